"""Real-size loading: load time and peak RSS per policy on a synthetic multi-GB checkpoint whose
routed experts have a real model's shapes (few layers, so it fits a workstation).

    python bench/load_big.py --shape qwen3-30b-a3b --layers 2 --policies on-demand,specter
    python bench/load_big.py --shape mixtral-8x7b --layers 1 --dir /tmp/big --keep
    python bench/load_big.py --shape qwen3-30b-a3b --layers 1 --specter-src /work/main   # another checkout

Each (policy, load) runs in a fresh process that loads the checkpoint on the CPU, generates two
tokens and reports ru_maxrss, so one load's memory never hides another's ("load adds" is that
peak less the RSS of the process before loading: Python, torch and transformers imported). `specter` and
`spec-lru` load twice over one draft cache: first (quantise + write) and cached. "device" is
what the emulated device holds beside the host store (non-expert weights, slot pool and draft, in
the compute dtype; a big model's CPU pool aliases the store and holds nothing): on a GPU box that
lives in device memory, so `host` = peak RSS - device is what the host needs there.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specter.policy import POLICY

# config overrides per shape: the routed experts (and attention) as published, a 32k vocabulary
SHAPES = {
    "qwen3-30b-a3b": ("qwen3_moe", "num_experts", dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                        num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, norm_topk_prob=True)),
    "mixtral-8x7b": ("mixtral", "num_local_experts", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8)),
    "deepseek-v2-lite": ("deepseek_v2", "n_routed_experts", dict(hidden_size=2048, moe_intermediate_size=1408, intermediate_size=10944,
                                             n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                                             first_k_dense_replace=0, num_attention_heads=16,
                                             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)),
}


def make_config(shape: str, layers: int, vocab: int = 32000, **overrides):
    import transformers as T

    arch, _, over = SHAPES[shape]
    over = {**over, **overrides}
    cls = {"qwen3_moe": T.Qwen3MoeConfig, "mixtral": T.MixtralConfig, "deepseek_v2": T.DeepseekV2Config}[arch]
    return cls(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False,
               eos_token_id=2, bos_token_id=1, dtype="bfloat16", **over)


def write_checkpoint(path: Path, cfg, dtype=torch.bfloat16, seed: int = 0) -> int:
    """config.json + one model.safetensors written tensor by tensor (never the whole model in memory),
    with the published tensor names the loader reads. Returns the file's size."""
    from specter.config import ModelSpec
    from specter.loader import _DEFAULT_EXPERT_NAMES, _EXPERT_NAMES, _checkpoint_name
    from specter.model import MoETransformer

    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(path))
    spec = ModelSpec.from_hf(cfg)
    with torch.device("meta"):
        model = MoETransformer(spec, 1)
    tensors = [(_checkpoint_name(n, spec), tuple(p.shape)) for n, p in model.named_parameters()]
    gate, up, down = _EXPERT_NAMES.get(spec.arch, _DEFAULT_EXPERT_NAMES)
    I, H = spec.expert_inter, spec.hidden
    for layer in spec.moe_layer_ids:
        for e in range(spec.n_experts):
            for name, shape in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
                tensors.append((f"model.layers.{layer}.{name.format(e=e)}.weight", shape))
    item = torch.empty((), dtype=dtype).element_size()
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = item * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16" if dtype == torch.bfloat16 else "F16", "shape": list(shape),
                        "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in tensors:
            std = 1.0 if "norm" in name else 0.02
            t = (torch.randn(shape, generator=gen) * std + (1.0 if "norm" in name else 0.0)).to(dtype)
            f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
    return (path / "model.safetensors").stat().st_size


def _load(model: str, policy: str, residency: float, compress: bool):
    import specter

    from specter.policy import POLICY

    budget = dict(residency=residency) if POLICY[policy].offloads else {}  # resident takes none
    return specter.load(model, device="cpu", policy=policy, compress_experts=compress, **budget)


def measure(model: str, policy: str, residency: float, compress: bool = False) -> dict:
    """One load in this process: seconds to load, peak RSS, what the emulated device holds."""
    import specter

    torch.manual_seed(0)
    base = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
    t0 = time.perf_counter()
    engine = _load(model, policy, residency, compress)
    load_s = time.perf_counter() - t0
    engine.generate([1, 2, 3], max_new_tokens=2)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device = sum(p.nbytes for p in engine.model.parameters())  # non-expert weights: on the device
    mgr = getattr(engine.decoder, "experts", None) or getattr(engine.decoder, "target", None)
    for ew in getattr(mgr, "pool", []):
        if not ew.w13.is_meta:  # an aliased CPU pool (a big model's) holds no bytes of its own
            device += ew.w13.nbytes + ew.w2.nbytes
    draft = getattr(engine.decoder, "draft", None)
    for ew in getattr(draft, "layers", []):
        device += ew.w13.nbytes + ew.w2.nbytes
    for q in getattr(draft, "q13", []) + getattr(draft, "q2", []):  # packed Int4Experts (CUDA)
        device += sum(t.nbytes for t in q.tensors().values())
    engine.close()
    return dict(policy=policy, load_s=load_s, peak_rss=peak, base_rss=base, device_bytes=device,
                specter=specter.__file__)


