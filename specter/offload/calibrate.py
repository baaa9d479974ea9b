"""Link profiles and the calibration of the emulated link.

A profile (profiles/*.json) describes one real GPU: how fast it reads its own memory and how fast
pinned host memory reaches it over PCIe. On CPU we cannot copy at PCIe speed *relative to* GPU
compute, so we measure how fast this machine pushes one token through one expert, take the ratio
to the GPU's memory bandwidth as a time scale, and slow the PCIe numbers down by the same scale:

    s         = device_memory_bandwidth / expert_throughput      # how much slower this CPU is
    bandwidth = pcie_bandwidth / s                                # emulated bytes/s
    latency   = latency * s                                       # emulated seconds per copy

so that copy time : expert compute time is what the real GPU would see.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from specter.errors import ConfigError

DEFAULT_PROFILE = "A100-40GB-PCIe4"


class UnknownProfileError(ConfigError):
    """A link profile name that has no JSON file in profiles/."""


@dataclass(frozen=True)
class LinkProfile:
    name: str                        # file stem, e.g. "A100-40GB-PCIe4"
    gpu: str                         # marketing name, e.g. "NVIDIA A100 40GB PCIe"
    device_memory_bandwidth: float   # bytes/s, datasheet HBM/GDDR bandwidth
    pcie_bandwidth: float            # bytes/s, *effective* pinned H2D as measured (not theoretical)
    latency: float                   # s per copy (launch + DMA setup)
    sources: list[str]
    notes: str
    link: str = ""                   # e.g. "PCIe 4.0 x16"
    pcie_theoretical_bandwidth: float = 0.0  # bytes/s per direction, for reference only
    # the host a typical machine with this GPU has (the host lane computes cold experts there)
    host: str = ""                             # e.g. "1 socket of 2x AMD EPYC 7763, 8x DDR4-3200"
    host_memory_bandwidth: float = 0.0         # bytes/s, STREAM-like (triad) as measured, one socket
    host_memory_theoretical_bandwidth: float = 0.0  # bytes/s, channels x transfer rate x 8, for reference
    host_cores: int = 0                        # cores the host lane may use (the socket's, less the driver's)
    host_core_flops: float = 0.0               # FLOP/s one core sustains in an expert's matmuls
    host_latency: float = 0.0                  # s per job: activations down, rows back, a worker woken
    host_gemv_efficiency: float = 1.0          # share of host_memory_bandwidth expert matmuls reach
    host_sources: tuple = ()


# ---------------------------------------------------------------- profiles


def _profile_dir():
    """profiles/ as installed (specter.profiles) or, in a source checkout, next to specter/."""
    try:
        return resources.files("specter.profiles")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "profiles"


def available_profiles() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in _profile_dir().iterdir() if p.name.endswith(".json"))


def load_profile(name: str | None = None) -> LinkProfile:
    name = name or DEFAULT_PROFILE
    names = available_profiles()
    if name not in names:
        raise UnknownProfileError(f"unknown link profile {name!r}; available: {', '.join(names)}")
    data = json.loads((_profile_dir() / f"{name}.json").read_text())
    data["sources"] = list(data.get("sources", []))
    data["host_sources"] = tuple(data.get("host_sources", ()))
    return LinkProfile(**data)


def profile_for_gpu(device_name: str) -> str | None:
    """The profile whose GPU matches a CUDA device name ("NVIDIA GeForce RTX 4090" -> "RTX4090-PCIe4")."""
    squashed = device_name.replace(" ", "").lower()
    for name in available_profiles():
        if name.split("-")[0].lower() in squashed:
            return name
    return None


# ---------------------------------------------------------------- calibration

_THROUGHPUT_CACHE: dict[tuple, float] = {}
_WORKING_SET = 64 << 20   # bytes of expert weights per pass: larger than any last-level cache
_MAX_EXPERTS = 256
_TIME_BUDGET = 0.25       # s for warm-up and timed passes together, past the minimum below
_MIN_PASSES, _MIN_EXPERTS = 3, 8  # timed passes, and experts a pass, whatever the budget: one pause of the
                                  # process (a busy machine) slows one sample of several, not the fastest


def measure_expert_throughput(hidden: int, intermediate: int, dtype=torch.float32, device="cpu",
                              repeats: int = 7, storage: torch.dtype | None = None) -> float:
    """Bytes of expert weights one decode token consumes per second through SwiGLU experts here.

    One pass runs x [1, H] through each of n distinct experts (w13 [2I, H], w2 [H, I]), n chosen so
    the weights overflow the caches; the result is the fastest pass's bytes / seconds: load from other
    processes only ever slows a pass, and the rate sets the emulated link's time scale for the engine's
    life (a server started beside a busy load was otherwise slowed for good).
    `storage`: the weights' dtype when it is not the compute dtype `dtype` (a CPU slot pool in the
    checkpoint's bf16): each expert is converted as it runs, as the torch backend does, and bytes
    are counted as stored, as the emulated link counts the bytes it copies.
    Cached per (hidden, intermediate, dtype, storage, device, and CPU threads) for the life of the process.
    """
    device = torch.device(device)
    storage = storage or dtype
    key = (hidden, intermediate, dtype, storage, str(device), torch.get_num_threads() if device.type == "cpu" else 0)
    if key in _THROUGHPUT_CACHE:
        return _THROUGHPUT_CACHE[key]

    expert_bytes = 3 * hidden * intermediate * storage.itemsize
    n = max(2, min(_MAX_EXPERTS, math.ceil(_WORKING_SET / expert_bytes)))
    # constant weights: matmul speed does not depend on values, and fill_ is far cheaper than randn
    w13 = torch.empty(n, 2 * intermediate, hidden, dtype=storage, device=device).fill_(0.01)  # [n, 2I, H]
    w2 = torch.empty(n, hidden, intermediate, dtype=storage, device=device).fill_(0.01)       # [n, H, I]
    x = torch.full((1, hidden), 0.1, dtype=dtype, device=device)                            # [1, H]
    # converted weights go into reused buffers, as the torch backend converts them
    b13, b2 = (torch.empty(w.shape[1:], dtype=dtype, device=device) if storage != dtype else None for w in (w13, w2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one_pass(experts: range, t_stop: float) -> float:
        """bytes/s over one pass, cut short at t_stop once it has run _MIN_EXPERTS (a loaded machine can be
        very slow)."""
        sync()
        t0, done = time.perf_counter(), 0
        with torch.inference_mode():
            for e in experts:
                g, u = (x @ (w13[e] if b13 is None else b13.copy_(w13[e])).T).chunk(2, dim=-1)  # [1, I] each
                y = (F.silu(g) * u) @ (w2[e] if b2 is None else b2.copy_(w2[e])).T             # [1, H]
                done += 1
                if done >= _MIN_EXPERTS and time.perf_counter() > t_stop:
                    break
            sync()
        return done * expert_bytes / (time.perf_counter() - t0)

    t_stop = time.perf_counter() + _TIME_BUDGET
    one_pass(range(min(n, 2)), t_stop)  # warm-up: allocator, kernel selection
    rates = []
    while len(rates) < max(_MIN_PASSES, repeats) and (len(rates) < _MIN_PASSES or time.perf_counter() < t_stop):
        rates.append(one_pass(range(n), t_stop))
    _THROUGHPUT_CACHE[key] = rate = max(rates)
    return rate


def emulated_link_params(profile: LinkProfile, expert_throughput: float) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of an emulated link on a machine with this expert throughput."""
    s = profile.device_memory_bandwidth / expert_throughput   # time scale: this CPU vs the GPU
    return profile.pcie_bandwidth / s, profile.latency * s


