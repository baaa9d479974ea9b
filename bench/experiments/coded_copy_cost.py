"""What a coded expert copy costs the thread that issues it, beside a raw copy, over the real link
(issue 24). The first GPU run (2026-12-04, H200) saw specter's draft time double with a coded store
(inferred: ~140 us more per coded expert copied, each copy then five host-to-device copies a
tensor and a decode launch). Then a CUDA store laid each coded tensor out expert-major: a copy was
one copy of the expert's row, one of its escape run and one launch a tensor; now a layer's two
tensors are laid out together (lossless.layer_major), each expert's record its rows of both then its
escape runs: one copy and one launch (`coded`), the per-tensor path beside it (`coded_unpaired`, the
same store), and the kernel reading the page-locked arena in place,
no staging copy (`coded_in_place`, the engine's with SPECTER_CODED_IN_PLACE=1; a line of its own a
shape, after all the others). This measures what is left. `tier_hit`: a hit of the compressed device
tier (offload/coded_tier.py, opt-in on CUDA): the pair kernel decoding bytes already on the device into
the slots, no host-to-device copy, through the same link call, so that its issue_us beside raw's says
whether a hit is cheaper for the issuing thread than the copy it replaces. `tier_batch`: a layer call's
--batch hits as the engine issues them, one link call and one launch of the batch kernel
(lossless.decode_staged_pairs); its figures are per expert. `raw_batch` / `coded_batch`: a coalesced
copy of --batch experts over the link (a layer call's misses), per expert: coded, each expert staged
and all of them decoded in one launch of the batch kernel.

    python bench/experiments/coded_copy_cost.py [--copies 64] [--launches jit]
                                                                    # CUDA: through CudaLink
    TRITON_INTERPRET=1 python bench/experiments/coded_copy_cost.py --device cpu --shapes small --copies 2
                                                                    # the same code on CPU (a smoke run)
    python bench/experiments/coded_copy_cost.py --device meta --copies 2000 [--launches stub]
                                                                    # the host's Python and dispatch alone

--device meta: the slots on the meta device (no byte moves) and the decode launch stubbed, the
copies run on the calling thread: what issuing a copy costs in Python and torch's dispatcher before
any CUDA call's own cost (a CPU figure; it also runs on commits before the layout, whose coded store
encode_store made without `cuda`). `--launches noop` (the default, as before): the decode kernels
swapped for objects whose launch does nothing; `stub`: Triton's own launch path, on a stub driver
that compiles for sm_90 and whose compiled launcher does nothing (aot.stub_driver), the decode
launches as the engine makes them (launch.py's direct launches); `jit`: the same, every launch
through Triton's JIT (`kernel[grid]`, the engine before launch.py).

Per expert shape (the bundled model's, Qwen3-30B-A3B's, DeepSeek-V2-Lite's, Mixtral-8x7B's; two
experts of random normal weights at 0.02, the stores pinned as a CUDA load pins them), raw, coded and
coded_unpaired:
  bytes     what one expert copy (w13 and w2) moves
  issue_us  perf_counter per link.copy, the copies issued back to back on the urgent stream (the
            issuing thread's cost: on a small expert it can exceed the copy itself)
  copy_us   wall time per copy over the whole batch, waited for at the end (the link's cost)
  gated_issue_us  (CUDA) issue_us with every copy held on the GPU behind a sleeping kernel: no copy
            lands, no link thread wakes while they are issued (issue_us above it: time lost to them)
  exact     the slots hold the last expert's bits
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

SHAPES = {"bundled": (256, 192), "qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408),
          "mixtral-8x7b": (4096, 14336)}  # (hidden, expert intermediate)
SMOKE = {"small": (64, 48)}  # a smoke run under the interpreter: seconds where bundled's takes minutes


class Direct:
    """CPU, meta: each copy run at once on the calling thread (what CudaLink enqueues, without a stream)."""

    def copy(self, dsts, srcs, **_):
        if hasattr(srcs[0], "decode_all_on"):
            srcs[0].decode_all_on(dsts, srcs)
            return self
        for d, s in zip(dsts, srcs):
            s.decode_on(d) if hasattr(s, "decode_on") else d.copy_(s)
        return self

    def wait(self):
        return None

    def close(self):
        return None


def stores(H: int, I: int, device: torch.device):
    """(raw, coded) stores of two experts, as lists of (w13, w2) copy sources, pinned on CUDA."""
    import inspect

    from specter.moe import ExpertWeights
    from specter.offload import coded as coded_mod
    from specter.offload.store import page_aligned, pin_in_place
    from specter.triton_ops.lossless import encode

    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(2, 2 * I, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(2, H, I, generator=g) * 0.02).bfloat16()
    cuda = device.type == "cuda"
    raw = []
    for w in (w13, w2):
        host = page_aligned(w.numel(), torch.bfloat16).view(w.shape).copy_(w)
        if cuda:
            pin_in_place(host)
        raw.append(host)
    if cuda:  # coded on the device (the host's encode is slow at Mixtral's size), laid out and pinned as a load does
        coded = coded_mod.for_cuda_layer(*(encode(w.to(device)) for w in (w13, w2)), pin=True, refused=[])
    else:     # laid out as on CUDA where this commit has the layout
        lay_out = {"cuda": True} if "cuda" in inspect.signature(coded_mod.encode_store).parameters else {}
        coded = coded_mod.encode_store([ExpertWeights(w13.clone(), w2.clone())], **lay_out)[0]
    return ExpertWeights(*raw), coded, (w13, w2)


def stub_the_decode_launch(launches: str) -> contextlib.AbstractContextManager:
    """--device meta: the decode kernels' launches do nothing. `noop`: the kernels swapped for objects
    whose launch does nothing (the launch code before it still runs); `stub`: Triton's own launch path
    on a stub driver (aot.stub_driver: compiled for sm_90, the compiled launcher does nothing): Triton's
    own host cost a launch, short of the driver's launch call itself; `jit`: the same with every
    launch through Triton's JIT (`kernel[grid]`), as before launch.py. -> the context to run in."""
    import os

    from specter.triton_ops import aot, lossless
    from specter.triton_ops.launch import through_the_jit

    lossless.LAUNCHES_ON_CPU = True
    os.environ["TRITON_INTERPRET"] = "1"  # read at call time by commits whose decode_into checks it
    if launches != "noop":
        if launches == "jit":
            lossless.launch = through_the_jit
        return aot.stub_driver(90, record=False)

    class Noop:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    lossless._decode_kernel = Noop()
    lossless._decode_pair_kernel = Noop()
    lossless._decode_pairs_kernel = Noop()
    return contextlib.nullcontext()


