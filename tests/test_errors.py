"""Every user error: a SpecterError with an actionable message through the API, and through the
CLI one line on stderr with exit code 2 (never a traceback)."""
import asyncio
import copy
import json
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import specter
from specter.cli import main


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "specter.cli", *args], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def in_process(capsys, *args):
    """cli's (status, stdout, stderr), from main() in this process: an exception main does not turn into
    its one-line error fails the test, where a subprocess would print a Traceback (test_cli_subprocess_*
    run the real process), and no interpreter start (5 s here) per case."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_directory(tmp_path):
    with pytest.raises(specter.CheckpointError, match="does not exist"):
        specter.load(tmp_path / "nope", device="cpu", policy="resident")


def test_directory_without_config(tmp_path):
    with pytest.raises(specter.CheckpointError, match="config.json"):
        specter.load(tmp_path, device="cpu", policy="resident")


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(specter.UnsupportedModelError, match="'llama'.*supported: mixtral"):
        specter.load(tmp_path, device="cpu", policy="resident")


@pytest.mark.parametrize("patch, match", [
    ({"num_experts_per_tok": 32}, "num_experts_per_tok \\(32\\) is more than the 16 routed experts"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"hidden_size": -256}, "hidden_size must be an integer >= 1, got -256"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"moe_intermediate_size": 0}, "intermediate size must be an integer >= 1"),
    ({"model_type": None}, "has no model_type"),
    ([1, 2, 3], "holds a JSON list"),
    ({"hidden_size": "256"}, "could not be read: Validation error for field 'hidden_size': TypeError"),  # one line
    ({"eos_token_id": [[2]]}, "Validation error for field 'eos_token_id'"),  # (transformers' own check)
])
def test_a_config_of_impossible_sizes_is_refused_naming_the_field(capsys, tmp_path, patch, match):
    """Each crashed in the model's construction (k out of range, store[0], a negative dimension, a list's
    missing .get) or gave `specter plan` negative bytes; now the same CheckpointError for load and plan."""
    config = json.loads((specter.default_model_path() / "config.json").read_text())
    config = patch if isinstance(patch, list) else {k: v for k, v in {**config, **patch}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(specter.CheckpointError, match=match):
        specter.load(tmp_path, device="cpu", policy="resident")
    code, _, err = in_process(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "Traceback" not in err and re.search(match, err), err


@pytest.mark.parametrize("arch, patch, error, match", [
    ("mixtral", {"sliding_window": 0}, specter.CheckpointError, "sliding_window must be an integer >= 1, got 0"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, specter.CheckpointError, "decoder_sparse_step must be an integer >= 1"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": None, "topk_group": 2}, specter.CheckpointError,
     "n_group must be an integer >= 1, got None"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, specter.UnsupportedModelError, "scoring_func 'sigmoid' is not supp"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     specter.UnsupportedModelError, "dynamic NTK RoPE"),
])
def test_configs_transformers_cannot_run_are_refused_from_config_json_alone(capsys, tiny, tmp_path, arch, patch, error,
                                                                           match):
    """Each ran as something else (a window of 0 masked every position away; a sparse step of 0 or
    groups of None read as 1; sigmoid scores read as softmax) where transformers crashes or DeepSeek's
    own code refuses, or (dynamic RoPE) was refused only once the weights' headers were read."""
    config = json.loads((tiny(arch)[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **patch}))  # no weights: refused before them
    with pytest.raises(error, match=match):
        specter.load(tmp_path, device="cpu", policy="resident")
    code, _, err = in_process(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "Traceback" not in err and re.search(match, err), err


@pytest.mark.parametrize("patch, error, match", [
    ({"norm_topk_prob": True}, specter.UnsupportedModelError, "norm_topk_prob true is not supported"),
    ({"mlp_bias": True}, specter.UnsupportedModelError, "mlp_bias"),
    ({"moe_layer_freq": 2}, specter.UnsupportedModelError, "moe_layer_freq 2 is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, specter.CheckpointError,
     r"n_group \(3\) to divide the 8 routed experts"),
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 3}, specter.CheckpointError,
     r"topk_group \(3\) <= n_group"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 0}, specter.CheckpointError,
     "topk_group must be an integer >= 1"),
])
def test_deepseek_options_specter_cannot_match_are_refused(capsys, tiny, tmp_path, patch, error, match):
    """They loaded and then gave other tokens than transformers (norm_topk_prob: DeepSeek's own code
    renormalises, transformers' does not; moe_layer_freq: DeepSeek's own code makes only every freq-th layer
    MoE, transformers every one; mlp_bias: biases never read) or crashed in generate (groups)."""
    path = tmp_path / "m"
    shutil.copytree(tiny("deepseek_v2")[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **patch}))
    with pytest.raises(error, match=match):
        specter.load(path, device="cpu", policy="resident")
    code, _, err = in_process(capsys, "plan", "--model", str(path))
    assert code == 2 and "Traceback" not in err and re.search(match, err), err


