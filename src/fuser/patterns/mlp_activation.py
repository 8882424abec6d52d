"""The activation of an un-gated MLP, ``fc2(act(fc1(x) + b))``, as the models write it.

    GPT-NeoX, Falcon     F.gelu(h)                                    exact GELU
    StarCoder2, Gemma-ish F.gelu(h, approximate="tanh")               gelu_pytorch_tanh
    GPT-2, Phi, GPT-J    0.5 * h * (1 + tanh(√(2/π) * (h + 0.044715 * h³)))   ``gelu_new`` written out: GELU tanh
    CLIP-style           h * sigmoid(1.702 * h)                       QuickGELU
    OPT                  F.relu(h)
    Arcee, Primer        relu(h)² (``square`` or ``pow(·, 2)``)       squared ReLU
    (any)                silu(h), h * sigmoid(h)

``h`` is the first projection's output: ``F.linear(x, W, b)`` (nn.Linear; its bias add joins the op: the linear is
rebuilt without it, and the op adds it in fp32 and sums its gradient in the backward's own pass), ``h0 + b`` (a
bias added by hand, Falcon's ``FalconLinear``), or anything else (GPT-2's ``Conv1D`` is ``addmm(b, x, W)``, whose
bias stays there). The fused op (``fuser::bias_activation``) computes the activation in fp32, rounds once to the
root's dtype (from the graph's metadata, so autocast's dtypes are kept), and saves the pre-activation alone; its
backward recomputes the activation's derivative from it.

Only where the activation feeds projections alone (the second linear, through casts, reshapes or dropout):
``act(gate) * up`` is a gated MLP's (``swiglu``, ``geglu``, ``reglu``), and an activation read by anything else
(a norm after it, a second branch) is declined, saying what reads it. ``tanh``-formula constants, QuickGELU's 1.702
and the ReLU's power are checked, not assumed: another number declines with the number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import fuser.kernels.bias_activation  # noqa: F401  (registers torch.ops.fuser.bias_activation)
from fuser.engine.canonical import canonical, tensor_meta
from fuser.engine.match import C, Found, OneOf, Op, S, V, scalar_hint
from fuser.engine.rewrite import copy_source_meta
from fuser.patterns.base import FLOAT_DTYPES, ArgExpr, Decline, Pattern, Replacement, Variant
from fuser.patterns.gated_mlp import _non_projection_user

if TYPE_CHECKING:
    from fuser.config import FuserConfig


@dataclass(frozen=True)
class LinearWithoutBias(ArgExpr):
    """``F.linear(source, weight)``: the first projection rebuilt without its bias, which the fused op adds."""

    source: Any
    weight: Any
    linear: torch.fx.Node  # the projection it stands for: its metadata (shape, dtype, source line)

    def build(self, graph: torch.fx.Graph) -> torch.fx.Node:
        node = graph.call_function(torch.nn.functional.linear, (self.source, self.weight))
        copy_source_meta(self.linear, node)
        if "example_value" in self.linear.meta:
            node.meta["example_value"] = self.linear.meta["example_value"]
        return node


# the first projection's output, with its bias where the op can take it over
pre = OneOf(
    Op("linear", V("x"), V("w"), V("b")),  # nn.Linear with a bias
    Op("add", V("x"), V("b")),  # Falcon: h @ W.T + b
    V("x"),  # no bias, or one the op does not take (GPT-2's addmm)
)


@dataclass(frozen=True)
class ActivationForm:
    activation: str  # the op's activation, or the family the check resolves from the bindings ("gelu", "sigmoid")


_inner_cubic = Op("add", pre, Op("mul", S("c"), Op("pow", pre, S("cube"))))  # h + 0.044715 * h³

VARIANTS = [
    # GPT-NeoX, Falcon (exact), StarCoder2 (tanh)
    Variant("F.gelu", Op("gelu", pre, C("approximate")), ActivationForm("gelu")),
    # GPT-2, Phi, GPT-J: NewGELUActivation, 0.5 * h * (1 + tanh(√(2/π) * (h + 0.044715 * h³)))
    Variant(
        "gelu_new",
        Op("mul", Op("mul", S("half"), pre), Op("add", S("one"), Op("tanh", Op("mul", S("k"), _inner_cubic)))),
        ActivationForm("gelu_tanh"),
    ),
    # QuickGELU: h * sigmoid(1.702 * h)
    Variant("quick_gelu", Op("mul", pre, Op("sigmoid", Op("mul", S("alpha"), pre))), ActivationForm("sigmoid")),
    Variant("silu", OneOf(Op("silu", pre), Op("mul", pre, Op("sigmoid", pre))), ActivationForm("silu")),
    # Arcee, Primer: relu(h)², as torch.square or pow
    Variant("relu2", Op("pow", Op("relu", pre), S("power")), ActivationForm("relu2")),
    # OPT
    Variant("relu", Op("relu", pre), ActivationForm("relu")),
]

_GELU_NEW = {"half": 0.5, "one": 1.0, "k": math.sqrt(2.0 / math.pi), "c": 0.044715, "cube": 3.0}
_GELU_MODES = {"none": "gelu", "tanh": "gelu_tanh"}


def _activation(b: dict[str, Any], form: ActivationForm) -> str:
    """The op's activation for the matched form, its captured numbers checked; raises ``Decline`` otherwise."""
    if form.activation == "gelu":
        if b["approximate"] not in _GELU_MODES:
            raise Decline(f"gelu approximate={b['approximate']!r} is not 'tanh' or 'none'")
        return _GELU_MODES[b["approximate"]]
    if form.activation == "gelu_tanh":
        for name, want in _GELU_NEW.items():
            got = scalar_hint(b[name])
            if got is None or not math.isclose(got, want, rel_tol=1e-6):
                raise Decline(
                    f"the tanh formula has {got} where GELU's tanh approximation, 0.5·h·(1 + tanh(√(2/π)·(h + "
                    f"0.044715·h³))), has {want:g}"
                )
        return "gelu_tanh"
    if form.activation == "sigmoid":
        alpha = scalar_hint(b["alpha"])
        if alpha is not None and math.isclose(alpha, 1.702, rel_tol=1e-6):
            return "gelu_quick"
        if alpha == 1:
            return "silu"
        raise Decline(f"h·sigmoid({alpha}·h) is neither QuickGELU (1.702) nor silu (1)")
    if form.activation == "relu2" and scalar_hint(b["power"]) != 2:
        raise Decline(f"relu(h) to the power {b['power']}: the op computes relu or its square")
    return form.activation


