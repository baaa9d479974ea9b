"""bench/device_check.sh, proven on CPU before a GPU machine sees it.

The GPU image lacks optimum-quanto (carried as a wheel) and the server's and client's packages
(never carried). With those made unimportable (a sitecustomize whose import hook raises
ModuleNotFoundError for them, as a missing package does), every test file must still collect, each
missing package a skip with its reason, never a collection error; the script's DRY_RUN installs the
carried wheels and collects what each step would run; a missing wheel stops it with a clear message.
Collection and a dry run only: nothing here needs a GPU or runs the suites.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_check.sh"
FETCH = REPO / "bench" / "fetch_device_wheels.sh"
# what the GPU image does not have (server, client, quantizer) and what they pull in
OPTIONAL = ("optimum", "openai", "fastapi", "starlette", "sse_starlette", "uvicorn", "httpx", "pydantic",
            "prometheus_client")
BLOCKER = f'''import sys

BLOCKED = {OPTIONAL!r}


class _Missing:
    """Finds the blocked packages first and reports them missing."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Missing())
'''
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
needs_pip = pytest.mark.skipif(subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode,
                               reason="the dry run installs a wheel with pip")


@pytest.fixture
def bare_env(tmp_path):
    """The environment of a process in which the optional packages cannot be imported."""
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, "-c", "import optimum.quanto"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "blocked" in r.stderr  # the hook is in place
    return env


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel named as `name==version` is (its module: a stub)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{name.replace('-', '_')}_stub/__init__.py": b"",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
                     for p, b in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def _carried() -> list[tuple[str, str]]:
    specs = re.findall(r"^# wheel: (\S+)==(\S+)$", SCRIPT.read_text(), re.M)
    assert any(name == "optimum-quanto" for name, _ in specs), specs
    return specs


@needs_bash
def test_the_scripts_parse():
    for script in (SCRIPT, FETCH):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


def test_the_documented_device_calls_fit_the_machine():
    """The header's one run call: carry .whl, within the tool's 10 minutes a call, the script's own
    budget (what its steps' limits are cut to) ending before the call's limit with time to pack the
    results, and every check it names one the script runs."""
    text = SCRIPT.read_text()
    header = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    calls = re.findall(r"run\(command='(.*?)', carry=\[\"\.whl\"\], timeout_s=(\d+)\)", header)
    assert len(calls) == 1, calls
    command, timeout = calls[0]
    checks = re.search(r'CHECKS="([\w ]+)"', command).group(1).split()
    budget = int(re.search(r"BUDGET_S=(\d+)", command).group(1))
    assert int(timeout) <= 600 and budget + 30 <= int(timeout), (budget, timeout)
    cases = set(re.findall(r"^\s+([\w |]+)\)", text, re.M))
    known = {name.strip() for case in cases for name in case.split("|")}
    assert checks and set(checks) <= known, (checks, known)


def test_every_test_file_collects_without_the_optional_packages(bare_env):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests", "bench/test_kernels.py"], cwd=REPO, env=bare_env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and not re.search(r"^ERROR |\d+ errors?\b", out, re.M), out[-4000:]
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line and not line.startswith("SKIPPED")}
    skipped = dict(re.findall(r"^SKIPPED \[\d+\] ([\w/.]+?\.py):\d+: (.*)$", out, re.M))
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))
    lost = [f for f in files if f not in collected and f not in skipped]
    assert not lost, f"neither collected nor skipped with a reason: {lost}\n{out[-3000:]}"
    assert "bench/test_kernels.py" in collected
    assert re.search(r"could not import '(httpx|openai|fastapi|sse_starlette|uvicorn)'",
                     skipped.get("tests/test_server.py", "")), skipped


def test_the_engine_imports_without_the_optional_packages(bare_env):
    """generate and bench need neither the server's packages nor, until a draft is packed, quanto."""
    code = ("import specter, specter.bench, specter.builder, specter.cli, specter.compiled, specter.triton_ops\n"
            "from specter.cli import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n")
    r = subprocess.run([sys.executable, "-c", code], cwd="/", env=bare_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_bash
@needs_pip
def test_dry_run_installs_the_carried_wheels_and_collects_each_step(bare_env, tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for name, version in _carried():
        _wheel(wheels, name, version)
    out = tmp_path / "out"
    every = re.search(r"unknown check '\$part' \(([^)]*)\)", SCRIPT.read_text())[1].replace(",", "")
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=dict(bare_env, DRY_RUN="1", CHECKS=every, WHEELS_DIR=str(wheels), OUT=str(out)))
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "optimum_quanto_stub" in log and "would run:" in log and "pip install" in log, log[-3000:]
    assert "FAILED" not in log and "is not in" not in log, log[-4000:]
    steps = set(re.findall(r"dry run: (\w+) would run:", log))  # each step's command checked, not only pytest's
    assert {"suite", "kernels", "bench", "firstrun", "moehost_jit", "codedcopy", "decodetune", "compressed_wide",
            "coded_tier_wide", "graphs", "async", "hostprof", "bench_eager_moe"} <= steps, steps
    for part in ("suite", "kernels"):
        text = (out / f"collect-{part}.log").read_text()
        n = re.search(r"(\d+)(?:/\d+)? tests? collected", text)
        assert n and int(n.group(1)) > 0, text[-2000:]
    suite = (out / "collect-suite.log").read_text()
    assert "tests/test_cuda.py::" in suite and "test_cuda_link_copies" in suite  # new and reused CUDA tests


@needs_bash
def test_a_missing_wheel_stops_the_check_with_what_to_do(bare_env, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(bare_env, CHECKS="suite", WHEELS_DIR=str(tmp_path / "none"), OUT=str(out)))
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "STOPPED" in r.stderr and "optimum-quanto==" in r.stderr and "fetch_device_wheels.sh" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["steps"]["wheels"]["exit"] == 3


def test_the_summary_reads_pytest_reports(tmp_path):
    """device_summary.py: counts and failures from JUnit XML, rows from `specter bench --json` (with
    --compare-compressed: the coded store against the raw one)."""
    (tmp_path / "suite.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure message="bits differ">x</failure></testcase>'
        '<testcase classname="tests.test_link" name="test_c"><skipped message="needs CUDA"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "bench.json").write_text('specter: compiling\n{"policies": {"resident": {"tpot_s": 0.01, '
                                         '"lossless_vs_resident": true, "outputs": [1]}}, "repeat": 1}\n')
    (tmp_path / "compressed_wide.json").write_text(
        '{"policies": {"on-demand": {"tpot_s": 0.02}, "on-demand+coded": {"tpot_s": 0.016}}, "coded_vs_raw": '
        '{"on-demand": {"h2d_bytes_ratio": 0.663, "tpot_speedup": 1.25, "same_tokens": true}}}')
    (tmp_path / "steps.tsv").write_text("suite\t1\t12\t240\nbench\t0\t30\t150\ncompressed_wide\t0\t40\t200\n")
    (tmp_path / "facts.json").write_text('{"device": "stand-in"}')
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device_summary.py"), "summary", str(tmp_path),
                        str(tmp_path / "facts.json"), str(tmp_path / "steps.tsv")], capture_output=True, text=True)
    assert r.returncode == 1 and "FAILED" in r.stdout and "bits differ" in r.stdout, r.stdout + r.stderr
    doc = json.loads((tmp_path / "summary.json").read_text())
    tests = doc["steps"]["suite"]["tests"]
    assert (tests["passed"], tests["skipped"], tests["skip_reasons"]) == (1, 1, {"needs CUDA": 1})
    assert tests["failed"] == [{"test": "tests.test_cuda::test_b", "kind": "failure", "message": "bits differ"}]
    assert doc["steps"]["bench"]["bench"]["policies"] == {"resident": {"tpot_s": 0.01, "lossless_vs_resident": True}}
    assert doc["steps"]["compressed_wide"]["bench"]["coded_vs_raw"]["on-demand"]["tpot_speedup"] == 1.25
    assert "coded/raw bytes a token 0.663, coded speed-up 1.250x, same tokens True" in r.stdout, r.stdout


@pytest.mark.parametrize("launches", ["noop", "stub"])
def test_the_moehost_experiment_runs_on_cpu(launches):
    """bench/experiments/moe_host_cost.py (CHECKS=moehost) in its CPU mode: fused_moe's own host cost,
    one line a model and width, every call through the real launch code up to the stubbed launches
    (noop: the kernels swapped for do-nothing objects; stub: Triton's launch path on aot.stub_driver)."""
    env = dict(os.environ, TRITON_INTERPRET="1") if launches == "noop" else {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "experiments" / "moe_host_cost.py"), "--device", "cpu",
                        "--iters", "5", "--launches", launches], cwd="/tmp", env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert {(row["model"], row["T"]) for row in rows} == {(m, T) for m in ("qwen3-30b-a3b", "deepseek-v2-lite",
                                                                          "mixtral-8x7b") for T in (1, 8)}
    assert all(row["host_us"] > 0 and row["launches"] == launches for row in rows), rows


def test_the_codedcopy_experiment_times_the_engines_launches_on_a_stub_driver():
    """bench/experiments/coded_copy_cost.py --device meta --launches stub: the coded copies' decode launches
    through Triton's launch path (aot.stub_driver), as the engine launches them; a line a shape."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "experiments" / "coded_copy_cost.py"), "--device", "meta",
                        "--shapes", "bundled", "--copies", "8", "--batch", "2", "--launches", "stub"], cwd="/tmp",
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[0])
    assert row["launches"] == "stub" and row["coded"]["issue_us"] > 0 and row["coded_batch"]["issue_us"] > 0, row


def test_the_decode_tune_experiment_compiles_a_variant_ahead_of_time():
    """bench/experiments/decode_tune.py --aot: a (BLOCK, NUM_WARPS) variant of the decode kernel compiled
    for sm_90 on this machine, its registers and spills reported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "experiments" / "decode_tune.py"), "--aot",
                        "--variants", "1024x4", "--targets", "90"], cwd="/tmp", env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[0])
    assert (row["block"], row["warps"], row["cc"]) == (1024, 4, 90) and row["registers"] > 0, row
    assert row["spill_bytes"] == 0, row


def test_the_host_profile_runs_on_cpu():
    """bench/host_profile.py (CHECKS=hostprof) on CPU: a line a policy, its top functions by own time."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "host_profile.py"), "--device", "cpu",
                        "--policies", "specter", "--tokens", "4", "--top", "5"], cwd="/tmp",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[0])
    assert row["policy"] == "specter" and row["tokens"] > 0 and row["ms_per_token"] > 0
    assert len(row["top"]) == 5 and all(own <= cum + 1e-6 for _, _, own, cum in row["top"]), row["top"]
