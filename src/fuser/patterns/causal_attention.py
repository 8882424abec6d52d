"""Causal attention that a traced model spells as an explicit mask: ``sdpa(q, k, v, attn_mask=M)`` → ``is_causal``.

Some versions of Hugging Face transformers (5.17 among them) cannot tell under ``torch.compile`` that no padding
mask was given, so they build the causal mask in the graph from ``arange`` comparisons and pass it to
``scaled_dot_product_attention`` instead of ``is_causal=True``. PyTorch then runs a masked kernel that computes
every block above the diagonal too, and attention under ``torch.compile`` takes longer than in eager mode
(``docs/notes/kernels.md``, causal attention).

The rewrite is made only when the mask is *proved* to be the plain causal mask:

- it is computed inside the graph from constants alone (no graph input, parameter, buffer or random op feeds it:
  a padding mask from the batch declines, since its values are unknown at compile time);
- evaluated on the CPU at compile time, it is boolean (True = attend) or float with exactly 0 / −inf, and every
  ``[T, T]`` slice equals ``tril(ones(T, T))`` (a prefix-LM or a document mask declines; a causal sliding window
  is the next case);
- query and key have the same length (``is_causal`` is top-left aligned);
- ``is_causal`` was not already set.

A symbolic length. Once batches of a second length arrive, Dynamo recompiles with a symbolic sequence length, and one
graph then serves every length: the mask cannot be evaluated, and evaluating it at the traced length would prove
nothing about the others (a sliding window of ``w`` keys is the causal mask at every length up to ``w``). There a
bool mask is proved instead, for every length, by algebra on its index expressions
(:mod:`fuser.patterns.mask_algebra`): the plain causal mask, or a window of one constant ``w`` (at lengths up to
``w`` the window op computes the causal mask). A mask it cannot read (a float mask among them) declines there.

The call becomes ``F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True, scale, enable_gqa)``: the
same function of q, k and v, so PyTorch may pick its flash kernels, which skip the masked blocks.

A causal sliding window. When every slice instead equals the window mask ``i − w < j ≤ i`` for one ``w < T`` (the
sliding layers of Gemma-3, Mistral, Cohere-2), the call becomes :func:`~fuser.kernels.window_attention.window_sdpa`
with that ``w``: FlashAttention's window kernels, which skip the blocks outside the window (fp16/bf16 on a CUDA GPU;
elsewhere the masked SDPA as written), faster than the masked SDPA and as close to fp32
(``docs/defaults.md``, ``causal_attention.sliding_window``). Not with dropout (declined), and
``sliding_window=False`` keeps the masked call.

Grouped-query attention. Where no mask is given, transformers calls SDPA with ``enable_gqa=True`` on the model's k and
v; where it passes a mask (traced, as above) it first expands them to the query's heads itself
(``repeat_kv``: ``k[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)``), and the
expanded copies are what the backward then saves. With ``gqa_fold=True`` the rewritten call is given the unexpanded k
and v with ``enable_gqa=True`` — the same function: query head ``h`` reads key/value head ``h // n_rep`` either way —
when both are exactly that expansion (an ``expand`` of a new dim 2 merged into dim 1; ``repeat``'s tiling order or any
other form is left as written). On by default since it was measured: less memory, no less speed
(``docs/defaults.md``, ``experimental.causal_attention.gqa_fold``).

A mask built from a graph input (the ``attention_mask`` the HF Trainer's collators pass, all ones when nothing is
padded) cannot be proved at compile time. With ``runtime_check=True`` (experimental, off: not measured on a GPU)
such a bool mask is compared with the causal mask on the device at every call, and ``torch.cond`` runs
``is_causal=True`` when they are equal, the masked call as written otherwise (not inside a checkpointed body, not
with dropout).

The window kernels and FlexAttention are :class:`CausalAttentionConfig`'s switches (``FuserConfig.causal_attention``,
``options={"causal_attention": {"sliding_window": False}}``); the fold and the run-time check, kept to compare, are
:class:`CausalAttentionExperimental`'s (``options={"experimental.causal_attention.gqa_fold": False}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx
import torch.nn.functional as F

from fuser._compat import statically_equal, statically_same_shape, sympy_expr
from fuser.engine.canonical import code_at, tensor_meta
from fuser.engine.match import OUTER_VALUE, C, Found, Op, S, V
from fuser.kernels.block_mask import block_mask
from fuser.kernels.window_attention import window_mask, window_sdpa
from fuser.options import check_fields
from fuser.patterns.base import Decline, Pattern, Replacement, Variant
from fuser.patterns.mask_algebra import INPUT_DEPENDENT, symbolic_verdict, unmutated_ancestors

if TYPE_CHECKING:
    from fuser.config import FuserConfig

Node = torch.fx.Node


@dataclass(frozen=True)
class CausalAttentionConfig:
    """Which attention kernels the causal-attention rewrite runs for a mask it proves to be a sliding window, and for a
    mask from the batch (module docstring)."""

    sliding_window: bool = True
    """A mask proved to be a causal sliding window (Gemma-3, Mistral, Cohere-2) runs FlashAttention's window kernels
    (``src/fuser/kernels/window_attention.py``, fp16/bf16 on a GPU), which skip the blocks outside it."""

    block_sparse_masks: bool = True
    """A bool mask computed from graph inputs (the causal mask and the batch's ``attention_mask``) runs on
    FlexAttention (fp16/bf16 on a CUDA GPU, heads of at most 128) with a block mask built from the mask's own values
    on the device: blocks the mask hides entirely (above the diagonal, all-pad keys) are skipped, the others masked
    element by element. No host synchronisation, no assumption about the mask; also in a graph compiled for any
    sequence length (``src/fuser/kernels/block_mask.py``). Elsewhere (CPU, fp32) the masked SDPA as written.
    ``experimental.causal_attention.runtime_check`` takes precedence."""

    def __post_init__(self) -> None:
        check_fields(self, "causal_attention")


@dataclass(frozen=True)
class CausalAttentionExperimental:
    """The causal-attention rewrite's alternatives kept to compare: what it does with the ``repeat_kv`` copies of a
    proved-causal call, and a run-time check of a mask from the batch (module docstring)."""

    gqa_fold: bool = True
    """A proved-causal call on transformers' ``repeat_kv`` copies gets the unexpanded k and v with
    ``enable_gqa=True``, so the backward saves them instead of the copies."""

    runtime_check: bool = False
    """A bool mask computed from graph inputs (a padding mask) is compared with the causal mask on the device at
    each call, and ``torch.cond`` runs ``is_causal=True`` when they are equal. Inductor reads the ``cond``'s
    predicate on the host: one synchronisation per call."""

    def __post_init__(self) -> None:
        check_fields(self, "experimental.causal_attention")


# the widest head block_sparse_sdpa gives FlexAttention: correct at 256 too, but its speed there is not measured
MAX_FLEX_HEAD_DIM = 128
# the largest sequence whose mask is evaluated at compile time (a T×T bool on the CPU: 4 GiB at 65536)
MAX_EVALUATED_LENGTH = 65536
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential")
_MEMO_KEY = "fuser_causal_mask"  # node.meta: the verdict on a mask node, shared by the layers that use it


def causal_sdpa(query, key, value, dropout_p=0.0, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with ``is_causal=True`` and no mask (what a proved causal mask becomes)."""
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale, **kwargs)


