"""What a pattern is, as the engine reads it: variants (pattern trees with the parameters their check reads), a
check that turns a match into a :class:`Replacement` or declines it, and hooks the engine runs without knowing
what they do. The engine imports nothing from ``fuser.patterns`` or ``fuser.kernels``: a block brings its own
argument builders (:class:`ArgExpr` subclasses), output adapters, refinements and post-grad passes.

A pattern reaches the backend, ``fuser.explain`` and :class:`fuser.FuserConfig` through :func:`register_pattern`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from fuser.options import check_options_class

if TYPE_CHECKING:
    from fuser.config import FuserConfig

Node = torch.fx.Node


class Decline(Exception):
    """Raised by a pattern's ``check`` when a structural match is not safe to replace; the text says why, in the
    words of the model's code (what it computes there, its dtypes and shapes), for ``fuser.explain``.

    A plain ``Decline`` is a missed fusion: code that looks like the block is not fused, which ``fuser.explain``
    always shows. Where the pattern has nothing to do for this model, raise :class:`NotApplicable` instead.
    """


class NotApplicable(Decline):
    """A decline where the pattern could not apply to this model, so nothing was missed: what the pattern is for is
    absent there (the fp32 adapters on a bf16/fp16 base that ``lora_sum`` fuses, in an fp32 model; an input that is
    fp32 already, for ``upcast_linear``; a setting the pattern is for). ``fuser.explain`` and ``fuser.report`` list
    such declines only with ``verbose=True``; :attr:`NearMiss.applicable <fuser.engine.rewrite.NearMiss>` is False
    for them."""


@dataclass(frozen=True)
class Variant:
    """One way models write a block.

    name:    what ``fuser.explain`` shows for a match of it, after the models that write it so (``"llama"``); a
             check never reads it.
    tree:    the pattern tree (:mod:`fuser.engine.match`).
    params:  what the pattern's check needs to know about this form, in a frozen dataclass the pattern defines
             (``GatedForm(packed=True)``), or None.
    declines: a form declared only to be declined (its check always raises ``Decline`` saying why, e.g. an L2 norm
             for RMSNorm): ``fuser.explain`` shows that reason where it matches, and never names it as the closest
             form of code that no form covers.
    """

    name: str
    tree: Any
    params: Any = None
    declines: bool = False


class ArgExpr:
    """A replacement argument that the rewrite builds in the graph, right before the fused op.

    Subclasses are frozen dataclasses with a ``source`` node field: when an earlier replacement took ``source``'s
    place, the engine swaps in the new node (``dataclasses.replace``) before calling :meth:`build`. ``source`` may
    itself be an ``ArgExpr``: the engine builds it first and hands :meth:`build` the node it made.
    """

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        raise NotImplementedError


@dataclass(frozen=True)
class EmptyLike(ArgExpr):
    """``source.new_empty(0)``: a 0-element tensor standing for "absent" where a custom op cannot take ``None``."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_method("new_empty", (self.source, (0,)))


@dataclass(frozen=True)
class CastTo(ArgExpr):
    """``source.to(dtype)``: an operand in the dtype autocast gave the op it replaces (custom ops see no autocast)."""

    source: Node
    dtype: torch.dtype

    def build(self, graph: torch.fx.Graph) -> Node:
        call = graph.call_method("to", (self.source, self.dtype))
        example = self.source.meta.get("example_value")
        if isinstance(example, torch.Tensor):  # what refinements read of the operand (its dtype, its shape)
            call.meta["example_value"] = example.to(self.dtype)
        return call


@dataclass(frozen=True)
class Replacement:
    """One call to a fused op that takes the place of ``root``."""

    op: Any  # an OpOverload, e.g. torch.ops.fuser.rms_norm.default
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    output_index: int | None = None  # the op returns a tuple: the block's value is this element
    # a combined match (q and k rotated by one op) replaces more roots: (root node, output index) for each
    extra_outputs: tuple[tuple[Node, int], ...] = ()
    # builds, after the op, each output as the block returned it from the op's (a view back to the block's
    # layout): ``output_adapter(graph, output) -> node``; None when the op returns the block's values as they are
    output_adapter: Callable[[torch.fx.Graph, Node], Node] | None = None
    # interior nodes the graph returns that the op never computes (logits): the graph returns None in their place
    dropped_outputs: tuple[Node, ...] = ()
    # what the check found, when the variant's name alone would not say it (a mask proved to be a window of 1024
    # keys: "window 1024"): the report's variant column shows it instead of the variant's name
    variant: str | None = None
    # patterns whose fused ops the replacement's arguments emit besides ``op`` (an autocast LoRA sum's lora_A as
    # ``fuser::upcast_linear``): counted under those names, one each
    emits_also: tuple[str, ...] = ()


