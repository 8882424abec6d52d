"""Causal sliding-window attention as one op, forward and backward, on FlashAttention-2's windowed kernels.

    out[b, h, i] = softmax_j(scale · q[b, h, i] · k[b, h // n_rep, j])  · v[b, h // n_rep, j]
                   over the keys  i − window < j ≤ i                    (n_rep = Hq / Hkv)

That is transformers' ``sliding_window_causal`` mask (Gemma-3, Mistral, Cohere-2 and others with a window):
query i sees itself and the ``window − 1`` keys before it. A traced model spells it as a boolean ``[B, 1, T, T]``
mask passed to ``scaled_dot_product_attention`` on k and v expanded to every query head; PyTorch then runs a masked
kernel that computes every score block, the ones outside the window too. The ``causal_attention`` pattern proves a
mask is exactly this window (``src/fuser/patterns/causal_attention.py``) and calls :func:`window_sdpa` instead.

How: q ``[B, Hq, T, D]``, k and v ``[B, Hkv, T, D]`` (the unexpanded heads) are laid out as FlashAttention's
variable-length ``[B·T, H, D]`` rows (every sequence has length T; a view for Hugging Face's ``[B, T, H, D]``
storage, a copy otherwise) and given to
``aten::_flash_attention_forward`` with ``window_size_left = window − 1, window_size_right = 0``; it skips the
blocks outside the window and reads each kv head once for its query heads. The backward is
``aten::_flash_attention_backward`` with the same window, from the saved q, k, v, output and log-sum-exp. Both
are PyTorch's own FlashAttention-2 kernels, the ones its causal SDPA runs: fp16/bf16, head_dim ≤ 256 and a multiple
of 8, compute capability ≥ 8.0, and a first small call on the GPU (``_probe``, once per GPU, dtype and head size)
that ran and agreed with the fp32 maths. Elsewhere (CPU, fp32, other head sizes, a PyTorch without the window
arguments, a failed probe) :func:`window_sdpa` calls the masked SDPA the model wrote, so results never depend on the
kernel being there.

On the CPU the op itself runs the same maths in fp32 (explicit mask and softmax, the backward's formulas written
out): what tests the op's autograd wiring without a GPU, not a fast path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from fuser import _compat

HALF = (torch.float16, torch.bfloat16)


def window_mask(length: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[T, T]`` bool, True where query i attends key j: ``i − window < j ≤ i``."""
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


@functools.cache
def _aten_has_window() -> bool:
    """Whether this PyTorch's FlashAttention ops take ``window_size_left`` (2.11 and 2.13 do)."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
        back = torch.ops.aten._flash_attention_backward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return all(any(a.name == "window_size_left" for a in s.arguments) for s in (schema, back))


def flash_window_supported(q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0) -> str | None:
    """None when :func:`window_sdpa` can run the FlashAttention window kernels on these inputs, else why not."""
    if not q.is_cuda:
        return "not on a CUDA device"
    if q.dtype not in HALF or k.dtype != q.dtype:
        return f"{q.dtype} (FlashAttention takes fp16 or bf16)"
    d = q.shape[-1]
    if d > 256 or d % 8:
        return f"head_dim {d} (FlashAttention takes ≤ 256, a multiple of 8)"
    if dropout_p:
        return "dropout"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "a GPU below compute capability 8.0"
    if not _aten_has_window():
        return "this PyTorch's FlashAttention ops have no window arguments"
    return _probe(q.device.index if q.device.index is not None else torch.cuda.current_device(), q.dtype, d)


PROBE_TOLERANCE = 2e-2  # far above the kernels' bf16 error (~3e-3, tests/kernels/test_window_attention.py)


@functools.cache
def _probe(device_index: int, dtype: torch.dtype, head_dim: int) -> str | None:
    """Once per GPU, dtype and head size: a small forward + backward through the FlashAttention path (GQA, a window
    shorter than the sequence) checked against the fp32 maths; None when it ran and agreed, else what went wrong.
    A PyTorch build whose kernels lack a case (a head size, an architecture) then falls back to the masked call
    instead of failing inside a training step."""
    try:
        with _compat.real_tensors(), torch.enable_grad():
            device = torch.device("cuda", device_index)
            gen = torch.Generator(device=device).manual_seed(0)

            def rand(heads: int) -> torch.Tensor:
                return torch.randn(2, heads, 160, head_dim, device=device, generator=gen).to(dtype)

            q, k, v, dout = rand(4), rand(2), rand(2), rand(4)
            scale = 1.0 / math.sqrt(head_dim)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = window_attention_op(*inputs, 37, scale)[0]
            got = (out, *torch.autograd.grad(out, inputs, dout))
            want = (_reference(q, k, v, 37, scale)[0], *_reference_backward(dout, q, k, v, 37, scale))
            err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True))
    except Exception as error:  # noqa: BLE001 - any failure means "do not use it here"
        return f"FlashAttention's window kernels failed a probe on this GPU ({type(error).__name__}: {error})"
    if not err <= PROBE_TOLERANCE:
        return f"FlashAttention's window kernels disagreed with the reference in a probe (relative error {err:.1e})"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] → FlashAttention's varlen [B·T, H, D], contiguous (no copy for Hugging Face's [B, T, H, D]
    storage). Contiguous always: the kernels allocate their outputs like their inputs, and the fake kernels below
    promise contiguous rows."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d).contiguous()


def _cu_seqlens(b: int, t: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=device)


def _scores(q, k, v, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v expanded to the query heads, the window-masked scores ``scale·q·kᵀ``), all fp32."""
    n_rep = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(n_rep, dim=1) for x in (k, v))
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    return kf, vf, scores.masked_fill(~window_mask(q.shape[2], window, q.device), float("-inf"))


