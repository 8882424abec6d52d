"""Structural pattern trees over the canonical view of a Dynamo graph.

A pattern is a small tree: ``Op("mul", V("h"), Op("rsqrt", ...))``. Matching walks the graph from a candidate
root node down through the canonical form (:func:`fuser.engine.canonical.canonical`), binding names:

    V("h")          any tensor-valued node; a name used twice must bind the same value (up to exact upcasts,
                    so ``x.float().pow(2)`` and ``x * rstd`` agree on ``x``)
    S("eps")        a Python number captured in the graph (never a literal copied from a dump)
    C("shape")      any other constant (a shape list, ``None``)
    literal         a plain Python value (``2``, ``(-1,)``, ``True``) must be equal
    Op(name, ...)   a canonical op; ``add``/``mul`` are tried in both operand orders
    OneOf(a, b)     alternatives, first match first
    OptCast(p, n)   ``p``, optionally wrapped in an explicit ``.to(dtype)``; binds ``n`` to the dtype or None

No-op casts (``.to(d)`` of a value already of dtype ``d``) are looked through wherever an ``Op`` is expected.

Why not ``torch._inductor.pattern_matcher``: its ``CallFunction``/``CallMethod`` trees match one spelling and
one operand order per node, so every variant would need every permutation of methods, functions, operand
orders and no-op casts written out, and a failed match carries no reason we could show in ``fuser.explain``.
Reading nodes through one canonical view and trying commutative orders here keeps each variant a one-line tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx

from fuser.engine.canonical import COMMUTATIVE, canonical, is_noop_cast, strip_exact_upcast, tensor_meta

Node = torch.fx.Node

# placeholder.meta key: the node of the enclosing graph that a nested body's input receives (set by the rewrite)
OUTER_VALUE = "fuser_outer_value"


class Pat:
    """Base of the pattern-tree nodes."""


@dataclass(frozen=True)
class V(Pat):
    name: str


@dataclass(frozen=True)
class S(Pat):
    name: str


@dataclass(frozen=True)
class C(Pat):
    """Any constant that is not a graph node (a shape list, ``None``, a dtype); bound by name."""

    name: str


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


def _match(p: Any, value: Any, b: dict[str, Any], nodes: tuple[Node, ...]) -> Iterator[tuple[dict, tuple]]:
    if isinstance(p, V):
        if not isinstance(value, Node) or tensor_meta(value) is None:
            return
        if p.name in b:
            if _same(b[p.name], value):
                yield b, nodes
        else:
            yield {**b, p.name: value}, nodes
    elif isinstance(p, S):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if p.name in b:
            if b[p.name] == value:
                yield b, nodes
        else:
            yield {**b, p.name: value}, nodes
    elif isinstance(p, C):
        if not isinstance(value, Node):
            yield {**b, p.name: value}, nodes
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
            return
        orders = [c.args]
        if p.op in COMMUTATIVE:
            orders.append(tuple(reversed(c.args)))
        for args in orders:
            yield from _match_all(p.args, args, b, nodes + (value,))
    elif isinstance(value, Node):
        return
    elif p == value:
        yield b, nodes


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


def escaping_use(found: Found) -> tuple[Node, Node] | None:
    """An interior node of the match that something outside the match also uses, with that user."""
    inside = set(found.nodes)
    for node in found.nodes[1:]:
        for user in node.users:
            if user not in inside:
                return node, user
    return None
