"""The torch backend of fused_moe (the CPU default, and the reference the kernels are tested
against) under its own name: it lives in fused_moe.py, beside the dispatch that calls it (the
combine's is `combine_rows(rows, backend="torch")`, that function's own body)."""
from .fused_moe import _dense, grouped_linear, moe_rows_torch, silu_mul

__all__ = ["_dense", "grouped_linear", "moe_rows_torch", "silu_mul"]
