"""The host lane: routed experts computed on the host, where the store already holds their weights.

    lane = make_host_lane(store, device, link, threads=None)   # HostLane; calibrated on CPU like the link
    job = lane.submit(layer, x, ids, weights, experts)         # the experts (store rows) it computes
    ...                                                        # the device computes its resident experts
    job.wait()  /  await job.landed()                          # seconds stalled; then job.rows [T, k, H]

Instead of copying a cold expert's bytes to the device (an expert's whole weight over PCIe), the
activations go to the host (a few KB) and the expert runs there (llama.cpp's --n-cpu-moe, Fiddler,
kTransformers). The lane computes `expert_rows` over the store's own tensors through a remap row,
so a job's rows are (token, top-k position) rows the device merges with its own (`merge_rows`) and
combines in the one fixed order: with the torch backend on CPU the bits are the emulated device's.

Threads: one dispatcher takes jobs in order; a job's experts are split over `threads` threads (the
dispatcher and threads - 1 pool workers), each running ATen on one intra-op thread; a thread's share
is an `expert_rows` call whose remap keeps only its experts, merged by row, so the split never
changes a bit. Weights are read in place (a store narrower than the compute dtype is converted an
expert at a time into each thread's reused buffer, as the torch backend does).

CPU (the emulated device): a job completes no earlier than its emulated time, `charge(job)`, from the
link profile's host slowed by the link's time scale (calibrate.emulated_host_params), so host time :
device time : copy time is the real machine's. CUDA (not yet run on a GPU; its calls go through a
CudaApi, so tests/test_host_lane.py runs this branch on a CPU with a fake one): inputs go to pinned
host buffers on the compute stream (an event the dispatcher waits on), the rows come back, in the
inputs' dtype, on the lane's own stream, and `wait()` makes the compute stream wait for that copy's event.
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from typing import Callable

import torch

from specter.triton_ops import expert_rows, merge_rows

from ..moe import ExpertWeights
from ..profiling import span
from .calibrate import HostParams, emulated_host_params
from .cuda_link import CudaApi
from .link import Transfer
from .threads import daemon


class HostJob(Transfer):
    """One layer's cold experts on the host: a Transfer whose bytes are the rows [T, k, H] the lane
    computes (`rows`, once waited for). Awaitable; `wait()` blocks for it and returns the seconds
    stalled (CUDA: once the rows' copy to the device is queued, a stream wait on its event)."""

    def __init__(self, layer: int, x, ids, weights, remap: torch.Tensor, experts: list[int], device):
        super().__init__((), (), tag=(layer, tuple(experts)))
        self.layer, self.experts = layer, experts   # experts: the store rows computed, in order
        self.x, self.ids, self.weights = x, ids, weights  # host tensors (CPU: the caller's own)
        self.remap = remap                          # [E] host int32: expert -> store row, -1 elsewhere
        self._device = device
        self.rows: torch.Tensor | None = None       # [T, k, H] on the device once complete
        self.remap_device = remap                   # what merge_rows reads (a device copy on CUDA)
        self.deadline = 0.0                         # emulated completion (CPU), perf_counter s

    def work(self) -> tuple[int, int]:
        """(distinct experts, (token, position) rows) this job computes."""
        rows = self.remap[self.ids]
        rows = rows[rows >= 0]
        return int(rows.unique().numel()), int(rows.numel())

    def __repr__(self) -> str:
        return f"HostJob(layer={self.layer}, experts={self.experts}, {'done' if self._future.done() else 'pending'})"


class HostLane:
    """Computes jobs one after another on `threads` host threads (see the module docstring).

    `charge(job) -> seconds`: the job's emulated time (CPU); it then completes no earlier than
    start + charge, start = max(enqueued, the previous job's completion). None: real time only.
    `cuda`: the CUDA calls of a lane whose inputs and rows cross to a GPU (default CudaApi() on a
    CUDA device, none elsewhere; tests hand a fake to run that branch on a CPU)."""

    def __init__(self, store: list[ExpertWeights], device, *, threads: int = 1, dtype: torch.dtype | None = None,
                 charge: Callable[[HostJob], float] | None = None, name: str = "host",
                 cuda: CudaApi | None = None):
        if threads < 1:
            raise ValueError(f"HostLane needs threads >= 1, got {threads}")
        self.store, self.device, self.threads, self.charge, self.name = store, torch.device(device), threads, charge, name
        self._cuda = cuda or (CudaApi() if self.device.type == "cuda" else None)
        self.dtype = dtype or store[0].w13.dtype  # the host computes in this dtype
        self.n_experts = store[0].w13.shape[0]
        self.stats = {"jobs": 0, "experts": 0, "busy_s": 0.0}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[HostJob] = collections.deque()
        self._pending = 0
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix=f"specter-{name}",
                                                           initializer=torch.set_num_threads,
                                                           initargs=(1,)) if threads > 1 else None
        self._stream = self._cuda.stream(self.device) if self._cuda else None
        self._worker = daemon(self._run, f"specter-{name}", self)

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               experts: list[int]) -> HostJob:
        """Compute the rows of x [T, H] routed to `experts` on the host; the other rows of the result are
        zero (job.remap_device maps exactly those experts, for merge_rows)."""
        remap = torch.full((self.n_experts,), -1, dtype=torch.int32)  # expert -> its store row
        remap[experts] = torch.tensor(experts, dtype=torch.int32)
        if cuda := self._cuda:  # to pinned host memory on the compute stream; the dispatcher waits for the event
            hx, hids, hw = (cuda.pinned_empty_like(t) for t in (x, ids, weights))
            for h, t in ((hx, x), (hids, ids), (hw, weights)):
                h.copy_(t, non_blocking=True)
            job = HostJob(layer, hx, hids, hw, remap, experts, self.device)
            job._cuda, job._consumer = cuda, cuda.current_stream(self.device)  # Transfer.wait's
            job._inputs = cuda.event()
            job._inputs.record(job._consumer)
            job._issued = threading.Event()
            job.remap_device = remap.to(self.device, non_blocking=True)
        else:
            job = HostJob(layer, x, ids, weights, remap, experts, self.device)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit() on a closed host lane")
            self._pending += 1
            self._queue.append(job)
            self._work.notify()
        return job

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Stop taking jobs; queued ones still complete (without sleeping out their emulated time)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._work.notify()
        if self._worker is not threading.current_thread():
            self._worker.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ----------------------------------------------------------------------------- the worker
    def _next(self) -> HostJob | None:
        with self._work:
            self._work.wait_for(lambda: self._queue or self._closed)
            return self._queue.popleft() if self._queue else None

    def _run(self) -> None:
        torch.set_num_threads(1)
        deadline = 0.0  # the previous job's emulated completion
        while (job := self._next()) is not None:
            job.t_started = time.perf_counter()
            error = None
            try:
                if self._cuda:
                    job._inputs.synchronize()
                with torch.inference_mode(), span(f"host job layer {job.layer}"):  # on the lane's thread
                    rows = self._compute(job)
                if self._cuda:
                    rows = self._to_device(job, rows)
                job.rows = rows
            except Exception as e:  # reported to whoever waits on the job
                error = e
            if self.charge is not None and error is None:
                job.deadline = deadline = max(job.t_enqueued, deadline) + self.charge(job)
                while (left := deadline - time.perf_counter()) > 0 and not self._closed:
                    time.sleep(left)
            with self._lock:
                self.stats["jobs"] += 1
                self.stats["experts"] += len(job.experts)
                self.stats["busy_s"] += time.perf_counter() - job.t_started
                self._pending -= 1
            if job._issued is not None:
                job._issued.set()
            job._finish(error)

    def _compute(self, job: HostJob) -> torch.Tensor:
        """[T, k, H] in the inputs' dtype: the job's rows, computed in the lane's dtype, its experts split
        over the lane's threads (merged by row)."""
        x = job.x if job.x.dtype == self.dtype else job.x.to(self.dtype)
        ew = self.store[job.layer]
        parts = _split(job.experts, self.threads)
        if len(parts) == 1:
            rows = expert_rows(x, job.ids, job.weights, ew.w13, ew.w2, remap=job.remap, backend="torch")
        else:
            remaps = [_only(job.remap, p) for p in parts]
            futures = [self._pool.submit(_rows, x, job.ids, job.weights, ew, r) for r in remaps[1:]]
            rows = _rows(x, job.ids, job.weights, ew, remaps[0])
            for r, f in zip(remaps[1:], futures):
                rows = merge_rows(rows, f.result(), job.ids, r)
        return rows.to(job.x.dtype)  # CUDA computes in the store's dtype, whatever the device's (a no-op on CPU)

    def _to_device(self, job: HostJob, rows: torch.Tensor) -> torch.Tensor:
        """CUDA: the rows from a pinned buffer to the device on the lane's stream; job._event after it."""
        cuda = self._cuda
        host = cuda.pinned_empty_like(rows).copy_(rows)
        with cuda.use(self._stream):
            out = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            if out.is_cuda:
                out.record_stream(job._consumer)  # read there after its wait: its memory outlives that
            job._event = cuda.event()
            job._event.record(self._stream)
        job._host_rows = host  # alive until the copy has run (the job outlives its wait)
        return out


