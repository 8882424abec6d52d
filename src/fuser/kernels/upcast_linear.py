"""``linear(x.to(weight.dtype), weight, bias)`` that keeps ``x`` in its own (half) precision for the backward.

peft keeps LoRA adapters in fp32 under a bf16 base model and casts each adapter's input up: ``lora_A(x.float())``.
The weight gradient of ``lora_A`` needs that input in the backward, and Inductor's partitioner saves the fp32 copy
(a tensor consumed by a matmul in the backward is never recomputed), twice the bytes of the bf16 ``x`` it came
from, for every adapter input of every layer.

This op computes exactly what the graph computed (the same cast, the same fp32 matmul) but saves ``x`` itself;
the backward casts it again, transiently:

    y      = x.to(W.dtype) @ Wᵀ + b
    dx     = (dy @ W).to(x.dtype)          the cast's backward rounds the fp32 gradient once, as eager's does
    dW     = dyᵀ @ x.to(W.dtype)           (rows of all leading dims flattened)
    db     = Σ dy

A LoRA ``lora_A`` has few outputs (the rank, 8–64), and its three fp32 matmuls run on cuBLAS's CUDA-core kernels (no
TF32), many times slower than reading ``x`` once (``docs/notes/kernels.md``, upcast linear). So on a GPU, weights of at
most 64 rows take Triton kernels instead (the ops' ``allow_triton=False`` switches them off; the pattern passes
``FuserConfig.experimental.upcast_linear.triton``): they read ``x`` in its own dtype (no fp32 copy is written, not even
transiently), their dots run on the tensor cores as ``tf32x3`` (fp32 accuracy: see ``CONFIGS``), and ``dx`` is rounded
to ``x``'s dtype in the kernel. The weight gradient is summed over the rows in fixed row blocks,
partial sums added in a fixed order (deterministic). They measured several times faster than cuBLAS's fp32 path,
with a smaller error against fp64 (``docs/defaults.md``, ``experimental.upcast_linear.triton``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuser._dtypes import HALF_DTYPES
from fuser.kernels._triton import (
    HAS_TRITON,
    as_rows,
    cdiv,
    check_floating,
    check_linear,
    launchable,
    next_power_of_2,
    or_empty,
    tl,
    triton,
    use_triton,
)
from fuser.kernels.gated_activation import Lora, gated_activation_forward
from fuser.kernels.linear_gated import GATED_GRADS_ARGS, GATED_LINEAR_ARGS

TRITON_MAX_OUT = 64  # the Triton path's widest weight (out features): LoRA ranks
_alloc = torch.empty  # the Triton path's output buffers (tests fill them with NaN first)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # an integer x: eager's F.linear(x.to(weight.dtype), ...) would run, but nothing here is written for it
    check_floating("upcast_linear", x=x, weight=weight, bias=bias)
    check_linear("upcast_linear", "x", x, weight, bias)


if HAS_TRITON:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        # a @ b with fp32 sums. Two operands of one half dtype (a LoRA sum of adapters autocast rounded) take the
        # tensor cores' native dot: each product is exact, as under any PRECISION; otherwise both are fp32 at
        # Triton's input_precision PRECISION
        if a.dtype == b.dtype and a.dtype != tl.float32:
            out = tl.dot(a, b)
        else:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        return out

    @triton.jit
    def upcast_linear_fwd_kernel(x_ptr, w_ptr, y_ptr, scale, n_rows, n_in, n_out, x_row_stride, w_stride_out,
                                 w_stride_in, k_per_split, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                 OUT_P: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        scale = tl.cast(scale, tl.float32)
        # y[split, rows, :] = scale · x[rows, ks of the split] @ W[:, ks of the split]ᵀ with fp32 sums, x read in
        # its own dtype (W [n_out, n_in] at any strides); one split (the whole of n_in) unless the caller splits it
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(1)
        outs = tl.arange(0, OUT_P)
        row_ok = rows < n_rows
        acc = tl.zeros((BLOCK_M, OUT_P), tl.float32)
        first = split * k_per_split
        for k0 in range(0, k_per_split, BLOCK_K):
            ks = first + k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < n_in  # k_per_split is a multiple of BLOCK_K: no tile crosses into the next split
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + outs[None, :] * w_stride_out + ks[:, None] * w_stride_in,
                        mask=k_ok[:, None] & (outs[None, :] < n_out), other=0.0)  # fmt: skip
            acc += _dot(x, w, PRECISION)
        y_ptr += split.to(tl.int64) * n_rows * n_out
        tl.store(y_ptr + rows[:, None].to(tl.int64) * n_out + outs[None, :], acc * scale,
                 mask=row_ok[:, None] & (outs[None, :] < n_out))  # fmt: skip

    @triton.jit
    def upcast_linear_dx_kernel(dy_ptr, w_ptr, dx_ptr, base_ptr, wide_ptr, scale, n_rows, n_in, n_out,
                                dy_row_stride, w_stride_out, w_stride_in, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                OUT_P: tl.constexpr, PRECISION: tl.constexpr, HAS_BASE: tl.constexpr,
                                ROUND_TERM: tl.constexpr, HAS_WIDE: tl.constexpr, ROW_TILES: tl.constexpr):  # fmt: skip
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        scale = tl.cast(scale, tl.float32)
        # dx[rows, cols] = (dy[rows, :] @ W[:, cols]) in fp32, rounded once to dx's dtype (W [n_out, n_in] at any
        # strides, dy at any row stride: a LoRA A output shared by several adapters, sliced); with HAS_BASE:
        # (base + scale · (dy @ W)) in fp32, rounded once (fuser::lora_sum's forward), or
        # with ROUND_TERM the term rounded to dx's dtype first, as peft's bitsandbytes layers add it; HAS_WIDE
        # also stores the unrounded fp32 value (fuser::lora_sum_wide: what a gated op computes its product from).
        # A program loads its columns of W once and computes ROW_TILES consecutive row tiles with them (each
        # tile's result is the same single dot, whatever ROW_TILES is)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        outs = tl.arange(0, OUT_P)
        col_ok, out_ok = cols < n_in, outs < n_out
        w = tl.load(w_ptr + outs[:, None] * w_stride_out + cols[None, :] * w_stride_in,
                    mask=out_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        for tile in range(ROW_TILES):
            rows = (tl.program_id(0) * ROW_TILES + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < n_rows
            dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * dy_row_stride + outs[None, :],
                         mask=row_ok[:, None] & out_ok[None, :], other=0.0)  # fmt: skip
            dx = _dot(dy, w, PRECISION)
            offsets = rows[:, None].to(tl.int64) * n_in + cols[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            if HAS_BASE:
                base = tl.load(base_ptr + offsets, mask=mask, other=0.0)
                term = dx * scale
                if ROUND_TERM:
                    term = term.to(dx_ptr.dtype.element_ty).to(tl.float32)
                dx = base.to(tl.float32) + term
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if HAS_WIDE:
                tl.store(wide_ptr + offsets, dx, mask=mask)

    @triton.jit
    def upcast_linear_dw_kernel(dy_ptr, x_ptr, partial_ptr, rstd_ptr, nw_ptr, scale, offset, n_rows, n_in, n_out,
                                dy_row_stride, x_row_stride, rows_per_split, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, OUT_P: tl.constexpr, PRECISION: tl.constexpr,
                                NORM: tl.constexpr = False, HAS_NW: tl.constexpr = False):  # fmt: skip
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        scale, offset = tl.cast(scale, tl.float32), tl.cast(offset, tl.float32)
        # partial[split, :, cols] = scale · dy[rows of the split, :]ᵀ @ x[rows of the split, cols], fp32 sums; with
        # NORM, x is an RMSNorm's input and the dot reads its output instead, rebuilt as the norm's kernel computes
        # it: (x · rstd[row] · (w[col] + offset)) in fp32, rounded to x's dtype (fuser::upcast_linear_normed)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        outs = tl.arange(0, OUT_P)
        col_ok, out_ok = cols < n_in, outs < n_out
        if NORM and HAS_NW:
            nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        acc = tl.zeros((OUT_P, BLOCK_N), tl.float32)
        first = split * rows_per_split
        for r0 in range(0, rows_per_split, BLOCK_M):
            rows = first + r0 + tl.arange(0, BLOCK_M)
            row_ok = (rows < n_rows) & (r0 + tl.arange(0, BLOCK_M) < rows_per_split)
            dy_t = tl.load(dy_ptr + rows[None, :].to(tl.int64) * dy_row_stride + outs[:, None],
                           mask=out_ok[:, None] & row_ok[None, :], other=0.0)  # fmt: skip
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            if NORM:
                rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
                normed = x.to(tl.float32) * rstd[:, None]
                if HAS_NW:
                    normed = normed * nw[None, :]
                x = normed.to(x_ptr.dtype.element_ty)
            acc += _dot(dy_t, x, PRECISION)
        tl.store(partial_ptr + split.to(tl.int64) * OUT_P * n_in + outs[:, None] * n_in + cols[None, :], acc * scale,
                 mask=out_ok[:, None] & col_ok[None, :])  # fmt: skip


def triton_enabled(x: torch.Tensor, allow_triton: bool = True) -> bool:
    """Triton runs for ``x`` (a GPU, or the interpreter) and the op's ``allow_triton`` did not switch it off."""
    return allow_triton and use_triton(x)


