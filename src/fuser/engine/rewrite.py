"""Find the blocks in a Dynamo graph and replace each with one fused-op call.

Two phases, so ``fuser.explain`` can run the first alone:

1. :func:`find_matches` walks every graph (the root and the nested subgraphs of higher-order ops such as
   activation checkpointing) from the last node to the first, so the outermost spelling of a block is tried
   before its inner parts; each node is claimed by at most one match. A structural match whose interior values
   are used outside it, or whose ``check`` declines, is recorded as a :class:`NearMiss` with the reason.
2. :func:`apply_matches` inserts the fused op before each match's root, hands the root's users over to it,
   makes the graph return ``None`` for interior values the op never computes (logits a training graph returns),
   and erases the interior nodes that are now dead.

:func:`rewrite` does both on a structural copy of the graph module, so a failure half-way leaves the user's
graph untouched and the backend can compile it unrewritten.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx

from fuser.engine.canonical import canonical, code_at, is_shape_query, module_path, source_line
from fuser.engine.function_linear import erase_dead_function_calls
from fuser.engine.match import (
    OUTER_VALUE,
    Found,
    closest_miss,
    escaping_use,
    match_tree,
    shape_source,
    unused_shape_query,
)
from fuser.engine.protocol import ArgExpr, Decline, NotApplicable, Pattern, Replacement, Variant, refinement_order

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")

Node = torch.fx.Node


@dataclass
class Match:
    pattern: str
    variant: str
    found: Found
    replacement: Replacement
    graph_name: str

    @property
    def where(self) -> str:
        return source_line(self.found.root)

    @property
    def module(self) -> str:
        """The submodule the block belongs to: the root's, or (a loss computed in the model's own forward, outside
        any submodule) the nearest covered node's (``lm_head`` for the linear feeding the loss)."""
        return first_module_path(self.found.nodes)


@dataclass
class NearMiss:
    """A block that was not fused: ``node`` is its root (a declined match) or the anchor op no form covered;
    ``reason`` says why in words; ``nodes`` are the graph nodes the declined match covered, root first.

    ``applicable`` is False where the pattern could not apply to this model (its check raised
    :class:`~fuser.engine.protocol.NotApplicable`: no LoRA adapter on a half-precision base, an input already
    fp32): nothing was missed, and the report lists it only when verbose. True for a missed fusion.
    """

    pattern: str
    node: Node
    reason: str
    graph_name: str
    nodes: tuple[Node, ...] = ()
    applicable: bool = True

    @property
    def where(self) -> str:
        return source_line(self.node)

    @property
    def module(self) -> str:
        return first_module_path((self.node, *self.nodes))


def first_module_path(nodes: Iterable[Node]) -> str:
    """The module path of the first of ``nodes`` that ran inside a submodule, or ``""``."""
    for node in nodes:
        path = module_path(node)
        if path:
            return path
    return ""


@dataclass
class RewriteResult:
    matches: list[Match] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    # pattern name → fused ops that its ``after_apply`` refined (counted in ``counts`` as the pattern's own)
    refined: dict[str, int] = field(default_factory=dict)
    # the graph is Dynamo's recompile of code it compiled before (new shapes, failed guards), not a graph break's
    # continuation: set by the backend, told apart in ``fuser.report``
    recompile: bool = False
    # for a recompile, Dynamo's reason: the guard of the earlier compile that failed (None where torch gives none)
    recompile_reason: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        return count_by_pattern(self.matches)


def count_by_pattern(matches: Iterable[Match]) -> dict[str, int]:
    """Pattern name → fused ops emitted (a combined q+k RoPE match is one op; the ops a replacement's arguments
    emit, ``Replacement.emits_also``, count under their own patterns)."""
    counts: Counter[str] = Counter()
    for m in matches:
        counts[m.pattern] += 1
        counts.update(m.replacement.emits_also)
    return dict(counts)


def subgraph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """``(qualified name, module)`` of the graph module and every graph module nested in it, outermost first."""
    out = [("", gm)]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                out += [(f"{node.target}.{n}".rstrip("."), m) for n, m in subgraph_modules(sub)]
    return out


