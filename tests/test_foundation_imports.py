"""The layers of parity hold, counting every import, the ones inside functions too (a lazy import hides a circle
from Python's loader, not from a reader):

- no two modules import each other, directly or round a circle;
- no two packages do (parity.X for every folder X; a module at the top, such as parity.errors, counts as its own);
- an import of another package inside a function is there only to defer a heavy dependency: its module is in
  LAZY below, with the reason, and importing that module really imports the dependency (checked from the sources).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "platform" / "parity"

# module imported inside a function -> (what importing it pulls in, why the importer must not pull that in)
LAZY = {
    "parity.config": ("omegaconf", "`python -m parity <command> --help` answers without the config stack "
                                   "(tests/test_cli_help.py)"),
    "parity.algorithms": ("torch", "parity.config stays importable without torch: the dashboard, the flows and "
                                   "the CLI read configs before any work needs it"),
    "parity.algorithms.corrections": ("torch", "as parity.algorithms: the config builds the correction stack only "
                                               "when it validates, after the keys and values are checked"),
    "parity.precision.config": ("torch", "the dashboard names runs by their precision (parity.tracking.naming) "
                                         "without importing torch"),
    "parity.precision.int8_triton": ("triton", "the CUDA decode path's INT8 kernels, only where that path runs"),
    "parity.precision.kv_packed": ("triton", "the packed KV cache's kernels, only where the CUDA decode path runs"),
    "parity.core.device": ("torch", "parity.config.validate checks keys, types and paths before torch loads: a bad "
                                    "command line is answered in under a second (tests/test_cli_errors.py)"),
    "parity.study.runs": ("torch", "`python -m parity study --help` (the command's parser) answers without it"),
    "parity.rollout": ("torch", "parity.study.cohorts reads the runs' rollout configs only when a study runs with "
                                "--cohorts, so `python -m parity study --help` answers without torch"),
}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        if "migrations" in p.parts:  # Alembic's scripts, run by Alembic
            continue
        parts = ["parity", *p.relative_to(PKG).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(tree: ast.AST, mods: dict[str, Path], in_function: bool = False):
    """(imported parity module, inside a function?) of every import statement under `tree`; `from a import b`
    names the module a.b where b is one, else a."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, in_function
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "parity imports itself by absolute names"
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            for name in subs or [node.module]:
                yield name, in_function
        yield from imports(node, mods, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def parity_imports(mods: dict[str, Path]) -> dict[str, list[tuple[str, bool]]]:
    out = {}
    for m, p in mods.items():
        found = [(n, f) for n, f in imports(ast.parse(p.read_text()), mods) if n in mods]
        # a module's own parent packages run before it anyway: not an edge of a circle
        out[m] = [(n, f) for n, f in found if n != m and not m.startswith(n + ".")]
    return out


def import_graph() -> dict[str, set[str]]:
    return {m: {n for n, _ in edges} for m, edges in parity_imports(modules()).items()}


def package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        graph.setdefault(package(m), set()).update(package(t) for t in targets if package(t) != package(m))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def loaded_on_import(module: str, mods: dict[str, Path]) -> set[str]:
    """Top-level names of every third-party module that importing `module` imports: its module-level imports and
    those of the parity modules they import, transitively (imports inside functions are not run on import)."""
    seen, todo, third = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)]
        todo += [p for p in parents if p in mods]
        for name, in_function in imports(ast.parse(mods[m].read_text()), mods):
            if in_function:
                continue
            if name in mods:
                todo.append(name)
            elif not name.startswith("parity"):
                third.add(name.split(".")[0])
    return third


def test_no_import_circles_in_parity() -> None:
    graph = import_graph()
    assert len(graph) > 80 and "parity.rollout.cuda_decode" in graph["parity.rollout.torch_engine"]
    assert circles(graph) == []


def test_no_two_packages_import_each_other() -> None:
    graph = package_graph()
    assert {"training", "rollout", "distributed", "config", "core"} <= set(graph)
    assert "rollout" in graph["training"] and "training" in graph["distributed"]
    assert circles(graph) == []


def test_imports_inside_functions_only_defer_heavy_dependencies() -> None:
    mods = modules()
    lazy = sorted({(m, n) for m, edges in parity_imports(mods).items() for n, in_function in edges
                   if in_function and package(n) != package(m)})
    assert lazy, "the walk finds the lazy imports (parity.__main__ defers parity.config)"
    assert [(m, n) for m, n in lazy if n not in LAZY] == []
    for target, (dependency, reason) in LAZY.items():
        assert reason and dependency in loaded_on_import(target, mods), (target, dependency)
    assert set(LAZY) == {n for _, n in lazy}, "an entry nothing imports lazily any more"


def test_the_check_sees_a_lazy_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("import os\ndef f():\n    from parity.training.loop import train\n")
    assert list(imports(tree, {"parity.training.loop": PKG})) == [("os", False), ("parity.training.loop", True)]
