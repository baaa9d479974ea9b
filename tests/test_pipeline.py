"""The layer pipeline (specter/pipeline/): stages, and 2- and 3-rank runs over gloo on the CPU that
must give one process's tokens; a mismatch or a dead rank fails every other rank, never hangs.

Ranks are subprocesses given torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) on a
free port; each launch runs several generations, so the whole file starts few processes."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import specter
from specter.loader import open_checkpoint
from specter.pipeline.group import PipelineError
from specter.pipeline.stages import make_stages, split_layers
from specter.speculative.governor import Governor
from specter.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("qwen3_moe", "deepseek_v2")  # GQA + every layer MoE; MLA + a dense first layer + a shared expert
GREEDY, SEEDED = dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=7)
RUNS = (("resident", None, GREEDY), ("resident", None, SEEDED), ("on-demand", 0.5, GREEDY),
        ("on-demand", 0.5, SEEDED), ("next-layer", 0.5, GREEDY), ("host", 0.5, GREEDY))
# the drafting policies: (policy, residency, sampling, K fixed on both sides or None for the adaptive governor,
# optimistic drafting: rank 0 drafts the next cycle while the others verify, greedy only)
SPEC_RUNS = (("spec-lru", 0.5, GREEDY, 3, False), ("specter", 0.5, GREEDY, 3, False), ("specter", 0.5, SEEDED, 2, True),
             ("specter", 0.5, GREEDY, None, True), ("spec-lru", 0.5, GREEDY, 2, True), ("specter", 0.5, GREEDY, 2, True))
SPEC_STATS = ("drafted_tokens", "accepted_tokens", "cycles")
PROMPT, NEW = [1, 5, 9, 17, 33], 10

RANKS = r"""
import json, sys
import torch
from specter.pipeline.decoder import serve_stage
from specter.pipeline.group import join
from specter.pipeline.launch import open_pipeline
from specter.speculative.governor import Governor

cases, out = json.loads(sys.argv[1]), sys.argv[2]
group = join("cpu", None, 120.0)  # an initialised group: open_pipeline joins it (a loaded machine: slow loads)
results = []


def slowed(rank, what, seconds):  # rank `rank`'s stage steps ("forward") or draft steps ("draft_forward")
    import time
    import specter.pipeline.stage as ps

    orig = getattr(ps.StageModel, what)
    if group.rank == rank:
        def slow(self, *a, **k):
            time.sleep(seconds)
            return orig(self, *a, **k)
        setattr(ps.StageModel, what, slow)
    return lambda: setattr(ps.StageModel, what, orig)


for c in cases:
    restore = slowed(*c["slow"]) if c.get("slow") else (lambda: None)
    g, engine, stage = open_pipeline(c["model"], device="cpu", policy=c["policy"], residency=c["residency"],
                                     threads=1, k_max=c.get("k_max"), compress_experts=c.get("compress", False),
                                     draft_cache=c.get("draft_cache"))
    if engine is None:
        serve_stage(stage, g)
        restore()
        continue
    if c.get("k") is not None:  # rank 0's governor decides every cycle's K for all the ranks
        engine.decoder.governor = Governor(32, fixed=c["k"])
    engine.decoder.optimistic = c.get("optimistic", False)
    r = engine.generate(c["prompt"], c["new"], **c["sampling"])
    if c.get("optimistic"):  # rank 0's K/V of every layer at the committed positions, for the test to compare
        n, cache = len(c["prompt"]) + len(r.token_ids) - 1, engine.decoder.stage.cache
        torch.save([t[:, :n].clone() for t in cache.k + cache.v], f"{out}.{len(results)}.kv")
    engine.decoder.finish()
    restore()
    results.append(dict(tokens=r.token_ids, pipeline=r.stats["pipeline"], hits=r.stats["expert_hits"],
                        misses=r.stats["expert_misses"], stats=r.stats, whole=engine.decoder.stage.whole,
                        groups=len(torch.distributed.distributed_c10d._world.pg_map)))  # the startup groups gone
if group.rank == 0:
    json.dump(results, open(out, "w"))
group.close()
"""

DIES = r"""
import os, sys, time
import specter.pipeline.stage as stage
from specter.cli import main
from specter.speculative.draft import PrefetchPlanner

run = stage.StageModel.forward

def forward(self, x, start, experts=None, logits_for="last"):  # this rank's first step: it dies, or
    if sys.argv[1] == "hang":                                  # hangs (for 2 timeouts, then dies)
        time.sleep(2 * float(sys.argv[sys.argv.index("--pipeline-timeout") + 1]))
    os._exit(3)

if sys.argv[1] == "draft":  # at its first lookahead row from rank 0's draft (mid-cycle)
    PrefetchPlanner.begin_cycle = lambda *a, **k: os._exit(3)
elif sys.argv[1] == "slow":  # starts later than the others by 2 timeouts, then runs as they do
    time.sleep(2 * float(sys.argv[sys.argv.index("--pipeline-timeout") + 1]))
else:
    stage.StageModel.forward = forward
sys.exit(main(sys.argv[2:]))
"""

NO_COLLECTIVES = r"""
import sys
import torch.distributed as dist
from specter.cli import main

def refused(*a, **k):  # gloo frees a collective's tensors on its worker thread after the call returned: an
    raise AssertionError("the pipeline called a collective")  # abort at exit when Python is finalizing

for name in ("gather_object", "all_gather_object", "broadcast_object_list", "gather", "all_gather", "broadcast",
             "all_reduce", "barrier"):
    setattr(dist, name, refused)
sys.exit(main(sys.argv[1:]))
"""

FIXED_K = r"""
import sys
import specter.speculative.governor as governor
from specter.cli import main

init = governor.Governor.__init__
governor.Governor.__init__ = lambda self, k_max, **kw: init(self, k_max, fixed=2)  # rank 0 drafts at once
sys.exit(main(sys.argv[1:]))
"""


needs_default = pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                                   reason="the bundled default model is not built")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argvs: list[list[str]], stdin=None, interruptible: bool = False) -> list[subprocess.Popen]:
    """One process per rank (argvs[r] after `python`), given torchrun's environment; `stdin`: each
    rank's (default: this process's). `interruptible`: SIGINT at its default, so Python raises
    KeyboardInterrupt for it, even where this process ignores it (a suite run in the background)."""
    n, port = len(argvs), _port()
    procs = []
    for r, argv in enumerate(argvs):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, stdin=None if stdin is None else stdin[r],
                                      preexec_fn=_default_sigint if interruptible else None))
    return procs


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _ranks(argvs: list[list[str]], stdin=None, interruptible: bool = False):
    """`_start`'s processes; any still running on the way out is killed, and every one reaped."""
    procs = _start(argvs, stdin, interruptible)
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


HANG = 600  # seconds: a hang guard, not a speed check (a loaded 2-core machine started ranks 4-8x slower)


def _launch(argvs: list[list[str]], timeout: float = 120) -> list[tuple[int | None, str, str]]:
    """Runs one process per rank (argvs[r] after `python`); (returncode, stdout, stderr) per rank. A
    rank still running at `timeout` (a hang) is killed and reported with returncode None."""
    t0 = time.monotonic()
    procs = _start(argvs)
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            out.append((p.returncode, so, se))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            out.append((None, so, se))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    paths = {}
    for arch in ARCHS:
        paths[arch] = tmp_path_factory.mktemp(f"pipe-{arch}")
        # an odd vocabulary for one: the logits' bytes on the wire are not a multiple of 8
        make_tiny_checkpoint(paths[arch], arch, **({"vocab_size": 131} if arch == "deepseek_v2" else {}))
    return paths


# ---------------------------------------------------------------------------------------- stages
def test_split_layers_is_the_balanced_contiguous_cover():
    import itertools

    for sizes in ([5, 1, 1, 1, 5], [3, 3, 3], [1, 9, 1, 1, 1, 1], [4, 4, 4, 4, 4, 4, 4]):
        for n in range(1, len(sizes) + 1):
            for first, last, shared in ((0, 0, None), (7, 2, None), (9, 2, [1] * len(sizes))):
                got = split_layers(sizes, n, first, last, shared)
                assert got[0][0] == 0 and got[-1][1] == len(sizes) and len(got) == n
                assert all(a < b for a, b in got) and all(got[i][1] == got[i + 1][0] for i in range(n - 1))

                def worst(ranges):  # the first range counts the shared bytes of its layers once (in `first`)
                    return max(sum(sizes[a:b]) - (sum(shared[a:b]) if shared and i == 0 else 0)
                               + (first if i == 0 else 0) + (last if i == n - 1 else 0)
                               for i, (a, b) in enumerate(ranges))

                best = min(worst(list(zip((0,) + cuts, cuts + (len(sizes),))))
                           for cuts in itertools.combinations(range(1, len(sizes)), n - 1))
                assert worst(got) == best
    with pytest.raises(PipelineError, match="at most 3 ranks"):
        split_layers([1, 1, 1], 4)