def _reference(q, k, v, window: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in fp32 by explicit maths: the CPU kernel and the test oracle. lse is ``[Hq, B·T]``."""
    b, hq, t, d = q.shape
    _, vf, scores = _scores(q, k, v, window, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    out = torch.softmax(scores, dim=-1) @ vf
    return out, lse.permute(1, 0, 2).reshape(hq, b * t)


def _reference_backward(grad_out, q, k, v, window: int, scale: float):
    """(dq, dk, dv) in fp32 by explicit maths: P = softmax(S), dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − rowsum(dO ⊙ O)),
    dQ = scale·dS·K, dK = scale·dSᵀ·Q, with dK and dV summed over each kv head's query heads."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    n_rep = hq // hkv
    qf, do = q.float(), grad_out.float()
    kf, vf, scores = _scores(q, k, v, window, scale)
    p = torch.softmax(scores, dim=-1)
    out = p @ vf
    ds = p * (do @ vf.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = ((ds.transpose(-1, -2) @ qf) * scale).view(b, hkv, n_rep, t, d).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(b, hkv, n_rep, t, d).sum(2)
    return dq, dk, dv


def _from_rows(like: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B·T, H, D] rows back to ``like``'s [B, H, T, D], as a transposed view of [B, T, H, D] storage (SDPA's flash
    layout, the one the kernels write)."""
    b, h, t, d = like.shape
    return rows.view(b, t, h, d).transpose(1, 2)


def _empty_like_rows(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``like`` in the [B, T, H, D] storage the kernels write."""
    b, h, t, d = like.shape
    return like.new_empty(b, t, h, d).transpose(1, 2)


@torch.library.custom_op("fuser::window_attention", mutates_args=())
def window_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[B, Hq, T, D]`` with ``[B, T, Hq, D]`` storage, lse ``[Hq, B·T]`` fp32) of causal attention over the
    last ``window`` keys (module docstring)."""
    b, hq, t, d = query.shape
    if query.device.type == "cpu":
        out, lse = _reference(query, key, value, window, scale)
        return _empty_like_rows(query).copy_(out), lse
    cu = _cu_seqlens(b, t, query.device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _rows(query), _rows(key), _rows(value), cu, cu, t, t, 0.0, True, False,
        scale=scale, window_size_left=window - 1, window_size_right=0,
    )  # fmt: skip
    return _from_rows(query, out), lse


@window_attention_op.register_fake
def _(query, key, value, window, scale):
    b, hq, t, d = query.shape
    return _empty_like_rows(query), query.new_empty(hq, b * t, dtype=torch.float32)


@torch.library.custom_op("fuser::window_attention_backward", mutates_args=())
def window_attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`window_attention_op`, each shaped as its input, in ``[B, T, H, D]`` storage (as the
    kernel writes them)."""
    b, t = query.shape[0], query.shape[2]
    inputs = (query, key, value)
    if query.device.type == "cpu":
        grads = _reference_backward(grad_out, query, key, value, window, scale)
        return tuple(_empty_like_rows(x).copy_(g) for x, g in zip(inputs, grads, strict=True))
    cu = _cu_seqlens(b, t, query.device)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)  # dropout 0: not read
    unused = torch.empty(0, device=query.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _rows(grad_out), _rows(query), _rows(key), _rows(value), _rows(out), lse, cu, cu, t, t, 0.0, True,
        rng_state, unused, scale=scale, window_size_left=window - 1, window_size_right=0,
    )  # fmt: skip
    return tuple(_from_rows(x, g) for x, g in zip(inputs, (dq, dk, dv), strict=True))


@window_attention_backward_op.register_fake
def _(grad_out, query, key, value, out, lse, window, scale):
    return _empty_like_rows(query), _empty_like_rows(key), _empty_like_rows(value)


def _setup_context(ctx, inputs, output):
    query, key, value, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.window, ctx.scale = window, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fuser.window_attention_backward(grad_out, query, key, value, out, lse, ctx.window, ctx.scale)
    return dq, dk, dv, None, None


window_attention_op.register_autograd(_backward, setup_context=_setup_context)


def window_sdpa(query, key, value, window: int, dropout_p: float = 0.0, scale=None, enable_gqa: bool = False):
    """``F.scaled_dot_product_attention`` under the causal ``window`` mask (key j seen by query i when
    ``i − window < j ≤ i``), on FlashAttention's window kernels where they run (:func:`flash_window_supported`),
    else on the masked SDPA the model wrote. ``key``/``value`` may have fewer heads than ``query`` only with
    ``enable_gqa``, as in SDPA."""
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if flash_window_supported(query, key, dropout_p) is None:
        return torch.ops.fuser.window_attention(query, key, value, int(window), scale)[0]
    mask = window_mask(query.shape[-2], int(window), query.device)
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs)
