"""Quantized experts at 4, 3 or 2 bits: a group-wise affine quantizer (optimum-quanto's for 4 and 2
bits, the same scheme in torch for 3), packed into the fused MoE kernel's layout.

Layout of `QuantExperts` (E experts of one layer, each an [N, K] weight; G = K // group_size; `bits`
is 4, 3 or 2; `Int4Experts` is the same class, its default width 4):

    qweight  int32  [E, N, K * bits / 32]   the codes of a row as int32 words along K (below)
    scale    dtype  [E, G, N]        one per group of `group_size` consecutive k of a row,
                                     group-major: a group's scales for consecutive rows are adjacent
    shift    dtype  [E, G, N]        quanto's float shift, laid out as the scales

    w[e, n, k] = scale[e, k // group_size, n] * q[e, n, k] - shift[e, k // group_size, n]

A row's words, by width (every code a whole field of one word: no code straddles two words):

    4 bits   K / 8 words:  code k = 8j + i in bits 4i .. 4i+3 of word j
    2 bits   K / 16 words: code k = 16j + i in bits 2i .. 2i+1 of word j
    3 bits   K / 16 words of the codes' low two bits (the 2-bit layout), then K / 32 words of their
             high bit: code k = 32j + i's bit 2 is bit i of word K / 16 + j

Why 3 bits is "two planes" and not 10 codes a word or 32 codes in 3 interleaved words: each plane
of a [BLOCK_N, BLOCK_K] tile is a contiguous run of whole words a row (two vector loads a row, no
word shared between tiles), unpacked by the very shift-and-mask of the 2-bit and a 1-bit layout;
every count is a power of two, as Triton's blocks must be. Ten codes a word wastes 2 bits in 32
and cuts 128-column tiles mid-word; 32 codes in 3 words puts codes 10 and 21 across two words
(two loads and a funnel shift each) and makes a tile 3 * BLOCK_K / 32 words, not a power of two.
It costs exactly 3 bits a weight and needs K divisible by 32 (2 bits: by 16; 4 bits: by 8).

Made for the GPU kernel (kernels.py): a weight tile of BLOCK_N rows and BLOCK_K columns is
BLOCK_N runs of BLOCK_K * bits / 32 contiguous words (vector loads, each byte read once), and its
scales for one group are BLOCK_N adjacent values (one vector load per tile). Read as bytes (little
endian, `qweight.view(torch.uint8)`), byte b of a 4-bit row holds code 2b in its low nibble and
2b + 1 in its high one, which is how the CPU dequantizes.

Quantizer: per group, scale = (max - min) / (2^bits - 1), shift = -min (a float),
q = clamp(round((w + shift) / scale), 0, 2^bits - 1): optimum-quanto's MaxOptimizer and affine
quantizer, as quanto's qint4 and qint2 compute them (used as they are for 4 and 2 bits). quanto has
no 3-bit type, so `affine_quantize` writes the same scheme in torch, op for op (tested equal to
quanto's at 2 and 4 bits, bit for bit); the draft at 4 bits is exactly what it was before 2 and 3.

The dequantization is quanto's own float-shift one (`scale * q - shift`), evaluated in the
scale's dtype. The three tensors and the width are everything: `QuantExperts(qweight, scale,
shift, bits)` rebuilds the container (from a safetensors file, say) and the group size follows
from the shapes. `dtype` (the scales' dtype) is the compute dtype: quantization itself always runs
in fp32, as quanto's quantizer does for the draft, and only the scales and shifts are rounded to
the compute dtype.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from einops import rearrange

from specter.errors import ConfigError

WIDTHS = (4, 3, 2)                        # the code widths the kernels unpack
PLANES = {4: (4,), 3: (2, 1), 2: (2,)}    # a row's planes, in order: the bits of a code each holds
K_MULTIPLE = {4: 8, 3: 32, 2: 16}         # K must divide into whole words of every plane


def group_size_for(in_features: int, preferred: int = 128) -> int:
    """`preferred` where it divides the row; else the largest power of two that does (tiny test models)."""
    g = preferred
    while g > 1 and in_features % g:
        g //= 2
    return g


def packable_widths(*ks: int) -> tuple[int, ...]:
    """The widths of WIDTHS whose codes pack rows of every length in `ks` into whole words."""
    return tuple(b for b in WIDTHS if all(k % K_MULTIPLE[b] == 0 for k in ks))


def check_bits(bits: int) -> int:
    if bits not in WIDTHS:
        raise ConfigError(f"draft bits must be one of {', '.join(map(str, WIDTHS))}; got {bits!r}")
    return bits


def packed_nbytes(N: int, K: int, bits: int = 4, group_size: int = 128, scale_bytes: int = 2) -> int:
    """Bytes of one [N, K] weight packed at `bits` (codes, plus a scale and a shift of `scale_bytes`
    each per group; groups as pack_experts makes them, shrunk where `group_size` does not divide K)."""
    check_bits(bits)
    g = group_size_for(K, group_size)
    return N * K * bits // 8 + 2 * scale_bytes * N * (K // g)


@dataclass
class QuantExperts:
    """One layer's experts at `bits` bits; see the module docstring for the layout."""

    qweight: torch.Tensor  # int32 [E, N, K * bits / 32]
    scale: torch.Tensor    # [E, K // group_size, N]
    shift: torch.Tensor    # [E, K // group_size, N]
    bits: int = 4

    def __post_init__(self):
        q, s, z = self.qweight, self.scale, self.shift
        check_bits(self.bits)
        if q.dtype != torch.int32 or q.dim() != 3:
            raise ConfigError(f"Int4Experts.qweight must be int32 [E, N, K*bits/32]; got {q.dtype} {tuple(q.shape)}")
        if (s.shape != z.shape or s.dtype != z.dtype or s.dim() != 3 or s.shape[0] != q.shape[0]
                or s.shape[2] != q.shape[1]):
            raise ConfigError(f"Int4Experts.scale and .shift must both be [E, groups, N] matching qweight "
                              f"{tuple(q.shape)}; got {tuple(s.shape)} {s.dtype} and {tuple(z.shape)} {z.dtype}")
        if (32 * q.shape[2]) % self.bits or self.shape[2] % K_MULTIPLE[self.bits]:
            raise ConfigError(f"Int4Experts: {q.shape[2]} words a row are no whole row of {self.bits}-bit codes")
        if not s.dtype.is_floating_point or self.shape[2] % s.shape[1]:
            raise ConfigError(f"Int4Experts: {s.shape[1]} groups do not divide K = {self.shape[2]}")
        if not (q.device == s.device == z.device):
            raise ConfigError("Int4Experts: qweight, scale and shift must be on one device")

    @classmethod
    def for_k(cls, qweight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, K: int) -> "QuantExperts":
        """The container of codes whose rows are K long (the width follows: 32 * words / K)."""
        return cls(qweight, scale, shift, bits=32 * qweight.shape[2] // K)

    # ---------------------------------------------------------------------------------- shape
    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K] of the dequantized weights."""
        E, N, words = self.qweight.shape
        return E, N, 32 * words // self.bits

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
        """The plain tensors, e.g. for safetensors; `QuantExperts(**d, bits=bits)` rebuilds the container."""
        return {"qweight": self.qweight, "scale": self.scale, "shift": self.shift}

    def to(self, device=None, dtype: torch.dtype | None = None) -> "QuantExperts":
        """Move the codes to `device`; scales and shifts also to `dtype` (the compute dtype)."""
        return QuantExperts(self.qweight.to(device), self.scale.to(device, dtype), self.shift.to(device, dtype),
                            self.bits)

    def __getitem__(self, idx) -> "QuantExperts":
        """Experts `idx` (an int keeps the expert axis: [1, N, K*bits/32])."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return QuantExperts(self.qweight[idx], self.scale[idx], self.shift[idx], self.bits)

    def packed_bytes(self) -> torch.Tensor:
        """uint8 [E, N, K * bits / 8]: the words as bytes (4 bits: two codes a byte, low nibble first)."""
        return self.qweight.view(torch.uint8)

    def codes(self) -> torch.Tensor:
        """uint8 [E, N, K]: the codes, unpacked."""
        q = self.packed_bytes()
        if self.bits == 4:
            return torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
        K = self.shape[2]
        low = _unpack_bytes(q[..., :K // 4], 2)
        return low if self.bits == 2 else low | (_unpack_bytes(q[..., K // 4:], 1) << 2)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """[E, N, K] in `dtype`: exactly quanto's dequantization (`scale * q - shift`); written into
        `out` (contiguous, that shape and dtype) when given."""
        E, N, K = self.shape
        w = torch.empty(E, N, K, dtype=self.dtype, device=self.device) if out is None else out
        q = self.packed_bytes()
        if self.bits == 4:
            w = w.view(E, N, K // 2, 2)
            w[..., 0] = q & 0xF  # the codes, converted to the scale dtype as they are written (exact: 0..15)
            w[..., 1] = q >> 4
        elif self.bits == 2:
            w = w.view(E, N, K // 4, 4)
            for i in range(4):
                w[..., i] = (q >> (2 * i)) & 3
        else:  # byte b of the high plane holds bit 2 of codes 8b .. 8b+7; bytes 2b, 2b+1 of the low plane the rest
            low, high = q[..., :K // 4].view(E, N, K // 8, 2), q[..., K // 4:]
            w = w.view(E, N, K // 8, 8)
            for i in range(8):
                w[..., i] = ((low[..., i // 4] >> (2 * (i % 4))) & 3) | (((high >> i) & 1) << 2)
        w = w.view(E, N, -1, self.group_size)
        scale, shift = self.scale.transpose(1, 2)[..., None], self.shift.transpose(1, 2)[..., None]  # [E, N, G, 1]
        w.mul_(scale).sub_(shift)  # in place: ~3x faster on CPU, same bits
        return w.view(E, N, K)


Int4Experts = QuantExperts  # the name the draft and the kernels grew up with; 4 bits unless told


def _unpack_bytes(b: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., n] of `width`-bit fields, lowest first -> uint8 [..., n * 8 / width]."""
    mask = (1 << width) - 1
    return torch.stack([(b >> (width * i)) & mask for i in range(8 // width)], dim=-1).flatten(-2)


def _pack_bytes(q: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., n] codes of `width` bits -> uint8 [..., n * width / 8], lowest field first."""
    per = 8 // width
    out = q[..., 0::per].clone()
    for i in range(1, per):
        out |= q[..., i::per] << (width * i)
    return out


def affine_params(groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) [rows, 1] of fp32 groups [rows, g]: quanto's MaxOptimizer for any width
    (qmax - qmin = 2^bits - 1, shift = -min), the same bits on every device. The divisor is a tensor
    on the groups' device: quanto divides by a Python int, which CUDA computes as a multiplication by
    its reciprocal (not correctly rounded: 1/15 and 1/3 are inexact), so a draft packed on a GPU
    differed from one packed on the CPU in a few scales and codes (the first GPU run to test it)."""
    rmin = torch.amin(groups, dim=1, keepdim=True)
    rmax = torch.amax(groups, dim=1, keepdim=True)
    levels = torch.full((), 2 ** bits - 1, dtype=groups.dtype, device=groups.device)
    return (rmax - rmin) / levels, -rmin


def affine_quantize(groups: torch.Tensor, bits: int, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, g]: quanto's quantize_affine with a float shift, for any width."""
    return torch.clamp(torch.round((groups + shift) / scale), min=0, max=2 ** bits - 1).to(torch.uint8)


def _quantize_groups(part: torch.Tensor, bits: int, g: int):
    """(codes uint8 [rows, g], scale [rows, 1], shift [rows, 1]) of fp32 groups: quanto's MaxOptimizer's
    parameters (affine_params: its bits, on every device) and quanto's own quantizer where quanto has
    the type (4 and 2 bits), the same scheme in torch else."""
    s, z = affine_params(part, bits)  # [rows, 1] each (per group)
    if bits == 3:
        return affine_quantize(part, bits, s, z), s, z
    import optimum.quanto  # noqa: F401  (registers torch.ops.quanto)

    return torch.ops.quanto.quantize_affine(part, bits=bits, axis=0, group_size=g, scale=s, shift=z), s, z


def quantize_int4(w: torch.Tensor, group_size: int = 128, bits: int = 4):
    """w [out, in] -> optimum-quanto WeightQBitsTensor (qint4 or qint2, per-group scale and float
    shift), the quanto object `pack_experts` reproduces; kept as the reference the tests compare against."""
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = {4: qint4, 2: qint2}[bits]
    g = group_size_for(w.shape[1], group_size)
    wf = w.float()
    scale, shift = MaxOptimizer()(wf, qtype=qtype, axis=0, group_size=g)
    return quantize_weight(wf, qtype=qtype, axis=0, scale=scale, shift=shift, group_size=g, optimized=False)


def pack_experts(w: torch.Tensor, bits: int = 4, group_size: int = 128, dtype: torch.dtype | None = None,
                 chunk_bytes: int | None = None) -> QuantExperts:
    """w [E, N, K] (any float dtype, any device) -> QuantExperts at `bits` on w's device, scales in
    `dtype` (default: w's dtype). Every group is quantized by the affine group-wise quantizer (the
    module docstring; in fp32, groups of `group_size` along K, shrunk for rows it does not divide,
    as the draft does), in a few batched ops over `chunk_bytes` of fp32 groups at a time (4 MiB on
    CPU, where cache-sized chunks run ~30x faster than huge temporaries; 256 MiB on GPUs)."""
    check_bits(bits)
    if w.dim() != 3 or not w.dtype.is_floating_point:
        raise ConfigError(f"pack_int4 expects float weights [E, N, K]; got {w.dtype} {tuple(w.shape)}")
    E, N, K = w.shape
    g = group_size_for(K, group_size)
    if K % K_MULTIPLE[bits]:
        raise ConfigError(f"{bits}-bit experts need K divisible by {K_MULTIPLE[bits]} (whole int32 words of "
                          f"codes); got K = {K}")
    if g % (8 // min(PLANES[bits])):
        raise ConfigError(f"{bits}-bit experts need groups of whole bytes of codes; K = {K} gives groups of {g}")
    dtype = dtype or w.dtype
    chunk_bytes = chunk_bytes or (1 << 22 if w.device.type == "cpu" else 1 << 28)
    assert sys.byteorder == "little"  # the words are written as bytes, low byte first
    groups = rearrange(w, "e n (G g) -> (e n G) g", g=g)         # quanto's grouping
    planes = [torch.empty(groups.shape[0], g * p // 8, dtype=torch.uint8, device=w.device) for p in PLANES[bits]]
    scale = torch.empty(groups.shape[0], dtype=dtype, device=w.device)
    shift = torch.empty_like(scale)
    rows = max(1, chunk_bytes // (4 * g))
    for r in range(0, groups.shape[0], rows):
        q, s, z = _quantize_groups(groups[r:r + rows].float(), bits, g)
        if bits == 4:
            torch.bitwise_or(q[:, 0::2], q[:, 1::2] << 4, out=planes[0][r:r + rows])
        else:
            low = 0
            for plane, p in zip(planes, PLANES[bits]):  # each plane: the next p bits of every code
                plane[r:r + rows] = _pack_bytes((q >> low) & ((1 << p) - 1), p)
                low += p
        scale[r:r + rows] = s[:, 0]
        shift[r:r + rows] = z[:, 0]
    row = torch.cat([p.view(E, N, -1) for p in planes], dim=2) if len(planes) > 1 else planes[0].view(E, N, -1)
    scale, shift = (rearrange(t, "(e n G) -> e G n", e=E, n=N).contiguous() for t in (scale, shift))
    return QuantExperts(row.view(torch.int32), scale, shift, bits)


def pack_int4(w: torch.Tensor, group_size: int = 128, dtype: torch.dtype | None = None,
              chunk_bytes: int | None = None) -> QuantExperts:
    """pack_experts at 4 bits: optimum-quanto's qint4, as the draft has always been."""
    return pack_experts(w, 4, group_size, dtype, chunk_bytes)
