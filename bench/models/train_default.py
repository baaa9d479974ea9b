#!/usr/bin/env python
"""Recipe for Specter's bundled default model (a small Qwen3-MoE trained on Python code).

Corpus: ``.py`` sources already installed with the interpreter that runs this script: the
standard library's modules, a capped slice of its test suite, and capped slices of the permissively
licensed packages in ``SITE_PACKAGES`` (no tests, no vendored copies, deduplicated); the held-out
packages of ``eval_default.py`` (``HELD_OUT``) are never included. Split into train/validation by a
hash of each entry. No download is needed.

Steps (each cached under ``--work-dir`` so a restart is fast):
  1. list + split the corpus files                      -> work/files.json
  2. train a byte-level BPE tokenizer on the train split -> out/tokenizer.json (+ tokenizer_config.json)
  3. tokenize both splits once                           -> work/tokens_{train,val}.pt (uint16/int32)
  4. train a Qwen3-MoE (transformers' Qwen3MoeForCausalLM) with the router load-balancing loss,
     AdamW + linear warmup + cosine decay, then a per-layer rebalancing phase, then an unlikelihood phase
     against greedy loops; checkpoints every ``--ckpt-minutes`` (``--resume``)
  5. save the final model in Hugging Face format (bf16 safetensors) + generation_config.json (the recommended
     sampling settings, ``--gen-*``)

Usage (the bundled model was made with the defaults):
    python bench/models/train_default.py --out runs/default_model

Only torch, tokenizers, transformers, safetensors and tqdm are needed. CUDA is used when available
(bf16 autocast), else CPU fp32. The run is deterministic for a given seed and machine: data order
is a pure function of (seed, step), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
TRAIN_SEQ_DEFAULT = 256


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------
HELD_OUT = ("transformers", "tqdm", "safetensors")  # eval_default.py's held-out text: never trained on
# Permissively licensed distributions whose installed .py sources join the corpus (SPDX as their metadata states
# it; the listing records each one's version and metadata licence in files.json and the card). Left out: the
# held-out three, copyleft/MPL code (certifi, hypothesis), mostly-generated data (botocore, awscli, cfn-lint,
# aws-sam-translator), docutils (mixed licences) and Specter itself.
SITE_PACKAGES = {
    "accelerate": "Apache-2.0", "anyio": "MIT", "attrs": "MIT", "click": "BSD-3-Clause", "cloudpickle": "BSD-3-Clause",
    "decorator": "BSD-2-Clause", "docker": "Apache-2.0", "einops": "MIT", "fastapi": "MIT", "filelock": "MIT",
    "Flask": "BSD-3-Clause", "fonttools": "MIT", "fsspec": "BSD-3-Clause", "h11": "MIT", "httpcore": "BSD-3-Clause",
    "httpx": "BSD-3-Clause", "huggingface_hub": "Apache-2.0", "idna": "BSD-3-Clause", "ipython": "BSD-3-Clause",
    "jedi": "MIT", "Jinja2": "BSD-3-Clause", "jsonschema": "MIT", "libcst": "MIT", "markdown-it-py": "MIT",
    "matplotlib": "PSF-based matplotlib licence", "moto": "Apache-2.0", "mpmath": "BSD-3-Clause",
    "networkx": "BSD-3-Clause", "numpy": "BSD-3-Clause", "openai": "Apache-2.0", "optimum-quanto": "Apache-2.0",
    "packaging": "Apache-2.0 OR BSD-2-Clause", "parso": "MIT", "pillow": "MIT-CMU", "pip": "MIT", "pluggy": "MIT",
    "prometheus_client": "Apache-2.0", "prompt_toolkit": "BSD-3-Clause", "psutil": "BSD-3-Clause",
    "pydantic": "MIT", "Pygments": "BSD-2-Clause", "pyparsing": "MIT", "pytest": "MIT",
    "python-dateutil": "Apache-2.0 OR BSD-3-Clause", "PyYAML": "MIT", "requests": "Apache-2.0", "rich": "MIT",
    "scipy": "BSD-3-Clause", "setuptools": "MIT", "sortedcontainers": "Apache-2.0", "starlette": "BSD-3-Clause",
    "sympy": "BSD-3-Clause", "torch": "BSD-3-Clause", "trio": "MIT OR Apache-2.0", "triton": "MIT",
    "typer": "MIT", "urllib3": "MIT", "uvicorn": "BSD-3-Clause", "Werkzeug": "BSD-3-Clause", "wrapt": "BSD-2-Clause",
}
PACKAGE_CAP_BYTES = 2_000_000  # per distribution: no one package's style dominates
STDLIB_TEST_CAP_BYTES = 1_500_000  # the stdlib's own test suite, weighted far down (it was 60% of the old corpus)
TEST_PARTS = {"test", "tests", "testing", "idle_test", "unittests"}
VENDORED_PARTS = {"_vendor", "vendor", "vendored", "_vendored", "third_party", "externals", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def site_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"]).resolve()


def is_test(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return (bool(TEST_PARTS & set(parts[:-1])) or name.startswith("test_") or name.endswith("_test.py")
            or name == "conftest.py")


def read_source(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a few test files are deliberately not UTF-8; skip them
    return text


def usable(text: str | None) -> bool:
    """Real source, not data: at least a few lines, no line over 500 characters."""
    return text is not None and len(text) >= 200 and max(map(len, text.splitlines()), default=0) <= 500


def fingerprint(text: str) -> str:
    """Content hash blind to trailing spaces and blank lines: vendored or copied files collapse to one."""
    return hashlib.sha1("\n".join(ln.rstrip() for ln in text.splitlines() if ln.strip()).encode()).hexdigest()


def _hash_order(rels: list[str]) -> list[str]:
    return sorted(rels, key=lambda r: hashlib.sha1(r.encode()).hexdigest())


def _take(root: Path, rels: list[str], cap: int | None, seen: set) -> list[str]:
    """Usable, not-yet-seen files of rels in a fixed pseudo-random order until cap bytes (None: all, sorted)."""
    taken, total = [], 0
    for rel in (sorted(rels) if cap is None else _hash_order(rels)):
        text = read_source(root / rel)
        if not usable(text):
            continue
        fp = fingerprint(text)
        if fp in seen:
            continue
        if cap is not None and total + len(text) > cap:
            continue
        seen.add(fp)
        taken.append(rel)
        total += len(text)
    return sorted(taken)


def list_corpus(val_percent: float) -> dict:
    """The corpus: stdlib modules, a capped slice of the stdlib tests, and capped slices of permissively licensed
    installed packages (no tests, no vendored copies, deduplicated), split train/val by a hash of each entry.

    Entries are "stdlib/REL" or "site/REL" (REL relative to that root); the held-out packages never appear."""
    import importlib.metadata as md

    roots = {"stdlib": stdlib_root(), "site": site_root()}
    seen: set = set()
    modules, tests = [], []
    for dirpath, dirnames, filenames in os.walk(roots["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for fn in filenames:
            if fn.endswith(".py"):
                rel = Path(dirpath, fn).relative_to(roots["stdlib"]).as_posix()
                (tests if is_test(rel) else modules).append(rel)
    entries = [f"stdlib/{r}" for r in _take(roots["stdlib"], modules, None, seen)]
    entries += [f"stdlib/{r}" for r in _take(roots["stdlib"], tests, STDLIB_TEST_CAP_BYTES, seen)]
    sources = {"stdlib": {"licence": "PSF-2.0", "version": sys.version.split()[0], "files": len(entries)}}
    for name in sorted(SITE_PACKAGES, key=str.lower):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # recorded as absent: the card lists what was actually used
        rels = []
        for f in dist.files or []:
            rel = str(f).replace("\\", "/")
            parts = rel.split("/")
            if (rel.endswith(".py") and not rel.startswith("..") and not is_test(rel)
                    and not (VENDORED_PARTS & set(parts)) and parts[0] not in HELD_OUT
                    and (roots["site"] / rel).is_file()):
                rels.append(rel)
        taken = _take(roots["site"], rels, PACKAGE_CAP_BYTES, seen)
        meta = dist.metadata
        sources[name] = {"licence": SITE_PACKAGES[name], "version": dist.version, "files": len(taken),
                         "metadata_licence": (meta.get("License-Expression") or meta.get("License") or "")[:80]}
        entries += [f"site/{r}" for r in taken]
    train, val = [], []
    for e in entries:
        h = int(hashlib.sha1(e.encode()).hexdigest()[:8], 16) % 10000
        (val if h < val_percent * 100 else train).append(e)
    return {"roots": {k: str(v) for k, v in roots.items()}, "sources": sources, "train": train, "val": val}


def entry_path(corpus: dict, entry: str) -> Path:
    src, rel = entry.split("/", 1)
    return Path(corpus["roots"][src]) / rel


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def train_tokenizer(corpus: dict, files: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def it():
        for e in files:
            t = read_source(entry_path(corpus, e))
            if t is not None:
                yield t

    tok.train_from_iterator(it(), trainer=trainer, length=len(files))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes its internal class name; the public one loads in 4.x and 5.x alike
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def load_tokenizer(out_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir))


def tokenize_split(tok, corpus: dict, files: list[str]) -> torch.Tensor:
    """All files of a split as one stream, each file followed by EOS."""
    eos = tok.convert_tokens_to_ids(EOS)
    backend = tok.backend_tokenizer
    ids: list[int] = []
    texts = [t for t in (read_source(entry_path(corpus, e)) for e in files) if t is not None]
    B = 64
    for i in range(0, len(texts), B):
        for enc in backend.encode_batch(texts[i : i + B], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
    dtype = torch.int16 if len(tok) <= 32767 else torch.int32
    return torch.tensor(ids, dtype=dtype)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
def make_config(args, vocab_size: int, eos_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate * 2,  # unused (all layers sparse), kept sensible
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=args.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=args.moe_intermediate,
        num_experts_per_tok=args.top_k,
        num_experts=args.experts,
        norm_topk_prob=True,
        output_router_logits=False,  # saved config: inference default; training passes it explicitly
        router_aux_loss_coef=args.aux_coef,
        mlp_only_layers=[],
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    t = min(1.0, t)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


def lr_at_total(step: int, args) -> float:
    if step < args.steps:
        return lr_at(step, args)
    if step < args.steps + args.rebalance_steps:
        t = (step - args.steps) / max(1, args.rebalance_steps)
        return args.rebalance_lr + (args.min_lr - args.rebalance_lr) * t
    t = (step - args.steps - args.rebalance_steps) / max(1, args.unlikelihood_steps)
    return args.ul_lr + (args.min_lr - args.ul_lr) * t


def unlikelihood_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al. 2019, "Neural text generation with unlikelihood training").

    logits [B, T, V] predict x[:, 1:] from x[:, :-1] ([B, T+1] token ids). At position t the negative
    candidates are the tokens already in the context x[:, :t+1], except the true next token:
    -sum_c log(1 - p(c)), averaged over positions. It lowers the probability of copying the context
    where the text does not, which is what makes greedy decoding of a small model fall into a loop.
    """
    B, T, V = logits.shape
    ctx = torch.zeros(B, T, V, dtype=torch.bool, device=logits.device)
    ctx.scatter_(2, x[:, :-1, None], True)
    ctx = ctx.cumsum(1, dtype=torch.int32) > 0  # [B, T, V]: seen in x[:, :t+1]
    ctx.scatter_(2, x[:, 1:, None], False)  # never penalise the true next token
    p = logits.softmax(-1)
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * ctx).sum(-1).mean()


