#!/usr/bin/env python
"""Measure the quality of Specter's bundled default model and (optionally) write its model card.

Loads the saved files with plain transformers (fp32) and measures:
  * next-token top-1 accuracy, loss and mean max-probability on HELD-OUT third-party Python code
    (the ``.py`` files of the installed ``transformers/models/llama/``, ``tqdm/`` and ``safetensors/``
    packages: the recipe never puts these three packages in its corpus);
  * loss / perplexity / top-1 on the recipe's validation split (entries chosen by hash, see
    ``train_default.py``);
  * the share of routing assignments (top-k slots) each expert of each layer gets on the held-out text;
  * 64-token continuations of a fixed set of varied prompts, greedy and with the model's own sampling
    settings (``generation_config.json``), and the share of distinct 4-grams in them (a loop scores low).

    python bench/models/eval_default.py --model specter/default_model \
        --summary runs/default_model/work/train_summary.json --write-card
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_default as recipe  # noqa: E402

from specter.sampling import describe  # noqa: E402
from specter.generation_defaults import read_generation_defaults  # noqa: E402
from specter.sampling import SamplingParams  # noqa: E402

REPO = HERE.parents[1]
DEFAULT_MODEL = REPO / "specter" / "default_model"
PROMPTS = [  # fixed and varied: the README's first prompt, then definitions, statements and idioms
    "def add(a, b):",
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "for i, line in enumerate(lines):",
    "import os\nimport sys\n\n\ndef main():",
    'def read_config(path):\n    """Read a JSON config file and return it as a dict."""\n',
    "@dataclass\nclass Point:\n",
    "async def fetch(session, url):\n",
    "parser = argparse.ArgumentParser(description=",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "    def __repr__(self):\n",
    "with open(filename) as f:\n",
]
SAMPLE_SEED = 0
GOALS = {"heldout_top1": 0.40, "greedy_distinct4": 0.6}
HELDOUT_PACKAGES = ["transformers/models/llama", "tqdm", "safetensors"]


def heldout_files() -> list[tuple[str, Path]]:
    import safetensors
    import tqdm
    import transformers

    roots = {
        "transformers/models/llama": Path(transformers.__file__).parent / "models" / "llama",
        "tqdm": Path(tqdm.__file__).parent,
        "safetensors": Path(safetensors.__file__).parent,
    }
    out = []
    for name in HELDOUT_PACKAGES:
        root = roots[name]
        for p in sorted(root.rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            out.append((f"{name}/{p.relative_to(root).as_posix()}", p))
    return out


def stream(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def measure(model, data: torch.Tensor, seq_len: int, batch: int = 8, count_experts: bool = False) -> dict:
    cfg = model.config
    n_win = (data.numel() - 1) // seq_len
    loss_sum, correct, n, maxp_sum = 0.0, 0, 0, 0.0
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.long)
    for w in range(0, n_win, batch):
        x = torch.stack([data[i * seq_len: i * seq_len + seq_len + 1] for i in range(w, min(n_win, w + batch))])
        out = model(input_ids=x[:, :-1], use_cache=False, output_router_logits=count_experts)
        logits = out.logits.float()
        y = x[:, 1:]
        loss_sum += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                                      reduction="sum").item()
        probs = logits.softmax(-1)
        maxp_sum += probs.max(-1).values.sum().item()
        correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
        if count_experts:
            for li, rl in enumerate(out.router_logits):
                idx = rl.topk(cfg.num_experts_per_tok, dim=-1).indices.reshape(-1)
                counts[li] += torch.bincount(idx, minlength=cfg.num_experts)
    res = {"tokens": n, "loss": loss_sum / n, "ppl": math.exp(loss_sum / n), "top1": correct / n,
           "mean_max_prob": maxp_sum / n}
    if count_experts:
        share = counts.double() / counts.sum(-1, keepdim=True)
        res["expert_share_min"] = [round(v, 4) for v in share.min(-1).values.tolist()]
        res["expert_share_max"] = [round(v, 4) for v in share.max(-1).values.tolist()]
        res["expert_share"] = [[round(v, 4) for v in row] for row in share.tolist()]
    return res


def distinct_ngrams(ids: list[int], n: int = 4) -> float:
    """Share of distinct n-grams among a continuation's n-grams (1.0: no n-gram repeats; a loop scores low)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def continuations(model, tok, gen_config=None, max_new_tokens: int = 64) -> list[dict]:
    """One continuation per prompt: greedy when gen_config is None, else sampled with it (seeded per prompt).

    Each is exactly ``max_new_tokens`` long (end-of-text suppressed until then): an early end would otherwise
    score a perfect distinct-4-gram share over nothing.
    """
    outs = []
    for i, p in enumerate(PROMPTS):
        ids = tok(p, return_tensors="pt", add_special_tokens=False)["input_ids"]
        kw = dict(do_sample=False) if gen_config is None else dict(generation_config=gen_config)
        if gen_config is not None:
            torch.manual_seed(SAMPLE_SEED + i)
        g = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **kw)
        new = g[0, ids.shape[1]:].tolist()
        outs.append({"prompt": p, "text": tok.decode(new, skip_special_tokens=True), "tokens": len(new),
                     "distinct4": round(distinct_ngrams(new), 4)})
    return outs