def test_stored_tensors_the_model_does_not_read(tiny, tmp_path):
    """A tensor of a layer Specter computes that it does not read (here a bias the config does not
    declare) would make the output another model's: refused, named. One past the last layer is warned
    about; rotary inv_freq buffers are ignored."""
    from safetensors.torch import load_file, save_file

    src, ref = tiny("qwen3_moe")
    path = tmp_path / "m"
    shutil.copytree(src, path)
    tensors = load_file(src / "model.safetensors")
    n = ref.config.num_hidden_layers
    for extra, outcome in (("model.layers.1.mlp.experts.0.down_proj.bias", "error"),
                           ("model.norm.bias", "error"),
                           (f"model.layers.{n}.eh_proj.weight", "warning"),
                           ("model.layers.0.self_attn.rotary_emb.inv_freq", "silent")):
        save_file({**tensors, extra: torch.zeros(4)}, path / "model.safetensors", metadata={"format": "pt"})
        if outcome == "error":
            with pytest.raises(specter.CheckpointError, match=re.escape(repr(extra)) + ".*describes another model"):
                specter.load(path, device="cpu", policy="resident")
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            engine = specter.load(path, device="cpu", policy="resident")
        engine.close()
        assert [str(w.message) for w in seen if "not read" in str(w.message)] == \
            ([] if outcome == "silent" else [f"{path}: 1 tensor(s) outside the layers Specter computes are not read "
                                            f"({extra!r})"]), extra


def test_missing_weights(tiny, tmp_path):
    path, _ = tiny("qwen3_moe")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(specter.CheckpointError, match="no \\*.safetensors"):
        specter.load(tmp_path, device="cpu", policy="resident")


