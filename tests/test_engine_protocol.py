"""The engine owns the pattern protocol: it imports nothing from ``fuser.patterns``, ``fuser.kernels`` or the
Inductor passes (``fuser.inductor``), which import no pattern; no module of ``fuser`` takes part in an import cycle;
and a pattern declared outside ``src/fuser/`` plugs in through ``register_pattern``."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fuser
from fuser.engine.match import Op, V
from fuser.engine.protocol import PATTERNS, Decline, Pattern, Replacement, Variant, register_pattern

PACKAGE = Path(fuser.__file__).parent
OUTSIDE_THE_ENGINE = ("fuser.patterns", "fuser.kernels", "fuser.inductor", "fuser.refinements")


def _modules() -> dict[str, Path]:
    """Every module of ``src/fuser/`` by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    """The modules an import statement names, wherever it runs (in a function too), except under
    ``if TYPE_CHECKING:``, which never runs."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, str | None]] = []  # (module, name imported from it or None)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(alias.name, None) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        self.found += [(base, alias.name) for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module → the ``fuser`` modules it imports: ``from a import b`` names ``a.b`` where that is a module."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        targets = set()
        for module, item in visitor.found:
            target = f"{module}.{item}" if item is not None and f"{module}.{item}" in modules else module
            while target and target not in modules:  # `import fuser.kernels.rope.x`: the deepest module named
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def _part(module: str) -> str:
    """The part of fuser a module belongs to: its subpackage (``fuser.engine``), or the top-level module itself."""
    for package in ("fuser.engine", "fuser.patterns", "fuser.refinements", "fuser.inductor", "fuser.kernels"):
        if module == package or module.startswith(package + "."):
            return package
    return module


def test_no_module_of_fuser_is_in_an_import_cycle():
    graph = import_graph()
    assert "fuser.engine.rewrite" in graph and "fuser.patterns.rope" in graph["fuser.patterns"]
    cycle = find_cycle(graph)
    assert cycle is None, " → ".join(cycle)


def test_no_part_of_fuser_imports_back_the_parts_that_import_it():
    """The same with each subpackage taken as one node: the engine imported the patterns' protocol while the
    patterns imported the engine, a cycle no single pair of modules showed."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(_part(module), set()).update(_part(t) for t in targets if _part(t) != _part(module))
    cycle = find_cycle(graph)
    assert cycle is None, " → ".join(cycle)
    assert "fuser.engine" in graph["fuser.patterns"]


def test_the_engine_names_no_pattern_or_kernel_module():
    graph = import_graph()
    engine = {m: targets for m, targets in graph.items() if _part(m) == "fuser.engine"}
    assert "fuser.engine.protocol" in engine
    for module, targets in engine.items():
        assert not [t for t in targets if t.startswith(OUTSIDE_THE_ENGINE)], module
    for path in (PACKAGE / "engine").rglob("*.py"):  # every import statement, under TYPE_CHECKING too
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                named = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            assert not [n for n in named if n.startswith(OUTSIDE_THE_ENGINE)], f"{path}:{node.lineno}"


@pytest.mark.parametrize(
    ("part", "one_of_them", "not_imported"),
    [
        ("fuser.inductor", "fuser.inductor.inline_ops", ("fuser.patterns", "fuser.refinements")),
        ("fuser.refinements", "fuser.refinements.lora_sums", ("fuser.patterns", "fuser.inductor")),
    ],
)
def test_passes_and_refinements_name_no_pattern_module(part, one_of_them, not_imported):
    """A post-grad pass or a refinement works on fused ops' calls, whichever pattern (or user) put them in the graph:
    a pattern imports its passes and refinements (and the helpers its check shares with them), never the other way
    round; passes and refinements do not import each other."""
    graph = import_graph()
    modules = {m: targets for m, targets in graph.items() if _part(m) == part}
    assert one_of_them in modules
    for module, targets in modules.items():
        assert not [t for t in targets if _part(t) in not_imported], module


def test_refinements_run_in_registration_order_and_after_what_they_declare():
    """The engine orders the refinements by their ``after``; for the patterns fuser ships that is the order they
    are registered in, the order they always ran in, so each graph comes out as it did."""
    from fuser.engine.protocol import Refinement, refinement_order

    shipped = [p for p in PATTERNS.values() if p.check.__module__.startswith("fuser.patterns.")]
    order = [p.name for p in refinement_order(shipped)]
    assert order == [p.name for p in shipped if p.after_apply is not None]
    assert order == ["rms_norm_linear", "rms_norm", "swiglu", "geglu", "reglu", "glu", "upcast_linear", "lora_sum"]
    for pattern in shipped:
        if pattern.after_apply is not None:
            assert isinstance(pattern.after_apply, Refinement), pattern.name
            assert all(order.index(name) < order.index(pattern.name) for name in pattern.after_apply.after)
    # with a pattern left out, the others keep their order
    assert [p.name for p in refinement_order([p for p in shipped if p.name != "rms_norm"])] == [
        n for n in order if n != "rms_norm"
    ]


