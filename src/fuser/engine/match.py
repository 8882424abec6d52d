"""Structural pattern trees over the canonical view of a Dynamo graph.

A pattern is a small tree: ``Op("mul", V("h"), Op("rsqrt", ...))``. Matching walks the graph from a candidate
root node down through the canonical form (:func:`fuser.engine.canonical.canonical`), binding names:

    V("h")          any tensor-valued node; a name used twice must bind the same value (up to exact upcasts,
                    so ``x.float().pow(2)`` and ``x * rstd`` agree on ``x``)
    Input("x")      a tensor that is an input of the whole captured graph (a placeholder, not a nested body's):
                    computed before the graph began, e.g. in the graph before a graph break
    S("eps")        a Python number captured in the graph (never a literal copied from a dump), or a graph node
                    whose value is a number Dynamo made symbolic (see below)
    C("shape")      any other constant (a shape list, ``None``)
    literal         a plain Python value (``2``, ``(-1,)``, ``True``) must be equal
    Op(name, ...)   a canonical op; ``add``/``mul`` are tried in both operand orders
    OneOf(a, b)     alternatives, first match first
    OptCast(p, n)   ``p``, optionally wrapped in an explicit ``.to(dtype)``; binds ``n`` to the dtype or None

No-op casts (``.to(d)`` of a value already of dtype ``d``) are looked through wherever an ``Op`` is expected.

Symbolic scalars. When a Python float a model reads changes between calls (a second model with another
``rms_norm_eps`` or LoRA ``scaling``, in one process), Dynamo's automatic dynamic recompiles with it as a graph
input: a 0-d fp64 placeholder and ``item = placeholder.item()``, a node whose example value is a ``SymFloat``
(``zf0``), used where the literal was (``add(variance, item)``). ``S`` binds such a node (or any node computed
from it, ``1 / item``) like a literal; a check reads its number with :func:`scalar_hint` and hands the node to
the fused op with :func:`scalar_arg`, so the op takes it from the graph. A custom op's ``float`` argument cannot
stay symbolic through AOT autograd: torch's tensorify pass specialises it (a guard on the value) and restarts
Dynamo's analysis, whose new graph has the literal again; the ``eager`` inner compiler passes the run-time float.

Why not ``torch._inductor.pattern_matcher``: its ``CallFunction``/``CallMethod`` trees match one spelling and
one operand order per node, so every variant would need every permutation of methods, functions, operand
orders and no-op casts written out, and a failed match carries no reason we could show in ``fuser.explain``.
Reading nodes through one canonical view and trying commutative orders here keeps each variant a one-line tree.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fuser.engine.canonical import (
    COMMUTATIVE,
    canonical,
    is_noop_cast,
    is_shape_query,
    meta_value,
    strip_exact_upcast,
    tensor_meta,
)

Node = torch.fx.Node

# placeholder.meta key: the node of the enclosing graph that a nested body's input receives (set by the rewrite)
OUTER_VALUE = "fuser_outer_value"


class Pat:
    """Base of the pattern-tree nodes."""


@dataclass(frozen=True)
class _Named(Pat):
    """A leaf of the tree, bound by name (equal, hashed and printed as its own class)."""

    name: str


class V(_Named):
    """Any tensor-valued node."""


class Input(_Named):
    """A tensor input (placeholder) of the captured graph itself, not of a nested body."""


class S(_Named):
    """A Python number captured in the graph, or a graph node computing a scalar."""


class C(_Named):
    """Any constant that is not a graph node (a shape list, ``None``, a dtype)."""


@dataclass(frozen=True)
class Op(Pat):
    op: str
    args: tuple[Any, ...]

    def __init__(self, op: str, *args: Any) -> None:
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", args)


@dataclass(frozen=True)
class OneOf(Pat):
    alternatives: tuple[Any, ...]

    def __init__(self, *alternatives: Any) -> None:
        object.__setattr__(self, "alternatives", alternatives)


@dataclass(frozen=True)
class OptCast(Pat):
    inner: Any
    name: str


@dataclass
class Found:
    """One structural match: what the names bound to, and every graph node the tree covered (root first)."""

    root: Node
    bindings: dict[str, Any]
    nodes: list[Node]


def _same(a: Any, b: Any) -> bool:
    return strip_exact_upcast(a) is strip_exact_upcast(b)


def is_symbolic_scalar(value: Any) -> bool:
    """Whether ``value`` is a graph node computing a Python number Dynamo made symbolic (a SymFloat or SymInt)."""
    return isinstance(value, Node) and isinstance(meta_value(value), (torch.SymFloat, torch.SymInt))


def scalar_hint(value: Any) -> int | float | None:
    """The number an ``S`` binding stands for: a literal itself; for a symbolic scalar the value Dynamo traced
    with (its hint: the value of this compile's example inputs), or ``None`` when it has none (data-dependent)."""
    if not isinstance(value, Node):
        return value
    sym = meta_value(value)
    if not isinstance(sym, (torch.SymFloat, torch.SymInt)) or not sym.node.has_hint():
        return None
    hint = sym.node.hint
    return float(hint) if isinstance(sym, torch.SymFloat) else int(hint)


def scalar_arg(value: Any) -> float | Node:
    """A float argument of a fused op: a literal as ``float``, a symbolic scalar as its node (taken from the
    graph at run time)."""
    return value if is_symbolic_scalar(value) else float(value)


def same_scalar(a: Any, b: Any) -> bool:
    """Whether two ``S`` bindings are the same number for every input: equal literals, or symbolic scalars of one
    expression (the same node, or two ``item()`` calls of one input)."""
    if isinstance(a, Node) or isinstance(b, Node):
        if a is b:
            return True
        if not (is_symbolic_scalar(a) and is_symbolic_scalar(b)):
            return False
        return meta_value(a).node.expr == meta_value(b).node.expr
    return a == b


def _match(p: Any, value: Any, b: dict[str, Any], nodes: tuple[Node, ...]) -> Iterator[tuple[dict, tuple]]:
    if isinstance(p, V):
        if not isinstance(value, Node) or tensor_meta(value) is None:
            _fail(p, value, b, nodes)
        else:
            yield from _bind(p, value, b, nodes, _same)
    elif isinstance(p, Input):
        is_input = isinstance(value, Node) and value.op == "placeholder" and OUTER_VALUE not in value.meta
        if not is_input or tensor_meta(value) is None:
            _fail(p, value, b, nodes)
        else:
            yield from _bind(p, value, b, nodes, _same)
    elif isinstance(p, S):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or is_symbolic_scalar(value)):
            _fail(p, value, b, nodes)
        else:
            yield from _bind(p, value, b, nodes, same_scalar)
    elif isinstance(p, C):
        if not isinstance(value, Node):
            yield {**b, p.name: value}, nodes
        else:
            _fail(p, value, b, nodes)
    elif isinstance(p, OneOf):
        for alt in p.alternatives:
            yield from _match(alt, value, b, nodes)
    elif isinstance(p, OptCast):
        c = canonical(value)
        if c is not None and c.op == "to":
            yield from _match(p.inner, c.args[0], {**b, p.name: c.args[1]}, nodes + (value,))
        yield from _match(p.inner, value, {**b, p.name: None}, nodes)
    elif isinstance(p, Op):
        while p.op != "to" and is_noop_cast(value):
            nodes = nodes + (value,)
            value = canonical(value).args[0]
        c = canonical(value)
        if c is None or c.op != p.op or len(c.args) != len(p.args):
            _fail(p, value, b, nodes)
            return
        orders = [c.args]
        if p.op in COMMUTATIVE:
            orders.append(tuple(reversed(c.args)))
        for args in orders:
            yield from _match_all(p.args, args, b, nodes + (value,))
    elif not isinstance(value, Node) and p == value:
        yield b, nodes
    else:
        _fail(p, value, b, nodes)