def test_truncated_safetensors_names_the_file(tiny, tmp_path):
    path, _ = tiny("qwen3_moe")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    data = (path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(specter.CheckpointError, match="model.safetensors.*truncated"):
        specter.load(tmp_path, device="cpu", policy="resident")


def test_a_tensor_stored_twice_is_refused(tiny, tmp_path):
    """With no index every *.safetensors file is read, and a stray copy of an old shard (here zeroed
    embedding and lm_head) overrode the real tensors silently: the output was another model's. A tensor
    in two files is refused, naming both; in shards an index lists, too."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    shutil.copytree(tiny("qwen3_moe")[0], path)
    real = load_file(path / "model.safetensors")
    stray = {n: torch.zeros_like(real[n]) for n in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(stray, path / "zz-old.safetensors", metadata={"format": "pt"})
    with pytest.raises(specter.CheckpointError, match=r"'lm_head.weight' is stored twice, in .*model.safetensors and "
                                                      r"in .*zz-old.safetensors: .*remove the stray one"):
        specter.load(path, device="cpu", policy="resident")
    index = {"weight_map": {**{n: "model.safetensors" for n in real}, **{n: "zz-old.safetensors" for n in stray}}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(specter.CheckpointError, match="stored twice"):
        specter.load(path, device="cpu", policy="resident")


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tiny, tmp_path):
    """num_hidden_layers 2 over weights of 3 decoder layers computed a shallower model, with only a warning
    that some tensors were not read. Whole decoder layers past the config's are refused, unless it
    declares them as multi-token-prediction layers (num_nextn_predict_layers: warned, not read)."""
    src, ref = tiny("qwen3_moe")
    path = tmp_path / "m"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = n - 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(specter.CheckpointError, match=f"decoder layers up to model.layers.{n - 1}, but config.json's "
                                                      f"num_hidden_layers is {n - 1}"):
        specter.load(path, device="cpu", policy="resident")
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="outside the layers Specter computes are not read"):
        specter.load(path, device="cpu", policy="resident").close()


def test_a_config_with_more_experts_than_the_weights_says_so(tiny, tmp_path):
    """It said only that '...experts.8.gate_proj.weight' is missing; config.json is what disagrees."""
    path = tmp_path / "m"
    shutil.copytree(tiny("mixtral")[0], path)
    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_local_experts"]
    cfg["num_local_experts"] = n + 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(specter.CheckpointError, match=f"experts.{n}.w1.weight' is missing .*config.json declares "
                                                      f"{n + 2} routed experts a layer, the weights hold {n}"):
        specter.load(path, device="cpu", policy="resident")
    cfg["num_local_experts"] = n  # one expert's tensor gone from the middle: a damaged file, not the config
    (path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(specter.CheckpointError, match="experts.1.w1.weight' is missing") as err:
        specter.load(path, device="cpu", policy="resident")
    assert "config.json" not in str(err.value)


def test_missing_shard_names_the_file(tiny, tmp_path):
    path, _ = tiny("mixtral", max_shard_size="100KB")
    shutil.copytree(path, tmp_path / "m")
    victim = sorted((tmp_path / "m").glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(specter.CheckpointError, match=victim.name):
        specter.load(tmp_path / "m", device="cpu", policy="resident")


@pytest.mark.parametrize("index", [{"weight_map": [["a", "b"]]}, {"weight_map": {"x": None}}, [1, 2],
                                   {"weight_map": {}}, {"weight_map": {"x": 3}}, {"metadata": {}}], ids=str)
def test_a_malformed_shard_index_is_a_checkpoint_error(tiny, tmp_path, index):
    """A weight_map that is a list, empty, or maps to non-names; an index that is a list or lacks the map:
    one CheckpointError naming the index (they were AttributeError, TypeError, StopIteration tracebacks)."""
    from specter.errors import CheckpointError

    path = tmp_path / "m"
    shutil.copytree(tiny("mixtral", max_shard_size="100KB")[0], path)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is malformed"):
        specter.load(path, device="cpu", policy="resident")


def test_tensors_are_found_in_the_shard_holding_them_and_experts_set_the_store_dtype(tiny, tmp_path):
    """The index names a wrong shard for the embedding: the shards' headers decide, as for every other tensor
    (it was a SafetensorError). Experts stored in fp32 beside a bf16 embedding keep fp32 in the store (they
    were rounded to bf16, and greedy tokens left transformers' at token 14)."""
    from safetensors.torch import load_file, save_file

    from test_parity import hf_greedy

    from specter.loader import open_checkpoint

    src, ref = tiny("mixtral", max_shard_size="100KB")
    ref = copy.deepcopy(ref)  # the session's; its embedding is rounded below
    path = tmp_path / "m"
    shutil.copytree(src, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    embed = index["weight_map"]["model.embed_tokens.weight"]
    index["weight_map"]["model.embed_tokens.weight"] = next(f for f in index["weight_map"].values() if f != embed)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = path / embed
    tensors = load_file(shard)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].bfloat16()
    save_file(tensors, shard, metadata={"format": "pt"})
    assert open_checkpoint(path).dtype == torch.float32
    engine = specter.load(path, device="cpu", policy="on-demand", residency=0.5)
    ref.model.embed_tokens.weight.data = ref.model.embed_tokens.weight.data.bfloat16().float()
    assert engine.generate([1, 2, 3], max_new_tokens=20).token_ids == hf_greedy(ref, [1, 2, 3], 20)


def test_a_broken_tokenizer_fails_before_the_weights_load(tiny, tmp_path, monkeypatch):
    from specter import builder

    path = tmp_path / "m"
    shutil.copytree(tiny("qwen3_moe")[0], path)
    (path / "tokenizer.json").write_text("{not json")
    monkeypatch.setattr(builder, "load_checkpoint", lambda *a, **k: pytest.fail("the weights began to load"))
    with pytest.raises(specter.CheckpointError, match="the tokenizer in .* could not be loaded"):
        specter.load(path, device="cpu", policy="resident")


def test_a_tokenizer_config_without_its_tokenizer_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "m"
    shutil.copytree(specter.default_model_path(), path)
    (path / "tokenizer.json").unlink()  # tokenizer_config.json alone: transformers' five-line message
    with pytest.raises(specter.CheckpointError, match="no tokenizer.json") as e:
        specter.load(path, device="cpu", policy="resident")
    assert "\n" not in str(e.value)


def test_a_missing_lm_head_is_refused_unless_the_config_ties_it(tiny, tmp_path):
    """An untied lm_head missing from the checkpoint was read from the embedding table instead: nonsense
    text from a broken checkpoint. Tied (tie_word_embeddings true), the table is the head, as transformers has it."""
    from safetensors.torch import load_file, save_file

    path, _ = tiny("qwen3_moe")
    shutil.copytree(path, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(specter.CheckpointError, match="'lm_head.weight' is missing.*tie_word_embeddings is false"):
        specter.load(tmp_path / "m", device="cpu", policy="resident")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    e = specter.load(tmp_path / "m", device="cpu", policy="resident")
    try:
        assert torch.equal(e.model.lm_head.weight, e.model.model.embed_tokens.weight)
    finally:
        e.close()


def test_chat_messages_the_template_cannot_render_are_a_config_error(chat_model):
    """As real templates do (Qwen's, Mixtral's), this one raises on a role it does not know: that, and a
    message without a role or with no text, came out as jinja's own exceptions."""
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                               "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
                               "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
    (chat_model / "tokenizer_config.json").write_text(json.dumps(config))
    e = specter.load(chat_model, device="cpu", policy="resident")
    try:
        with pytest.raises(specter.ConfigError, match="chat template refused these messages.*Unknown role: wizard"):
            e.generate([{"role": "wizard", "content": "hi"}], max_new_tokens=2)
        for bad in ({"content": "hi"}, {"role": "user", "content": None}, {"role": "", "content": "hi"}):
            with pytest.raises(specter.ConfigError, match="chat message 0 must have a non-empty string 'role'"):
                e.generate([bad], max_new_tokens=2)
        assert e.generate([{"role": "user", "content": "hi"}], max_new_tokens=2).token_ids
    finally:
        e.close()


@pytest.mark.parametrize("policy", ["resident", "on-demand", "specter"])
def test_a_closed_engine_refuses_to_generate(policy):
    """resident generated on after close(); on-demand and specter raised their link's or lane's RuntimeError."""
    e = specter.load(None, device="cpu", policy=policy, residency=None if policy == "resident" else 0.5)
    assert e.generate("x", max_new_tokens=2).token_ids
    e.close()
    e.close()  # twice is fine
    for call in (lambda: e.generate("x", max_new_tokens=2), lambda: list(e.stream("x", max_new_tokens=2))):
        with pytest.raises(specter.ConfigError, match="this engine is closed"):
            call()


def test_k_max_for_a_policy_that_does_not_draft_is_refused():
    """The CLI refused --k-max for resident and on-demand; load() took k_max and ignored it."""
    for policy in ("resident", "on-demand"):
        with pytest.raises(specter.ConfigError, match=f"policy '{policy}' does not draft, so k_max=4"):
            specter.load(None, device="cpu", policy=policy, k_max=4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "float64"])
def test_a_compute_dtype_outside_the_three_is_refused(dtype):
    """torch.int8 passed the check and failed in silu ("not implemented for 'Char'"); float64 ran untested."""
    with pytest.raises(specter.ConfigError, match="dtype must be one of float32"):
        specter.load(None, device="cpu", policy="resident", dtype=dtype)


@pytest.fixture(scope="module")
def engine(tiny):
    path, _ = tiny("qwen3_moe")
    return specter.load(path, device="cpu", policy="resident")


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(seed="x"), "seed"),
    (dict(seed=2 ** 64, temperature=1.0), "seed"),         # past a 64-bit seed: torch's overflow, before
    (dict(seed=-(2 ** 63) - 1, temperature=1.0), "seed"),
])
def test_invalid_sampling_values(engine, kw, match):
    """Refused by every entry point at the call (a stream's too, not at its first piece), as a ValueError
    as well (what Python code catches for a bad argument)."""
    with pytest.raises(specter.ConfigError, match=match):
        engine.generate([1, 2, 3], **kw)
    for entry in (engine.stream_ids,) + ((engine.stream, engine.astream) if engine.tokenizer else ()):
        with pytest.raises(ValueError, match=match):
            entry([1, 2, 3], **kw)
    assert engine.generate([1, 2, 3], max_new_tokens=2).stats["finish_reason"] == "length"


