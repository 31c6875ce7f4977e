"""No import cycle among rlflow's modules (rlflow/, stages/ as rlflow.stages, operators/ as rlflow.operators).

Static: every file is parsed with ast (nothing is imported), and an edge A -> B is drawn for each `import` or
`from ... import` of B in A, at module level AND inside functions, try/if blocks and classes. Function-level imports
count on purpose: the cycle this test was written for (runtime/evaluation.py <-> runtime/prompt_source.py) ran
through a function-level import, and a lazy import only hides a cycle until someone moves it to the top. The only
edges left out are the implicit ones from a module to its parent packages' __init__ files (every submodule would
otherwise sit in a cycle with a package that imports it). A strongly connected component of more than one module
is a cycle; the test names every one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[3]
#: source folder -> the package it ships as (pyproject.toml's package-dir)
PACKAGES = {"rlflow": "rlflow", "stages": "rlflow.stages", "operators": "rlflow.operators"}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the three source folders of `root`."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, node: ast.AST) -> list[str]:
    """The dotted names an import statement in module `name` (file `path`) may bring in."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the module's package (the module itself when it is an __init__)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import mod` imports pkg.mod


def import_graph(root: Path = REPO) -> nx.DiGraph:
    known = modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for target in imported(name, path, node):
                if target in known and target != name:
                    graph.add_edge(name, target)
    return graph


def test_the_graph_sees_the_packages():
    graph = import_graph()
    assert {"rlflow.runtime.driver", "rlflow.stages.trainer", "rlflow.operators.coordinator"} <= set(graph)
    assert graph.has_edge("rlflow.runtime.prompt_source", "rlflow.prompt_rows")
    assert graph.has_edge("rlflow.operators.coordinator", "rlflow.operators.routing")  # a relative import


def test_no_import_cycles():
    graph = import_graph()
    cycles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert not cycles, "import cycles (each line: modules that import each other, directly or through the others):\n" \
        + "\n".join("  " + " <-> ".join(c) for c in cycles)


def test_a_cycle_is_found(tmp_path):
    """The check itself: two modules that import each other only inside functions are reported."""
    (tmp_path / "rlflow").mkdir()
    (tmp_path / "rlflow" / "a.py").write_text("def f():\n    from rlflow import b\n")
    (tmp_path / "rlflow" / "b.py").write_text("def g():\n    import rlflow.a\n")
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "c.py").write_text("from . import d\n")
    (tmp_path / "stages" / "d.py").write_text("")
    (tmp_path / "operators").mkdir()
    graph = import_graph(tmp_path)
    assert graph.has_edge("rlflow.stages.c", "rlflow.stages.d")
    assert sorted(next(c for c in nx.strongly_connected_components(graph) if len(c) > 1)) == ["rlflow.a", "rlflow.b"]
