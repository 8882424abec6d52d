"""Attention written by hand, ``softmax(q @ kᵀ · s + mask) @ v`` → ``F.scaled_dot_product_attention``.

Vision towers and older text models spell attention out instead of calling SDPA: BLIP's vision and text attention
(``torch.matmul(q, k.transpose(-1, -2)) * scale`` or ``/ sqrt(d)``, an additive mask, ``nn.Softmax(dim=-1)``,
``nn.Dropout``, ``torch.matmul``), transformers' ``eager_attention_forward`` (GIT's vision tower:
``softmax(..., dtype=float32).to(q.dtype)``), SAM-style encoders (GOT-OCR2: ``(q * scale) @ kᵀ`` on ``[B·H, L, E]``
plus a relative-position bias computed from q). Eager PyTorch runs them as a matmul, a softmax and a matmul, and
autograd saves the ``[..., L, S]`` probabilities for the backward; SDPA's fused kernels save neither.

What is matched, from the root ``matmul(P, v)``:

- ``P`` = ``softmax(S, dim=-1)``, optionally computed in fp32 and cast back (``softmax(S, dtype=float32).to(q.dtype)``),
  optionally through a dropout that is off (``p = 0`` or ``training=False``: the identity);
- ``S`` = ``matmul(q, kᵀ)`` (``torch.matmul``, ``@``, ``torch.bmm``), optionally ``* s`` or ``/ s`` (a number, or a
  number Dynamo made symbolic), then optionally ``+ mask`` (a float mask of the scores' dtype that broadcasts to them),
  or ``torch.baddbmm(mask, q, kᵀ)`` (``nn.MultiheadAttention``'s body).

It becomes ``F.scaled_dot_product_attention(q, kᵀ.transpose(-2, -1), v, attn_mask=mask, scale=s)`` (``1 / s`` for a
division, ``1.0`` where nothing scaled the scores: a q scaled before the product stays in q, the same function). The
transpose back is a view, right whether or not ``kᵀ`` was itself a transpose. The rewrite is the same function of q,
k, v and the mask (the mask's gradient included: SDPA gives it on the CPU) wherever the eager code gives a number; a
query row whose every key the mask sets to ``-inf`` is NaN in eager and zeros from SDPA.

Declined, with the reason: the probabilities or the scores read by anything else (attention weights returned,
``output_attentions``: SDPA never computes them); dropout with ``p > 0`` in training (SDPA's dropout draws other
random numbers, so the step would not be the same function of the inputs); a softmax over another dim; a scale applied
after the mask was added (it scales the mask too); a mask of another dtype (a bool mask added as 0/1 among them) or
one that widens the scores (``[..., L, S]`` is the scores' shape); operands that the matmul broadcasts over batch dims.

``nn.MultiheadAttention``. Dynamo keeps its functional body, ``F.multi_head_attention_forward``, as one call. With
``need_weights=True`` (its default) that body runs the matmul/softmax form above and also returns the averaged
weights; with ``need_weights=False`` it calls SDPA with the same masks. A call whose weights nothing reads (SigLIP's
pooling head takes ``[0]``) is made with ``need_weights=False``; declined with dropout in training (as above) and with
``is_causal`` (without the weights it drops the mask and trusts the hint).

How this relates to ``causal_attention``: that pattern reads SDPA calls in the captured graph (an explicit causal mask
becomes ``is_causal=True``); this one writes SDPA calls where the graph has none. Both run on the captured graph once,
so an SDPA call this pattern emits keeps the mask as written, and an SDPA call already in the graph is
``causal_attention``'s alone.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.nn.functional as F

from fuser._compat import statically_equal
from fuser.engine.canonical import argument_names, canonical, code_at, tensor_meta, value_readers
from fuser.engine.match import C, Found, OneOf, Op, OptCast, S, V, escaping_use, is_symbolic_scalar, scalar_hint
from fuser.patterns.base import Decline, NotApplicable, Pattern, Replacement, Variant

if TYPE_CHECKING:
    from fuser.config import FuserConfig

Node = torch.fx.Node


@dataclass(frozen=True)
class AttentionForm:
    """How a form scales and masks the scores: ``scale`` ``"none"``, ``"mul"`` (``* s``) or ``"div"`` (``/ s``);
    ``mask`` ``"none"``, ``"add"`` (``+ mask`` after the scale), ``"baddbmm"`` or ``"before_scale"`` (added before
    the scale: declined); ``module`` for ``F.multi_head_attention_forward``."""

    scale: str = "none"
    mask: str = "none"
    module: bool = False


def sdpa_of_scores(query, key_transposed, value, mask=None, scale=1.0, divide=False):
    """``softmax(query @ key_transposed · scale + mask) @ value`` (``/ scale`` with ``divide``) as SDPA computes it."""
    scale = 1.0 / scale if divide else scale
    key = key_transposed.transpose(-2, -1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def _probabilities(scores: Any) -> Any:
    """``softmax(scores)``, optionally cast (``.to(q.dtype)``) and dropped out."""
    softmax = OptCast(Op("softmax", scores, C("dim"), C("softmax_dtype")), "probs_cast")
    return OneOf(Op("dropout", softmax, S("dropout_p"), C("training")), softmax)


_PRODUCT = Op("matmul", V("q"), V("kt"))
_SCALED = {
    "none": _PRODUCT,
    "mul": Op("mul", _PRODUCT, S("scale")),
    "div": Op("div", _PRODUCT, S("scale")),
}


def _form(name: str, scores: Any, form: AttentionForm, declines: bool = False) -> Variant:
    return Variant(name, Op("matmul", _probabilities(scores), V("v")), form, declines)


# F.multi_head_attention_forward's arguments, each a tensor or a constant (None, a number, a flag)
_MHA_ARGUMENTS = argument_names("multi_head_attention")
_MHA_TREE = Op("multi_head_attention", *(OneOf(V(name), C(name)) for name in _MHA_ARGUMENTS))

VARIANTS = [
    # BLIP's text attention: matmul(q, kᵀ) / sqrt(d) + mask
    _form("scores / scale + mask", Op("add", _SCALED["div"], V("mask")), AttentionForm("div", "add")),
    # transformers' eager_attention_forward with a mask (GIT's vision tower): matmul(q, kᵀ) * scaling + mask
    _form("scores * scale + mask", Op("add", _SCALED["mul"], V("mask")), AttentionForm("mul", "add")),
    # q scaled before the product, a bias added (GOT-OCR2's relative positions)
    _form("scores + mask", Op("add", _PRODUCT, V("mask")), AttentionForm("none", "add")),
    # BLIP's vision attention and eager_attention_forward without a mask
    _form("scores * scale", _SCALED["mul"], AttentionForm("mul")),
    _form("scores / scale", _SCALED["div"], AttentionForm("div")),
    # q scaled before the product (CLIP-style towers: q * scale, then bmm(q, kᵀ))
    _form("scores", _PRODUCT, AttentionForm()),
    # nn.MultiheadAttention's body with a mask: baddbmm(mask, q * scale, kᵀ)
    _form("baddbmm(mask, q, kᵀ)", Op("baddbmm", V("mask"), V("q"), V("kt")), AttentionForm("none", "baddbmm")),
    _form(
        "(scores + mask) * scale",
        Op("mul", Op("add", _PRODUCT, V("mask")), S("scale")),
        AttentionForm("mul", "before_scale"),
        declines=True,
    ),
    _form(
        "(scores + mask) / scale",
        Op("div", Op("add", _PRODUCT, V("mask")), S("scale")),
        AttentionForm("div", "before_scale"),
        declines=True,
    ),
    # nn.MultiheadAttention (SigLIP's pooling head): the module's functional body, one call in Dynamo's graph
    Variant("nn.MultiheadAttention", _MHA_TREE, AttentionForm(module=True)),
]


def check_softmax_attention(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    form: AttentionForm = variant.params
    if form.module:
        return _check_multi_head_attention(found)
    b = found.bindings
    _check_uses_outside(found)
    if form.mask == "before_scale":
        what = "multiplies" if form.scale == "mul" else "divides"
        raise Decline(f"the scale {what} the scores after the mask was added (the mask is scaled too): SDPA adds its "
                      "mask to the scaled scores")  # fmt: skip
    if b["dim"] != -1:
        raise Decline(f"the softmax is over dim {b['dim']} of the scores, not the last (the keys'): SDPA normalises "
                      "over the keys")  # fmt: skip
    _check_dropout(b)
    q, kt, v = (tensor_meta(b[name]) for name in ("q", "kt", "v"))
    _check_operands(q, kt, v)
    _check_dtypes(found, q)
    mask = b.get("mask")
    if mask is not None:
        _check_mask(found, mask, q)
    scale, divide = 1.0, False
    if form.scale != "none":
        value = b["scale"]
        number = scalar_hint(value)
        if number is None or number == 0:
            raise Decline(f"the scores are scaled by {number!r}, not a nonzero number known when compiling")
        scale = value if is_symbolic_scalar(value) else float(value)
        divide = form.scale == "div"
    return Replacement(sdpa_of_scores, (b["q"], b["kt"], b["v"], mask, scale, divide))


def _check_uses_outside(found: Found) -> None:
    """Decline a match whose scores or probabilities something outside it reads: SDPA never computes them."""
    escape = escaping_use(found)
    if escape is None:
        return
    inner, user = escape
    c = canonical(inner)
    what = "probabilities" if c is not None and c.op in ("softmax", "to", "dropout") else "scores"
    if user.op == "call_method" and user.target in _SHAPE_OF_OTHER and user.args[1:2] == (inner,):
        # x.reshape_as(scores) reads only their shape, but the engine moves only size()/shape queries, and a
        # tensor of that shape computed before it is what it would have to read instead (GOT-OCR2's bias: none)
        raise Decline(f"the shape of the attention {what} is read by {code_at(user)} (`{user.target}`), and the "
                      "fused call does not compute them")  # fmt: skip
    raise Decline(f"the attention {what} are also {_read_by(user)} (attention weights returned, output_attentions?): "
                  "SDPA does not compute them")  # fmt: skip


_SHAPE_OF_OTHER = ("reshape_as", "view_as", "expand_as")  # x.reshape_as(y): y's shape, x's values


def _read_by(user: Node) -> str:
    return "returned by the captured graph" if user.op == "output" else f"read by {code_at(user)}"


def _check_dropout(b: dict[str, Any]) -> None:
    if "dropout_p" not in b:
        return
    p, training = scalar_hint(b["dropout_p"]), b["training"]
    if training is False or p == 0:
        return  # the identity
    if training is not True or p is None:
        raise Decline(f"dropout with p={b['dropout_p']!r}, training={training!r}: not known to be off")
    raise Decline(f"dropout with p={p} on the probabilities in training: SDPA's dropout draws other random numbers, "
                  "so the step would not be the same function of its inputs")  # fmt: skip


def _check_operands(q: torch.Tensor | None, kt: torch.Tensor | None, v: torch.Tensor | None) -> None:
    """q ``[..., L, E]``, kᵀ ``[..., E, S]``, v ``[..., S, Ev]`` of one rank and the same batch dims (matmul
    broadcasts them; SDPA is not asked to)."""
    if q is None or kt is None or v is None or min(t.dim() for t in (q, kt, v)) < 2:
        raise Decline("q, kᵀ or v is not a tensor of at least 2 dims")
    shapes = [tuple(t.shape) for t in (q, kt, v)]
    if not q.dim() == kt.dim() == v.dim():
        raise Decline(f"q, kᵀ and v have shapes {shapes}: unequal ranks that the matmuls broadcast")
    same_batch = all(statically_equal(a, b) for t in (kt, v) for a, b in zip(q.shape[:-2], t.shape[:-2], strict=True))
    if not same_batch or not statically_equal(kt.shape[-1], v.shape[-2]):
        raise Decline(f"q, kᵀ and v have shapes {shapes}: batch dims that the matmuls broadcast")
    if not (q.is_floating_point() and q.dtype == kt.dtype == v.dtype):
        raise Decline(f"q, kᵀ and v are {q.dtype}, {kt.dtype}, {v.dtype}: SDPA takes one floating dtype")


def _check_dtypes(found: Found, q: torch.Tensor) -> None:
    """The scores in q's dtype; the softmax in that dtype or fp32 (then cast back, or read at q's dtype by an
    autocast matmul: what SDPA's kernels do with their fp32 probabilities); the result in q's dtype."""
    b = found.bindings
    softmax = next(n for n in found.nodes if (c := canonical(n)) is not None and c.op == "softmax")
    scores = tensor_meta(canonical(softmax).args[0])
    out = tensor_meta(found.root)
    if scores.dtype != q.dtype or out.dtype != q.dtype:
        raise Decline(f"the scores are {scores.dtype} and the output {out.dtype} for a {q.dtype} q: mixed dtypes "
                      "(autocast?) that SDPA would compute in one")  # fmt: skip
    if b["softmax_dtype"] not in (None, torch.float32, q.dtype):
        raise Decline(f"the softmax is computed in {b['softmax_dtype']} for {q.dtype} scores")
    if b["probs_cast"] not in (None, q.dtype):
        raise Decline(f"the probabilities are cast to {b['probs_cast']} for a {q.dtype} v")


def _check_mask(found: Found, mask: Node, q: torch.Tensor) -> None:
    """A float mask of the scores' dtype, broadcasting to the scores' ``[..., L, S]`` without widening them."""
    m = tensor_meta(mask)
    products = [n for n in found.nodes[1:] if (c := canonical(n)) is not None and c.op in ("matmul", "baddbmm")]
    scores = tensor_meta(products[0])
    if m is None or m.dtype != q.dtype:
        dtype = None if m is None else m.dtype
        raise Decline(f"the mask added to the {q.dtype} scores is {dtype}: SDPA takes a float mask in the query's "
                      "dtype (a bool mask added is +0/+1, not which keys to attend)")  # fmt: skip
    fits = m.dim() <= scores.dim() and all(
        statically_equal(a, 1) or statically_equal(a, s)
        for a, s in zip(reversed(m.shape), reversed(scores.shape), strict=False)
    )
    if not fits:
        raise Decline(f"a mask of shape {tuple(m.shape)} for scores of shape {tuple(scores.shape)}: it does not "
                      "broadcast to [..., L, S]")  # fmt: skip


# ---------------------------------------------------------------------------------------- nn.MultiheadAttention


def _check_multi_head_attention(found: Found) -> Replacement:
    """``F.multi_head_attention_forward`` with ``need_weights=True`` whose weights nothing reads → the same call with
    ``need_weights=False``, which runs SDPA on the same q, k, v and masks."""
    b = found.bindings
    call = found.root
    if not b["need_weights"]:
        raise NotApplicable("nn.MultiheadAttention runs SDPA already (need_weights=False)")
    for user in value_readers(call):
        index = user.args[1] if user.target is operator.getitem and len(user.args) == 2 else None
        if index not in (0, -2):
            raise Decline(f"the attention weights nn.MultiheadAttention returns are {_read_by(user)}: with "
                          "need_weights=False it does not compute them")  # fmt: skip
    p = scalar_hint(b["dropout_p"]) if not isinstance(b["dropout_p"], Node) else None
    if b["training"] is not False and p != 0:
        raise Decline(f"nn.MultiheadAttention with dropout {b['dropout_p']!r} in training: SDPA's dropout draws other "
                      "random numbers, so the step would not be the same function of its inputs")  # fmt: skip
    if b["is_causal"]:
        raise Decline("nn.MultiheadAttention with is_causal=True: without the weights it drops the mask and applies "
                      "SDPA's causal mask instead, the same only if the mask was causal")  # fmt: skip
    kwargs = {name: b[name] for name in _MHA_ARGUMENTS} | {"need_weights": False}
    return Replacement(F.multi_head_attention_forward, (), kwargs, variant="nn.MultiheadAttention, need_weights off")


SOFTMAX_ATTENTION = Pattern(
    "softmax_attention",
    VARIANTS,
    check_softmax_attention,
    # the uses of the scores and probabilities outside a match are judged by the check, which says what they are
    judges_outside_uses=True,
)
