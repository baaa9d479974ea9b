"""What `specter serve` adds to a request: TTFT and TPOT through the server (loopback, the real
`openai` client, streaming) vs the Python API (`engine.stream`), the same requests on the SAME
engine, alternated (never concurrent). The server runs on a thread of this process, as `specter
serve` runs it; the client runs in a child process (as a real client would, off the server's GIL)
and times each request there.

    python bench/server_overhead.py [--policy specter] [--residency 0.25] [--max-tokens 64] [--repeat 8]

TTFT: from the call to the first text piece. TPOT: (last piece - first piece) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n", "def add(a, b):"]


def timed(pieces) -> tuple[float, float, str]:
    """(time to the first piece, first piece -> last piece, text) of a text-piece iterator."""
    t0 = time.perf_counter()
    first = last = None
    text = []
    for piece in pieces:
        if piece:
            last = time.perf_counter()
            first = first or last
            text.append(piece)
    return first - t0, last - first, "".join(text)


def client_main(url: str) -> None:
    """Child process: one request per line of stdin ("prompt_json max_tokens"), timings on stdout."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    for line in sys.stdin:
        req = json.loads(line)
        use = {}

        def pieces():
            for chunk in client.completions.create(model="m", prompt=req["prompt"], max_tokens=req["max_tokens"],
                                                   temperature=0, stream=True, stream_options={"include_usage": True}):
                use["tokens"] = chunk.usage.completion_tokens if chunk.usage else use.get("tokens")
                yield chunk.choices[0].text if chunk.choices else ""

        ttft, span, text = timed(pieces())
        print(json.dumps([ttft, span / max(use["tokens"] - 1, 1), text]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="specter")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the child process's mode
    args = ap.parse_args()
    if args.client:
        return client_main(args.client)

    import specter
    from specter.server import ServerThread, create_app

    residency = None if args.policy == "resident" else args.residency
    engine = specter.load(args.model, device="cpu", policy=args.policy, residency=residency)

    def api(prompt, max_tokens):
        stats: dict = {}
        ttft, span, text = timed(engine.stream(prompt, max_new_tokens=max_tokens, temperature=0.0, stats=stats))
        return ttft, span / max(stats["new_tokens"] - 1, 1), text

    with ServerThread(create_app(engine, model_name="m")) as url:
        child = subprocess.Popen([sys.executable, __file__, "--client", url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)

        def server(prompt, max_tokens):
            child.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
            child.stdin.flush()
            return tuple(json.loads(child.stdout.readline()))

        for p in PROMPTS:  # warm both paths
            api(p, 8), server(p, 8)
        rows = {"python": [], "server": []}
        for r in range(args.repeat):
            for p in PROMPTS:
                order = (("python", api), ("server", server))
                texts = {}
                for name, run in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
                    ttft, tpot, texts[name] = run(p, args.max_tokens)
                    rows[name].append((ttft, tpot))
                assert texts["python"] == texts["server"], (p, texts)
        child.stdin.close()
        child.wait()
    engine.close()
    med = {k: (statistics.median(t for t, _ in v), statistics.median(t for _, t in v)) for k, v in rows.items()}
    print(f"policy {args.policy}" + (f", residency {residency:g}" if residency else "") +
          f", {args.max_tokens} new tokens, greedy, {len(rows['python'])} requests each (medians; texts identical)")
    print(f"{'':<12} {'TTFT ms':>9} {'TPOT ms':>9}")
    for k in ("python", "server"):
        print(f"{k:<12} {med[k][0] * 1e3:>9.2f} {med[k][1] * 1e3:>9.2f}")
    d_ttft, d_tpot = med["server"][0] - med["python"][0], med["server"][1] - med["python"][1]
    print(f"{'overhead':<12} {d_ttft * 1e3:>+9.2f} {d_tpot * 1e3:>+9.2f}   "
          f"({med['server'][0] / med['python'][0]:.2f}x TTFT, {med['server'][1] / med['python'][1]:.2f}x TPOT)")


if __name__ == "__main__":
    main()
