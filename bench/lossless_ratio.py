"""Lossless expert coding: sizes of the candidate codes, and the CPU decode speed of the chosen one.

    python bench/lossless_ratio.py [--repeat 5] [--threads 1]

For the bundled model's routed experts (as the store holds them: per MoE layer w13 [E, 2I, H] and
w2 [E, H, I]) and for random normal bf16 weights at several scales, the size as a fraction of the
bf16 bytes of:
    entropy   8 raw bits + the exponents' entropy (per expert): the bound of any exponent coder
    huffman   8 raw bits + a Huffman code per expert (payload only: no tables, no offsets; DFloat11's)
    fixed-b   specter.triton_ops.lossless at code width b (everything counted), b = 2, 3, 4
    chosen    the width encode() picks
and the torch decode's speed (bf16 bytes written per second, one expert at a time, as the emulated
device decodes a landed copy), checked bit for bit, and the encode's (bf16 bytes read per second).
Then the bundled model's store as a CUDA load lays it out (lossless.layer_major: each expert's rows
and escape runs in one record, records padded to the layer's longest) against its coded bytes.
"""
from __future__ import annotations

import argparse
import heapq
import math
import os
import time
from pathlib import Path

import torch

from specter.triton_ops import lossless

MODEL = Path(__file__).resolve().parents[1] / "specter" / "default_model" / "model.safetensors"


def bundled_experts() -> list[torch.Tensor]:
    """Per MoE layer, w13 [E, 2I, H] and w2 [E, H, I] in bf16."""
    from safetensors.torch import load_file

    d = load_file(str(MODEL))
    out, layer = [], 0
    while f"model.layers.{layer}.mlp.experts.0.gate_proj.weight" in d:
        p = f"model.layers.{layer}.mlp.experts."
        E = sum(1 for k in d if k.startswith(p) and k.endswith("gate_proj.weight"))
        out.append(torch.stack([torch.cat([d[f"{p}{e}.gate_proj.weight"], d[f"{p}{e}.up_proj.weight"]]) for e in range(E)]))
        out.append(torch.stack([d[f"{p}{e}.down_proj.weight"] for e in range(E)]))
        layer += 1
    return out


def normals(scale: float, E=16, N=384, K=256, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(E, N, K, generator=g) * scale).bfloat16()]


def huffman_bits(counts: list[int]) -> int:
    """Payload bits of a Huffman code for these symbol counts."""
    heap = [(c, i, 0) for i, c in enumerate(counts) if c]
    if len(heap) == 1:
        return heap[0][0]
    depth = {i: 0 for _, i, _ in heap}
    members = {i: [i] for _, i, _ in heap}
    heapq.heapify(heap)
    nxt = len(counts)
    while len(heap) > 1:
        c1, a, _ = heapq.heappop(heap)
        c2, b, _ = heapq.heappop(heap)
        members[nxt] = members.pop(a) + members.pop(b)
        for s in members[nxt]:
            depth[s] += 1
        heapq.heappush(heap, (c1 + c2, nxt, 0))
        nxt += 1
    return sum(counts[s] * d for s, d in depth.items())


def sizes(tensors: list[torch.Tensor]) -> dict[str, float]:
    raw = sum(t.numel() * 2 for t in tensors)
    acc = dict(entropy=0.0, huffman=0.0, **{f"fixed-{b}": 0.0 for b in lossless.WIDTHS}, chosen=0.0)
    widths = set()
    for w in tensors:
        E, N, K = w.shape
        hist = lossless.histograms(w)
        for e in range(E):
            h = hist[e][hist[e] > 0].double()
            p = h / h.sum()
            acc["entropy"] += (8 * N * K + float(-(h * p.log2()).sum())) / 8
            acc["huffman"] += (8 * N * K + huffman_bits(hist[e].tolist())) / 8
        for b in lossless.WIDTHS:
            acc[f"fixed-{b}"] += lossless.encoded_nbytes(hist, N * K, b)
        packed = lossless.encode(w)
        widths.add(packed.bits)
        acc["chosen"] += packed.nbytes
    out = {k: v / raw for k, v in acc.items()}
    out["widths"] = ",".join(map(str, sorted(widths)))
    return out


def encode_speed(tensors: list[torch.Tensor]) -> float:
    """GB/s of bf16 weights encoded (once: the one-time cost per checkpoint)."""
    t0 = time.perf_counter()
    for w in tensors:
        lossless.encode(w)
    return sum(w.numel() * 2 for w in tensors) / (time.perf_counter() - t0) / 1e9


def decode_speed(tensors: list[torch.Tensor], repeat: int) -> tuple[float, float]:
    """(GB/s of bf16 written, GB/s of compressed read): best of `repeat` passes over every expert."""
    packed = [lossless.encode(w) for w in tensors]
    outs = [torch.empty(w.shape[1:], dtype=torch.bfloat16) for w in tensors]
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        for p, o in zip(packed, outs):
            for e in range(p.shape[0]):
                lossless.decode_torch(p, e, o)
        best = min(best, time.perf_counter() - t0)
    for w, p in zip(tensors, packed):
        assert torch.equal(p.decode().view(torch.int16), w.view(torch.int16))
    raw = sum(w.numel() * 2 for w in tensors)
    comp = sum(p.nbytes for p in packed)
    return raw / best / 1e9, comp / best / 1e9


def laid_out(tensors: list[torch.Tensor]) -> tuple[float, int, int]:
    """(arena bytes over coded bytes, layers laid out in records, layers) of [w13, w2, w13, w2, ...]."""
    arena = coded = inline = 0
    for w13, w2 in zip(tensors[0::2], tensors[1::2]):
        a, b = lossless.encode(w13), lossless.encode(w2)
        arena += lossless.layer_major_nbytes(a, b)
        coded += sum(p.shape[0] * lossless.row_layout(p)[1] + p._starts[-1] for p in (a, b))
        inline += lossless._arena(a, b)[0] is not None
    return arena / coded, inline, len(tensors) // 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for the decode (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = {"bundled model experts": bundled_experts()}
    for s in (1e-3, 0.02, 1.0, 100.0):
        cases[f"normal sigma={s:g}"] = normals(s)
    cols = ["entropy", "huffman"] + [f"fixed-{b}" for b in lossless.WIDTHS] + ["chosen"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print("| weights | MiB bf16 | " + " | ".join(cols) + " | width | decode GB/s (bf16 out) | decode GB/s (coded in) | encode GB/s |")
    print("|---" * (len(cols) + 6) + "|")
    for name, tensors in cases.items():
        s = sizes(tensors)
        out_gbs, in_gbs = decode_speed(tensors, args.repeat)
        enc_gbs = encode_speed(tensors)
        mib = sum(t.numel() * 2 for t in tensors) / 2**20
        print(f"| {name} | {mib:.1f} | " + " | ".join(f"{s[c]:.4f}" for c in cols)
              + f" | {s['widths']} | {out_gbs:.2f} | {in_gbs:.2f} | {enc_gbs:.2f} |")
    ratio, inline, layers = laid_out(cases["bundled model experts"])
    print(f"\nCUDA layout of the bundled store: {inline} of {layers} layers in records, arena {ratio:.4f}x its rows "
          f"and escape runs (records padded to the layer's longest)")


if __name__ == "__main__":
    main()