def _find_in_graph(
    graph: torch.fx.Graph, patterns: list[Pattern], config: FuserConfig, graph_name: str, result: RewriteResult
) -> None:
    claimed: set[Node] = set()
    anchors: list[tuple[Pattern, Node]] = []
    calls = [(n, canonical(n)) for n in reversed(graph.nodes) if n.op in ("call_function", "call_method")]
    # the patterns that run first see the whole graph before the others (their matches are claimed first)
    for group in ([p for p in patterns if p.runs_first], [p for p in patterns if not p.runs_first]):
        if not group:
            continue
        for node, canon in calls:
            for pattern in group:
                if canon is not None and canon.op in pattern.anchors:
                    anchors.append((pattern, node))
            if node in claimed:
                continue
            accepted = _try_patterns(node, group, config, claimed, graph_name, result)
            if accepted is not None:
                claimed.update(accepted.found.nodes)
    for pattern in patterns:
        if pattern.combine is not None:
            mine = [m for m in result.matches if m.graph_name == graph_name and m.pattern == pattern.name]
            if mine:
                others = [m for m in result.matches if not (m.graph_name == graph_name and m.pattern == pattern.name)]
                result.matches = others + pattern.combine(mine)
    covered = {n for m in result.matches if m.graph_name == graph_name for n in m.found.nodes}
    # an anchor inside a declined match is explained by that decline's reason
    explained = {n for nm in result.near_misses for n in (nm.node, *nm.nodes)}
    for pattern, node in anchors:
        if node not in covered and node not in explained:
            reason = _unmatched_anchor_reason(pattern, node, covered | claimed)
            result.near_misses.append(NearMiss(pattern.name, node, reason, graph_name))
            log.debug("fuser: %s declined at %s: %s", pattern.name, source_line(node), reason)


def _enclosing_candidates(anchor: Node, depth: int = 6, limit: int = 40) -> list[Node]:
    """``anchor`` and the nodes that use it, transitively up to ``depth`` steps: the roots a block containing it
    could have."""
    out, frontier = [anchor], [anchor]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u.op in ("call_function", "call_method") and u not in out]
        frontier = list(dict.fromkeys(frontier))
        out += frontier
        if len(out) >= limit:
            break
    return out[:limit]


def _unmatched_anchor_reason(pattern: Pattern, anchor: Node, taken: set[Node]) -> str:
    """Why no form of ``pattern`` covers ``anchor``, in words: the form and root that matched the most of the code
    around it, what that form needs there and what the code has instead."""
    what = canonical(anchor).op if canonical(anchor) is not None else str(anchor.target)
    best = None
    for root in _enclosing_candidates(anchor):
        for variant in [v for v in pattern.variants if not v.declines]:
            miss = closest_miss(variant.tree, root, anchor)
            if miss is None:
                overlap = any(n in taken for f in match_tree(variant.tree, root) for n in f.nodes)
                why = "it overlaps a block another pattern fused" if overlap else "that block was not fused"
                return f"this `{what}` is part of a {pattern.name} block ({variant.name} form), but {why}"
            score = (anchor in miss.nodes, len(set(miss.nodes)))
            if best is None or score > best[0]:
                best = (score, variant, miss)
    text = f"this `{what}` looked like part of {pattern.name}, but the code around it is none of its known forms"
    if best is None:
        return text
    _, variant, miss = best
    return f"{text}: the closest, the {variant.name!r} form, needs {miss.expected} where the code has {miss.found}"


def _try_patterns(
    node: Node, patterns: list[Pattern], config: FuserConfig, claimed: set[Node], graph_name: str, result: RewriteResult
) -> Match | None:
    for pattern in patterns:
        reasons: set[str] = set()  # of this pattern's declines at this node
        # declines of one form are near-misses only if no other form of the pattern is accepted at this node
        pending: list[NearMiss] = []
        for variant in pattern.variants:
            for found in match_tree(variant.tree, node):
                if any(n in claimed for n in found.nodes):
                    continue
                escape = None if pattern.judges_outside_uses else escaping_use(found)
                try:
                    if escape is not None:
                        _raise_if_not_applicable(pattern, found, variant, config)
                        inner, user = escape
                        if is_shape_query(user):
                            raise Decline(
                                f"`{user.name}` reads the shape of intermediate `{inner.name}`, and no input of the "
                                "block has that shape to read it from once the block is fused"
                            )
                        raise Decline(f"intermediate `{inner.name}` is also used by {code_at(user)}, outside the block")
                    replacement = pattern.check(found, variant, config)
                    if replacement.dropped_outputs and graph_name:
                        # a nested subgraph's outputs are its higher-order op's: they must keep their values
                        raise Decline(f"the nested graph `{graph_name}` returns values the fused op does not compute")
                except Decline as why:
                    # optional parts (a no-op cast, a whole-tensor slice) give one block several structural
                    # matches that decline for the same reason: report it once, also when the other match was
                    # rooted at a no-op cast of this node (tried first: the walk goes from the last node back)
                    covered = set(found.nodes)
                    same = any(
                        nm.pattern == pattern.name and nm.reason == str(why) and covered <= set(nm.nodes)
                        for nm in (*result.near_misses, *pending)
                    )
                    if str(why) not in reasons and not same:
                        reasons.add(str(why))
                        applicable = not isinstance(why, NotApplicable)
                        pending.append(
                            NearMiss(pattern.name, node, str(why), graph_name, tuple(found.nodes), applicable)
                        )
                    continue
                match = Match(pattern.name, replacement.variant or variant.name, found, replacement, graph_name)
                result.matches.append(match)
                log.debug("fuser: %s (%s) at %s", pattern.name, match.variant, match.where)
                return match
        for nm in pending:
            result.near_misses.append(nm)
            verb = "declined" if nm.applicable else "does not apply"
            log.debug("fuser: %s %s at %s: %s", pattern.name, verb, source_line(node), nm.reason)
    return None