def repeated_ngrams(ids: torch.Tensor, n: int = 4) -> torch.Tensor:
    """ids [B, L] -> bool [B, L]: True where ids[:, t] completes an n-gram that already occurred in its row."""
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for b, row in enumerate(ids.tolist()):
        seen = set()
        for t in range(n - 1, len(row)):
            g = tuple(row[t - n + 1:t + 1])
            if g in seen:
                mask[b, t] = True
            seen.add(g)
    return mask


class GreedyPool:
    """Phase 3's sequence-level unlikelihood data: the model's own greedy continuations of training prefixes.

    Continuations are generated ``rows`` at a time (HF generate's per-token overhead dominates at this size, so
    one batch of 32 costs about what one of 8 does) and handed out ``batch`` rows per step, then regenerated with
    the current weights: they are at most rows / batch steps stale.
    """

    def __init__(self, args, data: torch.Tensor, device):
        self.args, self.data, self.device = args, data, device
        self.rows: torch.Tensor | None = None

    @torch.no_grad()
    def _fill(self, model, step: int):
        a = self.args
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - a.ul_prefix - 1, (a.ul_pool,), generator=g)
        prefix = torch.stack([self.data[s:s + a.ul_prefix] for s in starts.tolist()]).long().to(self.device)
        model.eval()
        out = model.generate(prefix, max_new_tokens=a.ul_continuation, min_new_tokens=a.ul_continuation,
                             do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
        model.train()
        self.rows = out.cpu()

    def next(self, model, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [batch, prefix+continuation], mask [batch, prefix+continuation]: repeated 4-grams of the continuation)."""
        if self.rows is None or self.rows.shape[0] < self.args.batch:
            self._fill(model, step)
        ids, self.rows = self.rows[: self.args.batch], self.rows[self.args.batch:]
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[:, self.args.ul_prefix:] = repeated_ngrams(ids[:, self.args.ul_prefix:])
        return ids.to(self.device), mask.to(self.device)


def sequence_unlikelihood_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, L-1, V] of ids[:, :-1]; -log(1 - p(token)) at every continuation token that repeats a 4-gram,
    averaged over continuation tokens (Welleck et al.'s sequence-level objective)."""
    p = logits.softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    n = (ids.shape[1] - 1) * ids.shape[0]
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * m).sum() / n


