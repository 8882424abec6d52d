"""peft's LoRA output under a half-precision base: ``(base + lora_B(a) · s).to(base dtype)``, fp32 adapter.

peft keeps adapters in fp32 and writes ``result = result + lora_B(lora_A(dropout(x))) * scaling`` followed by
``result.to(torch_result_dtype)``; its bitsandbytes layers (QLoRA) cast the scaled term first and add it in the
base dtype (variant "peft bitsandbytes", computed in that order). The op (``fuser/kernels/lora_sum.py``) computes
that sum and its gradients without the fp32 ``[tokens, out]`` tensors Inductor writes around ``lora_B``. It runs
before the other patterns: the gated-MLP patterns would otherwise absorb the gate and up sums, and they then take
the op's half-precision output as their input instead. On by default since its first GPU measurement (H200,
Llama-3-8B LoRA r16, 4×2048: 13,945 → 15,356 tokens/s; ``benchmarks/results/LOG.md``).
"""

from __future__ import annotations

import torch

import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum)
from fuser._compat import statically_equal
from fuser.engine.canonical import tensor_meta
from fuser.engine.match import C, Found, Op, S, V, scalar_arg, scalar_hint
from fuser.kernels.upcast_linear import HALF_DTYPES, TRITON_MAX_OUT
from fuser.patterns.base import Decline, Pattern, Replacement, Variant

_TERM = Op("mul", Op("linear", V("a"), V("w"), None), S("scale"))
VARIANTS = [
    # peft's Linear: the sum in fp32, then cast to the base dtype
    Variant("peft", Op("to", Op("add", V("base"), _TERM), C("dtype"))),
    # peft's bitsandbytes Linear4bit/8bit (QLoRA): the term cast to the base dtype, then added
    Variant("peft bitsandbytes", Op("add", V("base"), Op("to", _TERM, C("dtype")))),
]


def check_lora_sum(found: Found, variant: Variant) -> Replacement:
    b = found.bindings
    base, a, w, out = (tensor_meta(v) for v in (b["base"], b["a"], b["w"], found.root))
    if base is None or a is None or w is None or out is None:
        raise Decline("a value without shape or dtype metadata")
    if base.dtype not in HALF_DTYPES or b["dtype"] != base.dtype:
        raise Decline(f"the sum of a {base.dtype} base is cast to {b['dtype']} (the op returns the base's half dtype)")
    if a.dtype != torch.float32 or w.dtype != torch.float32:
        raise Decline(f"adapter of dtype {w.dtype} fed {a.dtype} (the op takes an fp32 adapter and input)")
    if w.dim() != 2 or not isinstance(w.shape[1], int) or not 0 < w.shape[1] <= TRITON_MAX_OUT:
        raise Decline(f"weight {tuple(w.shape)}: not a LoRA B of rank ≤ {TRITON_MAX_OUT}")
    if scalar_hint(b["scale"]) is None:  # a symbolic scale (another lora_alpha, recompiled) is passed as it is
        raise Decline(f"the LoRA scaling `{b['scale'].name}` is computed from data at run time")
    expected = (*a.shape[:-1], w.shape[0])
    if len(base.shape) != len(expected) or not all(
        statically_equal(x, y) for x, y in zip(base.shape, expected, strict=True)
    ):
        raise Decline(f"base of shape {tuple(base.shape)}, not a's rows × the adapter's outputs {expected}")
    if base.device != a.device or w.device != a.device:
        raise Decline("base, input and adapter on different devices")
    round_term = variant.name == "peft bitsandbytes"
    if round_term and out.dtype != base.dtype:
        raise Decline(f"the sum is {out.dtype}, not the base's {base.dtype}")
    scale = scalar_arg(b["scale"])
    return Replacement(torch.ops.fuser.lora_sum.default, (b["base"], b["a"], b["w"], scale, round_term))


LORA_SUM = Pattern("lora_sum", VARIANTS, check_lora_sum, runs_first=True)
