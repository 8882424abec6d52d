"""LayerNorm, as the models write it.

Every variant centres ``h`` (the input, or its fp32 upcast) on its mean over the last dim, divides by the root of
the biased variance plus eps, and optionally applies a weight and a bias:

    torch       F.layer_norm(x, (d,), w, b, eps) / nn.LayerNorm    GPT-2, GPT-NeoX, OPT, Falcon, Phi, StarCoder2,
                                                                   BLOOM, and OLMo's F.layer_norm(x.float(), ...)
    by hand     u = x.mean(-1, keepdim=True)                       the BERT-era ``LayerNorm`` classes
                s = (x - u).pow(2).mean(-1, keepdim=True)
                w * ((x - u) / torch.sqrt(s + eps)) + b
    Cohere      w.float() * ((x - u) * rsqrt(s + eps)), .to(in_dtype), no bias
    (any)       x.var(-1, keepdim=True, unbiased=False) for the variance; no weight or bias

The fused op (``fuser::layer_norm``) computes the statistics and the affine map in fp32 and rounds once, to the
root node's dtype read from the graph's metadata: under autocast, where eager runs ``F.layer_norm`` in fp32 on a
half-precision input, that is fp32, as eager's. A cast inside the block (the normalised value's to the input dtype
before the weight multiply) is computed in fp32, as Inductor computes it fused. Declined, saying why: a variance
with Bessel's correction (``var()``'s default, unbiased), a ``normalized_shape`` over more than the last dim, a
weight or bias that does not broadcast over the last dim alone (a residual added after the norm is not its bias).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import fuser.kernels.layer_norm  # noqa: F401  (registers torch.ops.fuser.layer_norm)
from fuser.engine.canonical import canonical, strip_exact_upcast, tensor_meta
from fuser.engine.match import C, Found, OneOf, Op, OptCast, S, V, scalar_arg, scalar_hint
from fuser.patterns.base import FLOAT_DTYPES, Decline, Pattern, Replacement, Variant

if TYPE_CHECKING:
    from fuser.config import FuserConfig

h = V("h")
eps = S("eps")

centred = Op("sub", h, Op("mean", h, (-1,), True))  # x - x.mean(-1, keepdim=True)
variance = OneOf(
    Op("mean", Op("pow", centred, 2), (-1,), True),  # (x - u).pow(2).mean(-1, keepdim=True)
    Op("mean", Op("mul", centred, centred), (-1,), True),  # ((x - u) * (x - u)).mean(...)
    Op("var", h, (-1,), C("correction"), True),  # x.var(-1, keepdim=True, unbiased=False)
)
variance_eps = Op("add", variance, eps)
normed = OptCast(
    OneOf(
        Op("mul", centred, Op("rsqrt", variance_eps)),  # Cohere: (x - u) * rsqrt(var + eps)
        Op("div", centred, Op("sqrt", variance_eps)),  # BERT-era: (x - u) / sqrt(var + eps)
    ),
    "norm_dtype",
)

VARIANTS = [
    # torch.nn.functional.layer_norm and torch.nn.LayerNorm (its weight and bias each optional)
    Variant(
        "F.layer_norm",
        Op("layer_norm", h, C("normalized_shape"), OneOf(V("w"), None), OneOf(V("b"), None), eps),
        None,
    ),
    # the BERT-era LayerNorm classes: w * normed + b
    Variant("by hand", OptCast(Op("add", Op("mul", normed, V("w")), V("b")), "out_cast"), None),
    # Cohere: w.float() * normed, then .to(in_dtype); no bias
    Variant("no bias", OptCast(Op("mul", normed, V("w")), "out_cast"), None),
    # no weight, no bias (elementwise_affine=False written out)
    Variant("no weight", OptCast(normed, "out_cast"), None),
]


def _affine(value: object, name: str, n_cols: int) -> torch.fx.Node | None:
    """The weight or bias node (through exact upcasts), checked to be a 1-D float tensor of the hidden size."""
    if value is None:
        return None
    node = strip_exact_upcast(value)
    t = tensor_meta(node)
    if t is None or t.dim() != 1 or t.shape[0] != n_cols:
        shape = None if t is None else tuple(t.shape)
        raise Decline(f"{name} of shape {shape} does not broadcast over the last dim ({n_cols}) alone")
    if t.dtype not in FLOAT_DTYPES:
        raise Decline(f"{name} dtype {t.dtype} is not fp16/bf16/fp32")
    return node


def check_layer_norm(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    x = strip_exact_upcast(b["h"])
    xt = tensor_meta(x)
    if xt.dtype not in FLOAT_DTYPES:
        raise Decline(f"input dtype {xt.dtype} is not fp16/bf16/fp32 (the fused op computes in fp32)")
    if xt.dim() == 0:
        raise Decline("input is a scalar")
    n_cols = xt.shape[-1]
    if not isinstance(n_cols, int):
        raise Decline("hidden size (last dim) is symbolic")
    if "normalized_shape" in b and list(b["normalized_shape"]) != [n_cols]:
        raise Decline(f"normalized_shape {b['normalized_shape']} is not the last dim alone ([{n_cols}])")
    if "correction" in b and b["correction"] != 0:
        raise Decline(
            f"the variance is var() with correction {b['correction']} (unbiased: divided by d - 1); LayerNorm's "
            "divides by the hidden size (unbiased=False)"
        )
    eps_number = scalar_hint(b["eps"])
    if eps_number is None:
        raise Decline(f"eps `{b['eps'].name}` is computed from data at run time (its value is not known)")
    if eps_number < 0:
        raise Decline(f"eps {eps_number} is negative")
    weight, bias = _affine(b.get("w"), "weight", n_cols), _affine(b.get("b"), "bias", n_cols)
    out = tensor_meta(found.root)
    if out is None or out.dim() != xt.dim() or out.dtype not in FLOAT_DTYPES:
        raise Decline("the result is not a norm of the input (another rank or a dtype other than fp16/bf16/fp32)")
    for node in found.nodes[1:]:
        cast = canonical(node)
        if cast is not None and cast.op == "to" and cast.args[1] not in FLOAT_DTYPES:
            raise Decline(f"`{node.name}` inside the norm casts to {cast.args[1]}, not to fp16/bf16/fp32")
    return Replacement(
        torch.ops.fuser.layer_norm.default,
        (x, weight, bias, scalar_arg(b["eps"]), out.dtype),
        output_index=0,  # (y, mean, rstd)
    )


LAYER_NORM = Pattern("layer_norm", VARIANTS, check_layer_norm, anchors=frozenset({"layer_norm"}))