def triton_path(x: torch.Tensor, weight: torch.Tensor, allow_triton: bool = True) -> bool:
    """The Triton kernels: not switched off (``allow_triton=False``), a half input, a narrow weight in fp32 or in the
    input's dtype (an adapter autocast rounded: the dots take both operands in that dtype, the products exact)."""
    return (
        triton_enabled(x, allow_triton)
        and weight.dtype in (torch.float32, x.dtype)
        and x.dtype in HALF_DTYPES
        and 0 < weight.shape[0] <= TRITON_MAX_OUT
        and weight.is_contiguous()
    )


# Launch configurations, per kernel: tile sizes, warps, pipeline stages, and the dot's input precision. On a GPU the
# dots run on the tensor cores as "tf32x3" (each fp32 operand split into a TF32 high part and a TF32 remainder,
# three products summed in fp32: about 2^-21 relative per product, below the fp32 sums' own rounding over the
# thousands of terms here; x in bf16/fp16 is exact in TF32, so its remainder is zero). A "bf16x3" variant (x as a
# native bf16 operand, the fp32 one split into three bf16 parts) was tried and dropped: its forward was much further
# from fp64 than tf32x3's. Chosen by ``benchmarks/tune_upcast_linear.py``. The forward's inputs in 4 splits (partial
# products summed in a fixed order): 64-row tiles leave too few programs to fill the GPU's SMs for a few thousand
# rows while each streams its rows' inputs. The dW's rows in 16 splits of at least 2 row blocks, and for ranks above
# 16 32-column blocks. dx (also lora_sum's forward): each program loads its W columns once and computes 8 row tiles
# of 64. What each choice measured: docs/notes/kernels.md (upcast linear). The interpreter (CPU) ignores the
# precision and the stages.
CONFIGS = {
    "fwd": {"BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "PRECISION": "tf32x3", "SPLIT_K": 4},
    "dx": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "ROW_TILES": 8, "PRECISION": "tf32x3"},
    "dw": {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_N_WIDE_RANK": 32,  # BLOCK_N where the rank (padded) is above 16
        "num_warps": 4,
        "num_stages": 3,
        "PRECISION": "tf32x3",
        "SPLITS": 16,
        "MIN_SPLIT_BLOCKS": 2,
    },
}
_CPU_CONFIGS = {
    "fwd": {"BLOCK_M": 16, "BLOCK_K": 32, "PRECISION": "ieee", "SPLIT_K": 1},
    "dx": {"BLOCK_M": 16, "BLOCK_N": 32, "PRECISION": "ieee", "ROW_TILES": 2},  # the row loop runs in CI too
    "dw": {"BLOCK_M": 16, "BLOCK_N": 32, "PRECISION": "ieee", "SPLITS": 16},
}


