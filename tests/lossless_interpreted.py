"""The lossless decode kernel under TRITON_INTERPRET=1, against the torch decode. Run through
test_lossless.py::test_decode_kernel_under_the_triton_interpreter, which starts a process with the
variable set before triton is imported; collected on its own it skips without it.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

from specter.triton_ops import lossless  # noqa: E402
from test_lossless import _bits, special_weights  # noqa: E402


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kernel_decodes_every_case_bit_exact(bits):
    """Every special case (escapes everywhere, odd numel, a partial last block, no escapes at all),
    one launch per expert into a slot filled with garbage first."""
    for name, w in special_weights().items():
        packed = lossless.encode(w, bits)
        for e in range(w.shape[0]):
            slot = torch.full(w.shape[1:], float("nan"), dtype=torch.bfloat16)
            lossless.decode_triton(packed, e, slot)
            ref = lossless.decode_torch(packed, e, torch.empty_like(slot))
            assert _bits(slot).equal(_bits(ref)) and _bits(slot).equal(_bits(w[e])), (name, e, bits)


def test_kernel_decodes_across_blocks_with_escapes_in_several():
    """Several BLOCKs of one expert, escapes in the first, a middle and the last block (the per-block
    escape offsets), through decode_into (the kernel under the interpreter), of the whole tensor and of
    one expert taken out of it."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(2, 40, 96, generator=g) * 0.02).bfloat16()           # 3840 elements: 4 blocks
    flat = w.view(2, -1)
    flat[:, [3, 1500, 2049, 3839]] = torch.tensor([1e30, -1e-30, 3e20, float("inf")]).bfloat16()
    packed = lossless.encode(w, 2)
    assert (packed.esc_off[:, 1:] > packed.esc_off[:, :-1]).all()
    out = torch.empty(40, 96, dtype=torch.bfloat16)
    for e in range(2):
        assert _bits(packed.decode_into(out, e)).equal(_bits(w[e]))
        out.fill_(float("nan"))
        assert _bits(packed.expert(e).decode_into(out, 0)).equal(_bits(w[e]))  # one expert, as a copy moves it
