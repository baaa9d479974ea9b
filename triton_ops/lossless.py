"""Lossless bf16 experts: sign and mantissa kept raw, exponents in a fixed-width code with exact escapes.

A bf16 weight is sign (1 bit), exponent (8) and mantissa (7). In trained weights the exponent
carries little information (a few bits of entropy: most weights sit within a few octaves of the
tensor's scale), so it is coded and the other eight bits are stored as they are. Layout of
`LosslessExperts` (E experts of one tensor [E, N, K]; each expert's numel = N * K elements, padded
to P = a multiple of 32; BITS the code width, one for the whole tensor; ESC = 2**BITS - 1):

    signman   uint8  [E, P]                 byte i = sign << 7 | mantissa of element i
    planes    int32  [E, BITS, P // 32]     bit planes of the codes: bit i of word j of plane p is
                                            bit p of element 32j + i's code (plane-major)
    table     int32  [E, 2**BITS]           exponent of each code (entry ESC unused: 0)
    esc_off   int32  [E, cdiv(P, BLOCK)]    escapes of the expert before block b (BLOCK elements)
    escapes   uint8  [total]                the raw exponents of escaped elements, in element order,
                                            each expert's run padded to a multiple of 4 bytes
    esc_start int64  [E + 1]                where each expert's run starts in `escapes`
    by_expert uint8  [E, R] or None         layer_major(): the four tensors above are views of
                                            it, expert e's rows one after another in by_expert[e]
                                            (row_layout), itself a view of CodedPair.rows [E, Ra +
                                            Rb] (a layer's w13 and w2 rows side by side)
    run_at    tuple of E ints or None       layer_major(): `escapes` is then the layer's whole
                                            arena and expert e's run starts at byte run_at[e] of
                                            it (in its record, right after its rows: CodedPair)

    exponent(i) = table[code(i)]  unless code(i) == ESC: escapes[esc_start[e] (laid out: run_at[e])
                                  + rank of i among the expert's escapes]
    bf16 bits   = (signman & 0x80) << 8 | exponent << 7 | (signman & 0x7F)

Every bit pattern round-trips (±0, subnormals, inf, NaN payloads: the exponent field is coded as
the eight bits it is), and an expert decodes on its own (its rows of the tensors and its escape run), a block
of BLOCK elements at a time with no dependence on any other block: the GPU kernel gives each
program one block, every load contiguous and wide (the sign/mantissa bytes and the planes read as
int32 words; a block's escapes are found by a prefix sum of its escape flags, read as words too).

Why this code and not Huffman (DFloat11) or ANS: an exponent coder can at best reach 8 raw bits
plus the exponents' entropy a weight, and a Huffman code comes within a fraction of a bit of that;
the fixed code with the best width (chosen per tensor from 2, 3 and 4 bits by the encoded size)
lands a few percent of the bf16 bytes above it. But a Huffman stream must be parsed sequentially
(DFloat11 needs per-thread bit offsets, hierarchical lookup tables in shared memory and a second
pass for output positions), where a fixed width is random access per element: the decoder is a
handful of shifts and masks over wide loads, at memory speed, so decoding never shows next to
the PCIe copy it follows. A fixed 4-bit code over the 15 most frequent exponents almost never
escapes, but at 12 bits a weight it can never go below 0.75x of bf16; 3 bits over the 7 most
frequent escape a few percent of weights (8 bits each, plus a word of offsets per block) and come
out smaller on trained and on normal weights alike. The measured sizes of all of them, with the
entropy bound and Huffman beside, are in docs/RESULTS.md (`python bench/lossless_ratio.py`).
fp16 (5-bit exponent, 10-bit mantissa) and fp32 are refused: their split differs and is not done.

`decode()` (torch, any device) and `decode_into(out, e)` (one expert into a slot: the Triton
kernel on CUDA or under TRITON_INTERPRET=1, torch elsewhere) return the identical bf16 bits.
`layer_major(w13, w2)` (a CUDA host store: offload/coded.py) lays a layer's two tensors out for
copies, together, an expert's record its rows of both then its escape runs, so that `stage_pair`
copies an expert in one copy and `decode_staged_pair` decodes both tensors in one launch (the
issuing host's cost a copy is mostly its CUDA calls: docs/RESULTS.md); `decode_pair_in_place` is
that launch reading the page-locked arena itself, no staging copy (an experiment until a GPU times
it: offload/coded.py's decode_in_place). One tensor's expert alone (a slot of another dtype) is
`stage` (its row and escape run) and `decode_staged`.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from specter.errors import ConfigError

from .launch import launch

BLOCK = 1024            # elements a decode program handles; esc_off counts escapes per BLOCK
NUM_WARPS = 2           # 64 threads: 16 bytes of sign/mantissa a thread (one vector load), no spills
WIDTHS = (2, 3, 4)      # code widths encode chooses from (the smallest encoding wins)
LAUNCHES_ON_CPU = False  # aot.py's recorder sets it: launch code runs on CPU stand-ins


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class LosslessExperts:
    """One tensor's experts, losslessly coded; see the module docstring for the layout."""

    shape: tuple            # (E, N, K) of the bf16 weights
    signman: torch.Tensor   # uint8 [E, P]
    planes: torch.Tensor    # int32 [E, BITS, P // 32]
    table: torch.Tensor     # int32 [E, 2**BITS]
    esc_off: torch.Tensor   # int32 [E, cdiv(P, BLOCK)]
    escapes: torch.Tensor   # uint8 [total], expert runs padded to 4 bytes (laid out: the arena, runs at run_at)
    esc_start: torch.Tensor  # int64 [E + 1] (host): expert e's run is esc_start[e + 1] - esc_start[e] bytes
    by_expert: torch.Tensor | None = None  # uint8 [E, R]: the four tensors above are views of it (layer_major)
    run_at: tuple | None = None  # layer_major: where each expert's run starts in `escapes` (else esc_start)

    def __post_init__(self):
        E, N, K = self.shape
        P = self.padded
        if (self.signman.shape != (E, P) or self.planes.dim() != 3 or self.planes.shape[0] != E
                or self.planes.shape[2] != P // 32 or self.table.shape != (E, 1 << self.bits)
                or self.esc_off.shape != (E, _cdiv(P, BLOCK)) or self.esc_start.shape != (E + 1,)
                or (self.by_expert is not None and self.by_expert.shape != (E, row_layout(self)[1]))
                or (self.run_at is not None and len(self.run_at) != E)):
            raise ConfigError(f"LosslessExperts: tensors do not match shape {self.shape}")

    @property
    def bits(self) -> int:
        return self.planes.shape[1]

    @property
    def padded(self) -> int:
        """P: an expert's element count rounded up to whole 32-element plane words."""
        return _cdiv(self.shape[1] * self.shape[2], 32) * 32

    @property
    def device(self) -> torch.device:
        return self.signman.device

    def to(self, device) -> "LosslessExperts":
        """The coded tensors on `device`, as encode lays them out (esc_start, an index the launch code
        reads, stays on the host)."""
        *moved, _ = (t.to(device) for t in self.compact().tensors())
        return LosslessExperts(self.shape, *moved, self.esc_start)

    def compact(self) -> "LosslessExperts":
        """Itself as encode lays it out (each tensor its own, the runs back to back in `escapes`): a copy
        where laid out (layer_major), else itself. What the disk cache writes."""
        if self.run_at is None:  # as encode laid it out (layer_major sets run_at)
            return self
        runs = [self.expert_escapes(e) for e in range(self.shape[0])]
        fixed = (t.contiguous() for t in (self.signman, self.planes, self.table, self.esc_off))
        return LosslessExperts(self.shape, *fixed, torch.cat(runs) if runs else self.escapes[:0], self.esc_start)

    def tensors(self) -> list[torch.Tensor]:
        return [self.signman, self.planes, self.table, self.esc_off, self.escapes, self.esc_start]

    @property
    def nbytes(self) -> int:
        """Bytes of the format (tables and offsets included; the escape runs, not a laid-out one's arena)."""
        fixed = (self.signman, self.planes, self.table, self.esc_off, self.esc_start)
        return sum(t.numel() * t.element_size() for t in fixed) + self._starts[-1]

    def expert(self, e: int) -> int:
        """Expert index e in [0, E) (negative from the end, as a tensor's); else IndexError."""
        E = self.shape[0]
        if not -E <= e < E:
            raise IndexError(f"expert {e} of {E}")
        return e % E

    def expert_nbytes(self, e: int) -> int:
        """Bytes an expert's copy moves: its rows of the fixed tensors and its escape run."""
        e = self.expert(e)
        fixed = sum(t[e].numel() * t.element_size() for t in (self.signman, self.planes, self.table, self.esc_off))
        return fixed + self._starts[e + 1] - self._starts[e]

    @property
    def raw_nbytes(self) -> int:
        E, N, K = self.shape
        return E * N * K * 2

    def expert_escapes(self, e: int) -> torch.Tensor:
        """uint8: expert e's escape run (a multiple of 4 bytes)."""
        e = self.expert(e)
        start, end = self._starts[e], self._starts[e + 1]
        at = start if self.run_at is None else self.run_at[e]
        return self.escapes[at:at + end - start]

    @functools.cached_property
    def _starts(self) -> list[int]:
        """esc_start as Python ints (read per copy: a tensor element costs microseconds to read)."""
        return self.esc_start.tolist()

    # ------------------------------------------------------------------------------- decoding
    def decode(self) -> torch.Tensor:
        """bf16 [E, N, K], bit for bit the weights `encode` was given."""
        E, N, K = self.shape
        out = torch.empty(E, N, K, dtype=torch.bfloat16, device=self.device)
        for e in range(E):
            decode_torch(self, e, out[e])
        return out

    def decode_into(self, out: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e into `out` (bf16 [N, K], contiguous, e.g. a slot): the Triton kernel on CUDA (and
        under TRITON_INTERPRET=1), torch on other devices."""
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or tuple(out.shape) != tuple(self.shape[1:]):
            raise ConfigError(f"decode_into needs a contiguous bf16 {tuple(self.shape[1:])} output; got "
                              f"{out.dtype} {tuple(out.shape)}")
        if out.device != self.device:
            raise ConfigError(f"decode_into: the coded experts are on {self.device}, the output on {out.device}")
        e = self.expert(e)
        if out.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return decode_triton(self, e, out)
        return decode_torch(self, e, out)


# ----------------------------------------------------------------------------------- encoding
CHUNK = 1 << 20  # elements encoded at a time (a multiple of BLOCK): temporaries stay a few MiB


def _fields(flat: torch.Tensor, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements c0 .. c1 of one expert's bf16 [numel] (zeros past its end) -> (exponent fields,
    sign/mantissa bytes), uint8 [c1 - c0] each. Read as int16 (bit 15 sign, 14 .. 7 exponent, 6 .. 0
    mantissa), contiguous: the uint8 casts keep the low byte (an arithmetic shift's sign bits drop)."""
    x = flat[c0:c1].view(torch.int16)
    if x.numel() < c1 - c0:
        x = torch.nn.functional.pad(x, (0, c1 - c0 - x.numel()))
    return _exponents(x), ((x >> 8) & 0x80 | x & 0x7F).to(torch.uint8)


def _exponents(x: torch.Tensor) -> torch.Tensor:
    """bf16 weights read as int16 -> their exponent fields, uint8."""
    return (x >> 7).to(torch.uint8)


def histograms(w: torch.Tensor) -> torch.Tensor:
    """int64 [E, 256]: each expert's exponent counts, of bf16 w [E, N, K]."""
    E, flat = w.shape[0], w.reshape(w.shape[0], -1).view(torch.int16)
    hist = torch.zeros(E, 256, dtype=torch.int64, device=w.device)
    for e in range(E):
        for c0 in range(0, flat.shape[1], CHUNK):
            hist[e] += torch.bincount(_exponents(flat[e, c0:c0 + CHUNK]), minlength=256)
    return hist


def _tables(hist: torch.Tensor, bits: int) -> torch.Tensor:
    """[E, 2**bits - 1] the most frequent exponents of each expert, most frequent first (ties: the
    smaller exponent), as codes 0 .. ESC - 1."""
    order = torch.argsort(-hist * 256 + torch.arange(256, device=hist.device), dim=1)  # stable by design
    return order[:, :(1 << bits) - 1]


def encoded_nbytes(hist: torch.Tensor, numel: int, bits: int) -> int:
    """Bytes `encode` spends at this width, from [E, 256] exponent histograms (escapes rounded up per
    expert as stored; the per-block offsets and tables counted)."""
    E, P = hist.shape[0], _cdiv(numel, 32) * 32
    covered = torch.sort(hist, dim=1, descending=True).values[:, :(1 << bits) - 1].sum(1)
    escapes = sum(_cdiv(int(n), 4) * 4 for n in (numel - covered))
    return E * (P + P // 32 * bits * 4 + (1 << bits) * 4 + _cdiv(P, BLOCK) * 4) + escapes + (E + 1) * 8


def best_width(hist: torch.Tensor, numel: int) -> int:
    return min(WIDTHS, key=lambda b: (encoded_nbytes(hist, numel, b), b))


def encode(w: torch.Tensor, bits: int | None = None) -> LosslessExperts:
    """bf16 [E, N, K] -> LosslessExperts on w's device (code width: the smallest of WIDTHS for this
    tensor unless given), an expert and CHUNK elements at a time (two passes: histograms, codes)."""
    if w.dtype != torch.bfloat16:
        raise ConfigError(f"lossless expert compression codes bf16 weights; got {w.dtype} (fp16 and fp32 "
                          f"checkpoints are not supported: load them without compress_experts)")
    if w.dim() != 3 or not w.numel():
        raise ConfigError(f"encode expects expert weights [E, N, K], none of them 0; got {tuple(w.shape)}")
    E, N, K = w.shape
    w = w.contiguous()
    hist = histograms(w)
    bits = best_width(hist, N * K) if bits is None else bits
    if bits not in WIDTHS:
        raise ConfigError(f"code width must be one of {WIDTHS}; got {bits}")
    top = _tables(hist, bits)                                 # [E, ESC]
    table = torch.zeros(E, 1 << bits, dtype=torch.int32, device=w.device)
    table[:, :(1 << bits) - 1] = top.to(torch.int32)
    P = _cdiv(N * K, 32) * 32
    signman = torch.empty(E, P, dtype=torch.uint8, device=w.device)
    planes = torch.empty(E, bits, P // 8, dtype=torch.uint8, device=w.device)
    esc_off = torch.empty(E, _cdiv(P, BLOCK), dtype=torch.int32, device=w.device)
    runs = [_encode_expert(w[e].view(-1), top[e], bits, signman[e], planes[e], esc_off[e]) for e in range(E)]
    start = torch.tensor([0] + [r.numel() for r in runs], dtype=torch.int64).cumsum(0)
    escapes = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.uint8, device=w.device)
    return LosslessExperts((E, N, K), signman, planes.view(torch.int32), table, esc_off, escapes, start)


def _encode_expert(flat: torch.Tensor, top: torch.Tensor, bits: int, signman: torch.Tensor,
                   planes: torch.Tensor, esc_off: torch.Tensor) -> torch.Tensor:
    """One expert's bf16 [numel] into its rows signman [P], planes uint8 [bits, P // 8] and esc_off
    [blocks]; returns its escape run (uint8, padded to 4 bytes)."""
    esc = (1 << bits) - 1
    lut = torch.full((256,), esc, dtype=torch.uint8, device=flat.device)
    lut[top] = torch.arange(esc, dtype=torch.uint8, device=flat.device)
    run, seen = [], 0
    for c0 in range(0, signman.numel(), CHUNK):
        c1 = min(c0 + CHUNK, signman.numel())
        exp, signman[c0:c1] = _fields(flat, c0, c1)
        codes = lut.index_select(0, exp.int())                # [c1 - c0] uint8
        codes[max(0, flat.numel() - c0):] = 0                 # padding: code 0, never an escape
        planes[:, c0 // 8:c1 // 8] = _planes(codes, bits)
        flags = codes == esc
        per_block = torch.count_nonzero(torch.nn.functional.pad(flags, (0, -flags.numel() % BLOCK)).view(-1, BLOCK), 1)
        esc_off[c0 // BLOCK:c0 // BLOCK + per_block.numel()] = seen + torch.cumsum(per_block, 0) - per_block
        seen += int(per_block.sum())
        run.append(exp[flags].to(torch.uint8))
    run = torch.cat(run) if run else torch.zeros(0, dtype=torch.uint8, device=flat.device)
    return torch.nn.functional.pad(run, (0, -run.numel() % 4))


_GATHER = sum(1 << (56 - 7 * i) for i in range(8))  # x * _GATHER >> 56: bit 8i of x into bit i


def _planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [C] (C a multiple of 8) -> uint8 [bits, C // 8]: byte j of plane p holds bit p of
    codes 8j .. 8j + 7, element 8j + t in bit t (read as little-endian int32 words: the layout).
    Eight codes are one int64; their bit p's, at bits 8t, are gathered by one multiplication (every
    partial product lands on its own bit, so nothing carries into the top byte)."""
    eights = codes.view(torch.int64)
    return torch.stack([((((eights >> p) & 0x0101010101010101) * _GATHER) >> 56 & 0xFF).to(torch.uint8)
                        for p in range(bits)])


# --------------------------------------------------------------------- expert-major layout (copies)
ALIGN = 16  # bytes: each field of a row starts on a 16-byte boundary (the kernel's wide loads)


def row_layout(p: LosslessExperts) -> tuple[tuple[int, int, int, int], int]:
    """Byte offsets of signman, planes, table and esc_off in an expert-major row of p, and the row's
    length R (a multiple of 64)."""
    return _row_layout(p.padded, p.bits)


@functools.lru_cache(maxsize=None)
def _row_layout(P: int, bits: int) -> tuple[tuple[int, int, int, int], int]:
    offsets, at = [], 0
    for nbytes in (P, bits * P // 8, 4 << bits, 4 * _cdiv(P, BLOCK)):
        offsets.append(at)
        at += _cdiv(nbytes, ALIGN) * ALIGN
    return tuple(offsets), _cdiv(at, 64) * 64


def _laid_out(p: LosslessExperts, by_expert: torch.Tensor, arena: torch.Tensor, run_at: list[int]) -> LosslessExperts:
    """p's bits copied into `by_expert` (uint8 [E, R], each row one expert's: row_layout) and its escape
    runs into `arena` (uint8, the layer's) at run_at."""
    fields = [by_expert[:, at:at + t[0].nbytes].view(t.dtype).view(t.shape).copy_(t)
              for t, at in zip((p.signman, p.planes, p.table, p.esc_off), row_layout(p)[0])]
    for e, at in enumerate(run_at):
        run = p.expert_escapes(e)
        arena[at:at + run.numel()].copy_(run)
    return LosslessExperts(p.shape, *fields, arena, p.esc_start, by_expert, tuple(run_at))


@dataclass
class CodedPair:
    """A layer's two coded tensors laid out together for copies (layer_major) in one arena: expert e's
    record is its rows of both, a's then b's (rows[e]), then its escape run of a, then of b, so a copy
    of the expert is one copy of its record's head (stage_pair) and one launch decodes both
    (decode_staged_pair). Records are padded to the layer's longest; where that padding would cost
    more than INLINE_SLACK of the arena, the runs follow all rows instead (a's, then b's) and a copy
    is one copy of the rows and one of each run."""
    a: LosslessExperts       # w13: by_expert = rows[:, :Ra]
    b: LosslessExperts       # w2:  by_expert = rows[:, Ra:]
    rows: torch.Tensor       # uint8 [E, Ra + Rb], row e at byte e * rows.stride(0) of the arena
    words: torch.Tensor | None = None   # int32: the whole arena, for decode_pair_in_place
    tables: torch.Tensor | None = None  # int32 [E, 2**a.bits + 2**b.bits] on the device (with_tables)
    in_place: bool = False   # copies decode in place (decode_pair_in_place), not from a staging copy
    _segments: dict = field(default_factory=dict, repr=False, compare=False)  # expert -> its views (segments)

    def decode_into(self, e: int, out_a: torch.Tensor, out_b: torch.Tensor) -> torch.Tensor | None:
        """Expert e into bf16 slots on the device, as a copy does: in place where set (-> None), else
        staged (-> the staged bytes on the device, stage_pair's: the compressed tier keeps them)."""
        if self.in_place:
            decode_pair_in_place(self, e, out_a, out_b)
            return None
        staged = stage_pair(self, e, out_a.device)
        decode_staged_pair(self, e, staged, out_a, out_b)
        return staged

    def staged_nbytes(self, e: int) -> int:
        """The bytes stage_pair puts on the device for expert e: both rows and both escape runs."""
        a, b = self.a._starts, self.b._starts
        return self.rows.shape[1] + a[e + 1] - a[e] + b[e + 1] - b[e]

    def segments(self, e: int) -> tuple[torch.Tensor, ...]:
        """The host views stage_pair copies for expert e, whose bytes back to back are its staged bytes
        [rows | a's run | b's run]: one (its record's head) when the layer is laid out inline, else its
        rows and each run it has. Made once an expert (a view costs the issuing thread about a microsecond)."""
        views = self._segments.get(e)
        if views is None:
            spans: list[list[int]] = []  # [byte in the arena, length], adjacent ones merged
            for at, n in ((e * self.rows.stride(0), self.rows.shape[1]),
                          *((p.run_at[e], p._starts[e + 1] - p._starts[e]) for p in (self.a, self.b))):
                if spans and spans[-1][0] + spans[-1][1] == at:
                    spans[-1][1] += n
                elif n:
                    spans.append([at, n])
            arena = self.a.escapes
            views = self._segments[e] = tuple(arena[at:at + n] for at, n in spans)
        return views

    def with_tables(self, device) -> "CodedPair":
        """Itself, with each expert's two code tables copied to `device` (decode_pair_in_place reads them there)."""
        self.tables = torch.cat([self.a.table, self.b.table], 1).to(device)
        return self


INLINE_SLACK = 1 / 64  # the padding inline records may add to a layer's arena (measured: docs/RESULTS.md)


def _arena(a: LosslessExperts, b: LosslessExperts) -> tuple[int | None, int]:
    """(stride, nbytes) of a layer's arena: the stride of its inline records (an expert's rows of a and b,
    then its two runs, padded to the longest record and to 64 bytes), or None where that padding would
    exceed INLINE_SLACK of the compact bytes (every row, then every run), which the arena then holds."""
    E, R = a.shape[0], row_layout(a)[1] + row_layout(b)[1]
    runs = [a._starts[e + 1] - a._starts[e] + b._starts[e + 1] - b._starts[e] for e in range(E)]
    stride, compact = _cdiv(R + max(runs, default=0), 64) * 64, E * R + sum(runs)
    return (stride, E * stride) if E * stride <= compact * (1 + INLINE_SLACK) else (None, compact)


def layer_major_nbytes(a: LosslessExperts, b: LosslessExperts) -> int:
    return _arena(a, b)[1]


def layer_major(a: LosslessExperts, b: LosslessExperts, buffer: torch.Tensor | None = None) -> CodedPair:
    """a's and b's bits (one layer's w13 and w2, the same experts) in one uint8 arena of layer_major_nbytes
    (`buffer`; else allocated): CodedPair's records, expert e's [a's row | b's row | a's run | b's run]
    (row_layout each), or where records would pad too much, rows [E, Ra + Rb] then a's runs then b's."""
    E, Ra, Rb = a.shape[0], row_layout(a)[1], row_layout(b)[1]
    if b.shape[0] != E:
        raise ConfigError(f"layer_major: {E} experts in one tensor, {b.shape[0]} in the other")
    stride, nbytes = _arena(a, b)
    arena = (torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer)[:nbytes]
    if stride:   # inline: each expert's runs right after its rows
        rows = arena.view(E, stride)[:, :Ra + Rb]
        at_a = [e * stride + Ra + Rb for e in range(E)]
        at_b = [at + a._starts[e + 1] - a._starts[e] for e, at in enumerate(at_a)]
    else:        # after all rows
        rows = arena[:E * (Ra + Rb)].view(E, Ra + Rb)
        at_a = [E * (Ra + Rb) + s for s in a._starts[:-1]]
        at_b = [E * (Ra + Rb) + a._starts[-1] + s for s in b._starts[:-1]]
    a, b = _laid_out(a, rows[:, :Ra], arena, at_a), _laid_out(b, rows[:, Ra:], arena, at_b)
    return CodedPair(a, b, rows, arena.view(torch.int32))


def stage(p: LosslessExperts, e: int, device) -> torch.Tensor:
    """Expert e of a laid-out p (host, layer_major) into one new uint8 [R + run] buffer on `device`, on the
    current stream: one non-blocking copy of its row, and one of its escape run when it has one
    (decode_staged's input)."""
    row, run = p.by_expert[e], p.expert_escapes(e)
    staged = torch.empty(row.numel() + run.numel(), dtype=torch.uint8, device=device)
    staged[:row.numel()].copy_(row, non_blocking=True)
    if run.numel():
        staged[row.numel():].copy_(run, non_blocking=True)
    return staged


def stage_pair(pair: CodedPair, e: int, device) -> torch.Tensor:
    """Expert e of both of a pair's tensors into one new uint8 [Ra + Rb + run_a + run_b] buffer on `device`,
    on the current stream: non-blocking copies of its segments, one when laid out inline
    (decode_staged_pair's input)."""
    parts = pair.segments(e)
    staged = torch.empty(pair.staged_nbytes(e), dtype=torch.uint8, device=device)
    if len(parts) == 1:
        return staged.copy_(parts[0], non_blocking=True)
    at = 0
    for part in parts:
        staged[at:at + part.numel()].copy_(part, non_blocking=True)
        at += part.numel()
    return staged


def decode_staged_pair(pair: CodedPair, e: int, staged: torch.Tensor, out_a: torch.Tensor,
                       out_b: torch.Tensor) -> None:
    """stage_pair()'s bytes of expert e decoded into out_a and out_b (contiguous bf16 slots of the pair's
    tensors, on their device): one launch."""
    for p, out in ((pair.a, out_a), (pair.b, out_b)):
        _check_out(p, out, "decode_staged_pair")
    _require_launch(out_a)
    a, b = pair.a, pair.b
    grid, (rows, tab_a, tab_b, n_a, n_b), kw = _pair_launch(a.padded, a.bits, b.padded, b.bits)
    run_a = a._starts[e + 1] - a._starts[e]                   # b's escape run follows a's (stage_pair)
    words = staged.view(torch.int32)
    launch(_decode_pair_kernel, grid, words, words, out_a.view(torch.int16), out_b.view(torch.int16), 0, tab_a, tab_b,
           rows, rows + run_a // 4, a.shape[1] * a.shape[2], n_a, b.shape[1] * b.shape[2], n_b, **kw)


def decode_staged_pairs(pair: CodedPair, jobs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Several experts of one pair, each (e, staged, out_a, out_b) as decode_staged_pair's arguments, in one
    launch (a layer's hits in the compressed tier: offload/coded_tier.py). The kernel reads each expert's
    addresses from a job table, int64 [n, 4] on the device (one small copy from pinned memory, which the
    caching host allocator keeps until the copy is done): its staged bytes, its two slots, its w13 escape
    run's length in words. A buffer off the allocator's 64-byte alignment or a slot off 16 bytes (the
    kernel's wide loads and stores assume them) falls back to a launch an expert: the same bits."""
    if len(jobs) == 1:
        return decode_staged_pair(pair, *jobs[0])
    for _, _, out_a, out_b in jobs:
        for p, out in ((pair.a, out_a), (pair.b, out_b)):
            _check_out(p, out, "decode_staged_pairs")
    _require_launch(jobs[0][2])
    table, ok = [], True
    for e, staged, out_a, out_b in jobs:
        ok &= staged.data_ptr() % 64 == 0 and out_a.data_ptr() % 16 == 0 and out_b.data_ptr() % 16 == 0
        run_a = pair.a._starts[e + 1] - pair.a._starts[e]
        table += (staged.data_ptr(), out_a.data_ptr(), out_b.data_ptr(), run_a // 4)
    if not ok:
        for job in jobs:
            decode_staged_pair(pair, *job)
        return
    a, b = pair.a, pair.b
    (blocks,), (rows, tab_a, tab_b, n_a, n_b), kw = _pair_launch(a.padded, a.bits, b.padded, b.bits)
    device = jobs[0][2].device  # pinned (the caching host allocator's), so the copy never waits on the stream
    table = torch.tensor(table, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    launch(_decode_pairs_kernel, (blocks, len(jobs)), table, A_NUMEL=a.shape[1] * a.shape[2],
           B_NUMEL=b.shape[1] * b.shape[2], A_WORDS=n_a, B_WORDS=n_b, A_TAB=tab_a, B_TAB=tab_b, ROWS=rows, **kw)


def decode_pair_in_place(pair: CodedPair, e: int, out_a: torch.Tensor, out_b: torch.Tensor) -> None:
    """Expert e of both of a pair's tensors decoded into out_a and out_b (contiguous bf16 slots, on the
    device) straight from the layer's arena on the host (`pair.words`: page-locked, so mapped into the
    device's address space), no staging copy: one launch reading the coded bytes over the bus, the code
    tables from `pair.tables` on the device (the kernel looks a table up once an element)."""
    for p, out in ((pair.a, out_a), (pair.b, out_b)):
        _check_out(p, out, "decode_pair_in_place")
    _require_launch(out_a)
    a, b = pair.a, pair.b
    grid, (_, tab_a, _, n_a, n_b), kw = _pair_launch(a.padded, a.bits, b.padded, b.bits)
    tables = pair.tables.shape[1]
    launch(_decode_pair_kernel, grid, pair.words, pair.tables, out_a.view(torch.int16), out_b.view(torch.int16),
           e * pair.rows.stride(0) // 4, e * tables, e * tables + (1 << a.bits), a.run_at[e] // 4, b.run_at[e] // 4,
           a.shape[1] * a.shape[2], n_a, b.shape[1] * b.shape[2], n_b, **kw)


@functools.lru_cache(maxsize=None)
def _pair_launch(Pa: int, bits_a: int, Pb: int, bits_b: int) -> tuple[tuple[int], tuple[int, ...], dict]:
    """(grid, (words of the two rows, a's and b's table in them, a's and b's plane words), constexprs) of
    _decode_pair_kernel for a pair of layouts, in int32 words: an expert's rows [a's row | b's row]
    (then, staged, its escape runs)."""
    (off_a, Ra), (off_b, Rb) = _row_layout(Pa, bits_a), _row_layout(Pb, bits_b)
    blocks_a = _cdiv(Pa, BLOCK)
    kw = dict(A_PLANES=off_a[1] // 4, A_ESC_OFF=off_a[3] // 4, B_SIGNMAN=Ra // 4, B_PLANES=(Ra + off_b[1]) // 4,
              B_ESC_OFF=(Ra + off_b[3]) // 4, A_BLOCKS=blocks_a, A_BITS=bits_a, B_BITS=bits_b, BLOCK=BLOCK,
              num_warps=NUM_WARPS)
    return (blocks_a + _cdiv(Pb, BLOCK),), ((Ra + Rb) // 4, off_a[2] // 4, (Ra + off_b[2]) // 4, Pa // 32, Pb // 32), kw


def _check_out(p: LosslessExperts, out: torch.Tensor, who: str) -> None:
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() != p.shape[1] * p.shape[2]:
        raise ConfigError(f"{who} needs a contiguous bf16 {tuple(p.shape[1:])} output; got {out.dtype} "
                          f"{tuple(out.shape)}")


def decode_staged(p: LosslessExperts, staged: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """stage()'s bytes of one expert of p decoded into out (contiguous bf16 [N, K], on their device):
    one launch of the kernel on views of them."""
    _check_out(p, out, "decode_staged")
    offsets, R = row_layout(p)
    words = staged.view(torch.int32)                          # R and every run a multiple of 4 bytes
    fields = [words[at // 4:] for at in offsets]
    escapes = words[R // 4:] if staged.numel() > R else fields[2]  # none: never read
    return _launch(p, *fields, escapes, out)


# ---------------------------------------------------------------------------------- torch decode
_SPREAD: dict = {}


def _spread(device) -> torch.Tensor:
    """int64 [256]: byte value -> eight bytes, byte t holding the value's bit t."""
    device = torch.device(device)
    if device not in _SPREAD:
        v = torch.arange(256, device=device)
        _SPREAD[device] = ((v[:, None] >> torch.arange(8, device=device)) & 1).to(torch.uint8).view(torch.int64)[:, 0]
    return _SPREAD[device]


def codes_of(packed: LosslessExperts, e: int) -> torch.Tensor:
    """uint8 [P]: expert e's codes, from its bit planes (eight codes at a time, one int64 a plane byte)."""
    planes = packed.planes[e].contiguous().view(torch.uint8).long()  # [BITS, P // 8]
    spread = _spread(planes.device)
    codes = spread[planes[0]]                                 # [P // 8] int64: eight codes
    for p in range(1, packed.bits):
        codes |= spread[planes[p]] << p
    return codes.view(torch.uint8)


def decode_torch(packed: LosslessExperts, e: int, out: torch.Tensor) -> torch.Tensor:
    """Expert e into out (bf16 [N, K]) with torch ops (the emulated device's path)."""
    numel = out.numel()
    codes = codes_of(packed, e)[:numel]
    exp = torch.take(packed.table[e].to(torch.int16) << 7, codes.long())  # [numel] exponent fields
    run = packed.expert_escapes(e)                            # its escapes in order, padded to 4 bytes
    if run.numel():  # masked_scatter_ takes one a flag, in order: the padding is never read
        exp.masked_scatter_(codes == (1 << packed.bits) - 1, run.to(torch.int16) << 7)
    bits = out.view(-1).view(torch.int16)
    sm = packed.signman[e, :numel].view(torch.int8).to(torch.int16)  # sign-extended: bit 7 into 7 .. 15
    torch.bitwise_and(sm, -0x8000 | 0x7F, out=bits)           # sign in bit 15, mantissa in 0 .. 6
    bits |= exp
    return out


# --------------------------------------------------------------------------------- Triton decode
@triton.jit
def _decode_kernel(signman_ptr, planes_ptr, table_ptr, esc_off_ptr, esc_ptr, out_ptr, numel, n_words,
                   BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program b decodes elements b * BLOCK .. + BLOCK of one expert. signman_ptr and esc_ptr are
    the bytes read as int32 words; out_ptr the slot as int16."""
    _decode_block(tl.program_id(0), signman_ptr, planes_ptr, table_ptr, esc_off_ptr, esc_ptr, out_ptr, numel,
                  n_words, BITS, BLOCK)


@triton.jit(do_not_specialize=["a_tab", "b_tab", "a_esc", "b_esc"])  # gathers: one compile for every expert
def _decode_pair_kernel(base_ptr, table_ptr, a_out, b_out, row, a_tab, b_tab, a_esc, b_esc, a_numel, a_words,
                        b_numel, b_words, A_PLANES: tl.constexpr, A_ESC_OFF: tl.constexpr, B_SIGNMAN: tl.constexpr,
                        B_PLANES: tl.constexpr, B_ESC_OFF: tl.constexpr, A_BLOCKS: tl.constexpr,
                        A_BITS: tl.constexpr, B_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One expert's two tensors (w13 and w2) in one launch: programs 0 .. A_BLOCKS - 1 decode tensor a
    into a_out, the rest tensor b into b_out, each as _decode_kernel's program of that number would.
    Everything is read as int32 words at word offsets: the expert's rows of both tensors at base_ptr +
    row (the fields at the layout's offsets in them: constexpr, one set a pair of shapes and widths),
    its code tables at table_ptr + a_tab and + b_tab, its escape runs at base_ptr + a_esc and + b_esc
    (offsets that vary by expert and are read by gathers: not specialized, so one compile, the one
    warm_decode makes at load, serves every expert; `row` is always a multiple of 16 words, and its
    specialization keeps the sign/mantissa loads 16 bytes wide).
    From stage_pair's bytes (base and table the staged buffer, row 0); or in place from a layer's
    page-locked arena on the host (the tables from a copy on the device: decode_pair_in_place)."""
    pid = tl.program_id(0)
    if pid < A_BLOCKS:
        _decode_block(pid, base_ptr + row, base_ptr + (row + A_PLANES), table_ptr + a_tab,
                      base_ptr + (row + A_ESC_OFF), base_ptr + a_esc, a_out, a_numel, a_words, A_BITS, BLOCK)
    else:
        _decode_block(pid - A_BLOCKS, base_ptr + (row + B_SIGNMAN), base_ptr + (row + B_PLANES), table_ptr + b_tab,
                      base_ptr + (row + B_ESC_OFF), base_ptr + b_esc, b_out, b_numel, b_words, B_BITS, BLOCK)


@triton.jit
def _decode_pairs_kernel(jobs_ptr, A_NUMEL: tl.constexpr, B_NUMEL: tl.constexpr, A_WORDS: tl.constexpr,
                         B_WORDS: tl.constexpr, A_TAB: tl.constexpr, B_TAB: tl.constexpr,
                         ROWS: tl.constexpr, A_PLANES: tl.constexpr, A_ESC_OFF: tl.constexpr, B_SIGNMAN: tl.constexpr,
                         B_PLANES: tl.constexpr, B_ESC_OFF: tl.constexpr, A_BLOCKS: tl.constexpr,
                         A_BITS: tl.constexpr, B_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """_decode_pair_kernel's program pid (from staged bytes) for expert program_id(1) of a batch, whose
    addresses are a row of jobs_ptr, int64 [n, 4] (decode_staged_pairs): its staged bytes (64-byte
    aligned), its w13 and w2 slots (16-byte aligned: the loads and stores stay 16 bytes wide), and its
    w13 escape run's words (its w2 run follows it, after the rows' ROWS words). Loaded addresses take
    registers that parameters would not, so everything that is one layer's layout (offsets, words,
    numels) is a constexpr: one compile a kind of layer (warm_decode), at most one spilled word
    (test_lossless.BATCH_SPILL)."""
    pid, at = tl.program_id(0), jobs_ptr + 4 * tl.program_id(1)
    src = tl.multiple_of(tl.load(at).to(tl.pointer_type(tl.int32)), 64)
    if pid < A_BLOCKS:
        bits = _block_bits(pid, src, src + A_PLANES, src + A_TAB, src + A_ESC_OFF, src, ROWS, A_WORDS, A_BITS, BLOCK)
        _store_block(pid, bits, at + 1, A_NUMEL, BLOCK)
    else:
        bits = _block_bits(pid - A_BLOCKS, src + B_SIGNMAN, src + B_PLANES, src + B_TAB, src + B_ESC_OFF, src,
                           ROWS + tl.load(at + 3).to(tl.int32), B_WORDS, B_BITS, BLOCK)
        _store_block(pid - A_BLOCKS, bits, at + 2, B_NUMEL, BLOCK)


@triton.jit
def _store_block(b, bits, out_at, numel, BLOCK: tl.constexpr):
    """The batch kernel's block b of bits into the slot whose address is at out_at (loaded only now: a
    64-bit value held through the decode would take two registers more)."""
    out = tl.multiple_of(tl.load(out_at).to(tl.pointer_type(tl.int16)), 16)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, bits, mask=offs < numel)


@triton.jit
def _decode_block(b, signman_ptr, planes_ptr, table_ptr, esc_off_ptr, esc_ptr, out_ptr, numel, n_words,
                  BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Elements b * BLOCK .. + BLOCK of one expert (the decode kernels' program b) into out_ptr."""
    bits = _block_bits(b, signman_ptr, planes_ptr, table_ptr, esc_off_ptr, esc_ptr, 0, n_words, BITS, BLOCK)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, bits, mask=offs < numel)


@triton.jit
def _block_bits(b, signman_ptr, planes_ptr, table_ptr, esc_off_ptr, esc_ptr, esc_at, n_words, BITS: tl.constexpr,
                BLOCK: tl.constexpr):
    """int16 [BLOCK]: the bf16 bits of elements b * BLOCK .. + BLOCK of one expert; its escape run at
    esc_ptr + esc_at words (the batch kernel's: an offset from the expert's bytes, no pointer of its own)."""
    # sign/mantissa bytes: BLOCK / 4 words, byte j of a word is element 4w + j
    offs_w = b * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    smw = tl.load(signman_ptr + offs_w, mask=offs_w < n_words * 8, other=0)
    sm = tl.reshape((smw[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF, (BLOCK,))
    # codes: BLOCK / 32 words of each plane, bit i of a word is element 32g + i
    offs_g = b * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    code = tl.zeros((BLOCK // 32, 32), dtype=tl.int32)
    for p in tl.static_range(BITS):
        plane = tl.load(planes_ptr + p * n_words + offs_g, mask=offs_g < n_words, other=0)
        code |= ((plane[:, None] >> tl.arange(0, 32)[None, :]) & 1) << p
    code = tl.reshape(code, (BLOCK,))
    exp = tl.load(table_ptr + code)                          # 2**BITS int32 entries: cached
    # escapes: the k-th escape of the block is the raw exponent at esc_off[b] + k, read from its word
    flags = code == (1 << BITS) - 1
    at = tl.load(esc_off_ptr + b) + tl.cumsum(flags.to(tl.int32), 0) - 1
    word = tl.load(esc_ptr + (esc_at + at // 4), mask=flags, other=0)
    exp = tl.where(flags, (word >> ((at % 4) * 8)) & 0xFF, exp)
    return (((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)).to(tl.int16)


def decode_triton(packed: LosslessExperts, e: int, out: torch.Tensor) -> torch.Tensor:
    """Expert e into out (bf16 [N, K], contiguous, on the packed tensors' device): one launch."""
    escapes = packed.expert_escapes(e)
    if escapes.numel() == 0:
        escapes = packed.table[e]                             # never read (no flags), any int32 address
    else:
        escapes = escapes.view(torch.int32)
    return _launch(packed, packed.signman[e].view(torch.int32), packed.planes[e], packed.table[e],
                   packed.esc_off[e], escapes, out)


def _require_launch(out: torch.Tensor) -> None:
    if out.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and not LAUNCHES_ON_CPU:
        raise ConfigError("the lossless decode kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1 "
                          "(set before triton is imported)")


def _launch(p: LosslessExperts, signman, planes, table, esc_off, escapes, out: torch.Tensor) -> torch.Tensor:
    """One expert's fields (int32 views of its rows) decoded into out: one launch, BLOCK elements a program."""
    _require_launch(out)
    P = p.padded
    launch(_decode_kernel, (_cdiv(P, BLOCK),), signman, planes, table, esc_off, escapes, out.view(torch.int16),
           out.numel(), P // 32, BITS=p.bits, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
