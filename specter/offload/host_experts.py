"""The `host` policy's expert provider (llama.cpp's --n-cpu-moe, Fiddler): resident experts on the
device, every other one computed on the host lane, nothing copied.

    mgr   OffloadedExperts, warmed: its slot pool is the device's resident experts (the same budget
          as every other policy: the first S experts of each layer, a static split as llama.cpp's)
    lane  HostLane over the host store (host_lane.py)

A layer's call reads its routing once, hands the cold experts' rows to the lane first (so the host
works while the device does), computes the resident experts in one grouped call through the slot
pool's remap row, then waits for the lane and merges its rows by (token, top-k position): the bits
of one call over resident weights, whatever ran where.
"""
from __future__ import annotations

import torch

from specter.triton_ops import combine_rows, merge_rows

from .host_lane import HostLane
from .manager import OffloadedExperts


class HostExperts:
    def __init__(self, mgr: OffloadedExperts, lane: HostLane):
        self.mgr, self.lane = mgr, lane
        self.slots, self.link, self.store = mgr.slots, mgr.link, mgr.store
        self.reset_stats()

    @property
    def all_resident(self) -> bool:
        return self.mgr.all_resident

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The layer's routed experts: cold ones on the lane while the resident ones compute here."""
        mgr, slots = self.mgr, self.slots
        if mgr.all_resident:
            return mgr(layer, x, ids, weights)
        routed = ids.reshape(-1).tolist()  # [T * k] on the host
        need = sorted(set(routed))
        cold = [e for e in need if not slots.is_ready(layer, e)]  # nothing is copied: resident = warmed
        st = self._stats
        st["expert_hits"] += len(need) - len(cold)
        st["expert_misses"] += len(cold)
        job = None
        if cold:
            job = self.lane.submit(layer, x, ids, weights, cold)
            st["host_experts"] += len(cold)
            st["host_bytes"] += len(cold) * mgr.host_expert_bytes
        if len(cold) < len(need):  # the resident ones, meanwhile, in one call through the remap row
            pool = mgr.rows[layer]
            rows = mgr.expert_rows(x, ids, weights, pool.w13, pool.w2, remap=slots.remap[layer])
        else:
            rows = x.new_zeros(ids.shape + x.shape[1:])
        if job is not None:
            waited = job.wait()
            st["host_stall_s"] += waited
            st["stall_s"] += waited
            rows = merge_rows(rows, job.rows, ids, job.remap_device)
        slots.touch(layer, need)
        return combine_rows(rows)

    # -------------------------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        self.mgr.reset_stats()
        self._stats = dict(expert_hits=0, expert_misses=0, stall_s=0.0, host_experts=0, host_bytes=0,
                           host_stall_s=0.0)
        self._busy0 = self.lane.stats["busy_s"]

    def stats(self) -> dict:
        out = self.mgr.stats()  # hits of all-resident calls, h2d (none after warm-up)
        for k, v in self._stats.items():
            out[k] = out.get(k, 0) + v
        out["host_busy_s"] = self.lane.stats["busy_s"] - self._busy0
        out["host_threads"] = self.lane.threads
        out["offloaded_bytes"] = out["h2d_bytes"] + out["host_bytes"]  # (the manager's sum left out the lane's)
        return out

    def reset(self) -> None:
        self.mgr.reset()

    def recover(self) -> None:
        self.mgr.recover()

    def close(self) -> None:
        self.lane.close()
        self.mgr.close()