def test_options_a_pipeline_would_ignore_are_refused():
    from specter.errors import ConfigError
    from specter.pipeline.launch import check_options

    check_options("on-demand", {})
    with pytest.raises(ConfigError, match="--k-max does not apply"):
        check_options("on-demand", {"k_max": 3})
    check_options("specter", {"k_max": 3})  # the drafting policies read --k-max
    with pytest.raises(ConfigError, match="not pipelined"):
        check_options("oracle", {})


def test_under_torchrun_a_flag_the_policy_ignores_is_refused_and_bench_takes_the_context(monkeypatch):
    """Under torchrun `generate --policy resident --compress-experts` generated (one process refuses the flag),
    and `bench --context 8` benched at the model's context: the pipeline's bench never passed it on."""
    import importlib

    from specter.cli import build_parser
    from specter.errors import ConfigError
    from specter.pipeline import launch

    bench = importlib.import_module("specter.pipeline.bench")  # (specter.pipeline.bench is also a function)

    args = build_parser().parse_args(["generate", "x", "--policy", "resident", "--compress-experts"])
    with pytest.raises(ConfigError, match="policy 'resident' does not use --compress-experts"):
        launch.run(args, lambda engine: 0)
    for argv, match in ((["--policy", "on-demand", "--k-max", "0"], "--k-max does not apply"),  # (0 was dropped)
                        (["--policy", "on-demand", "--draft-cache", "off"], "--draft-cache would be ignored"),
                        (["--k-max", "0", "--draft-cache", "off"], "--k-max 0 makes no draft"),
                        (["--k-max", "0", "--draft-bits", "3"], "--k-max 0 makes no draft")):
        with pytest.raises(ConfigError, match=match):  # refused under torchrun as in one process
            launch.run(build_parser().parse_args(["generate", "x", *argv]), lambda engine: 0)
    args = build_parser().parse_args(["bench", "--policies", "resident", "--compress-experts"])
    with pytest.raises(ConfigError, match="none of the policies resident uses --compress-experts|policy 'resident' "
                                          "does not use --compress-experts"):
        bench.run(args)
    opened = []

    def open_pipeline(*a, **kw):
        opened.append(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr(bench, "open_pipeline", open_pipeline)
    with pytest.raises(ConfigError, match="stop here"):
        bench.run(build_parser().parse_args(["bench", "--policies", "on-demand", "--context", "8"]))
    assert opened[0]["context"] == 8


def test_host_threads_size_each_ranks_host_lane(ckpts):
    """--host-threads under a pipeline: each stage's host lane (policy host's, specter's LaneChoice)
    gets that many threads, as one process's does; a policy without a host lane refuses it."""
    import torch

    from specter.errors import ConfigError
    from specter.pipeline.load import load_stage

    path = ckpts["qwen3_moe"]
    spec = open_checkpoint(path).spec
    last = make_stages(spec, 2, 4, drafts=True)[1]
    st = load_stage(path, last, torch.device("cpu"), policy="host", residency=0.5, threads=1, host_threads=3)
    assert st.provider.inner.lane.threads == 3
    st.close()
    st = load_stage(path, last, torch.device("cpu"), policy="specter", residency=0.5, threads=1, host_threads=2)
    assert st.mgr.host_lane.threads == 2 and st.mgr.host_choice is not None
    st.close()
    st = load_stage(path, last, torch.device("cpu"), policy="specter", residency=0.5, threads=1)
    assert st.mgr.host_lane.threads == 1  # default: the rank's own threads
    st.close()
    with pytest.raises(ConfigError, match="computes no expert on the host"):
        load_stage(path, last, torch.device("cpu"), policy="on-demand", residency=0.5, host_threads=2)


def test_stages_number_moe_layers_as_the_provider_does(ckpts):
    spec = open_checkpoint(ckpts["deepseek_v2"]).spec  # layer 0 dense, 1 and 2 MoE
    stages = make_stages(spec, 3, 4)
    assert [(s.first, s.last, s.moe_first, s.moe_last) for s in stages] == [(0, 1, 0, 0), (1, 2, 0, 1), (2, 3, 1, 2)]
    two = make_stages(spec, 2, 4)  # the dense layer is light: the first stage takes two layers
    assert [(s.first, s.last) for s in two] == [(0, 2), (2, 3)]
    # a drafting policy's first stage also holds the whole draft: every layer's non-expert weights and
    # INT4 experts, which outweigh the second MoE layer here
    assert [(s.first, s.last) for s in make_stages(spec, 2, 4, drafts=True)] == [(0, 1), (1, 3)]


def test_a_given_partition_overrides_the_byte_balance(ckpts, monkeypatch):
    """SPECTER_PIPELINE_LAYERS counts each rank's decoder layers, in place of the byte-balanced split;
    a count per rank, each at least 1, covering every layer, or a clear error."""
    spec = open_checkpoint(ckpts["deepseek_v2"]).spec  # layer 0 dense, 1 and 2 MoE
    monkeypatch.setenv("SPECTER_PIPELINE_LAYERS", "2,1")
    got = make_stages(spec, 2, 4, drafts=True)  # byte-balanced it would be (0, 1), (1, 3)
    assert [(s.first, s.last, s.moe_first, s.moe_last) for s in got] == [(0, 2, 0, 1), (2, 3, 1, 2)]
    for bad in ("1,1", "3,0", "1,1,1", "two,one"):
        monkeypatch.setenv("SPECTER_PIPELINE_LAYERS", bad)
        with pytest.raises(PipelineError, match="give 2 comma-separated counts"):
            make_stages(spec, 2, 4)
    monkeypatch.setenv("SPECTER_PIPELINE_LAYERS", "")  # empty: as unset, the byte balance
    assert [(s.first, s.last) for s in make_stages(spec, 2, 4, drafts=True)] == [(0, 1), (1, 3)]


def test_stages_read_only_their_tensors_and_chain_to_the_models_logits(ckpts):
    """In one process, no group: each stage loads its own tensors only (nothing left on the meta
    device, its own MoE layers in its store), and the stages run one after the other give the whole
    model's logits, prefill and steps, bit for bit."""
    import torch

    from specter.layers import KVCache
    from specter.pipeline.load import load_stage

    path = ckpts["deepseek_v2"]
    spec = open_checkpoint(path).spec
    stages = [load_stage(path, s, torch.device("cpu"), policy="on-demand", residency=0.5)
              for s in make_stages(spec, 3, 4)]
    for st in stages:
        assert not any(p.is_meta for p in st.model.parameters())
        n_moe = st.stage.moe_last - st.stage.moe_first
        assert (st.provider is None) == (n_moe == 0) and (st.provider is None or len(st.provider.inner.store) == n_moe)
        st.begin(16)
    ref = specter.load(path, device="cpu", policy="resident")
    cache = KVCache(spec, 16, torch.device("cpu"), torch.float32)
    start = 0
    for tokens in ([1, 5, 9, 17, 33], [40], [2]):
        t = torch.tensor(tokens)
        want = ref.model(t, start, cache, ref.decoder.experts, logits_for="last")
        x = t
        for st in stages:
            x = st.forward(x, start)
        assert torch.equal(x, want)
        start += len(tokens)
    ref.close()
    for st in stages:
        st.close()


def test_plan_ranks_says_what_each_rank_holds_as_the_ranks_load_it(ckpts, capsys):
    """`specter plan --ranks N`: one row per rank covering every layer; the slot pool each row gives is
    the one that rank's load builds (a byte budget each rank's own, a residency its layers' share)."""
    import torch

    from specter.cli import main
    from specter.pipeline.load import load_stage

    path = ckpts["qwen3_moe"]
    spec = open_checkpoint(path).spec
    for budget in (["--expert-memory", "120KiB"], ["--residency", "0.5"]):
        assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "on-demand", "--device", "cpu",
                     "--json", *budget]) == 0
        rows = json.loads(capsys.readouterr().out)["ranks"]
        assert [r["layers"] for r in rows] == [[s.first, s.last] for s in make_stages(spec, 2, 4)]
        kw = {budget[0][2:].replace("-", "_"): budget[1] if budget[0] == "--expert-memory" else float(budget[1])}
        for r, s in zip(rows, make_stages(spec, 2, 4)):
            st = load_stage(path, s, torch.device("cpu"), policy="on-demand", **kw)
            assert st.provider.inner.slots.pool_slots == r["pool_slots"] and r["fits"]
            # each layer may hold its share of the rank's own pool (not of one device's pool over every layer)
            pool, n = r["pool_slots"], r["moe_layers"]
            assert st.provider.inner.slots.n_slots == min(spec.n_experts, pool, max(spec.top_k, -(-pool // n)))
            st.close()
    assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "on-demand", "--device", "cpu",
                 "--device-memory", "1KiB"]) == 1  # status 1: it does not fit
    assert capsys.readouterr().out.count("does NOT fit") == 2
    assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "oracle"]) == 2  # not pipelined
    assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "specter", "--device", "cpu", "--json",
                 "--expert-memory", "120KiB"]) == 0  # rank 0's device also holds the whole draft
    rows = json.loads(capsys.readouterr().out)["ranks"]
    assert all(r["total_bytes"] == r["non_expert_bytes"] + r["kv_bytes"] + r["draft_bytes"] + r["pool_bytes"]
               for r in rows)
    plain = json.loads((main(["plan", "--model", str(path), "--ranks", "2", "--policy", "on-demand", "--device",
                              "cpu", "--json", "--expert-memory", "120KiB"]), capsys.readouterr().out)[1])["ranks"]
    assert rows[0]["draft_bytes"] > 0 and rows[1]["draft_bytes"] == 0
    # the draft counted on rank 0: it takes fewer layers than under on-demand, as the ranks load them
    assert [r["layers"] for r in rows] == [[s.first, s.last] for s in make_stages(spec, 2, 4, drafts=True)] \
        == [[0, 1], [1, 3]] != [r["layers"] for r in plain]
    assert rows[0]["non_expert_bytes"] == sum(r["non_expert_bytes"] for r in plain)  # every layer's
    assert rows[0]["kv_bytes"] == sum(r["kv_bytes"] for r in plain)


