"""RMSNorm, as the models write it.

Every variant normalises ``h`` (the input, or its fp32 upcast) by ``rsqrt(mean(h²) + eps)`` over the last dim
and optionally multiplies by a weight. What differs is where the casts are and how the weight enters:

    Llama       w * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(in_dtype)
    OLMo-2      (w * (h * rsqrt(...))).to(in_dtype)              weight multiplied in fp32, then the cast
    Gemma       ((h * rsqrt(...)) * (1 + w.float())).type_as(x)  offset 1, all fp32
    Gemma-3n    h * pow(mean(h²) + eps, -0.5)
    (any)       sum(h², -1, keepdim=True) / d instead of the mean
    nanochat    no weight at all
    torch       F.rms_norm / nn.RMSNorm

Declared in order to decline it: Dory's (nGPT's) ``h * rsqrt(sum(h²) + eps)`` (also FLA's q/k ``l2norm``, with
``(h * h).sum``), with no division by the hidden size, projects onto the unit sphere (an L2 norm), which is an
RMSNorm only up to a factor ``√d`` and ``eps / d``.

``fuser.explain`` names a match by its form: ``llama``, ``olmo2``, ``gemma``, ``no weight`` or ``F.rms_norm`` (the
others in the table are spellings of the normalisation inside them).

The fused op rounds once, at its output: an explicit cast between the normalisation and the weight multiply
(Llama's ``.to(in_dtype)``) is computed in fp32, as Inductor computes it fused. The result has the root node's
dtype, read from the graph's metadata (so autocast's dtypes are kept). ``eps`` is the literal, or, when Dynamo
made it symbolic (a second model with another ``rms_norm_eps`` in one process), the graph's ``item()`` node: the
op takes it from the graph, and the checks read the value it was traced with. Where ``x`` is a LoRA sum or a
residual add over one, the ``lora_sum`` pattern's refinements hand the op the sum's fp32 value as well
(``x_wide``); where it is any other residual add of two tensors of one dtype, a refinement of this pattern makes
the add and the norm one op (``fuser::add_rms_norm``, :func:`add_residuals_into_norms`).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

import fuser.kernels.linear_normed  # noqa: F401  (registers torch.ops.fuser.linear_normed)
import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum, whose sums the refinement leaves)
import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
from fuser._compat import statically_same_shape
from fuser._dtypes import HALF_DTYPES
from fuser.engine.canonical import canonical, code_at, strip_exact_upcast, tensor_meta, value_readers
from fuser.engine.match import C, Found, OneOf, Op, OptCast, S, V, is_symbolic_scalar, scalar_arg, scalar_hint
from fuser.engine.rewrite import copy_source_meta
from fuser.inductor.norm_grad_sums import PASS as GRAD_SUMS_PASS
from fuser.inductor.norm_grad_sums import UPCASTS_PASS as GRAD_UPCASTS_PASS
from fuser.inductor.op_casts import OUTPUT_CASTS_PASS
from fuser.kernels.upcast_linear import TRITON_MAX_OUT  # a LoRA A the rebuild serves: the Triton kernels' rows
from fuser.options import check_fields
from fuser.patterns.base import FLOAT_DTYPES, CastTo, Decline, Pattern, Replacement, Variant
from fuser.patterns.upcast_check import why_not_upcast

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")


@dataclass(frozen=True)
class RmsNormLinearConfig:
    """Which norms the ``rms_norm_linear`` pattern (a norm fused with the projections that read it) takes."""

    lora: bool = False
    """Also take the norms whose output peft's LoRA A adapters read (besides frozen bases): their weight gradients
    rebuild the normalised value from the norm's input and rstd (``fuser::upcast_linear_normed``) instead of saving
    it. Off: it saves memory at some cost in speed. Under full fine-tuning the pattern needs no switch: there it is
    both smaller and faster."""

    def __post_init__(self) -> None:
        check_fields(self, "rms_norm_linear")


@dataclass(frozen=True)
class RmsNormExperimental:
    """What a fused RMSNorm takes in besides the norm (it holds for the norms ``rms_norm_linear`` takes too): each
    kept to compare with the separate kernels it replaced."""

    residual_add: bool = True
    """A residual add of two tensors of one dtype (fp16, bf16 or fp32) and shape whose sum a fused norm reads (every
    decoder layer's ``h = h + attn_out`` before its next norm, under full fine-tuning) becomes one
    ``fuser::add_rms_norm``: the add, its rounding (the residual stream's next value) and the norm in one kernel, and
    in the backward the residual stream's gradient added to the norm's input gradient by the norm's own kernel
    (:func:`add_residuals_into_norms`). The norm reads the sum before its rounding, and the gradients are added in
    fp32 and rounded once: as close to fp32 as the separate add, or closer. Under autocast with fp32 weights (a
    trainer's ``bf16=True`` on an fp32 model) the add sums the fp32 stream and a bf16 projection into fp32: the op
    takes those too, and its step is the step without it, bit for bit. LoRA sums added to the residual are
    lora_sum's."""

    gradient_sums: bool = True
    """A norm's output gradient that the backward graph forms as a sum of two to four terms (the input gradients of
    the q/k/v or gate/up projections the norm feeds) is summed by the norm's backward kernel as it loads the terms,
    in fp32: the sum is not written, read back, or rounded first (:mod:`fuser.inductor.norm_grad_sums`). With it, a
    norm backward whose terms are all half-precision values widened to fp32 (autocast's casts, under fp32 weights)
    reads them unwidened and widens them as it loads them (the post-grad pass ``norm_grad_upcasts``)."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.rms_norm")


h = V("h")
eps = S("eps")

mean_square = OneOf(
    Op("mean", Op("pow", h, 2), (-1,), True),  # Llama: h.pow(2).mean(-1, keepdim=True)
    Op("mean", Op("mul", h, h), (-1,), True),  # h * h
    Op("div", Op("sum", Op("pow", h, 2), (-1,), True), S("n_cols")),  # sum / hidden size
)
variance_eps = Op("add", mean_square, eps)
normed = OneOf(
    Op("mul", h, Op("rsqrt", variance_eps)),  # Llama and most others
    Op("mul", h, Op("to", Op("rsqrt", variance_eps), C("rstd_dtype"))),  # DeepSeek-V4, GLM-5: rsqrt(...).to(x.dtype)
    Op("mul", h, Op("pow", variance_eps, -0.5)),  # Gemma-3n, Gemma-4: pow(var + eps, -0.5)
    Op("div", h, Op("sqrt", variance_eps)),  # h / sqrt(var + eps)
)


@dataclass(frozen=True)
class NormForm:
    # where the model rounds to the input dtype around the weight multiply: "before" it (Llama), "after" it (OLMo-2,
    # Gemma), or None (no weight, or torch's own); what tells the forms apart, though the op rounds once either way
    weight_cast: Literal["before", "after"] | None = None
    functional: bool = False  # torch's rms_norm: its normalized_shape must be the last dim alone
    unit_length: bool = False  # an L2 norm (sum of squares, no division by d): declined


VARIANTS = [
    # Gemma: ((h * rsqrt(...)) * (1 + w.float())).type_as(x), all fp32
    Variant(
        "gemma",
        OptCast(Op("mul", OptCast(normed, "norm_dtype"), Op("add", S("offset"), V("w"))), "out_cast"),
        NormForm(weight_cast="after"),
    ),
    # OLMo-2, Helium, GPT-OSS: (w * (h * rsqrt(...))).to(in_dtype), the weight multiplied in fp32
    Variant("olmo2", Op("to", Op("mul", normed, V("w")), C("out_cast")), NormForm(weight_cast="after")),
    # Llama and most: w * (h * rsqrt(...)).to(in_dtype); also a norm that casts nothing (a no-op cast is optional)
    Variant(
        "llama", OptCast(Op("mul", OptCast(normed, "norm_dtype"), V("w")), "out_cast"), NormForm(weight_cast="before")
    ),
    # nanochat, DeepSeek-V4 parts: no weight
    Variant("no weight", OptCast(normed, "out_cast"), NormForm()),
    # Dory (nGPT), and FLA's l2norm of q/k (Qwen3-Next, Qwen3.5, OLMo-hybrid: (x * x).sum): h * rsqrt(sum(h²) + eps),
    # unit length rather than unit RMS: declined by the check
    Variant(
        "l2 norm",
        Op("mul", h, Op("rsqrt", Op("add", Op("sum", OneOf(Op("pow", h, 2), Op("mul", h, h)), (-1,), True), eps))),
        NormForm(unit_length=True),
        declines=True,
    ),
    # torch.nn.functional.rms_norm and torch.nn.RMSNorm
    Variant(
        "F.rms_norm",
        Op("rms_norm", h, C("normalized_shape"), OneOf(V("w"), None), OneOf(eps, None)),
        NormForm(functional=True),
    ),
]


def check_rms_norm(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    if variant.params.unit_length:
        raise Decline(
            "an L2 norm, h * rsqrt(sum(h²) + eps): the sum of squares is not divided by the hidden size, so it "
            "scales h to unit length, not unit RMS; the fused op computes an RMSNorm only"
        )
    x = strip_exact_upcast(b["h"])
    xt = tensor_meta(x)
    if xt.dtype not in FLOAT_DTYPES:
        raise Decline(f"input dtype {xt.dtype} is not fp16/bf16/fp32 (the fused op computes in fp32)")
    if xt.dim() == 0:
        raise Decline("input is a scalar")
    n_cols = xt.shape[-1]
    if not isinstance(n_cols, int):
        raise Decline("hidden size (last dim) is symbolic")
    if "n_cols" in b and (is_symbolic_scalar(b["n_cols"]) or b["n_cols"] != n_cols):
        raise Decline(f"sum of squares divided by {_number(b['n_cols'])}, not by the hidden size {n_cols}")
    if variant.params.functional and list(b["normalized_shape"]) != [n_cols]:
        raise Decline(f"normalized_shape {b['normalized_shape']} is not the last dim alone ([{n_cols}])")
    eps_value = b.get("eps")
    if eps_value is None:  # F.rms_norm's default
        eps_value = torch.finfo(xt.dtype).eps
    # a symbolic eps (a model with another eps, recompiled) is checked by the value it was traced with
    eps_number = scalar_hint(eps_value)
    if eps_number is None:
        raise Decline(f"eps `{eps_value.name}` is computed from data at run time (its value is not known)")
    if eps_number < 0:
        raise Decline(f"eps {eps_number} is negative")

    w = b.get("w")
    if w is not None:
        w = strip_exact_upcast(w)
        wt = tensor_meta(w)
        if wt.dim() != 1 or wt.shape[0] != n_cols:
            raise Decline(f"weight of shape {tuple(wt.shape)} does not broadcast over the last dim ({n_cols}) alone")
        if wt.dtype not in FLOAT_DTYPES:
            raise Decline(f"weight dtype {wt.dtype} is not fp16/bf16/fp32")

    out = tensor_meta(found.root)
    if out.dim() != xt.dim() or out.dtype not in FLOAT_DTYPES:
        raise Decline(f"result of rank {out.dim()} and dtype {out.dtype} is not a norm of the input")

    # The casts inside the block (the normalised value's to the input dtype before the weight multiply, Llama's and
    # aten's rms_norm's) are not reproduced: Inductor fuses them with the multiply and elides the round trip, and the
    # single rounding of the product is closer to fp32. The op's ``norm_dtype`` stays None. That holds
    # for a cast to a dtype the op computes for; one to fp64 or an integer type computes something else.
    for node in found.nodes[1:]:
        cast = canonical(node)
        if cast is not None and cast.op == "to" and cast.args[1] not in FLOAT_DTYPES:
            raise Decline(f"`{node.name}` inside the norm casts to {cast.args[1]}, not to fp16/bf16/fp32")
    return Replacement(
        torch.ops.fuser.rms_norm.default,
        (x, w, scalar_arg(eps_value), scalar_arg(b.get("offset", 0.0)), None, out.dtype),
        output_index=0,  # (y, rstd)
    )


def _number(value: object) -> str:
    return f"`{value.name}`" if isinstance(value, torch.fx.Node) else str(value)


def norm_of(x: object) -> tuple[torch.fx.Node, torch.fx.Node, tuple] | None:
    """``(norm call, its input h, (norm weight, offset))`` when ``x`` is ``fuser::rms_norm(h, …)[0]`` or
    ``fuser::add_rms_norm(…)[0]`` (h: its rounded sum, output 2) and the norm's output is what its kernel computes
    from h, rstd and the weight (no intermediate rounding, h's dtype); None otherwise."""
    if not (isinstance(x, torch.fx.Node) and x.target is operator.getitem and x.args[1] == 0):
        return None
    norm = x.args[0]
    if not isinstance(norm, torch.fx.Node):
        return None
    if norm.target is torch.ops.fuser.rms_norm.default:
        h, (weight, _, offset, norm_dtype, out_dtype) = norm.args[0], norm.args[1:6]
    elif norm.target is torch.ops.fuser.add_rms_norm.default:
        h, (weight, _, offset, norm_dtype, out_dtype) = None, norm.args[2:7]
    else:
        return None
    if norm_dtype is not None or isinstance(offset, torch.fx.Node):
        return None
    h_dtype = tensor_meta(norm.args[0] if h is None else h).dtype
    if out_dtype not in (None, h_dtype) or tensor_meta(x).dtype != h_dtype:
        return None
    return norm, h, (weight, float(offset))


def norm_output(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    """``node[index]`` (a multi-output op's), reusing a getitem the graph has."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    example = node.meta.get("example_value")
    if isinstance(example, (tuple, list)):
        item.meta["example_value"] = example[index]
    copy_source_meta(node, item)
    return item


def _projection_reader(user: torch.fx.Node, y: torch.fx.Node, config: FuserConfig) -> str | None:
    """None when ``user`` reads ``y`` only as the input of linear projections whose backward does not need ``y``
    saved: a frozen weight (a LoRA base, a frozen model); a trainable one (full fine-tuning), whose weight gradient
    rebuilds ``y`` (``fuser::linear_normed``); or peft's LoRA A (``linear(y.to(fp32), A)``, A of at most 64 rows,
    whose weight gradient rebuilds ``y``: ``fuser::upcast_linear_normed``); else why not, in words."""
    c = canonical(user)
    name = f"`{user.name}`"
    if c is not None and c.op == "linear" and c.args[0] is y:
        return _why_not_rebuilt(user, c.args[1], c.args[2] if len(c.args) > 2 else None, y)
    if c is not None and c.op == "to" and value_readers(user):
        if not config.rms_norm_linear.lora:
            return (
                f"{name} casts the normalised value for LoRA adapters, whose weight gradients would rebuild it: "
                "off by default (rms_norm_linear.lora), so the norm's output is saved as before"
            )
        if not config.enabled("upcast_linear"):
            return f"{name} casts the normalised value for LoRA adapters, and the upcast_linear pattern is off"
        for lora in value_readers(user):
            a = canonical(lora)
            w = tensor_meta(a.args[1]) if a is not None and a.op == "linear" and a.args[0] is user else None
            if w is None or w.dim() != 2 or w.shape[0] > TRITON_MAX_OUT:
                return f"{name} casts the normalised value for `{lora.name}`, which is not a LoRA A projection"
            reason = why_not_upcast(y, c.args[1], a.args[1], lora, a.args[2] if len(a.args) > 2 else None)
            if reason is not None:
                return f"{name} casts the normalised value for `{lora.name}`, which upcast_linear declines: {reason}"
        return None
    return f"{code_at(user)} also reads the normalised value: only linear projections may"


def _why_not_rebuilt(linear: torch.fx.Node, weight: object, bias: object, y: torch.fx.Node) -> str | None:
    """None when ``linear(y, weight, bias)`` leaves nothing of ``y`` saved once it is ``fuser::linear_normed`` (or
    is frozen: then it saves nothing of ``y`` as it is); else why not."""
    w, out = tensor_meta(weight), tensor_meta(linear)
    if w is None or not w.requires_grad:
        return None
    name = f"`{linear.name}`"
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES:
        return f"{name} trains a weight of rank {w.dim()} and dtype {w.dtype}, not a 2-D fp16/bf16/fp32 one"
    if out is None or out.dtype not in FLOAT_DTYPES:
        return f"{name} returns {None if out is None else out.dtype}, not fp16/bf16/fp32"
    b = tensor_meta(bias) if bias is not None else None
    if bias is not None and (b is None or b.dtype not in FLOAT_DTYPES):
        return f"{name} adds a bias that is not an fp16/bf16/fp32 tensor"
    return None


def check_rms_norm_linear(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    """An RMSNorm (any form ``rms_norm`` takes) whose output only linear projections read, none of which needs it
    saved for its backward once the refinements ran: the frozen bases read it in the forward only, trainable ones
    become ``fuser::linear_normed`` after the rewrite (:func:`rebuild_in_projections`), and with
    ``rms_norm_linear.lora`` peft's LoRA A adapters (``upcast_linear``) rebuild it in their weight gradient from the
    norm's input and rstd, which the norm's backward saves anyway (``fuser::upcast_linear_normed``). The op is the
    norm's; such a norm counts here, not under ``rms_norm``. Declines (the norm then counts as ``rms_norm``) where
    anything else reads it (a query of its shape is no read)."""
    replacement = check_rms_norm(found, variant, config)
    y = found.root
    if not value_readers(y):
        raise Decline("nothing reads the normalised value")
    for user in value_readers(y):
        reason = _projection_reader(user, y, config)
        if reason is not None:
            raise Decline(reason)
    return replacement


def _trainable_projections(y: torch.fx.Node, config: FuserConfig) -> list[torch.fx.Node] | None:
    """The linears of a trainable weight that read ``y`` (an RMSNorm's output) when every reader of ``y`` is a
    projection that leaves nothing of it saved (a frozen linear, a trainable one that can rebuild it, a LoRA A that
    rebuilds it: ``fuser::upcast_linear`` with ``rms_norm_linear.lora``); None when anything else reads it (then
    ``y`` is saved anyway, and a rebuild would only add work)."""
    trainable = []
    for user in value_readers(y):
        if user.op == "call_function" and user.target in _LORA_A_OPS and user.args[0] is y:
            if not config.rms_norm_linear.lora:
                return None
            continue
        c = canonical(user)
        if c is None or c.op != "linear" or c.args[0] is not y or y in c.args[1:]:
            return None
        bias = c.args[2] if len(c.args) > 2 else None
        if _why_not_rebuilt(user, c.args[1], bias, y) is not None:
            return None
        if tensor_meta(c.args[1]).requires_grad:
            trainable.append(user)
    return trainable


_LORA_A_OPS = (torch.ops.fuser.upcast_linear.default, torch.ops.fuser.upcast_linear_normed.default)


def _cast_for(graph: torch.fx.Graph, value: object, dtype: torch.dtype, before: torch.fx.Node) -> object:
    """``value`` as ``dtype``: itself where it already is (or is not a tensor), else a ``value.to(dtype)`` inserted
    before ``before``."""
    t = tensor_meta(value)
    if t is None or t.dtype == dtype:
        return value
    with graph.inserting_before(before):
        cast = CastTo(value, dtype).build(graph)
    copy_source_meta(before, cast)
    cast.meta["example_value"] = t.to(dtype)
    return cast


def rebuild_in_projections(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``linear(y, W, b)`` with ``y`` an RMSNorm's output that only projections read and ``W`` trainable →
    ``linear_normed(y, h, rstd, norm weight, offset, W, b, dtype)`` (``fuser/kernels/linear_normed.py``), whose
    backward rebuilds ``y`` from the norm's input and rstd instead of saving it. Returns how many.

    Under autocast (fp32 ``y`` and weights, a bf16 matmul) the casts to the matmul's dtype are the graph's, one
    ``.to`` per projection as autocast's own, not the op body's: Inductor then casts the norm's output once for all
    its projections (their forward casts are one expression) and each weight once, for the forward and the saved
    copy the backward reads, where the op's body cast ``y`` once per projection and each weight a second time, in
    eager kernels, a cast per projection and layer that took measurable time in an autocast step
    (``docs/notes/kernels.md``, autocast casts). The gradients are the same
    values: the op's bf16 dx and dW, cast to fp32 by each ``.to``'s backward, each projection's dx its own term
    of the fp32 sum, as eager autocast sums them."""
    n = 0
    for node in list(graph.nodes):
        found = norm_of(node) if node.op == "call_function" else None
        if found is None:
            continue
        projections = _trainable_projections(node, config)
        if not projections:
            continue
        norm, h, (weight, offset) = found
        h = norm_output(graph, norm, 2) if h is None else h
        rstd = norm_output(graph, norm, 1)
        for linear in projections:
            c = canonical(linear)
            bias = c.args[2] if len(c.args) > 2 else None
            dtype = tensor_meta(linear).dtype
            y, w, b = (_cast_for(graph, v, dtype, linear) for v in (node, c.args[1], bias))
            args = (y, h, rstd, weight, offset, w, b, dtype)
            with graph.inserting_before(linear):
                fused = graph.call_function(torch.ops.fuser.linear_normed.default, args)
            fused.meta.update(linear.meta)
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------
# Refinement: the residual add a norm reads joins the norm's op
# ---------------------------------------------------------------------------------------------------------


def _lora_sum_kept_wide(node: object) -> bool:
    """A ``fuser::lora_sum`` that rounds its sum (peft's order): lora_sum's refinements, which run after this one,
    add such a sum to the residual in fp32 before the norm (so that its rounding does not erase a small LoRA term),
    and take the add themselves."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target is torch.ops.fuser.lora_sum.default
        and not (len(node.args) > 4 and node.args[4])
    )


def _residual_operands(norm: torch.fx.Node, order: dict[torch.fx.Node, int]) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(a, b)`` for ``norm`` (a ``fuser::rms_norm`` call) that normalises a residual add ``a + b`` it can absorb
    into an op in the add's place; raises ``Decline`` otherwise."""
    add = norm.args[0]
    c = canonical(add)
    if c is None or c.op != "add" or len(c.args) != 2:
        raise Decline(f"its input `{getattr(add, 'name', add)}` is not an add (nothing to absorb)")
    a, b = add.args[:2]
    metas = [tensor_meta(v) for v in (a, b, add)]
    if None in metas or not all(isinstance(v, torch.fx.Node) for v in (a, b)):
        raise Decline(f"`{add.name}` adds a value that is not a tensor of the graph")
    dtypes, out = (metas[0].dtype, metas[1].dtype), metas[2].dtype
    # two tensors of one dtype; or, under autocast with fp32 weights, a half-precision projection added into the fp32
    # residual stream (an fp32 sum): the op takes the fp32 one as x, whose dtype its sum keeps
    promoted = out == torch.float32 and sorted(d == out for d in dtypes) == [False, True]
    if out not in FLOAT_DTYPES or not (dtypes == (out, out) or (promoted and set(dtypes) - {out} <= set(HALF_DTYPES))):
        raise Decline(
            f"`{add.name}` adds {dtypes[0]} and {dtypes[1]} into {out}: not two tensors of one fp16/bf16/fp32 dtype, "
            "nor an fp32 and a half-precision one summed in fp32"
        )
    if dtypes[1] == out and dtypes[0] != out:
        a, b = b, a
    if not all(statically_same_shape(t.shape, metas[2].shape) for t in metas[:2]):
        raise Decline(
            f"`{add.name}` broadcasts: {tuple(metas[0].shape)} + {tuple(metas[1].shape)} (the op adds tensors of one "
            "shape)"
        )
    if metas[0].device != metas[1].device:
        raise Decline(f"`{add.name}` adds tensors on different devices")
    wide = [v.name for v in (a, b) if _lora_sum_kept_wide(v)]
    if wide:
        raise Decline(
            f"`{wide[0]}` is a LoRA sum: lora_sum's refinement adds it to the residual in fp32, so that rounding "
            "does not erase a LoRA term smaller than half the residual's ulp"
        )
    norms = [u for u in add.users if u.op == "call_function" and u.target in _NORM_OPS]
    if norms != [norm]:
        raise Decline(f"`{add.name}` feeds {len(norms)} norms: the op absorbs an add into one")
    if add in norm.args[1:]:
        raise Decline(f"`{norm.name}` reads `{add.name}` as another argument too")
    if any(u.target is not operator.getitem for u in norm.users):
        raise Decline(f"`{norm.name}`'s results are read other than by index")
    late = [v.name for v in norm.args[1:] if isinstance(v, torch.fx.Node) and order[v] > order[add]]
    if late:
        raise Decline(f"`{late[0]}`, an argument of the norm, is computed after `{add.name}`")
    # the op takes the add's place: nothing may read (and so perhaps modify in place) the sum before the norm does,
    # but for the replaced norm's own upcast of it, left without users until Inductor drops it
    early = [u.name for u in value_readers(add) if order[u] < order[norm] and not _dead_cast(u)]
    if early:
        raise Decline(f"`{early[0]}` reads `{add.name}` before the norm does")
    return a, b


def _dead_cast(node: torch.fx.Node) -> bool:
    c = canonical(node)
    return c is not None and c.op == "to" and not node.users


def add_residuals_into_norms(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``y, rstd = rms_norm(a + b, …)`` → ``y, rstd, h = add_rms_norm(a, b, …)``
    (``experimental.rms_norm.residual_add``), where the add (``operator.add``, ``torch.add`` or ``Tensor.add``, no
    alpha) sums two tensors of one fp16/bf16/fp32 dtype and one shape (or, under autocast with fp32 weights, an
    fp32 and a half-precision one into an fp32 sum, which the op computes as eager does), and this norm is the only
    one that reads it: its other readers (the residual stream) read ``h``, the same sum rounded once as the add
    rounds it. The op normalises the sum before that rounding, as Inductor computes an add fused with a norm, and
    its backward adds ``h``'s own gradient to the norm's input gradient in fp32 with one rounding
    (``fuser/kernels/rms_norm.py``), so that a decoder layer's residual add costs no kernel of its own either way.
    Covers the norms of ``rms_norm`` and ``rms_norm_linear`` alike (``linear_normed``'s rebuild then reads ``h``); a
    norm given an fp32 ``x_wide``, or whose add sums a LoRA sum (lora_sum's refinements take those), is left as it
    is. Returns how many norms; a declined one is logged at debug level with the reason."""
    if not config.experimental.rms_norm.residual_add:
        return 0
    n = 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    rms_norm = torch.ops.fuser.rms_norm.default
    for norm in [node for node in graph.nodes if node.op == "call_function" and node.target is rms_norm]:
        if norm.kwargs.get("x_wide") is not None or len(norm.args) != 6:
            continue  # the fp32 value a LoRA sum's refinement gave it
        try:
            a, b = _residual_operands(norm, order)
        except Decline as reason:
            log.debug("fuser: rms_norm: `%s` keeps its input apart: %s", norm.name, reason)
            continue
        add = norm.args[0]
        with graph.inserting_after(add):
            fused = graph.call_function(torch.ops.fuser.add_rms_norm.default, (a, b, *norm.args[1:6]))
        with graph.inserting_after(fused):
            total = graph.call_function(operator.getitem, (fused, 2))
        copy_source_meta(norm, fused)
        total.meta.update(add.meta)  # the residual stream's next value: the add's shape, dtype and source line
        example = norm.meta.get("example_value")
        if isinstance(example, (tuple, list)) and "example_value" in add.meta:
            fused.meta["example_value"] = (*example[:2], add.meta["example_value"])
        add.replace_all_uses_with(total, delete_user_cb=lambda user, norm=norm: user is not norm)
        norm.replace_all_uses_with(fused)  # its getitem 0 / 1 (y, rstd) are the fused op's
        graph.erase_node(norm)
        graph.erase_node(add)
        order = {node: i for i, node in enumerate(graph.nodes)}
        n += 1
    return n


_NORM_OPS = (torch.ops.fuser.rms_norm.default, torch.ops.fuser.add_rms_norm.default)


def rebuild_and_add_residuals(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``rms_norm_linear``'s refinements: :func:`rebuild_in_projections`, then, when the ``rms_norm`` pattern (whose
    refinement it is, run after this one) is off, :func:`add_residuals_into_norms` for these norms."""
    n = rebuild_in_projections(graph, config)
    if not config.enabled("rms_norm"):
        n += add_residuals_into_norms(graph, config)
    return n


RMS_NORM = Pattern(
    "rms_norm",
    VARIANTS,
    check_rms_norm,
    anchors=frozenset({"rsqrt", "rms_norm"}),
    after_apply=add_residuals_into_norms,
    post_grad=(GRAD_SUMS_PASS, GRAD_UPCASTS_PASS, OUTPUT_CASTS_PASS),
    experimental_options=RmsNormExperimental,
)

# on by default: under full fine-tuning it lowers the peak and costs no speed (docs/defaults.md, rms_norm_linear); for
# LoRA, RmsNormLinearConfig.lora says why the norms its adapters read are left out
RMS_NORM_LINEAR = Pattern(
    "rms_norm_linear",
    VARIANTS,
    check_rms_norm_linear,
    after_apply=rebuild_and_add_residuals,
    post_grad=(GRAD_SUMS_PASS, GRAD_UPCASTS_PASS, OUTPUT_CASTS_PASS),
    options=RmsNormLinearConfig,
)