@dataclass(frozen=True)
class HostParams:
    """The host lane's cost model, in this machine's (emulated) seconds: a job reading `weight_bytes`
    of experts, doing `flops`, and moving `act_bytes` of activations and rows over PCIe takes

        latency + act_bytes / pcie_bandwidth + max(weight_bytes / bandwidth, flops / flops_per_s)

    (memory-bound at a few tokens an expert, compute-bound past the host's ridge point)."""

    bandwidth: float     # bytes/s of expert weights the host reads
    flops_per_s: float   # all the lane's cores
    latency: float       # s per job
    pcie_bandwidth: float

    def seconds(self, weight_bytes: int, flops: int, act_bytes: int) -> float:
        compute = max(weight_bytes / self.bandwidth, flops / self.flops_per_s if self.flops_per_s else 0.0)
        return self.latency + act_bytes / self.pcie_bandwidth + compute


def emulated_host_params(profile: LinkProfile, time_scale: float) -> HostParams:
    """The profile's host slowed by the link's time scale (device_memory_bandwidth / this machine's
    expert throughput), exactly as emulated_link_params slows its PCIe link: host : device : copy
    times stay the profiled machine's. Experts stream at host_gemv_efficiency of the host's bandwidth."""
    if not profile.host_memory_bandwidth > 0:
        raise ConfigError(f"link profile {profile.name!r} describes no host (host_memory_bandwidth): add the host "
                          f"of a typical machine with that GPU to profiles/{profile.name}.json")
    s = time_scale
    return HostParams(bandwidth=profile.host_memory_bandwidth * profile.host_gemv_efficiency / s,
                      flops_per_s=profile.host_cores * profile.host_core_flops / s,
                      latency=profile.host_latency * s, pcie_bandwidth=profile.pcie_bandwidth / s)