def _device_memory(spec, stages, drafts: bool, slots: int) -> tuple[int, list[int], int]:
    """(a device budget leaving the fullest rank `slots` fp32 expert slots, each rank's fixed bytes, a slot's bytes)."""
    from specter.pipeline.stages import stage_device_bytes

    fixed = [sum(stage_device_bytes(spec, s, 4, drafts)) for s in stages]
    slot = spec.expert_numel() * 4
    return max(fixed) + slots * slot, fixed, slot


def test_device_memory_is_each_ranks_whole_device(ckpts, capsys):
    """--device-memory under torchrun is each rank's own device: its pool takes what its stage's weights,
    KV cache and (rank 0 of a drafting policy) whole draft leave, as `plan --ranks` says; a device too
    small fails on the rank it is too small for, naming it and the budget."""
    from specter.cli import main
    from specter.errors import BudgetError
    from specter.pipeline.load import load_stage

    path = ckpts["qwen3_moe"]
    spec = open_checkpoint(path).spec
    for policy in ("on-demand", "specter"):
        drafts = policy == "specter"
        stages = make_stages(spec, 2, 4, drafts=drafts)
        memory, fixed, slot = _device_memory(spec, stages, drafts, 3)
        assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", policy, "--device", "cpu", "--json",
                     "--device-memory", str(memory)]) == 0
        rows = json.loads(capsys.readouterr().out)["ranks"]
        assert (rows[0]["draft_bytes"] > 0) == drafts and rows[1]["draft_bytes"] == 0
        for r, s, f in zip(rows, stages, fixed):
            assert r["pool_slots"] == min(r["experts"], (memory - f) // slot) and r["fits"], (policy, r)
            assert f == r["non_expert_bytes"] + r["kv_bytes"] + r["draft_bytes"] and r["total_bytes"] <= memory
            st = load_stage(path, s, torch.device("cpu"), policy=policy, device_memory=memory, draft_cache="off")
            assert st.provider.inner.slots.pool_slots == r["pool_slots"], (policy, r)
            st.close()
    stages = make_stages(spec, 2, 4)
    memory, _, _ = _device_memory(spec, stages, False, 2)  # the fullest rank: its top-2 only
    short, whole = (load_stage(path, stages[1], torch.device("cpu"), policy="on-demand", device_memory=memory,
                               context=context, draft_cache="off") for context in (16, None))  # KV for 16 tokens
    assert whole.provider.inner.slots.pool_slots < short.provider.inner.slots.pool_slots, "no slot for the KV saved"
    short.close()
    whole.close()
    stages = make_stages(spec, 2, 4, drafts=True)
    memory, fixed, slot = _device_memory(spec, stages, True, 0)
    with pytest.raises(BudgetError,
                       match=r"rank 0: device_memory .* cannot even hold .* whole draft .*without the draft"):
        load_stage(path, stages[0], torch.device("cpu"), policy="specter", device_memory=fixed[0] - 1)
    with pytest.raises(BudgetError,
                       match=r"rank 0: device_memory .* leaves its expert pool .* top-2.*without the draft"):
        load_stage(path, stages[0], torch.device("cpu"), policy="specter", device_memory=fixed[0] + slot)
    with pytest.raises(specter.ConfigError, match="one budget"):
        load_stage(path, stages[1], torch.device("cpu"), policy="on-demand", device_memory=memory, residency=0.5)


def test_plan_ranks_tips_a_drafting_policy_whose_device_would_hold_every_expert_without_the_draft(capsys):
    """At 33 MiB a rank (the bundled model, two ranks) on-demand holds every expert on both ranks and
    specter's draft leaves rank 1 short: the plan says so (text and JSON); no tip for on-demand itself,
    nor where neither holds everything."""
    from specter.cli import main

    def plan(policy, memory, *extra):
        assert main(["plan", "--ranks", "2", "--policy", policy, "--device", "cpu", "--device-memory", memory,
                     *extra]) == (1 if memory == "20MiB" else 0)  # (20 MiB: a rank does not fit)
        return capsys.readouterr().out

    got = json.loads(plan("specter", "33MiB", "--json"))
    plain = json.loads(plan("on-demand", "33MiB", "--json"))
    assert all(r["pool_slots"] == r["experts"] for r in plain["ranks"]) and "tip" not in plain
    short = [r for r in got["ranks"] if r["pool_slots"] < r["experts"]]
    assert short and f"rank {short[0]['rank']} {short[0]['pool_slots']} of {short[0]['experts']}" in got["tip"]
    assert "tip: without a draft" in plan("specter", "33MiB")
    assert "tip:" not in plan("specter", "20MiB")  # on-demand does not hold everything there either


def test_a_gpu_without_a_budget_gives_each_rank_what_its_free_memory_leaves(ckpts, monkeypatch):
    """On CUDA with no budget each rank's pool takes 90% of its GPU's free memory less its stage's weights, KV
    cache and (rank 0 of a drafting policy) whole draft: the same sum as --device-memory. (It left the draft
    out, over-filling rank 0's GPU by the draft's size: ~24 GB for Mixtral's.)"""
    from specter.pipeline.stages import stage_budget, stage_device_bytes

    spec = open_checkpoint(ckpts["qwen3_moe"]).spec
    free = 10 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    cuda = torch.device("cuda")
    for drafts in (False, True):
        for s in make_stages(spec, 2, 2, drafts=drafts):
            budget, own = stage_budget(spec, s, 2, cuda, drafts=drafts)
            assert own and budget == int(free * 0.9) - sum(stage_device_bytes(spec, s, 2, drafts))
            assert budget == stage_budget(spec, s, 2, cuda, device_memory=int(free * 0.9), drafts=drafts)[0]
            if drafts and s.is_first:
                assert stage_device_bytes(spec, s, 2, drafts)[2] > 0  # the draft is counted
    s = make_stages(spec, 2, 2)[1]
    assert stage_budget(spec, s, 2, cuda, residency=0.5) == (None, False)  # a residency: the model's pool shared
    assert stage_budget(spec, s, 2, torch.device("cpu")) == (None, False)  # CPU with none: every expert resident


def test_plan_ranks_compress_experts_says_what_each_rank_holds_as_the_ranks_load_it(tmp_path, capsys):
    """`plan --ranks --compress-experts`: each rank's host store is its own layers' coded bytes, with the
    raw copy a CPU rank keeps beside it (the plan left it out), and its slot pool and compressed device
    tier are the ones its load builds."""
    from specter.cli import main
    from specter.offload.coded import store_nbytes
    from specter.pipeline.load import load_stage

    path = tmp_path / "bf16"
    make_tiny_checkpoint(path, "qwen3_moe", dtype=torch.bfloat16)
    spec = open_checkpoint(path).spec
    for policy, budget in (("on-demand", ["--residency", "0.5"]), ("on-demand", ["--expert-memory", "120KiB"]),
                           ("specter", ["--residency", "0.5"]), ("host", ["--residency", "0.5"])):
        assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", policy, "--device", "cpu", "--json",
                     "--compress-experts", *budget]) == 0
        rows = json.loads(capsys.readouterr().out)["ranks"]
        raw = [r["moe_layers"] * spec.n_experts * spec.expert_numel() * 2 for r in rows]
        kw = {budget[0][2:].replace("-", "_"): budget[1] if budget[0] == "--expert-memory" else float(budget[1])}
        stages = make_stages(spec, 2, 2, drafts=policy == "specter")
        assert [r["layers"] for r in rows] == [[s.first, s.last] for s in stages]
        for r, s, n in zip(rows, stages, raw):
            st = load_stage(path, s, torch.device("cpu"), policy=policy, compress_experts=True, draft_cache="off", **kw)
            mgr = st.provider.inner
            mgr = getattr(mgr, "inner", mgr)  # policy host: HostExperts over the manager
            assert mgr.slots.pool_slots == r["pool_slots"] and r["fits"], (policy, budget, r)
            assert 0 < r["store_bytes"] == store_nbytes(mgr.store) < n, (r, n)
            kept = mgr.store[0].w13.rows is not None  # the rank's raw copy beside its coded store (left out)
            assert r["raw_rows_bytes"] == (n if kept else 0) and kept, (policy, budget, r)
            tier = getattr(mgr, "tier", None)
            assert r["tier_bytes"] == (tier.capacity if tier is not None else 0), (policy, budget, r)
            if budget[0] == "--residency":  # the host policy copies nothing after warm-up: no tier; specter's
                assert (r["tier_bytes"] > 0) == (policy == "on-demand"), r  # raw slots hold a verification's
                # working set (top-k x 5), as one process's do: at 0.5 no tier (the ranks planned as plain
                # decoding, 2 raw slots and a tier, where one process keeps 12 raw)
            assert r["total_bytes"] == r["non_expert_bytes"] + r["kv_bytes"] + r["draft_bytes"] + r["pool_bytes"] \
                + r["tier_bytes"]
            st.close()
    assert main(["plan", "--model", str(path), "--ranks", "2", "--device", "cpu", "--residency", "0.5",
                 "--compress-experts"]) == 0
    assert "losslessly coded" in capsys.readouterr().out
    # a rank's own budget that holds every expert of its layers raw: all raw, no tier (the whole model's plan
    # split it into top-k slots and a tier, which decoded nearly every use: 1.9x one rank's raw TPOT)
    mine = max(s.moe_last - s.moe_first for s in make_stages(spec, 2, 2))
    every = str(mine * spec.n_experts * spec.expert_numel() * 4)  # (fp32 slots on CPU)
    assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "on-demand", "--device", "cpu", "--json",
                 "--compress-experts", "--expert-memory", every]) == 0
    for r, s in zip(json.loads(capsys.readouterr().out)["ranks"], make_stages(spec, 2, 2)):
        assert r["tier_bytes"] == 0 and r["pool_slots"] == r["experts"], r
        st = load_stage(path, s, torch.device("cpu"), policy="on-demand", compress_experts=True, draft_cache="off",
                        expert_memory=every)
        mgr = st.provider.inner
        assert getattr(mgr, "tier", None) is None and mgr.slots.pool_slots == r["experts"]
        st.close()