def test_refinements_run_after_what_they_declare_whatever_the_registration_order():
    from fuser.engine.protocol import Refinement, refinement_order

    def pattern(name, after=()):
        return Pattern(name, [], lambda *a: None, after_apply=Refinement(lambda graph, config: 0, after=after))

    first, second = pattern("first", after=("second",)), pattern("second")
    assert [p.name for p in refinement_order([first, second])] == ["second", "first"]
    cycle = pattern("second", after=("first",))
    with pytest.raises(ValueError, match="cycle"):
        refinement_order([first, cycle])
    # registering the pattern that closes a cycle is refused, and leaves the registry as it was
    register_pattern(pattern("loops_back", after=("loops_back_too",)))
    try:
        with pytest.raises(ValueError, match="cycle"):
            register_pattern(pattern("loops_back_too", after=("loops_back",)))
        assert "loops_back_too" not in PATTERNS
    finally:
        del PATTERNS["loops_back"]


def test_the_engine_imports_and_rewrites_alone_in_a_fresh_process():
    """Every engine module imported, and a rewrite run, with ``src/fuser/__init__.py`` (which imports the patterns and
    kernels on purpose) left out: no ``fuser.patterns`` or ``fuser.kernels`` module gets loaded."""
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys, types
        import torch
        package = types.ModuleType("fuser")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["fuser"] = package
        import fuser.engine
        for info in pkgutil.iter_modules(fuser.engine.__path__):
            importlib.import_module("fuser.engine." + info.name)
        from fuser.engine.match import Op, V
        from fuser.engine.protocol import Pattern, Replacement, Variant
        from fuser.engine.rewrite import rewrite

        def f(x):
            return torch.neg(torch.neg(x)) + 1

        gm = torch.fx.symbolic_trace(f)
        for node in gm.graph.nodes:  # the metadata Dynamo would have recorded
            node.meta["example_value"] = torch.empty(3)
        double_neg = Pattern(
            "double_neg",
            [Variant("neg of neg", Op("neg", Op("neg", V("x"))))],
            lambda found, variant, config: Replacement(torch.clone, (found.bindings["x"],)),
        )
        new, result = rewrite(gm, [double_neg], None)
        assert result.counts == {{"double_neg": 1}}, result.counts
        assert torch.equal(new(torch.arange(3.0)), torch.arange(3.0) + 1)
        print(sorted(m for m in sys.modules if m.startswith({OUTSIDE_THE_ENGINE!r})))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


# --- a pattern from outside src/fuser/ ------------------------------------------------------------------------------


def double_negation(x):
    return torch.neg(-x) * 2


DOUBLE_NEG = Pattern(
    "double_neg",
    [Variant("neg of neg", Op("neg", Op("neg", V("x"))))],
    lambda found, variant, config: Replacement(torch.ops.aten.clone.default, (found.bindings["x"],)),
    default=False,
)


@pytest.fixture
def registered():
    register_pattern(DOUBLE_NEG)
    yield DOUBLE_NEG
    del PATTERNS[DOUBLE_NEG.name]


def test_a_registered_pattern_is_matched_and_compiled_by_name(registered):
    assert "double_neg" not in fuser.DEFAULT_PATTERNS and not fuser.FuserConfig().enabled("double_neg")
    x = torch.randn(4)
    config = fuser.FuserConfig(patterns=("double_neg",), strict=True, inner_compiler="aot_eager")
    report = fuser.explain(double_negation, x, config=config)
    assert report.counts == {"double_neg": 1} and [m.variant for m in report.matches] == ["neg of neg"]
    out = torch.compile(double_negation, backend=fuser.backend(config))(x)
    assert fuser.backend(config).counts == {"double_neg": 1}
    torch.testing.assert_close(out, double_negation(x))


def test_register_pattern_refuses_a_taken_name(registered):
    register_pattern(DOUBLE_NEG)  # the same pattern again: nothing changes
    assert list(PATTERNS).count("double_neg") == 1
    with pytest.raises(ValueError, match="another pattern is registered as 'rms_norm'"):
        register_pattern(Pattern("rms_norm", [], DOUBLE_NEG.check))
    with pytest.raises(TypeError, match="takes a Pattern"):
        register_pattern("double_neg")


def _never(found, variant, config):
    raise Decline("a form this toy declines")


NEG_OF_SIGMOID = Pattern(
    "neg_of_sigmoid",
    [
        Variant("real", Op("neg", Op("sigmoid", V("x")))),
        # matches more of the code below than "real" does, but is declared only to be declined
        Variant("declared", Op("mul", Op("neg", Op("tanh", V("x"))), V("y")), declines=True),
    ],
    _never,
    anchors=frozenset({"neg"}),
    default=False,
)


def test_a_form_declared_to_decline_is_never_named_the_closest():
    register_pattern(NEG_OF_SIGMOID)
    try:
        config = fuser.FuserConfig(patterns=("neg_of_sigmoid",))
        report = fuser.explain(lambda x, y: -(x * 2) * y, torch.randn(4), torch.randn(4), config=config)
    finally:
        del PATTERNS[NEG_OF_SIGMOID.name]
    (miss,) = report.near_misses
    assert "the closest, the 'real' form" in miss.reason, miss.reason