def sampling_settings(model_dir: Path):
    """The model's own sampling settings, as transformers reads them (None: the file asks for greedy)."""
    from transformers import GenerationConfig

    gc = GenerationConfig.from_pretrained(str(model_dir))
    return gc if gc.do_sample else None


def file_sizes(d: Path) -> dict:
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return {n: (d / n).stat().st_size for n in names if (d / n).exists()}


CARD = """# Specter default model: `specter-moe-py-12m`

A small Mixture-of-Experts causal LM for **Python source code**, bundled with Specter so the engine
runs out of the box (no model hub, no download). Hugging Face format, Qwen3-MoE architecture:
loads with `transformers.AutoModelForCausalLM` / `AutoTokenizer` from this directory, offline.

It is a *demo* model: it writes plausible-looking Python, not correct programs. Its job is to
exercise an MoE inference engine (expert offloading, routing, speculative decoding) with a
real, trained router: peaked next-token distributions, specialised experts, no dead experts.

## Architecture

| | |
|---|---|
| architecture | `Qwen3MoeForCausalLM` (`model_type: qwen3_moe`) |
| layers | {layers} (every layer is sparse MoE) |
| hidden size | {hidden} |
| attention | {heads} query heads, {kv_heads} KV heads (GQA), head_dim {head_dim}, RoPE θ=10000, q/k RMSNorm |
| experts | {experts} routed experts per layer, top-{top_k}, `norm_topk_prob=True`, moe_intermediate_size {moe_inter} |
| vocab | {vocab} (byte-level BPE, `<|endoftext|>` = id {eos} is BOS/EOS/PAD) |
| context | trained on {seq_len}-token windows; `max_position_embeddings` 2048 |
| embeddings | {tie} |
| parameters | {params:,} total, {expert_params:,} in experts ({expert_pct:.0f}%); active per token ≈ {active:,} |
| weights | `model.safetensors`, bf16, per-expert tensors (`model.layers.L.mlp.experts.E.{{gate,up,down}}_proj.weight`), router `model.layers.L.mlp.gate.weight` |
| files | {files_table} |
| total size | {total_mib:.2f} MiB |

## Training data and licence

Python source code already installed on the machine that ran the recipe (nothing is downloaded):
the **Python {py_version} standard library** modules, a {stdlib_test_mb:.1f} MB slice of the standard
library's own test suite, and up to {cap_mb:.0f} MB from each of {n_packages} permissively licensed
packages (their non-test, non-vendored `.py` files; per-package caps keep any one style from
dominating). Files are deduplicated by a whitespace-blind content hash, and files with lines over
500 characters (data, not code) are left out. {train_files} training files ({train_tokens:,} tokens) and
{val_files} validation files ({val_tokens:,} tokens), split by a SHA-1 hash of each entry (≈3% validation).

| source | version | licence | files |
|---|---|---|---|
{sources_rows}

The CPython standard library is © Python Software Foundation (PSF-2.0); each package is © its
authors under the licence listed (as its metadata states it). This model was trained on that text
and may reproduce fragments of it; treat generated text accordingly. The tokenizer and weights in
this directory are released with the Specter project; attribution for the training data is given here.

Held-out evaluation text (never trained on: the recipe leaves these three packages out of its
corpus entirely) is the installed source of `transformers/models/llama/` (Apache-2.0), `tqdm/`
(MPL-2.0 and MIT) and `safetensors/` (Apache-2.0); it is only read at evaluation time, not
redistributed.

## Recipe

One script, `bench/models/train_default.py` (needs only torch, tokenizers, transformers,
safetensors, tqdm): trains the tokenizer (byte-level BPE, {vocab} tokens, `tokenizers`), tokenizes the
corpus once (cached), then trains from scratch with AdamW (β=0.9/0.95, weight decay 0.1 on matrices),
gradient clipping 1.0, batch {batch} × {seq_len} tokens, {steps} steps in all ({tokens_seen:,} tokens ≈
{epochs:.2f} epochs), in three phases:

1. **{steps1} steps**: lr {lr} with {warmup} warmup steps and cosine decay to {min_lr}; transformers'
   router load-balancing loss (`output_router_logits=True`), coefficient {aux_coef}. That loss pools the
   router statistics of *all layers*, so it keeps the model balanced overall while single layers
   starve some experts (at the end of this phase, on the probe batches, {n_revived} experts had under
   {revive_pct:.0f}% of their layer's assignments and {n_zero} got none at all).
2. **{steps2} rebalancing steps**: first every expert with under {revive_pct:.0f}% of the routing assignments
   on 8 probe batches is re-initialised as a noisy copy (router row, weights, Adam state) of one of the
   busiest experts of its layer; then training continues with a
   *per-layer* balance loss (Switch-style, averaged over layers), coefficient {rebalance_coef}, lr
   {rebalance_lr} decaying linearly to {min_lr}.
3. **{steps3} unlikelihood steps** (Welleck et al. 2019, "Neural text generation with unlikelihood
   training"), lr {ul_lr} decaying linearly to {min_lr}, the per-layer balance loss kept. One step
   in {seq_every} is *sequence-level*: the model's own greedy continuations ({ul_cont} tokens after
   {ul_prefix}-token training prefixes, {ul_pool} generated at a time with the current weights) are
   penalised with −log(1 − p) at every token that repeats a 4-gram of its continuation, and with nothing
   else (the model's own text is no target). The other steps are ordinary language-model steps plus
   *token-level* unlikelihood (weight {ul_alpha}: −log(1 − p) of every context token that is not the next
   one). A model this small otherwise falls into loops under greedy decoding; this phase trades a
   little held-out accuracy for continuations that keep moving (the card's metrics below).

Seeded (torch/python/numpy), data order a pure function of (seed, step); checkpoints every few
minutes, `--resume` continues exactly (bit-identical to an uninterrupted run; tested).
CUDA + bf16 autocast when available, else CPU fp32.

Exact command (run from the repo root; it writes the model to `runs/default_model/`, caches and
checkpoints to `runs/default_model/work/`):

```
{train_cmd}
cp runs/default_model/{{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json}} specter/default_model/
{eval_cmd}
```

Training took {train_min:.1f} min on {train_device} (2 shared CPU cores), torch {torch_version}, Python {py_version}{timing_note}.
Training loss at the last logged language-model step ≈ {final_train_loss}. The bundled files are the output's `config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`.

## Metrics

Measured with `transformers` loading these files in float32, {seq_len}-token non-overlapping windows
(each file followed by `<|endoftext|>`):

| text | tokens | loss | perplexity | top-1 acc | mean max-prob |
|---|---|---|---|---|---|
| held-out third-party Python (llama, tqdm, safetensors) | {ho_tokens:,} | {ho_loss:.3f} | {ho_ppl:.2f} | **{ho_top1:.3f}** | {ho_maxp:.3f} |
| validation split of the corpus | {va_tokens:,} | {va_loss:.3f} | {va_ppl:.2f} | {va_top1:.3f} | {va_maxp:.3f} |

Expert routing on the held-out text (share of the top-{top_k} assignments; uniform = {uniform:.4f}):

| layer | min share | max share |
|---|---|---|
{share_rows}

Measured by:

```
{eval_cmd}
```

## Continuations

The prompts are a fixed, varied set (`PROMPTS` in `bench/models/eval_default.py`, the README's
first prompt first); 64 new tokens each (end-of-text is suppressed until then, so that a continuation
that stops early cannot score a perfect share over nothing). *Distinct 4-grams* is the share of a continuation's token
4-grams that occur once (a loop scores low), averaged over the prompts.

| decoding | mean distinct 4-grams | mean tokens |
|---|---|---|
| greedy | **{greedy_d4:.3f}** | {greedy_len:.1f} |
| sampled with `generation_config.json` ({sampling}), seeds 0..{last_seed} | {sampled_d4:.3f} | {sampled_len:.1f} |

Goals (issue 13): held-out top-1 ≥ {goal_top1:.2f} (this model: {ho_top1:.3f}); greedy distinct
4-grams ≥ {goal_d4:.1f} (this model: {greedy_d4:.3f}).

`generation_config.json` recommends {sampling}; `specter generate` uses it when no sampling option
is given (`--greedy` for greedy decoding, which the losslessness tests use).

### Greedy, unedited (prompt first, then the model's continuation)

{greedy_md}

### Sampled with the recommended settings, unedited

{sampled_md}
"""


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / max(1, len(rows))