def per_layer_balance_loss(router_logits, top_k: int) -> torch.Tensor:
    """Switch-style balance loss computed per layer and averaged (= top_k when perfectly balanced)."""
    losses = []
    for rl in router_logits:
        probs = torch.softmax(rl.float(), dim=-1)  # [tokens, E]
        E = probs.shape[-1]
        idx = torch.topk(probs, top_k, dim=-1).indices
        frac = torch.nn.functional.one_hot(idx, E).float().sum(1).mean(0)  # [E], sums to top_k
        losses.append(E * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def revive_dead_experts(model, opt, data, args, device, autocast) -> list:
    """Re-initialise starved experts as noisy copies of the busiest experts of the same layer (deterministic)."""
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    counts = torch.zeros(cfg.num_hidden_layers, E)
    model.eval()
    for i in range(8):
        x = get_batch(data, i, args, seed_offset=424242).to(device)
        with autocast():
            out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        for li, rl in enumerate(out.router_logits):
            counts[li] += torch.bincount(rl.float().topk(k, dim=-1).indices.reshape(-1).cpu(), minlength=E)
    model.train()
    share = counts / counts.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(args.seed + 99991)
    revived = []
    for li, layer in enumerate(model.model.layers):
        dead = [e for e in range(E) if share[li, e] < args.revive_below]
        busy = sorted((e for e in range(E) if e not in dead), key=lambda e: -share[li, e].item())
        mlp = layer.mlp
        for j, d in enumerate(dead):
            src = busy[j % len(busy)]
            for prm in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
                noise = torch.randn(prm[src].shape, generator=g).to(prm.device, prm.dtype)
                w = prm.data  # plain storage write: keeps autograd version counters out of it
                w[d] = w[src] + 0.05 * w[src].float().std().to(w.dtype) * noise
                st = opt.state.get(prm, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        st[key][d] = st[key][src]
            revived.append((li, d, src, round(share[li, d].item(), 4)))
    return revived


def get_batch(data: torch.Tensor, step: int, args, seed_offset: int = 0):
    """Random windows; the choice is a pure function of (seed, step) so resume is exact."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + seed_offset)
    n = data.numel() - args.seq_len - 1
    starts = torch.randint(0, n, (args.batch,), generator=g)
    x = torch.stack([data[s : s + args.seq_len + 1].long() for s in starts.tolist()])
    return x


def set_seed(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, device, max_tokens: int, autocast) -> dict:
    """Mean next-token loss/accuracy over non-overlapping windows of the validation stream."""
    model.eval()
    tot_loss, tot_correct, tot_n = 0.0, 0, 0
    n_win = min((data.numel() - 1) // seq_len, max(1, max_tokens // seq_len))
    for w in range(0, n_win, 8):
        xs = [data[i * seq_len : i * seq_len + seq_len + 1].long() for i in range(w, min(n_win, w + 8))]
        x = torch.stack(xs).to(device)
        with autocast():
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        y = x[:, 1:]
        tot_loss += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        tot_correct += (logits.argmax(-1) == y).sum().item()
        tot_n += y.numel()
    model.train()
    return {"loss": tot_loss / tot_n, "acc": tot_correct / tot_n, "tokens": tot_n}


def write_generation_config(out: Path, eos_id: int, args):
    """The sampling settings the card recommends: `specter generate` and transformers apply them by default."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=True,
                     temperature=args.gen_temperature, top_p=args.gen_top_p, top_k=args.gen_top_k,
                     repetition_penalty=args.gen_repetition_penalty, max_new_tokens=64).save_pretrained(str(out))


def atomic_save(obj, path: Path):
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output dir for the final HF model + tokenizer")
    p.add_argument("--work-dir", default=None, help="caches + checkpoints (default: OUT/work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from WORK/ckpt.pt if present")
    # corpus / tokenizer
    p.add_argument("--max-files", type=int, default=None, help="use only the first N train (and N//10+1 val) files")
    p.add_argument("--val-percent", type=float, default=3.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    # model
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=192)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--aux-coef", type=float, default=0.02,
                   help="phase 1: transformers' load-balancing loss (computed over all layers pooled)")
    # optimisation
    p.add_argument("--steps", type=int, default=9500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=TRAIN_SEQ_DEFAULT)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=250)
    p.add_argument("--rebalance-steps", type=int, default=700,
                   help="phase 2, after --steps: train with a PER-LAYER load-balancing loss so that no expert of "
                        "any layer starves (transformers' aux loss pools all layers, which lets single layers "
                        "collapse onto a few experts)")
    p.add_argument("--rebalance-coef", type=float, default=0.1)
    p.add_argument("--revive-below", type=float, default=0.01,
                   help="at the start of phase 2, every expert whose routing share (on a few probe batches) is "
                        "below this is re-initialised as a noisy copy of a busy expert of its layer (router row, "
                        "weights and optimiser state): the balance loss alone cannot revive an expert the router "
                        "never picks")
    p.add_argument("--rebalance-lr", type=float, default=5e-4, help="phase 2 lr, decayed linearly to --min-lr")
    p.add_argument("--unlikelihood-steps", type=int, default=400,
                   help="phase 3, after phase 2: fine-tune with token-level unlikelihood (weight --ul-alpha) on top "
                        "of the language-model and per-layer balance losses, against greedy loops")
    p.add_argument("--ul-alpha", type=float, default=1.0)
    p.add_argument("--ul-lr", type=float, default=3e-4, help="phase 3 lr, decayed linearly to --min-lr")
    p.add_argument("--ul-seq-every", type=int, default=2,
                   help="phase 3: every Nth step is a sequence-level unlikelihood step on the model's own greedy "
                        "continuations (penalising each token that repeats a 4-gram); 0 = none")
    p.add_argument("--ul-seq-alpha", type=float, default=1.0)
    p.add_argument("--ul-prefix", type=int, default=32)
    p.add_argument("--ul-continuation", type=int, default=64)
    p.add_argument("--ul-pool", type=int, default=32, help="greedy continuations generated per batch")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--ckpt-minutes", type=float, default=4.0)
    p.add_argument("--eval-tokens", type=int, default=65536, help="validation tokens for the final eval")
    p.add_argument("--no-progress", action="store_true")
    # the recommended sampling settings written to generation_config.json (the card measures them)
    p.add_argument("--gen-temperature", type=float, default=0.7)
    p.add_argument("--gen-top-p", type=float, default=0.95)
    p.add_argument("--gen-top-k", type=int, default=50)
    p.add_argument("--gen-repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint, no export) after this many steps: simulates an interrupted run")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the recipe; restores torch's global thread/determinism settings afterwards (tests call this)."""
    threads, det, warn = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        return _main(argv)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn)


