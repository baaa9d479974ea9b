"""Memory plan (specter/offload/plan.py): budgets -> slots per layer, by hand from each tiny checkpoint's config.

One routed expert holds gate, up and down projections: 3 * hidden * expert_inter weights, so in fp32
it is 3 * hidden * expert_inter * 4 bytes. A slot pool of B bytes buys floor(B / (n_moe_layers *
expert_bytes)) slots per layer; a residency fraction F buys ceil(F * n_experts); a device budget D
buys what is left after the non-expert weights, the INT4 draft and the KV cache. Fewer slots than
top-k is refused (BudgetError); a malformed budget is a ConfigError. Those are the per-layer rule's
numbers (pool="layer"); the shared pool's (the default: floor(B / expert_bytes) slots in one pool,
refused below one layer's top-k) are checked after them.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import specter
import specter.sizes
from specter.layers import KVCache
from specter.loader import open_checkpoint
from specter.offload.plan import MemoryPlan
from specter.offload.plan import make_plan as plan_of


def make_plan(*args, **kw) -> MemoryPlan:
    """The per-layer rule's plan (the tests below were written for it; the shared pool's follow)."""
    return plan_of(*args, **{"pool": "layer", **kw})

# arch, tiny_config overrides. deepseek_v2: first layer dense + shared expert; qwen2_moe: dense first
# layer (mlp_only_layers=[0]) + gated shared expert; mixtral: every layer MoE, nothing shared.
CASES = [("deepseek_v2", {}), ("qwen2_moe", {"mlp_only_layers": [0]}), ("mixtral", {})]
IDS = [a for a, _ in CASES]


def by_hand(ref) -> dict:
    """Expert geometry read straight from the transformers config (not through ModelSpec)."""
    c = ref.config
    if c.model_type == "deepseek_v2":
        E, inter, moe_layers = c.n_routed_experts, c.moe_intermediate_size, c.num_hidden_layers - c.first_k_dense_replace
    elif c.model_type == "qwen2_moe":
        E, inter = c.num_experts, c.moe_intermediate_size
        moe_layers = c.num_hidden_layers - len(c.mlp_only_layers)
    else:
        E, inter, moe_layers = c.num_local_experts, c.intermediate_size, c.num_hidden_layers
    expert_numel = 3 * c.hidden_size * inter
    total = sum(p.numel() for p in ref.parameters())
    routed = sum(p.numel() for n, p in ref.named_parameters() if ".mlp.experts." in n)
    assert routed == moe_layers * E * expert_numel, "the hand geometry disagrees with the checkpoint"
    return dict(E=E, k=c.num_experts_per_tok, L=moe_layers, H=c.hidden_size, I=inter, expert_numel=expert_numel,
                expert_fp32=expert_numel * 4,
                total_numel=total, non_expert_numel=total - routed)


@pytest.fixture(params=CASES, ids=IDS)
def case(request, tiny):
    arch, kw = request.param
    path, ref = tiny(arch, **kw)
    ckpt = open_checkpoint(path)
    return ckpt.spec, ckpt.numel(), by_hand(ref), path


def test_geometry_matches_the_hand_numbers(case):
    spec, numel, h, _ = case
    assert numel == h["total_numel"]
    assert (spec.n_experts, spec.top_k, spec.n_moe_layers) == (h["E"], h["k"], h["L"])
    plan = make_plan(spec, numel, torch.float32, residency=1.0)
    assert plan.expert_bytes == h["expert_fp32"]
    assert make_plan(spec, numel, torch.bfloat16, residency=1.0).expert_bytes == h["expert_numel"] * 2
    assert plan.non_expert_bytes == h["non_expert_numel"] * 4
    # deepseek_v2 tiny: hidden 64, moe_intermediate 32 -> 3*64*32*4 = 24576 bytes, 2 MoE layers of 3
    if spec.arch == "deepseek_v2":
        assert (plan.expert_bytes, plan.n_moe_layers) == (24576, 2)


def test_no_budget_is_all_resident(case):
    spec, numel, h, _ = case
    plan = make_plan(spec, numel, torch.float32)
    assert plan.slots_per_layer == h["E"] and plan.residency == 1.0
    assert plan.slot_pool_bytes == h["L"] * h["E"] * h["expert_fp32"]


@pytest.mark.parametrize("fraction", [0.25, 0.3, 0.5, 0.51, 0.75, 1.0, 1])
def test_residency_to_slots(case, fraction):
    spec, numel, h, _ = case
    plan = make_plan(spec, numel, torch.float32, residency=fraction)
    want = math.ceil(fraction * h["E"] - 1e-9)  # 8 experts: 0.25->2, 0.3->3, 0.5->4, 0.51->5, 0.75->6, 1->8
    assert plan.slots_per_layer == want
    assert plan.residency == want / h["E"]
    assert plan.slot_pool_bytes == h["L"] * want * h["expert_fp32"]
    assert plan.total_bytes == plan.slot_pool_bytes + plan.non_expert_bytes + plan.draft_bytes + plan.kv_bytes
    d = plan.as_dict()
    assert d["slots_per_layer"] == want and d["residency"] == plan.residency and d["top_k"] == h["k"]


def test_residency_table_by_hand_for_eight_experts(tiny):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    got = {f: make_plan(ckpt.spec, ckpt.numel(), torch.float32, residency=f).slots_per_layer
           for f in (0.25, 0.26, 0.375, 0.5, 0.625, 0.875, 0.9, 1.0)}
    assert got == {0.25: 2, 0.26: 3, 0.375: 3, 0.5: 4, 0.625: 5, 0.875: 7, 0.9: 8, 1.0: 8}


def test_expert_memory_to_slots(case):
    spec, numel, h, _ = case
    per_slot = h["L"] * h["expert_fp32"]  # one more slot in every MoE layer
    for slots in (h["k"], 3, 5, h["E"]):
        exact = slots * per_slot
        for budget in (exact, exact + per_slot - 1, f"{exact}B", f"{exact / 1024:g}KiB" if exact % 1024 == 0 else exact):
            plan = make_plan(spec, numel, torch.float32, expert_memory=budget)
            assert plan.slots_per_layer == slots, (budget, plan.slots_per_layer)
            assert plan.slot_pool_bytes == exact
    # one byte short of 3 slots is 2 slots; more than everything is capped at every expert
    assert make_plan(spec, numel, torch.float32, expert_memory=3 * per_slot - 1).slots_per_layer == 2
    assert make_plan(spec, numel, torch.float32, expert_memory="1TiB").slots_per_layer == h["E"]
    # bf16 experts are half the bytes: the same budget buys twice the slots
    assert make_plan(spec, numel, torch.bfloat16, expert_memory=2 * per_slot).slots_per_layer == 4


def test_expert_memory_units(tiny):
    """deepseek_v2 tiny, fp32: 2 MoE layers x 24576 B = 48 KiB per slot per layer."""
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    n = ckpt.numel()
    slots = lambda b: make_plan(ckpt.spec, n, torch.float32, expert_memory=b).slots_per_layer  # noqa: E731
    assert slots("144KiB") == 3 and slots("143KiB") == 2 and slots("144 kib") == 3
    assert slots("147456") == 3 and slots(147456) == 3 and slots("147.456KB") == 3
    assert slots("192KiB") == 4 and slots("0.1875MiB") == 4


def test_device_memory_to_slots(case):
    spec, numel, h, _ = case
    ctx = 64
    # fixed device bytes, by hand: non-expert weights + INT4 draft of every routed expert + KV cache
    # 4 bits a weight + a bf16 scale and shift per group of 128 along a row (the largest power of two
    # dividing a shorter row: the tiny models' 64- and 32-wide rows are one group each)
    group = lambda K: next(g for g in (128, 64, 32, 16, 8, 4, 2, 1) if K % g == 0)  # noqa: E731
    H, I = h["H"], h["I"]
    draft_expert = h["expert_numel"] // 2 + 2 * 2 * (2 * I * (H // group(H)) + H * (I // group(I)))
    kv = KVCache(spec, ctx, "cpu", torch.float32).nbytes()  # what the engine really allocates
    per_slot = h["L"] * h["expert_fp32"]
    for draft in (True, False):
        fixed = h["non_expert_numel"] * 4 + (h["L"] * h["E"] * draft_expert if draft else 0) + kv
        plan = make_plan(spec, numel, torch.float32, device_memory=fixed + 3 * per_slot, context=ctx, draft=draft)
        assert (plan.non_expert_bytes, plan.kv_bytes, plan.context) == (h["non_expert_numel"] * 4, kv, ctx)
        assert plan.draft_bytes == (h["L"] * h["E"] * draft_expert if draft else 0)
        assert plan.slots_per_layer == 3 and plan.total_bytes == fixed + 3 * per_slot
        assert make_plan(spec, numel, torch.float32, device_memory=fixed + 3 * per_slot - 1, context=ctx,
                         draft=draft).slots_per_layer == 2
        with pytest.raises(specter.BudgetError) as err:  # one slot short of top-k
            make_plan(spec, numel, torch.float32, device_memory=fixed + h["k"] * per_slot - 1, context=ctx, draft=draft)
        total = re.search(r": [^:(]* \(([\d,]+) bytes\) in all", str(err.value)).group(1)
        assert int(total.replace(",", "")) == fixed + h["k"] * per_slot  # what runs, named
        with pytest.raises(specter.BudgetError, match="device_memory") as err:  # not even the fixed part: the
            make_plan(spec, numel, torch.float32, device_memory=fixed - 1, context=ctx, draft=draft)  # same need
        total = re.search(r": [^:(]* \(([\d,]+) bytes\) in all", str(err.value)).group(1)
        assert int(total.replace(",", "")) == fixed + h["k"] * per_slot and "--device-memory" in str(err.value)


def test_kv_bytes_match_the_cache_the_engine_allocates(case):
    spec, numel, _, _ = case
    for dtype in (torch.float32, torch.bfloat16):
        plan = make_plan(spec, numel, dtype, residency=1.0, context=10)
        assert plan.kv_bytes == KVCache(spec, 10, "cpu", dtype).nbytes()
    # the context is capped at the model's
    assert make_plan(spec, numel, torch.float32, context=10**9).context == spec.max_position
    if spec.attention == "mla":  # the latent cache: normalised KV latent + rotary key, nothing per head
        assert KVCache(spec, 10, "cpu", torch.float32).nbytes() == spec.n_layers * 10 * (
            spec.kv_lora_rank + spec.qk_rope_dim) * 4


def test_a_plan_larger_than_the_free_device_memory_is_refused_before_the_load():
    """A device_memory budget was never checked against the GPU (the README's Mixtral-on-24-GiB plan
    leaves 169 MiB of 24 GiB): past what is free the load would end in a CUDA out-of-memory error."""
    from specter.offload.plan import check_device_room

    spec, dtype, numel = described("Mixtral-8x7B")
    plan = plan_of(spec, numel, dtype, device_memory="24GiB", context=4096, draft_bits=2)
    check_device_room(plan, plan.total_bytes)  # exactly enough
    with pytest.raises(specter.BudgetError, match=r"the plan needs 23\.8 GiB .* the GPU has 23\.5 GiB .* free; .*"
                                                  r"device_memory \(--device-memory\) 21\.1 GiB"):
        check_device_room(plan, int(23.5 * 2**30))


def test_budgets_below_top_k_are_refused(case):
    spec, numel, h, _ = case
    per_slot = h["L"] * h["expert_fp32"]
    k = h["k"]
    for kw in (dict(residency=(k - 1) / h["E"]), dict(residency=1e-6), dict(expert_memory=k * per_slot - 1),
               dict(expert_memory="1KB"), dict(expert_memory=0)):
        with pytest.raises(specter.BudgetError) as err:
            make_plan(spec, numel, torch.float32, **kw)
        assert isinstance(err.value, specter.SpecterError)
        assert f"top-{k}" in str(err.value) and "\n" not in str(err.value)
        # the figures it asks for, given back, are enough (a residency rounded down, or a size rounded to
        # the budget's own figure, was not: "at least 48.0 KiB" for a budget of 48.0 KiB less a byte)
        asked = r"\(([\d,]+) bytes\) of slot pool.*\(([\d.e-]+) residency\)"
        pool, residency = re.search(asked, str(err.value)).groups()
        assert make_plan(spec, numel, torch.float32, expert_memory=int(pool.replace(",", ""))).slots_per_layer == k
        assert make_plan(spec, numel, torch.float32, residency=float(residency)).slots_per_layer >= k
    # exactly top-k is enough
    assert make_plan(spec, numel, torch.float32, expert_memory=k * per_slot).slots_per_layer == k
    assert make_plan(spec, numel, torch.float32, residency=k / h["E"]).slots_per_layer == k


def test_a_numpy_residency_is_a_residency(case):
    np = pytest.importorskip("numpy")  # np.float32 is no float: "residency must be a fraction, got np.float32(0.5)"
    spec, numel, _, _ = case
    assert make_plan(spec, numel, torch.float32, residency=np.float32(0.5)).pool_slots == \
        make_plan(spec, numel, torch.float32, residency=0.5).pool_slots


@pytest.mark.parametrize("bad", [0, 0.0, -0.25, 1.0001, 1.5, 2, float("nan"), float("inf"), "0.5"])
def test_residency_outside_unit_interval_is_a_config_error(tiny, bad):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    with pytest.raises(specter.ConfigError, match="residency"):
        make_plan(ckpt.spec, ckpt.numel(), torch.float32, residency=bad)


def test_residency_bool_is_a_config_error(tiny):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    with pytest.raises(specter.ConfigError):
        make_plan(ckpt.spec, ckpt.numel(), torch.float32, residency=True)


def test_two_budgets_at_once_is_a_config_error(tiny):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    n = ckpt.numel()
    for kw in (dict(residency=0.5, expert_memory="1GiB"), dict(residency=0.5, device_memory="1GiB"),
               dict(expert_memory="1GiB", device_memory="1GiB"),
               dict(residency=0.5, expert_memory="1GiB", device_memory="1GiB")):
        with pytest.raises(specter.ConfigError, match="one budget"):
            make_plan(ckpt.spec, n, torch.float32, **kw)


@pytest.mark.parametrize("bad", ["lots", "6 parsecs", "-1GiB", -5, 1.5, "1.5B"])
def test_malformed_byte_budgets_are_config_errors(tiny, bad):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    n = ckpt.numel()
    for name in ("expert_memory", "device_memory"):
        with pytest.raises(specter.ConfigError, match=name):
            make_plan(ckpt.spec, n, torch.float32, **{name: bad})


def test_table_mentions_the_numbers(tiny):
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    plan = make_plan(ckpt.spec, ckpt.numel(), torch.float32, residency=0.5)
    assert isinstance(plan, MemoryPlan)
    text = plan.table()
    assert "4 of 8" in text and "50.0%" in text and "top-2" in text and "2 layers x 4 slots" in text


def test_load_uses_the_plan_and_refuses_bad_budgets(tiny):
    """specter.load turns the same budgets into the same slot counts, and refuses the same way (before loading)."""
    path, _ = tiny("deepseek_v2")
    ckpt = open_checkpoint(path)
    n = ckpt.numel()
    engine = specter.load(path, device="cpu", policy="on-demand", expert_memory="144KiB")  # 6 x 24 KiB
    try:
        assert engine.plan.pool_slots == 6 and engine.plan.pool == "shared"
        assert engine.plan == plan_of(ckpt.spec, n, torch.float32, expert_memory="144KiB", draft=False)
        mgr = engine.decoder.experts
        assert mgr.slots.pool_slots == 6 and tuple(mgr.pool[0].w13.shape[:1]) == (6,)
        assert all(p is mgr.pool[0] for p in mgr.pool)  # one pool for both MoE layers
    finally:
        engine.close()
    engine = specter.load(path, device="cpu", policy="on-demand", expert_memory="144KiB", slot_pool="layer")
    try:
        assert engine.plan.slots_per_layer == 3 and engine.plan.pool_slots == 6
        assert engine.plan == make_plan(ckpt.spec, n, torch.float32, expert_memory="144KiB", draft=False)
        mgr = engine.decoder.experts
        assert mgr.slots.n_slots == 3 and mgr.slots.per_layer and tuple(mgr.pool[0].w13.shape[:1]) == (6,)
    finally:
        engine.close()
    with pytest.raises(specter.BudgetError):  # 1 slot of 16: below one layer's top-2
        specter.load(path, device="cpu", policy="on-demand", residency=0.0625)
    with pytest.raises(specter.BudgetError):
        specter.load(path, device="cpu", policy="on-demand", residency=0.125, slot_pool="layer")
    with pytest.raises(specter.BudgetError):
        specter.load(path, device="cpu", policy="next-layer", expert_memory="1KB")
    with pytest.raises(specter.ConfigError):
        specter.load(path, device="cpu", policy="on-demand", residency=0.5, expert_memory="1MiB")
    with pytest.raises(specter.ConfigError):
        specter.load(path, device="cpu", policy="on-demand", residency=1.5)


MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
                    torch_dtype="bfloat16", tie_word_embeddings=False)


def test_plan_names_the_host_to_device_path(tmp_path, monkeypatch, capsys):
    """CUDA: "pinned store" (the store page-locked), or with pinning off two staging buffers of one
    expert each (Mixtral-8x7B: 3 x 4096 x 14336 bf16 = 336 MiB); CPU: the emulated link."""
    import json

    from specter.cli import main
    from specter.loader import describe
    from specter.offload.plan import host_needs

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    spec, dtype, _, _ = describe(tmp_path)
    monkeypatch.delenv("SPECTER_PIN_STORE", raising=False)
    pinned = host_needs(spec, dtype, "cuda")
    assert (pinned.h2d_path, pinned.pinned_bytes) == ("pinned store", pinned.store_bytes)
    assert pinned.staging_bytes == 3 * 4096 * 14336 * 2
    staged = host_needs(spec, dtype, "cuda", pin=False)
    assert staged.h2d_path == "staging buffers (2 x 336.0 MiB)" and staged.pinned_bytes == 2 * staged.staging_bytes
    assert host_needs(spec, dtype, "cpu").h2d_path == "emulated (host memory)"

    argv = ["plan", "--model", str(tmp_path), "--device", "cuda", "--residency", "0.25"]
    assert main(argv) == 0
    assert "host->device copies: pinned store (if the host cannot pin it: staging buffers (2 x 336.0 MiB))" \
        in capsys.readouterr().out
    monkeypatch.setenv("SPECTER_PIN_STORE", "0")
    assert main(argv + ["--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert host["h2d_path"] == "staging buffers (2 x 336.0 MiB)" and host["pinned_bytes"] == 2 * 336 * 2**20


def test_engine_stats_name_the_host_to_device_path(tiny):
    """... and the emulated link's time scale, set once at load (a scale measured on a busy machine slowed an
    engine for good, unseen)."""
    path, _ = tiny("mixtral")
    for policy, want in (("on-demand", "emulated (host memory)"), ("resident", None)):
        engine = specter.load(path, device="cpu", policy=policy, **({"residency": 0.5} if policy != "resident" else {}))
        try:
            stats = engine.generate([1, 2, 3], max_new_tokens=2).stats
            assert stats["h2d_path"] == want
            link = getattr(engine.decoder.experts, "link", None)
            assert stats["time_scale"] == (None if link is None else link.time_scale)
            assert policy == "resident" or stats["time_scale"] > 0
        finally:
            engine.close()


# ------------------------------------------------------------------------------ the shared pool
def test_shared_pool_slots_by_hand(case):
    """One pool: B bytes buy floor(B / expert_bytes) slots, a residency F ceil(F x L x E); the floor is
    one layer's top-k, not every layer's."""
    spec, numel, h, _ = case
    L, E, k, eb = h["L"], h["E"], h["k"], h["expert_fp32"]
    for slots in (k, k + 1, L * k - 1, L * E):
        plan = plan_of(spec, numel, torch.float32, expert_memory=slots * eb + eb - 1)
        assert (plan.pool_slots, plan.pool, plan.slot_pool_bytes) == (slots, "shared", slots * eb)
        assert plan.slots_per_layer == min(E, slots, max(k, -(-slots // L)))  # a layer's share, top-k at least
        assert plan.residency == slots / (L * E)
        assert plan_of(spec, numel, torch.float32, expert_memory=slots * eb, pool="open").slots_per_layer == min(E, slots)
    assert plan_of(spec, numel, torch.float32, residency=0.3).pool_slots == math.ceil(0.3 * L * E - 1e-9)
    assert plan_of(spec, numel, torch.float32, expert_memory="1TiB").pool_slots == L * E
    assert plan_of(spec, numel, torch.float32).pool_slots == L * E
    with pytest.raises(specter.BudgetError, match=f"top-{k}"):
        plan_of(spec, numel, torch.float32, expert_memory=k * eb - 1)
    text = plan_of(spec, numel, torch.float32, expert_memory=(k + 1) * eb).table()
    assert f"shared: {k + 1} slots" in text and f"{k + 1} of {L * E}" in text
    with pytest.raises(specter.ConfigError, match="pool"):
        plan_of(spec, numel, torch.float32, pool="layers")


# ------------------------------------------------------------------------------ `specter plan` finds a way to run
CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "configs"


def described(name: str):
    from specter.loader import describe

    spec, dtype, numel, _ = describe(CONFIGS / name)
    return spec, dtype, numel


def test_describe_plans_a_yarn_config_from_config_alone():
    """DeepSeek-V2-Lite's config has YaRN rope scaling, whose tables cannot be built on the meta device."""
    spec, _, numel = described("DeepSeek-V2-Lite")
    assert spec.n_experts == 64 and numel > 15e9


