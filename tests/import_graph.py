"""The import graph of the installed package, from the source alone (ast, nothing imported).

    python tests/import_graph.py [REPO]     # modules, cycles, function-level project imports

Modules are named as installed: specter/x.py is specter.x, compiled/ is specter.compiled,
triton_ops/ is specter.triton_ops (pyproject.toml's package-dir). An edge a -> b is an import of b
in a's body at module level (`if TYPE_CHECKING:` blocks left out); importing a submodule runs its
package's __init__ first, an edge not counted. tests/test_packaging.py holds the package to: no
module-level cycle, and no function-level import that hides one (its target reaching the
importer at module level).
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOTS = {"specter": "specter", "specter.compiled": "compiled", "specter.triton_ops": "triton_ops"}
TOP_LEVEL = ("compiled", "triton_ops")  # also importable by these names (PYTHONPATH = the repository)


def modules(repo: Path) -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package."""
    out = {}
    for pkg, folder in ROOTS.items():
        for f in sorted((repo / folder).rglob("*.py")):
            parts = list(f.relative_to(repo / folder).with_suffix("").parts)
            if pkg == "specter" and parts[0] in TOP_LEVEL:  # stray copies under specter/ are not the package's
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = f
    return out


def _canonical(name: str) -> str:
    return "specter." + name if name.split(".")[0] in TOP_LEVEL else name


def _targets(mods: dict, importer: str, path: Path, node) -> set[str]:
    """Project modules an import statement names (the longest known prefix of each)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer if path.name == "__init__.py" else importer.rsplit(".", 1)[0]
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
        names = [f"{base}.{a.name}" if _canonical(f"{base}.{a.name}") in mods else base for a in node.names]
    found = set()
    for name in map(_canonical, names):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != importer:
            found.add(name)
    return found


def graph(repo: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module-level edges, function-level imports as (importer, target, line))."""
    mods = modules(repo)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    local: list[tuple[str, str, int]] = []
    for name, path in mods.items():
        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(mods, name, path, child):
                        if in_function:
                            local.append((name, target, child.lineno))
                        else:
                            edges[name].add(target)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
        visit(ast.parse(path.read_text()), False)
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(edges[v])
    return False


def hidden_cycles(edges, local) -> list[tuple[str, str]]:
    """Function-level imports whose target imports the importer back at module level."""
    return sorted({(a, b) for a, b, _ in local if reaches(edges, b, a)})


def report(repo: Path) -> str:
    edges, local = graph(repo)
    lines = [f"{len(edges)} modules, {sum(map(len, edges.values()))} module-level project imports",
             f"module-level cycles: {len(cycles(edges))}"]
    lines += [f"  {' <-> '.join(c)}" for c in cycles(edges)]
    lines.append(f"function-level imports of project modules: {len(local)}")
    for importer, n in sorted(Counter(a for a, _, _ in local).items(), key=lambda kv: (-kv[1], kv[0])):
        targets = sorted({b.removeprefix("specter.") for a, b, _ in local if a == importer})
        lines.append(f"  {importer}: {n} -> {', '.join(targets)}")
    hidden = hidden_cycles(edges, local)
    lines.append(f"function-level imports hiding a cycle: {len(hidden)}")
    lines += [f"  {a} -> {b}" for a, b in hidden]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
