"""Rotary position embedding of q and k as one fused op, forward and backward, in one launch each.

q ``[B, Hq, T, D]`` and k ``[B, Hk, T, D]`` (GQA / MQA: Hk may differ; k may be absent) are rotated with cos and
sin broadcastable to ``[B, 1, T, R]``, R = ``rotary_dim`` ≤ D, even; channels c ≥ R pass through unchanged
(partial rotary: Phi, GPT-NeoX, GLM). The R rotated channels form h = R/2 pairs. Pair i reads the input channels
(a, b) and writes the output channels (p, o), all in fp32:

    y[p] = x[a]·cos[p] − x[b]·sin[p]
    y[o] = x[b]·cos[o] + x[a]·sin[o]

with, per ``layout`` (cos/sin are read at the output channel, never assumed equal across a pair):

    layout              a     b       p     o       written by
    "half"              i     i+h     i     i+h     Llama, Mistral, Qwen, GPT-NeoX, Phi (HF ``rotate_half``)
    "interleaved"       2i    2i+1    2i    2i+1    GLM, Helium, original Meta (cos/sin repeat-interleaved)
    "pairs_to_halves"   2i    2i+1    i     i+h     DeepSeek-V2/V3 ``rope_interleave``: pairs in, halves out

Backward is the transposed rotation, with the same cos/sin (y is linear in x; no gradient flows to cos/sin):

    dx[a] = dy[p]·cos[p] + dy[o]·sin[o]
    dx[b] = dy[o]·cos[o] − dy[p]·sin[p]
    dx[c] = dy[c]                                   (c ≥ R, pass-through)

Dtypes: q, k, cos and sin may each be fp32, bf16 or fp16 (fp64 on the reference path, the test oracle); the
maths runs in fp32 and the results are stored in ``out_dtype`` (None: each in its input's dtype). The pattern
passes the dtype eager's type promotion gives the matched block: bf16 q/k from an autocast linear rotated by fp32
cos/sin give fp32 (HF Trainer ``bf16=True`` with fp32 master weights), a wider input may also be rounded once to a
narrower ``out_dtype``. The gradients dq and dk come back in q's and k's own dtypes (autograd wants a gradient in
its input's dtype), computed from incoming gradients of ``out_dtype``.

Forward saves cos and sin only (never rotated copies of q or k). Both directions are one elementwise kernel over
tiles of [heads, pairs] of one token: the program grid runs over (token, head block), the head blocks of q first
and then those of k, so q and k are rotated in the same launch; each program loads its token's cos/sin once.
q, k and the gradients are read through all four strides (Hugging Face hands over ``x.view(B, T, H, D)
.transpose(1, 2)``: nothing is copied); cos/sin through three, size-1 dims read with stride 0. Each output is
laid out as its input where that is dense (Hugging Face's transposed view gives ``[B, T, H, D]`` storage: see
``_like``), else contiguous. Interleaved pairs are loaded as one contiguous row and split in registers
(``tl.split``/``tl.join``) rather than by two stride-2 loads, which do not vectorise: compiled for sm_90 (no GPU
needed), every layout's q/k loads and stores are 8- or 16-byte vector accesses. The launch configuration (tiles of
~1024 pairs, 4 warps) is not tuned on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fuser.kernels._triton import (
    HAS_TRITON,
    DtypeError,
    cdiv,
    check_floating,
    compute_dtype,
    kernel_dtypes,
    launchable,
    next_power_of_2,
    takes_triton,
    tl,
    triton,
    use_triton,
)

LAYOUTS = ("half", "interleaved", "pairs_to_halves")
# (input pairs interleaved, output pairs interleaved) per layout: halves (x[i], x[i+h]) otherwise
_PAIRING = {"half": (False, False), "interleaved": (True, True), "pairs_to_halves": (True, False)}


def _check_layout(layout: str) -> None:
    if layout not in _PAIRING:
        raise ValueError(f"fuser: rope expects layout 'half', 'interleaved' or 'pairs_to_halves', got {layout!r}")


def _has_heads(k: torch.Tensor | None) -> bool:
    """k (or dk) is present: a 0-element tensor stands for "rotate q only"."""
    return k is not None and k.numel() > 0


def _check_dtype_arg(name: str, dtype: torch.dtype | None) -> None:
    """A requested result dtype: None, or a floating-point ``torch.dtype``."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    error = DtypeError if isinstance(dtype, torch.dtype) else TypeError
    raise error(
        f"fuser: rope expects {name} to be None or a floating-point dtype (torch.float32, torch.bfloat16 or "
        f"torch.float16), got {dtype!r}"
    )


