"""specter.triton_ops: INT4 packing against quanto, the grouped MoE against the per-expert loop."""
from __future__ import annotations

import pytest
import torch

from specter.errors import ConfigError
from specter.triton_ops import Int4Experts, pack_int4, quantize_int4


def _weights(E=3, N=48, K=256, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * 0.05
    w[0, 0, :64] = 0.0       # a constant group (scale 0)
    w[1, 2, 128:] = 0.25     # another, not at zero
    return w.to(dtype)


# ------------------------------------------------------------------------------------ INT4 packing
@pytest.mark.parametrize("K,group_size", [(256, 128), (96, 128), (64, 32)])
def test_int4_dequantize_equals_quanto_bit_for_bit(K, group_size):
    w = _weights(K=K)
    packed = pack_int4(w, group_size)
    ref = torch.stack([quantize_int4(w[e], group_size).dequantize() for e in range(w.shape[0])])
    assert packed.dtype == torch.float32 and packed.shape == tuple(w.shape)
    assert torch.equal(packed.dequantize(), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_scales_follow_the_compute_dtype(dtype):
    """Quantized in fp32 either way; scales in the compute dtype, dequantized as quanto does it."""
    from optimum.quanto import qint4
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor

    w = _weights(dtype=dtype)
    packed = pack_int4(w)
    assert packed.scale.dtype == packed.shift.dtype == dtype and packed.dequantize().dtype == dtype
    for e in range(w.shape[0]):
        q = quantize_int4(w[e])
        ref = WeightQBitsTensor(qint4, 0, q._group_size, q.size(), q.stride(), q._data.unpack(),
                                q._scale.to(dtype), q._shift.to(dtype)).dequantize()
        assert torch.equal(packed.dequantize()[e], ref)


def test_int4_layout_is_plain_tensors_and_round_trips():
    w = _weights()
    packed = pack_int4(w, 64)
    assert packed.qweight.shape == (3, 48, 128) and packed.qweight.dtype == torch.uint8
    assert packed.scale.shape == packed.shift.shape == (3, 48, 4) and packed.group_size == 64
    # the documented nibble order: code k = 2j low, k = 2j + 1 high
    codes = packed.codes()
    assert torch.equal(packed.qweight, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert codes.max() <= 15
    again = Int4Experts(**packed.tensors())
    assert torch.equal(again.dequantize(), packed.dequantize())
    assert torch.equal(packed[1].dequantize(), packed.dequantize()[1:2])
    assert packed.to(dtype=torch.float16).dequantize().dtype == torch.float16
    assert packed.expert_nbytes() == 48 * 128 + 2 * 48 * 4 * 4


def test_int4_chunking_does_not_change_the_result():
    w = _weights(E=5)
    assert torch.equal(pack_int4(w, chunk_bytes=1).qweight, pack_int4(w).qweight)


def test_int4_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"\[E, N, K\]"):
        pack_int4(torch.randn(4, 8))
    with pytest.raises(ConfigError, match="even K"):
        pack_int4(torch.randn(2, 4, 7))
    packed = pack_int4(_weights())
    with pytest.raises(ConfigError, match="uint8"):
        Int4Experts(packed.qweight.float(), packed.scale, packed.shift)
    with pytest.raises(ConfigError, match="scale and .shift"):
        Int4Experts(packed.qweight, packed.scale, packed.shift[:, :, :1])


# --------------------------------------------------------------------------------- the packed draft
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_draft_runs_in_the_compute_dtype(dtype):
    """The packed draft (CUDA's) at bf16/fp16: scales follow the compute dtype, and it computes
    what the unpacked draft computes (both hold the same INT4 codes)."""
    from specter.moe import ExpertWeights
    from specter.speculative.draft import DraftExperts
    from specter.speculative.lookahead import Lookahead

    E, H, I, T, k = 4, 64, 32, 5, 2
    g = torch.Generator().manual_seed(1)
    experts = [ExpertWeights(torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1)]
    look = Lookahead(4, 1, k, "cpu")
    packed = DraftExperts(experts, look, "cpu", dtype, packed=True)
    plain = DraftExperts(experts, look, "cpu", dtype, packed=False)
    assert packed.q13[0].dtype == dtype
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 1], [0, 3]])
    w = torch.rand(T, k, generator=g).to(dtype)
    y = packed(0, x, ids, w)
    assert y.dtype == dtype and y.shape == (T, H)
    torch.testing.assert_close(y, plain(0, x, ids, w), rtol=0.05, atol=0.02)
