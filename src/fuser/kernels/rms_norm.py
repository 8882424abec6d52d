"""RMSNorm as one fused op, forward and backward.

    rstd = 1 / sqrt(mean(x², last dim) + eps)          (fp32, one value per row, saved for backward)
    n    = x · rstd                                    (optionally rounded to ``norm_dtype``: Llama's explicit cast)
    y    = n · (weight + offset)                       (``offset=1`` is Gemma's ``1 + weight``)

Backward, with g = dy · (weight + offset):

    dx      = rstd · (g − n · mean(g · n))
    dweight = Σ_rows dy · n                           (per-program partial sums, reduced in a second step)

Forward saves x, the weight and rstd (4 bytes a row); backward reads x and dy once and writes dx. The backward
loads rstd rather than recomputing it: a second row reduction per tile costs more time than the bytes it saves
(``benchmarks/tune_rms_norm.py``; ``docs/notes/kernels.md``). The weight gradient is
reduced deterministically: each program owns a fixed set of rows and writes one fp32 partial row, and the
partials are summed by ``torch.sum`` afterwards (no atomics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fuser.kernels import _triton as tt
from fuser.kernels._triton import HAS_TRITON, tl, triton


@dataclass(frozen=True)
class Norm:
    """The norm's parameters, as its functions pass them around: ``weight`` (None: none), ``eps``, ``offset``
    (``1`` for Gemma's ``1 + weight``) and ``norm_dtype`` (the normalised value rounded to it before the weight
    multiply, as Llama's explicit cast; None: not rounded)."""

    weight: torch.Tensor | None
    eps: float
    offset: float = 0.0
    norm_dtype: torch.dtype | None = None


# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference: the same forward and backward formulas, used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _reference_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd per row, fp32 (fp64 for fp64 inputs), shape ``x.shape[:-1]``."""
    xc = x.to(tt.compute_dtype(x))
    return torch.rsqrt(xc.pow(2).mean(-1) + eps)


def _reference_forward(x: torch.Tensor, norm: Norm, out_dtype: torch.dtype) -> torch.Tensor:
    """Forward in fp32 (fp64 for fp64 inputs); the result in ``out_dtype``."""
    compute = tt.compute_dtype(x)
    xc = x.to(compute)
    # compute rstd
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + norm.eps)
    n = xc * rstd
    if norm.norm_dtype is not None:
        n = n.to(norm.norm_dtype).to(compute)
    y = n if norm.weight is None else n * (norm.weight.to(compute) + norm.offset)
    return y.to(out_dtype)


def _reference_backward(
    dy: torch.Tensor, x: torch.Tensor, norm: Norm, compute_dweight: bool, rstd: torch.Tensor | None, dx_dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hand-written backward (not autograd of the forward): (dx in ``dx_dtype``, default x's, and dweight or
    None). ``rstd`` (shape ``x.shape[:-1]``) is the forward's saved statistic; without it, it is recomputed."""
    weight = norm.weight
    compute = tt.compute_dtype(x)
    xc = x.to(compute)
    dyc = dy.to(compute)
    n_cols = x.shape[-1]
    if rstd is None:
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + norm.eps)
    else:
        rstd = rstd.to(compute).unsqueeze(-1)
    n = xc * rstd
    g = dyc if weight is None else dyc * (weight.to(compute) + norm.offset)
    dx = rstd * (g - n * ((g * n).sum(-1, keepdim=True) / n_cols))
    dweight = None
    if weight is not None and compute_dweight:
        n_w = n if norm.norm_dtype is None else n.to(norm.norm_dtype).to(compute)
        dweight = (dyc * n_w).reshape(-1, n_cols).sum(0).to(weight.dtype)
    return dx.to(dx_dtype or x.dtype), dweight


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

_NORM_CAST_CODE = {None: 0, torch.float32: 0, torch.float64: 0, torch.float16: 1, torch.bfloat16: 2}

