"""peft's LoRA output under a half-precision base: ``(base + lora_B(a) · s).to(base dtype)``, fp32 adapter.

peft keeps adapters in fp32 and writes ``result = result + lora_B(lora_A(dropout(x))) * scaling`` followed by
``result.to(torch_result_dtype)``; its bitsandbytes layers (QLoRA) cast the scaled term first and add it in the
base dtype (variant "peft bitsandbytes", computed in that order). The op (``src/fuser/kernels/lora_sum.py``) computes
that sum and its gradients without the fp32 ``[tokens, out]`` tensors Inductor writes around ``lora_B``. It runs
before the other patterns: the gated-MLP patterns would otherwise absorb the gate and up sums, and they then take
the op's half-precision output as their input instead. On by default since its first GPU measurement
(``docs/defaults.md``, ``lora_sum``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum)
from fuser._compat import statically_same_shape
from fuser.engine.canonical import canonical, tensor_meta
from fuser.engine.match import C, Found, Op, S, V, scalar_arg, scalar_hint
from fuser.engine.rewrite import copy_source_meta
from fuser.inductor.lora_gated_sums import PASS as GATED_SUMS_PASS
from fuser.kernels.upcast_linear import TRITON_MAX_OUT
from fuser.options import check_fields
from fuser.patterns.base import (
    HALF_DTYPES,
    ArgExpr,
    CastTo,
    Decline,
    NotApplicable,
    Pattern,
    Replacement,
    Variant,
)
from fuser.refinements.lora_sums import REFINEMENT

if TYPE_CHECKING:
    from fuser.config import FuserConfig


@dataclass(frozen=True)
class LoraSumExperimental:
    """How a LoRA sum is computed where it must be stored rounded or kept in fp32: the ways measured against each
    other."""

    fp32_base: bool = True
    """A sum that no fused consumer reads unrounded (v_proj's, read by attention) adds its LoRA term to the base
    linear's fp32 output (``fuser::linear_wide``: cuBLAS's accumulator, not rounded) and rounds once. Rounding the
    base to bf16 first erases every LoRA term below half an ulp of it (a bf16 base is on the bf16 grid, so the second
    rounding returns it), as eager and Inductor do: at LoRA learning rates, most of v_proj's update. Costs one fp32
    ``[tokens, out]`` write and read per such sum."""

    gated_in_slices: bool = False
    """The fp32 gate and up sums a gated activation computes its product from (kept unrounded, for the reason
    ``fp32_base`` gives) are formed and consumed in row slices of at most 256 MiB each
    (``fuser::gated_activation_of_lora_sums``, put in place by a post-grad pass, forward and checkpointed recompute
    alike) instead of as two whole ``[tokens, intermediate]`` fp32 tensors. The same kernels compute the same values,
    bit for bit. Off: it lowers the peak only where those sums set it (long, checkpointed sequences), and costs a
    little speed."""

    fp32_autocast_adapters: bool = True
    """Under autocast, a LoRA sum computes its adapter's two matmuls from the fp32 adapter itself (``a`` in fp32,
    ``tf32x3`` dots on the Triton path), as peft computes them without autocast: more precise than autocast. Off:
    from the adapter rounded to autocast's dtype, as autocast computes them (its dtype's dots, fp32 sums, ``a``
    rounded), the term and the sum rounded once where autocast rounds three times; meant to be faster, not yet
    timed in a compiled Trainer step (``docs/defaults.md``): kept off."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.lora_sum")


@dataclass(frozen=True)
class LoraSumForm:
    round_term: bool  # the scaled LoRA term is rounded to the base dtype before the add, not the sum after it
    autocast: bool = False  # the adapter's matmuls ran under autocast: the tree also holds lora_A and its upcast


