"""Rotary position embeddings, as the models write them.

    Llama and most    x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., h:], x[..., :h])
    Phi, GPT-NeoX     partial: cat(rope(x[..., :R]), x[..., R:])   (only the first R channels rotate)
    GLM, Helium       interleaved: rotate_half(x) = stack(-x[..., 1::2], x[..., 0::2]).flatten(-2)
                      (cos/sin repeat-interleaved by the model), also partial

cos and sin are whatever the model computed (``attention_scaling`` included) and broadcast ``[B|1, 1, T, R]``.
The result dtype is eager's type promotion of x and cos/sin, passed to the op as ``out_dtype``: under autocast
with fp32 master weights (HF Trainer ``bf16=True``) the projections give bf16 q/k, the rotary embedding fp32
cos/sin, and the rotation an fp32 result; the op reads both as they are and computes in fp32.
q and k of one attention layer rotated by the same cos/sin become one fused op (counted once); a tensor whose
partner does not share cos/sin is rotated by the same op alone.

    DeepSeek-V3       cat([x1*c - x2*s, x2*c + x1*s]) with x1 = x[..., 0::2], x2 = x[..., 1::2]: interleaved
                      pairs in, halves out, no ``neg``; c, s of width R/2

    Llama-4 text      view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis[:, :, None]).flatten(3)
                      on [B, T, H, D]: the op runs on the [B, H, T, D] view, with cos/sin taken from freqs_cis
    DeepSeek-V2       the same product with rotations shaped before it, freqs_cis.unsqueeze(1) ([B|1, 1, T, D/2],
                      shared by q and k) on [B, H, T, D]; or [B|1, T, 1, D/2] on [B, T, H, D]

    GPT-OSS           x1, x2 = chunk(x, 2, -1); cat([x1*c - x2*s, x2*c + x1*s]): rotate_half's rotation written
                      on the two halves, without a ``neg``; c, s of width R/2 (spread over both halves for the op)

    NanoChat          x * cos + cat(x2, -x1) * sin: rotate_half with the sign on the other half, which is
                      -rotate_half(x); that is x * cos + rotate_half(x) * (-sin), exactly (negation is exact, and
                      (-a)(-b) = ab), so the op gets -sin: a rotation the other way

Multimodal and 2-D rotary embeddings are these same forms; what differs is how cos/sin are built, which is
position-only data the rotation reads as it is (the op reads cos/sin at each output channel, never assuming a
pair's two channels share an angle, so any section layout is computed exactly):

    Qwen2-VL text     M-RoPE: cos/sin of the (t, h, w) positions, split into sections along the channels and
    (2.5-VL, 3-VL)    re-concatenated (Qwen3-VL: interleaved), in the rotary embedding or before the rotation;
                      the rotation is the Llama form on [B|1, 1, T, D] cos/sin
    Qwen2-VL vision   (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype) on q [T, H, D] (all tokens of
    (2.5-VL, 3-VL,    all images, no batch dim), cos/sin [T, 1, D] from the (h, w) positions: the op runs on the
    GLM-4V, ...)      [1, H, T, D] view, reads q in its own dtype (the upcast is exact, and the op computes in
                      fp32) and rounds once to the dtype cast back to, as eager does
    Pixtral vision    the Llama form with cos/sin [1, T, D] (unsqueezed at dim 0) broadcast over [B, H, T, D]
    Inkling-2 vision  the Qwen2-VL vision form with the interleaved rotation written through the pairs' dim:
                      x1, x2 = x.view(..., -1, 2).unbind(-1); stack((-x2, x1), -1).flatten(-2)

Any form may end in an explicit ``.to(dtype)`` of its result: the op rounds its fp32 result once to that dtype
(eager rounds to the promoted dtype first, where that is narrower, and the op is then the more accurate).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.fx

import fuser.kernels.rope  # noqa: F401  (registers torch.ops.fuser.rope)
from fuser._compat import statically_same_shape
from fuser.engine.canonical import canonical, module_path, strip_exact_upcast, tensor_meta
from fuser.engine.match import Found, Op, OptCast, S, V
from fuser.inductor.op_casts import OUTPUT_CASTS_PASS, ROPE_GRAD_UPCASTS_PASS
from fuser.patterns.base import FLOAT_DTYPES, ArgExpr, Decline, EmptyLike, Pattern, Replacement, Variant

if TYPE_CHECKING:
    from fuser.config import FuserConfig

Node = torch.fx.Node


def _rotate_half(x):
    return Op("cat", Op("neg", Op("slice_last", x, S("h"), S("r_end"), 1)), Op("slice_last", x, 0, S("h"), 1), -1)


def _rotate_half_flipped(x):
    """NanoChat: ``cat(x2, -x1)``, the negated ``rotate_half``."""
    return Op("cat", Op("slice_last", x, S("h"), S("r_end"), 1), Op("neg", Op("slice_last", x, 0, S("h"), 1)), -1)


def _rotate_interleaved(x):
    pairs = Op(
        "stack", Op("neg", Op("slice_last", x, 1, S("r_odd_end"), 2)), Op("slice_last", x, 0, S("r_even_end"), 2), -1
    )
    return Op("flatten", pairs, -2, -1)


def _rotate_pairwise(x):
    """Inkling-2's vision tower (SAM-3's lineage): ``x1, x2 = x.view(..., -1, 2).unbind(-1)``,
    ``stack((-x2, x1), -1).flatten(-2)``, the interleaved rotation through the pairs' own dim."""
    pairs = Op("unbind", Op("split_pairs", x), -1)
    return Op("flatten", Op("stack", Op("neg", Op("getitem", pairs, 1)), Op("getitem", pairs, 0), -1), -2, -1)


