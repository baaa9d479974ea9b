import json
import os
import shutil

import pytest
import torch

import specter
from specter.testing import ARCHS, make_tiny_checkpoint

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

@pytest.fixture(scope="session", autouse=True)
def _draft_cache(tmp_path_factory):
    """Drafts cached under the session's temporary directory, never the user's cache."""
    os.environ["SPECTER_DRAFT_CACHE"] = str(tmp_path_factory.mktemp("draft-cache"))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device-aware test runs on CPU, and on CUDA when a GPU is present."""
    return request.param


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch, **kw) -> (checkpoint dir, transformers reference model); built once per session."""
    built = {}

    def get(arch="qwen3_moe", **kw):
        key = (arch, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(arch)
            built[key] = (path, make_tiny_checkpoint(path, arch, **kw))
        return built[key]

    return get


@pytest.fixture
def fixed_k(monkeypatch):
    """Every speculative engine the test builds (`specter bench` too) drafts K = min(4, K_max) tokens a
    cycle. The governor chooses K by measured time, so on a busy machine it may decode plainly for a
    whole run: a test that needs speculation to happen fixes K."""
    from specter import builder
    from specter.speculative.governor import Governor

    monkeypatch.setattr(builder, "Governor", lambda k_max, **kw: Governor(k_max, **kw, fixed=min(4, k_max)))


@pytest.fixture(scope="session")
def all_archs():
    return ARCHS


@pytest.fixture
def chat_model(tmp_path):
    """A copy of the bundled model with a chat template added."""
    model = tmp_path / "chat-model"
    shutil.copytree(specter.default_model_path(), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model
