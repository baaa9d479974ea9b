"""Ahead-of-time compiles of the kernels fused_moe launches, for NVIDIA targets, on any machine.

The interpreter (TRITON_INTERPRET=1) runs a kernel as Python, so it accepts code compiled Triton
rejects and says nothing of registers, spills, shared memory or load widths. This module compiles
the very launches the engine makes, without a GPU (the Triton wheel ships ptxas):

    with recording() as launches:            every @triton.jit kernel of kernels.py swapped for a
        moe_rows_triton(...)                 recorder: the launch code runs on CPU stand-in
                                             tensors of real shapes (untouched memory), nothing runs
    compile_launch(launch, cc)               Triton's own binder specializes the arguments as a
                                             launch on that target would (divisibility by 16,
                                             pointer alignment, constexprs), then triton.compile
    inspect(kernel)                          registers and spills (ptxas -v), shared memory, and
                                             the global loads in the PTX by kind and width

`python -m specter.triton_ops.aot` prints the table for the shapes of MODELS. `lossless_launches()`
records lossless.py's decode kernel the same way (one expert of each shape into a slot).

    with stub_driver(cc) as calls:           Triton's own launch path, JIT and all, on CPU tensors:
        kernel[grid](...)                    it compiles for `cc`, and each launch's arguments, as
                                             the compiled launcher receives them, are recorded
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import triton

from . import kernels, lossless
from .int4 import WIDTHS, QuantExperts, group_size_for
from .launch import forget as forget_launches

TARGETS = {80: "A100", 89: "L4 / RTX 4090", 90: "H100 / H200"}
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # bytes a block may hold

# (H, I, routed experts, top-k) of the routed experts of the models the engine is made for
MODELS = {
    "Mixtral-8x7B": (4096, 14336, 8, 2),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "bundled": (256, 192, 16, 2),
}
KERNELS = ("_align_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel")


@dataclass
class Launch:
    kernel: object   # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, fn, log: list[Launch]):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(Launch(self.fn, grid, args, kwargs))


@contextmanager
def recording(module=kernels, names=KERNELS):
    """Kernel launches of `module` (kernels.py) inside the block are recorded (in order), not run."""
    log: list[Launch] = []
    saved = {name: getattr(module, name) for name in names}
    launches_on_cpu = module.LAUNCHES_ON_CPU
    try:
        for name, fn in saved.items():
            setattr(module, name, _Recorder(fn, log))
        module.LAUNCHES_ON_CPU = True
        yield log
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        module.LAUNCHES_ON_CPU = launches_on_cpu


def stand_in_lossless(E: int, N: int, K: int, bits: int) -> lossless.LosslessExperts:
    """A LosslessExperts of [E, N, K] bf16 weights at code width `bits`, in untouched memory (an
    escape run of 4 bytes an expert: the kernel's arguments are the same for any count)."""
    P = -(-N * K // 32) * 32
    return lossless.LosslessExperts((E, N, K), torch.empty(E, P, dtype=torch.uint8),
                                    torch.empty(E, bits, P // 32, dtype=torch.int32),
                                    torch.empty(E, 1 << bits, dtype=torch.int32),
                                    torch.empty(E, -(-P // lossless.BLOCK), dtype=torch.int32),
                                    torch.empty(4 * E, dtype=torch.uint8), torch.arange(0, 4 * E + 1, 4))


def lossless_launches(models=MODELS, widths=lossless.WIDTHS) -> list[Launch]:
    """Every distinct launch of the lossless decode kernels for these models' w13 and w2, at each
    code width: one expert decoded into a bf16 slot, from a copy's staging buffer (CudaLink) and from
    a whole coded tensor on the device (decode_into); and both of an expert's tensors from a pair's
    staging buffer (CudaLink's copy of a layer laid out together) and in place from its arena, each
    width on each side (w13's width, then w2's: each one of `widths` in turn)."""
    seen, out = set(), []
    for H, I, _, _ in models.values():
        log = []
        for (N, K), bits in ((nk, b) for nk in ((2 * I, H), (H, I)) for b in widths):
            packed = stand_in_lossless(2, N, K, bits)
            staged = torch.empty(lossless.row_layout(packed)[1] + 4, dtype=torch.uint8)  # a copy's (coded.py)
            with recording(lossless, ("_decode_kernel",)) as more:
                lossless.decode_staged(packed, staged, torch.empty(N, K, dtype=torch.bfloat16))
                lossless.decode_triton(packed, 1, torch.empty(N, K, dtype=torch.bfloat16))
            log += more
        for ba, bb in zip(widths, widths[1:] + widths[:1]):
            a, b = stand_in_lossless(2, 2 * I, H, ba), stand_in_lossless(2, H, I, bb)
            rows = sum(lossless.row_layout(p)[1] for p in (a, b))
            arena = torch.empty(2 * rows + 16, dtype=torch.uint8)  # two rows, then 4-byte runs: a's, b's
            a, b = (replace(p, run_at=(2 * rows + at, 2 * rows + at + 4)) for p, at in ((a, 0), (b, 8)))
            pair = lossless.CodedPair(a, b, arena[:2 * rows].view(2, rows), arena.view(torch.int32),
                                      torch.empty(2, (1 << ba) + (1 << bb), dtype=torch.int32))
            staged = [torch.empty(rows + 8, dtype=torch.uint8) for _ in range(2)]
            slots = torch.empty(2, 2 * I, H, dtype=torch.bfloat16), torch.empty(2, H, I, dtype=torch.bfloat16)
            with recording(lossless, ("_decode_pair_kernel", "_decode_pairs_kernel")) as more:
                lossless.decode_staged_pair(pair, 1, staged[0], slots[0][0], slots[1][0])
                lossless.decode_pair_in_place(pair, 1, slots[0][0], slots[1][0])
                lossless.decode_staged_pairs(pair, [(e, staged[e], slots[0][e], slots[1][e]) for e in (0, 1)])
            log += more
        for launch in log:
            key = _key(launch, 90)
            if key not in seen:
                seen.add(key)
                out.append(launch)
    return out


def stand_in_experts(R: int, H: int, I: int, dtype: torch.dtype, int4, group_size: int = 128):
    """(w13 [R, 2I, H], w2 [R, H, I]) of the real sizes, dense or QuantExperts (int4: True or 4, 3, 2
    bits), in untouched memory."""
    if not int4:
        return torch.empty(R, 2 * I, H, dtype=dtype), torch.empty(R, H, I, dtype=dtype)
    bits = 4 if int4 is True else int4

    def packed(N, K):
        g = group_size_for(K, group_size)
        return QuantExperts(torch.empty(R, N, K * bits // 32, dtype=torch.int32),
                            torch.empty(R, K // g, N, dtype=dtype), torch.empty(R, K // g, N, dtype=dtype), bits)
    return packed(2 * I, H), packed(H, I)


def record_moe(H: int, I: int, E: int, k: int, T: int, dtype: torch.dtype, int4, slots: int | None):
    """The launches of one fused MoE call (expert rows, then their combine) over E experts, or over
    `slots` weight rows of a slot pool through a remap row when slots is given; int4: False (dense),
    True (4 bits) or the code width."""
    R = slots or E
    w13, w2 = stand_in_experts(R, H, I, dtype, int4)
    x = torch.empty(T, H, dtype=dtype)
    ids = torch.randint(0, E, (T, k))
    weights = torch.empty(T, k, dtype=dtype)
    remap = torch.full((E,), -1, dtype=torch.int32) if slots else None
    with recording() as log:
        rows = kernels.moe_rows_triton(x, ids, weights, w13, w2, remap)
        kernels.combine_triton(rows)
    return log


def _key(launch: Launch, cc: int):
    """What makes a compile distinct: the binder's specialization of every argument."""
    return launch.kernel.fn.__name__, cc, repr(_bind(launch, cc)[1:])


def _bind(launch: Launch, cc: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return target, signature, constexprs, attrs, options


_compiled: dict = {}


def compile_launch(launch: Launch, cc: int):
    """The CompiledKernel a launch with these arguments builds on compute capability `cc` (cached
    per specialization, so equal signatures compile once)."""
    key = _key(launch, cc)
    if key not in _compiled:
        from triton.compiler import ASTSource

        target, signature, constexprs, attrs, options = _bind(launch, cc)
        src = ASTSource(launch.kernel, signature, constexprs, attrs)
        _compiled[key] = triton.compile(src, target=target, options=options.__dict__)
    return _compiled[key]


STUB_DEVICE = 1000  # the device index a stub driver reports: no machine's, so its kernels never mix with a GPU's


@dataclass
class StubCall:
    kernel: str
    grid: tuple[int, int, int]
    stream: int
    function: int    # one number a compiled kernel loaded: equal when the same compiled kernel ran
    args: tuple      # what the launcher received after the function: metadata, two hooks, the arguments


@contextmanager
def stub_driver(cc: int = 90, record: bool = True):
    """Triton's active driver, inside the block, is one that compiles for compute capability `cc` (no
    GPU: ptxas) and records each launch the compiled launcher is handed (StubCall), running nothing
    (`record=False`: nothing kept, for timing the host's side of launches).
    Its device is STUB_DEVICE: on exit every kernel it compiled forgets that device's cache, and
    launch.py its kept kernels, so nothing of the stub outlives the block (a GPU machine's tests run
    in the same process)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    calls: list[StubCall] = []
    touched: set = set()
    loaded: list[int] = []

    class Launcher:
        def __init__(self, src, metadata):
            self.name = src.fn.__name__
            touched.add(src.fn)

        def __call__(self, gx, gy, gz, stream, function, *args):
            enter, leave = args[2:4]                      # after the packed and the launch metadata
            if enter is not None:                         # as the compiled launcher does
                enter(args[1])
            if record:
                calls.append(StubCall(self.name, (gx, gy, gz), stream, function, args))
            if leave is not None:
                leave(args[1])

    class Utils:
        def load_binary(self, name, kernel, shared, device):
            loaded.append(len(loaded) + 1)
            return object(), loaded[-1], 64, 0, 1024        # module, function, registers, spills, max threads

        def get_device_properties(self, device):
            return {"max_shared_mem": SHARED_LIMIT[cc], "multiprocessor_count": 132}

        def unload_module(self, module):
            pass

    class Stub:
        utils, launcher_cls = Utils(), Launcher

        def get_current_device(self):
            return STUB_DEVICE

        def get_current_stream(self, device):
            return 7

        def get_current_target(self):
            return GPUTarget("cuda", cc, 32)

    saved = driver._active              # None until first asked (asking would raise on a machine without a GPU)
    driver.set_active(Stub())
    forget_launches()
    try:
        yield calls
    finally:
        driver._active = saved
        forget_launches()
        for fn in touched:
            for kernel in fn.device_caches.pop(STUB_DEVICE, ({},))[0].values():
                kernel.module = None                # else its __del__ unloads a stub module through the real driver


@dataclass
class Report:
    kernel: str
    cc: int
    registers: int
    spill_bytes: int           # spill stores + spill loads
    shared_bytes: int
    loads: dict = field(default_factory=dict)  # kind -> count: "cp.async.16", "ld.v4.b32", "ld.u8", ...
    tile_loads: list = field(default_factory=list)  # (how, bytes a thread) of each [rows, cols] 2-D tile load
    signature: str = ""

    def weight_load_bytes(self, shapes) -> list[int]:
        """Bytes a thread of each load of a tile whose (rows, cols, element) is in `shapes`."""
        return [nbytes for shape, how, nbytes in self.tile_loads if shape in shapes]

    @property
    def byte_loads(self) -> int:
        return sum(n for kind, n in self.loads.items() if kind.startswith("ld") and kind.rsplit(".", 1)[-1][1:] == "8")

    @property
    def wide_loads(self) -> int:
        """Loads of 8 or more bytes a thread: vector ld.global, or cp.async of 8 / 16 bytes."""
        wide = 0
        for kind, n in self.loads.items():
            if kind.startswith("cp.async."):
                wide += n if int(kind.rsplit(".", 1)[1]) >= 8 else 0
            elif ".v" in kind:
                v, width = re.search(r"\.v(\d)\.[a-z]+(\d+)$", kind).groups()
                wide += n if int(v) * int(width) >= 64 else 0
        return wide


_LD = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global((?:\.[a-z0-9:]+)*)\s")
_CP = re.compile(r"^\s*(?:@%p\d+\s+)?cp\.async\.(?:ca|cg)\.shared\.global(?:\.[a-z0-9:]+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-f]+|\d+)")


def load_kinds(ptx: str) -> dict[str, int]:
    """Global loads of a PTX listing by kind: 'ld.v4.b32' (vector width and element), 'ld.u8', or
    'cp.async.16' (bytes a thread), cache hints left out."""
    kinds: dict[str, int] = {}
    for line in ptx.splitlines():
        if m := _LD.match(line):
            parts = [p for p in m.group(1).split(".") if p and not p.startswith(("nc", "L1", "L2", "ca", "cg", "cs",
                                                                                 "lu", "cv", "global", "relaxed",
                                                                                 "acquire", "gpu", "sys", "cta"))]
            kind = "ld." + ".".join(parts)
        elif m := _CP.match(line):
            kind = f"cp.async.{int(m.group(1), 0)}"
        else:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


_LAYOUT = re.compile(r"^#(\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*order = \[([\d, ]+)\]")
_TILE_LOAD = re.compile(r"= (ttg\.async_copy_global_to_local|tt\.load) .*?(?:contiguity = (\d+) : i32\}.*?)?"
                        r": tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>, "
                        r"(?:#ttg\.slice<\{dim = (\d+), parent = #(\w+)\}>|#(\w+))>")
_ELEM_BYTES = {"i8": 1, "u8": 1, "i16": 2, "bf16": 2, "f16": 2, "i32": 4, "f32": 4, "i64": 8}


def tile_loads(ttgir: str) -> list[tuple[tuple[int, int, str], str, int]]:
    """2-D tile loads of a TTGIR listing: ((rows, cols, element), op, bytes a thread), the bytes being
    the elements a thread reads contiguously (its layout's sizePerThread along the fastest axis,
    capped by the contiguity Triton proved for an async copy). A tile in a slice of a 3-D blocked
    layout (a 3-bit tile's 1-bit plane, [32, 2] words, can be one) takes its parent's sizes and
    order without the sliced dimension."""
    layouts = {}
    for line in ttgir.splitlines():
        if m := _LAYOUT.match(line):
            layouts[m.group(1)] = ([int(v) for v in m.group(2).split(",")], [int(v) for v in m.group(3).split(",")])
    out = []
    for line in ttgir.splitlines():
        if not (m := _TILE_LOAD.search(line)):
            continue
        op, contiguity, rows, cols, elem, dim, parent, layout = m.groups()
        if (layout or parent) not in layouts:
            continue
        size, order = layouts[layout or parent]
        if parent is not None:  # drop the sliced dimension
            d = int(dim)
            size = [v for i, v in enumerate(size) if i != d]
            order = [o - (o > d) for o in order if o != d]
        n = size[order[0]] if contiguity is None else min(size[order[0]], int(contiguity))
        out.append(((int(rows), int(cols), elem), op.split(".")[-1], n * _ELEM_BYTES[elem]))
    return out


def _ptxas_usage(ptx: str, cc: int) -> tuple[int, int]:
    """(registers, spill bytes) from ptxas -v on the kernel's own PTX, for the PTX's own target, with
    the ptxas Triton itself uses for that target."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={arch}", str(src), "-o",
                              str(Path(d) / "k.cubin")], capture_output=True, text=True, check=True)
    out = res.stdout + res.stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return regs, spills


def inspect(launch: Launch, cc: int) -> Report:
    k = compile_launch(launch, cc)
    ptx = k.asm["ptx"]
    regs, spills = _ptxas_usage(ptx, cc)
    _, signature, constexprs, _, _ = _bind(launch, cc)
    flags = ",".join(f"{n}={v}" for n, v in launch.kwargs.items() if n in ("GROUP_TILE", "HAS_REMAP", "BITS") and v)
    return Report(launch.kernel.fn.__name__.strip("_"), cc, regs, spills, k.metadata.shared, load_kinds(ptx),
                  tile_loads(k.asm["ttgir"]), f"{signature.get('x_ptr') or signature.get('rows_ptr') or signature.get('ids_ptr') or signature.get('signman_ptr')} {flags}")


def engine_launches(models=MODELS, widths=(1, 8, 33), dtypes=(torch.bfloat16, torch.float16), bits=WIDTHS):
    """Every distinct launch fused_moe makes for these models: dense experts in each dtype and
    quantized experts at each code width of `bits` (the draft, scales in the first dtype), over all
    experts and over a slot pool (a quarter of the experts, remap row), at each T, with each model's
    top-k and top-1."""
    seen, out = set(), []
    for name, (H, I, E, k) in models.items():
        cases = [(dt, False) for dt in dtypes] + [(dtypes[0], b) for b in bits]
        for (dtype, int4), slots, T, topk in ((c, s, t, kk) for c in cases for s in (None, max(k, E // 4))
                                              for t in widths for kk in sorted({1, k})):
            for launch in record_moe(H, I, E, topk, T, dtype, int4, slots):
                key = _key(launch, 90)
                if key not in seen:
                    seen.add(key)
                    out.append(launch)
    return out


def variant(launch: Launch) -> str:
    """A launch's kind in words: weights (dense dtype or INT4), remap row, masked K tiles."""
    kw, name = launch.kwargs, launch.kernel.fn.__name__
    if name == "_align_kernel":
        return "remap row" if kw["HAS_REMAP"] else "all experts"
    if name == "_combine_kernel":
        return str(launch.args[0].dtype).removeprefix("torch.")
    if name == "_decode_kernel":
        return f"lossless {kw['BITS']}-bit codes"
    if name in ("_decode_pair_kernel", "_decode_pairs_kernel"):
        batch = ", a batch" if name == "_decode_pairs_kernel" else ""
        return f"lossless pair{batch}, {kw['A_BITS']}- and {kw['B_BITS']}-bit codes"
    x = launch.args[0]
    words = (f"INT{kw['BITS']}" + (" group-tile" if kw["GROUP_TILE"] else "") if kw["BITS"]
             else str(x.dtype).removeprefix("torch."))
    return words + ("" if kw["EVEN_K"] else " masked-K")


def weight_tiles(launch: Launch, elem: str | None = None) -> set:
    """(rows, cols, element) of the weight tiles an expert kernel's launch loads: [BLOCK_N, BLOCK_K]
    of a dense dtype (`elem`, or any), or one [BLOCK_N, BLOCK_K * width / 32] int32 tile a plane."""
    kw = launch.kwargs
    if kw["BITS"]:
        planes = {4: (4,), 3: (2, 1), 2: (2,)}[kw["BITS"]]
        return {(kw["BLOCK_N"], kw["BLOCK_K"] * p // 32, "i32") for p in planes}
    return {(kw["BLOCK_N"], kw["BLOCK_K"], e) for e in ([elem] if elem else ("bf16", "f16", "f32"))}


def table(launches) -> list[dict]:
    """One row per (kernel, variant, target): most registers, spill bytes and shared memory over
    its specializations, every global load kind, and the narrowest weight-tile load."""
    rows: dict = {}
    for launch in launches:
        for cc in TARGETS:
            r = inspect(launch, cc)
            row = rows.setdefault((r.kernel, variant(launch), cc), dict(
                kernel=r.kernel, variant=variant(launch), target=f"sm_{cc}", specializations=0, registers=0,
                spill_bytes=0, shared_kib=0.0, loads=set(), weight_load_bytes=None))
            row["specializations"] += 1
            row["registers"] = max(row["registers"], r.registers)
            row["spill_bytes"] = max(row["spill_bytes"], r.spill_bytes)
            row["shared_kib"] = max(row["shared_kib"], r.shared_bytes / 1024)
            row["loads"] |= set(r.loads)
            if r.kernel in ("gate_up_kernel", "down_kernel"):
                kw = launch.kwargs
                elem = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[launch.args[0].dtype]
                widths = r.weight_load_bytes(weight_tiles(launch, elem))
                if widths:
                    low = min(widths)
                    row["weight_load_bytes"] = low if row["weight_load_bytes"] is None else min(row["weight_load_bytes"], low)
    return [dict(row, loads=" ".join(sorted(row["loads"]))) for row in rows.values()]


def main() -> None:
    import time

    t0 = time.perf_counter()
    launches = engine_launches() + lossless_launches()
    print(f"{len(launches)} distinct specializations of {', '.join(MODELS)} experts (and their lossless decode), compiled for "
          f"sm_{', sm_'.join(map(str, TARGETS))} with triton {triton.__version__}")
    print("| kernel | variant | target | specializations | registers | spill bytes | shared KiB | global loads "
          "| weight tile bytes a thread |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table(launches):
        w = row["weight_load_bytes"]
        print(f"| {row['kernel'].removesuffix('_kernel')} | {row['variant']} | {row['target']} | "
              f"{row['specializations']} | {row['registers']} | {row['spill_bytes']} | {row['shared_kib']:.1f} | "
              f"{row['loads']} | {'' if w is None else w} |")
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