def measure(link, slots, srcs, copies: int, device) -> tuple[float, float, float | None]:
    """(issue_us, copy_us, gated_issue_us) per copy of srcs[i % 2] into `slots`, issued back to back.
    gated (CUDA): the same copies issued while a sleeping kernel holds them all on the GPU, so no copy
    lands and no link thread wakes while they are issued: issue_us far above it is time the issuing
    thread lost to the link's threads (the GIL), not the copies' own host cost."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for t in [link.copy(slots, srcs[i % 2], urgent=True, after=None) for i in range(4)]:  # warm: allocator, kernel
        t.wait()
    sync()
    t0 = time.perf_counter()
    ts = [link.copy(slots, srcs[i % 2], urgent=True, after=None) for i in range(copies)]
    issued = time.perf_counter() - t0
    for t in ts:
        t.wait()
    sync()
    total = time.perf_counter() - t0
    gated = None
    if device.type == "cuda":
        torch.cuda._sleep(int(2e8))  # ~0.1 s at 2 GHz: longer than issuing the batch
        gate = link.read_event()
        t0 = time.perf_counter()
        ts, marks = [], []
        for i in range(copies):
            ts.append(link.copy(slots, srcs[i % 2], urgent=True, after=gate))
            marks.append(time.perf_counter())
        gated = (marks[-1] - t0) / copies * 1e6
        each = [round((b - a) * 1e6) for a, b in zip([t0] + marks, marks)]
        slowest = max(range(copies), key=each.__getitem__)
        print(f"gated: slowest copy() #{slowest} of {copies}, {each[slowest]} us; first five {each[:5]} us",
              file=sys.stderr, flush=True)
        for t in ts:
            t.wait()
        sync()
        if isinstance(srcs[0][0], torch.Tensor):  # raw: the same gated batch without the link
            bare_gated(slots, srcs, copies)
    return issued / copies * 1e6, total / copies * 1e6, gated


def bare_gated(slots, srcs, copies: int) -> None:
    """The gated batch as plain `copy_(non_blocking=True)` calls on a side stream, no CudaLink (no
    events, no threads): a batch as slow as the link's says the wait is in torch or the driver
    (e.g. a source the driver stages as pageable), a fast one that it is the link's."""
    stream = torch.cuda.Stream()
    torch.cuda._sleep(int(2e8))
    gate = torch.cuda.Event()
    gate.record()
    stream.wait_event(gate)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for i in range(copies):
            for d, s in zip(slots, srcs[i % 2]):
                d.copy_(s, non_blocking=True)
    bare = (time.perf_counter() - t0) / copies * 1e6
    pinned = [bool(s.is_pinned()) for s in srcs[0]]
    print(f"gated, bare copy_ on a side stream: {bare:.1f} us an expert; sources is_pinned() {pinned}",
          file=sys.stderr, flush=True)
    torch.cuda.synchronize()