if HAS_TRITON:

    @triton.jit
    def _round_to(v, NORM_CAST: tl.constexpr):
        # reproduce an explicit `.to(norm_dtype)` between the normalisation and the weight multiply
        if NORM_CAST == 1:
            v = v.to(tl.float16).to(tl.float32)
        elif NORM_CAST == 2:
            v = v.to(tl.bfloat16).to(tl.float32)
        return v

    @triton.jit
    def rms_norm_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        r_ptr,
        sum_ptr,
        x_row_stride,
        y_row_stride,
        r_row_stride,
        n_rows,
        n_cols,
        eps,
        offset,
        HAS_WEIGHT: tl.constexpr,
        NORM_CAST: tl.constexpr,
        STORE_RSTD: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_N]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # x + r in fp32, stored rounded (sum_ptr: contiguous, y's shape); the norm is of the fp32 sum
            x += tl.load(r_ptr + rows[:, None] * r_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(sum_ptr + rows[:, None] * n_cols + cols[None, :], x.to(sum_ptr.dtype.element_ty), mask=mask)
        # compute rstd
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BLOCK_M]
        if STORE_RSTD:
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        n = _round_to(x * rstd[:, None], NORM_CAST)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # [BLOCK_N]
            n = n * w[None, :]
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], n.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_rows(ptr, row_stride, rows, cols, mask):
        # a [BLOCK_M, BLOCK_N] tile of a row-major tensor, in fp32 (0 outside the mask)
        return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def rms_norm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        dx_ptr,
        dw_partial_ptr,
        rstd_ptr,
        dres_ptr,
        dx2_ptr,
        dy2_ptr,
        dy3_ptr,
        dy4_ptr,
        dy_row_stride,
        dy2_row_stride,
        dy3_row_stride,
        dy4_row_stride,
        x_row_stride,
        dx_row_stride,
        n_rows,
        n_cols,
        n_programs,
        tiles_per_program,
        eps,
        offset,
        HAS_WEIGHT: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
        NORM_CAST: tl.constexpr,
        LOAD_RSTD: tl.constexpr,
        HAS_DRES: tl.constexpr,
        STORE_DX2: tl.constexpr,
        N_DY: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset  # [BLOCK_N]
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # each program walks a fixed set of row tiles, so the partial sums do not depend on scheduling
        for i in range(0, tiles_per_program):
            rows = (pid + i * n_programs).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # the norm's output gradient as the sum of up to four terms (the projections it feeds), added in fp32
            if N_DY >= 2:
                dy += _load_rows(dy2_ptr, dy2_row_stride, rows, cols, mask)
            if N_DY >= 3:
                dy += _load_rows(dy3_ptr, dy3_row_stride, rows, cols, mask)
            if N_DY >= 4:
                dy += _load_rows(dy4_ptr, dy4_row_stride, rows, cols, mask)
            if LOAD_RSTD:
                rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)  # [BLOCK_M]
            else:  # recompute rstd: the row is in registers already
                rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BLOCK_M]
            n = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            dx = rstd[:, None] * (g - n * (tl.sum(g * n, axis=1) / n_cols)[:, None])
            if HAS_DRES:  # add_rms_norm: the sum's own gradient (contiguous, x's shape) joins the norm's
                dx += tl.load(dres_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if STORE_DX2:  # the same gradient in a second dtype (contiguous): the residual stream's and the sum's
                tl.store(dx2_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx2_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * _round_to(n, NORM_CAST), axis=0)
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=col_mask)