def side_by_side(model: str, policies: list[str], residency: float, repeat: int, compress: bool = False) -> dict:
    """Load times measured alternately in one process (imports done, draft cache warm): the honest
    ratio on a machine whose load drifts. Median seconds per policy."""
    import gc

    import specter

    times = {p: [] for p in policies}
    for i in range(repeat + 1):  # the first round warms imports and caches and is not counted
        for p in policies:
            t0 = time.perf_counter()
            engine = _load(model, p, residency, compress)
            if i:
                times[p].append(time.perf_counter() - t0)
            engine.close()
            del engine
            gc.collect()
    return {p: statistics.median(t) for p, t in times.items()}


def run_child(model: Path, policy: str, residency: float, env: dict, compress: bool = False) -> dict:
    cmd = ["nice", sys.executable, __file__, "--measure", str(model), "--policies", policy,
           "--residency", str(residency)] + ["--compress-experts"] * compress
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{policy}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=None, help="routed experts a layer (default: the model's)")
    ap.add_argument("--policies", default="on-demand,next-layer,spec-lru,specter")
    ap.add_argument("--residency", type=float, default=0.25)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one, deleted after)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (and reuse it if --dir has one)")
    ap.add_argument("--specter-src", default=None, help="import specter from this checkout (e.g. main, for 'before')")
    ap.add_argument("--repeat", type=int, default=1, help="loads per row: median load time, highest peak")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compress-experts", action="store_true",
                    help="the store losslessly coded; its first load codes (a cold coded cache), the next reads it")
    ap.add_argument("--side-by-side", type=int, default=0, metavar="R",
                    help="also time loads of the policies alternately in one process, R rounds (cached draft)")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one load in this process
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if args.measure:
        if args.side_by_side:
            print(json.dumps(side_by_side(args.measure, policies, args.residency, args.side_by_side,
                                          args.compress_experts)))
        else:
            print(json.dumps(measure(args.measure, policies[0], args.residency, args.compress_experts)))
        return 0

    path = Path(args.dir or tempfile.mkdtemp(prefix="specter-big-", dir="/tmp"))
    cache = Path(tempfile.mkdtemp(prefix="specter-draft-cache-", dir="/tmp"))
    env = {**os.environ, "SPECTER_DRAFT_CACHE": str(cache), "TQDM_DISABLE": "1"}
    if args.specter_src:
        env["PYTHONPATH"] = os.pathsep.join([args.specter_src, env.get("PYTHONPATH", "")])
    try:
        if not (path / "model.safetensors").is_file():
            t0 = time.perf_counter()
            over = {} if args.experts is None else {SHAPES[args.shape][1]: args.experts}
            size = write_checkpoint(path, make_config(args.shape, args.layers, **over))
            print(f"wrote {size / 1e9:.2f} GB to {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        size = (path / "model.safetensors").stat().st_size
        rows = []
        for p in policies:
            cached = POLICY[p].drafts or args.compress_experts  # a draft or coded store: made, then cached
            loads = ("first", "cached") if cached else ("first",)
            for which in loads:
                runs = []
                for _ in range(args.repeat):
                    if which == "first":  # every draft policy's first load quantises (the same key otherwise hits)
                        shutil.rmtree(cache, ignore_errors=True)
                    runs.append(run_child(path, p, args.residency, env, args.compress_experts))
                r = max(runs, key=lambda x: x["peak_rss"])
                r.update(load=which, checkpoint_bytes=size, load_s=statistics.median(x["load_s"] for x in runs))
                rows.append(r)
                print(_row(r), file=sys.stderr)
        side = None
        if args.side_by_side:
            cmd = ["nice", sys.executable, __file__, "--measure", str(path), "--policies", ",".join(policies),
                   "--residency", str(args.residency), "--side-by-side", str(args.side_by_side)] + \
                ["--compress-experts"] * args.compress_experts
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"side by side: child failed\n{out.stderr[-3000:]}")
            side = json.loads(out.stdout.strip().splitlines()[-1])
        if args.json:
            print(json.dumps({"shape": args.shape, "layers": args.layers, "residency": args.residency, "rows": rows,
                              "side_by_side": side}))
        else:
            print(f"{args.shape}, {args.layers} layer(s), checkpoint {size / 1e9:.2f} GB, residency {args.residency}")
            print(f"{'policy':<11} {'load':<7} {'load s':>7} {'peak RSS GB':>11} {'/ ckpt':>7} {'load adds':>9} "
                  f"{'/ ckpt':>7} {'device GB':>9} {'host GB':>8} {'/ ckpt':>7}")
            for r in rows:
                print(_row(r))
            if side:
                base = side.get("on-demand", next(iter(side.values())))
                print(f"load time side by side in one process ({args.side_by_side} rounds, median, draft cached): "
                      + ", ".join(f"{p} {t:.2f} s ({t / base:.2f}x)" for p, t in side.items()))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    return 0


def _row(r: dict) -> str:
    size, host = r["checkpoint_bytes"], r["peak_rss"] - r["device_bytes"]
    adds = r["peak_rss"] - r.get("base_rss", 0)
    return (f"{r['policy']:<11} {r['load']:<7} {r['load_s']:>7.1f} {r['peak_rss'] / 1e9:>11.2f} "
            f"{r['peak_rss'] / size:>6.2f}x {adds / 1e9:>9.2f} {adds / size:>6.2f}x "
            f"{r['device_bytes'] / 1e9:>9.2f} {host / 1e9:>8.2f} {host / size:>6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