@pytest.mark.parametrize("name,size", [("Mixtral-8x7B", "24GiB"), ("Qwen3-30B-A3B", "16GiB"), ("Qwen3-30B-A3B", "24GiB"),
                                       ("Phi-3.5-MoE", "24GiB"), ("DeepSeek-V2-Lite", "12GiB")])
def test_search_lists_only_what_fits_fastest_first(name, size):
    from specter.offload.plan import Option, fit, search

    spec, dtype, numel = described(name)
    budget = specter.sizes.parse_size(size)
    ways = search(spec, numel, dtype, size)
    assert ways and all(isinstance(o, Option) for o in ways)
    assert all(o.plan.total_bytes <= budget for o in ways)  # never a way that does not fit
    assert [o.tpot_s for o in ways] == sorted(o.tpot_s for o in ways)
    assert all(o.plan.pool_slots >= spec.top_k for o in ways if o.policy != "resident")
    drafted = [o for o in ways if o.draft_bits]
    assert drafted and all(o.plan.draft_bits == o.draft_bits for o in drafted)
    assert all(o.plan.draft_bytes == spec.n_moe_layers * spec.n_experts * plan_of(
        spec, numel, dtype, residency=1.0, draft_bits=o.draft_bits).draft_bytes // (spec.n_moe_layers * spec.n_experts)
        for o in drafted)
    bare = [o for o in ways if o.policy == "specter" and o.draft_bits is None]  # --k-max 0: no draft
    assert len(bare) == 1 and bare[0].plan.draft_bytes == 0 and bare[0].as_dict()["k_max"] == 0
    ctx = max(o.plan.context for o in ways if o.policy == "specter" and o.draft_bits)  # the model's own, or
    # shorter: Phi-3.5's 128K
    f = fit(spec, numel, dtype, size, policy="specter", context=ctx)
    assert f.fits and f.draft_bits in (4, 3, 2) and f.plan.total_bytes <= budget  # specter runs it