_TERM = Op("mul", Op("linear", V("a"), V("w"), None), S("scale"))
# under autocast (``Trainer(bf16=True)``) peft's ``lora_B(lora_A(x.float()))`` leaves both matmuls to autocast, which
# runs them in the half dtype on rounded copies of the fp32 adapter: the tree takes lora_A's linear and its upcast
_AUTOCAST_TERM = Op("mul", Op("linear", Op("linear", Op("to", V("x"), C("upcast")), V("wa"), None), V("w"), None),
                    S("scale"))  # fmt: skip
VARIANTS = [
    # peft's Linear: the sum in fp32, then cast to the base dtype
    Variant("peft", Op("to", Op("add", V("base"), _TERM), C("dtype")), LoraSumForm(round_term=False)),
    # peft's bitsandbytes Linear4bit/8bit (QLoRA): the term cast to the base dtype, then added
    Variant("peft bitsandbytes", Op("add", V("base"), Op("to", _TERM, C("dtype"))), LoraSumForm(round_term=True)),
    # peft's Linear under autocast: every value in the half dtype, the final cast a no-op
    Variant(
        "peft autocast",
        Op("to", Op("add", V("base"), _AUTOCAST_TERM), C("dtype")),
        LoraSumForm(round_term=False, autocast=True),
    ),  # fmt: skip
]


@dataclass(frozen=True)
class UpcastLinearOf(ArgExpr):
    """``fuser::upcast_linear(source, weight)``: an autocast LoRA sum's ``a``, lora_A's output computed from the half
    input. ``weight`` is the fp32 adapter (``a`` in fp32, as peft computes it without autocast), or its copy
    rounded to the input's dtype (a :class:`CastTo`: ``a`` as autocast computes it)."""

    source: torch.fx.Node
    weight: torch.fx.Node | CastTo
    allow_triton: bool

    def build(self, graph: torch.fx.Graph) -> torch.fx.Node:
        weight = self.weight.build(graph) if isinstance(self.weight, ArgExpr) else self.weight
        call = graph.call_function(torch.ops.fuser.upcast_linear.default, (self.source, weight, None),
                                   {"allow_triton": self.allow_triton})  # fmt: skip
        x, w = tensor_meta(self.source), tensor_meta(weight)
        call.meta["example_value"] = x.new_empty((*x.shape[:-1], w.shape[0]), dtype=w.dtype)
        copy_source_meta(self.source, call)
        return call


def _autocast_adapter(found: Found, fp32: bool) -> UpcastLinearOf:
    """An autocast LoRA sum's ``a`` as the op takes it (see :data:`_AUTOCAST_TERM`), or Decline.

    Autocast computes ``lora_B(lora_A(x))`` from bf16 copies of ``x`` and of both fp32 adapters, rounding ``a``, the
    product and the scaled term to bf16 and adding the term to the base in bf16. With ``fp32``
    (``experimental.lora_sum.fp32_autocast_adapters``, the default) the ops compute from the fp32 adapters
    themselves, ``a`` unrounded: the values of peft's graph without autocast, with fp32 gradient sums. Without it,
    from the same rounded copies of the adapters autocast makes (their dots in bf16, sums in fp32, ``a`` rounded),
    the term and the sum rounded once; each adapter's gradient is rounded to bf16 and cast to fp32, as autocast's
    is."""
    b = found.bindings
    x, wa, w, base = (tensor_meta(b[k]) for k in ("x", "wa", "w", "base"))
    linears = {canonical(n).args[1]: n for n in found.nodes if (c := canonical(n)) is not None and c.op == "linear"}
    outs = (tensor_meta(linears.get(b["wa"])), tensor_meta(linears.get(b["w"])))
    if x is None or wa is None or any(t is None for t in outs):
        raise Decline("a value without shape or dtype metadata")
    if x.dtype not in HALF_DTYPES or b["upcast"] != torch.float32:
        raise Decline(f"lora_A reads a {x.dtype} input cast to {b['upcast']} (the op takes a half input made fp32)")
    if wa.dtype != torch.float32 or wa.dim() != 2 or wa.shape[0] != w.shape[1]:
        raise Decline(f"lora_A's weight {tuple(wa.shape)} of {wa.dtype}: not an fp32 adapter of lora_B's rank")
    if any(t.dtype != base.dtype for t in outs):
        raise Decline(
            f"the adapter's matmuls return {outs[0].dtype} and {outs[1].dtype}, not the base's {base.dtype} "
            "(an autocast dtype other than the base's)"
        )
    return UpcastLinearOf(b["x"], b["wa"] if fp32 else CastTo(b["wa"], x.dtype), True)