def _main(argv=None) -> dict:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers import Qwen3MoeForCausalLM

    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    set_seed(args.seed)

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)

        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)

        def autocast():
            return torch.autocast("cpu", enabled=False)

    # 1. corpus listing (cached; the listing is part of the cache key of everything below)
    files_path = work / "files.json"
    corpus = list_corpus(args.val_percent)
    if args.max_files is not None:
        corpus["train"] = corpus["train"][: args.max_files]
        corpus["val"] = corpus["val"][: args.max_files // 10 + 1]
    key = hashlib.sha1(json.dumps([corpus, args.vocab_size], sort_keys=True).encode()).hexdigest()[:16]
    prev = json.loads(files_path.read_text()) if files_path.exists() else None
    if prev is None or prev.get("key") != key:
        for f in ("tokens_train.pt", "tokens_val.pt", "tokenizer.json", "tokenizer_config.json"):
            (work / f).unlink(missing_ok=True)
        files_path.write_text(json.dumps({"key": key, **corpus}, indent=0))
    print(f"[corpus] {len(corpus['sources'])} sources: {len(corpus['train'])} train / {len(corpus['val'])} val files",
          flush=True)

    # 2. tokenizer (trained once, cached in work/, then copied to out/)
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        t0 = time.time()
        train_tokenizer(corpus, corpus["train"], args.vocab_size, tok_dir)
        print(f"[tokenizer] trained in {time.time() - t0:.1f}s", flush=True)
    tok = load_tokenizer(tok_dir)
    eos_id = tok.convert_tokens_to_ids(EOS)

    # 3. tokenized corpus (cached)
    data = {}
    for split in ("train", "val"):
        path = work / f"tokens_{split}.pt"
        if path.exists():
            data[split] = torch.load(path)
        else:
            t0 = time.time()
            data[split] = tokenize_split(tok, corpus, corpus[split])
            atomic_save(data[split], path)
            print(f"[data] tokenized {split}: {data[split].numel():,} tokens in {time.time() - t0:.1f}s", flush=True)
    train_data, val_data = data["train"], data["val"]
    print(f"[data] train {train_data.numel():,} tokens, val {val_data.numel():,} tokens", flush=True)

    # 4. model + optimiser
    config = make_config(args, len(tok), eos_id)
    model = Qwen3MoeForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"[model] {n_params / 1e6:.2f}M params, experts {n_expert / 1e6:.2f}M ({100 * n_expert / n_params:.0f}%)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    ckpt_path = work / "ckpt.pt"
    start_step, elapsed_before, log = 0, 0.0, []
    pool = GreedyPool(args, train_data, device)
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_step, elapsed_before, log = ck["step"], ck.get("elapsed", 0.0), ck.get("log", [])
        torch.set_rng_state(ck["torch_rng"])
        random.setstate(ck["py_rng"])
        pool.rows = ck.get("ul_pool")
        print(f"[resume] from step {start_step} ({elapsed_before / 60:.1f} min already trained)", flush=True)

    def save_ckpt(step, elapsed):
        atomic_save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "log": log,
                "args": vars(args),
                "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(),
                "ul_pool": pool.rows,  # phase 3's unused greedy continuations: a resumed run uses the same ones
            },
            ckpt_path,
        )

    tokens_per_step = args.batch * args.seq_len
    t_start = time.time()
    last_ckpt = time.time()
    ema = None
    total_steps = args.steps + args.rebalance_steps + args.unlikelihood_steps
    bar = tqdm(range(start_step, total_steps), initial=start_step, total=total_steps, disable=args.no_progress,
               dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        lr = lr_at_total(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        p3 = step - args.steps - args.rebalance_steps
        if p3 >= 0 and args.ul_seq_every > 0 and p3 % args.ul_seq_every == args.ul_seq_every - 1:
            x, rep = pool.next(model, step)  # phase 3, sequence-level step
        else:
            x, rep = get_batch(train_data, step, args).to(device), None
        with autocast():
            outp = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        logits = outp.logits.float()
        lm_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        if step == args.steps and args.rebalance_steps > 0 and args.revive_below > 0:
            revived = revive_dead_experts(model, opt, train_data, args, device, autocast)
            print(f"[revive] (layer, expert, from, share): {revived}", flush=True)
            log.append({"step": step, "revived": revived})
        if step < args.steps:  # phase 1
            loss = lm_loss + args.aux_coef * outp.aux_loss.float()
            aux = outp.aux_loss.item()
        else:  # phase 2: per-layer balance (phase 3: plus unlikelihood)
            bal = per_layer_balance_loss(outp.router_logits, args.top_k)
            loss = lm_loss + args.rebalance_coef * bal
            aux = bal.item()
            if rep is not None:  # only unlikelihood: the model's own text is no target to imitate
                ul = sequence_unlikelihood_loss(logits, x, rep)
                loss = args.ul_seq_alpha * ul + args.rebalance_coef * bal
                aux = ul.item()
            elif p3 >= 0:
                ul = unlikelihood_loss(logits, x)
                loss = loss + args.ul_alpha * ul
                aux = ul.item()
        lm = lm_loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        dt = time.time() - t_start
        tps = (step + 1 - start_step) * tokens_per_step / max(dt, 1e-6)
        bar.set_postfix(loss=f"{ema:.3f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}", tok_s=f"{tps:,.0f}", refresh=False)
        if step % 25 == 0 or step == total_steps - 1:
            log.append({"step": step, "lm_loss": round(lm, 4), "aux": round(aux, 4), "lr": lr, "gnorm": round(gn, 3),
                        "elapsed": round(elapsed_before + dt, 1)})
            if rep is not None:  # lm_loss of the model's own greedy text, aux its sequence-level unlikelihood
                log[-1]["own_text"] = True
            if args.no_progress:
                print(json.dumps(log[-1]), flush=True)
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(step + 1, elapsed_before + (time.time() - t_start))
            last_ckpt = time.time()
        if args.stop_after is not None and step + 1 >= args.stop_after and step + 1 < total_steps:
            bar.close()
            save_ckpt(step + 1, elapsed_before + (time.time() - t_start))
            print(f"[stop] interrupted after step {step + 1}; continue with --resume", flush=True)
            return {"stopped_at": step + 1}
    bar.close()
    train_seconds = elapsed_before + (time.time() - t_start)
    if start_step < total_steps:
        save_ckpt(total_steps, train_seconds)

    # 5. final eval on the validation split + export
    val = evaluate(model, val_data, args.seq_len, device, args.eval_tokens, autocast)
    print(f"[val] loss {val['loss']:.4f} ppl {math.exp(val['loss']):.2f} top1 {val['acc']:.4f} ({val['tokens']} tokens)",
          flush=True)

    model = model.to(torch.bfloat16).cpu()
    model.config.use_cache = True
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out), safe_serialization=True)
    write_generation_config(out, eos_id, args)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    summary = {
        "command": "python bench/models/train_default.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "steps": total_steps,
        "tokens_seen": total_steps * tokens_per_step,
        "train_tokens": train_data.numel(),
        "val_tokens": val_data.numel(),
        "train_files": len(corpus["train"]),
        "val_files": len(corpus["val"]),
        "sources": corpus["sources"],
        "params": n_params,
        "expert_params": n_expert,
        "train_seconds": round(train_seconds, 1),
        "device": str(device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "val_loss": val["loss"],
        "val_ppl": math.exp(val["loss"]),
        "val_top1": val["acc"],
        "log": log,
        "args": vars(args),
    }
    (work / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[done] saved to {out} (trained {train_seconds / 60:.1f} min)", flush=True)
    return summary


if __name__ == "__main__":
    main()