def check_mlp_activation(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    activation = _activation(b, variant.params)
    other = _non_projection_user(found.root)
    if other is not None:
        raise Decline(f"the activation is also used by {other}, not only by a projection")
    linear = next((n for n in found.nodes if _is_linear(n)), None) if "w" in b else None
    h = linear if linear is not None else b["x"]  # the pre-activation, before the bias the op adds
    ht, out = tensor_meta(h), tensor_meta(found.root)
    if ht is None or ht.dtype not in FLOAT_DTYPES or out.dtype not in FLOAT_DTYPES:
        raise Decline(f"dtypes {None if ht is None else ht.dtype} → {out.dtype} are not fp16/bf16/fp32")
    if ht.dim() == 0 or tuple(ht.shape) != tuple(out.shape):
        raise Decline(f"the pre-activation's shape {tuple(ht.shape)} is not the result's {tuple(out.shape)}")
    n_cols = ht.shape[-1]
    if not isinstance(n_cols, int):
        raise Decline("the intermediate size (last dim) is symbolic")
    bias = b.get("b")
    source: Any = b["x"]
    if bias is not None:
        bt = tensor_meta(bias)
        if bt is None or bt.dim() != 1 or bt.shape[0] != n_cols or bt.dtype not in FLOAT_DTYPES:
            raise Decline(f"the added `{bias.name}` is not a bias (a 1-D fp16/bf16/fp32 tensor of the last dim)")
        if linear is not None:  # nn.Linear: rebuilt without its bias, which the op adds
            w = tensor_meta(b["w"])
            if w is None or w.dim() != 2:
                raise Decline("the first projection's weight is not a matrix")
            source = LinearWithoutBias(b["x"], b["w"], linear)
    return Replacement(torch.ops.fuser.bias_activation.default, (source, bias, activation, out.dtype))


def _is_linear(node: torch.fx.Node) -> bool:
    c = canonical(node)
    return c is not None and c.op == "linear"


MLP_ACTIVATION = Pattern("mlp_activation", VARIANTS, check_mlp_activation, anchors=frozenset({"gelu", "relu"}))
