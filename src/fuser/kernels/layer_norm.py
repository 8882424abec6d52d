"""LayerNorm as one fused op, forward and backward.

    mean = mean(x, last dim)                            (fp32, one value per row, saved for backward)
    rstd = 1 / sqrt(mean((x − mean)²) + eps)            (fp32, one value per row, saved for backward)
    n    = (x − mean) · rstd
    y    = n · weight + bias                           (each optional: ``elementwise_affine=False`` has neither)

Backward, with g = dy · weight (dy without a weight):

    dx      = rstd · (g − mean(g) − n · mean(g · n))
    dweight = Σ_rows dy · n                             dbias = Σ_rows dy

Forward saves x, the weight, mean and rstd (8 bytes a row), never the normalised value; backward reads x and dy
once and writes dx. The weight and bias gradients are reduced deterministically: each program owns a fixed set of
rows and writes one fp32 partial row of each, and the partials are summed by ``torch.sum`` afterwards (no atomics).
The variance is the biased one (divided by the hidden size), as ``F.layer_norm`` and ``var(unbiased=False)``.
The statistics and the affine map are computed in fp32 whatever the dtypes; the result is rounded once, to
``out_dtype`` (fp32 under autocast, where eager's ``F.layer_norm`` runs in fp32).
"""

from __future__ import annotations

import torch

from fuser.kernels import _triton as tt
from fuser.kernels._triton import HAS_TRITON, tl, triton

# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference: the same forward and backward formulas, used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _reference_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) per row in the compute dtype (fp32, fp64 for fp64 inputs), shape ``x.shape[:-1]``."""
    xc = x.to(tt.compute_dtype(x))
    mean = xc.mean(-1)
    # compute rstd from the centred values (the two-pass variance: no cancellation for rows far from zero)
    var = (xc - mean.unsqueeze(-1)).pow(2).mean(-1)
    return mean, torch.rsqrt(var + eps)


