"""Gated MLP activations: ``act(gate) * up``, as the models write it.

    Llama/Qwen/Mistral   F.silu(gate_proj(x)) * up_proj(x)           separate projections (either operand order)
    hand-written silu    g * torch.sigmoid(g)
    Phi-3, GLM, MoE      gate, up = gate_up.chunk(2, dim=-1)         one packed projection (transformers 5 runs
                                                                     every MoE's experts as one grouped_mm, then
                                                                     chunks: one fused op per MoE layer)
    peft LoRA            gate = base(x) + lora_B(lora_A(x)) * s      the sums are absorbed into the op
    Gemma (GeGLU)        F.gelu(g, approximate="tanh") * u           also exact GELU

The fused op computes the activation in fp32 and saves gate and up (never the activation or the product) for a
backward that recomputes the activation. Not matched, by construction: ``silu(g) + u``, ``relu(g) * u``,
GPT-2's ``gelu_new`` written as a tanh formula, un-gated MLPs; and declined when the activation output is used
anywhere else, or the product feeds anything but a projection.
"""

from __future__ import annotations

import torch

import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation*)
from fuser._compat import statically_equal
from fuser.engine.canonical import tensor_meta
from fuser.engine.match import C, Found, OneOf, Op, OptCast, S, V
from fuser.patterns.base import FLOAT_DTYPES, Decline, Pattern, Replacement, Variant


def _maybe_lora(name: str) -> OneOf:
    """``base + lora * s`` (peft's LoRA forward), optionally cast back to the base dtype (peft keeps adapters
    in fp32 under a bf16 base, so its sum is fp32 until ``.to(torch_result_dtype)``), or any tensor."""
    lora_sum = Op("add", V(name), Op("mul", V(f"{name}_lora"), S(f"{name}_scale")))
    return OneOf(OptCast(lora_sum, f"{name}_cast"), V(name))


def _half(index: int) -> Op:
    return Op("getitem", Op("chunk", _maybe_lora("gate_up"), 2, -1), index)


def _variants(activation) -> list[Variant]:
    return [
        # Phi-3, GLM, every transformers-5 MoE: gate and up are the halves of one projection
        Variant("packed", Op("mul", activation(_half(0)), _half(1))),
        # Llama and most: separate gate and up projections
        Variant("separate", Op("mul", activation(_maybe_lora("gate")), _maybe_lora("up"))),
    ]


def _silu(g):
    return OneOf(Op("silu", g), Op("mul", g, Op("sigmoid", g)))


def _gelu(g):
    return Op("gelu", g, C("approximate"))


_GELU_MODES = {"tanh": "gelu_tanh", "none": "gelu"}


_PROJECTION_TARGETS = ("linear", "matmul", "mm", "addmm", "bmm", "grouped_mm", "dropout")
_PASS_THROUGH_METHODS = ("to", "float", "half", "bfloat16", "contiguous", "view", "reshape", "type_as")


def _non_projection_user(node: torch.fx.Node, depth: int = 0) -> torch.fx.Node | None:
    """A user of the product that is not a projection (through casts and reshapes), or None.

    The product of a gated MLP feeds the down projection (and, with LoRA, its ``lora_A``); anything else using
    it (a second branch, a graph output) means the block is not the plain MLP the op is built for.
    """
    for user in node.users:
        name = str(getattr(user.target, "__name__", user.target))
        if user.op == "call_method" and name in _PASS_THROUGH_METHODS and depth < 4:
            bad = _non_projection_user(user, depth + 1)
            if bad is not None:
                return bad
        elif user.op == "call_function" and any(t in name for t in _PROJECTION_TARGETS):
            continue
        elif user.op == "call_module":
            continue
        else:
            return user
    return None


def _check(found: Found, variant: Variant, activation: str) -> Replacement:
    b = found.bindings
    out = tensor_meta(found.root)
    other = _non_projection_user(found.root)
    if other is not None:
        raise Decline(f"the product is also used by `{other.name}`, not only by a projection")
    if activation != "silu":
        if b.get("approximate") not in _GELU_MODES:
            raise Decline(f"gelu approximate={b.get('approximate')!r} is not 'tanh' or 'none'")
        activation = _GELU_MODES[b["approximate"]]
    bases = ["gate_up"] if variant.name == "packed" else ["gate", "up"]
    tensors = {n: tensor_meta(b[n]) for n in bases + [f"{n}_lora" for n in bases] if n in b}
    if any(t.dtype not in FLOAT_DTYPES for t in tensors.values()):
        raise Decline(f"dtypes {[str(t.dtype) for t in tensors.values()]} are not all fp16/bf16/fp32")
    base_dtypes = {tensors[n].dtype for n in bases}
    if len(base_dtypes | {out.dtype}) != 1:
        raise Decline(f"gate/up/result dtypes differ ({[str(d) for d in base_dtypes]} → {out.dtype})")
    for n in bases:
        if f"{n}_lora" not in b:
            continue
        # the sum's dtype: the explicit cast, or type promotion of base and LoRA term; it must be the base's
        lora_dtype = tensors[f"{n}_lora"].dtype
        sum_dtype = b.get(f"{n}_cast") or torch.promote_types(tensors[n].dtype, lora_dtype)
        if sum_dtype != tensors[n].dtype:
            raise Decline(f"{n} LoRA sum is {sum_dtype}, not the base dtype {tensors[n].dtype}")
        if variant.name == "packed" and lora_dtype != tensors[n].dtype:
            raise Decline(f"packed gate_up LoRA term of dtype {lora_dtype} (the packed op takes one dtype)")
    shapes = [tuple(t.shape) for t in tensors.values()]
    first = shapes[0]
    for shape in shapes[1:]:
        if len(shape) != len(first) or not all(statically_equal(a, c) for a, c in zip(shape, first, strict=True)):
            raise Decline(f"gate/up shapes differ: {shapes}")
    if not isinstance(shapes[0][-1], int):
        raise Decline("intermediate size (last dim) is symbolic")
    if variant.name == "packed":
        if shapes[0][-1] % 2:
            raise Decline(f"packed gate_up has an odd last dim {shapes[0][-1]}")
        return Replacement(
            torch.ops.fuser.gated_activation_packed.default,
            (b["gate_up"], b.get("gate_up_lora"), float(b.get("gate_up_scale", 1.0)), activation),
            output_index=0,
        )
    return Replacement(
        torch.ops.fuser.gated_activation.default,
        (
            b["gate"],
            b["up"],
            b.get("gate_lora"),
            b.get("up_lora"),
            float(b.get("gate_scale", 1.0)),
            float(b.get("up_scale", 1.0)),
            activation,
        ),
        output_index=0,
    )


SWIGLU = Pattern(
    "swiglu", _variants(_silu), lambda found, variant: _check(found, variant, "silu"), anchors=frozenset({"silu"})
)
GEGLU = Pattern("geglu", _variants(_gelu), lambda found, variant: _check(found, variant, "gelu"), anchors=frozenset())
