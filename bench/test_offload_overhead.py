"""What the offload manager's bookkeeping costs per decode step, beside resident compute.

Both providers compute the same experts on the same inputs with every expert already resident;
the manager runs its full slow path (poll, hit counting, ordering, pin/unpin, touch) rather than
its all-resident shortcut, so the difference is exactly the per-step overhead of offloading.

    python -m pytest bench/test_offload_overhead.py --benchmark-only --benchmark-group-by=group
"""
import pytest
import torch

import specter
from specter.moe import ResidentExperts
from specter.offload.link import EmulatedLink
from specter.offload.manager import OffloadedExperts


@pytest.fixture(scope="module")
def setup():
    engine = specter.load(None, device="cpu", policy="resident")
    experts = engine.expert_weights
    mgr = OffloadedExperts(experts, experts[0].n_experts, torch.device("cpu"), EmulatedLink(1e12))
    mgr.warm()
    mgr.all_resident = False  # force the bookkeeping path
    spec = engine.spec
    torch.manual_seed(0)
    x = torch.randn(1, spec.hidden)
    steps = [torch.stack([torch.randperm(spec.n_experts)[:spec.top_k] for _ in range(1)]) for _ in range(64)]
    w = torch.full((1, spec.top_k), 1.0 / spec.top_k)
    yield ResidentExperts(experts), mgr, x, steps, w, spec.n_moe_layers
    mgr.close()


def _decode(provider, x, steps, w, n_layers):
    for ids in steps:  # 64 decode steps, every MoE layer
        for layer in range(n_layers):
            provider(layer, x, ids, w)


@pytest.mark.benchmark(group="offload-overhead")
def test_resident_provider(benchmark, setup):
    resident, _, x, steps, w, L = setup
    benchmark(_decode, resident, x, steps, w, L)


@pytest.mark.benchmark(group="offload-overhead")
def test_offload_manager_all_hits(benchmark, setup):
    _, mgr, x, steps, w, L = setup
    benchmark(_decode, mgr, x, steps, w, L)
