"""Built-in workloads: `specter bench --workload NAME` picks a prompt set; bad names fail clearly."""
from __future__ import annotations

import pytest

from specter.bench import read_prompts
from specter.errors import ConfigError
from specter.workloads import DEFAULT, DIVERSE


def test_workloads_resolve():
    assert read_prompts(None) == list(DEFAULT) == read_prompts(None, "default")
    diverse = read_prompts(None, "diverse")
    assert diverse == list(DIVERSE) and len(diverse) >= 10 and len(set(diverse)) == len(diverse)


def test_diverse_prompts_tokenize_with_the_bundled_model():
    from specter import default_model_path
    from specter.loader import load_tokenizer

    tok = load_tokenizer(default_model_path())
    assert all(8 <= len(tok.encode(p)) <= 200 for p in DIVERSE)


def test_bad_workload_arguments():
    with pytest.raises(ConfigError, match="unknown workload 'nope'"):
        read_prompts(None, "nope")
    with pytest.raises(ConfigError, match="either --prompts"):
        read_prompts("prompts.txt", "diverse")