@dataclass(frozen=True)
class Rotation:
    """What rotates q and k (and, transposed, their gradients): ``cos``/``sin`` 4-D, broadcastable to
    ``[B, 1, T, rotary_dim]``; the first ``rotary_dim`` channels are rotated, paired per ``layout``."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    layout: str


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor | None, rotation: Rotation, dtypes: Iterable[tuple[str, torch.dtype | None]]
) -> None:
    """Shapes, dtypes and devices; ``q``/``k`` may equally be the gradients dq_out/dk_out; ``dtypes``: the
    requested result dtypes, each with the name of the argument that asked for it (``("out_dtype", ...)``)."""
    cos, sin, rotary_dim = rotation.cos, rotation.sin, rotation.rotary_dim
    _check_layout(rotation.layout)
    # first, so an integer tensor is named for what it is rather than failing a shape check
    check_floating("rope", q=q, k=k, cos=cos, sin=sin)
    for name, dtype in dtypes:
        _check_dtype_arg(name, dtype)
    if q.dim() != 4:
        raise ValueError(f"fuser: rope expects q of shape [batch, heads, seq, head_dim], got {tuple(q.shape)}")
    batch, _, seq_len, head_dim = q.shape
    if rotary_dim % 2 != 0 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(f"fuser: rope expects an even rotary_dim in [2, head_dim={head_dim}], got {rotary_dim}")
    if _has_heads(k) and (k.dim() != 4 or k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim):
        raise ValueError(
            f"fuser: rope expects k of shape [{batch}, kv_heads, {seq_len}, {head_dim}] (q's batch, seq and "
            f"head_dim), got {tuple(k.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and t.device != q.device:
            raise ValueError(f"fuser: rope expects {name} on q's device {q.device}, got {t.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.shape[-1] != rotary_dim:
            raise ValueError(
                f"fuser: rope expects {name} of last dim {rotary_dim} (rotary_dim) and 4 dims, got {tuple(t.shape)}"
            )
        # size-1 batch first (usual, and no guard on a symbolic batch), the token dim compared to T first
        # (the same symbol under dynamic shapes: no specialisation on T)
        broadcastable = (
            t.shape[1] == 1 and (t.shape[0] == 1 or t.shape[0] == batch) and (t.shape[2] == seq_len or t.shape[2] == 1)
        )
        if not broadcastable:
            raise ValueError(
                f"fuser: rope expects {name} broadcastable to [{batch}, 1, {seq_len}, {rotary_dim}] "
                f"(HF passes cos.unsqueeze(1)), got {tuple(t.shape)}"
            )


# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference: the same forward and backward formulas, used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _split(t: torch.Tensor, rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two channels of every pair among the first ``rotary_dim``: (t[2i], t[2i+1]) or (t[i], t[i+h])."""
    if interleaved:
        return t[..., 0:rotary_dim:2], t[..., 1:rotary_dim:2]
    half = rotary_dim // 2
    return t[..., :half], t[..., half:rotary_dim]