# ------------------------------------------------------------------------------- token identity
@pytest.mark.parametrize("world", [2, 3])
def test_pipelines_give_one_process_tokens(ckpts, tmp_path, world):
    """Every policy: the tokens of one process. The drafting ones with K fixed also draft and accept
    exactly what one process does, and verify the same experts (their uses summed over the ranks);
    with the adaptive governor (K = 0 steps with next-layer guesses among them) the greedy tokens."""
    cases = [dict(model=str(ckpts[a]), policy=p, residency=res, prompt=PROMPT, new=NEW, sampling=s)
             for a in ARCHS for p, res, s in RUNS]
    cases += [dict(model=str(ckpts[a]), policy=p, residency=res, prompt=PROMPT, new=NEW, sampling=s, k=k, optimistic=o)
              for a in ARCHS for p, res, s, k, o in SPEC_RUNS]
    out = tmp_path / "results.json"
    ranks = _launch([["-c", RANKS, json.dumps(cases), str(out)]] * world, timeout=240)
    assert all(r[0] == 0 for r in ranks), [r[2][-2000:] for r in ranks]
    got = json.loads(out.read_text())
    assert len(got) == len(cases)
    for i, (c, g) in enumerate(zip(cases, got)):
        engine = specter.load(c["model"], device="cpu", policy=c["policy"], residency=c["residency"], threads=1)
        if c.get("k") is not None:
            engine.decoder.governor = Governor(32, fixed=c["k"])
        ref = engine.generate(PROMPT, NEW, **c["sampling"])  # a fresh engine, as each case's pipeline is
        ref_kv = engine.decoder._cache if c.get("optimistic") else None
        engine.close()
        assert g["tokens"] == ref.token_ids, c
        if ref_kv is not None:  # the target's K/V at every committed position, every layer (a pre-draft's
            # step at a verified position must not leave the draft's there); verified in other widths: close
            got = torch.load(f"{out}.{i}.kv")
            want = [t[:, :got[0].shape[1]] for t in ref_kv.k + ref_kv.v]
            worst = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, want))
            assert worst < 1e-5, (c, worst)
        layers = g["pipeline"]["layers"]
        assert g["pipeline"]["ranks"] == world and len(layers) == world
        assert layers[0][0] == 0 and layers[-1][1] == 3 and all(layers[i][1] == layers[i + 1][0]
                                                               for i in range(world - 1))
        if "k" not in c:  # plain decoding: the prefill, then one step a token after the first
            assert g["pipeline"]["round_trips"] == NEW
        if c["policy"] != "resident" and c.get("k", 0) is not None:  # every rank's expert uses counted once:
            assert g["hits"] + g["misses"] == ref.stats["expert_hits"] + ref.stats["expert_misses"] > 0  # one process's
        opt = g["pipeline"].get("optimistic")
        if c.get("optimistic") and c["sampling"] == GREEDY:  # rank 0 drafted each next cycle during verification
            if c.get("k"):  # the tiny models at K = 2: some cycles accept all K and the target's token is the
                # draft's guess (rank 0 keeps the pre-draft and verifies it next), others do not (discarded):
                # the tokens above are one process's both ways
                assert opt["kept"] > 0 and opt["pre_drafted"] > opt["kept"] and opt["used_tokens"] > 0, opt
                assert g["pipeline"]["round_trips"] == 1 + g["stats"]["cycles"]
            continue  # not one process's cycles: a pre-draft reads the draft's own K/V of the later stages' layers
        assert not opt or not opt["pre_drafted"], opt  # sampled: never optimistic (its draws would move)
        if c.get("k"):  # the same cycles: drafted (so speculation ran across the stages) and accepted alike
            assert [g["stats"][s] for s in SPEC_STATS] == [ref.stats[s] for s in SPEC_STATS], c
            # a round trip through every stage: the prefill, each verification or plain step (rank 0 drafts)
            assert g["pipeline"]["round_trips"] == 1 + g["stats"]["cycles"]
            assert g["stats"]["drafted_tokens"] > 0 and g["stats"]["k_histogram"] == {str(k): v for k, v in ref.stats["k_histogram"].items()}
            per = g["pipeline"]["per_rank"]
            if c["policy"] == "specter":  # each rank with MoE layers planned from its own lookahead rows
                assert all(r.get("cover_total", 0) > 0 for r in per if "expert_hits" in r), per


@pytest.mark.parametrize("slow", [[1, "forward", 0.15], [0, "draft_forward", 0.1]], ids=["verify", "draft"])
def test_optimistic_cycles_give_one_process_tokens_whichever_side_is_slower(ckpts, tmp_path, slow):
    """Optimistic drafting's two timings, forced by slowing one side: a slow later stage (its result comes
    back after rank 0's pre-draft, which then also runs rank 0's stage over it: a kept pre-draft's
    step is sent as the acceptance is known), or a slow draft (the result comes back during the
    pre-draft, which stops there: at once when the guess failed, once it has K drafts when it held).
    Both ways the tokens and rank 0's K/V at the committed positions are one process's."""
    cases = [dict(model=str(ckpts[a]), policy="specter", residency=0.5, prompt=PROMPT, new=NEW, sampling=GREEDY, k=2,
                  optimistic=True, slow=slow) for a in ARCHS]
    out = tmp_path / "results.json"
    ranks = _launch([["-c", RANKS, json.dumps(cases), str(out)]] * 2, timeout=240)
    assert all(r[0] == 0 for r in ranks), [r[2][-2000:] for r in ranks]
    got = json.loads(out.read_text())
    # the world and the script's own join's startup group: each open_pipeline's is destroyed after its startup
    assert [g["groups"] for g in got] == [2] * len(cases)
    for i, (c, g) in enumerate(zip(cases, got)):
        engine = specter.load(c["model"], device="cpu", policy="specter", residency=0.5, threads=1)
        engine.decoder.governor = Governor(32, fixed=2)
        ref = engine.generate(PROMPT, NEW, **GREEDY)
        want = [t for t in engine.decoder._cache.k + engine.decoder._cache.v]
        engine.close()
        assert g["tokens"] == ref.token_ids, c
        kv = torch.load(f"{out}.{i}.kv")
        worst = max((a - b[:, :a.shape[1]]).abs().max().item() / b.abs().max().item() for a, b in zip(kv, want))
        assert worst < 1e-5, (c, worst)
        opt = g["pipeline"]["optimistic"]
        assert opt["kept"] > 0 and opt["pre_drafted"] > opt["kept"], opt  # both kept and discarded pre-drafts
        if slow[0] == 1:  # every pre-draft ran to its end before the result came back; rank 0's stage then ran
            # over it where it copies nothing (deepseek_v2: rank 0 holds the dense layer 0; qwen3_moe: an MoE
            # layer at residency 0.5, whose copies and demotions must wait for the acceptance)
            assert opt["stopped"] == 0, opt
            assert (opt["early_steps"] > 0) == (c["model"] == str(ckpts["deepseek_v2"])), opt
        else:  # the result came back during each pre-draft: the failed ones stopped, no step ran early
            assert opt["stopped"] == opt["pre_drafted"] - opt["kept"] and opt["early_steps"] == 0, opt
            assert opt["pre_steps"] < opt["pre_drafted"] * 3, opt  # (the guess and K = 2 each, had none stopped)