def shape_row(name: str, kinds: tuple, link, copies: int, device, batch: int = 8) -> dict:
    """One shape's figures for each of `kinds` (raw, coded: the pair as the engine copies, coded_unpaired:
    the same store a tensor at a time, tier_hit: the pair decoded from its staged bytes kept on the
    device, coded_in_place: the pair read in place; an in-place failure is recorded as its error), and
    the coded/raw ratios where both ran."""
    from specter.offload.coded_tier import HeldExpert
    from specter.triton_ops.lossless import stage_pair

    H, I = {**SHAPES, **SMOKE}[name]
    raw, coded, (w13, w2) = stores(H, I, device)
    slots = [torch.empty(2 * I, H, dtype=torch.bfloat16, device=device),
             torch.empty(H, I, dtype=torch.bfloat16, device=device)]
    batch_slots = slots
    if any(k.endswith("_batch") for k in kinds):  # `batch` experts' slots, rows of a pool as the engine's
        pools = (torch.empty(batch, 2 * I, H, dtype=torch.bfloat16, device=device),
                 torch.empty(batch, H, I, dtype=torch.bfloat16, device=device))
        batch_slots = [p[j] for j in range(batch) for p in pools]
    out = {"shape": name, "hidden": H, "inter": I}
    copies = copies if device.type == "meta" else max(4, min(copies, int(8e9 // (w13[0].nbytes + w2[0].nbytes))))
    unpaired = type(coded)(coded.w13.packed, coded.w2.packed)  # the same store, each tensor alone
    sources = {"raw": raw, "coded": coded, "coded_unpaired": unpaired, "coded_in_place": coded}
    for kind in kinds:
        if kind == "coded_in_place":
            coded.w13.pair.with_tables(device).in_place = True
        n, dst = (batch, batch_slots) if kind.endswith("_batch") else (1, slots)
        if kind.startswith("tier_"):  # each expert's bytes staged on the device once, as a tier keeps them
            pair = coded.w13.pair
            bufs = [stage_pair(pair, e, device) for e in range(2)]
            held = [(HeldExpert(pair, e, bufs[e], True), HeldExpert(pair, e, bufs[e], False)) for e in range(2)]
            srcs = held if n == 1 else [tuple(h for j in range(n) for h in held[j % 2])] * 2  # experts 0, 1, 0, ..
        elif n > 1:  # a coalesced copy of n experts (a layer call's misses): 0, 1, 0, ...
            store = sources[kind.removesuffix("_batch")]
            srcs = [tuple(t for j in range(n) for t in (store.w13[j % 2], store.w2[j % 2]))] * 2
        else:
            srcs = [(sources[kind].w13[e], sources[kind].w2[e]) for e in range(2)]
        dst[0].fill_(float("nan"))
        try:
            issue, copy, gated = min((measure(link, dst, srcs, max(4, copies // n), device)
                                      for _ in range(3 if device.type == "meta" else 1)), key=lambda r: r[0])
        except Exception as e:  # noqa: BLE001 -- the in-place experiment may not run on a host: say why
            if kind != "coded_in_place":
                raise
            out[kind] = {"error": f"{type(e).__name__}: {e}"[:400]}
            continue
        last = (max(4, copies // n) - 1) % 2 if n == 1 else 0  # the expert in the first slots
        out[kind] = {"bytes": sum(s.nbytes for s in srcs[1]) // n, "issue_us": round(issue / n, 1),
                     "copy_us": round(copy / n, 1), "gated_issue_us": gated and round(gated / n, 1),
                     "exact": device.type == "meta" or all(
                         torch.equal(dst[2 * j].cpu(), w13[(last + j) % 2]) and torch.equal(dst[2 * j + 1].cpu(), w2[(last + j) % 2])
                         for j in range(n))}
    out["copies"] = copies
    if "raw" in out and "coded" in out:
        out["coded_over_raw"] = {"bytes": round(out["coded"]["bytes"] / out["raw"]["bytes"], 3),
                                 "issue": round(out["coded"]["issue_us"] / out["raw"]["issue_us"], 2),
                                 "copy": round(out["coded"]["copy_us"] / out["raw"]["copy_us"], 2),
                                 "issue_unpaired": round(out["coded_unpaired"]["issue_us"] / out["raw"]["issue_us"], 2)}
    for tier in ("tier_hit", "tier_batch"):
        if "raw" in out and tier in out:
            out[f"{tier}_over_raw"] = {k: round(out[tier][k] / out["raw"][k], 2) for k in ("issue_us", "copy_us")}
    if "raw_batch" in out and "coded_batch" in out:
        out["coded_batch_over_raw_batch"] = {k: round(out["coded_batch"][k] / out["raw_batch"][k], 2)
                                             for k in ("issue_us", "copy_us")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copies", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="tier_batch's hits a call (a layer call's; a top-8 "
                                                           "model's verification reads more)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated, of {', '.join(SHAPES)} (or {', '.join(SMOKE)}: a smoke run)")
    ap.add_argument("--launches", choices=("noop", "stub", "jit"),
                    help="--device meta: the decode launches do nothing (noop, the default), go through Triton's "
                         "launch path on a stub driver as the engine launches (stub), or all through Triton's JIT "
                         "(jit); CUDA: jit sends the real launches through the JIT (the engine before launch.py)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "meta":
        args.launches = args.launches or "noop"
        with stub_the_decode_launch(args.launches):
            return run(args, device)
    if args.launches not in (None, "jit"):
        ap.error(f"--launches {args.launches} needs --device meta")
    if args.launches == "jit":
        from specter.triton_ops import lossless
        from specter.triton_ops.launch import through_the_jit
        lossless.launch = through_the_jit
    return run(args, device)


def run(args, device) -> int:
    if device.type == "cuda":
        from specter.offload.cuda_link import CudaLink
        link = CudaLink(device)
    else:
        link = Direct()
    try:
        raws = {}
        kinds = ("raw", "coded", "coded_unpaired", "tier_hit", "tier_batch", "raw_batch", "coded_batch")
        for name in args.shapes.split(","):  # then in place, every shape (a fault there on a GPU would not
            out = shape_row(name, kinds, link, args.copies, device, args.batch)  # lose these)
            out["launches"] = args.launches or "engine"
            raws[name] = out["raw"]
            print(json.dumps(out), flush=True)
        for name in args.shapes.split(","):
            out = shape_row(name, ("coded_in_place",), link, args.copies, device)
            if "issue_us" in out["coded_in_place"]:
                out["in_place_over_raw"] = {k: round(out["coded_in_place"][k] / raws[name][k], 2) for k in ("issue_us", "copy_us")}
            print(json.dumps(out), flush=True)
    finally:
        link.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
