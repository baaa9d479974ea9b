"""compiled/ and triton_ops/ install as specter.compiled / specter.triton_ops (setuptools
package-dir), profiles and the default model ship as package data: in a wheel and editable. The
package's imports form no cycle (tests/import_graph.py)."""
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_subpackages():
    import specter.compiled
    import specter.profiles
    import specter.triton_ops

    assert Path(specter.compiled.__file__).parent == ROOT / "compiled"
    assert Path(specter.triton_ops.__file__).parent == ROOT / "triton_ops"
    assert Path(specter.profiles.__file__).parent == ROOT / "profiles"
    import importlib.metadata

    import specter
    assert importlib.metadata.version("specter") == specter.__version__  # (pyproject reads it from there)


@pytest.mark.slow
def test_wheel_carries_subpackages_profiles_and_default_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                        "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("specter-*.whl"))
    import specter
    assert wheel.name.startswith(f"specter-{specter.__version__}-"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for must in ("specter/compiled/__init__.py", "specter/triton_ops/__init__.py",
                 "specter/profiles/A100-40GB-PCIe4.json", "specter/cli/__init__.py"):
        assert must in names, must
    if (ROOT / "specter" / "default_model" / "model.safetensors").exists():
        assert "specter/default_model/model.safetensors" in names
        assert "specter/default_model/tokenizer.json" in names
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import specter, specter.compiled, specter.triton_ops, specter.profiles, pathlib; "
            "from specter.offload.calibrate import available_profiles; "
            "print(pathlib.Path(specter.compiled.__file__).parent.parent.parent, len(available_profiles()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    where, n = r.stdout.split()
    assert Path(where) == target and int(n) == 4


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", Path(__file__).with_name("import_graph.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_imports_form_no_cycle():
    """No module-level import cycle, and none hidden behind an import inside a function."""
    ig = _import_graph()
    edges, local = ig.graph(ROOT)
    assert "specter.cli" in edges and "specter.compiled.verify_step" in edges and "specter.triton_ops" in edges
    assert ig.cycles(edges) == []
    assert ig.hidden_cycles(edges, local) == []


def test_the_import_graph_sees_cycles(tmp_path):
    """The checker itself: a module-level cycle, and one hidden behind a function-level import."""
    ig = _import_graph()
    for folder in ig.ROOTS.values():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "specter" / "a.py").write_text("from . import b\n")
    (tmp_path / "specter" / "b.py").write_text("from .c import x\n")
    (tmp_path / "specter" / "c.py").write_text("def f():\n    from .b import y\nfrom compiled import k\n")
    (tmp_path / "compiled" / "k.py").write_text("import specter.a\n")
    edges, local = ig.graph(tmp_path)
    assert edges["specter.a"] == {"specter.b"} and edges["specter.compiled.k"] == {"specter.a"}
    assert ig.cycles(edges) == [["specter.a", "specter.b", "specter.c", "specter.compiled.k"]]
    assert local == [("specter.c", "specter.b", 2)] and ig.hidden_cycles(edges, local) == [("specter.c", "specter.b")]


def test_loading_and_generating_on_cpu_never_imports_the_compiler(tmp_path):
    """specter.load on CPU builds its model skeleton on the meta device and fills it from the checkpoint;
    nothing there needs torch._dynamo (an nn.Embedding's random init did: normal_ on meta imports it,
    about a second of every load here), and a CPU generation without compile=True never compiles. The
    second load: the first builds the INT4 draft's cache (quantizing may import it, once a checkpoint)."""
    code = ("import sys, specter; e = specter.load(specter.default_model_path()); "
            "e.generate('def f(', max_new_tokens=4, temperature=0.0); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    env = dict(os.environ, SPECTER_DRAFT_CACHE=str(tmp_path))
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]
