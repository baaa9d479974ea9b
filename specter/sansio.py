"""One body, two drivers: the hot path's computations are written once, as generators (sans-IO).

A body is a generator that `yield`s each thing it must have before it can go on (an *op*) and is
sent back the op's result; its `return` value is the result of the whole computation. Ops:

    Transfer   (offload/link.py)  an expert copy that must have landed    -> seconds stalled
    HostRead   (here)             a small device tensor read on the host  -> its values, as lists
    Call       (here)             an expert provider's call on a layer    -> its output
    anything else a driver's `resolve` knows (the decoder's planning requests, `Emit`)

    drive(body)          blocking:  op.wait()           (today's synchronous engine)
    await adrive(body)   asyncio:   await op.landed()   (the loop is free while a copy is in flight),
                                    or op.wait() when op.ready() says it would not block
    iterate / aiterate   the same for a body that also yields `Emit(value)`s to its consumer

An error a driver meets resolving an op is thrown into the body at its `yield`, so the body sees it
exactly where the synchronous code would have. Bodies nest: the model's forward yields a `Call` per
MoE layer, which the async driver resolves by driving the offload manager's own body.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import Any, AsyncIterator, Callable, Iterator

import torch


class HostRead:
    """Read a small device tensor on the host. Sync: `tolist()` (a host sync on CUDA). Async: on CUDA
    a non-blocking copy into pinned memory plus an event the loop polls; on CPU the values are there."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def wait(self) -> list:
        return self.t.tolist()

    def ready(self) -> bool:
        return not self.t.is_cuda

    async def landed(self) -> list:
        t = self.t
        if not t.is_cuda:
            return t.tolist()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        await poll(ev.query)
        return host.tolist()


class Emit:
    """An op a body yields to hand `value` out to whoever iterates the driver (`iterate`/`aiterate`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


async def poll(ready: Callable[[], bool], spin: float = 2e-3, every: float = 1e-3) -> None:
    """Until ready() (CUDA events are queried from the loop, never synchronised): for `spin` seconds
    give the loop a turn between checks (sleep(0): other tasks and I/O run), then sleep `every`
    between them. No finer sleep exists: epoll's timeout has 1 ms resolution, so asyncio.sleep(20e-6)
    sleeps a whole millisecond -- longer than a verification layer on a GPU."""
    if ready():
        return
    spin_until = time.perf_counter() + spin
    while not ready():
        await asyncio.sleep(0 if time.perf_counter() < spin_until else every)


class Call:
    """An expert provider's call on a layer's rows. Sync: `provider(...)` in the body's grad mode
    (inference / no_grad: the driver resolves it outside the body's own context). Async: `await
    provider.acall(...)` where it has one (the offload manager), else the plain call."""

    __slots__ = ("provider", "args", "inference", "grad")

    def __init__(self, provider, *args):
        self.provider, self.args = provider, args
        self.inference, self.grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def _mode(self):
        return torch.inference_mode() if self.inference else torch.set_grad_enabled(self.grad)

    def wait(self) -> torch.Tensor:
        with self._mode():
            return self.provider(*self.args)

    def ready(self) -> bool:
        return not hasattr(self.provider, "acall")

    async def landed(self) -> torch.Tensor:
        acall = getattr(self.provider, "acall", None)
        if acall is None:
            return self.wait()
        return await acall(*self.args)  # no mode held across an await: acall sets its own


def call(provider, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Generator:
    """`y = yield from call(experts, layer, x, ids, weights)`: the routed experts inside a body. A
    provider that cannot wait now (resident weights, the draft, an offload manager holding every
    expert: `may_wait` False or no `acall`) is called on the spot, in the body's own mode: an op
    yielded up a decoder's chain of bodies and back costs tens of microseconds a layer on a slow CPU,
    and buys nothing when there is nothing to wait for."""
    if getattr(provider, "acall", None) is None or not getattr(provider, "may_wait", True):
        return provider(layer, x, ids, weights)
    return (yield Call(provider, layer, x, ids, weights))


def wait(op) -> Any:
    return op.wait()


def landed(op):
    return op.landed()


def _never() -> bool:
    return False


def _advance(body: Generator, value, error: BaseException | None):
    return body.send(value) if error is None else body.throw(error)


def drive(body: Generator, resolve: Callable = wait) -> Any:
    """Run `body` to its end, resolving each op with `resolve(op)` (blocking); its return value."""
    result = []
    for value in iterate(body, resolve, result):
        raise TypeError(f"drive: the body emitted {value!r}; iterate() it instead")
    return result[0]


async def adrive(body: Generator, resolve: Callable = landed) -> Any:
    """`drive` on the running event loop: each op is awaited (`await resolve(op)`)."""
    result = []
    async for value in aiterate(body, resolve, result):
        raise TypeError(f"adrive: the body emitted {value!r}; aiterate() it instead")
    return result[0]


def iterate(body: Generator, resolve: Callable = wait, result: list | None = None) -> Iterator:
    """Run `body`, yielding each `Emit`'s value (the body resumes on the next `next()`); every other
    op goes to `resolve`. `result` gets the body's return value appended. Closing the iterator
    closes the body."""
    value, error = None, None
    try:
        while True:
            try:
                op = _advance(body, value, error)
            except StopIteration as stop:
                if result is not None:
                    result.append(stop.value)
                return
            try:
                if isinstance(op, Emit):
                    yield op.value
                    value, error = None, None
                else:
                    value, error = resolve(op), None
            except GeneratorExit:
                raise
            except BaseException as e:  # thrown into the body where it waited
                value, error = None, e
    finally:
        body.close()


async def aiterate(body: Generator, resolve: Callable = landed, result: list | None = None) -> AsyncIterator:
    """`iterate` on the running event loop (an async generator; `aclose()` closes the body): each
    op is awaited (`await resolve(op)`), the loop free meanwhile -- except an op whose `ready()`
    says `wait()` would not block now, which is resolved by `wait()` (a coroutine costs microseconds
    and a layer has several ops)."""
    value, error = None, None
    try:
        while True:
            try:
                op = _advance(body, value, error)
            except StopIteration as stop:
                if result is not None:
                    result.append(stop.value)
                return
            try:
                if isinstance(op, Emit):
                    yield op.value
                    value, error = None, None
                elif getattr(op, "ready", _never)():  # wait() would not block: no coroutine needed
                    value, error = op.wait(), None
                else:
                    value, error = await resolve(op), None
            except GeneratorExit:
                raise
            except BaseException as e:
                value, error = None, e
    finally:
        body.close()


def blocking(agen) -> Iterator:
    """An async generator iterated from blocking code, on an event loop of this thread's own (the
    blocking API over the async driver); closing the iterator closes the generator on that loop."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                item = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        try:
            loop.run_until_complete(agen.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