def test_a_streams_arguments_are_checked_at_the_call():
    """stream and astream refused a bad argument only at their first piece (generators); the engine is
    still taken at the first piece."""
    engine = specter.load(None, device="cpu", policy="resident")
    for entry in (engine.stream, engine.stream_ids, engine.astream):
        with pytest.raises(ValueError, match="top_p"):
            entry("def f():", top_p=0.0)
    greedy = dict(max_new_tokens=3, temperature=0)
    pending = engine.stream("def f():", **greedy)
    assert engine.generate("def f():", **greedy).stats["finish_reason"] == "length"  # not held by `pending`

    async def agen():
        return "".join([p async for p in engine.astream("def f():", **greedy)])

    assert "".join(pending) == asyncio.run(agen()) == engine.generate("def f():", **greedy).text
    engine.close()


def test_prompt_beyond_context(engine):
    with pytest.raises(specter.ContextLengthError, match="exceeds the model's context of 256"):
        engine.generate(list(range(1, 101)), max_new_tokens=200)
    # no max_new_tokens: 128, or what the context has room for (as the CLI and the server), not an error
    def ids(n):
        return [1 + i % 100 for i in range(n)]

    out = engine.generate(ids(200), temperature=0.0)
    assert out.stats["generated_tokens"] <= 56 and sum(1 for _ in engine.stream_ids(ids(200))) >= 1
    if out.stats["finish_reason"] == "length":
        assert len(out.token_ids) == 56
    with pytest.raises(specter.ContextLengthError, match=r"the prompt \(256 tokens\) leaves no room for a new token"):
        engine.generate(ids(256))


