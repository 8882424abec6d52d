"""lm_head + cross-entropy: ``cross_entropy(linear(h, W).float().view(-1, V), labels)``, as the models write it.

    transformers 5     linear(h[:, -0:, :], W) → .float() → view(-1, V) → cross_entropy(.., ignore_index, reduction)
                       (``ForCausalLMLoss``; ``reduction="sum"`` and a division when ``num_items_in_batch`` is given)
    OPT                lm_head(h).contiguous()                   a copy of the logits in row-major layout
    Cohere             logits * logit_scale                      a constant scale before the loss
    Granite            logits / logits_scaling                   its inverse is the scale
    Gemma-2            tanh(logits / cap) * cap                  final-logit softcapping (after any scale)
    hand-written       F.cross_entropy(lm_head(h).view(-1, V), y.view(-1)), or on 2-D logits with no view
    BLIP-2, GIT        logits[:, -n:, :], logits[:, k:-1, :]     the text positions only: any slices and ints that
                                                                 leave the vocab dim whole (the op takes h's same rows)

The whole chain from the linear to the loss becomes one ``torch.ops.fuser.linear_cross_entropy``, which never
holds the full ``[tokens, vocab]`` logits in memory. What stays in the graph: the labels expression (shift by pad or
slice, ``.contiguous()``, ``.view(-1)``, ``.to(device)``: the loss's target is the op's ``labels``) and a
following ``/ num_items_in_batch``. Tied embeddings need nothing: the weight is the embedding's, and autograd
sums its two gradients.

A model returns its logits with the loss. In training (gradients wanted), with ``FuserConfig.keep_logits=False``,
the graph returns ``None`` in their place (``outputs.logits is None``): Dynamo, AOT autograd and Inductor all
accept a ``None`` graph output, so no placeholder tensor is allocated; but not in the pieces Dynamo's DDPOptimizer
splits a DDP model's graph into (a model with several gradient buckets), where the piece returns a 0-element tensor
instead (``src/fuser/dynamo_backend.py``). With ``keep_logits=True``, or when no
gradient is wanted (evaluation), returned logits decline the match and the graph computes them and the loss as
written; so do logits returned from a nested graph (activation checkpointing), whose outputs are its
higher-order op's. Declined, saying so: ``nll_loss(log_softmax(logits))`` (ProphetNet), cross_entropy in two steps.
Declined too: class weights, label smoothing, ``reduction="none"``, soft (probability)
targets, a scale or cap that is a tensor rather than a constant, softcapping with two different constants, a
loss that is not fp32 (half-precision logits never upcast), and logits (or any value between them and the loss)
used by anything but the graph's return.

A scale or cap that Dynamo made symbolic (another model's ``logit_scale`` or softcap, recompiled in one process)
is taken from the graph: the op's ``logit_scale``/``softcap`` argument is that node (``1 / node`` for a divisor).

Under autocast the linear runs in a lower precision than its fp32 operands: the op gets them cast to that dtype
(custom ops see no autocast), as eager's linear does.

How the op accumulates the weight gradient is :class:`LinearCrossEntropyExperimental`
(``FuserConfig.experimental.linear_cross_entropy``, ``options={"experimental.linear_cross_entropy.<name>": ...}``),
passed to the op as its keyword arguments of those names: each default won a measurement, and the others are kept to
measure against.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fuser.engine.canonical import canonical, code_at, tensor_meta
from fuser.engine.match import (
    C,
    Found,
    Input,
    OneOf,
    Op,
    OptCast,
    S,
    V,
    describe_value,
    is_symbolic_scalar,
    movable_shape_query,
    same_scalar,
    scalar_hint,
)
from fuser.inductor.embedding_grads import PASS as EMBEDDING_GRADS_PASS
from fuser.kernels.linear_cross_entropy import DwAccumulator, DwKernel  # importing it registers the op
from fuser.options import check_fields
from fuser.patterns.base import FLOAT_DTYPES, ArgExpr, CastTo, Decline, NotApplicable, Pattern, Replacement, Variant

if TYPE_CHECKING:
    from fuser.config import FuserConfig

Node = torch.fx.Node


@dataclass(frozen=True)
class LinearCrossEntropyExperimental:
    """How the fused lm_head + cross-entropy forms the lm_head's weight gradient
    (``src/fuser/kernels/linear_cross_entropy.py``): the ways measured against each other to choose the default."""

    dw_kernel: DwKernel = "cublas"
    """What adds each chunk's share to the weight gradient's running sum: ``"cublas"`` (``addmm_``) or ``"triton"``
    (fuser's own kernel, half-precision sums only; kept as a measured alternative)."""

    dw_accumulator: DwAccumulator = "input"
    """The running sum's dtype: ``"input"`` (the weight's: no extra memory) or ``"fp32"`` (one extra
    ``[vocab, hidden]`` fp32 buffer, one rounding at the end)."""

    streams: bool = True
    """Accumulate the weight gradient on a second CUDA stream, beside the ``dhidden`` matmul (when both gradients
    are wanted): the memory-bound accumulation overlaps the compute-bound matmul, at no extra memory."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.linear_cross_entropy")


def _constant(name: str) -> OneOf:
    """A Python number (the model's config value; symbolic when Dynamo made it a graph input), or a tensor: bound
    as ``<name>_tensor`` and declined."""
    return OneOf(S(name), V(f"{name}_tensor"))


@dataclass(frozen=True)
class Indexed(ArgExpr):
    """``source[index]``, cast to ``dtype``: the hidden states' rows that the logits' own index selects (the last dim
    left whole), in the dtype the op computes in."""

    source: Node
    index: tuple[Any, ...]
    dtype: torch.dtype

    def build(self, graph: torch.fx.Graph) -> Node:
        node = graph.call_function(operator.getitem, (self.source, self.index))
        if tensor_meta(self.source).dtype != self.dtype:
            node = graph.call_method("to", (node, self.dtype))
        return node


@dataclass(frozen=True)
class Reciprocal(ArgExpr):
    """``1.0 / source`` of a symbolic scalar (Granite's ``logits / logits_scaling`` as the op's logit scale)."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_function(operator.truediv, (1.0, self.source))


def _loss_of(logits: Any) -> Op:
    """The loss over ``logits``: scale, softcap, upcast and rows as the models write them, then the loss."""
    scaled = OneOf(
        Op("mul", logits, _constant("scale")),  # Cohere: logits * logit_scale
        Op("div", logits, _constant("inverse_scale")),  # Granite: logits / logits_scaling
        logits,
    )
    softcapped = OneOf(
        Op("mul", Op("tanh", Op("div", scaled, _constant("cap_in"))), _constant("cap_out")),  # Gemma-2
        scaled,
    )
    upcast = OptCast(softcapped, "loss_cast")
    rows = OneOf(
        Op("rows", upcast),  # view(-1, V) / reshape(-1, V)
        Op("flatten", upcast, S("flatten_start"), -2),  # flatten(0, -2)
        upcast,  # logits that are 2-D already
    )
    return Op(
        "cross_entropy",
        rows,
        V("labels"),
        OneOf(V("class_weight"), None),
        S("ignore_index"),
        C("reduction"),
        S("label_smoothing"),
    )


# transformers' `hidden_states[:, slice(-logits_to_keep, None), :]` with logits_to_keep=0 selects everything
hidden = OneOf(Op("whole", V("h")), V("h"))
logits = OptCast(Op("linear", hidden, V("w"), OneOf(V("b"), None)), "linear_cast")
logits = OneOf(Op("contiguous", logits), logits)  # OPT: lm_head(h).contiguous()
# the text positions of a model that prepends others (BLIP-2: `logits[:, -labels.size(1):, :]`, GIT:
# `logits[:, num_image_tokens:-1, :].contiguous()`): the op takes the same rows of the hidden states
logits = OneOf(Op("index_leading", logits, C("logits_index")), logits)
logits = OneOf(Op("contiguous", logits), logits)
logits = OneOf(Op("rows", logits), logits)  # GIT: rows before the loss function's upcast and its own view

VARIANTS = [
    Variant("causal lm", _loss_of(logits)),
    # logits that enter the graph as an input, computed before it (a graph break between the lm_head and the loss,
    # as a logging call in transformers' loss_function makes): always declined, saying so
    Variant("logits from before the graph", _loss_of(Input("logits_input")), declines=True),
    # ProphetNet: nll_loss(log_softmax(logits, -1)), cross_entropy's value in two steps: declined, saying so
    Variant(
        "nll_loss of log_softmax",
        Op(
            "nll_loss",
            Op("log_softmax", V("log_softmax_input"), -1, C("log_softmax_dtype")),
            V("labels"),
            OneOf(V("class_weight"), None),
            S("ignore_index"),
            C("reduction"),
        ),
        declines=True,
    ),
]


def _scalar(b: dict, name: str, what: str) -> tuple[float | Node, float] | None:
    """(the op's argument, its number) of a captured constant: a literal, or a symbolic scalar node with the value
    it was traced with (checks read that value; the op takes the node, so the graph supplies it at run time)."""
    if f"{name}_tensor" in b:
        raise Decline(f"{what} is a tensor (`{b[f'{name}_tensor'].name}`), not a constant")
    if name not in b:
        return None
    value = b[name]
    number = scalar_hint(value)
    if number is None:
        raise Decline(f"{what} `{value.name}` is computed from data at run time (its value is not known)")
    return (value if is_symbolic_scalar(value) else float(value)), float(number)


def _outside_uses(found: Found) -> tuple[list[Node], list[tuple[Node, Node]]]:
    """Interior nodes the graph returns, and (interior node, user) pairs of any other use outside the match.

    The ``whole`` slice of the hidden states is not interior: it is a view of the op's input, and stays in the
    graph if something else uses it.
    """
    inside = set(found.nodes)
    returned, used = [], []
    for node in found.nodes[1:]:
        c = canonical(node)
        if c is not None and c.op == "whole":
            continue
        for user in node.users:
            if user in inside or movable_shape_query(found, node, user):
                continue
            if user.op == "output":
                returned.append(node)
            elif (chain := _returned_only(user)) is not None:
                # e.g. accelerate's convert_outputs_to_fp32 under autocast: the graph returns logits.float()
                returned += [node, *chain]
            else:
                used.append((node, user))
    return returned, used


# what a value may go through on its way to the graph's outputs and still count as "returned" (the graph then
# returns None for it too): casts and reshapes, as a wrapper around forward applies them to every output
_RETURN_CONVERSIONS = ("to", "reshape", "contiguous")


def _returned_only(node: Node) -> list[Node] | None:
    """``node`` and the conversions after it, if they only lead to the graph's outputs; else None."""
    c = canonical(node)
    if c is None or c.op not in _RETURN_CONVERSIONS or not node.users:
        return None
    chain = [node]
    for user in node.users:
        if user.op == "output":
            continue
        rest = _returned_only(user)
        if rest is None:
            return None
        chain += rest
    return chain


def _operand(node: Node, dtype: torch.dtype) -> Node | CastTo:
    return node if tensor_meta(node).dtype == dtype else CastTo(node, dtype)


# how the decline of a loss over logits that are an input of its graph begins (the backend warns once about it)
LOGITS_FROM_BEFORE_THE_GRAPH = "the logits are "


def check_linear_cross_entropy(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    if "logits_input" in b:
        raise Decline(
            f"{LOGITS_FROM_BEFORE_THE_GRAPH}{describe_value(b['logits_input'])} of this graph, not computed in it: "
            "the lm_head ran before this graph began, in the graph before a graph break (the report's graph breaks "
            "say where) or outside the compiled code, and the loss fuses only in the lm_head's graph. A "
            "`logger.warning_once` call (transformers' loss_function) breaks no graph under fuser.optimize, "
            "optimize_ and explain (FuserConfig.ignore_logging); torch.compile(backend='fuser') cannot skip it"
        )
    if "log_softmax_input" in b:
        log_probs = next(n for n in found.nodes if (c := canonical(n)) is not None and c.op == "log_softmax")
        others = [f"`{u.name}`" for u in log_probs.users if u is not found.root]
        reused = (
            f"; the log-probabilities are also used by {', '.join(others)} (a label-smoothing term?)" if others else ""
        )
        raise Decline(
            "the loss is nll_loss over log_softmax: cross_entropy's value, written in two steps" + reused + ". The "
            "fused op replaces an lm_head followed by cross_entropy (without label smoothing) only"
        )
    if b.get("class_weight") is not None:
        raise Decline("cross_entropy with class weights (weight=)")
    # the op has no argument for these: one that changes between calls (symbolic) cannot be fused
    for name in ("label_smoothing", "ignore_index", "flatten_start"):
        if is_symbolic_scalar(b.get(name)):
            raise Decline(f"cross_entropy's {name} `{b[name].name}` changes between calls (the op takes it fixed)")
    if b["label_smoothing"] != 0:
        raise Decline(f"cross_entropy with label_smoothing={b['label_smoothing']}")
    if b["reduction"] not in ("mean", "sum"):
        raise Decline(f"cross_entropy reduction={b['reduction']!r} (the fused op returns one mean or sum loss)")
    if isinstance(b["ignore_index"], float):
        raise Decline(f"ignore_index {b['ignore_index']} is not an int")

    h, w, bias = b["h"], b["w"], b.get("b")
    ht, wt, lt = tensor_meta(h), tensor_meta(w), tensor_meta(b["labels"])
    linear_node = next(n for n in found.nodes if (c := canonical(n)) is not None and c.op == "linear")
    logits_t = tensor_meta(linear_node)
    if wt.dim() != 2 or ht.dim() < 1 or not isinstance(wt.shape[0], int) or not isinstance(wt.shape[1], int):
        raise Decline(f"lm_head weight of shape {tuple(wt.shape)} is not a static [vocab, hidden] matrix")
    if not (isinstance(ht.shape[-1], int) and ht.shape[-1] == wt.shape[1]):
        raise Decline(f"hidden size {ht.shape[-1]} is not the weight's {wt.shape[1]}")
    if bias is not None and tuple(tensor_meta(bias).shape) != (wt.shape[0],):
        raise Decline(f"bias of shape {tuple(tensor_meta(bias).shape)} is not [vocab]")
    dtypes = [ht.dtype, wt.dtype, logits_t.dtype] + ([tensor_meta(bias).dtype] if bias is not None else [])
    if any(d not in FLOAT_DTYPES for d in dtypes):
        raise Decline(f"dtypes {[str(d) for d in dtypes]} are not all fp16/bf16/fp32")
    for name in ("linear_cast", "loss_cast"):
        if b.get(name) not in (None, torch.float32):
            raise Decline(f"logits are cast to {b[name]} before the loss (only an fp32 upcast is fused)")
    if lt.dtype.is_floating_point or lt.dtype.is_complex or lt.dtype == torch.bool or lt.dim() != 1:
        raise Decline(f"target of dtype {lt.dtype} and rank {lt.dim()} is not a 1-D tensor of class indices")
    if "flatten_start" in b and b["flatten_start"] != -logits_t.dim():
        raise Decline(f"flatten from dim {b['flatten_start']} does not make [tokens, vocab] rows")
    ce_input = tensor_meta(canonical(found.root).args[0])
    if ce_input.dim() != 2:
        raise Decline(f"cross_entropy over class dim 1 of rank-{ce_input.dim()} logits (not [tokens, vocab] rows)")
    if tensor_meta(found.root).dtype != torch.float32:
        raise Decline(f"the loss is {tensor_meta(found.root).dtype}; the fused op returns an fp32 loss")

    logit_scale: float | Node | Reciprocal = 1.0
    scale, inverse_scale = _scalar(b, "scale", "logit scale"), _scalar(b, "inverse_scale", "logit scaling divisor")
    if scale is not None:
        logit_scale = scale[0]
    if inverse_scale is not None:
        arg, number = inverse_scale
        if number == 0:
            raise Decline("logits divided by 0")
        logit_scale = Reciprocal(arg) if isinstance(arg, Node) else 1.0 / arg
    cap_in, cap_out = _scalar(b, "cap_in", "softcap divisor"), _scalar(b, "cap_out", "softcap multiplier")
    softcap: float | Node = 0.0
    if cap_in is not None:
        if not same_scalar(b["cap_in"], b["cap_out"]):
            raise Decline(f"softcap tanh(x / {cap_in[1]}) * {cap_out[1]} uses two different constants")
        if cap_in[1] <= 0:
            raise Decline(f"softcap {cap_in[1]} is not positive")
        softcap = cap_in[0]

    # gradients are wanted when grad mode is on (at rewrite time, as at run time: Dynamo guards on it) and the
    # logits were traced with requires_grad (false inside a no_grad region of the graph)
    grad = torch.is_grad_enabled() and logits_t.requires_grad
    grad_hidden, grad_weight = grad and ht.requires_grad, grad and wt.requires_grad
    grad_bias = grad and bias is not None and tensor_meta(bias).requires_grad
    returned, used = _outside_uses(found)
    if used:
        inner, user = used[0]
        raise Decline(f"intermediate `{inner.name}` is also used by {code_at(user)}, outside the block")
    if returned:
        returns = f"the graph returns the logits ({', '.join(f'`{n.name}`' for n in returned)})"
        as_written = "the loss is computed from them as written"
        if config.keep_logits:
            raise Decline(f"{returns} and FuserConfig.keep_logits=True: {as_written}")
        if not (grad_hidden or grad_weight or grad_bias):
            # the op keeps the logits from memory in training; an evaluation that returns them has none to spare
            raise NotApplicable(f"{returns} and no gradient is wanted (evaluation): {as_written}")

    # autocast ran the linear in a lower precision than its operands: the op gets them in that dtype
    compute = logits_t.dtype
    options = config.experimental.linear_cross_entropy
    hidden_operand = Indexed(h, b["logits_index"], compute) if "logits_index" in b else _operand(h, compute)
    return Replacement(
        torch.ops.fuser.linear_cross_entropy.default,
        (
            hidden_operand,
            _operand(w, compute),
            None if bias is None else _operand(bias, compute),
            b["labels"],
            int(b["ignore_index"]),
            b["reduction"],
            logit_scale,
            softcap,
            grad_hidden,
            grad_weight,
            grad_bias,
        ),
        {"dw_kernel": options.dw_kernel, "dw_accumulator": options.dw_accumulator, "streams": options.streams},
        output_index=0,  # (loss, dhidden, dweight, dbias)
        dropped_outputs=tuple(dict.fromkeys(returned)),
    )


LINEAR_CROSS_ENTROPY = Pattern(
    "linear_cross_entropy",
    VARIANTS,
    check_linear_cross_entropy,
    anchors=frozenset({"cross_entropy"}),
    judges_outside_uses=True,
    # the embedding's gradient, which a tied lm_head's gradient joins (any embedding's: experimental.embedding_grads)
    post_grad=(EMBEDDING_GRADS_PASS,),
    experimental_options=LinearCrossEntropyExperimental,
)
