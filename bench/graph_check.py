"""CUDA: the captured draft step and piecewise verifier, checked and timed side by side
(bench/device_check.sh runs it).

    python bench/graph_check.py [--residency 0.5] [--max-new-tokens 64] [--repeat 2]

1. Zero host syncs: after warm-up, greedy and sampled draft steps run under
   torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call; so do the
   verifier's captured pieces at every width bucket (with stand-in experts: the offload manager's
   one routing read per MoE layer is by design, between pieces).
2. TPOT of the specter policy with the eager draft and verifier, both compiled without CUDA graphs
   (mode="default"), the captured draft with the eager verifier, and both captured
   (mode="reduce-overhead", the CUDA default), prompts alternated in one process;
   out.stats["compiled"], stall_s and the verifier's share of decode time of each.
3. Tokens against plain bf16 decoding (`resident`): identical, or parted only at a near-tie
   (specter.testing.tie_gap; README "What lossless guarantees").
"""
from __future__ import annotations

import argparse
import time

import torch

import specter
from specter.bench import DEFAULT_PROMPTS
from specter.compiled.draft_step import DraftStep, draft_layers
from specter.compiled.verify_step import VerifyStep, _no_experts
from specter.layers import KVCache
from specter.sampling import SamplingParams
from specter.testing import tie_gap


def sync_free_check(engine, steps: int = 8) -> str:
    dec = engine.decoder
    ds, model = dec.draft_step, dec.model
    steps = min(steps, ds.lookahead.k_max)  # a cycle drafts K_max tokens at most
    cache = KVCache(model.spec, 256, engine.device, engine.dtype)
    prompt = torch.tensor([1, 2, 3, 4, 5], device=engine.device)
    logits = model(prompt, 0, cache, dec.experts, logits_for="last")
    t = int(logits.argmax(-1))
    gen = torch.Generator(device=engine.device).manual_seed(0)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):  # warm: record the graphs
        for _ in range(3):
            ds.begin(t, 5, params)
            for _ in range(steps):
                ds.step(cache, gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
            ds.begin(t, 5, params)
            for _ in range(steps):
                ds.step(cache, gen)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return f"{2 * steps} draft steps (greedy and sampled) under set_sync_debug_mode('error'): no sync"


def verify_sync_check(engine) -> str:
    """The verifier's captured pieces at every width, with stand-in experts (zeros), under
    set_sync_debug_mode("error"): only the MoE layers between them may read the host."""
    vs, model = engine.decoder.verify_step, engine.decoder.model
    cache = KVCache(model.spec, 256, engine.device, engine.dtype)
    inputs = {w: torch.arange(w, device=engine.device) + 3 for w in vs.buckets}  # made before: no H2D inside
    for _ in range(3):  # warm: record the graphs
        for w, toks in inputs.items():
            vs.step(toks, 5, cache, _no_experts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for w, toks in inputs.items():
            vs.step(toks, 5, cache, _no_experts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return f"verifications at widths {vs.buckets} under set_sync_debug_mode('error'): no sync in the pieces"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    r = args.residency
    t0 = time.perf_counter()
    engines = {"eager": specter.load(None, device="cuda", policy="specter", residency=r, compile=False),
               "graphs": specter.load(None, device="cuda", policy="specter", residency=r, compile=True)}
    print(f"loaded (compile included) in {time.perf_counter() - t0:.0f} s", flush=True)
    nog = specter.load(None, device="cuda", policy="specter", residency=r, compile=False)
    dec = nog.decoder
    dec.draft_step = DraftStep(dec.model, draft_layers(dec.draft), dec.draft.lookahead, compile=True, mode="default")
    dec.draft_step.warmup()
    dec.verify_step = VerifyStep(dec.model, dec.governor.k_max, compile=True, mode="default")
    dec.verify_step.warmup()
    graphs = engines["graphs"]
    verify = graphs.decoder.verify_step  # None if the compile failed at load (a warning says why)
    engines = {"eager": engines["eager"], "compiled, no graphs": nog, "CUDA graphs, eager verify": graphs,
               "CUDA graphs, draft+verify": graphs}
    plain = specter.load(None, device="cuda", policy="resident")
    for check in (sync_free_check, verify_sync_check):
        try:
            print(check(graphs), flush=True)
        except Exception as e:  # report and go on to the timings
            print(f"SYNC CHECK FAILED ({check.__name__}): {type(e).__name__}: {e}", flush=True)
    for e in engines.values():
        e.generate(DEFAULT_PROMPTS[0], max_new_tokens=8, temperature=0.0)
    decode = {k: 0.0 for k in engines}
    tokens = {k: 0 for k in engines}
    stall = {k: 0.0 for k in engines}
    ver = {k: 0.0 for k in engines}
    compiled = {}
    worst = {k: 0.0 for k in engines}  # largest gap / rounding noise where tokens part (a tie: <= 4)
    for _ in range(args.repeat):
        for prompt in DEFAULT_PROMPTS:
            ids = plain.encode(prompt)
            ref = plain.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0).token_ids
            for name, e in engines.items():
                if e is graphs:  # one engine, its captured verifier off and on
                    graphs.decoder.verify_step = verify if name.endswith("draft+verify") else None
                out = e.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0)
                s = out.stats
                decode[name] += s["tpot_s"] * (s["new_tokens"] - 1)
                tokens[name] += s["new_tokens"] - 1
                stall[name] += s["decode_stall_s"]
                ver[name] += s["verify_s"]
                compiled[name] = s["compiled"]
                i, gap, noise = tie_gap(plain, ids, ref, out.token_ids)
                if i is not None:
                    worst[name] = max(worst[name], abs(gap) / max(noise, 1e-12))
    base = decode["eager"] / tokens["eager"]
    for name in engines:
        tpot = decode[name] / tokens[name]
        print(f"{name:<26} TPOT {tpot * 1e3:7.2f} ms  x{base / tpot:5.2f} vs eager  stall {stall[name]:.3f} s  "
              f"verify {ver[name] / decode[name]:.0%} of decode  compiled {compiled[name]}  where tokens part "
              f"from resident, largest gap {worst[name]:.2f}x the rounding noise (tests/test_bf16.py's tie: <= 4)")
    for e in {id(e): e for e in list(engines.values()) + [plain]}.values():
        e.close()


if __name__ == "__main__":
    main()
