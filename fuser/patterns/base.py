"""What a pattern is: named variants (pattern trees), checks on a match, and the fused op it becomes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

Node = torch.fx.Node


# the dtypes the fused ops compute for (in fp32 internally); anything else is left to the inner compiler
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Decline(Exception):
    """Raised by a pattern's ``check`` when a structural match is not safe to replace; the text says why."""


@dataclass(frozen=True)
class Variant:
    name: str  # which models write it this way, e.g. "llama"
    tree: Any


class ArgExpr:
    """A replacement argument that the rewrite builds in the graph, right before the fused op."""

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
        return graph.call_method("to", (self.source, self.dtype))


@dataclass(frozen=True)
class RepeatHalves(ArgExpr):
    """``cat([source, source], -1)``: per-pair cos/sin of width R/2 spread over both halves of width R."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_function(torch.cat, ([self.source, self.source],), {"dim": -1})


@dataclass(frozen=True)
class Transposed12(ArgExpr):
    """``source.transpose(1, 2)``: a ``[B, T, H, D]`` tensor viewed as ``[B, H, T, D]`` (no copy)."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_method("transpose", (self.source, 1, 2))


@dataclass(frozen=True)
class InterleavedFromComplex(ArgExpr):
    """The real (``part=0``) or imaginary (``part=1``) part of complex per-pair rotations ``[B|1, T, R/2]``,
    repeated for both channels of each pair and broadcast over heads: ``[B|1, 1, T, R]`` (cos or sin)."""

    source: Node
    part: int

    def build(self, graph: torch.fx.Graph) -> Node:
        parts = graph.call_function(torch.view_as_real, (self.source,))
        one = graph.call_function(operator.getitem, (parts, (Ellipsis, self.part)))
        both = graph.call_method("repeat_interleave", (one, 2), {"dim": -1})
        return graph.call_method("unsqueeze", (both, 1))


@dataclass(frozen=True)
class Replacement:
    """One call to a fused op that takes the place of ``root``."""

    op: Any  # an OpOverload, e.g. torch.ops.fuser.rms_norm.default
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    output_index: int | None = None  # the op returns a tuple: the block's value is this element
    # a combined match (q and k rotated by one op) replaces more roots: (root node, output index) for each
    extra_outputs: tuple[tuple[Node, int], ...] = ()
    # the op computes in [B, H, T, D] what the block returns as [B, T, H, D]: transpose each output back
    transpose_outputs_12: bool = False
    # interior nodes the graph returns that the op never computes (logits): the graph returns None in their place
    dropped_outputs: tuple[Node, ...] = ()


@dataclass
class Pattern:
    """A block that fuser recognises.

    ``anchors`` names canonical ops that almost always belong to this block (``rsqrt`` for RMSNorm): an anchor
    node that no accepted match covers is reported as a near-miss in ``fuser.explain``.
    ``check(found, variant)`` returns the ``Replacement`` or raises ``Decline`` with a reason.
    ``combine(matches)``, if given, may merge this pattern's accepted matches of one graph into fewer fused ops
    (RoPE rotates q and k with one op); it returns the matches to apply.
    ``judges_outside_uses``: interior values of a match that are used outside it decline the match, unless this is
    set: then ``check`` judges such uses itself (linear_cross_entropy drops the logits a graph returns).
    ``runs_first``: matched over the whole graph before the other patterns, which then see its blocks as plain
    inputs (lora_sum's sums would otherwise be absorbed by the gated-MLP patterns that consume them).
    ``default``: on when ``FuserConfig.patterns`` is None; a pattern with ``default=False`` runs only when named.
    ``after_apply(graph)``, if given, runs on each rewritten graph once every match is applied, and returns how many
    of this pattern's fused ops it refined using what the other fused ops became (upcast_linear: an input that a
    gated op computes is recomputed, not saved).
    ``takes_config``: ``check(found, variant, config)`` and ``after_apply(graph, config)`` also receive the
    :class:`fuser.FuserConfig` being compiled (a pattern with options of its own reads them there).
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
    takes_config: bool = False