def check_lora_sum(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    """The op runs upcast_linear's Triton kernels: ``config.experimental.upcast_linear.triton`` switches both (its
    refinements carry ``allow_triton`` over to the ops they make)."""
    b = found.bindings
    base, w, out = (tensor_meta(v) for v in (b["base"], b["w"], found.root))
    if base is None or w is None or out is None:
        raise Decline("a value without shape or dtype metadata")
    if base.dtype not in HALF_DTYPES:
        raise NotApplicable(
            f"the base layer's output is {base.dtype}, not bf16/fp16: the op fuses fp32 LoRA adapters into a "
            "half-precision base, and a LoRA sum all in one dtype has nothing for it to save"
        )
    if b["dtype"] != base.dtype:
        raise Decline(f"the sum of a {base.dtype} base is cast to {b['dtype']} (the op returns the base's half dtype)")
    if w.dim() != 2 or not isinstance(w.shape[1], int) or not 0 < w.shape[1] <= TRITON_MAX_OUT:
        raise Decline(f"weight {tuple(w.shape)}: not a LoRA B of rank ≤ {TRITON_MAX_OUT}")
    if w.dtype != torch.float32:
        raise Decline(f"adapter of dtype {w.dtype} (the op takes an fp32 adapter)")
    if variant.params.autocast:
        fp32 = config.experimental.lora_sum.fp32_autocast_adapters
        adapter = dataclasses.replace(
            _autocast_adapter(found, fp32), allow_triton=config.experimental.upcast_linear.triton
        )
        x = tensor_meta(adapter.source)
        dtype = torch.float32 if fp32 else x.dtype
        a = x.new_empty((*x.shape[:-1], w.shape[1]), dtype=dtype)
        b = {**b, "a": adapter, "w": b["w"] if fp32 else CastTo(b["w"], dtype)}
    else:
        a = tensor_meta(b["a"])
        if a is None:
            raise Decline("a value without shape or dtype metadata")
        if a.dtype != torch.float32:
            raise Decline(f"an fp32 adapter fed {a.dtype} (the op takes an fp32 input)")
    if scalar_hint(b["scale"]) is None:  # a symbolic scale (another lora_alpha, recompiled) is passed as it is
        raise Decline(f"the LoRA scaling `{b['scale'].name}` is computed from data at run time")
    expected = (*a.shape[:-1], w.shape[0])
    if not statically_same_shape(base.shape, expected):
        raise Decline(f"base of shape {tuple(base.shape)}, not a's rows × the adapter's outputs {expected}")
    if base.device != a.device or w.device != a.device:
        raise Decline("base, input and adapter on different devices")
    round_term = variant.params.round_term
    if round_term and out.dtype != base.dtype:
        raise Decline(f"the sum is {out.dtype}, not the base's {base.dtype}")
    scale = scalar_arg(b["scale"])
    return Replacement(
        torch.ops.fuser.lora_sum.default,
        (b["base"], b["a"], b["w"], scale, round_term),
        kwargs={"allow_triton": config.experimental.upcast_linear.triton},
        emits_also=("upcast_linear",) if variant.params.autocast else (),
    )


LORA_SUM = Pattern(
    "lora_sum",
    VARIANTS,
    check_lora_sum,
    runs_first=True,
    after_apply=REFINEMENT,
    post_grad=(GATED_SUMS_PASS,),
    experimental_options=LoraSumExperimental,
)