def _reference_forward(x, weight, bias, eps, out_dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in ``out_dtype``, mean, rstd); computed in fp32 (fp64 for fp64 inputs)."""
    compute = tt.compute_dtype(x)
    mean, rstd = _reference_stats(x, eps)
    y = (x.to(compute) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(out_dtype), mean, rstd


def _reference_backward(dy, x, weight, mean, rstd, compute_dweight, compute_dbias, dx_dtype):
    """The hand-written backward (not autograd of the forward): (dx, dweight or None, dbias or None), the weight
    and bias gradients in fp32 (fp64 for fp64 inputs)."""
    compute = tt.compute_dtype(x)
    n_cols = x.shape[-1]
    dyc = dy.to(compute)
    n = (x.to(compute) - mean.to(compute).unsqueeze(-1)) * rstd.to(compute).unsqueeze(-1)
    g = dyc if weight is None else dyc * weight.to(compute)
    dx = rstd.to(compute).unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - n * ((g * n).sum(-1, keepdim=True) / n_cols))
    dweight = (dyc * n).reshape(-1, n_cols).sum(0) if compute_dweight else None
    dbias = dyc.reshape(-1, n_cols).sum(0) if compute_dbias else None
    return dx.to(dx_dtype), dweight, dbias


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def layer_norm_fwd_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        mean_ptr,
        rstd_ptr,
        x_row_stride,
        y_row_stride,
        n_rows,
        n_cols,
        eps,
        HAS_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        eps = tl.cast(eps, tl.float32)  # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_N]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # compute mean, then the variance of the centred row (zero outside the row)
        mean = tl.sum(x, axis=1) / n_cols  # [BLOCK_M]
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)  # [BLOCK_M]
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = xc * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def layer_norm_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        mean_ptr,
        rstd_ptr,
        dx_ptr,
        dw_partial_ptr,
        db_partial_ptr,
        dy_row_stride,
        x_row_stride,
        dx_row_stride,
        n_rows,
        n_cols,
        n_programs,
        tiles_per_program,
        HAS_WEIGHT: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
        COMPUTE_DB: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # each program walks a fixed set of row tiles, so the partial sums do not depend on scheduling
        for i in range(0, tiles_per_program):
            rows = (pid + i * n_programs).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)  # [BLOCK_M]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)  # [BLOCK_M]
            n = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            # dx = rstd · (g − mean(g) − n · mean(g · n))
            c1 = tl.sum(g * n, axis=1) / n_cols  # [BLOCK_M]
            c2 = tl.sum(g, axis=1) / n_cols  # [BLOCK_M]
            dx = rstd[:, None] * (g - c2[:, None] - n * c1[:, None])
            tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * n, axis=0)
            if COMPUTE_DB:
                db_acc += tl.sum(dy, axis=0)
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_partial_ptr + pid * n_cols + cols, db_acc, mask=col_mask)


_MAX_BLOCK_N = 65536


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """Forward: (rows per program, BLOCK_N, warps): RMSNorm's forward configuration (the same row-wise shape of
    work, one more reduction)."""
    block_n = tt.next_power_of_2(n_cols)
    block_m = max(1, min(64, 4096 // block_n))
    num_warps = 16 if block_n >= 8192 else 8 if block_n >= 2048 else 4
    return block_m, block_n, num_warps


def _backward_launch_config(n_cols: int) -> tuple[int, int, int, int]:
    """Backward: (rows per tile, BLOCK_N, warps, programs per SM): RMSNorm's backward configuration."""
    block_n = tt.next_power_of_2(n_cols)
    block_m = max(1, min(64, (8192 if block_n <= 2048 else 16384) // block_n))
    num_warps = max(4, min(16, block_n // 512))
    programs_per_sm = 2 if block_n <= 2048 else 1
    return block_m, block_n, num_warps, programs_per_sm


def _triton_runs(x: torch.Tensor, *others: torch.Tensor | None, out_dtypes=()) -> bool:
    # a row must fit one block
    return tt.triton_runs(x, *others, out_dtypes=out_dtypes) and x.shape[-1] <= _MAX_BLOCK_N


def _launch_forward(x, weight, bias, eps, y, mean, rstd) -> None:
    """The forward kernel into ``y``, ``mean`` and ``rstd`` (contiguous), x read as a row view."""
    n_cols = x.shape[-1]
    x2, y2 = tt.as_rows(x), tt.out_rows(y)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return
    block_m, block_n, num_warps = _launch_config(n_cols)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    tt.launchable(layer_norm_fwd_kernel)[(tt.cdiv(n_rows, block_m),)](
        x2,
        weight if weight is not None else x2,
        bias if bias is not None else x2,
        y2,
        mean,
        rstd,
        x2.stride(0),
        y2.stride(0),
        n_rows,
        n_cols,
        eps,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )


def _launch_backward(dy, x, weight, mean, rstd, dx, compute_dweight, compute_dbias):
    """The backward kernel into ``dx``; returns (dweight, dbias) in fp32, None where not computed."""
    n_cols = x.shape[-1]
    x2, dy2, dx2 = tt.as_rows(x), tt.as_rows(dy), tt.out_rows(dx)
    n_rows = x2.shape[0]
    block_m, block_n, num_warps, programs_per_sm = _backward_launch_config(n_cols)
    n_programs = max(1, min(tt.num_programs_for(x, programs_per_sm), tt.cdiv(n_rows, block_m)))
    weight = weight.contiguous() if weight is not None else None
    compute_dw = weight is not None and compute_dweight
    shape = (n_programs, n_cols)
    dw_partial = torch.empty(shape if compute_dw else (1,), dtype=torch.float32, device=x.device)
    db_partial = torch.empty(shape if compute_dbias else (1,), dtype=torch.float32, device=x.device)
    if n_rows > 0:
        tt.launchable(layer_norm_bwd_kernel)[(n_programs,)](
            dy2,
            x2,
            weight if weight is not None else x2,
            mean.reshape(-1),
            rstd.reshape(-1),
            dx2,
            dw_partial,
            db_partial,
            dy2.stride(0),
            x2.stride(0),
            dx2.stride(0),
            n_rows,
            n_cols,
            n_programs,
            tt.cdiv(tt.cdiv(n_rows, block_m), n_programs),
            HAS_WEIGHT=weight is not None,
            COMPUTE_DW=compute_dw,
            COMPUTE_DB=compute_dbias,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    else:
        dw_partial.zero_()
        db_partial.zero_()
    return (dw_partial.sum(0) if compute_dw else None), (db_partial.sum(0) if compute_dbias else None)


# ---------------------------------------------------------------------------------------------------------
# One entry per direction: the Triton kernel or the plain-torch reference (used on CPU, and the test oracle)
# ---------------------------------------------------------------------------------------------------------


def layer_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
    *,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in ``out_dtype`` (default x's), mean, rstd): the statistics in fp32 (fp64 for fp64 inputs on the
    reference path), shape ``x.shape[:-1]``. ``out`` (contiguous, x's shape) receives y (tests pre-fill it with
    NaN). ``impl``: ``"triton"``, ``"reference"``, or ``"auto"`` (the kernel where Triton runs and a row fits one
    block)."""
    out_dtype = out_dtype or x.dtype
    if tt.takes_triton(impl, impl == "auto" and _triton_runs(x, weight, bias, out_dtypes=(out_dtype,))):
        y = out if out is not None else torch.empty(x.shape, dtype=out_dtype, device=x.device)
        mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        _launch_forward(x, weight, bias, eps, y, mean, rstd)
        return y, mean, rstd
    y, mean, rstd = _reference_forward(x, weight, bias, eps, out_dtype)
    return (out.copy_(y) if out is not None else y.contiguous()), mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    compute_dweight: bool = True,
    compute_dbias: bool = True,
    dx_dtype: torch.dtype | None = None,
    *,
    impl: str = "auto",
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx in ``dx_dtype`` (default x's), dweight, dbias): the last two in fp32 (fp64 on the fp64 reference), None
    where not asked for (dweight also without a weight). ``mean`` and ``rstd`` are the forward's. ``dx_out`` (x's
    shape, contiguous) receives dx (tests pre-fill it with NaN). ``impl`` as for :func:`layer_norm_forward`."""
    dx_dtype = dx_dtype or x.dtype
    compute_dweight = compute_dweight and weight is not None
    if tt.takes_triton(impl, impl == "auto" and _triton_runs(x, dy, weight, out_dtypes=(dx_dtype,))):
        dx = dx_out if dx_out is not None else torch.empty(x.shape, dtype=dx_dtype, device=x.device)
        dw, db = _launch_backward(dy, x, weight, mean, rstd, dx, compute_dweight, compute_dbias)
        return dx, dw, db
    dx, dw, db = _reference_backward(dy, x, weight, mean, rstd, compute_dweight, compute_dbias, dx_dtype)
    return (dx_out.copy_(dx) if dx_out is not None else dx.contiguous()), dw, db


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd
# ---------------------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    tt.check_floating("layer_norm", x=x, weight=weight, bias=bias)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != x.shape[-1]):
            raise ValueError(
                f"fuser: layer_norm expects a 1-D {name} of size {x.shape[-1]} (x's last dim), got {tuple(t.shape)}"
            )


@torch.library.custom_op(
    "fuser::layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) -> (Tensor, Tensor, Tensor)",
)
def layer_norm_op(x, weight, bias, eps, out_dtype):
    """Returns (y, mean, rstd); mean and rstd (fp32, ``x.shape[:-1]``) are what backward needs besides x and the
    weight. The result has ``out_dtype`` (default x's)."""
    _check(x, weight, bias)
    return layer_norm_forward(x, weight, bias, eps, out_dtype)


@layer_norm_op.register_fake
def _(x, weight, bias, eps, out_dtype):
    _check(x, weight, bias)
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), stats, stats.new_empty(stats.shape)


@torch.library.custom_op(
    "fuser::layer_norm_backward",
    mutates_args=(),
    schema=(
        "(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, bool compute_dweight, bool compute_dbias, "
        "ScalarType? bias_dtype) -> (Tensor, Tensor, Tensor)"
    ),
)
def layer_norm_backward_op(dy, x, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype):
    """(dx in x's dtype, dweight in the weight's dtype, dbias in ``bias_dtype``); one not computed is an empty
    tensor."""
    dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, compute_dweight, compute_dbias)
    dw = dw.to(weight.dtype) if dw is not None else None
    db = db.to(bias_dtype or x.dtype) if db is not None else None
    return dx, tt.or_empty(dw, x), tt.or_empty(db, x)


@layer_norm_backward_op.register_fake
def _(dy, x, weight, mean, rstd, compute_dweight, compute_dbias, bias_dtype):
    has_dw = weight is not None and compute_dweight
    dw = weight.new_empty(weight.shape) if has_dw else x.new_empty(0)
    db = x.new_empty(x.shape[-1:], dtype=bias_dtype or x.dtype) if compute_dbias else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dmean, _drstd):
    # mean and rstd are statistics handed to backward, not differentiable outputs: their gradients are ignored
    x, weight, mean, rstd = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    compute_dweight = weight is not None and need_w
    compute_dbias = ctx.bias_dtype is not None and need_b
    if dy is None or not (need_x or compute_dweight or compute_dbias):
        return None, None, None, None, None
    dx, dw, db = torch.ops.fuser.layer_norm_backward(
        dy, x, weight, mean, rstd, compute_dweight, compute_dbias, ctx.bias_dtype
    )
    return (dx if need_x else None), (dw if compute_dweight else None), (db if compute_dbias else None), None, None


layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused LayerNorm over the last dimension, with autograd: ``F.layer_norm(x, x.shape[-1:], weight, bias, eps)``
    with its statistics and affine map computed in fp32 whatever the dtypes, the result in ``out_dtype`` (default:
    ``x.dtype``). x, the weight and the bias must be floating point."""
    _check(x, weight, bias)
    return torch.ops.fuser.layer_norm(x, weight, bias, float(eps), out_dtype)[0]
