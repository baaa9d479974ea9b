"""A model's generation_config.json: read as transformers reads it, applied when the caller chooses no
sampling settings (API, CLI), never when they choose any; a missing file is greedy, a broken one a
clear error."""
import json
import shutil

import pytest

import specter
from specter.cli import main
from specter.sampling import SamplingParams, choose
from specter.generation_defaults import HF_UNSET, read_generation_defaults

SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.9, repetition_penalty=1.2)  # top_k unset: 50


def with_generation_config(src, dst, content) -> str:
    """A copy of checkpoint `src` whose generation_config.json is `content` (a dict, a string, or None: none)."""
    shutil.copytree(src, dst)
    file = dst / "generation_config.json"
    file.unlink(missing_ok=True)
    if content is not None:
        file.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(dst)


@pytest.fixture(scope="module")
def sampled(tiny, tmp_path_factory):
    """A tiny checkpoint whose generation_config.json says to sample, and one with no such file."""
    path, _ = tiny("qwen3_moe")
    root = tmp_path_factory.mktemp("gen")
    return (with_generation_config(path, root / "sampled", dict(SAMPLED, eos_token_id=127)),
            with_generation_config(path, root / "bare", None))


def test_fields_map_as_transformers_reads_them(tmp_path):
    from transformers import GenerationConfig

    assert {k: GenerationConfig._get_default_generation_params().get(k, None) for k in HF_UNSET} == HF_UNSET

    def read(content):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps(content))
        return read_generation_defaults(d)

    assert read(SAMPLED) == dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2)
    assert read(dict(do_sample=True, top_k=0, min_p=0.05)) == dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05,
                                                                     repetition_penalty=1.0)
    assert read(dict(do_sample=False, temperature=0.7, top_p=0.5)) == {}       # greedy: the filters do nothing
    assert read(dict(temperature=0.7, repetition_penalty=1.3)) == {"repetition_penalty": 1.3}  # greedy, penalised
    assert read(dict(do_sample=True, temperature=0.0)) == {}
    assert read(dict(eos_token_id=2, max_new_tokens=64, num_beams=1)) == {}     # nothing about sampling
    assert read_generation_defaults(tmp_path / "nowhere") == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(specter.CheckpointError, match="generation_config.json could not be read"):
        read_generation_defaults(tmp_path)


def test_transformers_own_warning_lines_are_held_back(tmp_path, capfd):
    """do_sample false with a temperature (common in published checkpoints) made transformers print
    "[transformers] The following generation flags are not valid..." on every run, outside Specter's
    one-line format; Specter states what it does with it (greedy). The logging level is put back."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(do_sample=False, temperature=0.7, top_p=0.5)))
    assert read_generation_defaults(tmp_path) == {}
    assert "generation flags" not in capfd.readouterr().err and hf_logging.get_verbosity() == level


def test_settings_specter_cannot_honour_are_named(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(SAMPLED, typical_p=0.9, num_beams=4)))
    with pytest.warns(UserWarning, match=r"sets num_beams=4, typical_p=0\.9, which Specter does not apply"):
        assert read_generation_defaults(tmp_path)["temperature"] == 0.8


@pytest.mark.parametrize("content, match", [
    ("{not json", "valid JSON"),
    (json.dumps(dict(do_sample=True, top_p=2.0)), "top_p must be in"),
    (json.dumps(dict(do_sample=True, temperature="hot")), "temperature"),
    (json.dumps(dict(do_sample="yes")), "do_sample must be true or false"),
])
def test_a_broken_file_is_a_checkpoint_error_naming_it(tiny, tmp_path, capsys, content, match):
    path = with_generation_config(tiny("qwen3_moe")[0], tmp_path / "m", content)
    capsys.readouterr()
    with pytest.raises(specter.CheckpointError, match=match) as e:
        specter.load(path, device="cpu", policy="resident")
    assert "generation_config.json" in str(e.value)
    assert main(["generate", "--prompt-ids", "1,2", "--model", path, "--policy", "resident", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specter: error:") and "generation_config.json" in err and "\n" not in err


def test_choose():
    model, P = dict(temperature=0.8, top_k=50), SamplingParams
    assert choose({}, model) == (P(**model), "model")
    assert choose(dict(seed=3, temperature=None), model) == (P(**model, seed=3), "model")  # a seed is no choice
    with pytest.warns(UserWarning, match=r"top_p \(--top-p\) has no effect without a temperature"):  # the rest: neutral
        assert choose(dict(top_p=0.5, seed=3), model) == (P(top_p=0.5, seed=3), "caller")
    assert choose(dict(temperature=0.0), model) == (P(temperature=0.0), "caller")
    assert choose({}, {}) == (P(), "none")


def test_generate_uses_the_model_defaults_unless_told_otherwise(sampled):
    path, bare = sampled
    engine = specter.load(path, device="cpu", policy="resident")
    plain = specter.load(bare, device="cpu", policy="resident")
    assert engine.generation_defaults == dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2)
    assert plain.generation_defaults == {}
    prompt = [5, 9, 14, 3]
    greedy = plain.generate(prompt, max_new_tokens=16)
    assert greedy.stats["sampling"] == "greedy" and greedy.stats["sampling_from"] == "none"
    out = engine.generate(prompt, max_new_tokens=16, seed=11)
    assert out.token_ids == engine.generate(prompt, max_new_tokens=16, seed=11, **engine.generation_defaults).token_ids
    assert out.token_ids != greedy.token_ids
    assert out.stats["sampling"] == "temperature 0.8, top-p 0.9, top-k 50, repetition 1.2"
    assert out.stats["sampling_from"] == "model"
    assert [t for c in engine.stream_ids(prompt, max_new_tokens=16, seed=11) for t in c] == out.token_ids
    for explicit in (dict(temperature=0.0), dict(temperature=0.0, seed=11)):  # any choice: exactly the caller's
        got = engine.generate(prompt, max_new_tokens=16, **explicit)
        assert got.token_ids == greedy.token_ids and got.stats["sampling_from"] == "caller"
    penalised = engine.generate(prompt, max_new_tokens=16, repetition_penalty=1.2)  # greedy + the penalty only
    assert penalised.token_ids == plain.generate(prompt, max_new_tokens=16, repetition_penalty=1.2).token_ids


def test_cli_uses_the_model_defaults_and_greedy_switches_them_off(sampled, capsys):
    path, _ = sampled
    engine = specter.load(path, device="cpu", policy="resident")
    base = ["generate", "--prompt-ids", "5,9,14,3", "--model", path, "--policy", "resident", "--device", "cpu",
            "--max-new-tokens", "12"]

    def tokens(*flags):
        assert main(base + ["--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert tokens("--seed", "4") == engine.generate([5, 9, 14, 3], max_new_tokens=12, seed=4).token_ids
    greedy = engine.generate([5, 9, 14, 3], max_new_tokens=12, temperature=0.0).token_ids
    assert tokens("--greedy") == tokens("--temperature", "0") == greedy != tokens("--seed", "4")
    assert tokens("--top-k", "1", "--seed", "4") == greedy  # an explicit option: the caller's settings only
    assert main(base + ["--seed", "4"]) == 0  # streamed: stdout is the tokens, stderr says what applied
    out = capsys.readouterr()
    assert "(the model's generation_config.json)" in out.err and "temperature" not in out.out
    with pytest.raises(SystemExit) as e:
        main(base + ["--greedy", "--temperature", "0.5"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
