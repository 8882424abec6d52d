"""Gated MLP activations: ``act(gate) * up``, as the models write it.

    Llama/Qwen/Mistral   F.silu(gate_proj(x)) * up_proj(x)           separate projections (either operand order)
    hand-written silu    g * torch.sigmoid(g)
    Phi-3, GLM, MoE      gate, up = gate_up.chunk(2, dim=-1)         one packed projection (transformers 5 runs
                                                                     every MoE's experts as one grouped_mm, then
                                                                     chunks: one fused op per MoE layer)
    peft LoRA            gate = base(x) + lora_B(lora_A(x)) * s      the sums are absorbed into the op
    Gemma (GeGLU)        F.gelu(g, approximate="tanh") * u           also exact GELU
    ReGLU, BitNet        F.relu(g) * u, relu(g)² * u                 ReLU and squared-ReLU gates (``reglu``)

One pattern per ``pattern`` of the activation table (:data:`fuser.kernels.activations.TABLE`), with two variants
(packed and separate) per activation of it, from the activation's tree: adding an activation to the table adds its
variants, and its pattern where it names a new one.

Declared in order to decline them, saying why (the fused op computes the table's activation of the raw gate times
the raw up):

    GPT-OSS, MiniMax-M3  gate * sigmoid(alpha * gate) * (up + 1), gate and up clamped: a scaled sigmoid, not silu
    Inkling-2            tanh(gate / c) * c * sigmoid(gate) * softcap(up): a softcapped gate factor

The fused op computes the activation in fp32 and saves gate and up (never the activation or the product) for a
backward that recomputes the activation. Not matched, by construction: ``silu(g) + u``, GPT-2's ``gelu_new``
written as a tanh formula, un-gated MLPs (``mlp_activation``'s); and declined when the activation output is used
anywhere else, or the product feeds anything but a projection. A custom ``torch.autograd.Function`` counts as a
projection when its forward multiplies the product by a matrix: under QLoRA the down projection is bitsandbytes'
``MatMul4Bit``, which Dynamo records as an ``autograd_function_apply`` call.

Two refinements after the rewrite, for every gated pattern: a trainable down projection fed the fused product
recomputes it for its weight gradient (``fuser::linear_gated``, :mod:`fuser.refinements.gated_down_projection`)
instead of saving it (:class:`GatedMLPConfig`, ``FuserConfig.gated_mlp``, ``options={"gated_mlp": {...}}``), and
Inductor's post-grad graphs write the gated backward's gradients over its inputs where nobody can observe it
(``fuser.inductor.gated_mlp_inplace``, this pattern's ``post_grad`` passes; :class:`GatedMLPExperimental`,
``FuserConfig.experimental.gated_mlp``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation*)
from fuser._compat import statically_equal
from fuser.engine.canonical import canonical, code_at, tensor_meta, value_readers
from fuser.engine.match import Found, OneOf, Op, OptCast, S, V, match_tree, scalar_arg, scalar_hint
from fuser.inductor.gated_down_grads import PASS as DOWN_GRADS_PASS
from fuser.inductor.gated_mlp_inplace import PASSES as IN_PLACE_PASSES
from fuser.kernels.activations import BY_NAME, GATED_PATTERNS, ONLY, TABLE, Activation
from fuser.options import check_fields
from fuser.patterns.base import FLOAT_DTYPES, Decline, Pattern, Replacement, Variant
from fuser.refinements.gated_down_projection import DOWN_WEIGHT

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class GatedMLPConfig:
    """What the gated MLP's fused op (every gated pattern's alike: ``swiglu``, ``geglu``, ``reglu``, ...) does
    beyond the forward it replaces."""

    recompute_for_down_weight: bool = True
    """A trainable down projection fed the fused product becomes ``fuser::linear_gated``, whose backward recomputes
    the product for its weight gradient instead of saving it: one ``[tokens, intermediate]`` activation per layer
    fewer."""

    def __post_init__(self) -> None:
        check_fields(self, "gated_mlp")


@dataclass(frozen=True)
class GatedMLPExperimental:
    """How the gated MLP's backward writes its gradients: each way kept to compare with the one it replaced."""

    backward_in_place: bool = True
    """Inductor's post-grad graphs write the gated backward's dgate and dup over gate and up, and add the down
    adapter's dx into the base projection's gradient, where nothing reads them after
    (``fuser.inductor.gated_mlp_inplace``)."""

    backward_writes_product: bool = True
    """Where the down projection recomputes the product for its weight gradient
    (``gated_mlp.recompute_for_down_weight``), the gated backward's kernel writes the product instead, over the
    product's gradient once read: one op, and one pass over gate and up fewer (``fuser.inductor.gated_down_grads``)."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.gated_mlp")


def _maybe_lora(name: str) -> OneOf:
    """``base + lora * s`` (peft's LoRA forward), optionally cast back to the base dtype (peft keeps adapters
    in fp32 under a bf16 base, so its sum is fp32 until ``.to(torch_result_dtype)``), or any tensor."""
    lora_sum = Op("add", V(name), Op("mul", V(f"{name}_lora"), S(f"{name}_scale")))
    return OneOf(OptCast(lora_sum, f"{name}_cast"), V(name))


def _half(index: int) -> Op:
    return Op("getitem", Op("chunk", _maybe_lora("gate_up"), 2, -1), index)


@dataclass(frozen=True)
class GatedForm:
    packed: bool  # gate and up are the halves of one projection's output, taken by the packed op
    activation: str | None = None  # the table's activation the tree matches (None: a declined form)
    # a gated product the fused op does not compute: says why, in words, from the match's bindings (declined)
    unsupported: Callable[[dict[str, Any]], str] | None = None


def _variants(activation: Activation) -> list[Variant]:
    act, name = activation.gate, activation.name
    return [
        # Phi-3, GLM, every transformers-5 MoE: gate and up are the halves of one projection
        Variant("packed", Op("mul", act(_half(0)), _half(1)), GatedForm(packed=True, activation=name)),
        # Llama and most: separate gate and up projections
        Variant(
            "separate",
            Op("mul", act(_maybe_lora("gate")), _maybe_lora("up")),
            GatedForm(packed=False, activation=name),
        ),
    ]


def _number(value: Any) -> str:
    return f"`{value.name}`" if isinstance(value, torch.fx.Node) else f"{value:g}"


def _clamped(node: Any) -> str:
    """`` clamped to [lo, hi]`` when ``node`` is a ``clamp`` (method or function) with constant bounds, else ``""``."""
    if not isinstance(node, torch.fx.Node) or getattr(node.target, "__name__", node.target) not in ("clamp", "clip"):
        return ""
    names = ("min", "max")
    bounds = {**dict(zip(names, node.args[1:], strict=False)), **node.kwargs}
    lo, hi = bounds.get("min"), bounds.get("max")
    if lo is None and hi is None:
        return ""
    if lo is None:
        return f" clamped to ≤ {_number(hi)}"
    if hi is None:
        return f" clamped to ≥ {_number(lo)}"
    return f" clamped to [{_number(lo)}, {_number(hi)}]"


def _offset(node: Any) -> tuple[Any, Any] | None:
    """``(x, c)`` when ``node`` is ``x + c`` with ``c`` a number, else None."""
    c = canonical(node)
    if c is None or c.op != "add":
        return None
    for x, number in (c.args, reversed(c.args)):
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return x, number
    return None


def _softcap_of(node: Any) -> Any:
    """The cap ``c`` when ``node`` is ``tanh(x / c) * c`` (a softcap), else None."""
    found = next(match_tree(_softcap(V("x"), "x"), node), None) if isinstance(node, torch.fx.Node) else None
    return None if found is None else found.bindings["x_cap"]


def _why_scaled_sigmoid(b: dict[str, Any]) -> str:
    """GPT-OSS, MiniMax-M3: ``glu = gate * sigmoid(gate * alpha)``, ``(up + 1) * glu``, gate and up clamped."""
    parts = [f"the activation is gate·sigmoid({_number(b['alpha'])}·gate), a sigmoid of the scaled gate (silu: 1·gate)"]
    up, offset = _offset(b["up"]) or (b["up"], None)
    clamps = [f"{n}{_clamped(x)}" for n, x in (("gate", b["gate"]), ("up", up)) if _clamped(x)]
    if clamps:
        parts.append(" and ".join(clamps) + " before it")
    if offset is not None:
        parts.append(f"up enters as (up + {_number(offset)})")
    return "; ".join(parts) + f": {ONLY}"


def _why_softcapped(b: dict[str, Any]) -> str:
    """Inkling-2: ``tanh(gate / c) * c * sigmoid(gate) * tanh(up / c') * c'``."""
    cap = _number(b["gate_cap"])
    why = f"the gate factor is softcapped, tanh(gate / {cap})·{cap}·sigmoid(gate), not silu(gate) = gate·sigmoid(gate)"
    up_cap = _softcap_of(b["up"])
    if up_cap is not None:
        why += f"; up is softcapped too (cap {_number(up_cap)})"
    return f"{why}: {ONLY}"


def _softcap(x: Any, name: str) -> Op:
    return Op("mul", Op("tanh", Op("div", x, S(f"{name}_cap"))), S(f"{name}_cap"))


# gated products that are none of the op's (see the module docstring): the check declines each, saying why. Each
# tree has one structural match per product (the reasons read ``up``'s offset, clamp or softcap from the graph)
_DECLINED = [
    Variant(
        "scaled sigmoid",
        Op("mul", V("up"), Op("mul", V("gate"), Op("sigmoid", Op("mul", V("gate"), S("alpha"))))),
        GatedForm(packed=False, unsupported=_why_scaled_sigmoid),
        declines=True,
    ),
    Variant(
        "softcapped",
        Op("mul", Op("mul", _softcap(V("gate"), "gate"), Op("sigmoid", V("gate"))), V("up")),
        GatedForm(packed=False, unsupported=_why_softcapped),
        declines=True,
    ),
]


_PROJECTION_TARGETS = ("linear", "matmul", "mm", "addmm", "bmm", "grouped_mm", "dropout")
_PASS_THROUGH_METHODS = ("to", "float", "half", "bfloat16", "contiguous", "view", "reshape", "type_as")


# Inside a custom autograd.Function's forward, the calls that multiply one operand by a matrix, and that operand's
# position. Named exactly, not by substring: here we vouch for code that no nn.Linear stands for.
_MATMUL_FUNCTIONS = {
    torch.nn.functional.linear: 0,  # also torch._C._nn.linear, the same object
    torch.matmul: 0,
    operator.matmul: 0,  # x @ w
    torch.mm: 0,
    torch.bmm: 0,
    torch.addmm: 1,  # addmm(bias, x, w)
}
_MATMUL_METHODS = {"matmul": 0, "mm": 0, "bmm": 0, "__matmul__": 0}
# custom ops by qualified name, so that bitsandbytes need not be importable: its 4-bit GEMM dequantises the packed
# NF4/FP4 matrix B and returns A @ B.T (gemv_4bit: the same for few rows)
_MATMUL_OPS = {"bitsandbytes::gemm_4bit": 0, "bitsandbytes::gemv_4bit": 0}
# reads of a tensor's shape, not of its values: bitsandbytes' forward checks ``A.numel() == 0``, which Dynamo keeps
# in the graph once sizes are dynamic
_METADATA_METHODS = ("size", "dim", "numel", "stride")
_AUTOGRAD_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)


def _non_projection_user(node: torch.fx.Node, depth: int = 0) -> str | None:
    """A user of the product that is not a projection (through casts and reshapes), as text for the report; or None.

    The product of a gated MLP feeds the down projection (and, with LoRA, its ``lora_A``); anything else using
    it (a second branch, a graph output) means the block is not the plain MLP the op is built for; a query of its
    shape is no use of it. A custom autograd.Function is judged by its forward (see
    :func:`_why_autograd_function_is_no_projection`).
    """
    for user in value_readers(node):
        name = str(getattr(user.target, "__name__", user.target))
        if user.op == "call_method" and name in _PASS_THROUGH_METHODS and depth < 4:
            bad = _non_projection_user(user, depth + 1)
            if bad is not None:
                return bad
        elif _AUTOGRAD_FUNCTION_APPLY is not None and user.target is _AUTOGRAD_FUNCTION_APPLY:
            why = _why_autograd_function_is_no_projection(user, node)
            if why is not None:
                return f"`{user.name}` ({why})"
        elif user.op == "call_function" and any(t in name for t in _PROJECTION_TARGETS):
            index = _matmul_input_index(user) or 0  # addmm(bias, x, W)'s x; the first operand of the rest
            operand = user.args[index] if index < len(user.args) else user.kwargs.get("input")
            if operand is not node:
                # the value is the matrix a product multiplies by (``weights @ act(scores)``), not what a projection
                # multiplies: a computed matrix, not an MLP's input to its next layer
                return f"`{user.name}` (as the matrix it multiplies by)"
            continue
        elif (c := canonical(user)) is not None and c.op == "linear" and c.args[0] is node:
            continue  # a custom autograd.Function computing a linear (src/fuser/engine/function_linear.py)
        elif user.op == "call_module":
            continue
        else:
            return f"`{user.name}`"
    return None


def _why_autograd_function_is_no_projection(apply: torch.fx.Node, operand: torch.fx.Node) -> str | None:
    """Why the custom autograd.Function that ``apply`` calls is not a projection of ``operand``; None if it is.

    QLoRA's base layers are bitsandbytes ``Linear4bit``: their matmul is the autograd.Function ``MatMul4Bit``
    (forward: ``gemm_4bit(A, packed_B, ...)``, a dequantise-and-multiply; backward: ``grad @ dequantize(B)``),
    which Dynamo records as ``autograd_function_apply(fwd_body, bwd_body, *operands)`` with the forward and
    backward as nested graphs. From outside, such a call could compute anything, so it is read, not trusted by
    name: it counts as a projection of ``operand`` only if, in its forward graph, every use of that input
    (through casts and reshapes) is the input operand of a matrix product (``linear``, ``matmul``/``@``, ``mm``,
    ``bmm``, ``addmm``, bitsandbytes' ``gemm_4bit``/``gemv_4bit``), saving it for backward, or reading its
    shape. What its backward does is its own business: the fused op only hands it the product and takes back
    its gradient.
    """
    module = apply.graph.owning_module
    body = apply.args[0]
    if module is None or not isinstance(body, torch.fx.Node) or body.op != "get_attr":
        return "a custom autograd.Function whose forward graph is not at hand"
    forward = operator.attrgetter(body.target)(module)
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    operands = list(apply.args[2:])
    if len(inputs) == len(operands) + 1:
        inputs = inputs[1:]  # older torch passes a placeholder ``ctx`` first
    if len(inputs) != len(operands):
        return f"a custom autograd.Function whose forward `{body.target}` takes other inputs than it is given"
    for operand_at, placeholder in zip(operands, inputs, strict=True):
        if operand_at is not operand:
            continue
        bad = _use_other_than_matmul(placeholder)
        if bad is not None:
            return (
                f"a custom autograd.Function whose forward `{body.target}` uses it in {code_at(bad)}, "
                "not as the input of a matrix product"
            )
    return None


def _use_other_than_matmul(value: torch.fx.Node, depth: int = 0) -> torch.fx.Node | None:
    """In a custom autograd.Function's forward graph: a use of ``value`` other than as the input operand of a
    matrix product, saved for backward or read for its shape (through casts and reshapes), or None."""
    for user in value.users:
        if user.op == "call_method" and user.target in _PASS_THROUGH_METHODS and user.args[0] is value and depth < 4:
            bad = _use_other_than_matmul(user, depth + 1)
            if bad is not None:
                return bad
        elif (user.op == "call_method" and user.target in _METADATA_METHODS) or (
            user.op == "call_function" and user.target is torch.numel
        ):
            continue
        elif user.op == "output":
            # the forward returns ((outputs...), (saved for backward...)): returning the value itself is no product
            returned = user.args[0]
            if not (isinstance(returned, (tuple, list)) and len(returned) == 2 and _count_uses(returned[1], value)):
                return user
            if _count_uses(returned[0], value):
                return user
        else:
            index = _matmul_input_index(user)
            args = list(user.args)
            if index is None or index >= len(args) or args[index] is not value:
                return user
            if _count_uses((user.args, user.kwargs), value) != 1:  # x @ x is no multiplication by a matrix
                return user
    return None


def _matmul_input_index(node: torch.fx.Node) -> int | None:
    """Position of the operand that ``node`` multiplies by a matrix, if it is a matrix product; else None."""
    if node.op == "call_method":
        return _MATMUL_METHODS.get(node.target)
    if node.op != "call_function":
        return None
    # an OpOverload (torch.ops.ns.op.default) names its op in its schema, a packet (torch.ops.ns.op) directly
    qualified = getattr(getattr(node.target, "_schema", None), "name", None)
    qualified = qualified or getattr(node.target, "_qualified_op_name", None)
    if qualified is not None:
        return _MATMUL_OPS.get(qualified)
    try:
        return _MATMUL_FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable callable
        return None


def _count_uses(args: object, value: torch.fx.Node) -> int:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, lambda n: found.append(n) if n is value else None)
    return len(found)


def _check(found: Found, variant: Variant, config: Any) -> Replacement:
    b = found.bindings
    if variant.params.unsupported is not None:
        raise Decline(variant.params.unsupported(b))
    # first whether the match is this activation at all (relu2's power): the reason to give where it is not
    activation = variant.params.activation
    if BY_NAME[activation].check is not None:
        BY_NAME[activation].check(b)
    out = tensor_meta(found.root)
    other = _non_projection_user(found.root)
    if other is not None:
        raise Decline(f"the product is also used by {other}, not only by a projection")
    bases = ["gate_up"] if variant.params.packed else ["gate", "up"]
    tensors = {n: tensor_meta(b[n]) for n in bases + [f"{n}_lora" for n in bases] if n in b}
    if any(t.dtype not in FLOAT_DTYPES for t in tensors.values()):
        raise Decline(f"dtypes {[str(t.dtype) for t in tensors.values()]} are not all fp16/bf16/fp32")
    base_dtypes = {tensors[n].dtype for n in bases}
    if len(base_dtypes | {out.dtype}) != 1:
        raise Decline(f"gate/up/result dtypes differ ({[str(d) for d in base_dtypes]} → {out.dtype})")
    for n in bases:
        if f"{n}_lora" not in b:
            continue
        if scalar_hint(b[f"{n}_scale"]) is None:  # a symbolic scale (another lora_alpha) is passed as it is
            raise Decline(f"{n} LoRA scaling `{b[f'{n}_scale'].name}` is computed from data at run time")
        # the sum's dtype: the explicit cast, or type promotion of base and LoRA term; it must be the base's
        lora_dtype = tensors[f"{n}_lora"].dtype
        sum_dtype = b.get(f"{n}_cast") or torch.promote_types(tensors[n].dtype, lora_dtype)
        if sum_dtype != tensors[n].dtype:
            raise Decline(f"{n} LoRA sum is {sum_dtype}, not the base dtype {tensors[n].dtype}")
        if variant.params.packed and lora_dtype != tensors[n].dtype:
            raise Decline(f"packed gate_up LoRA term of dtype {lora_dtype} (the packed op takes one dtype)")
    shapes = [tuple(t.shape) for t in tensors.values()]
    first = shapes[0]
    for shape in shapes[1:]:
        if len(shape) != len(first) or not all(statically_equal(a, c) for a, c in zip(shape, first, strict=True)):
            raise Decline(f"gate/up shapes differ: {shapes}")
    if not isinstance(shapes[0][-1], int):
        raise Decline("intermediate size (last dim) is symbolic")
    if variant.params.packed:
        if shapes[0][-1] % 2:
            raise Decline(f"packed gate_up has an odd last dim {shapes[0][-1]}")
        return Replacement(
            torch.ops.fuser.gated_activation_packed.default,
            (b["gate_up"], b.get("gate_up_lora"), scalar_arg(b.get("gate_up_scale", 1.0)), activation),
            output_index=0,
        )
    return Replacement(
        torch.ops.fuser.gated_activation.default,
        (
            b["gate"],
            b["up"],
            b.get("gate_lora"),
            b.get("up_lora"),
            scalar_arg(b.get("gate_scale", 1.0)),
            scalar_arg(b.get("up_scale", 1.0)),
            activation,
        ),
        output_index=0,
    )


# what a gated pattern has beyond its activations' variants: the forms it declares to decline, and the ops whose
# unmatched occurrences its near-miss report explains
_DECLINED_FORMS = {"swiglu": _DECLINED}
_ANCHORS = {"swiglu": frozenset({"silu"})}


def _gated_pattern(name: str) -> Pattern:
    """The gated pattern ``name``: the variants of the table's activations of that pattern, in table order."""
    variants = [v for activation in TABLE if activation.pattern == name for v in _variants(activation)]
    return Pattern(
        name,
        variants + _DECLINED_FORMS.get(name, []),
        _check,
        anchors=_ANCHORS.get(name, frozenset()),
        after_apply=DOWN_WEIGHT[name],
        post_grad=(*IN_PLACE_PASSES, DOWN_GRADS_PASS),  # the fused down grads take in-place backwards too
        options=GatedMLPConfig,
        experimental_options=GatedMLPExperimental,
        options_name="gated_mlp",  # one set of options for every activation
    )


# the gated patterns by name (``.counts`` keys), in table order: the order they are registered in
GATED = {name: _gated_pattern(name) for name in GATED_PATTERNS}
SWIGLU, GEGLU, REGLU = GATED["swiglu"], GATED["geglu"], GATED["reglu"]
