"""`specter plan` and `specter bench` from the command line: JSON on stdout, one-line errors and exit 2.

Most runs go through `specter.cli.main([...])` in-process (capsys); one runs `python -m specter.cli`
in a subprocess to check the real exit status and that stderr carries one line, no traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specter.cli import main
from specter.bench import run_bench

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 33, 2], [7, 7, 7], [100, 3, 64, 12, 90, 45, 8]]


@pytest.fixture
def model(tiny):
    path, _ = tiny("deepseek_v2")  # 8 routed experts, top-2, 2 MoE layers, hidden 64, expert inter 32
    return str(path)


def run_cli(capsys, *argv):
    capsys.readouterr()  # not what came before (building the model prints a progress bar when run alone)
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *needles):
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specter: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ------------------------------------------------------------------------------------------------- plan
def test_plan_json(capsys, model):
    rc, out, err = run_cli(capsys, "plan", "--model", model, "--residency", "0.25", "--json")
    assert rc == 0, err
    plan = json.loads(out)  # the whole of stdout is one JSON object
    assert out.count("\n") == 1
    assert plan["pool_slots"] == 4 and plan["n_experts"] == 8 and plan["top_k"] == 2  # one pool: 2 layers x 2
    assert plan["residency"] == 0.25 and plan["n_moe_layers"] == 2
    itemsize = torch.empty(0, dtype=getattr(torch, plan["dtype"])).element_size()
    assert plan["expert_bytes"] == 3 * 64 * 32 * itemsize
    assert plan["slot_pool_bytes"] == 4 * plan["expert_bytes"]


def test_plan_expert_memory_and_table(capsys, model):
    rc, out, err = run_cli(capsys, "plan", "--model", model, "--device", "cpu", "--expert-memory", "144KiB", "--json")
    assert rc == 0, err
    assert json.loads(out)["pool_slots"] == 6  # 147456 B / 24576 B, one pool for both MoE layers
    assert json.loads(out)["draft_bits"] == 4  # specter's draft; none for on-demand (it said 4 with no draft)
    rc, out, err = run_cli(capsys, "plan", "--model", model, "--device", "cpu", "--expert-memory", "144KiB", "--json",
                           "--policy", "on-demand")
    assert rc == 0 and json.loads(out)["draft_bits"] is None and json.loads(out)["draft_bytes"] == 0, out
    rc, out, err = run_cli(capsys, "plan", "--model", model, "--device", "cpu", "--residency", "0.5")
    assert rc == 0, err
    assert "8 of 16" in out and "top-2" in out


@pytest.mark.parametrize("argv, needle", [
    (["--expert-memory", "1KB"], "top-2"),
    (["--residency", "0"], "residency"),
    (["--residency", "1.5"], "residency"),
    (["--expert-memory", "lots"], "expert_memory"),
])
def test_plan_bad_budgets_exit_2(capsys, model, argv, needle):
    assert_one_line_error(*run_cli(capsys, "plan", "--model", model, *argv), needle)


def test_plan_two_budgets_is_a_usage_error(capsys, model):
    with pytest.raises(SystemExit) as e:  # argparse: mutually exclusive options
        main(["plan", "--model", model, "--residency", "0.5", "--expert-memory", "1GiB"])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_plan_budget_error_in_a_real_process(model, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "specter.cli", "plan", "--model", model, "--expert-memory", "1KB"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "expert_memory", "top-2")


# ------------------------------------------------------------------------------------------------ bench
def test_bench_json_three_policies(capsys, model, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    rc, out, err = run_cli(capsys, "bench", "--model", model, "--device", "cpu",
                           "--policies", "resident,on-demand,next-layer", "--residency", "0.5",
                           "--prompts", str(prompts), "--max-new-tokens", "8", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert out.count("\n") == 1
    assert res["max_new_tokens"] == 8 and res["prompts"] == len(PROMPTS) and res["repeat"] == 1
    assert res["speedup_baseline"] == "on-demand"
    c = res["link_calibration"]  # what the emulated link was calibrated at, as the table's header says
    assert c["expert_throughput_GBps"] > 0 and c["bandwidth_GBps"] > 0 and c["latency_us"] > 0
    pols = res["policies"]
    assert list(pols) == ["resident", "on-demand", "next-layer"]
    for name, r in pols.items():
        assert isinstance(r["tpot_s"], float) and r["tpot_s"] > 0, name
        assert isinstance(r["ttft_s"], float) and r["ttft_s"] > 0, name
        assert r["lossless_vs_resident"] is True, name
        assert 0 < r["new_tokens"] <= 8 * len(PROMPTS)
        assert r["new_tokens"] == pols["resident"]["new_tokens"]
        assert r["speedup_vs_on-demand"] > 0  # speed-ups are over plain offloading
    for name in ("on-demand", "next-layer"):
        r = pols[name]
        assert r["pool_slots"] == 8 and r["residency"] == 0.5
        assert r["expert_hits"] + r["expert_misses"] > 0 and 0 <= r["hit_rate"] <= 1
        assert r["expert_misses"] > 0 and r["h2d_bytes"] > 0
        assert 0 < r["decode_stall_s"] <= r["stall_s"] and r["decode_stall_s"] < r["decode_s"]
    assert pols["next-layer"]["prefetch_issued"] > 0
    assert "slots_per_layer" not in pols["resident"]


def test_bench_device_memory_is_the_whole_device(capsys, model, tmp_path):
    """--device-memory: each offloading policy's pool takes what its weights and KV cache leave (the plan's
    device budget), resident beside them takes none, and --plot (which sweeps the residency) refuses it."""
    import torch

    from specter.loader import open_checkpoint
    from specter.offload.plan import make_plan

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:1]))
    ck = open_checkpoint(model)
    want = make_plan(ck.spec, ck.numel(), torch.float32, device_memory="700KiB", draft=False,
                     device=torch.device("cpu"), store_dtype=ck.dtype).pool_slots
    assert 2 <= want < 16 and want != 4  # a part of the 16 routed experts, not the default residency 0.25's
    rc, out, err = run_cli(capsys, "bench", "--model", model, "--device", "cpu", "--policies", "resident,on-demand",
                           "--device-memory", "700KiB", "--prompts", str(prompts), "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    pols = json.loads(out)["policies"]
    assert pols["on-demand"]["pool_slots"] == want and pols["on-demand"]["lossless_vs_resident"] is True
    assert_one_line_error(*run_cli(capsys, "bench", "--model", model, "--device", "cpu", "--device-memory", "700KiB",
                                   "--plot", str(tmp_path / "p.png")), "--plot sweeps the residency", "--device-memory")


def test_bench_missing_prompts_file_exits_2(capsys, model, tmp_path):
    missing = tmp_path / "nope.json"
    assert_one_line_error(*run_cli(capsys, "bench", "--model", model, "--device", "cpu",
                                   "--policies", "resident,on-demand", "--residency", "0.5",
                                   "--prompts", str(missing), "--json"), str(missing))


@pytest.mark.parametrize("text, needle", [("[1, 2", "invalid JSON"), ("[]", "non-empty"), ('{"a": 1}', "non-empty"),
                                          ('[[1, 2], ""]', 'prompt 2 of 2 is ""'), ("[3]", "prompt 1 of 1 is 3")])
def test_bench_bad_prompts_file_exits_2(capsys, model, tmp_path, text, needle):
    f = tmp_path / "prompts.json"
    f.write_text(text)
    assert_one_line_error(*run_cli(capsys, "bench", "--model", model, "--policies", "resident",
                                   "--prompts", str(f), "--json"), needle)
    upper = tmp_path / "IDS.JSON"  # (read as one text prompt: the suffix was compared as ".json" only)
    upper.write_text("[[1, 2, 3], [4, 5]]")
    from specter.bench import read_prompts
    assert read_prompts(str(upper), None) == [[1, 2, 3], [4, 5]]
    f.write_bytes(b'["caf\xe9"]')  # Latin-1, not UTF-8: a UnicodeDecodeError's traceback
    assert_one_line_error(*run_cli(capsys, "bench", "--model", model, "--policies", "resident",
                                   "--prompts", str(f), "--json"), "is not UTF-8 text")


def test_bench_bad_arguments_exit_2(capsys, model, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS[:1]))
    common = ["bench", "--model", model, "--device", "cpu", "--prompts", str(f)]
    assert_one_line_error(*run_cli(capsys, *common, "--policies", " , "), "--policies")
    assert_one_line_error(*run_cli(capsys, *common, "--policies", "resident", "--max-new-tokens", "0"), "max-new-tokens")
    # one token decodes nothing after the first: a TPOT of ~0 ms and speed-ups of nothing were reported
    assert_one_line_error(*run_cli(capsys, *common, "--policies", "resident", "--max-new-tokens", "1"), ">= 2, got 1: bench")
    assert_one_line_error(*run_cli(capsys, *common, "--policies", "on-demand", "--residency", "0.05"), "top-2")
    assert_one_line_error(*run_cli(capsys, *common, "--policies", "bogus"), "bogus")
    assert_one_line_error(*run_cli(capsys, *common, "--policies", "on-demand", "--temperature", "0.7",
                                   "--top-p", "0"), "--top-p")


@pytest.mark.parametrize("argv, needle", [
    (["--residency", "1.5"], "residency must be a fraction"),
    (["--expert-memory", "abc"], "expert_memory (--expert-memory): cannot parse size 'abc'"),
    (["--residency", "0.25", "--device-memory", "1MiB"], "give one budget: residency (--residency)"),
    (["--link", "bogus"], "unknown link profile 'bogus'"),
    (["--policies", "on-demand,host", "--host-threads", "0"], "needs host_threads >= 1"),
    (["--policies", "on-demand,specter", "--k-max", "0", "--draft-bits", "2"], "--draft-bits 2 would be ignored"),
    (["--policies", "resident,on-demand", "--draft-cache", "dc"], "none of the policies resident, on-demand makes"),
    (["--plot", "p.png", "--policies", "on-demand,on-demand"], "listed twice"),
    (["--plot", "p.png", "--link", "bogus"], "unknown link profile 'bogus'"),
    (["--policies", "resident", "--compare-compressed"], "--policies resident copies nothing"),
])
def test_bench_refuses_before_the_load(capsys, model, monkeypatch, tmp_path, argv, needle):
    """Each was refused only after the checkpoint and its draft had loaded (minutes on a big model), or
    (--draft-bits with --k-max 0, --draft-cache without a draft) ignored, where generate refuses them first."""
    import specter.bench

    def loaded(*_, **__):
        raise AssertionError("the checkpoint was loaded before the refusal")

    monkeypatch.setattr(specter.bench, "load_shared", loaded)
    monkeypatch.chdir(tmp_path)  # (--plot p.png, --draft-cache dc: nothing made where the tests run)
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    assert_one_line_error(*run_cli(capsys, "bench", "--model", model, "--device", "cpu", *argv), needle)


def test_the_pipelined_bench_policies():
    """Under torchrun a policy listed twice ran twice into one row, and all seven listed by name (the
    default's text) silently dropped the one that is not pipelined."""
    from specter.errors import ConfigError
    from specter.pipeline.bench import _policies
    from specter.pipeline.launch import PIPELINED_POLICIES
    from specter.policy import BENCH_POLICIES

    assert _policies(None) == list(PIPELINED_POLICIES)
    with pytest.raises(ConfigError, match="'on-demand' is listed twice"):
        _policies("on-demand,on-demand")
    with pytest.raises(ConfigError, match="'oracle' is not pipelined"):
        _policies(",".join(BENCH_POLICIES))


def test_bench_plot_without_an_extension_says_the_file_it_writes(capsys, model, tmp_path, monkeypatch):
    """matplotlib writes NAME.png; bench said (and checked) NAME."""
    import specter.cli.bench

    pytest.importorskip("matplotlib")
    monkeypatch.setattr(specter.cli.bench, "residency_sweep", lambda model, policies, out, **kw: {"plot": out})
    rc, out, _ = run_cli(capsys, "bench", "--model", model, "--plot", str(tmp_path / "sweep"), "--json")
    assert rc == 0 and json.loads(out)["plot"] == str(tmp_path / "sweep.png")


def test_bench_sampling_reports_speed_not_token_equality(capsys, model, tmp_path, fixed_k):
    """Sampled runs compare tokens too: with bench's seed every policy, speculative or not, draws the
    tokens plain decoding draws (it was n/a: speculation drew differently); the table says how it
    sampled. Without a seed (the API's seed None) there is no one answer, and the column is n/a."""
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(PROMPTS[:2]))
    rc, out, err = run_cli(capsys, "bench", "--model", model, "--device", "cpu", "--prompts", str(f),
                           "--policies", "on-demand,specter", "--residency", "0.5", "--max-new-tokens", "10",
                           "--temperature", "0.8", "--seed", "3", "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["sampling"] == dict(temperature=0.8, top_p=1.0, top_k=0, seed=3)
    assert all(r["lossless_vs_on-demand"] is True for r in res["policies"].values())
    assert res["policies"]["specter"]["drafted_tokens"] > 0
    unseeded = run_bench(model, ["on-demand", "next-layer"], prompts=PROMPTS[:1], max_new_tokens=4, device="cpu",
                         residency=0.5, sampling=dict(temperature=0.8, seed=None))
    assert all(r["lossless_vs_on-demand"] is None for r in unseeded["policies"].values())
    rc, out, err = run_cli(capsys, "bench", "--model", model, "--device", "cpu", "--prompts", str(f),
                           "--policies", "on-demand,next-layer", "--residency", "0.5", "--max-new-tokens", "10",
                           "--temperature", "0.8", "--seed", "3")
    assert rc == 0 and "sampling (temperature 0.8" in out and " True" in out, err
    rc, out, err = run_cli(capsys, "bench", "--model", model, "--device", "cpu", "--prompts", str(f),
                           "--policies", "on-demand", "--residency", "0.5", "--max-new-tokens", "4", "--top-p", "0.9")
    assert rc == 0 and "greedy" in out  # (bench's temperature is 0: a filter alone ran greedy, silently)
    assert "specter: warning: top_p (--top-p) has no effect at temperature 0" in err, err


def test_time_split_and_table_sections():
    from specter.bench import format_table, time_split

    r = dict(tpot_s=0.01, ttft_s=0.1, decode_s=2.0, draft_s=0.5, decode_stall_s=1.0, speedup_vs_a=1.0,
             lossless_vs_a=True)
    assert time_split(r) == "draft 25% | copy stall 50% | compute 25%"
    assert time_split(dict(r, draft_s=0.0)) == "copy stall 50% | compute 50%"
    table = format_table({"policies": {"a": r}})
    assert "where decode time goes" in table and "a           draft 25%" in table
    assert "compressed device tier" not in table
    two = format_table({"policies": {"a": r, "b": dict(r, speedup_vs_a=2.0, lossless_vs_a=False)}}).splitlines()
    assert two[2].split()[-1] == "ref" and two[3].split()[-1] == "False"  # the reference is not checked against itself
    coded = dict(r, expert_misses=528, tier_hits=166, tier_fills=362)  # its hit rate counts the raw slots only
    assert "a           tier hits 166 (31.4% of the raw slots' misses), fills 362" in format_table({"policies": {"a": coded}})
    coded.update(expert_hits=100, device_hit_rate=266 / 628)  # the table: a tier hit is a hit, misses the rest
    row = format_table({"policies": {"a": coded}}).splitlines()[2].split()
    assert row[4:6] == ["42.4%", "362"], row


def test_a_generation_ended_at_its_first_token_adds_no_decode_time():
    """add_run counted a one-token generation as one decoded token of ~0 s, pulling TPOT down; with
    nothing decoded at all there is no TPOT (None, "n/a" in the table), nor a speed-up."""
    from types import SimpleNamespace

    from specter.bench import add_run, format_table, new_totals, ratio, tpot

    a = new_totals()
    add_run(a, SimpleNamespace(stats={"new_tokens": 1, "tpot_s": 1e-6, "ttft_s": 0.5}, token_ids=[7]), ())
    assert a["decode_tokens"] == 0 and a["runs"] == 1 and tpot(a) is None and ratio(0.01, tpot(a)) is None
    r = {"tpot_s": None, "ttft_s": 0.5, "speedup_vs_on-demand": None, "lossless_vs_on-demand": True}
    table = format_table({"policies": {"on-demand": r}})
    assert table.splitlines()[2].split()[1:3] == ["n/a", "n/a"]
    add_run(a, SimpleNamespace(stats={"new_tokens": 5, "tpot_s": 0.01, "ttft_s": 0.5}, token_ids=[1] * 5), ())
    assert tpot(a) == pytest.approx(0.01)


@pytest.mark.parametrize("policies, kw, needle", [
    (["resident"], dict(residency=0.25), "policy 'resident' keeps every expert on the device, so residency=0.25"),
    (["on-demand"], dict(host_threads=1), "computes no expert on the host, so host_threads=1 would be ignored"),
    (["on-demand", "next-layer"], dict(k_max=4), "none of the policies on-demand, next-layer reads it, so k_max=4"),
    (["specter"], dict(k_max=0, draft_bits=3), "k_max=0 makes no draft, so draft_bits=3"),
])
def test_run_bench_refuses_what_no_policy_of_the_run_reads(model, monkeypatch, policies, kw, needle):
    """The CLI refused these; run_bench (the Python API) ran and ignored them (a differential fuzz's finding)."""
    import specter.bench
    from specter.errors import ConfigError

    monkeypatch.setattr(specter.bench, "load_shared", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(ConfigError, match=needle):
        run_bench(model, policies, prompts=PROMPTS[:1], max_new_tokens=3, device="cpu", **kw)


@pytest.mark.parametrize("kw, needle", [
    (dict(residency=0.001), "top-"),
    (dict(expert_memory="1KiB"), "top-"),
    (dict(device_memory="1KiB"), "cannot hold what a generation needs"),
])
def test_run_bench_refuses_a_budget_below_top_k_before_the_load(model, tiny, monkeypatch, kw, needle):
    """run_bench (the Python API) found these only in its first engine's plan, after the checkpoint and
    the draft had loaded; the CLI's generate refuses them first. Each policy is planned from the headers."""
    import specter.bench
    from specter.errors import BudgetError

    monkeypatch.setattr(specter.bench, "load_shared", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(BudgetError, match=needle):
        run_bench(model, ["resident", "specter"], prompts=PROMPTS[:1], max_new_tokens=3, device="cpu", **kw)
    coded, _ = tiny("qwen3_moe", dtype=torch.bfloat16)  # and the coded engines' plans
    with pytest.raises(BudgetError, match=needle):
        run_bench(str(coded), ["on-demand"], prompts=PROMPTS[:1], max_new_tokens=3, device="cpu",
                  compare_compressed=True, **kw)


def test_a_draft_width_the_experts_cannot_pack_is_refused_before_the_load(tiny, monkeypatch):
    """Tiny Mixtral's experts (intermediate 48) pack no 3-bit draft: refused when the draft was quantised."""
    import specter
    import specter.bench
    from specter import builder
    from specter.errors import ConfigError

    path, _ = tiny("mixtral")
    for mod in (builder, specter.bench):
        monkeypatch.setattr(mod, "load_shared", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(ConfigError, match="3-bit draft"):
        run_bench(str(path), ["spec-lru"], prompts=PROMPTS[:1], max_new_tokens=3, device="cpu", residency=0.5,
                  draft_bits=3)
    with pytest.raises(ConfigError, match="3-bit draft"):
        specter.load(path, device="cpu", policy="specter", residency=0.5, draft_bits=3)


def test_compare_compressed_takes_the_runs_own_options(tiny):
    """compress_experts=False crashed the coded load (given twice), and draft_bits reached a non-drafting
    policy's coded load, which refused it after the raw load: one coded load now serves every policy."""
    path, _ = tiny("qwen3_moe", dtype=torch.bfloat16)
    res = run_bench(str(path), ["on-demand", "specter"], prompts=PROMPTS[:1], max_new_tokens=3, device="cpu",
                    residency=0.5, compress_experts=False, draft_bits=2, k_max=2, compare_compressed=True)
    assert set(res["policies"]) == {"on-demand", "on-demand+coded", "specter", "specter+coded"}
    assert all(c["same_tokens"] for c in res["coded_vs_raw"].values())