def _rope(x, rotate):
    return Op("add", Op("mul", x, V("cos")), Op("mul", rotate(x), V("sin")))


def _pairs_to_halves():
    """DeepSeek-V3 lineage: interleaved pairs in, halves out, no ``neg``; cos/sin of width R/2 (one per pair)."""
    x1, x2 = Op("slice_last", V("x"), 0, S("r_even_end"), 2), Op("slice_last", V("x"), 1, S("r_odd_end"), 2)
    first = Op("sub", Op("mul", x1, V("cos")), Op("mul", x2, V("sin")))
    second = Op("add", Op("mul", x2, V("cos")), Op("mul", x1, V("sin")))
    return Op("cat", first, second, -1)


def _chunked_halves():
    """GPT-OSS: ``x1, x2 = chunk(x, 2, -1)``, ``cat([x1*c - x2*s, x2*c + x1*s])``; cos/sin of width R/2."""
    x1, x2 = Op("getitem", Op("chunk", V("x"), 2, -1), 0), Op("getitem", Op("chunk", V("x"), 2, -1), 1)
    first = Op("sub", Op("mul", x1, V("cos")), Op("mul", x2, V("sin")))
    second = Op("add", Op("mul", x2, V("cos")), Op("mul", x1, V("sin")))
    return Op("cat", first, second, -1)


def _complex(freqs):
    """Llama-4 text, DeepSeek-V2: ``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs)
    .flatten(3)`` with complex per-pair rotations ``freqs`` broadcast over the heads."""
    z = Op("view_as_complex", Op("split_pairs", V("x")))
    rotated = Op("mul", z, freqs)
    return OptCast(Op("flatten", Op("view_as_real", rotated), -2, -1), "out_cast")


def _partial(rotate):
    rot = Op("slice_last", V("x"), 0, S("R"), 1)
    return Op("cat", _rope(rot, rotate), Op("slice_last", V("x"), S("R"), S("D"), 1), -1)


@dataclass(frozen=True)
class RopeForm:
    # the op's layout: rotate_half's halves, even/odd pairs, or DeepSeek-V3's pairs in and halves out
    layout: Literal["half", "interleaved", "pairs_to_halves"]
    complex_freqs: bool = False  # rotations as complex numbers on [B, T, H, D] (Llama-4): its own check
    negated_sin: bool = False  # the model's rotate is -rotate_half (NanoChat): the op gets -sin
    # the complex rotations come already shaped 4-D, size 1 on the heads' dim (DeepSeek-V2): the layout follows it
    freqs_shaped: bool = False
    # cos/sin of width R/2, one per pair of channels that rotate together (DeepSeek-V3's pairs, GPT-OSS's halves)
    half_width_cos: bool = False


def _cast_back(tree):
    """``tree``, optionally followed by an explicit ``.to(dtype)`` of its result (Qwen2-VL's vision blocks cast the
    fp32 rotation back to q's dtype); binds ``out_cast``."""
    return OptCast(tree, "out_cast")


