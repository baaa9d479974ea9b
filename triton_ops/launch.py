"""A Triton kernel launched without the JIT's work on every launch.

`kernel[grid](*args, **constexprs)` binds every argument anew each time: each tensor's dtype and
16-byte alignment, each integer's specialization, the cache key built from all of them and the
options, a lookup, then launch metadata for the launch hooks (empty unless a profiler set one).
That is host time on every eager launch: a decode launch a coded copy, on the thread that issues
copies, and four a fused MoE call (what it costs: docs/RESULTS.md; `--launches jit|stub` of
bench/experiments/coded_copy_cost.py and moe_host_cost.py time both on a stub driver).

`launch(kernel, grid, *args, **constexprs)` launches the same thing. The first launch of a
specialization goes through the JIT, which compiles or finds the kernel and returns it; later ones
hand the same arguments straight to that compiled kernel's launcher. A specialization is what
Triton's binder specializes on, read off each launch more cheaply than it does: the device, each
tensor's dtype and 16-byte alignment, each positional integer's value (a `do_not_specialize` one's
only whether it is an i32), and the named arguments (constexprs and options such as num_warps) with
their values. Anything else positional (a float, None, a bool) is refused. Triton's process-wide
knobs (debug, instrumentation) are read at a specialization's first launch only. With a launch hook
set (a profiler), or a kernel that is not a JITFunction (TRITON_INTERPRET=1's, aot.py's recorder),
every launch goes through `kernel[grid]`.

Both paths name `enable_fp_fusion=FP_FUSION` unless the caller does: a float multiply and add may compile to one
fused multiply-add (one rounding instead of two). Triton 3.9 leaves that to TRITON_DEFAULT_FP_FUSION, default on,
and Triton 3.10 turns the default off; named here, the kernels' rounding is the same under every Triton and
environment. (The lossless decode kernels are integer-only; the fused MoE kernels' epilogues are float.)
tests/test_launch.py records both paths' launches on a stub driver and finds them identical.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_specialized: dict[int, tuple[list[str], list[bool]]] = {}  # id(kernel) -> (its parameters, which Triton specializes)
# (id(kernel), device, signature, named) -> (launcher, function, metadata, tail, the CompiledKernel: held, so that
# the module its function lives in is never unloaded under us: Triton 3.9 unloads it when the kernel is freed)
_compiled: dict[tuple, tuple] = {}
FP_FUSION = True  # what every launch compiles with (module docstring); Triton <= 3.9's default, so no numbers moved


def launch(kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    """kernel[grid](*args, **constexprs), straight to the compiled kernel once this specialization ran."""
    constexprs.setdefault("enable_fp_fusion", FP_FUSION)
    if not isinstance(kernel, JITFunction) or not _hooks_idle():
        kernel[grid](*args, **constexprs)
        return
    device = driver.active.get_current_device()
    full = (id(kernel), device, _signature(kernel, args), tuple(constexprs.items()))
    hit = _compiled.get(full)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if hit is None:
        _compiled[full] = _first(kernel, grid, args, constexprs)
        return
    run, function, metadata, tail, _ = hit
    run(*grid, driver.active.get_current_stream(device), function, metadata, None, None, None, *args, *tail)


def through_the_jit(kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    """launch() as Triton's JIT makes every launch: the reference tests and experiments compare it with."""
    constexprs.setdefault("enable_fp_fusion", FP_FUSION)
    kernel[grid](*args, **constexprs)


def forget() -> None:
    """Drops every kept kernel (tests that swap Triton's driver)."""
    _compiled.clear()


def _hooks_idle() -> bool:
    """No launch hook would run: each is None or an empty HookChain (Triton >= 3.4)."""
    runtime = knobs.runtime
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def _signature(kernel: JITFunction, args) -> tuple:
    """What Triton specializes a launch's positional arguments on, as its binder does (jit.py): each
    tensor's dtype and whether its address is 16-byte aligned, each integer's value (a `do_not_specialize`
    one's: i32 or not)."""
    _, specialized = _specialized.get(id(kernel)) or _learn(kernel)
    sig = []
    for arg, spec in zip(args, specialized):
        if isinstance(arg, torch.Tensor):
            sig += (arg.dtype, not arg.data_ptr() & 15)
        elif type(arg) is int:
            sig.append(arg if spec or not -2 ** 31 <= arg < 2 ** 31 else None)
        else:
            raise TypeError(f"{kernel.__name__}: launch() takes tensors and ints positionally, "
                            f"not {type(arg).__name__}")
    return tuple(sig)


def _learn(kernel: JITFunction) -> tuple[list[str], list[bool]]:
    _specialized[id(kernel)] = ([p.name for p in kernel.params],
                                [not p.do_not_specialize for p in kernel.params])
    return _specialized[id(kernel)]


def _first(kernel: JITFunction, grid, args, constexprs) -> tuple:
    """Launches through the JIT and keeps what a direct launch needs: the compiled kernel's launcher,
    its function and metadata, and the values of the parameters after `args` (passed by name)."""
    rest = _specialized[id(kernel)][0][len(args):]
    if missing := set(rest) - set(constexprs):
        raise TypeError(f"{kernel.__name__}: parameters {sorted(missing)} neither positional nor named")
    compiled = kernel[grid](*args, **constexprs)
    if hasattr(compiled, "result"):                      # an asynchronous compile (a Triton knob)
        compiled = compiled.result()
    return compiled.run, compiled.function, compiled.packed_metadata, tuple(constexprs[n] for n in rest), compiled