def test_a_stages_slot_pool_is_the_plans_dtype():
    """A stage's pool was the store's dtype (bf16) where the plan's is fp32 (CPU): the emulated link, which
    charges the bytes written, charged a rank's copy half of one process's, and its coded tier held twice
    as many members as planned."""
    from specter.loader import open_checkpoint
    from specter.pipeline.load import load_stage
    from specter.pipeline.stages import make_stages

    path = specter.default_model_path()  # bf16
    for s in make_stages(open_checkpoint(path).spec, 2, 2, drafts=False):
        st = load_stage(path, s, torch.device("cpu"), policy="on-demand", residency=0.25, threads=1)
        try:
            assert st.provider.inner.pool[0].w13.dtype == getattr(torch, st.plan.pool_dtype) == torch.float32
        finally:
            st.close()


def test_k_max_and_compress_experts_give_one_process_tokens(tmp_path):
    """--k-max (rank 0's governor's longest draft; 0: no draft held) and --compress-experts (each rank's
    own layers' experts coded, in one process's coded cache) under a 2-rank pipeline: one process's greedy
    tokens with the same options; the ranks' coded layers are one process's bytes, under its layer numbers."""
    from specter.offload.coded import cache_entry

    path = tmp_path / "bf16"
    make_tiny_checkpoint(path, "qwen3_moe", dtype=torch.bfloat16)
    caches = {w: tmp_path / f"cache-{w}" for w in ("ranks", "one")}
    cases = [dict(model=str(path), policy="specter", residency=0.5, prompt=PROMPT, new=NEW, sampling=GREEDY, k_max=k)
             for k in (0, 1, 4)]
    cases += [dict(model=str(path), policy=p, residency=0.5, prompt=PROMPT, new=NEW, sampling=GREEDY, compress=True,
                   draft_cache=str(caches["ranks"])) for p in ("on-demand", "host", "specter", "spec-lru")]
    cases += [dict(model=str(path), policy="on-demand", residency=0.5, prompt=PROMPT, new=1, sampling=GREEDY)]
    out = tmp_path / "results.json"
    ranks = _launch([["-c", RANKS, json.dumps(cases), str(out)]] * 2, timeout=240)
    assert all(r[0] == 0 for r in ranks), [r[2][-2000:] for r in ranks]
    got = json.loads(out.read_text())
    assert len(got) == len(cases)
    for c, g in zip(cases, got):
        k_max = {"k_max": c["k_max"]} if "k_max" in c else {}  # load refuses it for a policy that does not draft
        engine = specter.load(c["model"], device="cpu", policy=c["policy"], residency=0.5, threads=1, **k_max,
                              compress_experts=c.get("compress", False),
                              draft_cache=str(caches["one"]) if c.get("compress") else None)
        ref = engine.generate(PROMPT, c["new"], **c["sampling"])
        engine.close()
        assert g["tokens"] == ref.token_ids, c
        if c.get("k_max"):  # the governor drafted no longer than --k-max
            assert max(map(int, g["stats"]["k_histogram"])) <= c["k_max"] and g["stats"]["drafted_tokens"] > 0
        if c.get("k_max") == 0:  # never drafted, and rank 0 made and held no draft (as one process makes none)
            assert g["stats"]["drafted_tokens"] == 0 and not g["whole"], g["stats"]
        elif c["policy"] in ("specter", "spec-lru"):
            assert g["whole"]
        if c.get("compress") and c["policy"] != "host":  # the coded store served misses: over each rank's link,
            assert 0 < g["stats"]["h2d_bytes"] + g["stats"]["tier_hits"], g["stats"]  # or from the tier its load filled
            per = g["stats"]["pipeline"]["per_rank"]  # the tier's counters are summed too (they were rank 0's)
            assert all(g["stats"][k] == sum(r.get(k, 0) for r in per) for k in ("tier_hits", "tier_fills", "tier_decoded_bytes"))
        if c["policy"] == "host":  # the host lanes' seconds are every rank's (they were rank 0's)
            per = g["stats"]["pipeline"]["per_rank"]
            assert g["stats"]["host_busy_s"] == pytest.approx(sum(r["host_busy_s"] for r in per))
            assert all(r["host_busy_s"] > 0 for r in per) and g["stats"]["host_threads"] == 1
        if c["new"] == 1:  # no step after the first token: nothing stalled after it, on any rank (rank 1's
            assert g["stats"]["decode_stall_s"] == 0 < g["stats"]["stall_s"], g["stats"]  # prefill stall counted)
    files = {w: cache_entry(open_checkpoint(path).files.values(), str(d)) for w, d in caches.items()}
    names = sorted(p.name for p in files["one"].glob("layer-*"))
    assert names == [f"layer-{i}.safetensors" for i in range(3)]
    assert names == sorted(p.name for p in files["ranks"].glob("layer-*"))
    assert all((files["one"] / n).read_bytes() == (files["ranks"] / n).read_bytes() for n in names)


def test_cli_under_torchrun_prints_once_with_pipeline_stats(ckpts):
    """No --policy: specter, the default as in one process, speculating across the two ranks. Every
    exchange is point to point (NO_COLLECTIVES refuses the collectives: a rank that exits right after
    one could abort, docs/RESULTS.md)."""
    argv = ["-c", NO_COLLECTIVES, "generate", "--model", str(ckpts["qwen3_moe"]), "--prompt-ids", "1,5,9,17,33",
            "--max-new-tokens", str(NEW), "--greedy", "--residency", "0.5", "--json", "--pipeline-timeout", "60",
            "--host-threads", "1", "--draft-bits", "2",  # each rank's host lane (specter's); rank 0's draft width
            "--context", "64"]  # each rank's KV cache planned for 64 tokens, rank 0's engine bounded by them
    ranks = _launch([argv, argv], timeout=HANG)
    assert [r[0] for r in ranks] == [0, 0], [r[2][-2000:] for r in ranks]
    assert ranks[1][1] == ""  # printed once, by rank 0
    got = json.loads(ranks[0][1])
    ref = specter.load(str(ckpts["qwen3_moe"]), device="cpu", policy="on-demand", residency=0.5, threads=1)
    assert got["token_ids"] == ref.generate(PROMPT, NEW, temperature=0.0).token_ids
    ref.close()
    assert got["stats"]["pipeline"]["ranks"] == 2 and got["stats"]["pipeline"]["layers"] == [[0, 1], [1, 3]]  # the draft on rank 0
    assert got["stats"]["policy"] == "specter" and got["stats"]["drafted_tokens"] > 0


def _entry(cache: Path) -> dict[str, tuple[int, int, bytes]]:
    """The draft cache's layer files: name -> (inode, mtime_ns, bytes). A rewrite (temporary file
    renamed into place) gives a new inode."""
    out = {}
    for f in sorted(cache.glob("*/layer-*.safetensors")):
        st = f.stat()
        out[f"{f.parent.name}/{f.name}"] = (st.st_ino, st.st_mtime_ns, f.read_bytes())
    return out


def test_rank_0_shares_one_processs_draft_cache(ckpts, tmp_path):
    """--draft-cache under torchrun: rank 0 hits the entry one process wrote (same key, no file
    rewritten), rebuilds a corrupt or missing layer, and writes an entry one process then hits; the
    other rank never touches the cache; the tokens are one process's."""
    path = str(ckpts["deepseek_v2"])  # a dense first layer: rank 0's stage holds one MoE layer of two
    one, pipe = tmp_path / "one", tmp_path / "pipe"

    def single(cache: Path) -> list[int]:
        engine = specter.load(path, device="cpu", policy="specter", residency=0.5, threads=1,
                              draft_cache=str(cache))
        try:
            return engine.generate(PROMPT, NEW, temperature=0.0).token_ids
        finally:
            engine.close()

    def pipeline(cache: Path) -> list[int]:
        argv = ["-m", "specter", "generate", "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", str(NEW), "--greedy", "--residency", "0.5", "--json",
                "--pipeline-timeout", "60", "--draft-cache"]
        ranks = _launch([argv + [str(cache)], argv + [str(tmp_path / "rank1")]], timeout=HANG)
        assert [r[0] for r in ranks] == [0, 0], [r[2][-2000:] for r in ranks]
        assert not (tmp_path / "rank1").exists()  # rank 1 holds no draft: its --draft-cache is never made
        got = json.loads(ranks[0][1])
        assert got["stats"]["pipeline"]["ranks"] == 2 and got["stats"]["drafted_tokens"] > 0
        return got["token_ids"]

    ref = single(one)
    written = _entry(one)
    assert len(written) == 2  # one entry, both MoE layers
    assert pipeline(one) == ref
    assert _entry(one) == written  # a hit: every file read, none rewritten

    layers = sorted(one.glob("*/layer-*.safetensors"))
    data = bytearray(layers[0].read_bytes())
    data[-1] ^= 0xFF  # fails its CRC
    layers[0].write_bytes(bytes(data))
    layers[1].unlink()
    assert pipeline(one) == ref
    again = _entry(one)
    assert {k: v[2] for k, v in again.items()} == {k: v[2] for k, v in written.items()}  # rebuilt alike
    assert all(again[k][0] != written[k][0] or again[k][1] != written[k][1] for k in written)

    assert pipeline(pipe) == ref  # a miss: rank 0 writes one process's entry, under its key
    made = _entry(pipe)
    assert {k: v[2] for k, v in made.items()} == {k: v[2] for k, v in written.items()}
    assert single(pipe) == ref and _entry(pipe) == made  # which one process then hits


