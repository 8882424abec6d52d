"""No import cycles among fuser's runtime imports: the module-level imports of every module under ``src/fuser/``
(imports inside functions, made when called, and ``if TYPE_CHECKING:`` blocks are not runtime imports at import
time). ``from package import name`` counts as importing ``package.name`` where that is a module, else the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fuser"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    out = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            out += _statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            out += _statements(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        else:
            out.append(node)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each fuser module -> the fuser modules its module-level code imports."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        imported: set[str] = set()
        for node in _statements(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
                imported |= subs | ({source} if len(subs) < len(node.names) else set())
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``graph`` meets (each as the path that closes it)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return found


def test_the_cycle_walk_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_absolute_and_from_imports():
    graph = import_graph()
    assert "fuser.engine.rewrite" in graph and "fuser.engine.match" in graph["fuser.engine.rewrite"]
    assert "fuser._compat" in graph["fuser.dynamo_backend"]


def test_fuser_has_no_import_cycles():
    assert cycles(import_graph()) == []
