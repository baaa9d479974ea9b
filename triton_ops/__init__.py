"""Triton kernels with their plain-torch references (the `specter.triton_ops` package).

    pack_int4(w, group_size) -> Int4Experts    optimum-quanto's qint4, in the kernels' layout (int4.py)
"""
from .int4 import Int4Experts, group_size_for, pack_int4, quantize_int4

__all__ = ["Int4Experts", "group_size_for", "pack_int4", "quantize_int4"]