def _raise_if_not_applicable(pattern: Pattern, found: Found, variant: Variant, config: FuserConfig) -> None:
    """Raise ``pattern``'s :class:`NotApplicable` for ``found`` if its check gives one; otherwise return.

    A match whose intermediate values are used outside it is declined for that use, before its check runs. Where
    the pattern could not apply to it anyway (an upcast linear of an input that is fp32 already), that is the
    reason to give: the use outside is no missed fusion. Any other decline of the check is left to the use outside,
    which the user can change."""
    try:
        pattern.check(found, variant, config)
    except NotApplicable:
        raise
    except Decline:
        pass


# higher-order ops whose body receives the operands unchanged: ``op(body, *operands)``
_PASS_THROUGH_HOPS = ("tag_activation_checkpoint", "wrap")


def link_nested_inputs(gm: torch.fx.GraphModule) -> None:
    """Mark each placeholder of a nested body (activation checkpointing) with the enclosing graph's node it
    receives, so a check can follow a value across the boundary (``node.meta[OUTER_VALUE]``)."""
    for _, module in subgraph_modules(gm):
        for node in module.graph.nodes:
            hop = getattr(node.target, "__name__", None) or str(node.target)
            if node.op != "call_function" or not hop.endswith(_PASS_THROUGH_HOPS) or not node.args:
                continue
            body_attr = node.args[0]
            if not isinstance(body_attr, Node) or body_attr.op != "get_attr":
                continue
            body = getattr(module, body_attr.target, None)
            if not isinstance(body, torch.fx.GraphModule):
                continue
            inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
            if len(inputs) == len(node.args) - 1:
                for placeholder, outer in zip(inputs, node.args[1:], strict=True):
                    if isinstance(outer, Node):
                        placeholder.meta[OUTER_VALUE] = outer


def find_matches(gm: torch.fx.GraphModule, patterns: list[Pattern], config: FuserConfig) -> RewriteResult:
    """Phase 1: every accepted match and near-miss in ``gm`` and its nested subgraphs. Changes nothing.

    Every check receives ``config``: ``keep_logits``, and the pattern's own options, which its fused ops may take
    as arguments.
    """
    result = RewriteResult()
    link_nested_inputs(gm)
    for name, module in subgraph_modules(gm):
        _find_in_graph(module.graph, patterns, config, name, result)
    return result


# what ties a node to the user's code: its source line, its submodule, the function it came from
SOURCE_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


def copy_source_meta(source: Node, *targets: Node) -> None:
    """Give ``targets`` (nodes a rewrite inserts in ``source``'s place) ``source``'s link to the user's code, so
    reports, Inductor's kernel names and error messages still point at the model's own line."""
    for key in SOURCE_META_KEYS:
        if key in source.meta:
            for target in targets:
                target.meta[key] = source.meta[key]


