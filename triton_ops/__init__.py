"""Triton kernels with their plain-torch references (the `specter.triton_ops` package).

    pack_int4(w, group_size) -> Int4Experts     optimum-quanto's qint4 in the kernels' layout (int4.py)
    pack_experts(w, bits) -> QuantExperts        the same at 4, 3 or 2 bits (Int4Experts is QuantExperts)
    fused_moe(x, ids, weights, w13, w2, remap)  a layer's routed experts, grouped (fused_moe.py)
    expert_rows / combine_rows / merge_rows     its two halves, for callers that split the experts
    lossless.encode(w) -> LosslessExperts       bf16 experts coded losslessly, decoded into slots (lossless.py)
    graphed.GraphedRows()                       expert_rows / fused_moe replayed from CUDA graphs (graphed.py)
    launch.launch(kernel, grid, *args, **kw)    kernel[grid](...) without the JIT's binding each launch (launch.py)
"""
from .fused_moe import BACKENDS, combine_rows, default_backend, expert_rows, fused_moe, merge_rows
from .int4 import Int4Experts, QuantExperts, group_size_for, pack_experts, pack_int4, packed_nbytes, quantize_int4

__all__ = ["BACKENDS", "Int4Experts", "QuantExperts", "combine_rows", "default_backend", "expert_rows", "fused_moe",
           "group_size_for", "merge_rows", "pack_experts", "pack_int4", "packed_nbytes", "quantize_int4"]
