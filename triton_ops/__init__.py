"""Triton kernels with their plain-torch references."""