def _join(first: torch.Tensor, second: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of ``_split``: the pairs' two channels back into one ``[..., R]`` tensor."""
    if interleaved:
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _rotate_reference(
    x: torch.Tensor, rotation: Rotation, backward: bool, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """One tensor through the module docstring's formulas (forward, or the transposed rotation for backward),
    computed in fp32 (fp64 when any operand is fp64) and returned in ``out_dtype`` (None: x's dtype)."""
    out_dtype = out_dtype or x.dtype
    if x.numel() == 0:
        return _like(x, out_dtype)
    cos, sin, rotary_dim = rotation.cos, rotation.sin, rotation.rotary_dim
    in_pairs, out_pairs = _PAIRING[rotation.layout]
    compute = max((compute_dtype(t) for t in (x, cos, sin)), key=lambda d: d.itemsize)
    xc = x.to(compute)
    cos_p, cos_o = _split(cos.to(compute), rotary_dim, out_pairs)  # cos at the output channels p and o
    sin_p, sin_o = _split(sin.to(compute), rotary_dim, out_pairs)
    if backward:
        # dx[a] = dy[p]·cos[p] + dy[o]·sin[o];  dx[b] = dy[o]·cos[o] − dy[p]·sin[p]
        dy_p, dy_o = _split(xc, rotary_dim, out_pairs)
        rotated = _join(dy_p * cos_p + dy_o * sin_o, dy_o * cos_o - dy_p * sin_p, in_pairs)
    else:
        # y[p] = x[a]·cos[p] − x[b]·sin[p];  y[o] = x[b]·cos[o] + x[a]·sin[o]
        x_a, x_b = _split(xc, rotary_dim, in_pairs)
        rotated = _join(x_a * cos_p - x_b * sin_p, x_b * cos_o + x_a * sin_o, out_pairs)
    # the pass-through channels are copied as they are (only converted to out_dtype)
    return _like(x, out_dtype).copy_(torch.cat((rotated.to(out_dtype), x[..., rotary_dim:].to(out_dtype)), dim=-1))


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_pairs(row_ptr, head_mask, n_half, stride_d, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # the two channels of every pair, fp32 [BLOCK_HEADS, BLOCK_HALF] each (row_ptr: [BLOCK_HEADS, 1] pointers
        # to the heads' channel 0): (x[2i], x[2i+1]) or (x[i], x[i+h])
        if INTERLEAVED:
            # one contiguous load of the R channels, de-interleaved in registers (strided loads do not vectorise)
            chans = tl.arange(0, 2 * BLOCK_HALF)
            mask = head_mask[:, None] & (chans < 2 * n_half)[None, :]
            x = tl.load(row_ptr + chans[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
            first, second = tl.split(tl.reshape(x, (x.shape[0], BLOCK_HALF, 2)))
        else:
            pairs = tl.arange(0, BLOCK_HALF)
            mask = head_mask[:, None] & (pairs < n_half)[None, :]
            first = tl.load(row_ptr + pairs[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
            second = tl.load(row_ptr + (pairs + n_half)[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        return first, second

    @triton.jit
    def _store_pairs(
        row_ptr, first, second, head_mask, n_half, stride_d, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr
    ):
        # the inverse of _load_pairs: write the pairs' two channels, rounded to the output dtype
        out_ty = row_ptr.dtype.element_ty
        if INTERLEAVED:
            chans = tl.arange(0, 2 * BLOCK_HALF)
            mask = head_mask[:, None] & (chans < 2 * n_half)[None, :]
            x = tl.reshape(tl.join(first, second), (first.shape[0], 2 * BLOCK_HALF))
            tl.store(row_ptr + chans[None, :] * stride_d, x.to(out_ty), mask=mask)
        else:
            pairs = tl.arange(0, BLOCK_HALF)
            mask = head_mask[:, None] & (pairs < n_half)[None, :]
            tl.store(row_ptr + pairs[None, :] * stride_d, first.to(out_ty), mask=mask)
            tl.store(row_ptr + (pairs + n_half)[None, :] * stride_d, second.to(out_ty), mask=mask)

    @triton.jit
    def _rotate_head_block(
        src_row_ptr,
        dst_row_ptr,
        src_stride_h,
        src_stride_d,
        dst_stride_h,
        dst_stride_d,
        head_start,
        n_heads,
        rotary_dim,
        head_dim,
        cos_p,
        sin_p,
        cos_o,
        sin_o,
        BACKWARD: tl.constexpr,
        IN_INTERLEAVED: tl.constexpr,
        OUT_INTERLEAVED: tl.constexpr,
        HAS_PASS: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        # one token's heads [head_start, head_start + BLOCK_HEADS) of one tensor
        heads = head_start + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
        head_mask = heads < n_heads
        heads = heads.to(tl.int64)
        src_heads = src_row_ptr + heads[:, None] * src_stride_h  # [BLOCK_HEADS, 1]
        dst_heads = dst_row_ptr + heads[:, None] * dst_stride_h
        n_half = rotary_dim // 2
        if BACKWARD:
            # read the gradient at the output channels (p, o), write it at the input channels (a, b):
            # dx[a] = dy[p]·cos[p] + dy[o]·sin[o];  dx[b] = dy[o]·cos[o] − dy[p]·sin[p]
            dy_p, dy_o = _load_pairs(src_heads, head_mask, n_half, src_stride_d, OUT_INTERLEAVED, BLOCK_HALF)
            dx_a = dy_p * cos_p + dy_o * sin_o
            dx_b = dy_o * cos_o - dy_p * sin_p
            _store_pairs(dst_heads, dx_a, dx_b, head_mask, n_half, dst_stride_d, IN_INTERLEAVED, BLOCK_HALF)
        else:
            # y[p] = x[a]·cos[p] − x[b]·sin[p];  y[o] = x[b]·cos[o] + x[a]·sin[o]
            x_a, x_b = _load_pairs(src_heads, head_mask, n_half, src_stride_d, IN_INTERLEAVED, BLOCK_HALF)
            y_p = x_a * cos_p - x_b * sin_p
            y_o = x_b * cos_o + x_a * sin_o
            _store_pairs(dst_heads, y_p, y_o, head_mask, n_half, dst_stride_d, OUT_INTERLEAVED, BLOCK_HALF)
        if HAS_PASS:
            # channels rotary_dim..head_dim are copied unchanged
            cols = rotary_dim + tl.arange(0, BLOCK_PASS)  # [BLOCK_PASS]
            pass_mask = head_mask[:, None] & (cols < head_dim)[None, :]
            x = tl.load(src_heads + cols[None, :] * src_stride_d, mask=pass_mask, other=0.0)
            tl.store(dst_heads + cols[None, :] * dst_stride_d, x.to(dst_row_ptr.dtype.element_ty), mask=pass_mask)

    @triton.jit
    def rope_kernel(
        src_q_ptr,
        src_k_ptr,
        dst_q_ptr,
        dst_k_ptr,
        cos_ptr,
        sin_ptr,
        src_q_stride_b,
        src_q_stride_h,
        src_q_stride_t,
        src_q_stride_d,
        src_k_stride_b,
        src_k_stride_h,
        src_k_stride_t,
        src_k_stride_d,
        dst_q_stride_b,
        dst_q_stride_h,
        dst_q_stride_t,
        dst_q_stride_d,
        dst_k_stride_b,
        dst_k_stride_h,
        dst_k_stride_t,
        dst_k_stride_d,
        cos_stride_b,
        cos_stride_t,
        cos_stride_d,
        sin_stride_b,
        sin_stride_t,
        sin_stride_d,
        seq_len,
        n_q_heads,
        n_k_heads,
        head_dim,
        rotary_dim,
        BACKWARD: tl.constexpr,
        IN_INTERLEAVED: tl.constexpr,
        OUT_INTERLEAVED: tl.constexpr,
        Q_BLOCK_HEADS: tl.constexpr,
        K_BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
        HAS_PASS: tl.constexpr,
    ):
        # The forward kernel (BACKWARD=False: src = q, k; dst = q_out, k_out) and the backward kernel
        # (BACKWARD=True: src = dq_out, dk_out; dst = dq, dk), one specialisation each.
        # program → (token, head block), head blocks fastest: for HF's [B, T, H, D] storage consecutive programs
        # sweep contiguous memory (and a 1-D grid has no 65535 limit on the token count)
        n_q_blocks = tl.cdiv(n_q_heads, Q_BLOCK_HEADS)
        n_blocks = n_q_blocks + tl.cdiv(n_k_heads, K_BLOCK_HEADS)
        pid = tl.program_id(0)
        row = (pid // n_blocks).to(tl.int64)  # b·T + t; int64 offsets from here on
        block = pid % n_blocks
        batch = row // seq_len
        token = row % seq_len

        # this token's cos and sin at the output channels (p, o) of every pair, fp32  [1, BLOCK_HALF] each
        # (one row, broadcast over the heads)
        n_half = rotary_dim // 2
        one_row = tl.arange(0, 1)
        cos_row = cos_ptr + batch * cos_stride_b + token * cos_stride_t + one_row[:, None]
        sin_row = sin_ptr + batch * sin_stride_b + token * sin_stride_t + one_row[:, None]
        cos_p, cos_o = _load_pairs(cos_row, one_row < 1, n_half, cos_stride_d, OUT_INTERLEAVED, BLOCK_HALF)
        sin_p, sin_o = _load_pairs(sin_row, one_row < 1, n_half, sin_stride_d, OUT_INTERLEAVED, BLOCK_HALF)

        # the same call for q's heads and k's, on their own pointers, strides and head counts: two calls, not one on
        # selected arguments, as q and k may differ in dtype (a pointer's element type) and in block size (constexpr)
        if block < n_q_blocks:  # a block of q's heads
            _rotate_head_block(
                src_q_ptr + batch * src_q_stride_b + token * src_q_stride_t,
                dst_q_ptr + batch * dst_q_stride_b + token * dst_q_stride_t,
                src_q_stride_h,
                src_q_stride_d,
                dst_q_stride_h,
                dst_q_stride_d,
                block * Q_BLOCK_HEADS,
                n_q_heads,
                rotary_dim,
                head_dim,
                cos_p,
                sin_p,
                cos_o,
                sin_o,
                BACKWARD,
                IN_INTERLEAVED,
                OUT_INTERLEAVED,
                HAS_PASS,
                Q_BLOCK_HEADS,
                BLOCK_HALF,
                BLOCK_PASS,
            )
        else:  # a block of k's heads
            _rotate_head_block(
                src_k_ptr + batch * src_k_stride_b + token * src_k_stride_t,
                dst_k_ptr + batch * dst_k_stride_b + token * dst_k_stride_t,
                src_k_stride_h,
                src_k_stride_d,
                dst_k_stride_h,
                dst_k_stride_d,
                (block - n_q_blocks) * K_BLOCK_HEADS,
                n_k_heads,
                rotary_dim,
                head_dim,
                cos_p,
                sin_p,
                cos_o,
                sin_o,
                BACKWARD,
                IN_INTERLEAVED,
                OUT_INTERLEAVED,
                HAS_PASS,
                K_BLOCK_HEADS,
                BLOCK_HALF,
                BLOCK_PASS,
            )


# The best of benchmarks/tune_rope.py's sweep at every size it tried (docs/notes/kernels.md): 512 pairs (8 heads of
# 128) per tile on one warp.
_PAIRS_PER_TILE = 512
_NUM_WARPS = 1


def _launch_config(head_dim: int, rotary_dim: int, n_q_heads: int, n_k_heads: int) -> dict:
    """Tiles of ~``_PAIRS_PER_TILE`` pairs (1024 rotated elements): BLOCK_HALF over the pairs, head blocks of q
    and of k sized separately (a GQA k with 8 heads does not pad to q's 16), pass-through block over D − R."""
    block_half = next_power_of_2(rotary_dim // 2)
    max_heads = max(1, _PAIRS_PER_TILE // block_half)
    n_pass = head_dim - rotary_dim
    return {
        "Q_BLOCK_HEADS": min(next_power_of_2(max(n_q_heads, 1)), max_heads),
        "K_BLOCK_HEADS": min(next_power_of_2(max(n_k_heads, 1)), max_heads),
        "BLOCK_HALF": block_half,
        "BLOCK_PASS": next_power_of_2(n_pass) if n_pass > 0 else 1,
        "HAS_PASS": n_pass > 0,
        "num_warps": _NUM_WARPS,
    }


def _broadcast_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, channel) strides of a 4-D cos/sin, 0 along its size-1 (broadcast) dims."""
    return tuple(0 if t.shape[dim] == 1 else t.stride(dim) for dim in (0, 2, 3))


def _triton_runs(q: torch.Tensor, *tensors: torch.Tensor | None, out_dtypes: tuple[torch.dtype | None, ...]) -> bool:
    """Triton runs for q's device, and the kernels load and store every tensor's dtype (each its own) and
    ``out_dtypes``; a 0-element tensor (k absent) is never read, so its dtype does not count."""
    read = [t for t in (q, *tensors) if t is not None and t.numel() > 0]
    return use_triton(q) and kernel_dtypes(*read, out_dtypes=out_dtypes)


def _launch(src: tuple[torch.Tensor, torch.Tensor | None], dst: tuple, rotation: Rotation, backward: bool) -> None:
    """The kernel over the heads of ``src`` = (q, k) (k None or 0-element: q only) into ``dst``, reading and writing
    through strides."""
    (src_q, src_k), (dst_q, dst_k) = src, dst
    batch, n_q_heads, seq_len, head_dim = src_q.shape
    has_k = _has_heads(src_k)
    n_k_heads = src_k.shape[1] if has_k else 0
    config = _launch_config(head_dim, rotation.rotary_dim, n_q_heads, n_k_heads)
    n_blocks = cdiv(n_q_heads, config["Q_BLOCK_HEADS"]) + cdiv(n_k_heads, config["K_BLOCK_HEADS"])
    n_programs = batch * seq_len * n_blocks
    if n_programs == 0 or head_dim == 0:
        return
    # without k, q stands in for its pointers and strides: the k branch never runs
    src_k, dst_k = (src_k, dst_k) if has_k else (src_q, dst_q)
    cos, sin = rotation.cos, rotation.sin
    launchable(rope_kernel)[(n_programs,)](
        src_q,
        src_k,
        dst_q,
        dst_k,
        cos,
        sin,
        *src_q.stride(),
        *src_k.stride(),
        *dst_q.stride(),
        *dst_k.stride(),
        *_broadcast_strides(cos),
        *_broadcast_strides(sin),
        seq_len,
        n_q_heads,
        n_k_heads,
        head_dim,
        rotation.rotary_dim,
        BACKWARD=backward,
        IN_INTERLEAVED=_PAIRING[rotation.layout][0],
        OUT_INTERLEAVED=_PAIRING[rotation.layout][1],
        **config,
    )


def _like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A result for ``t`` in ``dtype`` (None: t's), laid out as ``t`` is where ``t`` is dense (Hugging Face's
    ``x.view(B, T, H, D).transpose(1, 2)``: ``[B, T, H, D]`` storage), else contiguous. An attention kernel that
    allocates its output in its query's layout (cuDNN's, flash's) then returns it in ``[B, T, H, D]`` storage, so
    the model's ``transpose(1, 2).reshape(B, T, H·D)`` before the output projection is a view, not a copy; the
    backward's gradients come back the same way to the q/k projections' ``view``/``transpose``."""
    return torch.empty_like(t, dtype=dtype or t.dtype, memory_format=torch.preserve_format)


def _new_out(t: torch.Tensor, dtype: torch.dtype | None, out: torch.Tensor | None) -> torch.Tensor:
    """A result of ``t``'s shape in ``dtype`` (None: t's), laid out as :func:`_like` says, or the caller's ``out``
    buffer after checking it."""
    dtype = dtype or t.dtype
    if out is None:
        return _like(t, dtype)
    if out.shape != t.shape or out.dtype != dtype:
        raise ValueError(
            f"fuser: rope expects an out buffer of shape {tuple(t.shape)} and dtype {dtype}, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    return out


# the names of the result dtypes in the ops, per direction (errors name the argument that was wrong)
_DTYPE_NAMES = {False: ("out_dtype", "out_dtype"), True: ("dq_dtype", "dk_dtype")}


def rope_rotate(
    q: torch.Tensor,
    k: torch.Tensor | None,
    rotation: Rotation,
    dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
    *,
    backward: bool = False,
    impl: str = "auto",
    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both ops' work: q and k rotated (``backward``: the incoming gradients dq_out and dk_out through the transposed
    rotation), in fp32 (fp64 for fp64 inputs on the reference path), returned laid out as their inputs
    (``_like``) in ``dtypes`` (q's, k's; None: the input's dtype). k None gives None, a 0-element k an empty result.

    ``impl``: ``"triton"`` launches the kernel, ``"reference"`` runs the plain-torch formulas (the test oracle),
    ``"auto"`` picks as the ops do. ``out``: buffers for the kernel's results (q's / k's shape and result dtype, any
    strides), so tests can pre-fill them with NaN; q and k are read in place through their strides."""
    _check_inputs(q, k, rotation, zip(_DTYPE_NAMES[backward], dtypes, strict=True))
    cos, sin = rotation.cos, rotation.sin
    if not takes_triton(impl, impl == "auto" and _triton_runs(q, k, cos, sin, out_dtypes=dtypes)):
        return tuple(
            None if x is None else _rotate_reference(x, rotation, backward, dtype)
            for x, dtype in zip((q, k), dtypes, strict=True)
        )
    results = tuple(None if x is None else _new_out(x, d, o) for x, d, o in zip((q, k), dtypes, out, strict=True))
    _launch((q, k), results, rotation, backward)
    return results


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::rope", mutates_args=())
def rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    layout: str,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out), each laid out as its input (``_like``), in ``out_dtype`` (None: q's / k's dtype); a
    0-element k means "rotate q only" and gives a 0-element k_out."""
    return rope_rotate(q, k, Rotation(cos, sin, rotary_dim, layout), (out_dtype, out_dtype))


def _fake_results(q, k, rotation: Rotation, dtypes, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, rotation, zip(_DTYPE_NAMES[backward], dtypes, strict=True))
    return tuple(_like(t, dtype) for t, dtype in zip((q, k), dtypes, strict=True))


@rope_op.register_fake
def _(q, k, cos, sin, rotary_dim, layout, out_dtype=None):
    return _fake_results(q, k, Rotation(cos, sin, rotary_dim, layout), (out_dtype, out_dtype), backward=False)


# The backward op takes the forward's arguments, q and k replaced by their incoming gradients, and a result dtype
# for each (q's and k's); its schema is written from the same pieces as the forward's (torch infers that one from
# rope_op's signature).
_ROTATION_SCHEMA = "Tensor cos, Tensor sin, SymInt rotary_dim, str layout"
_BACKWARD_SCHEMA = (
    f"(Tensor dq_out, Tensor dk_out, {_ROTATION_SCHEMA}, ScalarType? dq_dtype=None, ScalarType? dk_dtype=None)"
    " -> (Tensor, Tensor)"
)


@torch.library.custom_op("fuser::rope_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def rope_backward_op(dq_out, dk_out, cos, sin, rotary_dim, layout, dq_dtype=None, dk_dtype=None):
    """(dq, dk), each laid out as its incoming gradient (``_like``), in ``dq_dtype`` / ``dk_dtype`` (None:
    dq_out's / dk_out's dtype); a 0-element dk_out (k absent, or its gradient not wanted) gives a 0-element dk."""
    return rope_rotate(dq_out, dk_out, Rotation(cos, sin, rotary_dim, layout), (dq_dtype, dk_dtype), backward=True)


@rope_backward_op.register_fake
def _(dq_out, dk_out, cos, sin, rotary_dim, layout, dq_dtype=None, dk_dtype=None):
    return _fake_results(dq_out, dk_out, Rotation(cos, sin, rotary_dim, layout), (dq_dtype, dk_dtype), backward=True)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, rotary_dim, layout = inputs[:6]
    # cos and sin are all backward needs: the rotation is linear in q and k
    ctx.save_for_backward(cos, sin)
    ctx.rotary_dim, ctx.layout = rotary_dim, layout
    # the gradients go back in q's and k's own dtypes, whatever out_dtype the outputs (and their gradients) have
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    need_dq = ctx.needs_input_grad[0] and dq_out is not None
    need_dk = ctx.needs_input_grad[1] and dk_out is not None
    no_grads = (None,) * 7
    if not (need_dq or need_dk):
        return no_grads
    # a gradient not wanted (or of an unused output) goes in as a 0-element tensor: its heads are skipped; the
    # op treats its two tensors alike, so k's gradient alone goes through q's slot
    empty = cos.new_empty(0)
    rotary_dim, layout = ctx.rotary_dim, ctx.layout
    if need_dq:
        dq, dk = torch.ops.fuser.rope_backward(
            dq_out, dk_out if need_dk else empty, cos, sin, rotary_dim, layout, ctx.q_dtype, ctx.k_dtype
        )
    else:
        dq, (dk, _) = None, torch.ops.fuser.rope_backward(dk_out, empty, cos, sin, rotary_dim, layout, ctx.k_dtype)
    # no gradient for cos and sin (the functional refuses cos/sin that require one)
    return (dq, (dk if need_dk else None), *no_grads[2:])


rope_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------------


def _as_4d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 3:  # [B | 1, T, R], as HF's rotary embedding returns it: unsqueeze the head dim
        return t.unsqueeze(1)
    if t.dim() != 4:
        raise ValueError(
            f"fuser: rope expects {name} of shape [batch or 1, seq, rotary_dim] or 4-D broadcastable to "
            f"[batch, 1, seq, rotary_dim], got {tuple(t.shape)}"
        )
    return t


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int | None = None,
    layout: str = "half",
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary position embedding of q ``[B, Hq, T, D]`` and k ``[B, Hk, T, D]`` (or None), fused, with autograd.

    ``cos``/``sin``: ``[B | 1, T, R]`` (HF's rotary embedding output; unsqueezed on dim 1 here) or 4-D
    broadcastable to ``[B, 1, T, R]``. q, k, cos and sin may each be fp32, bf16 or fp16. ``rotary_dim`` defaults
    to R; channels from it on pass through. ``layout``: ``"half"`` (``rotate_half``), ``"interleaved"`` (GLM) or
    ``"pairs_to_halves"`` (DeepSeek); see the module docstring. The maths runs in fp32; q_out and k_out are
    laid out as q and k where those are dense (else contiguous), in ``out_dtype`` (None: q's / k's dtype;
    eager's ``q * cos + rotate_half(q) * sin`` gives
    ``torch.promote_types(q.dtype, cos.dtype)``). q.grad and k.grad come back in q's and k's dtypes. No gradient
    flows to cos and sin.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"fuser: rope expects {name} to be a tensor, got {type(t).__name__}")
    _check_dtype_arg("out_dtype", out_dtype)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "fuser: rope computes no gradient for cos/sin, but cos or sin requires grad; pass cos.detach() and "
            "sin.detach() (or use the unfused formula if you train the rotary frequencies)"
        )
    cos, sin = _as_4d(cos, "cos"), _as_4d(sin, "sin")
    rotary_dim = cos.shape[-1] if rotary_dim is None else int(rotary_dim)
    k_or_empty = k if k is not None else q.new_empty(0)
    q_out, k_out = torch.ops.fuser.rope(q, k_or_empty, cos, sin, rotary_dim, layout, out_dtype)
    return q_out, (k_out if k is not None else None)
