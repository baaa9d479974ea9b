"""bench/device_check.sh's reports: the machine's facts, and one JSON summary of the steps it ran.

    python3 bench/device_summary.py facts                  # JSON: GPU, driver, Python, torch, Triton...
    python3 bench/device_summary.py summary OUT FACTS STEPS # writes OUT/summary.json, prints a short summary

STEPS is a tab-separated file, one line a step: name, exit status, seconds, time limit. A step's own
output in OUT is read when it is there: NAME.xml (pytest's JUnit XML: counts and each failure),
kernels.json (pytest-benchmark's JSON of bench/test_kernels.py: GB/s and share of HBM bandwidth per
model, T and implementation), bench.json (`specter bench --json`: TPOT and tokens per policy) and
NAME.log (its last lines). It needs nothing the GPU image lacks (torch only for the facts).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path


def facts() -> dict:
    out: dict = {"python": platform.python_version(), "machine": platform.machine()}
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = (r.stdout or r.stderr).strip()
    else:
        out["nvidia_smi"] = "not found"
    for dist in ("torch", "triton", "pytest", "pytest-benchmark", "optimum-quanto", "transformers", "specter"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["device"] = p.name
            out["capability"] = f"{p.major}.{p.minor}"
            out["multiprocessors"] = p.multi_processor_count
            out["memory_gib"] = round(p.total_memory / 2**30, 1)
    except Exception as e:  # a broken torch is a fact worth reporting, not a crash
        out["torch_error"] = f"{type(e).__name__}: {e}"
    return out


def junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    bad, skips = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                bad.append({"test": name, "kind": tag, "message": (el.get("message") or "")[:400]})
        el = case.find("skipped")
        if el is not None:
            reason = (el.get("message") or "")[:120]
            skips[reason] = skips.get(reason, 0) + 1
    counts["failed"] = bad
    counts["skip_reasons"] = skips
    return counts


def kernels(path: Path) -> list[dict]:
    rows = []
    for b in json.loads(path.read_text()).get("benchmarks", []):
        info = b.get("extra_info") or {}
        if "GBps" in info:
            rows.append({k: info.get(k) for k in ("model", "T", "impl", "experts", "us", "GBps", "hbm_share")})
    return rows


BENCH_JSON = ("compressed", "compressed_wide", "coded_tier_wide")  # `specter bench --json` steps not named bench*


def bench(path: Path) -> dict:
    text = path.read_text()
    start = text.find("\n{") + 1 if not text.startswith("{") else 0  # lines printed before it are skipped
    res, _ = json.JSONDecoder().raw_decode(text[start:])
    keep = ("tpot_s", "ttft_s", "hit_rate", "drafted_tokens", "accepted_tokens", "decode_stall_s", "draft_s",
            "verify_s", "residency")
    pols = {name: {k: v for k, v in r.items() if k in keep or k.startswith(("lossless", "speedup"))}
            for name, r in res.get("policies", {}).items()}
    return {"policies": pols, **{k: v for k, v in res.items() if k != "policies"}}


def tail(path: Path, n: int = 12) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:]


def summary(out: Path, facts_path: Path, steps_path: Path) -> int:
    doc: dict = {"facts": json.loads(facts_path.read_text()) if facts_path.exists() else {}, "steps": {}}
    ok = True
    lines = steps_path.read_text().splitlines() if steps_path.exists() else []
    for line in lines:
        name, rc, seconds, limit = line.split("\t")[:4]
        step: dict = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                      "timed_out": int(rc) in (124, 130, 137)}
        readers = [(out / f"{name}.xml", "tests", junit), (out / "kernels.json", "kernels", kernels),
                   (out / f"{name}.json", "bench", bench)]  # bench, bench_*, and BENCH_JSON's
        for path, key, read in readers:
            mine = key == "tests" or name == key or (key == "bench" and (name.startswith("bench_")
                                                                         or name in BENCH_JSON))
            if mine and path.exists() and path.stat().st_size:
                try:
                    step[key] = read(path)
                except Exception as e:  # a truncated file from a step that was stopped
                    step[key] = f"unreadable: {type(e).__name__}: {e}"
        log = out / f"{name}.log"
        if log.exists() and (int(rc) != 0 or name not in ("suite", "kernels", "bench", "bench_eager_moe")):
            step["log_tail"] = tail(log)
        ok &= int(rc) == 0
        doc["steps"][name] = step
    doc["ok"] = ok
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    f = doc["facts"]
    print(f"== device check: {'OK' if ok else 'FAILED'}  ({f.get('device') or f.get('nvidia_smi')}, torch {f.get('torch')}, "
          f"triton {f.get('triton')}, CUDA {f.get('cuda')})")
    for name, s in doc["steps"].items():
        t = s.get("tests")
        counts = (f"  {t['passed']} passed, {len(t['failed'])} failed, {t['skipped']} skipped"
                  if isinstance(t, dict) else "")
        print(f"{name:10} exit {s['exit']:3d}  {s['seconds']:4d} s of {s['limit_s']} s"
              f"{'  TIMED OUT' if s['timed_out'] else ''}{counts}")
        for bad in (t["failed"] if isinstance(t, dict) else [])[:10]:
            print(f"    {bad['kind'].upper()} {bad['test']}: {bad['message'][:160]}")
        for row in s.get("kernels", []) if isinstance(s.get("kernels"), list) else []:
            share = row.get("hbm_share")
            print(f"    {row['model']:18} T={row['T'] if row['T'] is not None else '-':<3} {row['impl']:12} {row['GBps']:8.1f} GB/s"
                  f"{'' if share is None else f'  {share:6.1%} of HBM'}")
        b = s.get("bench")
        if isinstance(b, dict):
            for pol, r in b["policies"].items():
                tpot = r.get("tpot_s")
                same = {k: v for k, v in r.items() if k.startswith(("lossless", "speedup"))}
                print(f"    {pol:11} TPOT {'n/a' if tpot is None else f'{tpot * 1e3:7.2f} ms'}  {same}")
            for pol, c in (b.get("coded_vs_raw") or {}).items():  # --compare-compressed: issue 24's figure
                ratio = c.get("h2d_bytes_ratio")
                print(f"    {pol:11} coded/raw bytes a token {'n/a' if ratio is None else f'{ratio:.3f}'}, "
                      f"coded speed-up {c['tpot_speedup']:.3f}x, same tokens {c.get('same_tokens')}")
        for line in s.get("log_tail", [])[-4:]:
            print(f"    | {line[:200]}")
    print(f"results: {out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="{facts,summary}", required=True)
    sub.add_parser("facts", help="print the machine's facts as JSON")
    s = sub.add_parser("summary", help="write OUT/summary.json and print a short summary")
    for name in ("out", "facts", "steps"):
        s.add_argument(name, type=Path, metavar=name.upper())
    args = ap.parse_args()
    if args.cmd == "facts":
        print(json.dumps(facts(), indent=1))
    else:
        sys.exit(summary(args.out, args.facts, args.steps))