def _on_cpu(value):
    return torch.fx.node.map_aggregate(value, lambda v: torch.device("cpu") if isinstance(v, torch.device) else v)


def _has_symbolic(value) -> bool:
    found: list[object] = []
    torch.fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.SymInt | torch.SymFloat) else v)
    return bool(found)


def _evaluate(mask: Node) -> torch.Tensor:
    """The mask's value, computed on the CPU from the graph's own nodes (following a nested body's input to the
    enclosing graph); Decline when it is not a compile-time constant."""
    env: dict[Node, object] = {}
    for n in unmutated_ancestors(mask):
        if n.op == "placeholder":
            outer = n.meta.get(OUTER_VALUE)
            if not isinstance(outer, Node):
                raise Decline(f"{INPUT_DEPENDENT} `{n.name}` (a padding mask?): values unknown")
            env[n] = _evaluate(outer)
            continue
        if n.op == "get_attr":
            raise Decline(f"the mask reads the module attribute `{n.target}`")
        if n.op not in ("call_function", "call_method"):
            raise Decline(f"the mask is computed by {code_at(n)}, which cannot be evaluated at compile time")
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if any(word in name.lower() for word in _RANDOM):
            raise Decline(f"the mask depends on a random op (`{name}`)")
        if _has_symbolic((n.args, n.kwargs)):
            raise Decline(f"the mask's shape is symbolic (`{n.name}`): dynamic shapes are not evaluated")
        args = _on_cpu(torch.fx.node.map_arg(n.args, env.__getitem__))
        kwargs = dict(_on_cpu(torch.fx.node.map_arg(n.kwargs, env.__getitem__)))
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        try:
            with torch.no_grad():
                if n.op == "call_function":
                    env[n] = n.target(*args, **kwargs)
                else:
                    env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        except Exception as error:  # noqa: BLE001 - any failure means "not provably constant"
            raise Decline(f"evaluating the mask at `{n.name}` failed ({type(error).__name__}: {error})") from error
    value = env[mask]
    if not isinstance(value, torch.Tensor):
        raise Decline(f"the mask evaluates to a {type(value).__name__}, not a tensor")
    return value