def _match_all(ps: tuple, values: tuple, b: dict, nodes: tuple) -> Iterator[tuple[dict, tuple]]:
    if not ps:
        yield b, nodes
        return
    for b1, n1 in _match(ps[0], values[0], b, nodes):
        yield from _match_all(ps[1:], values[1:], b1, n1)


def match_tree(pattern: Any, root: Node) -> Iterator[Found]:
    """Every way ``pattern`` matches with ``root`` as its outermost node."""
    for bindings, nodes in _match(pattern, root, {}, ()):
        if nodes and nodes[0] is root:
            yield Found(root, bindings, list(dict.fromkeys(nodes)))


@dataclass(frozen=True)
class Miss:
    """Where a pattern tree stopped matching: the graph nodes it had matched (outermost first), what the tree
    expected next and what the graph has there, in words (for ``fuser.explain``)."""

    nodes: tuple[Node, ...]
    expected: str
    found: str


# set by closest_miss while it runs a match: every point where matching stopped, as (nodes, pattern, value, bindings)
_RECORDING: list[tuple[tuple[Node, ...], Any, Any, dict[str, Any]]] | None = None


def _bind(
    p: _Named, value: Any, b: dict[str, Any], nodes: tuple[Node, ...], same: Callable[[Any, Any], bool]
) -> Iterator[tuple[dict, tuple]]:
    """``p``'s name bound to ``value``; a name bound before must bind the ``same`` value again."""
    if p.name not in b:
        yield {**b, p.name: value}, nodes
    elif same(b[p.name], value):
        yield b, nodes
    else:
        _fail(p, value, b, nodes)


def _fail(p: Any, value: Any, b: dict[str, Any], nodes: tuple[Node, ...]) -> None:
    if _RECORDING is not None:
        _RECORDING.append((nodes, p, value, b))