@pytest.mark.skipif(not (specter.default_model_path() / "tokenizer.json").exists(), reason="no bundled model")
def test_a_long_text_prompt_gets_the_engines_error_alone(capfd):
    """Past the context, the engine's ContextLengthError, not also transformers' warning that the tokenizer's
    model_max_length (2048 on the bundled model) "will result in indexing errors"."""
    engine = specter.load(None, device="cpu", policy="resident")
    with pytest.raises(specter.ContextLengthError, match="exceeds the model's context"):
        engine.generate("def " * 5000, max_new_tokens=2)
    assert "indexing errors" not in capfd.readouterr().err


def test_a_model_without_an_moe_layer_runs_resident_and_offloaders_say_so(tmp_path):
    """A config that routes no layer to experts (decoder_sparse_step 2 over one layer): resident runs it;
    the offloading policies crashed at load (IndexError on the empty store; ZeroDivisionError coded)."""
    from specter.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=1, decoder_sparse_step=2)
    engine = specter.load(tmp_path, device="cpu", policy="resident")
    assert engine.spec.n_moe_layers == 0 and len(engine.generate([1, 2, 3], max_new_tokens=3).token_ids) == 3
    for policy in ("on-demand", "next-layer", "host", "spec-lru", "specter"):
        with pytest.raises(specter.ConfigError, match=f"no MoE layer .* policy '{policy}' has nothing to offload"):
            specter.load(tmp_path, device="cpu", policy=policy, residency=0.5)


def test_string_prompt_without_tokenizer(engine):
    with pytest.raises(specter.TokenizerError, match="token ids"):
        engine.generate("hello")


def test_bad_prompts(engine):
    with pytest.raises(specter.ConfigError, match="outside the vocabulary"):
        engine.generate([1, 100000])
    with pytest.raises(specter.ConfigError, match="empty"):
        engine.generate([])