def _always(config: FuserConfig) -> bool:
    return True


@dataclass(frozen=True)
class PostGradPass:
    """A rewrite of Inductor's post-grad graphs (functional, after AOT autograd's partition; forward and backward)
    that a block brings for its fused ops, such as writing a backward's gradients over inputs nobody reads after.

    ``plan(graph)`` only reads the graph and returns what to change; ``apply(graph, plan)`` changes it and returns
    how many calls it rewrote (the backend's ``post_grad_counts[name]``). A failing plan leaves the graph as it
    was: the backend warns (raises under ``strict``) and goes on. ``enabled(config)`` says whether it runs.
    """

    name: str
    plan: Callable[[torch.fx.Graph], Any]
    apply: Callable[[torch.fx.Graph, Any], int]
    enabled: Callable[[FuserConfig], bool] = _always


def call_args(node: torch.fx.Node) -> dict[str, Any]:
    """An op call's arguments by its schema's names, defaults filled in: how post-grad passes read a call whether
    its arguments came positional or by keyword."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        else:
            bound[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return bound


def with_args(node: torch.fx.Node, values: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``node``'s args and kwargs with the arguments ``values`` names (its schema's names) set: where the call
    passes one by position, in its place; else as a keyword. The counterpart of :func:`call_args`."""
    names = [a.name for a in node.target._schema.arguments]
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in values.items():
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


@dataclass(frozen=True)
class Refinement:
    """A follow-on rewrite of fused ops, run on each rewritten graph once every match is applied: it refines a
    pattern's ops using what the other patterns' ops became (a gated op's product recomputed for the down
    projection's weight gradient, a residual add taken into a norm). A pattern names it as its ``after_apply``.

    ``run(graph, config)`` rewrites ``graph`` and returns how many of the pattern's fused ops it refined.
    ``after``: the patterns whose refinements must have run first, because this one reads what they made or leaves
    them what they take. Every match of every pattern is applied before any refinement runs, so reading another
    pattern's ops as matched needs no entry. The engine runs the refinements of the patterns it compiles in an order
    that honours every ``after`` among them (:func:`refinement_order`), registration order deciding the rest;
    :func:`register_pattern` refuses a pattern whose ``after`` closes a cycle.
    """

    run: Callable[[torch.fx.Graph, Any], int]
    after: tuple[str, ...] = ()

    def __call__(self, graph: torch.fx.Graph, config: Any) -> int:
        return self.run(graph, config)


@dataclass
class Pattern:
    """A block that fuser recognises.

    ``check(found, variant, config)`` returns the ``Replacement`` for a structural match of one of ``variants``,
    or raises ``Decline`` with a reason; ``config`` is the :class:`fuser.FuserConfig` being compiled (a pattern
    with options of its own reads them there).
    ``anchors`` names canonical ops that almost always belong to this block (``rsqrt`` for RMSNorm): an anchor
    node that no accepted match covers is reported as a near-miss in ``fuser.explain``.
    ``combine(matches)``, if given, may merge this pattern's accepted matches of one graph into fewer fused ops
    (RoPE rotates q and k with one op); it returns the matches to apply.
    ``judges_outside_uses``: interior values of a match that are used outside it decline the match, unless this is
    set: then ``check`` judges such uses itself (linear_cross_entropy drops the logits a graph returns).
    ``runs_first``: matched over the whole graph before the other patterns, which then see its blocks as plain
    inputs (lora_sum's sums would otherwise be absorbed by the gated-MLP patterns that consume them).
    ``default``: on when ``FuserConfig.patterns`` is None; a pattern with ``default=False`` runs only when named.
    ``after_apply(graph, config)``, if given, runs on each rewritten graph once every match is applied, and returns
    how many of this pattern's fused ops it refined using what the other fused ops became (upcast_linear: an input
    that a gated op computes is recomputed, not saved): a :class:`Refinement`, which says which patterns' refinements
    it runs after, or any such callable (it then runs after none in particular).
    ``post_grad``: passes over Inductor's post-grad graphs for this block's fused ops (:class:`PostGradPass`). A
    fused op can reach a graph without its pattern (a model that calls ``fuser.swiglu`` itself), so the backend
    runs the passes of every registered pattern, enabled or not.
    ``options``: the pattern's options, a frozen dataclass whose fields have defaults and a description each (the
    docstring under the field; the class docstring describes them together). Once the pattern is registered,
    ``FuserConfig(<name>={...})``, ``options={"<name>": {...}}`` or ``options={"<name>.<field>": ...}`` set them,
    ``docs/options.md`` lists them, and ``check`` and the hooks read them as ``config.<name>.<field>``.
    ``experimental_options``: the same under ``FuserConfig.experimental`` (``config.experimental.<name>``), for
    switches that exist to compare implementations rather than for users to choose.
    ``options_name``: the ``<name>`` both go by; the pattern's own name when ``None`` (swiglu, geglu and reglu share
    ``gated_mlp``'s).
    """

    name: str
    variants: list[Variant]
    check: Callable[..., Replacement]
    anchors: frozenset[str] = field(default_factory=frozenset)
    combine: Callable[[list[Any]], list[Any]] | None = None
    judges_outside_uses: bool = False
    runs_first: bool = False
    default: bool = True
    after_apply: Callable[..., int] | None = None
    post_grad: tuple[PostGradPass, ...] = ()
    options: type | None = None
    experimental_options: type | None = None
    options_name: str | None = None

    @property
    def options_key(self) -> str:
        """The name this pattern's options go by in ``FuserConfig`` and ``options=``."""
        return self.options_name or self.name