_MAX_BLOCK_N = 65536


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """Forward: (rows per program, BLOCK_N, warps), near the best of ``benchmarks/tune_rms_norm.py``'s sweep."""
    block_n = tt.next_power_of_2(n_cols)
    block_m = max(1, min(64, 4096 // block_n))
    num_warps = 16 if block_n >= 8192 else 8 if block_n >= 2048 else 4
    return block_m, block_n, num_warps


def _backward_launch_config(n_cols: int) -> tuple[int, int, int, int]:
    """Backward: (rows per tile, BLOCK_N, warps, programs per SM), from ``benchmarks/tune_rms_norm.py``'s sweep.

    Larger tiles and fewer resident programs won over one row per tile (``docs/notes/kernels.md``).
    """
    block_n = tt.next_power_of_2(n_cols)
    block_m = max(1, min(64, (8192 if block_n <= 2048 else 16384) // block_n))
    num_warps = max(4, min(16, block_n // 512))
    programs_per_sm = 2 if block_n <= 2048 else 1
    return block_m, block_n, num_warps, programs_per_sm


def _triton_runs(x: torch.Tensor) -> bool:
    # a row must fit one block
    return tt.triton_runs(x) and x.shape[-1] <= _MAX_BLOCK_N


def _launch_forward(x, norm: Norm, out, rstd, residual, sum_out, order=None) -> None:
    """The forward kernel into ``out`` (and ``rstd``, ``sum_out`` where given), x and residual read as row views;
    ``order``: every tensor's rows taken in that order of its dims (:func:`fuser.kernels._triton.row_order`), the
    outputs laid out in it."""
    n_cols = x.shape[-1]
    x2 = tt.as_rows(x, order)
    r2 = tt.as_rows(residual, order) if residual is not None else None
    weight = norm.weight.contiguous() if norm.weight is not None else None
    y2 = tt.out_rows(out, order)
    if rstd is not None and order is not None:
        rstd = rstd.permute(order[:-1]).view(-1)  # stored in that order (raises if not: never written elsewhere)
    if sum_out is not None and order is not None:
        sum_out = tt.out_rows(sum_out, order)
    n_rows = x2.shape[0]
    block_m, block_n, num_warps = _launch_config(n_cols)
    if n_rows > 0:
        tt.launchable(rms_norm_fwd_kernel)[(tt.cdiv(n_rows, block_m),)](
            x2,
            weight if weight is not None else x2,
            y2,
            rstd if rstd is not None else y2,
            r2 if r2 is not None else x2,
            sum_out if sum_out is not None else y2,
            x2.stride(0),
            y2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            n_rows,
            n_cols,
            norm.eps,
            norm.offset,
            HAS_WEIGHT=weight is not None,
            NORM_CAST=_NORM_CAST_CODE[norm.norm_dtype],
            STORE_RSTD=rstd is not None,
            HAS_RESIDUAL=r2 is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )


def _launch_backward(
    dy, x, norm: Norm, compute_dweight, rstd, dres, dx, dx2_out, dy_more=(), order=None
) -> torch.Tensor | None:
    """The backward kernel into ``dx`` (and ``dx2_out`` where given); returns dweight (None where not computed).
    ``dy_more``: up to three more terms of the output gradient (dy's shape), summed with dy in fp32. ``order``: the
    rows in that order of the dims, as :func:`_launch_forward` (not with ``dres``/``dx2_out``); ``dx`` laid out in
    it, the inputs read as views where they are too, else copied in that order."""
    if order is not None and (dres is not None or dx2_out is not None):
        raise ValueError("fuser: rms_norm's backward takes a row order only without dres and dx2_out")
    n_cols = x.shape[-1]
    x2 = tt.as_rows(x, order)
    weight = norm.weight.contiguous() if norm.weight is not None else None
    dy2 = tt.as_rows(dy, order)
    more = [tt.as_rows(t, order) for t in dy_more]
    more_or_dy = [*more, dy2, dy2, dy2][:3]
    dx2 = tt.out_rows(dx, order)
    n_rows = x2.shape[0]
    block_m, block_n, num_warps, programs_per_sm = _backward_launch_config(n_cols)
    n_programs = max(1, min(tt.num_programs_for(x, programs_per_sm), tt.cdiv(n_rows, block_m)))
    if rstd is not None:
        rstd = (rstd.permute(order[:-1]) if order is not None else rstd).reshape(-1).contiguous()
    compute_dw = weight is not None and compute_dweight
    dw_partial = torch.empty((n_programs, n_cols) if compute_dw else (1,), dtype=torch.float32, device=x.device)
    if n_rows > 0:
        tt.launchable(rms_norm_bwd_kernel)[(n_programs,)](
            dy2,
            x2,
            weight if weight is not None else x2,
            dx2,
            dw_partial,
            rstd if rstd is not None else dw_partial,
            dres.contiguous() if dres is not None else dx2,
            dx2_out if dx2_out is not None else dx2,
            *more_or_dy,
            dy2.stride(0),
            *(t.stride(0) for t in more_or_dy),
            x2.stride(0),
            dx2.stride(0),
            n_rows,
            n_cols,
            n_programs,
            tt.cdiv(tt.cdiv(n_rows, block_m), n_programs),
            norm.eps,
            norm.offset,
            HAS_WEIGHT=weight is not None,
            COMPUTE_DW=compute_dw,
            NORM_CAST=_NORM_CAST_CODE[norm.norm_dtype],
            LOAD_RSTD=rstd is not None,
            HAS_DRES=dres is not None,
            STORE_DX2=dx2_out is not None,
            N_DY=1 + len(more),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    elif compute_dw:
        dw_partial.zero_()
    return dw_partial.sum(0).to(weight.dtype) if compute_dw else None


# ---------------------------------------------------------------------------------------------------------
# One entry per direction: the Triton kernel or the plain-torch reference (used on CPU, and the test oracle)
# ---------------------------------------------------------------------------------------------------------


def rms_norm_forward(
    x: torch.Tensor,
    norm: Norm,
    out_dtype: torch.dtype | None = None,
    *,
    residual: torch.Tensor | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
    order: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The norm of ``x`` (with ``residual``, x's shape: of ``x + residual`` summed in fp32) in ``out_dtype``
    (default x's), computed in fp32 (fp64 for fp64 inputs on the reference path). ``rstd`` (contiguous fp32,
    ``x.shape[:-1]``), when given, receives each row's rstd, and ``sum_out`` (contiguous, x's shape) the sum;
    ``out`` (contiguous, x's shape) receives the result (tests pre-fill it with NaN). ``impl``: ``"triton"``,
    ``"reference"``, or ``"auto"`` (the kernel where Triton runs and a row fits one block). ``order``: x's row order
    (:func:`fuser.kernels._triton.row_order`), in which ``out``, ``rstd`` and ``sum_out`` are then laid out."""
    out_dtype = out_dtype or x.dtype
    if tt.takes_triton(impl, impl == "auto" and _triton_runs(x)):
        out = out if out is not None else tt.empty_in_order(x.shape, order, out_dtype, x.device)
        _launch_forward(x, norm, out, rstd, residual, sum_out, order)
        return out
    wide = x if residual is None else x.to(torch.float32) + residual.to(torch.float32)
    y = _reference_forward(wide, norm, out_dtype)
    if rstd is not None:
        rstd.copy_(_reference_rstd(wide, norm.eps))
    if sum_out is not None:
        sum_out.copy_(wide)
    return out.copy_(y) if out is not None else y.contiguous()


def _check_dy_more(dy: torch.Tensor, dy_more: Sequence[torch.Tensor]) -> None:
    if len(dy_more) > 3 or any(t.shape != dy.shape or t.dtype != dy.dtype for t in dy_more):
        got = [(t.dtype, tuple(t.shape)) for t in dy_more]
        raise ValueError(
            f"fuser: rms_norm's backward takes at most three more output-gradient terms of dy's dtype {dy.dtype} and "
            f"shape {tuple(dy.shape)}, got {got}"
        )


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    norm: Norm,
    compute_dweight: bool = True,
    dx_dtype: torch.dtype | None = None,
    *,
    rstd: torch.Tensor | None = None,
    dres: torch.Tensor | None = None,
    impl: str = "auto",
    dx_out: torch.Tensor | None = None,
    dx2_out: torch.Tensor | None = None,
    dy_more: Sequence[torch.Tensor] = (),
    order: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in ``dx_dtype``, default x's; dweight or None). ``rstd`` is the forward's (recomputed when ``None``);
    ``dres`` (x's shape): a gradient added to dx in fp32 (add_rms_norm's sum's); ``dx2_out`` (contiguous, x's
    shape) receives dx a second time, in its own dtype; ``dx_out`` (x's shape) receives dx (tests pre-fill it with
    NaN); ``dy_more``: up to three more terms of the output gradient, dy's shape and dtype, summed with dy in fp32
    (the input gradients of the projections the norm feeds). ``impl`` as for :func:`rms_norm_forward`."""
    _check_dy_more(dy, dy_more)
    if tt.takes_triton(impl, impl == "auto" and _triton_runs(x)):
        if dx_out is None:
            dx_out = tt.empty_in_order(x.shape, order, dx_dtype or x.dtype, x.device)
        return dx_out, _launch_backward(dy, x, norm, compute_dweight, rstd, dres, dx_out, dx2_out, dy_more, order)
    if dy_more:
        total = dy.to(torch.float64 if dy.dtype == torch.float64 else torch.float32)
        for term in dy_more:
            total = total + term.to(total.dtype)
        dy = total
    # add_rms_norm's gradient: the sum's own joins the norm's in fp32, and the one value is stored in two dtypes
    summed = dres is not None or dx2_out is not None
    dx, dweight = _reference_backward(dy, x, norm, compute_dweight, rstd, torch.float32 if summed else dx_dtype)
    if dres is not None:
        dx = dx + dres.to(torch.float32)
    if dx2_out is not None:
        dx2_out.copy_(dx)
    dx = dx.to(dx_dtype or x.dtype)
    return (dx_out.copy_(dx) if dx_out is not None else dx.contiguous()), dweight


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd
# ---------------------------------------------------------------------------------------------------------


# The norm's arguments (a Norm's fields), and the backward's (with the forward's rstd and whether dweight is
# wanted), as every op of this module takes them: the plain ops' schemas and the add variants' (which add the
# residual, or the sum's gradient) are written from these pieces.
_NORM_SCHEMA = "Tensor? weight, float eps, float offset, ScalarType? norm_dtype"
_NORM_BACKWARD_SCHEMA = (
    "Tensor? weight, Tensor rstd, float eps, float offset, ScalarType? norm_dtype, bool compute_dweight"
)


@torch.library.custom_op(
    "fuser::rms_norm",
    mutates_args=(),
    schema=f"(Tensor x, {_NORM_SCHEMA}, ScalarType? out_dtype, Tensor? x_wide=None) -> (Tensor, Tensor)",
)
def rms_norm_op(x, weight, eps, offset, norm_dtype, out_dtype, x_wide=None):
    """Returns (y, rstd); rstd (fp32, ``x.shape[:-1]``) is what backward needs besides x and the weight.

    ``x_wide`` (fp32, x's shape): the value ``x`` is the rounding of (a LoRA or residual sum before its cast to x's
    dtype). The norm and rstd are computed from it, as Inductor computes a norm fused with the sum's cast; ``x`` is
    saved, and the gradient (fp32) goes to ``x_wide`` when it requires one, else to ``x``. The result defaults to
    x's dtype."""
    tt.check_floating("rms_norm", x=x, weight=weight)
    if x_wide is not None:
        _check_wide(x, x_wide)
        out_dtype = out_dtype or x.dtype
        x = x_wide
    order = tt.row_order(x)
    out, rstd = _forward_buffers(x, out_dtype or x.dtype, order)
    norm = Norm(weight, eps, offset, norm_dtype)
    return rms_norm_forward(x, norm, out_dtype, out=out, rstd=rstd, order=order), rstd


def _forward_buffers(
    x: torch.Tensor, out_dtype: torch.dtype, order: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the result, rstd), laid out in ``order``, x's row order (a per-head q/k view keeps its layout, as eager's
    elementwise norm keeps it); the op and its fake kernel make the same."""
    return (
        tt.empty_in_order(x.shape, order, out_dtype, x.device),
        tt.empty_in_order(x.shape[:-1], order, torch.float32, x.device),
    )


def _check_wide(x: torch.Tensor, x_wide: torch.Tensor) -> None:
    if x_wide.dtype != torch.float32 or x_wide.shape != x.shape:
        raise ValueError(
            f"fuser: rms_norm expects x_wide in fp32 of x's shape {tuple(x.shape)}, "
            f"got {x_wide.dtype} {tuple(x_wide.shape)}"
        )


@rms_norm_op.register_fake
def _(x, weight, eps, offset, norm_dtype, out_dtype, x_wide=None):
    if x_wide is not None:
        _check_wide(x, x_wide)
    normed = x if x_wide is None else x_wide
    return _forward_buffers(normed, out_dtype or x.dtype, tt.row_order(normed))


@torch.library.custom_op(
    "fuser::rms_norm_backward",
    mutates_args=(),
    schema=(
        f"(Tensor dy, Tensor x, {_NORM_BACKWARD_SCHEMA}, ScalarType? dx_dtype=None, Tensor? dy2=None, "
        "Tensor? dy3=None, Tensor? dy4=None) -> (Tensor, Tensor)"
    ),
)
def rms_norm_backward_op(dy, x, weight, rstd, eps, offset, norm_dtype, compute_dweight, dx_dtype=None, dy2=None,
                         dy3=None, dy4=None):  # fmt: skip
    """(dx in ``dx_dtype``, default x's; dweight, or an empty tensor). ``dy2``, ``dy3``, ``dy4``: more terms of the
    output gradient (``experimental.rms_norm.gradient_sums``: the projections' input gradients), summed with dy in
    fp32."""
    norm = Norm(weight, eps, offset, norm_dtype)
    order = tt.row_order(x)
    dx = tt.empty_in_order(x.shape, order, dx_dtype or x.dtype, x.device)
    _, dw = rms_norm_backward(
        dy, x, norm, compute_dweight, dx_dtype, rstd=rstd, dx_out=dx, dy_more=_more(dy2, dy3, dy4), order=order
    )
    return dx, tt.or_empty(dw, x)


def _more(*terms: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The terms given, in order; a term after one left out is refused (dy3 needs dy2, dy4 dy3)."""
    given = [t is not None for t in terms]
    if given != sorted(given, reverse=True):
        raise ValueError(
            "fuser: rms_norm's backward takes its output-gradient terms in order: dy3 only with dy2, dy4 only with dy3"
        )
    return tuple(t for t in terms if t is not None)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset, norm_dtype, compute_dweight, dx_dtype=None, dy2=None, dy3=None, dy4=None):
    _check_dy_more(dy, _more(dy2, dy3, dy4))
    has_dw = weight is not None and compute_dweight
    dx = tt.empty_in_order(x.shape, tt.row_order(x), dx_dtype or x.dtype, x.device)
    return dx, (weight.new_empty(weight.shape) if has_dw else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, norm_dtype = inputs[:5]  # (out_dtype, x_wide): not needed, x_wide not saved
    ctx.n_inputs = len(inputs)
    ctx.has_wide = len(inputs) > 6 and inputs[6] is not None
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset, ctx.norm_dtype = eps, offset, norm_dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _drstd):
    # rstd is a statistic handed to backward, not a differentiable output: its gradient is ignored
    x, weight, rstd = ctx.saved_tensors
    compute_dweight = weight is not None and ctx.needs_input_grad[1]
    # with x_wide the gradient goes to it, in fp32 (x is its rounding: the cast's backward passes the gradient
    # through, so either input may take it; the fp32 one keeps it unrounded for a LoRA adapter's gradients, as
    # Inductor computes the norm's backward fused with the cast's)
    to_wide = ctx.has_wide and ctx.needs_input_grad[6]
    need_dx = ctx.needs_input_grad[0] or to_wide
    rest = [None] * (ctx.n_inputs - 2)  # eps, offset, the dtypes, and x_wide unless it takes the gradient
    if dy is None or not (need_dx or compute_dweight):
        return None, None, *rest
    dx, dw = torch.ops.fuser.rms_norm_backward(
        dy, x, weight, rstd, ctx.eps, ctx.offset, ctx.norm_dtype, compute_dweight, torch.float32 if to_wide else None
    )
    if to_wide:
        rest[4] = dx
    return (dx if ctx.needs_input_grad[0] and not to_wide else None), (dw if compute_dweight else None), *rest


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(
    "fuser::add_rms_norm",
    mutates_args=(),
    schema=f"(Tensor x, Tensor residual, {_NORM_SCHEMA}, ScalarType? out_dtype) -> (Tensor, Tensor, Tensor)",
)
def add_rms_norm_op(x, residual, weight, eps, offset, norm_dtype, out_dtype):
    """A residual add and the RMSNorm of its result: ``h = x + residual`` in fp32, returns (y, rstd, h rounded to
    x's dtype). y is the norm of the unrounded h, as Inductor computes a norm fused with the add and its cast; the
    rounded h is the residual stream's next value, and what backward reads. ``residual``: x's shape, in x's dtype (a
    decoder layer's ``h + attn_out`` under full fine-tuning), fp32 (a LoRA sum kept in fp32) or narrower
    than x (under autocast with fp32 weights, a bf16 projection added into the fp32 stream: h is then fp32, eager's
    sum exactly).

    Numerics, against eager's add then norm in x's dtype: the sum is rounded once either way (h is eager's value
    bit for bit); the norm reads the sum before that rounding (eager reads it after, as Inductor does not when it
    fuses the two); the backward adds h's own gradient to the norm's input gradient in fp32 and rounds once (eager
    rounds both, then adds and rounds again). No rounding eager does not do, and one fewer in each of the last
    two: as close to the fp32 values as eager's, or closer. In fp32 both compute the same formulas."""
    tt.check_floating("add_rms_norm", x=x, residual=residual, weight=weight)
    _check_residual(x, residual)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    norm = Norm(weight, eps, offset, norm_dtype)
    y = rms_norm_forward(x, norm, out_dtype, residual=residual, rstd=rstd, sum_out=h)
    return y, rstd, h


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    # the sum is stored in x's dtype: a residual in x's dtype, in fp32 (a LoRA sum kept wide, rounded into a half x),
    # or narrower than x (autocast's half-precision branch added into an fp32 residual stream: eager's sum is fp32)
    allowed = residual.dtype in (x.dtype, torch.float32) or residual.itemsize < x.itemsize
    if residual.shape != x.shape or not allowed:
        raise ValueError(
            f"fuser: add_rms_norm expects a residual of x's shape {tuple(x.shape)}, in x's dtype {x.dtype}, fp32 or "
            f"a narrower float dtype, got {residual.dtype} {tuple(residual.shape)}"
        )


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, norm_dtype, out_dtype):
    _check_residual(x, residual)
    return (
        x.new_empty(x.shape, dtype=out_dtype or x.dtype),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
        x.new_empty(x.shape),
    )


@torch.library.custom_op(
    "fuser::add_rms_norm_backward",
    mutates_args=(),
    schema=(
        f"(Tensor dy, Tensor? dh, Tensor h, {_NORM_BACKWARD_SCHEMA}, ScalarType residual_dtype, Tensor? dy2=None, "
        "Tensor? dy3=None, Tensor? dy4=None) -> (Tensor, Tensor, Tensor)"
    ),
)
def add_rms_norm_backward_op(dy, dh, h, weight, rstd, eps, offset, norm_dtype, compute_dweight, residual_dtype,
                             dy2=None, dy3=None, dy4=None):  # fmt: skip
    """(dx in h's dtype, dresidual in ``residual_dtype``, dweight or an empty tensor): the norm's input gradient
    plus ``dh`` (the rounded sum's own gradient, from the residual stream), added in fp32 and rounded once, one
    value in two dtypes. Where ``residual_dtype`` is h's (a residual add of two tensors of one dtype: full
    fine-tuning) dresidual would be dx again: it is an empty (0-element) tensor, not written, and dx is the
    gradient of both inputs."""
    norm = Norm(weight, eps, offset, norm_dtype)
    dres = _residual_gradient(h, residual_dtype)
    dx, dw = rms_norm_backward(
        dy,
        h,
        norm,
        compute_dweight,
        h.dtype,
        rstd=rstd,
        dres=dh,
        dx2_out=dres if dres.numel() else None,
        dy_more=_more(dy2, dy3, dy4),
    )
    return dx, dres, tt.or_empty(dw, h)


def _residual_gradient(h: torch.Tensor, residual_dtype: torch.dtype) -> torch.Tensor:
    """add_rms_norm_backward's dresidual buffer: h's shape in ``residual_dtype``, or 0 elements where that is h's
    dtype (dx is then the residual's gradient too)."""
    shape = (0,) if residual_dtype == h.dtype else h.shape
    return h.new_empty(shape, dtype=residual_dtype)


@add_rms_norm_backward_op.register_fake
def _(dy, dh, h, weight, rstd, eps, offset, norm_dtype, compute_dweight, residual_dtype, dy2=None, dy3=None,
      dy4=None):  # fmt: skip
    _check_dy_more(dy, _more(dy2, dy3, dy4))
    has_dw = weight is not None and compute_dweight
    dw = weight.new_empty(weight.shape) if has_dw else h.new_empty(0)
    return h.new_empty(h.shape), _residual_gradient(h, residual_dtype), dw


def _add_setup_context(ctx, inputs, output):
    x, residual, weight, eps, offset, norm_dtype, _ = inputs
    ctx.save_for_backward(output[2], weight, output[1])
    ctx.eps, ctx.offset, ctx.norm_dtype, ctx.residual_dtype = eps, offset, norm_dtype, residual.dtype
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _add_backward(ctx, dy, _drstd, dh):
    h, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_w = ctx.needs_input_grad[:3]
    compute_dweight = weight is not None and need_w
    rest = (None,) * 4
    if not (need_x or need_r or compute_dweight) or (dy is None and dh is None):
        return None, None, None, *rest
    if dy is None:  # only the sum is used downstream: its gradient passes to both inputs
        return (dh if need_x else None), (dh.to(ctx.residual_dtype) if need_r else None), None, *rest
    dx, dres, dw = torch.ops.fuser.add_rms_norm_backward(
        dy, dh, h, weight, rstd, ctx.eps, ctx.offset, ctx.norm_dtype, compute_dweight, ctx.residual_dtype
    )
    if ctx.residual_dtype == h.dtype:  # one gradient for both inputs: the op wrote it once (dres is empty)
        dres = dx
    return (dx if need_x else None), (dres if need_r else None), (dw if compute_dweight else None), *rest


add_rms_norm_op.register_autograd(_add_backward, setup_context=_add_setup_context)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    *,
    norm_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused RMSNorm over the last dimension, with autograd.

    ``offset=1.0`` gives Gemma's ``1 + weight``; ``norm_dtype`` rounds the normalised value before the weight
    multiply (Llama casts to the input dtype there); the result has ``out_dtype`` (default: ``x.dtype``).
    Statistics are computed in fp32 whatever the input dtype. x and the weight must be floating point
    (:class:`~fuser.kernels._triton.DtypeError` otherwise, as ``F.rms_norm`` raises for an integer x).
    """
    tt.check_floating("rms_norm", x=x, weight=weight)
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise ValueError(
            f"fuser: rms_norm expects a 1-D weight of size {x.shape[-1]} (x's last dim), got {tuple(weight.shape)}"
        )
    return torch.ops.fuser.rms_norm(x, weight, float(eps), float(offset), norm_dtype, out_dtype)[0]