VARIANTS = [
    Variant("half, partial", _cast_back(_partial(_rotate_half)), RopeForm("half")),
    Variant("interleaved, partial", _cast_back(_partial(_rotate_interleaved)), RopeForm("interleaved")),
    Variant("half", _cast_back(_rope(V("x"), _rotate_half)), RopeForm("half")),
    Variant("half, sign flipped", _cast_back(_rope(V("x"), _rotate_half_flipped)), RopeForm("half", negated_sin=True)),
    Variant("interleaved", _cast_back(_rope(V("x"), _rotate_interleaved)), RopeForm("interleaved")),
    Variant("interleaved, unbound pairs", _cast_back(_rope(V("x"), _rotate_pairwise)), RopeForm("interleaved")),
    Variant("pairs to halves", _cast_back(_pairs_to_halves()), RopeForm("pairs_to_halves", half_width_cos=True)),
    # GPT-OSS: rotate_half's rotation on chunk()'s halves, cos/sin of width R/2
    Variant("halves, chunked", _cast_back(_chunked_halves()), RopeForm("half", half_width_cos=True)),
    Variant("complex", _complex(Op("unsqueeze", V("freqs"), -2)), RopeForm("interleaved", complex_freqs=True)),
    # DeepSeek-V2: freqs_cis.unsqueeze(1) once, before q's and k's products
    Variant("complex, shaped", _complex(V("freqs")), RopeForm("interleaved", complex_freqs=True, freqs_shaped=True)),
]


@dataclass(frozen=True)
class RepeatHalves(ArgExpr):
    """``cat([source, source], -1)``: per-pair cos/sin of width R/2 spread over both halves of width R."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_function(torch.cat, ([self.source, self.source],), {"dim": -1})


@dataclass(frozen=True)
class Negated(ArgExpr):
    """``-source``: the sin of a rotation written with ``-rotate_half`` (NanoChat), as the op's ``rotate_half``
    form reads it."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_function(torch.neg, (self.source,))


@dataclass(frozen=True)
class Transposed12(ArgExpr):
    """``source.transpose(1, 2)``: a ``[B, T, H, D]`` tensor viewed as ``[B, H, T, D]`` (no copy)."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return graph.call_method("transpose", (self.source, 1, 2))


def transposed_back(graph: torch.fx.Graph, output: Node) -> Node:
    """The op's ``[B, H, T, D]`` output as the ``[B, T, H, D]`` the block returns (no copy)."""
    return graph.call_method("transpose", (output, 1, 2))


@dataclass(frozen=True)
class Unsqueezed(ArgExpr):
    """``source`` with ``dims`` size-1 dims in front: a tensor of fewer than 4 dims, which eager broadcasts from the
    right (q/k ``[T, H, D]`` of a vision tower, Pixtral's cos/sin ``[1, T, R]``), as the 4-D view the op reads
    (no copy)."""

    source: Node
    dims: int

    def build(self, graph: torch.fx.Graph) -> Node:
        out = self.source
        for _ in range(self.dims):
            out = graph.call_method("unsqueeze", (out, 0))
        return out


@dataclass(frozen=True)
class ViewedBack:
    """The op's 4-D output as the block returned it: ``[B, H, T, D]`` transposed back to ``[B, T, H, D]``
    (``transpose``), then the ``lead`` size-1 dims that :class:`Unsqueezed` put in front of q/k dropped."""

    transpose: bool
    lead: int

    def __call__(self, graph: torch.fx.Graph, output: Node) -> Node:
        if self.transpose:
            output = transposed_back(graph, output)
        for _ in range(self.lead):
            output = graph.call_method("squeeze", (output, 0))
        return output


@dataclass(frozen=True)
class InterleavedFromComplex(ArgExpr):
    """The real (``part=0``) or imaginary (``part=1``) part of complex per-pair rotations ``[B|1, T, R/2]``,
    repeated for both channels of each pair and broadcast over heads: ``[B|1, 1, T, R]`` (cos or sin). Rotations
    already shaped 4-D (``[B|1, 1, T, R/2]``, or ``[B|1, T, 1, R/2]`` to be transposed) keep their shape
    (``shaped``); ``transpose`` views the result's dims 1 and 2 swapped."""

    source: Node
    part: int
    shaped: bool = False
    transpose: bool = False

    def build(self, graph: torch.fx.Graph) -> Node:
        parts = graph.call_function(torch.view_as_real, (self.source,))
        one = graph.call_function(operator.getitem, (parts, (Ellipsis, self.part)))
        both = graph.call_method("repeat_interleave", (one, 2), {"dim": -1})
        if self.transpose:
            return graph.call_method("transpose", (both, 1, 2))
        return both if self.shaped else graph.call_method("unsqueeze", (both, 1))