def _causal_verdict(mask: Node, length: int) -> str | int | None:
    """None when ``mask`` is the plain causal mask of ``length`` (for every batch and head), the window ``w`` when it
    is the causal sliding window of ``w < length`` keys, else why not (a string)."""
    meta = tensor_meta(mask)
    if meta is None or meta.dim() < 2 or tuple(meta.shape[-2:]) != (length, length):
        return f"the mask's shape {None if meta is None else tuple(meta.shape)} does not end in [{length}, {length}]"
    if meta.device.type == "meta":
        return "the mask lives on the meta device"
    try:
        value = _evaluate(mask)
    except Decline as why:
        return str(why)
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        if not bool(((value == 0) | (value == float("-inf"))).all()):
            return "a float mask with values other than 0 and -inf (a finite fill is not the same as is_causal)"
        allowed = value == 0
    else:
        return f"a {value.dtype} mask"
    i = torch.arange(length)
    causal = i[None, :] <= i[:, None]
    if tuple(allowed.shape[-2:]) != (length, length):
        return f"the mask's shape {tuple(allowed.shape)} does not end in [{length}, {length}]"
    if bool((allowed == causal).all()):
        return None
    window = int(allowed.reshape(-1, length, length)[0, -1].sum())  # the last query sees the window's keys
    if 0 < window < length and bool((allowed == window_mask(length, window)).all()):
        return window
    return "the mask is neither the plain causal mask nor a causal sliding window (prefix or document mask?)"


