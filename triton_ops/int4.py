"""INT4 experts: optimum-quanto's qint4 quantizer, repacked into the fused MoE kernel's layout.

Layout of `Int4Experts` (E experts of one layer, each an [N, K] weight; G = K // group_size):

    qweight  int32  [E, N, K // 8]   eight 4-bit codes a word along K: word j of a row holds
                                     code k = 8j + i in bits 4i .. 4i+3
    scale    dtype  [E, G, N]        one per group of `group_size` consecutive k of a row,
                                     group-major: a group's scales for consecutive rows are adjacent
    shift    dtype  [E, G, N]        quanto's float shift, laid out as the scales

    w[e, n, k] = scale[e, k // group_size, n] * q[e, n, k] - shift[e, k // group_size, n]

Made for the GPU kernel (kernels.py): a weight tile of BLOCK_N rows and BLOCK_K columns is
BLOCK_N runs of BLOCK_K / 8 contiguous words (vector loads, each byte read once), and its scales
for one group are BLOCK_N adjacent values (one vector load per tile). Read as bytes (little
endian, `qweight.view(torch.uint8)`), byte b of a row holds code 2b in its low nibble and 2b + 1
in its high one, which is how the CPU dequantizes.

which is quanto's own float-shift dequantization (`scale * q - shift`), evaluated in the scale's
dtype. The three tensors are everything: `Int4Experts(qweight, scale, shift)` rebuilds the
container (from a safetensors file, say) and the group size follows from the shapes. `dtype`
(the scales' dtype) is the compute dtype: quantization itself always runs in fp32, as quanto's
quantizer does for the draft, and only the scales and shifts are rounded to the compute dtype.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from specter.errors import ConfigError


def group_size_for(in_features: int, preferred: int = 128) -> int:
    """`preferred` where it divides the row; else the largest power of two that does (tiny test models)."""
    g = preferred
    while g > 1 and in_features % g:
        g //= 2
    return g


@dataclass
class Int4Experts:
    """One layer's experts in INT4; see the module docstring for the layout."""

    qweight: torch.Tensor  # int32 [E, N, K // 8]
    scale: torch.Tensor    # [E, K // group_size, N]
    shift: torch.Tensor    # [E, K // group_size, N]

    def __post_init__(self):
        q, s, z = self.qweight, self.scale, self.shift
        if q.dtype != torch.int32 or q.dim() != 3:
            raise ConfigError(f"Int4Experts.qweight must be int32 [E, N, K//8]; got {q.dtype} {tuple(q.shape)}")
        if (s.shape != z.shape or s.dtype != z.dtype or s.dim() != 3 or s.shape[0] != q.shape[0]
                or s.shape[2] != q.shape[1]):
            raise ConfigError(f"Int4Experts.scale and .shift must both be [E, groups, N] matching qweight "
                              f"{tuple(q.shape)}; got {tuple(s.shape)} {s.dtype} and {tuple(z.shape)} {z.dtype}")
        if not s.dtype.is_floating_point or (8 * q.shape[2]) % s.shape[1]:
            raise ConfigError(f"Int4Experts: {s.shape[1]} groups do not divide K = {8 * q.shape[2]}")
        if not (q.device == s.device == z.device):
            raise ConfigError("Int4Experts: qweight, scale and shift must be on one device")

    # ---------------------------------------------------------------------------------- shape
    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K] of the dequantized weights."""
        E, N, words = self.qweight.shape
        return E, N, 8 * words

    @property
    def group_size(self) -> int:
        return self.shape[2] // self.scale.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def n_experts(self) -> int:
        return self.qweight.shape[0]

    def expert_nbytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.qweight, self.scale, self.shift))

    # ----------------------------------------------------------------------------- conversions
    def tensors(self) -> dict[str, torch.Tensor]:
        """The plain tensors, e.g. for safetensors; `Int4Experts(**d)` rebuilds the container."""
        return {"qweight": self.qweight, "scale": self.scale, "shift": self.shift}

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Int4Experts":
        """Move the codes to `device`; scales and shifts also to `dtype` (the compute dtype)."""
        return Int4Experts(self.qweight.to(device), self.scale.to(device, dtype), self.shift.to(device, dtype))

    def __getitem__(self, idx) -> "Int4Experts":
        """Experts `idx` (an int keeps the expert axis: [1, N, K//8])."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return Int4Experts(self.qweight[idx], self.scale[idx], self.shift[idx])

    def packed_bytes(self) -> torch.Tensor:
        """uint8 [E, N, K // 2]: the words as bytes, two codes a byte (low nibble first)."""
        return self.qweight.view(torch.uint8)

    def codes(self) -> torch.Tensor:
        """uint8 [E, N, K]: the 4-bit codes, unpacked."""
        q = self.packed_bytes()
        return torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """[E, N, K] in `dtype`: exactly quanto's dequantization (`scale * q - shift`); written into
        `out` (contiguous, that shape and dtype) when given."""
        E, N, K = self.shape
        q = self.packed_bytes()
        w = torch.empty(E, N, K, dtype=self.dtype, device=self.device) if out is None else out
        w = w.view(E, N, K // 2, 2)
        w[..., 0] = q & 0xF  # the codes, converted to the scale dtype as they are written (exact: 0..15)
        w[..., 1] = q >> 4
        w = w.view(E, N, -1, self.group_size)
        scale, shift = self.scale.transpose(1, 2)[..., None], self.shift.transpose(1, 2)[..., None]  # [E, N, G, 1]
        w.mul_(scale).sub_(shift)  # in place: ~3x faster on CPU, same bits
        return w.view(E, N, K)


def quantize_int4(w: torch.Tensor, group_size: int = 128):
    """w [out, in] -> optimum-quanto WeightQBitsTensor (qint4, per-group scale and float shift), the
    quanto object `pack_int4` reproduces; kept as the reference the tests compare against."""
    from optimum.quanto import MaxOptimizer, qint4, quantize_weight

    g = group_size_for(w.shape[1], group_size)
    wf = w.float()
    scale, shift = MaxOptimizer()(wf, qtype=qint4, axis=0, group_size=g)
    return quantize_weight(wf, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=g, optimized=False)


def pack_int4(w: torch.Tensor, group_size: int = 128, dtype: torch.dtype | None = None,
              chunk_bytes: int | None = None) -> Int4Experts:
    """w [E, N, K] (any float dtype, any device) -> Int4Experts on w's device, scales in `dtype`
    (default: w's dtype). Every group is quantized by quanto's own optimizer and affine quantizer
    (in fp32, groups of `group_size` along K, shrunk for rows it does not divide, as the draft
    does), in a few batched ops over `chunk_bytes` of fp32 groups at a time (4 MiB on CPU, where
    cache-sized chunks run ~30x faster than huge temporaries; 256 MiB on GPUs)."""
    from optimum.quanto import MaxOptimizer, qint4

    if w.dim() != 3 or not w.dtype.is_floating_point:
        raise ConfigError(f"pack_int4 expects float weights [E, N, K]; got {w.dtype} {tuple(w.shape)}")
    E, N, K = w.shape
    g = group_size_for(K, group_size)
    if K % 8:
        raise ConfigError(f"pack_int4 needs K divisible by 8 (eight codes a word); got K = {K}")
    dtype = dtype or w.dtype
    chunk_bytes = chunk_bytes or (1 << 22 if w.device.type == "cpu" else 1 << 28)
    assert sys.byteorder == "little"  # the words are written as bytes, low byte first
    groups = w.reshape(-1, g)                                   # [E*N*K/g, g]: quanto's grouping
    qweight = torch.empty(groups.shape[0], g // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(groups.shape[0], dtype=dtype, device=w.device)
    shift = torch.empty_like(scale)
    rows = max(1, chunk_bytes // (4 * g))
    for r in range(0, groups.shape[0], rows):
        part = groups[r:r + rows].float()
        s, z = MaxOptimizer().optimize(part, qint4, axis=0)  # [rows, 1] each (per group)
        q = torch.ops.quanto.quantize_affine(part, bits=4, axis=0, group_size=g, scale=s, shift=z)
        torch.bitwise_or(q[:, 0::2], q[:, 1::2] << 4, out=qweight[r:r + rows])
        scale[r:r + rows] = s[:, 0]
        shift[r:r + rows] = z[:, 0]
    group_major = lambda t: t.view(E, N, K // g).transpose(1, 2).contiguous()  # noqa: E731  [E, G, N]
    return Int4Experts(qweight.view(E, N, K // 2).view(torch.int32), group_major(scale), group_major(shift))
