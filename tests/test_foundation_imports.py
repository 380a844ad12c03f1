"""No two modules of parity import each other, directly or round a circle, counting the imports inside functions
too (a lazy import hides a circle from Python's loader, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "platform" / "parity"


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = ["parity", *p.relative_to(PKG).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            # a module's own parent packages run before it anyway: not an edge of a circle
            graph[m] |= {n for n in names if n in mods and n != m and not m.startswith(n + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_parity() -> None:
    graph = import_graph()
    assert len(graph) > 80 and "parity.rollout.cuda_decode" in graph["parity.rollout.torch_engine"]
    assert circles(graph) == []


def test_the_check_sees_a_lazy_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