def check_causal_attention(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
    b = found.bindings
    q, k, v, mask = b["q"], b["k"], b["v"], b["mask"]
    qt, kt = tensor_meta(q), tensor_meta(k)
    if qt.dim() < 2 or kt.dim() < 2:
        raise Decline("query or key has fewer than 2 dims")
    lq, lk = qt.shape[-2], kt.shape[-2]
    if not statically_equal(lq, lk):
        raise Decline(f"query length {lq} differs from key length {lk} (is_causal is top-left aligned)")
    # a symbolic length (the recompile for a second batch length): the mask is proved for every length by algebra
    symbolic = not isinstance(lq, int)
    if not symbolic and lq > MAX_EVALUATED_LENGTH:
        raise Decline(f"sequence length {lq} is above {MAX_EVALUATED_LENGTH}: the mask is not evaluated")
    # a checkpointed layer receives the mask as its body's input: judge the enclosing graph's node, once for all
    # the layers that share it (each layer's body has its own placeholder)
    source = mask
    while source.op == "placeholder" and isinstance(source.meta.get(OUTER_VALUE), Node):
        source = source.meta[OUTER_VALUE]
    memo = source.meta.setdefault(_MEMO_KEY, {})
    length = sympy_expr(lq) if symbolic else lq
    if length not in memo:
        memo[length] = symbolic_verdict(source, length) if symbolic else _causal_verdict(source, lq)
    verdict = memo[length]
    enable_gqa = bool(b["enable_gqa"])
    window = verdict if isinstance(verdict, int) else None
    if window is not None:
        if not config.causal_attention.sliding_window:
            raise Decline(f"a causal sliding window of {window} keys (causal_attention.sliding_window is off)")
        if b["dropout_p"] != 0:
            raise Decline(f"a causal sliding window of {window} keys with dropout (the window kernel has none)")
        _check_window_operands(q, k, v, enable_gqa, window)
    if isinstance(verdict, str):
        # the run-time check and the block mask read the mask's own values, whatever its length
        if verdict.startswith(INPUT_DEPENDENT) and config.experimental.causal_attention.runtime_check:
            return _runtime_checked(found)
        if verdict.startswith(INPUT_DEPENDENT) and config.causal_attention.block_sparse_masks:
            return _block_sparse(found)
        raise Decline(verdict)
    k, v, enable_gqa = _folded(k, v, enable_gqa, config)
    if window is not None:
        return Replacement(window_sdpa, (q, k, v, window, 0.0, b["scale"], enable_gqa), variant=f"window {window}")
    return Replacement(causal_sdpa, (q, k, v, float(b["dropout_p"]), b["scale"], enable_gqa))


def _folded(k: Node, v: Node, enable_gqa: bool, config: FuserConfig) -> tuple[Node, Node, bool]:
    """``(k, v, enable_gqa)`` as the rewritten call takes them: transformers' ``repeat_kv`` copies replaced by the
    unexpanded k and v with ``enable_gqa=True`` where ``gqa_fold`` is on and both are exactly that expansion."""
    if not enable_gqa and config.experimental.causal_attention.gqa_fold:
        k_kv, v_kv = _unrepeated(k), _unrepeated(v)
        if k_kv and v_kv and k_kv[1] == v_kv[1] and k_kv[1] > 1:
            return k_kv[0], v_kv[0], True
    return k, v, enable_gqa


def _runtime_checked(found: Found) -> Replacement:
    """The call as :func:`causal_or_masked_sdpa`: sound for any bool mask of the query's length, since the branch
    is chosen by comparing the mask's values on the device. k and v stay as given (no ``gqa_fold``): Inductor's
    post-grad passes fail on a ``torch.cond`` whose branches take the unexpanded k and v ("A subgraph argument
    other than striding has been modified")."""
    _check_runtime_variant(found)
    b = found.bindings
    args = (b["q"], b["k"], b["v"], b["mask"], b["scale"], bool(b["enable_gqa"]))
    return Replacement(causal_or_masked_sdpa, args, variant="runtime check")


def _block_sparse(found: Found) -> Replacement:
    """The call as :func:`block_sparse_sdpa` (``block_sparse_masks``): any bool mask of shape ``[T, T]``, ``[1 or B,
    1, T, T]``, without dropout."""
    _check_input_mask(found, "the block mask", "FlexAttention has none")
    b = found.bindings
    mask, q = tensor_meta(b["mask"]), tensor_meta(b["q"])
    what = "a mask from graph inputs"
    if q.dim() != 4 or mask.dim() not in (2, 4) or (mask.dim() == 4 and mask.shape[1] != 1):
        raise Decline(f"{what} of shape {tuple(mask.shape)} for a query of shape {tuple(q.shape)}")
    if q.shape[-1] > MAX_FLEX_HEAD_DIM:
        widest = MAX_FLEX_HEAD_DIM
        raise Decline(f"{what} with heads of {q.shape[-1]}: fuser gives FlexAttention heads of at most {widest}")
    if mask.dim() == 4 and not (statically_equal(mask.shape[0], 1) or statically_equal(mask.shape[0], q.shape[0])):
        raise Decline(f"{what} of batch {mask.shape[0]} for a query of batch {q.shape[0]}")
    args = (b["q"], b["k"], b["v"], b["mask"], b["scale"], bool(b["enable_gqa"]))
    return Replacement(block_sparse_sdpa, args, variant="block-sparse mask")


def block_sparse_sdpa(query, key, value, mask, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=mask)`` (``mask`` bool, True = attend): on a
    CUDA GPU in fp16/bf16 through FlexAttention, whose block mask is built from ``mask``'s values on the device, so
    the blocks it hides entirely are never computed; elsewhere the masked call as written. A query row that the mask
    hides entirely gets zeros from FlexAttention."""
    usable = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if not usable:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    length = query.shape[-2]
    # one mask row per query row: FlexAttention calls mask_mod with the query's batch index (a view, no copy)
    allowed = (mask if mask.dim() == 4 else mask[None, None]).expand(query.shape[0], 1, length, length)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, 0, q_idx, kv_idx]

    blocks = block_mask(allowed, mask_mod, length, length)
    return flex_attention(query, key, value, block_mask=blocks, scale=scale, enable_gqa=enable_gqa)


def _check_window_operands(q: Node, k: Node, v: Node, enable_gqa: bool, window: int) -> None:
    """Decline a window whose q, k, v the window op does not take as they are: [B, H, T, D] each, one batch size
    (no broadcasting), one head size, and k / v heads equal to q's (or a divisor of them, with ``enable_gqa``)."""
    metas = [tensor_meta(n) for n in (q, k, v)]
    what = f"a causal sliding window of {window} keys"
    if any(m is None or m.dim() != 4 for m in metas):
        raise Decline(f"{what} on q, k, v that are not all [batch, heads, tokens, head_dim]")
    (bq, hq, _, dq), (bk, hk, _, dk), (bv, hv, _, dv) = (tuple(m.shape) for m in metas)
    if not bq == bk == bv or not dq == dk == dv or hk != hv:
        raise Decline(f"{what} on q, k, v of shapes {[tuple(m.shape) for m in metas]} (broadcast or unequal)")
    if hk != hq and not (enable_gqa and hq % hk == 0):
        raise Decline(f"{what} with {hq} query heads and {hk} key heads without enable_gqa")


def _is_call(node: object, *names: str) -> bool:
    if not isinstance(node, Node):
        return False
    if node.op == "call_method":
        return node.target in names
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name in names and getattr(node.target, "__module__", None) in ("torch", "_operator", "operator", None)
    return False


def _unrepeated(node: Node) -> tuple[Node, int] | None:
    """(kv, n_rep) when ``node`` is ``kv[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)`` (or
    its ``unsqueeze(2)`` spelling), i.e. head ``i`` of ``node`` is head ``i // n_rep`` of ``kv``."""
    if not (_is_call(node, "reshape") and node.args):
        return None
    expanded = node.args[0]
    if not (_is_call(expanded, "expand") and expanded.args):
        return None
    inserted = expanded.args[0]
    if not isinstance(inserted, Node):
        return None
    if _is_call(inserted, "unsqueeze"):
        dim = inserted.args[1] if len(inserted.args) > 1 else inserted.kwargs.get("dim")
        if dim not in (2, -3):
            return None
    elif _is_call(inserted, "getitem"):
        index = inserted.args[1] if len(inserted.args) > 1 else None
        full = slice(None)
        if not (isinstance(index, tuple) and len(index) == 5 and index[2] is None):
            return None
        if not all(isinstance(i, slice) and i == full for j, i in enumerate(index) if j != 2):
            return None
    else:
        return None
    kv = inserted.args[0]
    metas = [tensor_meta(n) for n in (kv, inserted, expanded, node)]
    if any(m is None for m in metas):
        return None
    kv_shape, inserted_shape, expanded_shape, out_shape = (tuple(m.shape) for m in metas)
    if len(kv_shape) != 4 or len(expanded_shape) != 5 or len(out_shape) != 4:
        return None
    b, h, s, d = kv_shape
    n_rep = expanded_shape[2]
    if not isinstance(n_rep, int) or n_rep < 1:
        return None
    # compared without guards: the token dim s is symbolic in a dynamic-shape graph
    found = (inserted_shape, expanded_shape, out_shape)
    expected = ((b, h, 1, s, d), (b, h, n_rep, s, d), (b, h * n_rep, s, d))
    if not all(statically_same_shape(a, e) for a, e in zip(found, expected, strict=True)):
        return None
    return kv, n_rep


def _check_input_mask(found: Found, kernel: str, no_dropout_why: str) -> None:
    """Decline a mask from graph inputs that ``kernel`` (the run-time check, the block mask) cannot take: not bool,
    not ``[..., T, T]`` for queries and keys of length T, or a call with dropout."""
    b = found.bindings
    mask = tensor_meta(b["mask"])
    if mask.dtype != torch.bool:
        raise Decline(f"a {mask.dtype} mask from graph inputs ({kernel} takes bool masks)")
    length = tensor_meta(b["q"]).shape[-2]
    if mask.dim() < 2 or not all(statically_equal(n, length) for n in mask.shape[-2:]):
        raise Decline(f"a mask of shape {tuple(mask.shape)} for queries and keys of length {length}")
    if b["dropout_p"] != 0:
        raise Decline(f"a mask from graph inputs with dropout ({no_dropout_why})")


def _check_runtime_variant(found: Found) -> None:
    _check_input_mask(found, "the run-time check", "the run-time check does not branch around dropout")
    if any(n.op == "placeholder" and OUTER_VALUE in n.meta for n in found.root.graph.nodes):
        raise Decline("a mask from graph inputs inside a nested body (checkpointing): no run-time check there")


def causal_or_masked_sdpa(query, key, value, mask, scale=None, enable_gqa=False):
    """SDPA with ``is_causal=True`` when ``mask`` (bool, True = attend) equals the causal mask in every slice, else
    with ``mask`` as given: decided on the device by ``torch.cond`` (both branches are compiled)."""
    kwargs = {"scale": scale, **({"enable_gqa": True} if enable_gqa else {})}
    length = query.shape[-2]
    causal_mask = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    is_causal = (mask == causal_mask).all()

    def causal(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs).contiguous()

    def masked(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kwargs).contiguous()

    return torch.cond(is_causal, causal, masked, (query, key, value, mask))


VARIANTS = [
    Variant(
        "explicit mask",
        Op("sdpa", V("q"), V("k"), V("v"), V("mask"), S("dropout_p"), False, C("scale"), C("enable_gqa")),
    ),
]

CAUSAL_ATTENTION = Pattern(
    "causal_attention",
    VARIANTS,
    check_causal_attention,
    options=CausalAttentionConfig,
    experimental_options=CausalAttentionExperimental,
)