def _config(kind: str, device: torch.device) -> dict:
    return dict(CONFIGS[kind] if device.type == "cuda" else _CPU_CONFIGS[kind])


def _even_splits(n: int, max_splits: int, block: int) -> tuple[int, int]:
    """(items per split, splits): at most ``max_splits`` near-equal splits of ``n`` items, each a multiple of
    ``block`` (so no tile crosses into the next split), at least one split."""
    per_split = cdiv(cdiv(max(n, 1), max_splits), block) * block
    return per_split, max(1, cdiv(n, per_split))


def _out_p(n_out: int) -> int:
    return max(16, next_power_of_2(n_out))


def _forward_triton(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · (x @ weightᵀ)`` in fp32 (``weight`` [out, in], ≤ 64 rows, any strides), ``x`` read in its own
    dtype; the scale applied to each split's partial product, before their sum."""
    x2 = as_rows(x)
    n_rows, n_in = x2.shape
    n_out = weight.shape[0]
    cfg = _config("fwd", x.device)
    # the inputs in a fixed number of splits (a function of the shapes): more programs for few rows; the
    # splits' partial products are added in a fixed order (deterministic)
    k_per_split, splits = _even_splits(n_in, cfg.pop("SPLIT_K"), cfg["BLOCK_K"])
    y = _alloc(splits, n_rows, n_out, dtype=torch.float32, device=x.device)
    if n_rows:
        launchable(upcast_linear_fwd_kernel)[(cdiv(n_rows, cfg["BLOCK_M"]), splits)](
            x2, weight, y, float(scale), n_rows, n_in, n_out, x2.stride(0), weight.stride(0), weight.stride(1),
            k_per_split, OUT_P=_out_p(n_out), **cfg,
        )  # fmt: skip
    y = y[0] if splits == 1 else y.sum(0)
    return y.view(*x.shape[:-1], n_out)


def _dx_triton(
    dy: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    base: torch.Tensor | None = None,
    scale: float = 1.0,
    round_term: bool = False,
    out: torch.Tensor | None = None,
    wide_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(dy @ weight).to(dtype)`` (``weight`` [out, in], ≤ 64 rows, any strides), fp32 sums; with ``base``
    ([rows…, in], contiguous): ``(base + scale · (dy @ weight)).to(dtype)``, one rounding (``round_term``:
    ``base + (scale · (dy @ weight)).to(dtype)``, the term rounded first). ``out`` (contiguous, ``[rows, in]``
    elements of ``dtype``) receives the result, and may be ``base`` itself: each tile reads its base before it
    writes the same tile. ``wide_out`` (contiguous fp32, ``[rows, in]``) also receives the unrounded result."""
    dy2 = as_rows(dy)
    n_rows, n_out = dy2.shape
    n_in = weight.shape[1]
    dx = _alloc(n_rows, n_in, dtype=dtype, device=dy.device) if out is None else out.view(n_rows, n_in)
    cfg = _config("dx", dy.device)
    if n_rows:
        grid = (cdiv(n_rows, cfg["BLOCK_M"] * cfg["ROW_TILES"]), cdiv(n_in, cfg["BLOCK_N"]))
        launchable(upcast_linear_dx_kernel)[grid](
            dy2, weight, dx, dx if base is None else base, dx if wide_out is None else wide_out, float(scale),
            n_rows, n_in, n_out, dy2.stride(0), weight.stride(0), weight.stride(1), OUT_P=_out_p(n_out),
            HAS_BASE=base is not None, ROUND_TERM=round_term, HAS_WIDE=wide_out is not None, **cfg,
        )  # fmt: skip
    return dx.view(*dy.shape[:-1], n_in)


def _dw_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: float = 1.0,
    transposed: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
) -> torch.Tensor:
    """``scale · (dyᵀ @ x)`` in fp32, ``[dy's columns, x's columns]`` (``transposed``: its transpose, contiguous),
    the scale applied to each row split's partial sum, before their (fixed-order) sum. ``norm = (rstd, weight,
    offset)``: ``x`` is an RMSNorm's input, and the product reads the norm's output rebuilt from it (see
    :func:`normed_reference`)."""
    dy2, x2 = as_rows(dy), as_rows(x)
    n_rows, n_out = dy2.shape
    n_in = x2.shape[1]
    out_p = _out_p(n_out)
    cfg = _config("dw", x.device)
    wide_rank_block = cfg.pop("BLOCK_N_WIDE_RANK", None)
    if wide_rank_block is not None and out_p > 16:
        cfg["BLOCK_N"] = wide_rank_block
    block_m = cfg["BLOCK_M"]
    # the rows in a fixed number of splits (a function of the shapes; at least MIN_SPLIT_BLOCKS row blocks each),
    # each summed by one program per column block; the partial sums are added in a fixed order (deterministic)
    min_blocks = cfg.pop("MIN_SPLIT_BLOCKS", 8)
    max_splits = max(1, min(cfg.pop("SPLITS"), cdiv(n_rows, min_blocks * block_m)))
    rows_per_split, splits = _even_splits(n_rows, max_splits, block_m)
    partial = _alloc(splits, out_p, n_in, dtype=torch.float32, device=x.device)
    if n_rows:
        rstd, nw, offset = (norm[0].reshape(-1), norm[1], norm[2]) if norm is not None else (partial, None, 0.0)
        launchable(upcast_linear_dw_kernel)[(cdiv(n_in, cfg["BLOCK_N"]), splits)](
            dy2, x2, partial, rstd, partial if nw is None else nw, float(scale), float(offset), n_rows,
            n_in, n_out, dy2.stride(0), x2.stride(0), rows_per_split, OUT_P=out_p, NORM=norm is not None,
            HAS_NW=nw is not None, **cfg,
        )  # fmt: skip
    else:
        partial.zero_()
    if not transposed:
        return partial[:, :n_out].sum(0)
    out = _alloc(n_in, n_out, dtype=torch.float32, device=x.device)
    torch.sum(partial[:, :n_out], 0, out=out.t())  # the sum written through the transposed view: one kernel
    return out


def _upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, allow_triton: bool
) -> torch.Tensor:
    _check(x, weight, bias)
    if triton_path(x, weight, allow_triton):
        y = _forward_triton(x, weight)
        return (y + bias if bias is not None else y).to(weight.dtype)  # fp32 sums, rounded once for a half weight
    return F.linear(x.to(weight.dtype), weight, bias)


@torch.library.custom_op("fuser::upcast_linear", mutates_args=())
def upcast_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, allow_triton: bool = True
) -> torch.Tensor:
    """``allow_triton``: whether the Triton kernels may run (where they do: a GPU, or the interpreter), forward and
    backward; ``False`` keeps cuBLAS's fp32 matmuls."""
    return _upcast_linear(x, weight, bias, allow_triton)


def _fake_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


@upcast_linear_op.register_fake
def _(x, weight, bias, allow_triton=True):
    return _fake_out(x, weight)


def _linear_context(ctx, inputs, bias_at: int, allow_triton_at: int) -> None:
    """What every upcast linear's backward reads besides its saved tensors: whether it has a bias (at
    ``inputs[bias_at]``), ``allow_triton`` (``inputs[allow_triton_at]``, its last argument: absent when left at its
    default), and how many inputs to return gradients for."""
    ctx.has_bias = inputs[bias_at] is not None
    ctx.allow_triton = inputs[allow_triton_at] if len(inputs) > allow_triton_at else True
    ctx.n_inputs = len(inputs)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.save_for_backward(x, weight)
    _linear_context(ctx, inputs, 2, 3)


@torch.library.custom_op("fuser::upcast_linear_grads", mutates_args=())
def upcast_linear_grads(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool, allow_triton: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dW in W's dtype), each 0-element where not asked for."""
    fast = triton_path(x, weight, allow_triton)
    dx = _linear_dx(dy, x, weight, fast) if need_x else x.new_empty(0)
    return dx, _linear_dw(dy, x, weight, fast) if need_w else weight.new_empty(0)


# upcast_linear_grads' two results, each its own function: the fused ops whose backward includes a linear's
# (the gated and normed ones) call these, not the custom op, whose wrapper (autograd kernel, dispatcher, output
# checks) costs host time on every call (docs/notes/host-overhead.md) and does nothing inside another op. ``fast``: the
# caller's ``triton_path(x, weight, allow_triton)``, asked once per op
def _linear_dx(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
    """``(dy @ weight).to(x.dtype)``."""
    if fast:
        return _dx_triton(dy, weight, x.dtype)
    return (dy @ weight).to(x.dtype)


def _linear_dw(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
    """``dyᵀ @ x`` in W's dtype."""
    if fast:
        return _dw_triton(dy, x).to(weight.dtype)
    return dy.reshape(-1, dy.shape[-1]).t().to(weight.dtype) @ x.reshape(-1, x.shape[-1]).to(weight.dtype)


@upcast_linear_grads.register_fake
def _(dy, x, weight, need_x, need_w, allow_triton=True):
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return dx, weight.new_empty(weight.shape) if need_w else weight.new_empty(0)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = dw = None
    if need_x or need_w:
        dx, dw = torch.ops.fuser.upcast_linear_grads(dy, x, weight, need_x, need_w, ctx.allow_triton)
    db = _bias_grad(dy) if need_b and ctx.has_bias else None
    return (dx if need_x else None), (dw if need_w else None), db, *[None] * (ctx.n_inputs - 3)


def _bias_grad(dy: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).sum(0)


upcast_linear_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# The same op on a gated MLP's product, which its backward recomputes instead of saving
# ---------------------------------------------------------------------------------------------------------


# linear_gated's argument lists (linear_gated.GATED_LINEAR_ARGS, GATED_GRADS_ARGS), with allow_triton
@torch.library.custom_op(
    "fuser::upcast_linear_gated", mutates_args=(), schema=f"({GATED_LINEAR_ARGS}, bool allow_triton=True) -> Tensor"
)
def upcast_linear_gated_op(x, gate, up, weight, bias, gate_scale, up_scale, activation, allow_triton=True):
    """``upcast_linear(x, weight, bias, allow_triton)`` where ``x`` is ``fuser::gated_activation(gate, up, None, None,
    gate_scale, up_scale, activation)[0]`` (peft's LoRA A of a gated MLP's down projection): the backward saves
    gate and up (which the gated op's backward saves anyway) instead of ``x``, and recomputes ``x`` with that same
    op, so the weight gradient reads the very values the forward used."""
    return _upcast_linear(x, weight, bias, allow_triton)


@upcast_linear_gated_op.register_fake
def _(x, gate, up, weight, bias, gate_scale, up_scale, activation, allow_triton=True):
    return _fake_out(x, weight)


def _gated_setup_context(ctx, inputs, output):
    x, gate, up, weight, bias, gate_scale, up_scale, activation = inputs[:8]
    ctx.save_for_backward(gate, up, weight)
    ctx.gated = (gate_scale, up_scale, activation)
    _linear_context(ctx, inputs, 4, 8)


@torch.library.custom_op(
    "fuser::upcast_linear_gated_grads",
    mutates_args=(),
    schema=f"({GATED_GRADS_ARGS}, bool need_x, bool need_w, bool allow_triton=True) -> (Tensor, Tensor)",
)
def upcast_linear_gated_grads(
    dy, gate, up, weight, gate_scale, up_scale, activation, need_x, need_w, allow_triton=True
):
    """``upcast_linear_grads`` with x recomputed from gate and up here (where dW needs it), by the gated op's own
    forward: one op that reads ``dy``, so the recompute belongs to the backward (a separate call of the gated op
    would be merged with the forward's by common-subexpression elimination, and its output saved again)."""
    dw = _gated_weight_grad(dy, gate, up, weight, gate_scale, up_scale, activation, allow_triton) if need_w else None
    dx = _linear_dx(dy, gate, weight, triton_path(gate, weight, allow_triton)) if need_x else gate.new_empty(0)
    return dx, or_empty(dw, weight)


# rows of the recomputed product per weight-gradient step: a 64 MiB slice, not the whole [tokens, intermediate]
# tensor (896 MiB for Llama-3-8B at 32,768 tokens), which would sit beside gate, up and dx at the peak of a
# checkpointed layer's backward; small inputs are one slice, computed exactly as without slicing
GATED_RECOMPUTE_BYTES = 64 << 20


def _gated_weight_grad(dy, gate, up, weight, gate_scale, up_scale, activation, allow_triton) -> torch.Tensor:
    """dW = dyᵀ @ x with x = the gated product, recomputed slice by slice of rows (fp32 partial sums added in
    order: deterministic)."""
    n_cols = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, n_cols), up.reshape(-1, n_cols)
    dy2 = dy.reshape(-1, dy.shape[-1])
    n_rows = gate2.shape[0]
    fast = triton_path(gate, weight, allow_triton)  # the product has gate's dtype and device
    step = max(256, GATED_RECOMPUTE_BYTES // max(1, n_cols * gate.element_size()) // 256 * 256)
    if n_rows <= step:
        x = gated_activation_forward(gate, up, activation, Lora(None, None, gate_scale, up_scale))[0]
        return _linear_dw(dy, x, weight, fast)
    dw = None
    # the slices' sums added in fp32 and rounded once to a half weight's dtype (an adapter autocast rounded)
    wide = weight.to(torch.float32)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        x = gated_activation_forward(gate2[rows], up2[rows], activation, Lora(None, None, gate_scale, up_scale))[0]
        part = _linear_dw(dy2[rows], x, wide, fast)
        del x  # before the next slice is allocated: one slice live at a time, not two
        dw = part if dw is None else dw.add_(part)
    return dw.to(weight.dtype)


@torch.library.custom_op(
    "fuser::upcast_linear_gated_grads_acc_",
    mutates_args=("dx_acc",),
    schema=f"(Tensor(a0!) dx_acc, {GATED_GRADS_ARGS}, bool need_w, bool allow_triton=True) -> Tensor",
)
def upcast_linear_gated_grads_acc_(
    dx_acc, dy, gate, up, weight, gate_scale, up_scale, activation, need_w, allow_triton=True
):
    """``upcast_linear_gated_grads`` whose dx is added into ``dx_acc`` (``dx_acc += dx``, rounded as
    ``dx_acc + dx`` in dx_acc's dtype would be) instead of returned: returns dW (empty unless ``need_w``).

    Never called by autograd: a post-grad pass (:mod:`fuser.inductor.gated_mlp_inplace`) puts it in place of
    ``upcast_linear_gated_grads`` + the ``add`` that sums its dx with the base projection's, when nothing reads
    the base's gradient afterwards; one ``[tokens, intermediate]`` buffer fewer at the peak."""
    dw = _gated_weight_grad(dy, gate, up, weight, gate_scale, up_scale, activation, allow_triton) if need_w else None
    if triton_path(gate, weight, allow_triton) and dx_acc.is_contiguous() and dx_acc.dtype == gate.dtype:
        _dx_triton(dy, weight, gate.dtype, base=dx_acc, round_term=True, out=dx_acc)
    else:
        dx_acc.add_((dy @ weight).to(gate.dtype))
    return or_empty(dw, weight)


@upcast_linear_gated_grads_acc_.register_fake
def _(dx_acc, dy, gate, up, weight, gate_scale, up_scale, activation, need_w, allow_triton=True):
    return weight.new_empty(weight.shape) if need_w else weight.new_empty(0)


@upcast_linear_gated_grads.register_fake
def _(dy, gate, up, weight, gate_scale, up_scale, activation, need_x, need_w, allow_triton=True):
    dx = gate.new_empty(gate.shape) if need_x else gate.new_empty(0)
    return dx, weight.new_empty(weight.shape) if need_w else weight.new_empty(0)


def _gated_backward(ctx, dy):
    gate, up, weight = ctx.saved_tensors
    need_x, _, _, need_w, need_b = ctx.needs_input_grad[:5]
    dx = dw = None
    if need_x or need_w:
        dx, dw = torch.ops.fuser.upcast_linear_gated_grads(dy, gate, up, weight, *ctx.gated, need_x, need_w,
                                                           ctx.allow_triton)  # fmt: skip
    db = _bias_grad(dy) if need_b and ctx.has_bias else None
    return (dx if need_x else None), None, None, (dw if need_w else None), db, *[None] * (ctx.n_inputs - 5)


upcast_linear_gated_op.register_autograd(_gated_backward, setup_context=_gated_setup_context)


# ---------------------------------------------------------------------------------------------------------
# The same op on an RMSNorm's output, which its backward rebuilds from the norm's input instead of saving it
# ---------------------------------------------------------------------------------------------------------

_NORMED_ARGS = "Tensor h, Tensor rstd, Tensor? norm_weight, float offset"


def normed_reference(h: torch.Tensor, rstd: torch.Tensor, norm_weight: torch.Tensor | None, offset: float):
    """An RMSNorm's output rebuilt from its input ``h`` and the ``rstd`` its forward computed, as fuser's norm
    kernel computes it (``fuser::rms_norm`` with ``norm_dtype=None``): ``h · rstd · (w + offset)`` in fp32, rounded
    to h's dtype."""
    y = h.to(torch.float32) * rstd.unsqueeze(-1)
    if norm_weight is not None:
        y = y * (norm_weight.to(torch.float32) + offset)
    return y.to(h.dtype)


@torch.library.custom_op(
    "fuser::upcast_linear_normed",
    mutates_args=(),
    schema=f"(Tensor x, {_NORMED_ARGS}, Tensor weight, Tensor? bias, bool allow_triton=True) -> Tensor",
)
def upcast_linear_normed_op(x, h, rstd, norm_weight, offset, weight, bias, allow_triton=True):
    """``upcast_linear(x, weight, bias, allow_triton)`` where ``x`` is an RMSNorm's output, ``h`` its input and
    ``rstd`` the statistic its forward computed (peft's LoRA A of the projections a norm feeds: the
    ``rms_norm_linear`` pattern). The backward saves ``h`` and ``rstd`` (which the norm's own backward saves
    anyway) instead of ``x``, and the weight gradient reads ``x`` rebuilt from them (:func:`normed_reference`; on
    the Triton path inside the weight-gradient kernel, never written). Where the norm computed ``x`` from a value
    more precise than ``h`` (an unrounded residual sum, whose rounding ``h`` is), the rebuilt ``x`` is the norm of
    ``h``: what eager's graph computes there."""
    return _upcast_linear(x, weight, bias, allow_triton)


@upcast_linear_normed_op.register_fake
def _(x, h, rstd, norm_weight, offset, weight, bias, allow_triton=True):
    return _fake_out(x, weight)


def _normed_setup_context(ctx, inputs, output):
    x, h, rstd, norm_weight, offset, weight = inputs[:6]
    ctx.save_for_backward(h, rstd, norm_weight, weight)
    ctx.offset = offset
    _linear_context(ctx, inputs, 6, 7)


@torch.library.custom_op(
    "fuser::upcast_linear_normed_grads",
    mutates_args=(),
    schema=(
        f"(Tensor dy, {_NORMED_ARGS}, Tensor weight, bool need_x, bool need_w, bool allow_triton=True)"
        " -> (Tensor, Tensor)"
    ),
)
def upcast_linear_normed_grads(dy, h, rstd, norm_weight, offset, weight, need_x, need_w, allow_triton=True):
    """``upcast_linear_grads`` with x rebuilt from the norm's input ``h`` and ``rstd`` where dW needs it: in the
    weight-gradient kernel on the Triton path, else whole (a transient ``[tokens, in]`` tensor)."""
    fast = triton_path(h, weight, allow_triton)
    dx = _linear_dx(dy, h, weight, fast) if need_x else h.new_empty(0)
    dw = weight.new_empty(0)
    if need_w:
        if fast:
            dw = _dw_triton(dy, h, norm=(rstd, norm_weight, offset)).to(weight.dtype)
        else:
            x = normed_reference(h, rstd, norm_weight, offset)
            dw = _linear_dw(dy, x, weight, fast)
    return dx, dw


@upcast_linear_normed_grads.register_fake
def _(dy, h, rstd, norm_weight, offset, weight, need_x, need_w, allow_triton=True):
    dx = h.new_empty(h.shape) if need_x else h.new_empty(0)
    return dx, weight.new_empty(weight.shape) if need_w else weight.new_empty(0)


def _normed_backward(ctx, dy):
    h, rstd, norm_weight, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    dx = dw = None
    if need_x or need_w:
        dx, dw = torch.ops.fuser.upcast_linear_normed_grads(dy, h, rstd, norm_weight, ctx.offset, weight, need_x,
                                                            need_w, ctx.allow_triton)  # fmt: skip
    db = _bias_grad(dy) if need_b and ctx.has_bias else None
    return (dx if need_x else None), None, None, None, None, (dw if need_w else None), db, *[None] * (ctx.n_inputs - 7)


upcast_linear_normed_op.register_autograd(_normed_backward, setup_context=_normed_setup_context)


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, allow_triton: bool = True
) -> torch.Tensor:
    """``F.linear(x.to(weight.dtype), weight, bias)``, saving ``x`` (not its upcast copy) for the backward.
    ``allow_triton=False``: cuBLAS's fp32 matmuls where the Triton kernels would run (see the module docstring)."""
    return torch.ops.fuser.upcast_linear(x, weight, bias, allow_triton)
