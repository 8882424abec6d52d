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
the add and the norm one op (``fuser::add_rms_norm``, :mod:`fuser.refinements.residual_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
from fuser.engine.canonical import canonical, code_at, strip_exact_upcast, tensor_meta, value_readers
from fuser.engine.match import C, Found, OneOf, Op, OptCast, S, V, is_symbolic_scalar, scalar_arg, scalar_hint
from fuser.inductor.norm_grad_sums import PASS as GRAD_SUMS_PASS
from fuser.inductor.norm_grad_sums import UPCASTS_PASS as GRAD_UPCASTS_PASS
from fuser.inductor.op_casts import OUTPUT_CASTS_PASS
from fuser.kernels.upcast_linear import TRITON_MAX_OUT  # a LoRA A the rebuild serves: the Triton kernels' rows
from fuser.options import check_fields
from fuser.patterns.base import FLOAT_DTYPES, Decline, Pattern, Replacement, Variant
from fuser.patterns.upcast_check import why_not_upcast
from fuser.refinements.norm_projections import REFINEMENT as PROJECTIONS_REBUILT
from fuser.refinements.norm_projections import why_not_rebuilt
from fuser.refinements.residual_norms import REFINEMENT as RESIDUAL_ADD

if TYPE_CHECKING:
    from fuser.config import FuserConfig


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


def _projection_reader(user: torch.fx.Node, y: torch.fx.Node, config: FuserConfig) -> str | None:
    """None when ``user`` reads ``y`` only as the input of linear projections whose backward does not need ``y``
    saved: a frozen weight (a LoRA base, a frozen model); a trainable one (full fine-tuning), whose weight gradient
    rebuilds ``y`` (``fuser::linear_normed``); or peft's LoRA A (``linear(y.to(fp32), A)``, A of at most 64 rows,
    whose weight gradient rebuilds ``y``: ``fuser::upcast_linear_normed``); else why not, in words."""
    c = canonical(user)
    name = f"`{user.name}`"
    if c is not None and c.op == "linear" and c.args[0] is y:
        return why_not_rebuilt(user, c.args[1], c.args[2] if len(c.args) > 2 else None, y)
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


def check_rms_norm_linear(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    """An RMSNorm (any form ``rms_norm`` takes) whose output only linear projections read, none of which needs it
    saved for its backward once the refinements ran: the frozen bases read it in the forward only, trainable ones
    become ``fuser::linear_normed`` after the rewrite (:mod:`fuser.refinements.norm_projections`), and with
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


RMS_NORM = Pattern(
    "rms_norm",
    VARIANTS,
    check_rms_norm,
    anchors=frozenset({"rsqrt", "rms_norm"}),
    after_apply=RESIDUAL_ADD,
    post_grad=(GRAD_SUMS_PASS, GRAD_UPCASTS_PASS, OUTPUT_CASTS_PASS),
    experimental_options=RmsNormExperimental,
)

# on by default: under full fine-tuning it lowers the peak and costs no speed (docs/defaults.md, rms_norm_linear); for
# LoRA, RmsNormLinearConfig.lora says why the norms its adapters read are left out
RMS_NORM_LINEAR = Pattern(
    "rms_norm_linear",
    VARIANTS,
    check_rms_norm_linear,
    after_apply=PROJECTIONS_REBUILT,
    post_grad=(GRAD_SUMS_PASS, GRAD_UPCASTS_PASS, OUTPUT_CASTS_PASS),
    options=RmsNormLinearConfig,
)
