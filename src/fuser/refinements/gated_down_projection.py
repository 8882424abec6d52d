"""Refinement of the gated MLPs' ops: a trainable down projection fed a gated op's product becomes
``fuser::linear_gated`` (``src/fuser/kernels/linear_gated.py``), whose weight gradient recomputes the product from the
gate and up the gated op saves anyway, so the product ([tokens, intermediate], the widest activation of a layer) is
not saved for it (``gated_mlp.recompute_for_down_weight``). Each gated pattern (swiglu, geglu, reglu, ...) refines
its own activations' ops; ``upcast_linear``'s refinement swaps in the same recompute for peft's LoRA A of the down
projection (:func:`plain_gated_product`, :func:`swap_in_gated_linear`)."""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.fx

import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation*)
from fuser._compat import OpOverload
from fuser.engine.canonical import canonical, tensor_meta
from fuser.engine.protocol import Refinement
from fuser.kernels.activations import GATED_PATTERNS, TABLE

if TYPE_CHECKING:
    from fuser.config import FuserConfig


class GatedProduct(NamedTuple):
    """The arguments of a ``fuser::gated_activation`` call without LoRA terms: what its product is recomputed from."""

    gate: torch.fx.Node
    up: torch.fx.Node
    gate_scale: float
    up_scale: float
    activation: str


def plain_gated_product(x: Any) -> GatedProduct | None:
    """The :class:`GatedProduct` when ``x`` is ``fuser::gated_activation(gate, up, None, None,
    ...)[0]`` in a rewritten graph: a product the gated op's own forward can recompute from the gate and up it
    saves (not when it absorbed LoRA sums: it then saves the sums); None otherwise."""
    if not (isinstance(x, torch.fx.Node) and x.target is operator.getitem and x.args[1] == 0):
        return None
    gated = x.args[0]
    if not isinstance(gated, torch.fx.Node) or gated.target is not torch.ops.fuser.gated_activation.default:
        return None
    if set(gated.kwargs) - {"gate_wide", "up_wide"}:
        return None
    # with the unrounded LoRA sums (gate_wide, up_wide) the forward's product came from those; a recompute from the
    # rounded gate and up it saves is what the gradients are taken at, as eager's backward takes them
    gate, up, gate_lora, up_lora, gate_scale, up_scale, activation = gated.args
    if gate_lora is not None or up_lora is not None:
        return None
    return GatedProduct(gate, up, gate_scale, up_scale, activation)


def swap_in_gated_linear(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    op: OpOverload,
    linear_args: tuple[Any, Any, Any],
    product: GatedProduct,
    kwargs: dict[str, Any] | None = None,
) -> None:
    """Put ``op(x, gate, up, W, b, gate_scale, up_scale, activation, **kwargs)`` in place of ``node``, a linear layer
    ``(x, W, b)`` of the gated ``product`` x: the argument list ``fuser::linear_gated`` and
    ``fuser::upcast_linear_gated`` share, whose backward recomputes x from gate and up."""
    x, weight, bias = linear_args
    gated = (product.gate, product.up, weight, bias, product.gate_scale, product.up_scale, product.activation)
    with graph.inserting_before(node):
        refined = graph.call_function(op, (x, *gated), dict(kwargs or {}))
    refined.meta.update(node.meta)
    node.replace_all_uses_with(refined)
    graph.erase_node(node)


def recompute_for_down_weight(graph: torch.fx.Graph, config: FuserConfig, activations: frozenset[str]) -> int:
    """``linear(x, W, b)`` with ``x = gated_activation(gate, up, None, None, ..., activation)[0]`` (``activation``
    one of ``activations``: each pattern refines its own ops) and ``W`` trainable → ``linear_gated(x, gate, up, W,
    b, ...)`` (src/fuser/kernels/linear_gated.py), unless ``config.gated_mlp.recompute_for_down_weight`` is off;
    returns how many. Not for a frozen ``W`` (LoRA's base: nothing saves ``x`` for it), nor when the gated op
    absorbed LoRA sums (it then saves the sums), nor under autocast (``x`` and ``W`` of different dtypes)."""
    if not config.gated_mlp.recompute_for_down_weight:
        return 0
    import fuser.kernels.linear_gated  # noqa: F401  (registers torch.ops.fuser.linear_gated)

    n = 0
    for node in list(graph.nodes):
        linear = canonical(node)  # F.linear / nn.Linear's call, its arguments bound by name
        if linear is None or linear.op != "linear":
            continue
        x, weight, bias = linear.args
        product = plain_gated_product(x)
        xt, wt = tensor_meta(x), tensor_meta(weight)
        if product is None or product.activation not in activations or xt is None or wt is None:
            continue
        if not wt.requires_grad or wt.dtype != xt.dtype or wt.dim() != 2:
            continue
        if bias is not None and (tensor_meta(bias) is None or tensor_meta(bias).dtype != wt.dtype):
            continue
        swap_in_gated_linear(graph, node, torch.ops.fuser.linear_gated.default, linear.args, product)
        n += 1
    return n


def _for(*activations: str) -> Refinement:
    return Refinement(functools.partial(recompute_for_down_weight, activations=frozenset(activations)))


# by gated pattern: the activations whose ops it refines (each pattern its own, as the activation table assigns them)
DOWN_WEIGHT = {p: _for(*(a.name for a in TABLE if a.pattern == p)) for p in GATED_PATTERNS}