@dataclass(frozen=True)
class UpcastStripped(ArgExpr):
    """``source`` read through its exact upcasts (``x.float()`` of a half x is x), looked through when the op is
    built, not when it is matched: where another match has meanwhile replaced the cast (a q/k norm whose match ends
    in its ``type_as``), ``source`` is that match's fused result and is read as it is; the node before the cast was
    inside that match and is gone."""

    source: Node

    def build(self, graph: torch.fx.Graph) -> Node:
        return strip_exact_upcast(self.source)


def check_complex_rope(found: Found, form: RopeForm) -> Replacement:
    b = found.bindings
    xt, ft, out = tensor_meta(strip_exact_upcast(b["x"])), tensor_meta(b["freqs"]), tensor_meta(found.root)
    x = UpcastStripped(b["x"])
    if xt.dim() != 4 or not isinstance(xt.shape[-1], int):
        raise Decline(f"complex RoPE expects a 4-D [batch, seq, heads, head_dim] tensor, got {tuple(xt.shape)}")
    head_dim = xt.shape[-1]
    # Llama-4: [B|1, T, D/2], unsqueezed in the block on [B, T, H, D] (the op runs on its [B, H, T, D] view);
    # shaped before the block (DeepSeek-V2): size 1 on the heads' dim, 1 ([B, H, T, D]) or 2 ([B, T, H, D])
    heads_second = form.freqs_shaped and ft.dim() == 4 and _broadcast_over(b["freqs"], 1)
    want = f"[B|1, 1, T, {head_dim // 2}] or [B|1, T, 1, {head_dim // 2}]" if form.freqs_shaped else None
    if form.freqs_shaped and not (heads_second or (ft.dim() == 4 and _broadcast_over(b["freqs"], 2))):
        raise Decline(f"rotations of shape {tuple(ft.shape)} vary over heads: expected {want}")
    rank = 4 if form.freqs_shaped else 3
    if ft.dtype != torch.complex64 or ft.dim() != rank or ft.shape[-1] != head_dim // 2 or ft.requires_grad:
        want = want or f"[B|1, T, {head_dim // 2}]"
        raise Decline(f"rotations of shape {tuple(ft.shape)} {ft.dtype} are not complex64 {want}")
    if xt.dtype not in FLOAT_DTYPES:
        raise Decline(f"input dtype {xt.dtype} is not one the fused op computes for ({_dtype_names()})")
    # the product is complex64 (fp32 parts) whatever x was: its result, or the explicit cast of it, is rounded
    # once to the output dtype, which the op does too
    if out.dtype not in FLOAT_DTYPES:
        raise Decline(f"result dtype {out.dtype} is not one the fused op writes ({_dtype_names()})")
    shaped, transpose = form.freqs_shaped, not heads_second
    cos, sin = (InterleavedFromComplex(b["freqs"], part, shaped, transpose and shaped) for part in (0, 1))
    return Replacement(
        torch.ops.fuser.rope.default,
        (Transposed12(x) if transpose else x, EmptyLike(x), cos, sin, head_dim, form.layout, out.dtype),
        output_index=0,
        output_adapter=transposed_back if transpose else None,
    )