def test_specter_fits_mixtral_on_24gib_and_qwen3_on_16gib_only_with_a_narrower_draft():
    from specter.offload.plan import fit

    for name, size in (("Mixtral-8x7B", "24GiB"), ("Qwen3-30B-A3B", "16GiB")):
        spec, dtype, numel = described(name)
        assert not fit(spec, numel, dtype, size, draft_bits=4).fits, name  # the INT4 draft alone is too big
        assert fit(spec, numel, dtype, size).fits, name
    spec, dtype, numel = described("Mixtral-8x7B")  # by hand: (H4's packing) 4 / 3 / 2 bits
    sizes = [plan_of(spec, numel, dtype, residency=1.0, draft_bits=b).draft_bytes for b in (4, 3, 2)]
    assert [round(s / 2**30, 2) for s in sizes] == [22.31, 17.06, 11.81]
    with pytest.raises(specter.ConfigError, match="draft_bits"):
        plan_of(spec, numel, dtype, residency=1.0, draft_bits=8)


def test_predicted_speed_follows_the_bytes():
    """More slots never predict slower plain offloading; a device that holds everything predicts
    resident's step; without a draft the K chosen is 0."""
    from specter.offload.calibrate import load_profile
    from specter.offload.plan import predict_tpot

    spec, dtype, numel = described("Mixtral-8x7B")
    prof = load_profile("RTX4090-PCIe4")
    times = [predict_tpot(spec, plan_of(spec, numel, dtype, residency=r, draft=False), "on-demand", None, prof)
             for r in (0.1, 0.25, 0.5, 1.0)]
    assert [t for t, _ in times] == sorted((t for t, _ in times), reverse=True) and all(k == 0 for _, k in times)
    full = plan_of(spec, numel, dtype, residency=1.0, draft=False)
    assert predict_tpot(spec, full, "on-demand", None, prof)[0] == pytest.approx(
        predict_tpot(spec, full, "resident", None, prof)[0])