def test_rank_0_reads_no_other_stages_experts_when_the_draft_cache_holds_every_layer(ckpts, tmp_path, monkeypatch):
    """Rank 0's stage under specter: a draft cache miss reads every layer's routed experts (to quantise
    them) and writes the entry; a hit reads only its own stage's, yet every layer's other weights, and
    drafts the same logits."""
    import torch

    from specter.loader import _Reader
    from specter.pipeline.load import load_stage

    path = ckpts["deepseek_v2"]
    first = make_stages(open_checkpoint(path).spec, 2, 4)[0]
    assert (first.first, first.last) == (0, 2)  # layer 1 MoE here; layer 2 MoE on rank 1
    read, read_into = [], _Reader.read_into
    monkeypatch.setattr(_Reader, "read_into", lambda self, name, dst: (read.append(name), read_into(self, name, dst))[1])

    def load(cache):
        read.clear()
        st = load_stage(path, first, torch.device("cpu"), policy="specter", residency=0.5, draft_cache=str(cache))
        st.begin(16)
        logits = st.draft_forward(torch.tensor(PROMPT), 0, logits_for="all")
        st.close()
        return logits, {n.split(".mlp.experts.")[0] for n in read if ".mlp.experts." in n}, set(read)

    miss, experts, names = load(tmp_path / "c")
    assert experts == {"model.layers.1", "model.layers.2"} and len(list((tmp_path / "c").glob("*/layer-*"))) == 2
    hit, experts, hit_names = load(tmp_path / "c")
    assert experts == {"model.layers.1"}  # its own stage's only
    assert {n for n in names if ".mlp.experts." not in n} == {n for n in hit_names if ".mlp.experts." not in n}
    assert any(n.startswith("model.layers.2.self_attn") for n in hit_names)
    assert torch.equal(miss, hit)
    _, experts, _ = load("off")  # no cache: every layer's, quantised
    assert experts == {"model.layers.1", "model.layers.2"}


def test_rank_0_drafts_at_the_draft_bits_one_process_drafts_at(ckpts):
    """--draft-bits under a pipeline: rank 0's whole draft quantises its experts at that width and
    drafts one process's logits at it (not the 4-bit draft's); a policy without a draft refuses it."""
    import torch

    from specter.errors import ConfigError
    from specter.layers import KVCache
    from specter.pipeline.load import load_stage

    path = ckpts["qwen3_moe"]
    spec = open_checkpoint(path).spec
    first = make_stages(spec, 2, 4, drafts=True, draft_bits=2)[0]

    def staged(bits):
        st = load_stage(path, first, torch.device("cpu"), policy="specter", residency=0.5, draft_cache="off",
                        draft_bits=bits)
        st.begin(16)
        logits = st.draft_forward(torch.tensor(PROMPT), 0, logits_for="all")
        st.close()
        return logits

    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, draft_cache="off", draft_bits=2,
                          threads=1)
    dec = engine.decoder
    want = dec.model(torch.tensor(PROMPT), 0, KVCache(spec, 16, torch.device("cpu"), torch.float32), dec.draft,
                     logits_for="all")
    engine.close()
    two = staged(2)
    assert torch.equal(two, want) and not torch.equal(two, staged(4))
    with pytest.raises(ConfigError, match="runs no draft"):
        load_stage(path, first, torch.device("cpu"), policy="on-demand", residency=0.5, draft_bits=3)


def test_bench_under_torchrun_reports_each_rank(ckpts, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([PROMPT, [3, 4, 5]]))
    path = ckpts["deepseek_v2"]
    spec = open_checkpoint(path).spec
    memory, _, _ = _device_memory(spec, make_stages(spec, 2, 4), False, 2)  # each rank's device, pools partial
    argv = ["-m", "specter", "bench", "--model", str(path), "--prompts", str(prompts),
            "--policies", "resident,on-demand", "--device-memory", str(memory), "--max-new-tokens", "6", "--json",
            "--temperature", "0.9", "--seed", "5"]  # seeded at fp32: the tokens are compared, as greedy ones
    ranks = _launch([argv, argv], timeout=HANG)
    assert [r[0] for r in ranks] == [0, 0], [r[2][-2000:] for r in ranks]
    assert ranks[1][1] == ""
    got = json.loads(ranks[0][1])
    assert got["ranks"] == 2 and list(got["policies"]) == ["resident", "on-demand"]
    od = got["policies"]["on-demand"]
    assert od["lossless_vs_resident"] is True and len(od["per_rank"]) == 2
    assert od["h2d_bytes_per_token"] == od["h2d_bytes"] / od["new_tokens"] > 0
    assert sum(r["expert_hits"] + r["expert_misses"] for r in od["per_rank"]) == od["expert_hits"] + od["expert_misses"] > 0
    # each rank's pool is what its own device leaves: here rank 0's a part of its layer's experts, rank 1's all
    from specter.cli import main

    assert main(["plan", "--model", str(path), "--ranks", "2", "--policy", "on-demand", "--device", "cpu", "--json",
                 "--device-memory", str(memory)]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["pool_slots"] < r["experts"] for r in rows] == [r["expert_misses"] > 0 for r in od["per_rank"]] \
        == [True, False]


# ---------------------------------------------------------------------------------------- faults
def test_a_config_mismatch_fails_every_rank(ckpts, tmp_path):
    other = tmp_path / "other"
    make_tiny_checkpoint(other, "qwen3_moe")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    argv = ["-c", NO_COLLECTIVES, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy",
            "--policy", "resident", "--pipeline-timeout", "60", "--model"]
    ranks = _launch([argv + [str(ckpts["qwen3_moe"])], argv + [str(other)]], timeout=HANG)
    for r, (code, so, se) in enumerate(ranks):
        assert code == 2, (r, se[-2000:])
        assert f"rank {r} of 2: rank(s) 1 differ from rank 0 in the checkpoint:" in se and so == ""
    # options are named (a per-rank --residency was "fingerprint, options"; --pipeline-timeout was not compared)
    argv = ["-c", NO_COLLECTIVES, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy",
            "--policy", "on-demand", "--model", str(ckpts["qwen3_moe"])]
    ranks = _launch([argv + ["--residency", "0.5", "--pipeline-timeout", "60"],
                     argv + ["--residency", "0.25", "--pipeline-timeout", "50"]], timeout=HANG)
    for r, (code, so, se) in enumerate(ranks):
        assert code == 2, (r, se[-2000:])
        assert f"rank {r} of 2: rank(s) 1 differ from rank 0 in --residency, --pipeline-timeout:" in se, se
    # a rank's own load error says which rank it is
    argv = ["-m", "specter", "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--greedy", "--policy",
            "on-demand", "--residency", "0.5", "--pipeline-timeout", "60", "--model"]
    ranks = _launch([argv + [str(ckpts["qwen3_moe"])], argv + [str(tmp_path / "nothing-here")]], timeout=HANG)
    assert [code for code, _, _ in ranks] == [2, 2], ranks
    assert "rank 1 of 2: model directory" in ranks[1][2] and "does not exist" in ranks[1][2], ranks[1][2]
    for r, (_, _, se) in enumerate(ranks):  # every rank's error line names it once (rank 0's had no prefix)
        lines = [line for line in se.splitlines() if line.startswith("specter: error:")]
        assert lines and all(line.startswith(f"specter: error: rank {r} of 2: ") for line in lines), se
        assert not re.search(r"rank \d of 2: rank \d of 2", se), se