def check_rope(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    form = variant.params
    if form.complex_freqs:
        return check_complex_rope(found, form)
    b = found.bindings
    xt = tensor_meta(b["x"])
    # [B, H, T, D] / [B, T, H, D] (text decoders), or [T, H, D]: a vision tower's tokens of all its images, no batch
    if xt.dim() not in (3, 4):
        raise Decline(
            f"expects q/k of 4 dims ([batch, heads, seq, head_dim] or [batch, seq, heads, head_dim]) or of 3 "
            f"([seq, heads, head_dim], a vision tower's), got shape {tuple(xt.shape)}"
        )
    head_dim = xt.shape[-1]
    if not isinstance(head_dim, int):
        raise Decline("head_dim is symbolic")
    rotary_dim = b.get("R", head_dim)
    if "D" in b and b["D"] != head_dim:
        raise Decline(f"pass-through slice ends at {b['D']}, not at head_dim {head_dim}")
    if "h" in b and (2 * b["h"] != rotary_dim or b["r_end"] != rotary_dim):
        raise Decline(f"rotate_half splits at {b['h']}:{b['r_end']}, not at the halves of {rotary_dim}")
    if "r_odd_end" in b and (b["r_odd_end"] != rotary_dim or b["r_even_end"] != rotary_dim):
        raise Decline("interleaved pairs do not cover the rotary channels")
    if rotary_dim % 2 or rotary_dim <= 0 or rotary_dim > head_dim:
        raise Decline(f"rotary dim {rotary_dim} is not an even size within head_dim {head_dim}")
    cos_width = rotary_dim // 2 if form.half_width_cos else rotary_dim
    for name in ("cos", "sin"):
        t = tensor_meta(b[name])
        if t.dim() > xt.dim():
            # M-RoPE's cos/sin [3, B, T, D] used as they are, one position axis per section not picked
            raise Decline(
                f"{name} of shape {tuple(t.shape)} has more dims than q/k's {tuple(xt.shape)}: eager broadcasts q/k "
                f"over the extra dims, several rotations of q/k rather than one"
            )
        if t.dim() == 0 or t.shape[-1] != cos_width:
            raise Decline(f"{name} of shape {tuple(t.shape)} does not match the rotary dim {rotary_dim} (last dim)")
        if t.dtype not in FLOAT_DTYPES:
            raise Decline(f"{name} is {t.dtype}: the fused op reads {name} of {_dtype_names()}")
        if t.requires_grad:
            raise Decline(f"{name} requires grad (trained rotary frequencies): the fused op computes none for it")
    # eager broadcasts cos/sin against q/k from the right, and the op reads 4-D views of all three, size-1 dims put
    # in front: [B, H, T, D] with cos/sin [B|1, 1, T, R] (unsqueeze_dim=1, most models; Pixtral's [1, T, R]), or
    # [B, T, H, D] with cos/sin [B|1, T, 1, R] (unsqueeze_dim=2: GPT-J, CodeGen, the DeepSeek-V3.2 indexer; a
    # vision tower's [T, H, D] with [T, 1, R]): the op runs on the [B, H, T, D] view of the latter and its output
    # is viewed back
    cos_lead, sin_lead = (4 - tensor_meta(b[name]).dim() for name in ("cos", "sin"))
    heads_second = _broadcast_over(b["cos"], 1, cos_lead) and _broadcast_over(b["sin"], 1, sin_lead)
    heads_third = not heads_second and _broadcast_over(b["cos"], 2, cos_lead) and _broadcast_over(b["sin"], 2, sin_lead)
    if not (heads_second or heads_third):
        shapes = tuple(tensor_meta(b["cos"]).shape), tuple(tensor_meta(b["sin"]).shape)
        raise Decline(
            f"cos/sin vary over heads (shapes {shapes[0]}, {shapes[1]}): expected [B|1, 1, T, R] or [B|1, T, 1, R] "
            "(or fewer leading dims)"
        )
    out = tensor_meta(found.root)
    # the op writes q/k's shape: cos/sin that broadcast q/k to a larger result are not a rotation of q/k
    if not statically_same_shape(out.shape, xt.shape):
        raise Decline(
            f"cos/sin of shape {tuple(tensor_meta(b['cos']).shape)} broadcast q/k of shape {tuple(xt.shape)} to a "
            f"larger result {tuple(out.shape)}"
        )
    if xt.dtype not in FLOAT_DTYPES:
        raise Decline(f"input dtype {xt.dtype} is not one the fused op computes for ({_dtype_names()})")
    # eager's x*cos + rotate(x)*sin promotes: bf16 q (an autocast linear) and fp32 cos/sin give fp32. Every
    # intermediate is at least as wide as its inputs, so the op (fp32 maths, one rounding to out_dtype) is no
    # less accurate; any other result dtype means a cast the op does not reproduce
    cos_dtype, sin_dtype = tensor_meta(b["cos"]).dtype, tensor_meta(b["sin"]).dtype
    promoted = torch.promote_types(torch.promote_types(xt.dtype, cos_dtype), sin_dtype)
    rotated = canonical(found.root).args[0] if b.get("out_cast") is not None else found.root
    if tensor_meta(rotated).dtype != promoted:
        raise Decline(
            f"result dtype {tensor_meta(rotated).dtype} is not {promoted}, the promotion of the input's {xt.dtype} "
            f"and cos/sin's {cos_dtype}/{sin_dtype}: a cast inside the rotation that the fused op does not reproduce"
        )
    # an explicit cast of the result (Qwen2-VL's vision blocks: back to q's dtype) is the op's one rounding: eager's
    # result is fp32 there, or narrower and then rounded twice where the op rounds once
    if out.dtype not in FLOAT_DTYPES:
        raise Decline(f"result dtype {out.dtype} is not one the fused op writes ({_dtype_names()})")
    if form.half_width_cos:  # the op reads cos/sin per output channel: spread the per-pair values over both halves
        cos, sin = RepeatHalves(b["cos"]), RepeatHalves(b["sin"])
    else:
        cos, sin = b["cos"], b["sin"]
    if form.negated_sin:
        sin = Negated(sin)
    if cos_lead:
        cos = Unsqueezed(cos, cos_lead)
    if sin_lead:
        sin = Unsqueezed(sin, sin_lead)
    # an exact upcast of q/k (Qwen2-VL's vision q.float()) is read as q itself: the op widens each value as it
    # loads it, computes in fp32 as eager did, and its gradient comes back in q's dtype, as the upcast's does
    x = UpcastStripped(b["x"])
    x_lead = 4 - xt.dim()
    if x_lead:
        x = Unsqueezed(x, x_lead)
    if heads_third:
        x, cos, sin = Transposed12(x), Transposed12(cos), Transposed12(sin)
    adapter = ViewedBack(heads_third, x_lead) if heads_third or x_lead else None
    return Replacement(
        torch.ops.fuser.rope.default,
        (x, EmptyLike(UpcastStripped(b["x"])), cos, sin, rotary_dim, form.layout, out.dtype),
        output_index=0,
        output_adapter=adapter,
    )


def _broadcast_over(node: Node, dim: int, lead: int = 0) -> bool:
    """Whether ``node``'s tensor, viewed 4-D with ``lead`` size-1 dims put in front, has size 1 at ``dim``
    (broadcast over the heads there)."""
    shape = (1,) * lead + tuple(tensor_meta(node).shape)
    return len(shape) == 4 and isinstance(shape[dim], int) and shape[dim] == 1


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)


