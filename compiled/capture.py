"""Capture safety, checked without a GPU.

`capture_check_backend(found)`: a torch.compile backend that lowers each graph to ATen (AOT
autograd, as Inductor sees it), records every op a CUDA graph cannot hold, then runs the graph
eagerly. On CPU `mode="reduce-overhead"` silently skips CUDA graphs, so this is how CI learns that
a step would not capture:

    aten._local_scalar_dense   .item() / int() / bool() inside the graph: a host sync
    aten._assert_scalar        a runtime check on a data-dependent value: a host sync
    aten.nonzero, masked_select ... outputs whose shape depends on data: a host sync
    aten.multinomial           RNG that reads back (and is not capturable)
    device copies              _to_copy / copy_ between devices inside the graph
    CPU ops                    a node on another device than the graph's inputs (a CPU op in a CUDA graph)

`static_inputs_backend(inputs)`: records every tensor input of each graph Dynamo hands the backend
with its size and whether it is static. Under CUDA graphs (cudagraph trees) every input that is not
static is copied into the graph's own buffer before each replay; a tensor reached through plain
Python objects (not a module's parameter or buffer) is such an input unless marked with
`torch._dynamo.mark_static_address`. `copied_inputs(inputs, limit)` lists those above `limit` bytes.

`HostReads`: counts the host's reads of tensor values while it is active (item / int / float /
bool / tolist / cpu, and device-to-host copies): on CUDA each one is a sync that drains the GPU
queue. Reads of host mirrors through numpy (pinned memory, already landed) are not counted.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
UNSAFE = {aten._local_scalar_dense.default, aten._assert_scalar.default, aten.multinomial.default,
          aten.nonzero.default, aten.masked_select.default, aten.item.default,
          aten._assert_async.default, aten._assert_async.msg}


def unsafe_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of an ATen graph that a CUDA graph cannot hold, as 'op (why)' strings."""
    def device_of(node):
        v = node.meta.get("val")
        return v.device if isinstance(v, torch.Tensor) else None

    home = collections.Counter(d for n in gm.graph.nodes if n.op == "placeholder" and (d := device_of(n)))
    home = home.most_common(1)[0][0] if home else None
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if n.target in UNSAFE:
            found.append(f"{name} (host sync)")
        elif n.target in (aten._to_copy.default, aten.copy_.default, aten.copy.default):
            srcs = [device_of(a) for a in n.args if isinstance(a, torch.fx.Node)]
            dst = device_of(n)
            if dst is not None and any(s is not None and s != dst for s in srcs):
                found.append(f"{name} (device copy {srcs[-1]} -> {dst})")
        elif home is not None and (d := device_of(n)) is not None and d != home:
            found.append(f"{name} (runs on {d}, the graph on {home})")
    return found


def capture_check_backend(found: list[str], graphs: list | None = None):
    """A torch.compile backend: append each graph's unsafe ops to `found` (and the graph to
    `graphs`), then run it eagerly."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm: torch.fx.GraphModule, example_inputs):
        found.extend(unsafe_ops(gm))
        if graphs is not None:
            graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw)


class GraphInput(NamedTuple):
    graph: int          # which graph (the backend's call number)
    name: str           # Dynamo's placeholder name (l_self_experts_layers_0_w13: where it came from)
    nbytes: int         # at the example input's sizes
    static: str | None  # "guarded" / "unguarded" (parameters, buffers, marked tensors); None: copied per replay


def static_inputs_backend(inputs: list[GraphInput], inner=None):
    """A torch.compile backend: append each graph's tensor inputs to `inputs` (see GraphInput), then
    compile with `inner` (a backend; default: run the graph as traced)."""
    graphs = itertools.count()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        g = next(graphs)
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, ex in zip(nodes, example_inputs):
            if isinstance(ex, torch.Tensor):
                static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                inputs.append(GraphInput(g, node.name, ex.numel() * ex.element_size(), static))
        return gm.forward if inner is None else inner(gm, example_inputs)

    return backend


def copied_inputs(inputs: list[GraphInput], limit: int) -> list[GraphInput]:
    """The inputs a CUDA graph would copy before each replay (not static) of more than `limit` bytes."""
    return [i for i in inputs if i.static is None and i.nbytes > limit]


_copies = itertools.count(1)


def own_code(method):
    """`method` (bound) re-made on a copy of its code object, named apart (`_step_greedy#2`). Dynamo
    keys its compiled graphs and its recompile limit (8) on the code object, and its memory of
    which dims vary (automatic dynamic shapes) on the code's file, line and name, so every instance
    of a class that compiles its own methods (one per engine; tests build many models in one
    process) would otherwise share one cache, recompile against the others' guards, and see a
    model's constants (head counts) turned symbolic because another model had other ones."""
    import types

    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}#{next(_copies)}")
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__, own.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
    return types.MethodType(own, method.__self__)


