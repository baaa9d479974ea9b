"""Subcommands beyond `generate`: plan, bench, profile (added by the offload and speculative work)."""
from __future__ import annotations


def add_subcommands(sub, model_args, sampling_args) -> None:
    pass