def combine_q_and_k(matches: list) -> list:
    """Pair the rotations of one attention layer that share cos, sin, rotary dim and layout into one op.

    Pairs are consecutive in graph order, from the same module, with every input defined before both roots
    (the fused op is inserted before the first of them).
    """
    graph_order = {node: i for i, node in enumerate(matches[0].found.root.graph.nodes)}
    ordered = sorted(matches, key=lambda m: graph_order[m.found.root])
    out, i = [], 0
    while i < len(ordered):
        first = ordered[i]
        second = ordered[i + 1] if i + 1 < len(ordered) else None
        if second is not None and _pairable(first, second, graph_order):
            q_args, k_args = first.replacement.args, second.replacement.args
            first.replacement = dataclasses.replace(
                first.replacement,
                args=(q_args[0], k_args[0], *q_args[2:]),
                output_index=0,
                extra_outputs=((second.found.root, 1),),
            )
            first.found = Found(first.found.root, first.found.bindings, first.found.nodes + second.found.nodes)
            out.append(first)
            i += 2
        else:
            out.append(first)
            i += 1
    return out


def _pairable(a, b, graph_order) -> bool:
    qa, qb = a.replacement.args, b.replacement.args
    if qa[2:] != qb[2:] or module_path(a.found.root) != module_path(b.found.root):
        return False
    first_root = min(graph_order[a.found.root], graph_order[b.found.root])
    inputs = [_graph_node(x) for x in (qa[0], qb[0], qa[2], qa[3])]
    inputs = [x for x in inputs if isinstance(x, torch.fx.Node)]
    return all(graph_order[x] < first_root for x in inputs)


def _graph_node(arg):
    """The graph node an argument is built from (through nested :class:`ArgExpr`: a transposed view of an
    unsqueezed q), or the argument itself."""
    while isinstance(arg, ArgExpr):
        arg = arg.source
    return arg


ROPE = Pattern(
    "rope",
    VARIANTS,
    check_rope,
    anchors=frozenset(),
    combine=combine_q_and_k,
    post_grad=(OUTPUT_CASTS_PASS, ROPE_GRAD_UPCASTS_PASS),
)