def closest_miss(pattern: Any, root: Node, anchor: Node | None = None) -> Miss | None:
    """Why ``pattern`` does not match with ``root`` as its outermost node: the point where the most graph nodes
    had matched (preferring paths through ``anchor``), or ``None`` when it does match."""
    global _RECORDING
    recorded: list = []
    _RECORDING = recorded
    try:
        matched = any(nodes and nodes[0] is root for _, nodes in _match(pattern, root, {}, ()))
    finally:
        _RECORDING = None
    if matched or not recorded:
        return None
    nodes, p, value, b = max(recorded, key=lambda r: (anchor is None or anchor in r[0], len(set(r[0]))))
    return Miss(nodes, _expected(p, b), describe_value(value))


def _expected(p: Any, b: dict[str, Any]) -> str:
    if isinstance(p, S):
        if p.name in b:
            return f"the same number ({p.name}) as before, {describe_value(b[p.name])}"
        return f"a number ({p.name})"
    if isinstance(p, V):
        if p.name in b:
            return f"the same tensor ({p.name}) as before, {describe_value(b[p.name])}"
        return f"a tensor ({p.name})"
    if isinstance(p, Input):
        return f"an input of the graph ({p.name})"
    if isinstance(p, C):
        return f"a constant ({p.name})"
    if isinstance(p, Op):
        return f"a `{p.op}` with {len(p.args)} operand{'s' if len(p.args) != 1 else ''}"
    return repr(p)


def _readable_source(node: Node) -> str:
    """A graph input's Python source in dotted form (``model.layers.0.input_layernorm.variance_epsilon``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", "") or "")
    parts = [p for p in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\d+", name or node.name) if p not in _SOURCE_NOISE]
    if parts and parts[0] == "0" and "args" in (name or ""):
        parts = parts[1:]
    return ".".join(parts) or node.name


_SOURCE_NOISE = ("L", "G", "self", "args", "kwargs", "_modules", "__dict__", "_parameters", "_buffers", "modules")


def describe_value(value: Any) -> str:
    """A graph value in a user's words: ``the input `norm.eps` (a 0-d float32 tensor)``, ``a `rsqrt` (a 2×16×1
    float32 tensor)``, ``the constant 2``."""
    if not isinstance(value, Node):
        return f"the constant {value!r}"
    t = tensor_meta(value)
    if t is not None:
        shape = "×".join(str(d) for d in t.shape) if t.dim() else "0-d"
        kind = f"a {shape} {str(t.dtype).removeprefix('torch.')} tensor"
    elif is_symbolic_scalar(value):
        kind = "a number that changes between calls"
    else:
        kind = "a non-tensor value"
    if value.op == "placeholder":
        return f"the input `{_readable_source(value)}` ({kind})"
    c = canonical(value)
    if c is not None:
        return f"a `{c.op}` ({kind})"
    target = value.target if value.op == "call_method" else getattr(value.target, "__name__", str(value.target))
    return f"a call of `{target}` ({kind})"


def escaping_use(found: Found) -> tuple[Node, Node] | None:
    """An interior node of the match that something outside the match also uses, with that user. A query of its
    shape is no such use where its result is unused (:func:`unused_shape_query`) or :func:`shape_source` finds a
    node to read that shape from after the rewrite."""
    inside = set(found.nodes)
    for node in found.nodes[1:]:
        for user in node.users:
            if user in inside or movable_shape_query(found, node, user):
                continue
            return node, user
    return None


def movable_shape_query(found: Found, node: Node, user: Node) -> bool:
    """Whether ``user``, outside the match, queries the shape of ``node``, inside it, in a way the rewrite can keep:
    unused, or answered by :func:`shape_source`."""
    return is_shape_query(user) and (unused_shape_query(user) or shape_source(found, node, user) is not None)


def unused_shape_query(query: Node) -> bool:
    """Whether nothing reads the result of the shape query ``query``, or only indexing whose result nothing reads
    (``size = x.size(); getitem = size[0]`` left dead in a checkpointed layer's graph)."""
    return all(user.target is operator.getitem and not user.users for user in query.users)


def shape_source(found: Found, node: Node, query: Node) -> Node | None:
    """A node that survives the rewrite, has statically the same shape as ``node`` (an interior node of the match)
    and is computed before ``query`` (a shape query of ``node``): an input of the match that ``node`` is computed
    from, or else the match's root (whose fused value has the root's shape) where ``query`` comes after it. The
    rewrite points ``query`` there; ``None`` when there is none (the match then declines)."""
    from fuser._compat import statically_same_shape

    shape = tensor_meta(node).shape
    inside = set(found.nodes)
    seen: set[Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in inside:
            stack.extend(value.all_input_nodes)
            continue
        t = tensor_meta(value)
        if t is not None and statically_same_shape(t.shape, shape):
            return value
    root = tensor_meta(found.root)
    if root is not None and found.root < query and statically_same_shape(root.shape, shape):
        return found.root
    return None