_READS = {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__"}


class HostReads:
    """with HostReads() as r: ...; r.count -> host reads of tensor values (r.calls: which)."""

    def __init__(self):
        self.calls: list[str] = []
        state = self._state = {"in_read": False}  # a read already counted: its own d2h copy is not another
        self._fn, self._dispatch = _FnMode(self.calls, state), _D2HMode(self.calls, state)

    @property
    def count(self) -> int:
        return len(self.calls)

    @contextlib.contextmanager
    def paused(self):
        """Reads inside are not counted: for CPU stand-ins of device code that reads nothing on
        CUDA (the torch reference backend of fused_moe groups routing on the host)."""
        was, self._state["in_read"] = self._state["in_read"], True
        try:
            yield
        finally:
            self._state["in_read"] = was

    def __enter__(self):
        self._dispatch.__enter__()
        self._fn.__enter__()
        return self

    def __exit__(self, *exc):
        self._fn.__exit__(*exc)
        self._dispatch.__exit__(*exc)
        return False


class _FnMode(TorchFunctionMode):
    def __init__(self, calls, state):
        super().__init__()
        self.calls, self.state = calls, state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.state["in_read"] or not (name in _READS or (name == "to" and _to_host(args, kwargs))):
            return func(*args, **(kwargs or {}))
        self.calls.append(name)
        self.state["in_read"] = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.state["in_read"] = False


def _to_host(args, kwargs) -> bool:
    dev = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
    return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"


class _D2HMode(TorchDispatchMode):
    """Device-to-host copies that no Python-level read shows (CUDA only: CPU tensors never copy)."""

    def __init__(self, calls, state):
        super().__init__()
        self.calls, self.state = calls, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.state["in_read"] and func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst_cpu = (args[0].device.type == "cpu") if func is aten.copy_.default else \
                torch.device((kwargs or {}).get("device") or src.device).type == "cpu"
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_cpu:
                self.calls.append(f"d2h {func}")
        return func(*args, **(kwargs or {}))


class GraphRecordings:
    """The CUDA graphs a speculative decoder's compiled steps record before generating, per thread and
    KV cache. cudagraph trees keep graphs per thread and record one per static address set (recording
    one syncs the device), so a graph first met mid-generation would be recorded inside a timed cycle,
    and one recorded on the loading thread is never replayed by a server's engine thread. `record`
    runs each step's `warmup(cache=..., repeat=2)` once per thread and cache: a bounded number, each
    step's `recordings()` (the cache grows geometrically, from CACHE_MIN tokens). Nothing without graphs."""

    CACHE_MIN = 1024  # tokens: the smallest KV cache made while the steps run as CUDA graphs

    def __init__(self, device):
        self.device = torch.device(device)
        self.warmups: list[dict] = []   # one per thread and cache recorded
        self._warm = threading.local()  # .caches: numbers of the caches this thread recorded

    @staticmethod
    def needed(steps) -> bool:
        return any(s is not None and getattr(s, "graphs", False) for s in steps)

    def record(self, steps, cache, number: int) -> None:
        """Record every graph `steps` can replay on `cache` (the decoder's `number`th), on this thread."""
        steps = [s for s in steps if s is not None and getattr(s, "graphs", False)]
        warm = self._warm.__dict__.setdefault("caches", set())
        if not steps or number in warm:
            return
        before = (self._memory(), self._recorded())
        for step in steps:
            step.warmup(cache=cache, repeat=2)
        after = (self._memory(), self._recorded())
        warm.add(number)
        self.warmups.append(dict(
            thread=threading.current_thread().name, cache_len=cache.max_len,
            recordings=sum(s.recordings() for s in steps),  # the bound
            recorded=None if before[1] is None or after[1] is None else after[1] - before[1],  # counted (CUDA)
            bytes=None if before[0] is None else after[0] - before[0]))

    def summary(self) -> dict | None:
        """Over threads and caches: recordings (the steps' bound), recorded (counted in cudagraph
        trees, CUDA), device bytes the allocator took; None without any."""
        if not self.warmups:
            return None

        def total(key):
            return None if any(w[key] is None for w in self.warmups) else sum(w[key] for w in self.warmups)

        return dict(recordings=total("recordings"), recorded=total("recorded"), bytes=total("bytes"),
                    warmups=len(self.warmups), threads=len({w["thread"] for w in self.warmups}))

    def _memory(self) -> int | None:
        """Device memory the caching allocator holds (CUDA graphs' pools included); None off CUDA."""
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else None

    def _recorded(self) -> int | None:
        """CUDA graphs cudagraph trees hold for this thread (their nodes); None off CUDA or if unknown."""
        if self.device.type != "cuda":
            return None
        try:
            from torch._inductor import cudagraph_trees

            index = self.device.index
            mgr = cudagraph_trees.get_container(torch.cuda.current_device() if index is None else index).tree_manager
            if mgr is None:
                return 0
            todo, n = [node for nodes in mgr.roots.values() for node in nodes], 0
            while todo:
                node = todo.pop()
                n += 1
                todo.extend(c for cs in node.children.values() for c in cs)
            return n
        except Exception:  # noqa: BLE001 -- a private structure: report unknown rather than fail a generation
            return None
