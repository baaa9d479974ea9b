"""A model's own sampling settings (its `generation_config.json`) and when they apply.

Read with transformers' `GenerationConfig` and mapped the way `model.generate()` reads them:
`do_sample` false (or absent) is greedy (with the file's repetition_penalty, which transformers
applies to greedy search too); `do_sample` true samples with the file's temperature,
top_k, top_p, min_p and repetition_penalty, each at transformers' own default where the file is
silent (top_k 50: what `model.generate()` would use). A setting that changes tokens but that
Specter does not implement (typical_p, beams, n-gram bans, ...) is named in one warning, never
dropped silently. Lengths and token ids are not sampling settings and are not applied here.

When they apply (engine.choose): a caller who passes no sampling keyword (a seed alone is not a choice of
settings) gets the model's defaults; a caller who passes any gets exactly their own, the rest at
SamplingParams' neutral values (temperature 0 = greedy, filters and penalties off).
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from .errors import CheckpointError, ConfigError, warn
from .sampling import SamplingParams

FILE = "generation_config.json"

# generation_config field -> SamplingParams field; every one of these changes sampled tokens only
SAMPLED = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
# transformers' values for fields a file leaves unset (GenerationConfig._get_default_generation_params;
# a test checks they still agree)
HF_UNSET = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0}
# fields that do not choose tokens (lengths are the caller's max_new_tokens; EOS ids are read with config.json)
NOT_SAMPLING = {"do_sample", "max_length", "max_new_tokens", "bos_token_id", "eos_token_id", "pad_token_id",
                "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config", "transformers_version",
                "_from_model_config", "output_attentions", "output_hidden_states", "output_scores", "output_logits",
                "return_dict_in_generate", "compile_config", "disable_compile", "max_time", "low_memory",
                "prefill_chunk_size", "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
                "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
                "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "continuous_batching_config"}


def read_generation_defaults(path: str | os.PathLike) -> dict:
    """generate()'s sampling keywords from `path`/generation_config.json: {} (greedy) when the file is
    missing; a CheckpointError naming the file when it cannot be read or holds invalid values."""
    from .loader import transformers_attr

    GenerationConfig = transformers_attr("GenerationConfig")

    file = Path(path) / FILE
    if not file.is_file():
        return {}
    try:
        with quiet_transformers():  # (its "generation flags are not valid" line: do_sample false and a
            g = GenerationConfig.from_pretrained(str(path), local_files_only=True)  # temperature is greedy here)
    except Exception as e:
        raise CheckpointError(f"{file} could not be read ({e}); fix or delete it") from None
    unset = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    unapplied = [f"{k}={v!r}" for k, v in g.to_diff_dict().items()
                 if k not in NOT_SAMPLING and k not in SAMPLED and v != unset.get(k)]
    if unapplied:
        warn(f"{file} sets {', '.join(unapplied)}, which Specter does not apply; it samples with "
             f"do_sample, temperature, top_k, top_p, min_p and repetition_penalty only")
    if g.do_sample not in (None, True, False):
        raise CheckpointError(f"{file}: do_sample must be true or false, got {g.do_sample!r}")
    values = {ours: HF_UNSET[hf] if getattr(g, hf, None) is None else getattr(g, hf) for hf, ours in SAMPLED.items()}
    if g.do_sample and values["temperature"] != 0:
        out = {k: v for k, v in values.items() if v is not None}
    else:  # greedy (transformers refuses to sample at temperature 0); its repetition penalty still applies
        out = {} if values["repetition_penalty"] == 1 else {"repetition_penalty": values["repetition_penalty"]}
    try:
        SamplingParams(**out)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return out


_QUIET = threading.Lock()  # (transformers' verbosity is process-wide: loads on two threads, one at a time here)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own log lines (a "[transformers] ..." warning outside Specter's one-line format)
    held back to errors while it reads a file whose meaning Specter states itself."""
    from transformers.utils import logging as hf_logging

    with _QUIET:
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            hf_logging.set_verbosity(level)