def test_plan_cli_ranks_the_ways_and_says_specter_runs(capsys):
    from specter.cli import main
    from specter.offload.plan import draft_expert_bytes

    assert main(["plan", "--model", str(CONFIGS / "Qwen3-30B-A3B"), "--device-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "specter runs in 16.0 GiB" in out and "ways to run in 16.0 GiB, fastest predicted first" in out
    assert main(["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device-memory", "24GiB", "--context", "4096",
                 "--link", "RTX4090-PCIe4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fits"] and res["draft_bits"] in (3, 2) and res["profile"] == "RTX4090-PCIe4"
    assert res["options"] and all(o["total_bytes"] <= 24 * 2**30 and o["context"] == 4096 for o in res["options"])
    spec = described("Mixtral-8x7B")[0]  # the host's draft cache is the chosen width's
    assert res["host"]["draft_cache_bytes"] == \
        spec.n_moe_layers * spec.n_experts * draft_expert_bytes(spec, res["draft_bits"], scale_bytes=4)
    assert main(["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device-memory", "24GiB", "--draft-bits", "4",
                 "--context", "4096"]) == 1  # status 1: it does not fit
    out = capsys.readouterr().out  # (it said "it runs at 4096", an INT2 or INT3 way's context)
    assert "specter does NOT fit" in out and "it runs at" not in out
    assert main(["plan", "--model", str(CONFIGS / "Qwen3-30B-A3B"), "--device-memory", "16GiB", "--policy",
                 "oracle"]) == 0  # (specter generate refuses it: bench only)
    assert "oracle (specter bench only: a bound, not a way to run) runs in 16.0 GiB" in capsys.readouterr().out


def test_plan_of_resident_in_a_budget_says_whether_every_expert_fits(capsys):
    """fit() planned resident as an offloading policy: "resident runs in 24.0 GiB: residency 24.2%". It
    keeps every expert on the device (search leaves it out where that does not fit)."""
    from specter.cli import main
    from specter.offload.plan import fit, search

    spec, dtype, numel = described("Mixtral-8x7B")
    for size, fits in (("24GiB", False), ("120GiB", True)):
        f = fit(spec, numel, dtype, size, policy="resident", context=4096)
        assert f.fits == fits == bool(search(spec, numel, dtype, size, context=4096, policies=["resident"]))
        assert f.minimum == f.full == plan_of(spec, numel, dtype, context=4096, draft=False).total_bytes
        assert fits == (f.plan is not None and f.plan.pool_slots == spec.n_moe_layers * spec.n_experts)
    assert main(["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--policy", "resident", "--device-memory", "24GiB",
                 "--context", "4096"]) == 1
    assert "resident does NOT fit in 24.0 GiB: it needs at least 87.5 GiB" in capsys.readouterr().out


def test_the_plan_predicts_specter_with_its_host_lane_only_where_it_runs_one(capsys):
    """specter on CUDA copies every miss unless --host-threads is given (Policy.computes_on_host): the
    ranking predicts it so, and says what the lane would give; with --host-threads (or on CPU) it is
    predicted with the lane; 0 turns it off on CPU too; host always has its lane. Mixtral-8x7B on a
    24 GiB RTX 4090 is where it decides the ranking: specter's 5.9% residency is slower than
    on-demand without the lane and fastest with it."""
    from specter.cli import main
    from specter.offload.plan import predict_tpot, search

    spec, dtype, numel = described("Mixtral-8x7B")
    ranked = {}
    for device, threads in (("cuda", None), ("cuda", 4), ("cpu", None), ("cpu", 0)):
        ways = search(spec, numel, dtype, "24GiB", profile="RTX4090-PCIe4", device=device, host_threads=threads)
        lanes = {o.policy: o.host_lane for o in ways}
        assert lanes["host"] and not lanes["on-demand"] and not lanes["spec-lru"], (device, threads)
        ranked[device, threads] = ([o.policy for o in ways], lanes["specter"])
    order, lane = ranked["cuda", None]
    assert not lane and order.index("specter") > order.index("on-demand") and order[0] == "host"
    assert ranked["cuda", 4] == ranked["cpu", None] and ranked["cpu", None][0][0] == "specter"
    assert ranked["cpu", 0] == ranked["cuda", None]
    plan = search(spec, numel, dtype, "24GiB", profile="RTX4090-PCIe4", policies=["specter"])[0].plan
    with_lane, without = (predict_tpot(spec, plan, "specter", plan.draft_bits, _profile("RTX4090-PCIe4"), lane)[0]
                          for lane in (True, False))
    assert with_lane < without

    args = ["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device", "cuda", "--link", "RTX4090-PCIe4"]
    assert main(args + ["--device-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "specter without its host lane" in out and "with its host lane (`--host-threads N`" in out
    assert main(args + ["--device-memory", "24GiB", "--host-threads", "4"]) == 0
    out = capsys.readouterr().out
    assert "specter without its host lane" not in out and "with its host lane (`--host-threads N`" not in out
    assert main(args + ["--expert-memory", "6GiB"]) == 0  # the plan alone: what each lane carries
    assert "no host lane (policy specter on cuda: opt-in there with --host-threads)" in capsys.readouterr().out
    assert main(args + ["--expert-memory", "6GiB", "--host-threads", "4"]) == 0
    assert "two lanes (policy specter)" in capsys.readouterr().out
    for threads, lane in (([], False), (["--host-threads", "4"], True)):  # --json says which
        assert main(args + ["--expert-memory", "6GiB", "--json"] + threads) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["host_lane"] is lane and (res["lanes"] is not None) is lane
    for bad, why in ((["--policy", "on-demand", "--host-threads", "2"], "computes no expert on the host"),
                     (["--policy", "host", "--host-threads", "0"], "needs host_threads >= 1")):
        assert main(args + ["--expert-memory", "6GiB"] + bad) != 0 and why in capsys.readouterr().err


def _profile(name):
    from specter.offload.calibrate import load_profile

    return load_profile(name)


def test_a_long_context_plan_says_what_a_shorter_one_would_give_the_pool():
    """Qwen3-30B-A3B on 24 GiB plans 3.75 GiB of KV cache for its 40960 tokens: the fit's tips say what
    --context 8192 gives the pool instead (as make_plan computes it); the bundled model's 2048 get no tip."""
    from specter.offload.plan import TIP_CONTEXT, fit, make_plan

    spec, dtype, numel = described("Qwen3-30B-A3B")
    f = fit(spec, numel, dtype, "24GiB", policy="specter")
    short = make_plan(spec, numel, dtype, device_memory="24GiB", context=TIP_CONTEXT, draft_bits=f.draft_bits)
    tip = [t for t in f.suggestions if "--context" in t]
    assert f.plan.context == 40960 and f.plan.kv_bytes == 40960 * 96 * 1024
    assert short.pool_slots > f.plan.pool_slots and len(tip) == 1
    assert f"holds {short.pool_slots} slots ({short.pool_slots - f.plan.pool_slots} more)" in tip[0], tip
    ckpt = specter.loader.open_checkpoint(specter.default_model_path())
    small = fit(ckpt.spec, ckpt.numel(), torch.float32, "30MiB", policy="specter")
    assert small.fits and not [t for t in small.suggestions if "--context" in t]


def test_the_all_resident_tip_says_what_the_draft_adds():
    """Mixtral-8x7B in 96 GiB: specter's tip said every expert resident needs 102.9 GiB, while resident
    (no draft) fits; the tip counted the INT2 draft and did not say so (a QA pass). It says both now."""
    from specter.offload.plan import fit
    from specter.sizes import format_size

    spec, dtype, numel = described("Mixtral-8x7B")
    f, resident = (fit(spec, numel, dtype, "96GiB", policy=p) for p in ("specter", "resident"))
    tip = next(t for t in f.suggestions if t.startswith("every expert resident"))
    assert f.draft_bits == 2 and resident.fits and f.full > 96 * 2**30 > resident.full
    assert tip == (f"every expert resident needs {format_size(f.full, up=True)} beside the INT2 draft "
                   f"({format_size(f.full - f.plan.draft_bytes, up=True)} without it: --policy resident)"), tip


def test_the_plans_draft_cache_is_the_bytes_the_cache_holds(tmp_path):
    """plan said 4.88 MiB for the bundled model's draft cache, counting bf16 scales; the cache keeps fp32."""
    from safetensors import safe_open

    from specter.loader import describe
    from specter.offload.plan import host_needs

    engine = specter.load(None, device="cpu", policy="specter", residency=0.5, draft_cache=str(tmp_path))
    engine.close()
    files = sorted(tmp_path.rglob("layer-*.safetensors"))
    held = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            held += sum(st.get_tensor(k).nbytes for k in st.keys())
    spec, dtype, _, _ = describe(specter.default_model_path())
    assert len(files) == spec.n_moe_layers and held == host_needs(spec, dtype, "cpu").draft_cache_bytes


def test_plan_over_ranks_narrows_the_draft_where_the_default_does_not_fit(capsys):
    """As the one-rank plan picks a draft width that fits: Mixtral over 2 ranks of 24 GiB fits at INT2, and
    the INT4 default does not (rank 0 holds the whole draft)."""
    from specter.cli import main

    args = ["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device-memory", "24GiB", "--ranks", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "draft INT2 (the widest that fits)" in out and out.count("; fits") == 2
    assert main(args + ["--draft-bits", "4"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


@pytest.mark.parametrize("policy, dtype, budget, tier", [
    ("on-demand", None, "40MiB", None), ("specter", None, "40MiB", None), ("on-demand", "bfloat16", "40MiB", None),
    ("specter", None, "50MiB", "0")])  # no tier: the INT2 draft is predicted fastest
def test_plan_with_a_device_budget_is_the_plan_the_engine_builds(capsys, monkeypatch, policy, dtype, budget, tier):
    """`plan --device-memory` planned its pool without the engine's pool arguments: no coded device tier
    with --compress-experts (40 MiB: 37 raw slots said, 2 and a tier of ~50 built), a CPU pool in the
    compute dtype, and it crashed where it chose a draft other than INT4 with --compress-experts. It
    now plans what `specter.load` builds with the same flags (--draft-bits: the width it chose, which
    it says to pass), and --dtype is plan's as generate's."""
    from specter.cli import main

    if tier is not None:
        monkeypatch.setenv("SPECTER_CODED_TIER", tier)
    flags = ["--device", "cpu", "--policy", policy, "--device-memory", budget, "--context", "512",
             "--compress-experts"] + (["--dtype", dtype] if dtype else [])
    assert main(["plan", *flags, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fits"]
    bits = res["draft_bits"] or 4
    assert (bits != 4) == (tier == "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = specter.load(None, device="cpu", policy=policy, device_memory=budget, context=512,
                              compress_experts=True, dtype=dtype,
                              **({"draft_bits": bits} if policy == "specter" else {}))
    try:
        built = engine.plan.as_dict()
        every = built["pool_slots"] == engine.spec.n_moe_layers * engine.spec.n_experts  # (bf16: every expert fits)
        assert any("every expert has a slot" in str(w.message) for w in seen) == every == (dtype == "bfloat16")
    finally:
        engine.close()
    keys = ("pool_slots", "slot_pool_bytes", "pool_dtype", "pool_rows", "tier_bytes", "dtype", "draft_bits")
    assert {k: res["plan"][k] for k in keys} == {k: built[k] for k in keys}
    assert (res["plan"]["tier_bytes"] > 0) == (dtype is None and tier is None)  # (bf16: every expert fits raw)
    assert abs(res["plan"]["tier_experts"] - built["tier_experts"]) <= 1  # measured ratio, the engine's estimate
    if bits != 4:  # the text path of the same plan, and what to pass for it
        assert main(["plan", *flags]) == 0
        assert f"run it with --draft-bits {bits}" in capsys.readouterr().out


def test_a_plan_that_does_not_fit_names_the_draft_its_need_is_for(capsys):
    """The need of a drafting policy that does not fit is for its narrowest draft: the headline says which
    (--draft-bits 2), and the host line's draft cache is that draft's (it was the INT4 one's)."""
    from specter.cli import main
    from specter.offload.plan import draft_expert_bytes

    args = ["plan", "--device", "cpu", "--policy", "specter", "--device-memory", "20MiB"]
    assert main(args + ["--json"]) == 1  # status 1: it does not fit (JSON too)
    res = json.loads(capsys.readouterr().out)
    spec = open_checkpoint(specter.default_model_path()).spec
    assert not res["fits"] and res["minimum_draft_bits"] == 2
    assert res["host"]["draft_cache_bytes"] == spec.n_moe_layers * spec.n_experts * draft_expert_bytes(spec, 2, 4)
    assert main(args) == 1
    assert "at 2048 tokens of context with --draft-bits 2" in capsys.readouterr().out


def test_the_least_device_budget_is_priced_as_the_pool_holds_it():
    """A re-check of this stop's floor: it priced one layer's top-k slots in the compute dtype, where a big
    CPU pool holds the bf16 store's (Mixtral: a budget of 3 bf16 slots was refused, as needing 2 fp32 ones);
    and plan's stated minimum left out the compiled verifier's KV scratch ("needs at least 10.9 GiB (0 bytes
    more)"). A budget of exactly the stated minimum fits; a byte less does not."""
    from specter.offload.plan import fit

    spec, sdt, numel = described("Mixtral-8x7B")
    cpu = dict(context=4096, draft=False, device=torch.device("cpu"), store_dtype=sdt)
    fixed = plan_of(spec, numel, torch.float32, residency=1.0, **cpu)
    budget = fixed.non_expert_bytes + fixed.kv_bytes + 3 * spec.expert_numel() * 2
    got = plan_of(spec, numel, torch.float32, device_memory=budget, **cpu)
    assert (got.pool_slots, got.pool_dtype) == (3, "bfloat16")
    for name, dtype, device, policy in (("Mixtral-8x7B", torch.float32, "cpu", "on-demand"),
                                        ("Qwen3-30B-A3B", torch.bfloat16, "cuda", "specter")):
        spec, sdt, numel = described(name)
        need = fit(spec, numel, dtype, "1GiB", policy=policy, context=4096, device=device, store_dtype=sdt).minimum
        at = fit(spec, numel, dtype, need, policy=policy, context=4096, device=device, store_dtype=sdt,
                 draft_bits=2 if policy == "specter" else None)
        below = fit(spec, numel, dtype, need - 1, policy=policy, context=4096, device=device, store_dtype=sdt,
                    draft_bits=2 if policy == "specter" else None)
        assert at.fits and not below.fits, name
        assert at.plan.kv_scratch == (32 if policy == "specter" else 0)


def test_a_draft_predicted_not_to_pay_is_not_tuned_but_named(capsys):
    """At 20 MiB on CUDA the bundled model's specter is predicted at K 0 (plain steps) at every width: the
    plan chose INT2 and said "predicted faster than INT4", a width for a draft it predicts never runs.
    It says the draft does not pay there and what runs without it (--k-max 0); the headline still names
    the width its table is for (a re-check: without it `plan && serve` got INT4's 19 slots, not 27)."""
    from specter.cli import main

    args = ["plan", "--device", "cuda", "--policy", "specter", "--device-memory", "20MiB"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fits"] and res["predicted_k"] == 0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the draft is predicted not to pay here" in out and "--k-max 0 runs specter without one" in out
    assert "draft INT2: run it with --draft-bits 2" in out and "predicted faster than INT" not in out
    assert main(args[:-1] + ["60MiB", "--json"]) == 0  # every expert resident: no slots to buy
    assert any("--policy resident runs without it" in t for t in json.loads(capsys.readouterr().out)["suggestions"])
    assert main(args[:-1] + ["30MiB", "--json"]) == 0  # a draft that pays keeps its tips
    res = json.loads(capsys.readouterr().out)
    assert res["predicted_k"] > 0 and not any("not to pay" in t for t in res["suggestions"])
    # where only a narrower draft fits (Mixtral in 24 GiB: INT4 alone is 22.3 GiB) the headline names the width
    # the load needs, K 0 or not (without it `plan && serve` loads INT4 and fails)
    mixtral = ["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device-memory", "24GiB", "--context", "4096"]
    assert main(mixtral) == 0
    assert "draft INT2: run it with --draft-bits 2" in capsys.readouterr().out
    # --k-max 0: the plan of the engine that makes no draft
    flags = ["--device", "cpu", "--policy", "specter", "--residency", "0.5", "--k-max", "0"]
    assert main(["plan", *flags, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    engine = specter.load(None, device="cpu", policy="specter", residency=0.5, k_max=0)
    try:
        assert said == {**engine.plan.as_dict(), **{k: said[k] for k in said if k not in engine.plan.as_dict()}}
    finally:
        engine.close()
    assert said["draft_bytes"] == 0 and said["host"]["draft_cache_bytes"] == 0


def test_plan_over_ranks_checks_what_one_rank_checks_and_says_its_draft(capsys, tiny):
    """`plan --ranks 2` took a context past the model's (capping its KV silently) and a draft width the
    model cannot pack, exiting 0 where the one-rank plan exits 2; its JSON left out the draft width it
    picked (text: "draft INT3 (the widest that fits)"). And a plan with every expert on the device
    reported a host lane the engine does not run."""
    from specter.cli import main

    qwen = ["plan", "--model", str(CONFIGS / "Qwen3-30B-A3B"), "--ranks", "2"]
    assert main(qwen + ["--residency", "0.5", "--context", "1000000"]) == 2
    assert "context" in capsys.readouterr().err
    assert main(qwen + ["--device-memory", "16GiB", "--context", "4096", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["draft_bits"] == 3 and all(r["fits"] for r in said["ranks"])
    assert json.loads((main(qwen + ["--policy", "on-demand", "--residency", "0.5", "--json"]),
                       capsys.readouterr().out)[1])["draft_bits"] is None
    path, _ = tiny("mixtral", hidden_size=48)  # 48 does not pack into INT3's groups
    assert main(["plan", "--model", str(path), "--ranks", "2", "--residency", "0.5", "--draft-bits", "3"]) == 2
    capsys.readouterr()
    assert main(["plan", "--device", "cpu", "--policy", "specter", "--json"]) == 0  # every expert resident
    assert json.loads(capsys.readouterr().out)["host_lane"] is False
    assert main(["plan", "--device", "cpu", "--policy", "specter"]) == 0  # and says why (not "opt-in there")
    assert "no host lane: every expert is on the device" in capsys.readouterr().out
    assert main(qwen + ["--device-memory", "16GiB", "--k-max", "0", "--json"]) == 0  # rank 0 holds no draft
    said = json.loads(capsys.readouterr().out)
    assert said["draft_bits"] is None and said["ranks"][0]["draft_bytes"] == 0
    assert main(qwen + ["--residency", "0.5", "--k-max", "0", "--draft-bits", "3"]) == 2
    assert "would be ignored" in capsys.readouterr().err
    graphs = {}
    for k in ("1", "32"):  # the CUDA graphs line at the --k-max asked for (widths 1, 2 at K_max 1)
        assert main(["plan", "--device", "cuda", "--residency", "0.5", "--k-max", k, "--json"]) == 0
        graphs[k] = json.loads(capsys.readouterr().out)["cuda_graphs"]["recordings"]
    assert graphs == {"1": 14, "32": 38}
    assert main(["plan", "--k-max", "0", "--draft-bits", "3"]) == 2 and "would be ignored" in capsys.readouterr().err


def test_the_advice_of_a_plan_that_does_not_fit_is_advice_that_fits(capsys):
    """Taken literally, each failed: the need was rounded to the nearest (3.17 GiB given back fell 3.3 MB
    short), "(it runs at N)" was the no-draft row's context (--k-max 0's), and "run without a draft,
    which needs X" was said where X was more than the budget too. And --link was ignored by the lanes'
    line (an unknown name taken) unless --device-memory was given."""
    import re

    from specter.cli import main
    from specter.sizes import format_size

    mixtral = ["plan", "--model", str(CONFIGS / "Mixtral-8x7B")]
    for budget, runs in (("10GiB", False), ("16GiB", True)):  # 10: only --k-max 0 runs (it said "it runs at")
        assert main(mixtral + ["--device-memory", budget]) == 1
        runs_at = re.search(r"\(it runs at (\d+):", capsys.readouterr().out)
        assert bool(runs_at) == runs, budget
        if runs_at:  # the context it names fits, with the draft
            assert main(mixtral + ["--device-memory", budget, "--context", runs_at[1]]) == 0
            capsys.readouterr()
    assert main(mixtral + ["--device-memory", "4GiB"]) == 1
    out = capsys.readouterr().out
    assert "run without a draft" not in out and "without a draft (--policy host, on-demand or next-layer) it needs " \
        "7.66 GiB, which does not fit either" in out
    need = re.search(r"it needs at least ([\d.]+ GiB) at (\d+) tokens of context with --draft-bits (\d)", out)
    assert need and need[1] == format_size(int(re.search(r'"minimum_bytes": (\d+)', _json(mixtral, "4GiB"))[1]),
                                           up=True)
    assert main(mixtral + ["--device-memory", need[1].replace(" ", ""), "--context", need[2], "--draft-bits",
                           need[3]]) == 0  # the need, given back as the budget, fits
    capsys.readouterr()
    lanes = ["plan", "--model", str(CONFIGS / "Mixtral-8x7B"), "--device", "cuda", "--residency", "0.25",
             "--host-threads", "8"]
    said = {}
    for link in ("RTX4090-PCIe4", "H200-PCIe5"):
        assert main(lanes + ["--link", link]) == 0
        said[link] = re.search(r"two lanes .*?: a plain step [^;]*", capsys.readouterr().out)[0]
    assert "RTX4090-PCIe4's link" in said["RTX4090-PCIe4"] and said["RTX4090-PCIe4"] != said["H200-PCIe5"]
    assert main(lanes + ["--link", "nope"]) == 2 and "unknown link profile 'nope'" in capsys.readouterr().err


def _json(args, budget):
    from specter.cli import main
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(args + ["--device-memory", budget, "--json"])
    return buf.getvalue()


def test_format_size_rounds_up_when_asked():
    from specter.sizes import format_size

    assert format_size(3 * 2 ** 30 + 1) == "3.00 GiB" and format_size(3 * 2 ** 30 + 1, up=True) == "3.01 GiB"
    assert format_size(6 * 2 ** 30, up=True) == "6.00 GiB" and format_size(10 * 2 ** 30 - 1, up=True) == "10.00 GiB"
    assert format_size(1000, up=True) == "1000 B"