# every registered pattern by name (the keys of ``fuser.explain(...).counts``), in the order registered
PATTERNS: dict[str, Pattern] = {}


def register_pattern(pattern: Pattern) -> Pattern:
    """Make ``pattern`` known to the backend, ``fuser.explain`` and ``FuserConfig.patterns``, and its options (if it
    declares any) to ``FuserConfig`` and ``options=``; returns it. Options that cannot be checked, or that take a name
    another pattern's different options or FuserConfig itself hold, are refused here.

    At each node the engine tries the patterns in the order they were registered (those with ``runs_first`` over
    the whole graph before the others): the first whose check accepts a match there takes the node.
    """
    if not isinstance(pattern, Pattern):
        raise TypeError(f"fuser: register_pattern takes a Pattern, got {type(pattern).__name__}")
    if PATTERNS.get(pattern.name, pattern) is not pattern:
        raise ValueError(f"fuser: another pattern is registered as {pattern.name!r}; give this one another name")
    for kind in ("options", "experimental_options"):
        cls = getattr(pattern, kind)
        if cls is None:
            continue
        check_options_class(cls, pattern.options_key)
        # patterns may share options (one block, several activations), never give one name two classes
        for other in PATTERNS.values():
            theirs = getattr(other, kind)
            if other is not pattern and other.options_key == pattern.options_key and theirs not in (None, cls):
                raise ValueError(
                    f"fuser: pattern {other.name!r} has {kind} {theirs.__name__} under {pattern.options_key!r}; "
                    f"give pattern {pattern.name!r} another options_name for its {cls.__name__}"
                )
    previous = PATTERNS.get(pattern.name)
    PATTERNS[pattern.name] = pattern
    try:
        refinement_order(PATTERNS.values())
    except ValueError:
        if previous is None:
            del PATTERNS[pattern.name]
        else:
            PATTERNS[pattern.name] = previous
        raise
    return pattern


def registered_options(experimental: bool = False) -> dict[str, type]:
    """The registered patterns' options classes (``Pattern.options``, or ``experimental_options``) by the name each
    goes by, in the order the patterns were registered."""
    found: dict[str, type] = {}
    for pattern in PATTERNS.values():
        cls = pattern.experimental_options if experimental else pattern.options
        if cls is not None:
            found.setdefault(pattern.options_key, cls)
    return found


def post_grad_passes(patterns: Iterable[Pattern]) -> tuple[PostGradPass, ...]:
    """The post-grad passes of ``patterns``, in their order, each once (swiglu and geglu share theirs)."""
    return tuple(dict.fromkeys(p for pattern in patterns for p in pattern.post_grad))


def refinement_order(patterns: Iterable[Pattern]) -> list[Pattern]:
    """Those of ``patterns`` that have an ``after_apply``, in the order the engine runs them: each after the patterns
    its :attr:`Refinement.after` names (those among ``patterns``), the earliest in ``patterns``' order first where
    that leaves a choice; raises ``ValueError`` on a cycle."""
    refining = [p for p in patterns if p.after_apply is not None]
    names = {p.name for p in refining}
    waits = {p.name: {n for n in getattr(p.after_apply, "after", ()) if n in names and n != p.name} for p in refining}
    ordered: list[Pattern] = []
    while len(ordered) < len(refining):
        done = {p.name for p in ordered}
        ready = next((p for p in refining if p.name not in done and waits[p.name] <= done), None)
        if ready is None:
            stuck = sorted(n for n in names if n not in done)
            raise ValueError(f"fuser: the refinements of {stuck} each wait for another's (Refinement.after): a cycle")
        ordered.append(ready)
    return ordered