def test_a_rank_slower_to_start_than_the_timeout_is_waited_for(ckpts):
    """--pipeline-timeout bounds the waits once every rank has loaded; a rank that joins and loads
    later than that (a bigger shard, a slower disk, a busy machine) is waited for."""
    args = ["generate", "--model", str(ckpts["qwen3_moe"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
            "--greedy", "--policy", "resident", "--pipeline-timeout", "2"]
    ranks = _launch([["-m", "specter", *args], ["-c", DIES, "slow", *args]], timeout=90)
    assert [r[0] for r in ranks] == [0, 0], [r[2][-2000:] for r in ranks]
    assert ranks[0][1].strip() and ranks[1][1] == ""


@pytest.mark.parametrize("how", ["exit", "hang", "draft"])
def test_a_dead_or_stuck_rank_fails_the_others_within_the_timeout(ckpts, how):
    """Rank 1 of 3 dies (or stops answering) at its first step: ranks 0 and 2 exit with an error naming
    the broken pipeline, at once for a death (the connection closes), after the timeout for a hang
    (rank 2, waiting on rank 1, times out; rank 0 then sees rank 2 leave, or times out itself).
    "draft": specter, rank 1 dies at the first lookahead row rank 0's draft sends it (mid-cycle)."""
    timeout = 5
    policy = ["--policy", "specter", "--residency", "0.5"] if how == "draft" else ["--policy", "resident"]
    args = ["generate", "--model", str(ckpts["qwen3_moe"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
            "--greedy", *policy, "--pipeline-timeout", str(timeout)]
    first = ["-c", FIXED_K, *args] if how == "draft" else ["-m", "specter", *args]
    ranks = _launch([first, ["-c", DIES, how, *args], ["-m", "specter", *args]], timeout=90)
    for r in (0, 2):
        code, so, se = ranks[r]
        assert code == 2, (r, se[-2000:])
        assert f"rank {r} of 3:" in se and "the pipeline is broken" in se
    assert ("timed out" if how == "hang" else "closed its connection") in ranks[2][2]
    if how != "hang":
        assert ranks[1][0] == 3


@pytest.mark.parametrize("policy", ["on-demand", "specter"])
def test_ctrl_c_mid_generation_is_an_interrupt_on_every_rank(tmp_path, policy):
    """Ctrl-C at a terminal reaches every rank: each exits 130 as one process does, rank 0 not with a
    "pipeline is broken" error from the end of the generation it sends after the interrupt."""
    import signal

    path = tmp_path / "endless"  # no EOS, a long context: generating when the signal comes
    make_tiny_checkpoint(path, "qwen3_moe", max_position_embeddings=1 << 20, eos_token_id=None)
    args = ["-m", "specter", "generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens",
            "1000000", "--greedy", "--policy", policy, "--residency", "0.5"]
    with _ranks([args, args], interruptible=True) as procs:
        assert procs[0].stdout.read(1)  # a token: generating
        for p in procs:
            p.send_signal(signal.SIGINT)
        got = [(p.wait(180), p.stderr.read()) for p in procs]  # (~2 s; a rank waiting on its lock hung 600)
    assert [code for code, _ in got] == [130, 130], got
    assert all("error" not in err for _, err in got), got


# ----------------------------------------------------------------------------------------- serve
def _serving(url: str, procs, httpx, within: float = 180) -> None:
    """Until rank 0's server answers /health (or a rank has exited: then fail with its error)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank exited ({p.returncode}): {p.communicate()[1][-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("the pipelined server did not come up")


@needs_default
def test_serve_under_torchrun_answers_then_503_once_a_rank_is_gone():
    """`torchrun -m specter serve` (2 ranks, specter): rank 0 serves one process's greedy text; idle for
    longer than the pipeline timeout it still answers (rank 0 keeps the other ranks' waits alive);
    once rank 1 is killed every request and /health get 503 (pipeline_broken), and rank 0 exits
    non-zero after SIGTERM, saying why."""
    import signal

    httpx = pytest.importorskip("httpx")
    for name in ("fastapi", "sse_starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(name)
    port, timeout = _port(), 3
    argv = ["-m", "specter", "serve", "--port", str(port), "--device", "cpu", "--residency", "0.5", "--k-max", "8",
            "--pipeline-timeout", str(timeout), "--model-name", "tiny"]
    url = f"http://127.0.0.1:{port}"
    with _ranks([argv, argv]) as procs:
        _serving(url, procs, httpx)
        body = dict(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0)
        first = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        engine = specter.load(None, device="cpu", policy="specter", residency=0.5, k_max=8)
        want = engine.generate("def add(a, b):", 12, temperature=0.0).text
        engine.close()
        assert first.json()["choices"][0]["text"] == want
        assert first.json()["specter"]["pipeline"]["ranks"] == 2
        time.sleep(2 * timeout)  # idle past the timeout: pings keep rank 1 waiting
        again = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == want, again.text
        procs[1].kill()
        procs[1].wait()
        t0, health = time.monotonic(), None
        while time.monotonic() - t0 < 4 * timeout:  # the next ping (or request) finds rank 1 gone
            health = httpx.get(url + "/health", timeout=10)
            if health.status_code == 503:
                break
            time.sleep(0.2)
        assert health.status_code == 503 and health.json()["error"]["code"] == "pipeline_broken", health.text
        down = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["code"] == "pipeline_broken", down.text
        said = down.json()["error"]["message"]
        assert "rank 0 of 2" in said and said.count("the pipeline is broken") == 1 and "GLHF" not in said, said
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=60)
        err = procs[0].communicate()[1]
        assert code == 2 and "the pipeline is broken" in err, err[-2000:]


@needs_default
def test_serve_under_torchrun_stops_cleanly_on_sigterm_to_every_rank():
    """torchrun (or Ctrl-C) signals every rank: rank 0's server drains and stops the others; all exit 0."""
    import signal

    httpx = pytest.importorskip("httpx")
    for name in ("fastapi", "sse_starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(name)
    port = _port()
    argv = ["-m", "specter", "serve", "--port", str(port), "--device", "cpu", "--policy", "resident",
            "--pipeline-timeout", "30"]
    with _ranks([argv, argv]) as procs:
        _serving(f"http://127.0.0.1:{port}", procs, httpx)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
        assert codes == [0, 0], [p.communicate()[1][-2000:] for p in procs]


@needs_default
def test_chat_under_torchrun_reads_rank_0s_input_and_outlives_the_timeout(chat_model):
    """`torchrun -m specter chat` (2 ranks, specter): rank 0 reads the turns and prints one process's
    replies, once; idle at the prompt past the pipeline timeout it still answers (its waits are kept
    alive, as a server's); /reset and /exit work; every rank exits 0."""
    model = chat_model
    engine = specter.load(model, device="cpu", policy="specter", residency=0.5, k_max=8)
    sys_msg, kw = [{"role": "system", "content": "be brief"}], dict(max_new_tokens=6, temperature=0.0)
    r1 = engine.generate(sys_msg + [{"role": "user", "content": "def add(a, b):"}], **kw).text
    r2 = engine.generate(sys_msg + [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": r1},
                                    {"role": "user", "content": "class Stack:"}], **kw).text
    r3 = engine.generate(sys_msg + [{"role": "user", "content": "class Stack:"}], **kw).text
    engine.close()
    timeout = 3
    argv = ["-m", "specter", "chat", "--model", str(model), "--device", "cpu", "--residency", "0.5", "--k-max", "8",
            "--max-new-tokens", "6", "--greedy", "--system", "be brief", "--pipeline-timeout", str(timeout)]
    with _ranks([argv, argv], stdin=[subprocess.PIPE, subprocess.DEVNULL]) as procs:
        procs[0].stdin.write("def add(a, b):\n")
        procs[0].stdin.flush()
        assert procs[0].stdout.read(len(r1) + 1) == r1 + "\n"  # the first reply (the load came first)
        time.sleep(2 * timeout)  # idle at the prompt past the timeout: rank 1 still waits
        out, err = procs[0].communicate("class Stack:\n/reset\nclass Stack:\n/exit\n", timeout=180)
        assert procs[0].returncode == 0, err[-2000:]
        assert out == f"{r2}\n{r3}\n"
        out1, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 0 and out1 == "", err1[-2000:]


@needs_default
def test_chat_under_torchrun_ends_when_a_rank_is_gone(chat_model):
    """Rank 1 killed while rank 0 waits at the prompt: the next turn ends the chat with the pipeline's
    error and exit status 2 (a turn's other errors are reported and the chat goes on)."""
    model = chat_model
    argv = ["-m", "specter", "chat", "--model", str(model), "--device", "cpu", "--residency", "0.5",
            "--max-new-tokens", "4", "--greedy", "--pipeline-timeout", "3"]
    with _ranks([argv, argv], stdin=[subprocess.PIPE, subprocess.DEVNULL]) as procs:
        procs[0].stdin.write("def add(a, b):\n")
        procs[0].stdin.flush()
        assert procs[0].stdout.readline()  # the first reply: the pipeline ran
        procs[1].kill()
        procs[1].wait()
        out, err = procs[0].communicate("class Stack:\nclass Queue:\n", timeout=120)
        assert procs[0].returncode == 2 and "rank 0 of 2" in err and "/reset starts over" not in err, err[-2000:]


# ---------------------------------------------------------------- what rank 0 tells the governor (a virtual clock)
class _Clock:
    """time.perf_counter for optimistic.py, advanced only by the stand-ins' injected costs."""
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Later:
    """The STEP sent down the chain: its result arrives `later` seconds after it left."""

    def __init__(self, T: int, start: int, arrives: float, later: float):
        self.T, self.start, self.arrives, self.later = T, start, arrives, later


class _VirtualCycles:
    """OptimisticCycles' stand-ins with injected costs, no model and no ranks: a draft step takes `draft`
    seconds, rank 0's stage `stage` a row, the later stages `later` from the STEP's departure to its
    result. The target's token at position p is target(p); the draft's is too, except at `wrong` ones."""
    V = 16

    def __init__(self, clock, draft: float, stage: float, later: float, wrong: set[int]):
        self.clock, self.draft_s, self.stage_s, self.later_s, self.wrong = clock, draft, stage, later, wrong
        self.draft = type("Row", (), {"row": None})()
        self.model = type("M", (), {"spec": None})()
        self.remote, self.local, self.all_resident = [0.0] * 5, None, False
        self.link = type("L", (), {"pending": staticmethod(lambda: 0)})()

    @staticmethod
    def target(p: int) -> int:
        return 1 + p % 7

    def onehot(self, tokens: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens), self.V).float()  # [T, V]

    def draft_forward(self, tokens, pos, logits_for="last"):  # the stage: the draft's step at pos
        self.clock.now += self.draft_s
        return self.onehot([0 if pos + 1 in self.wrong else self.target(pos + 1)])

    def step(self, tokens, start, experts, logits_for="all"):  # the model: rank 0's stage, then the wire
        from specter.pipeline.standins import Step
        T = tokens.shape[0]
        self.clock.now += self.stage_s * T
        return Step(torch.zeros(T, 1), start, 0, self.stage_s * T)

    def send(self, step, post=False):
        return _Later(step.T, step.start, self.clock.now + self.later_s, self.later_s)

    def logits(self, sent):
        return self.onehot([self.target(sent.start + i + 1) for i in range(sent.T)]) if self.clock.now >= sent.arrives else None

    def receive(self, sent):
        self.clock.now = max(self.clock.now, sent.arrives)
        self.remote[4] += sent.later  # the later stages' step seconds, as they come back with the logits
        return self.logits(sent)

    def stats(self):  # the experts
        return dict(stall_s=0.0, expert_hits=0, expert_misses=0)

    def demote_rejected(self, kept_rows):
        pass

    def cancel_prefetches(self):
        return 0


def _virtual_decoder(monkeypatch, told: list, **costs):
    """PipelineSpeculativeDecoder's optimistic cycles over _VirtualCycles: (decoder, clock); `told` gets
    every observe_cycle(K, accepted, draft_s, verify_s, stall_s, dear)."""
    import collections
    import types
    from specter.pipeline import optimistic

    clock = _Clock()
    monkeypatch.setattr(optimistic, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(optimistic, "kv_rows", lambda *a: None)  # rank 0's K/V: none here
    monkeypatch.setattr(optimistic, "put_kv_rows", lambda *a: None)
    from specter.speculative.decoder import SpeculativeDecoder

    fake = _VirtualCycles(clock, **costs)
    dec = object.__new__(type("Dec", (optimistic.OptimisticCycles, SpeculativeDecoder), {}))  # the real MRO, no init
    dec.stage, dec.model, dec.experts = fake, fake, fake
    dec.stages, dec.planner, dec.device = [types.SimpleNamespace(last=1)], None, torch.device("cpu")
    dec.governor = types.SimpleNamespace(draft_s=None, fixed=None, arm="spec",
                                         observe_cycle=lambda *a, dear: told.append(a + (dear,)))
    dec.pre, dec.k, dec.need, dec.cancel_leftovers = None, 0, 10 ** 6, False
    dec.send_rows = lambda upto: None
    dec._stats = dict(k_histogram=collections.Counter(), cycles=0, recall_hits=0, recall_total=0, drafted_tokens=0,
                      accepted_tokens=0, rejections=0, draft_s=0.0, verify_s=0.0)
    dec.opt = optimistic.optimistic_stats()
    return dec, clock


@pytest.mark.parametrize("later", [0.030, 0.004], ids=["slow-verify", "slow-draft"])
def test_optimistic_cycles_tell_the_governor_their_wall_time(monkeypatch, later):
    """The seconds each greedy cycle reports (drafting exposed beyond verification, and verification)
    add up to its wall time, whether rank 0's pre-draft and its stage over it ran inside the last
    cycle's wait (a slow verification: the stage runs early) or past it (a slow draft), kept or
    discarded, so the governor's arms compare speculation's real rate with plain steps'. (A stage run
    early was counted twice, in the cycle that ran it and again as the next one's verification.)"""
    from specter.sampling import SamplingParams

    told, walls = [], []
    wrong = {p for p in range(12, 400) if p % 11 == 0}  # about one drafted position in 11 rejected
    dec, clock = _virtual_decoder(monkeypatch, told, draft=0.002, stage=0.0005, later=later, wrong=wrong)
    greedy, t, n = SamplingParams(temperature=0.0), dec.stage.target(10), 10
    while n < 300:
        t0 = clock.now
        new = dec._optimistic_cycle(t, n, 4, None, greedy)
        walls.append(clock.now - t0)
        assert new == [dec.stage.target(n + 1 + i) for i in range(len(new))]  # the target's tokens
        t, n = new[-1], n + len(new)
    o = dec.opt
    assert o["kept"] > 0 and o["pre_drafted"] > o["kept"], o  # both kept and discarded pre-drafts
    assert (o["early_steps"] > 0) == (later > 0.02), o  # the stage ran early only beside a slow verification
    # cycles by how they began: on a kept pre-draft (each kept one but perhaps the last) or fresh
    assert o["kept_cycles"] in (o["kept"], o["kept"] - 1) and o["kept_cycles"] + o["fresh_cycles"] == len(walls), o
    assert o["kept_tokens"] + o["fresh_tokens"] == n - 10, o
    assert o["kept_s"] + o["fresh_s"] == pytest.approx(sum(walls), abs=1e-9), o
    for (k, m, draft_s, verify_s, stall_s, dear), wall in zip(told, walls, strict=True):
        assert draft_s >= 0 and verify_s > 0
        assert draft_s + verify_s == pytest.approx(wall, abs=1e-9), (k, m, draft_s, verify_s, wall)
    assert sum(d for *_, d in told) == o["fresh_cycles"]  # dear: the fresh cycles, which the later stages waited out


def test_a_fresh_draft_drafts_a_share_of_k_and_its_pre_draft_all_of_it(monkeypatch):
    """A fresh draft (no kept pre-draft: at the start, after a discard) keeps the later stages waiting
    for each of its steps, so while speculation is the governor's running arm it drafts fresh_share of
    the governor's K (rounded up); the pre-draft beside its verification drafts the whole K, which the
    next cycle verifies when it is kept. A fixed K is every cycle's (the pipelines' tests compare
    fixed-K cycles with one process's), and so is a cycle while the governor measures its arms or
    probes speculation from plain decoding (a K = 1 cycle is not the speculation it would run)."""
    from specter.sampling import SamplingParams

    told, ran = [], []
    wrong = {40, 41, 90}  # drafts rejected there: the cycles after are fresh again
    dec, clock = _virtual_decoder(monkeypatch, told, draft=0.002, stage=0.0005, later=0.030, wrong=wrong)
    greedy, t, n = SamplingParams(temperature=0.0), dec.stage.target(10), 10
    while n < 150:
        fresh = dec.pre is None
        new = dec._optimistic_cycle(t, n, 6, None, greedy)
        ran.append((fresh, told[-1][0]))
        t, n = new[-1], n + len(new)
    assert sum(f for f, _ in ran) >= 3 and sum(not f for f, _ in ran) >= 3, ran
    assert all(k == (3 if f else 6) for f, k in ran), ran  # fresh: ceil(6 / 2); kept: all 6
    dec.governor.fixed, dec.pre, told[:] = 6, None, []
    dec._optimistic_cycle(dec.stage.target(200), 200, 6, None, greedy)
    assert told[-1][0] == 6  # K fixed: a fresh cycle drafts all of it
    dec.governor.fixed = None
    for arm in (None, "plain", "spec"):  # measured, probed from plain decoding, running
        dec.governor.arm, dec.pre = arm, None
        dec._optimistic_cycle(dec.stage.target(300), 300, 6, None, greedy)
        assert told[-1][0] == (3 if arm == "spec" else 6), arm


def test_every_rank_prints_its_errors_and_warnings_with_its_rank(monkeypatch, capsys):
    """Rank 0's errors had no prefix and the other ranks' one from `ranked` (the same error, printed bare
    and prefixed, in one run); warnings had none (the cache warning printed once per rank, alike)."""
    import warnings

    from specter.cli import _one_line
    from specter.errors import SpecterWarning
    from specter.pipeline import rank_prefixed

    assert rank_prefixed("x") == "x"  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rank_prefixed("x") == "rank 1 of 2: x"
    assert rank_prefixed("rank 0 of 2: rank(s) 1 differ") == "rank 0 of 2: rank(s) 1 differ"  # (names one already)
    _one_line(warnings.WarningMessage("the cache is not writable", SpecterWarning, "f", 1).message, SpecterWarning,
              "f", 1)
    assert capsys.readouterr().err == "specter: warning: rank 1 of 2: the cache is not writable\n"