def apply_matches(result: RewriteResult) -> None:
    """Phase 2: replace each match's root by its fused op; erase interior nodes left without users."""
    # positions of the original nodes, taken once per graph: insertions never reorder the roots among themselves
    order: dict[Node, int] = {}
    for graph in {m.found.root.graph for m in result.matches}:
        order.update((node, i) for i, node in enumerate(graph.nodes))
    # a match applied earlier may have replaced a node that a later match takes as an input (lora_sum's sums feed
    # the gated MLP, which was matched after them): such inputs are read through this map
    replaced: dict[Node, Node] = {}

    def resolve(value: Any) -> Any:
        def current(node: Node) -> Node:
            while node in replaced:
                node = replaced[node]
            return node

        if isinstance(value, ArgExpr):  # its source may be another ArgExpr (a transposed view of a repeated cos)
            return dataclasses.replace(value, source=resolve(value.source))
        return torch.fx.node.map_arg(value, current)

    for match in result.matches:
        root = match.found.root
        graph = root.graph
        replacement = match.replacement
        outputs = [(root, replacement.output_index), *replacement.extra_outputs]
        first = min((r for r, _ in outputs), key=order.__getitem__)
        with graph.inserting_before(first):
            args = tuple(_built(resolve(a), graph) for a in replacement.args)
            kwargs = {k: _built(resolve(v), graph) for k, v in replacement.kwargs.items()}
            call = graph.call_function(replacement.op, args, kwargs)
        copy_source_meta(root, call)
        _move_shape_queries(match.found, resolve)
        for old, index in outputs:
            fused = call
            with graph.inserting_before(first):
                if index is not None:
                    fused = graph.call_function(operator.getitem, (call, index))
                if replacement.output_adapter is not None:
                    fused = replacement.output_adapter(graph, fused)
            copy_source_meta(old, fused)
            if "example_value" in old.meta:
                fused.meta["example_value"] = old.meta["example_value"]
            old.replace_all_uses_with(fused)
            replaced[old] = fused
        for dropped in replacement.dropped_outputs:
            _return_none_for(dropped)
        # dropped outputs outside the match (a returned-only cast of the logits) go with it
        dead = list(dict.fromkeys([*match.found.nodes, *replacement.dropped_outputs]))
        while dead:  # erase users before what they use; interior nodes have no users outside the match
            erasable = [n for n in dead if not n.users]
            if not erasable:
                break
            for node in erasable:
                graph.erase_node(node)
                dead.remove(node)
    for graph in {m.found.root.graph for m in result.matches}:
        graph.lint()


def _move_shape_queries(found: Found, resolve: Callable[[Any], Any]) -> None:
    """Erase each unused shape query of an interior node of ``found`` (which the rewrite erases), and point each
    other one at the node :func:`~fuser.engine.match.shape_source` names: an input of the block of the same shape, or
    the root, whose users the fused value takes over next. ``resolve`` maps a node an earlier match replaced to its
    replacement."""
    inside = set(found.nodes)
    for node in found.nodes[1:]:
        for query in [user for user in node.users if user not in inside and is_shape_query(user)]:
            if unused_shape_query(query):  # erased, with its unused indexing
                for user in list(query.users):
                    query.graph.erase_node(user)
                query.graph.erase_node(query)
                continue
            source = shape_source(found, node, query)
            if source is None:  # escaping_use declined such a match; a pattern judging its own uses must too
                raise RuntimeError(f"`{query.name}` reads the shape of `{node.name}`, and no node left has that shape")
            query.replace_input_with(node, resolve(source))


def _built(value: Any, graph: torch.fx.Graph) -> Any:
    """A replacement argument as the fused op's call takes it: an :class:`ArgExpr` built in ``graph``, its source
    first where that is one too."""
    if not isinstance(value, ArgExpr):
        return value
    if isinstance(value.source, ArgExpr):
        value = dataclasses.replace(value, source=_built(value.source, graph))
    return value.build(graph)


def _return_none_for(node: Node) -> None:
    """Make the graph return ``None`` where it returned ``node`` (Dynamo, AOT autograd and Inductor accept it)."""
    for user in list(node.users):
        if user.op == "output":
            user.args = torch.fx.node.map_arg(user.args, lambda n: None if n is node else n)


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a copied graph (and copied nested subgraphs) sharing gm's tensors and metadata."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    output_value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    new_output = graph.output(output_value, type_expr=getattr(old_output, "type", None))
    new_output.meta = dict(old_output.meta)
    clone = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    clone.meta = dict(getattr(gm, "meta", {}))
    for node in graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                setattr(clone, node.target, clone_graph_module(sub))
    return clone


def rewrite(
    gm: torch.fx.GraphModule, patterns: list[Pattern], config: FuserConfig
) -> tuple[torch.fx.GraphModule, RewriteResult]:
    """Match and replace on a copy of ``gm`` as ``config`` asks; ``gm`` itself is never modified."""
    clone = clone_graph_module(gm)
    result = find_matches(clone, patterns, config)
    if result.matches:
        apply_matches(result)
        for pattern in refinement_order(patterns):
            n = sum(pattern.after_apply(module.graph, config) for _, module in subgraph_modules(clone))
            if n:
                result.refined[pattern.name] = n
                log.debug("fuser: %s refined %d fused ops after the rewrite", pattern.name, n)
        for _, module in subgraph_modules(clone):
            erase_dead_function_calls(module.graph)  # linear Functions whose result a fused op took over
            module.recompile()
    return clone, result