def _rows(x, ids, weights, ew: ExpertWeights, remap) -> torch.Tensor:
    with torch.inference_mode():
        return expert_rows(x, ids, weights, ew.w13, ew.w2, remap=remap, backend="torch")


def _split(experts: list[int], n: int) -> list[list[int]]:
    """Experts dealt round-robin into at most n non-empty parts."""
    return [p for p in (experts[i::n] for i in range(n)) if p]


def _only(remap: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """remap with every store row but `keep` turned to -1."""
    return torch.where(torch.isin(remap, torch.tensor(keep, dtype=remap.dtype)), remap, -1)


# ----------------------------------------------------------------------------------- building
def default_host_threads() -> int:
    """Physical cores of this process's CPUs minus one: the thread that drives the device (the CUDA
    driver's launches, or on CPU the emulated device's compute, which keeps cores - 1 of its own)."""
    return max(1, physical_cores() - 1)


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on (logical CPUs if unknown)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            base = f"/sys/devices/system/cpu/cpu{c}/topology/"
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def make_host_lane(store: list[ExpertWeights], device, link, *, threads: int | None = None,
                   dtype: torch.dtype | None = None, charged_dtype: torch.dtype | None = None,
                   cuda: CudaApi | None = None) -> HostLane:
    """The host lane for `device`. CPU: each job is charged its emulated time from the link's profile
    and time scale (calibrate.emulated_host_params), weights counted at `charged_dtype`'s width (the one
    the emulated link times copies at), so that host : device : copy times are the profiled machine's.
    A link without a profile (a test's plain EmulatedLink) gives a lane that takes real time only.
    dtype: what the host computes in (CPU: the device's compute dtype, for identical bits; CUDA: the store's).
    cuda: HostLane's (tests: its CUDA branch on a CPU)."""
    device = torch.device(device)
    threads = threads or default_host_threads()
    profile, scale = getattr(link, "profile", None), getattr(link, "time_scale", None)
    charge = None
    if device.type == "cpu" and profile is not None and scale is not None:
        w13, w2 = store[0].w13, store[0].w2
        H, I = w13.shape[2], w2.shape[2]
        item = (charged_dtype or dtype or w13.dtype).itemsize
        params = emulated_host_params(profile, scale)

        def charge(job: HostJob) -> float:  # weight bytes read, FLOPs, activations down and rows back
            experts, rows = job.work()
            return params.seconds(weight_bytes=experts * 3 * H * I * item, flops=rows * 6 * H * I,
                                  act_bytes=(job.ids.shape[0] + rows) * H * item)
    lane = HostLane(store, device, threads=threads, dtype=dtype if device.type == "cpu" else store[0].w13.dtype,
                    charge=charge, name="host" if charge is None else f"host:{profile.name}", cuda=cuda)
    if device.type == "cuda":  # real seconds: the GPU's own profile, unscaled (for LaneChoice's estimates)
        from .calibrate import load_profile, profile_for_gpu

        profile, scale = load_profile(profile_for_gpu(torch.cuda.get_device_name(device))), 1.0
    lane.profile, lane.time_scale = profile, scale
    return lane


# ------------------------------------------------------------------------------- which lane
class LaneChoice:
    """Specter's two lanes: which of a layer's missing experts compute on the host instead of crossing
    PCIe (OffloadedExperts.host_choice). The m missing experts are ranked by the planner's scores
    (decayed predicted and verified uses; a prompt's, by its own tokens' uses, `prompt_uses`: the
    earlier text's scores said nothing of which of them the first decode steps need, and the ones it
    hosted missed again there) and the first c are copied, the rest computed on the host, c minimising
    this call's time less what the copies are worth later:

        J(c) = max(c t_copy, host(the other m - c)) - t_host1 sum_{i<c} (u(e_i) - u(v_i))   (ties: more copies)

    v_i the resident the i-th copy displaces (a free slot first, u = 0; then the lowest scored
    resident this call does not use), u an expert's decayed count of uses once this step is counted
    (score decay / use_weight, + rho for the copied expert's use now: rho the layer's measured chance
    that an expert a step uses, the next step uses too), and t_host1 what one later miss costs on the
    host: a copy serves as many uses in the next steps as its expert had in the last ones.
    The later worth counts in plain steps only: the scores and reuse measure recurrence from step to
    step, while a verification's misses serve its own K + 1 rows (there J is this call's time alone).
    c is at most the slots the layer can free beside the experts this call holds; t_copy the link's
    measured seconds a copy; host times HostParams.seconds. Rows are exact whichever lane computes them."""

    def __init__(self, mgr, params: HostParams | None, planner=None):
        self.mgr, self.params, self.planner = mgr, params, planner  # planner: score, use_weight, decay, reuse
        self.H, self.I = mgr.store[0].w13.shape[2], mgr.store[0].w2.shape[2]
        self.item = mgr.pool[0].w13.element_size()  # the width copies are timed at
        self.rank_prompt = True  # a prompt's misses ranked by its own tokens (False: by the planner's scores)

    def room(self, layer: int, missing: list[int], distinct) -> int:
        """How many of `missing` may be copied: the layer's quota less the experts of this call
        (`distinct`, its routed experts once each) already in its slots."""
        slots = self.mgr.slots
        held, where = 0, slots.slot[layer]
        for e in distinct:
            held += where[e] >= 0
        return max(0, min(len(missing), slots.n_slots - held))

    def __call__(self, layer: int, missing: list[int], routed: list[int]) -> list[int]:
        slots = self.mgr.slots
        counts: dict = {}
        for e in routed:
            counts[e] = counts.get(e, 0) + 1
        room = self.room(layer, missing, counts)
        order = list(missing)
        pl = self.planner
        if pl is not None:  # stable: equal scores keep their order
            order.sort(key=pl.scores.raw[layer].__getitem__, reverse=True)  # raw: as the layer's scores order
            if pl.prompt_tokens and self.rank_prompt:  # a prompt: by its own tokens' uses (ties: the scores)
                uses = prompt_uses(routed, pl.prompt_tokens, pl.decay)
                order.sort(key=lambda e: uses.get(e, 0.0), reverse=True)
        if self.params is None:  # no host profile (a test's plain link): copy what fits, host the rest
            return order[room:]
        t_copy = self.mgr.link.copy_seconds(self.mgr.expert_bytes)
        p, H, I, item = self.params, self.H, self.I, self.item
        worth = pl is not None and not pl.read_upto  # a plain step's (a verification's copies serve its cycle)
        if worth:  # the uses each copy gains: its own, less its victim's (free slots first, then coldest)
            score, (free, others) = pl.scores.raw[layer], slots.room(layer, counts)
            f = pl.decay * pl.scores.scale[layer] / pl.use_weight  # raw score -> next step's uses (scores.py)
            cold = []
            for e in others:
                cold.append(score[e])
            victims = [0.0] * free + sorted(cold)
            t_host1 = p.latency + 2 * H * item / p.pcie_bandwidth + max(
                3 * H * I * item / p.bandwidth, 6 * H * I / p.flops_per_s if p.flops_per_s else 0.0)
        rows = 0  # the (token, position) rows of order[c:]
        for e in order:
            rows += counts[e]
        best_c, best_t, gained = 0, None, 0.0
        for c in range(room + 1):
            n = len(order) - c  # HostParams.seconds of those n experts, written out (one call fewer each)
            host = p.latency + 2 * rows * H * item / p.pcie_bandwidth + max(
                n * 3 * H * I * item / p.bandwidth, rows * 6 * H * I / p.flops_per_s if p.flops_per_s else 0.0) if n else 0.0
            t = max(c * t_copy, host) - gained
            if best_t is None or t <= best_t:
                best_c, best_t = c, t
            if c < len(order):
                rows -= counts[order[c]]
                if worth:
                    victim = victims[c] if c < len(victims) else 0.0
                    gained += t_host1 * (pl.reuse[layer] + f * (score[order[c]] - victim))  # less its victim's
        return order[best_c:]


def prompt_uses(routed: list[int], tokens: int, decay: float, tail: int = 64) -> dict[int, float]:
    """A prompt's experts weighed as the steps after it will see them: token T-1-d's uses count decay^d, as
    if each token were a plain step (the planner's scores' decay). routed: [T * k] experts, token by token.
    Only the last `tail` tokens count (0.8^64 ~ 1e-6): a long prompt costs no more than a short one."""
    k = max(1, len(routed) // tokens)
    n = len(routed) // k  # the tokens (`tokens` in a prompt's call)
    uses: dict[int, float] = {}
    for t in range(max(0, n - tail), n):
        w = decay ** (n - 1 - t)
        for e in routed[t * k:(t + 1) * k]:
            uses[e] = uses.get(e, 0.0) + w
    return uses


def host_params(lane: HostLane) -> HostParams | None:
    """The lane's cost model in the seconds copies are timed in (None without a profile)."""
    if getattr(lane, "profile", None) is None or getattr(lane, "time_scale", None) is None:
        return None
    return emulated_host_params(lane.profile, lane.time_scale)
