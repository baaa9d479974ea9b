"""What a coded expert copy costs the emulated link's thread on CPU, by where it writes the slot from
(offload/coded.py's emulate_from): `decode` (the torch decode of the coded store, what a store past
coded_tier.ROWS_MAX_BYTES did), `reads` (loader.ExpertReads: the expert read from the checkpoint as
the copy runs, what it does now) and `rows` (a decoded copy of the store kept, under the limit).
Then on-demand's greedy TPOT with the emulated link writing from `decode` and from `reads`.

    python bench/experiments/coded_rows_source.py --model /tmp/wide16 [--copies 32] [--tokens 24]

The emulated link charges a coded copy from the profile either way; this is what this CPU takes
beside it, which shows in a copy's time when it is the longer.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import specter
from specter.loader import StoredExperts, open_checkpoint
from specter.offload import coded_tier
from specter.offload.coded import encode_store
from specter.offload.link import _copy_serial
from specter.workloads import workload_prompts


def per_copy_ms(model: str, copies: int) -> dict:
    stored = StoredExperts(open_checkpoint(model))
    layer = stored[0]
    coded = encode_store([layer])[0]
    reads = stored.expert_reads()[0]
    slot = [torch.empty(w.shape[1:], dtype=torch.float32) for w in (layer.w13, layer.w2)]
    E, out = layer.n_experts, {}
    sources = {"decode": coded, "reads": reads, "rows": layer}  # each indexed w13[e], w2[e]
    for name, src in sources.items():
        t0 = time.perf_counter()
        for i in range(copies):
            for d, s in zip(slot, (src.w13[i % E], src.w2[i % E])):
                _copy_serial(d, s)
        out[name] = round((time.perf_counter() - t0) / copies * 1e3, 2)
    out["expert_mb"] = round(layer.expert_nbytes() / 1e6, 2)
    return out


def tpot_ms(model: str, tokens: int, mode: str) -> tuple[float, list[int]]:
    coded_tier.ROWS_MAX_BYTES = 0  # past the limit, as a big model's store
    keep = StoredExperts.expert_reads
    if mode == "decode":
        StoredExperts.expert_reads = lambda self: None
    try:
        engine = specter.load(model, device="cpu", policy="on-demand", residency=0.25, compress_experts=True)
    finally:
        StoredExperts.expert_reads = keep
    try:
        prompt = workload_prompts("default")[0]
        engine.generate(prompt, max_new_tokens=4, temperature=0.0)  # warm
        out = engine.generate(prompt, max_new_tokens=tokens, temperature=0.0)
        return round(out.stats["tpot_s"] * 1e3, 1), out.token_ids
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--copies", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    res = {"per_copy_ms": per_copy_ms(a.model, a.copies)}
    res["tpot_ms_decode"], t_dec = tpot_ms(a.model, a.tokens, "decode")
    res["tpot_ms_reads"], t_reads = tpot_ms(a.model, a.tokens, "reads")
    res["same_tokens"] = t_dec == t_reads
    print(json.dumps(res))


if __name__ == "__main__":
    main()
