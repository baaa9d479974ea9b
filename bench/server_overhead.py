"""What `specter serve` adds to a request: TTFT and TPOT through the server (a `specter serve`
subprocess on loopback, the real `openai` client, streaming) vs the Python API (`engine.stream` in
this process), the same requests on identically loaded engines, alternated (never concurrent).

    python bench/server_overhead.py [--policy specter] [--residency 0.25] [--max-tokens 64] [--repeat 8]

TTFT: from the call to the first text piece. TPOT: (last piece - first piece) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

import openai

import specter

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def add(a, b):"]


def python_api(engine, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    stats: dict = {}
    t0 = time.perf_counter()
    first = last = None
    text = []
    for piece in engine.stream(prompt, max_new_tokens=max_tokens, temperature=0.0, stats=stats):
        last = time.perf_counter()
        first = first or last
        text.append(piece)
    return first - t0, (last - first) / max(stats["new_tokens"] - 1, 1), "".join(text)


def server(client, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    first = last = None
    text, n = [], 0
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            n = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
            text.append(chunk.choices[0].text)
    return first - t0, (last - first) / max(n - 1, 1), "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="specter")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=8)
    args = ap.parse_args()
    residency = None if args.policy == "resident" else args.residency
    engine = specter.load(args.model, device="cpu", policy=args.policy, residency=residency)
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specter.cli", "serve", "--device", "cpu", "--policy", args.policy,
           "--port", str(port), "--model-name", "m"] + (["--model", args.model] if args.model else []) + \
        (["--residency", str(residency)] if residency else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(600):  # until it listens
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        for p in PROMPTS:  # warm both paths
            python_api(engine, p, 8), server(client, p, 8)
        rows = {"python": [], "server": []}
        for r in range(args.repeat):
            for p in PROMPTS:
                order = (("python", lambda: python_api(engine, p, args.max_tokens)),
                         ("server", lambda: server(client, p, args.max_tokens)))
                texts = {}
                for name, run in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
                    ttft, tpot, texts[name] = run()
                    rows[name].append((ttft, tpot))
                assert texts["python"] == texts["server"], (p, texts)
    finally:
        proc.terminate()
        proc.wait()
    engine.close()
    med = {k: (statistics.median(t for t, _ in v), statistics.median(t for _, t in v)) for k, v in rows.items()}
    n = len(rows["python"])
    print(f"policy {args.policy}" + (f", residency {residency:g}" if residency else "") +
          f", {args.max_tokens} new tokens, greedy, {n} requests each (medians; texts identical)")
    print(f"{'':<12} {'TTFT ms':>9} {'TPOT ms':>9}")
    for k in ("python", "server"):
        print(f"{k:<12} {med[k][0] * 1e3:>9.2f} {med[k][1] * 1e3:>9.2f}")
    d_ttft, d_tpot = med["server"][0] - med["python"][0], med["server"][1] - med["python"][1]
    print(f"{'overhead':<12} {d_ttft * 1e3:>+9.2f} {d_tpot * 1e3:>+9.2f}   "
          f"({med['server'][0] / med['python'][0]:.2f}x TTFT, {med['server'][1] / med['python'][1]:.2f}x TPOT)")


if __name__ == "__main__":
    main()