def build_card(model_dir: Path, ho: dict, va: dict, greedy: list[dict], sampled: list[dict], sampling: str,
               summary: dict | None, eval_cmd: str) -> str:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    cfg = {k: getattr(c, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                      "vocab_size", "eos_token_id", "tie_word_embeddings")}
    sizes = file_sizes(model_dir)
    s = summary or {}
    a = s.get("args", {})
    from safetensors import safe_open

    params = expert_params = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = math.prod(f.get_slice(k).get_shape())
            params += n
            if ".experts." in k:
                expert_params += n
    per_expert = expert_params // (cfg["num_hidden_layers"] * cfg["num_experts"])
    active = params - expert_params + per_expert * cfg["num_hidden_layers"] * cfg["num_experts_per_tok"]
    log = s.get("log") or [{}]
    cont_md = {name: "\n\n".join(f"```python\n{r['prompt']}{r['text']}\n```" for r in rows)
               for name, rows in (("greedy", greedy), ("sampled", sampled))}
    sources = s.get("sources", {})
    sources_rows = "\n".join(f"| {name} | {v['version']} | {v['licence']} | {v['files']} |"
                              for name, v in sources.items() if v.get("files"))
    share_rows = "\n".join(f"| {i} | {mn:.4f} | {mx:.4f} |" for i, (mn, mx) in
                           enumerate(zip(ho["expert_share_min"], ho["expert_share_max"])))
    return CARD.format(
        layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"], moe_inter=cfg["moe_intermediate_size"], vocab=cfg["vocab_size"],
        eos=cfg["eos_token_id"], seq_len=a.get("seq_len", 256),
        tie="tied input/output embeddings" if cfg.get("tie_word_embeddings") else "untied (`lm_head.weight` stored)",
        params=params, expert_params=expert_params, expert_pct=100 * expert_params / params, active=active,
        files_table=", ".join(f"`{k}` {v / 2**20:.2f} MiB" if v > 2**20 else f"`{k}` {v / 1024:.1f} KiB"
                              for k, v in sizes.items()),
        total_mib=sum(sizes.values()) / 2**20,
        py_version=s.get("python", sys.version.split()[0]), train_files=s.get("train_files", "?"),
        train_tokens=s.get("train_tokens", 0), val_files=s.get("val_files", "?"), val_tokens=s.get("val_tokens", 0),
        lr=a.get("lr"), warmup=a.get("warmup"), min_lr=a.get("min_lr"), batch=a.get("batch"), steps=s.get("steps"),
        steps1=a.get("steps"), steps2=a.get("rebalance_steps", 0), revive_pct=100 * a.get("revive_below", 0),
        rebalance_coef=a.get("rebalance_coef"), rebalance_lr=a.get("rebalance_lr"),
        steps3=a.get("unlikelihood_steps", 0), ul_lr=a.get("ul_lr"), seq_every=a.get("ul_seq_every"),
        ul_cont=a.get("ul_continuation"), ul_prefix=a.get("ul_prefix"), ul_pool=a.get("ul_pool"),
        ul_alpha=a.get("ul_alpha"),
        n_revived=sum(len(r.get("revived", [])) for r in log),
        n_zero=sum(1 for r in log for x in r.get("revived", []) if x[3] == 0.0),
        tokens_seen=s.get("tokens_seen", 0), epochs=s.get("tokens_seen", 0) / max(1, s.get("train_tokens", 1)),
        aux_coef=a.get("aux_coef"), train_cmd=s.get("command", "?"), train_min=s.get("train_seconds", 0) / 60,
        train_device=s.get("device", "?"), torch_version=s.get("torch", torch.__version__),
        timing_note=f" ({s['timing_note']})" if s.get("timing_note") else "",
        final_train_loss=next((r["lm_loss"] for r in reversed(log) if "lm_loss" in r and not r.get("own_text")), "?"),
        ho_tokens=ho["tokens"], ho_loss=ho["loss"], ho_ppl=ho["ppl"], ho_top1=ho["top1"], ho_maxp=ho["mean_max_prob"],
        va_tokens=va["tokens"], va_loss=va["loss"], va_ppl=va["ppl"], va_top1=va["top1"], va_maxp=va["mean_max_prob"],
        uniform=1 / cfg["num_experts"], share_rows=share_rows, eval_cmd=eval_cmd, sources_rows=sources_rows,
        n_packages=sum(1 for k, v in sources.items() if k != "stdlib" and v.get("files")),
        cap_mb=recipe.PACKAGE_CAP_BYTES / 1e6, stdlib_test_mb=recipe.STDLIB_TEST_CAP_BYTES / 1e6,
        greedy_d4=_mean(greedy, "distinct4"), greedy_len=_mean(greedy, "tokens"),
        sampled_d4=_mean(sampled, "distinct4"), sampled_len=_mean(sampled, "tokens"), sampling=sampling,
        last_seed=SAMPLE_SEED + len(PROMPTS) - 1, goal_top1=GOALS["heldout_top1"], goal_d4=GOALS["greedy_distinct4"],
        greedy_md=cont_md["greedy"], sampled_md=cont_md["sampled"],
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--summary", default=None, help="train_summary.json written by train_default.py")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--val-percent", type=float, default=3.0, help="must match the recipe's split")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-card", action="store_true", help="write MODEL/README.md")
    p.add_argument("--json", default=None, help="also write the metrics as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    t0 = time.time()

    ho_files = heldout_files()
    ho = measure(model, stream(tok, [p.read_text(encoding="utf-8") for _, p in ho_files]), args.seq_len,
                 count_experts=True)
    ho["files"] = [name for name, _ in ho_files]
    print(f"[held-out] {len(ho_files)} files {ho['tokens']} tok: loss {ho['loss']:.4f} ppl {ho['ppl']:.2f} "
          f"top1 {ho['top1']:.4f} maxp {ho['mean_max_prob']:.3f}", flush=True)
    print(f"[experts] min share per layer {ho['expert_share_min']}  max {ho['expert_share_max']}", flush=True)

    corpus = recipe.list_corpus(args.val_percent)
    texts = [t for t in (recipe.read_source(recipe.entry_path(corpus, e)) for e in corpus["val"]) if t is not None]
    va = measure(model, stream(tok, texts), args.seq_len)
    print(f"[val] {len(texts)} files {va['tokens']} tok: loss {va['loss']:.4f} ppl {va['ppl']:.2f} "
          f"top1 {va['top1']:.4f}", flush=True)

    gc = sampling_settings(model_dir)
    sampling = describe(SamplingParams(**read_generation_defaults(model_dir)))  # as `specter generate` reports it
    greedy = continuations(model, tok)
    sampled = continuations(model, tok, gc) if gc is not None else []
    for name, rows in (("greedy", greedy), (f"sampled ({sampling})", sampled)):
        for r in rows:
            print(f"---- {name} {r['prompt']!r} distinct4 {r['distinct4']:.3f}\n{r['prompt']}{r['text']}", flush=True)
        if rows:
            print(f"[{name}] mean distinct 4-grams {_mean(rows, 'distinct4'):.3f}", flush=True)
    print(f"[eval] {time.time() - t0:.1f}s", flush=True)

    summary = json.loads(Path(args.summary).read_text()) if args.summary else None
    eval_cmd = "python bench/models/eval_default.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"heldout": ho, "val": va, "greedy": greedy, "sampled": sampled, "sampling": sampling,
              "greedy_distinct4": _mean(greedy, "distinct4"),
              "sampled_distinct4": _mean(sampled, "distinct4") if sampled else None, "eval_command": eval_cmd}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.write_card:
        (model_dir / "README.md").write_text(build_card(model_dir, ho, va, greedy, sampled, sampling, summary, eval_cmd))
        print(f"[card] wrote {model_dir / 'README.md'}", flush=True)
    return result


if __name__ == "__main__":
    main()