def test_text_that_is_not_unicode_is_a_config_error(chat_model):
    """A lone surrogate (bytes that are not UTF-8, as Python hands the CLI's argv and stdin over) reached
    the tokenizer: a TypeError traceback, exit 1. The server already refused it."""
    engine = specter.load(chat_model, device="cpu", policy="resident")
    try:
        for prompt, where in (("x = \ud800", "the prompt"), ([{"role": "user", "content": "a\udcffb"}],
                                                               "chat message 0's content")):
            with pytest.raises(specter.ConfigError, match=f"{where}: it is not valid Unicode: a lone surrogate"):
                engine.generate(prompt, max_new_tokens=2)
    finally:
        engine.close()
    r = subprocess.run([sys.executable, "-m", "specter.cli", "generate", "--policy", "resident", "--greedy",
                        "--max-new-tokens", "2", b"x = \xff"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not valid Unicode" in r.stderr, r.stderr


def test_unknown_policy_and_device(tiny):
    path, _ = tiny("qwen3_moe")
    with pytest.raises(specter.ConfigError, match="unknown policy"):
        specter.load(path, device="cpu", policy="fastest")
    with pytest.raises(specter.ConfigError, match="device"):
        specter.load(path, device="tpu", policy="resident")


@pytest.mark.parametrize("policy, kw", [("resident", dict(compress_experts=True)), ("resident", dict(link="NOPE")),
                                        ("resident", dict(draft_bits=2)), ("on-demand", dict(draft_bits=2))])
def test_the_api_refuses_an_option_the_policy_would_ignore(policy, kw):
    """The CLI refused `--policy resident --compress-experts` as ignored; specter.load took it (and coded
    the store for nothing), a misspelt link profile on resident, and draft_bits on a policy without a
    draft. Refused as the CLI refuses them, before the load."""
    with pytest.raises(specter.ConfigError, match=f"so {next(iter(kw))}=.* would be ignored"):
        specter.load(None, device="cpu", policy=policy, **({"residency": 0.5} if policy != "resident" else {}), **kw)


def test_a_cuda_device_that_is_not_there_is_named(monkeypatch):
    """`--device cuda:1` on a box without a GPU said "device 'cuda' was asked for", and a GPU index
    past the machine's was left to fail deep in the load: both name the device asked for."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(specter.ConfigError, match=r"device 'cuda:1' was asked for but no CUDA GPU .*'cpu'"):
        specter.resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(specter.ConfigError, match=r"'cuda:1' was asked for but this machine has 1 CUDA GPU \(cuda:0\)"):
        specter.resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert specter.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(specter.ConfigError, match=r"has 2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        specter.resolve_device("cuda:2")


def test_cli_errors_are_one_line_exit_2(tiny, tmp_path, capsys):
    path, _ = tiny("qwen3_moe")
    cases = [
        ["generate", "hi", "--model", str(tmp_path / "missing")],
        ["generate", "hi", "--model", str(path), "--policy", "resident"],          # no tokenizer
        ["generate", "x", "--model", str(path), "--policy", "resident", "--temperature", "-1"],
        ["generate", "x", "--model", str(path), "--policy", "resident", "--top-p", "2"],
    ]
    for args in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("specter: error:") and "\n" not in err and "Traceback" not in err, err


def test_cli_subprocess_unsupported_arch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, out, err = cli("generate", "hi", "--model", str(tmp_path), "--device", "cpu")
    assert code == 2
    assert "Traceback" not in err and "'gpt2' is not supported" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kw, match", [
    (dict(stop=""), "empty stop string"),
    (dict(stop=["ok", ""]), "empty stop string"),
    (dict(stop=[5]), "stop must be a string or a list of strings"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(max_tokens=5), "unknown argument 'max_tokens'"),
    (dict(topp=0.5), "did you mean 'top_p'"),
])
def test_bad_arguments_are_specter_errors(kw, match):
    e = specter.load(None, device="cpu", policy="resident")  # a tokenizer, so stop strings are allowed
    for call in (lambda: e.generate("x", **kw), lambda: list(e.stream("x", **kw)),
                 lambda: list(e.stream_ids("x", **kw))):
        with pytest.raises(specter.SpecterError, match=match):
            call()

    async def astream():
        return [p async for p in e.astream("x", **kw)]

    with pytest.raises(specter.SpecterError, match=match):
        asyncio.run(astream())


def test_streaming_without_a_tokenizer(engine):
    """No tokenizer: stream() says to use stream_ids(), which yields the generated ids."""
    with pytest.raises(specter.TokenizerError, match="stream_ids"):
        next(engine.stream([1, 2, 3], max_new_tokens=4))
    chunks = list(engine.stream_ids([1, 2, 3], max_new_tokens=6))
    assert [t for c in chunks for t in c] == engine.generate([1, 2, 3], max_new_tokens=6).token_ids
    assert len(chunks) == 6
    with pytest.raises(specter.TokenizerError, match="stop strings"):
        engine.generate([1, 2, 3], stop="x")


def test_a_gguf_file_a_hub_id_and_a_quantized_checkpoint_say_what_to_pass(tiny, tmp_path, capsys):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(specter.CheckpointError, match="GGUF file.*Hugging Face model directory"):
        specter.load(gguf, device="cpu")
    with pytest.raises(specter.CheckpointError, match="hf download Qwen/Qwen3-30B-A3B --local-dir DIR"):
        specter.load("Qwen/Qwen3-30B-A3B", device="cpu")
    d = tmp_path / "gguf-dir"
    d.mkdir()
    shutil.copy(tiny("qwen3_moe")[0] / "config.json", d / "config.json")
    (d / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(specter.CheckpointError, match="GGUF files"):
        specter.load(d, device="cpu")
    (d / "config.json").unlink()  # a GGUF download alone: the same hint
    with pytest.raises(specter.CheckpointError, match="config.json is missing.*GGUF files"):
        specter.load(d, device="cpu")
    from specter.cli import main

    for command in (["chat"], ["serve", "--port", "0"]):  # their tokenizer check leaves it to the load's hint
        assert main([*command, "--model", str(d), "--device", "cpu"]) == 2
        assert "GGUF files" in capsys.readouterr().err, command
    path, _ = tiny("qwen3_moe")
    q = tmp_path / "gptq"
    shutil.copytree(path, q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(specter.UnsupportedModelError, match=r"quantized checkpoint \(gptq\).*original"):
        specter.load(q, device="cpu")


def test_a_budget_the_policy_would_ignore_is_refused(tiny, capsys):
    path, _ = tiny("qwen3_moe")
    for kw in (dict(residency=0.25), dict(expert_memory="1MiB"), dict(device_memory="1GiB")):
        with pytest.raises(specter.ConfigError, match="'resident' keeps every expert.*would be ignored"):
            specter.load(path, device="cpu", policy="resident", **kw)
    assert main(["generate", "--prompt-ids", "1,2", "--model", str(path), "--policy", "resident",
                 "--residency", "0.25"]) == 2
    assert "would be ignored" in capsys.readouterr().err


@pytest.mark.parametrize("kw, match", [
    (dict(model=123), "model must be a directory path"),
    (dict(dtype=5), "dtype must be a name"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(threads="x"), "threads must be an integer"),
])
def test_bad_load_arguments_are_config_errors(kw, match):
    with pytest.raises(specter.ConfigError, match=match):
        specter.load(device="cpu", **kw)


def test_a_context_shorter_than_the_models(tiny):
    """context=N caps prompt + new tokens at N with an error naming both contexts, plans the KV cache
    for N tokens (a device budget then buys more expert slots), and gives the same tokens; a context
    that is not a positive integer, or longer than the model's, is refused."""
    path, _ = tiny("qwen3_moe")
    whole = specter.load(path, device="cpu", policy="on-demand", residency=0.5)
    budget = whole.plan.total_bytes  # the whole context's KV cache and half the experts
    short = specter.load(path, device="cpu", policy="on-demand", device_memory=budget, context=64)
    try:
        assert short.context == 64 and whole.context == 256 and short.plan.context == 64
        assert short.plan.kv_bytes * 4 == whole.plan.kv_bytes and short.plan.pool_slots > whole.plan.pool_slots
        want = whole.generate([1, 2, 3], max_new_tokens=20, temperature=0.0).token_ids
        assert short.generate([1, 2, 3], max_new_tokens=20, temperature=0.0).token_ids == want
        with pytest.raises(specter.ContextLengthError, match=r"context of 64 tokens \(the engine was loaded with "
                                                             r"context=64; the model's is 256\)"):
            short.generate([1, 2, 3], max_new_tokens=62)
    finally:
        whole.close()
        short.close()
    for bad, match in ((0, "integer >= 1"), (True, "integer >= 1"), ("64", "integer >= 1"),
                       (257, "exceeds the model's")):
        with pytest.raises(specter.ConfigError, match=match):
            specter.load(path, device="cpu", policy="on-demand", context=bad)


def test_an_unknown_load_option_names_the_ones_there_are():
    """specter.load(driver=...) said only "unknown option(s): driver"; slot_pool's refusal named `pool`."""
    with pytest.raises(specter.ConfigError, match=r"kmax \(did you mean k_max\?\); specter.load takes .*slot_pool"):
        specter.load(None, device="cpu", policy="on-demand", residency=0.5, kmax=3)
    with pytest.raises(specter.ConfigError, match="slot_pool must be one of"):
        specter.load(None, device="cpu", policy="on-demand", residency=0.5, slot_pool="bogus")


def test_first_loads_on_several_threads_at_once_import_transformers_safely(tmp_path):
    """Two specter.load calls on threads of a fresh process: transformers' lazy module raced ("cannot
    import name 'AutoConfig' from 'transformers'", in 2 of 3 threads). Its names are imported under a
    lock now; the cache's temporary names are per thread too (they were per process)."""
    code = """
import threading, specter
from specter.loader import read_config, load_tokenizer
from specter.generation_defaults import read_generation_defaults
from specter.speculative.draft_cache import write_layer_file
import torch, pathlib
p, errs = specter.default_model_path(), []
def go(i):
    try:
        [read_config, load_tokenizer, read_generation_defaults][i % 3](p)
        write_layer_file(pathlib.Path(DIR) / "layer-0.safetensors", "k", 0, {"w": torch.zeros(1 << 16)})
    except BaseException as e:
        errs.append(repr(e))
ts = [threading.Thread(target=go, args=(i,)) for i in range(6)]
[t.start() for t in ts]; [t.join() for t in ts]
print(errs)
""".replace("DIR", repr(str(tmp_path)))  # -W error: a collision on the temporary name warned of a full disk
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
    assert [f.name for f in tmp_path.iterdir()] == ["layer-0.safetensors"]


@pytest.mark.parametrize("name, content, match", [
    ("generation_config.json", b"[1, 2]", "generation_config.json holds a JSON list"),  # ('list' has no .get)
    ("generation_config.json", b"null", "generation_config.json holds a JSON null"),
    ("generation_config.json", b'{"eos_token_id": "x"}', "generation_config.json: eos_token_id must be a token"),
    ("generation_config.json", b'{"eos_token_id": [[0]]}', "eos_token_id must be a token id"),  # (unhashable)
    ("generation_config.json", b'{"eos_token_id": true}', "eos_token_id must be a token id"),  # (ended at token 1)
    ("generation_config.json", b'{"eos_token_id": 5.5}', "eos_token_id must be a token id"),  # (never matched)
    ("generation_config.json", b'{"do_sample": false, "x": "\xff"}', "generation_config.json is not valid JSON"),
    ("config.json", None, "config.json is not valid JSON"),  # a byte that is not UTF-8 (UnicodeDecodeError)
])
def test_a_settings_file_that_is_not_an_object_of_the_right_values_is_refused(capsys, tmp_path, name, content, match):
    """Each crashed with a traceback (AttributeError, TypeError, UnicodeDecodeError), from load and plan
    alike, or (true, 5.5) was taken as an end-of-sequence token; now one CheckpointError naming the file."""
    shutil.copytree(specter.default_model_path(), tmp_path / "m")
    f = tmp_path / "m" / name
    f.write_bytes(content if content is not None else f.read_bytes().replace(b'"model_type"', b'"model_\xfftype"'))
    with pytest.raises(specter.CheckpointError, match=match):
        specter.load(tmp_path / "m", device="cpu", policy="resident")
    code, _, err = in_process(capsys, "plan", "--model", str(tmp_path / "m"))
    assert code == 2 and "Traceback" not in err and re.search(match, err), err


def test_a_compile_asked_for_that_fails_is_one_line(monkeypatch):
    """--compile without a C++ compiler on CPU printed Inductor's ~100-line InvalidCxxCompiler traceback;
    asked for, a failed compile is a NotAvailableError of one line; in auto mode (CUDA) a warning and
    the eager steps, as before."""
    from specter import builder

    def fails(*_, **__):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found: (None, 'g++')\n" + "detail\n" * 99)

    monkeypatch.setattr(builder, "_compiled_verify_step", fails)
    with pytest.raises(specter.NotAvailableError, match=r"^compile=True \(--compile\): compiling the one-token step "
                                                        r"failed \(RuntimeError: InvalidCxxCompiler: No working C\+\+ "
                                                        r"compiler found: \(None, 'g\+\+'\)\); fix that") as e:
        builder._compiled_steps(None, None, True, torch.device("cpu"), 0)
    assert "\n" not in str(e.value)
    with pytest.warns(specter.errors.SpecterWarning, match="decoding eagerly"):
        assert builder._compiled_steps(None, None, None, torch.device("cuda"), 0) == (None, None)
