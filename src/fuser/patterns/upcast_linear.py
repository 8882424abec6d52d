"""A linear layer fed an upcast copy of its input: ``linear(x.to(fp32), W)`` with ``x`` in bf16/fp16.

peft writes every LoRA adapter of a half-precision model this way (adapters kept in fp32, ``lora_A(x.float())``);
so do fp32 routers and heads. Inductor saves the fp32 copy for the weight gradient; the fused op saves ``x``
(half the bytes) and casts it again in the backward. The values are the same: the same cast and the same fp32
matmul (``src/fuser/kernels/upcast_linear.py``).

After the rewrite (``after_apply``, :mod:`fuser.refinements.upcast_linears`), an upcast linear whose input is a
gated MLP's fused product (peft's LoRA A of the down projection: ``lora_A(act(gate) * up)``) becomes
``fuser::upcast_linear_gated``: its backward recomputes the product from gate and up, which the gated op saves for
its own backward anyway, so the product itself ([tokens, intermediate], the widest activation of a layer) is no
longer saved. Not when the gated op absorbed LoRA sums (then it saves the sums, not its inputs).

Upcast linears that read the same input (peft's LoRA A of q/k/v, of gate/up: one normalised activation each)
then become one op on their weights concatenated (``torch.cat``, at most 64 rows in all), its output sliced back
per adapter: the input is read once instead of once per adapter in the forward and in the weight gradient, and
the backward writes one ``dx`` (the adapters' terms summed in fp32, rounded once) instead of one per adapter, each
rounded and then added. Fewer, wider kernels and op calls. The values are the same dots; ``x``'s gradient is
rounded once instead of once per adapter.

The recompute is :class:`UpcastLinearConfig`'s ``recompute_gated_input`` (``FuserConfig.upcast_linear``,
``options={"upcast_linear": {...}}``), a memory-for-speed trade. The kernels and the grouping are
:class:`UpcastLinearExperimental`'s (``FuserConfig.experimental.upcast_linear``), kept to compare: ``triton`` is
passed to the op as ``allow_triton=`` (and to lora_sum's, which runs the same kernels), ``group_shared_inputs``
decides the grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.upcast_linear  # noqa: F401  (registers torch.ops.fuser.upcast_linear)
from fuser.engine.match import C, Found, OneOf, Op, V
from fuser.options import check_fields
from fuser.patterns.base import Pattern, Replacement, Variant
from fuser.patterns.upcast_check import why_not_upcast
from fuser.refinements.upcast_linears import REFINEMENT

if TYPE_CHECKING:
    from fuser.config import FuserConfig


@dataclass(frozen=True)
class UpcastLinearConfig:
    """What the upcast linear (peft's LoRA A under a half-precision base) saves for its backward."""

    recompute_gated_input: bool = True
    """An upcast linear fed a gated MLP's fused product (peft's LoRA A of the down projection) recomputes the product
    in its backward instead of saving it."""

    def __post_init__(self) -> None:
        check_fields(self, "upcast_linear")


@dataclass(frozen=True)
class UpcastLinearExperimental:
    """The upcast linear's (and lora_sum's) kernels, and the grouping of adapters that share an input: each kept to
    compare with what it replaced."""

    triton: bool = True
    """On a GPU, weights of at most 64 rows (LoRA ranks) take fuser's Triton kernels
    (``src/fuser/kernels/upcast_linear.py``; lora_sum's op runs the same kernels); ``False`` keeps cuBLAS's fp32
    matmuls, which are much slower for such thin weights."""

    group_shared_inputs: bool = True
    """Upcast linears of one input (peft's LoRA A of q/k/v, of gate/up) become one op on their concatenated weights
    (at most 64 rows), its output sliced per adapter: the input read once each way, one ``dx``."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.upcast_linear")


VARIANTS = [Variant("upcast input", Op("linear", Op("to", V("x"), C("dtype")), V("w"), OneOf(V("b"), None)))]


def check_upcast_linear(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    bias = b.get("b")
    decline = why_not_upcast(b["x"], b["dtype"], b["w"], found.root, bias)
    if decline is not None:
        raise decline
    allow_triton = {"allow_triton": config.experimental.upcast_linear.triton}
    return Replacement(torch.ops.fuser.upcast_linear.default, (b["x"], b["w"], bias), allow_triton)


UPCAST_LINEAR = Pattern(
    "upcast_linear",
    VARIANTS,
    check_upcast_linear,
    after_apply=REFINEMENT,
    options=UpcastLinearConfig,
    experimental_options=UpcastLinearExperimental,
)
