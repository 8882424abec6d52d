"""The activation of an un-gated MLP, ``fc2(act(fc1(x) + b))``, with the bias add, as one fused op.

    h   = x + bias                  (fp32; bias optional, ``[n_cols]``)
    out = act(h)                    (rounded once, to ``out_dtype``)

with ``act`` one of the gated op's activations (:data:`fuser.kernels.activations.TABLE`: ``gelu`` exact,
``gelu_tanh`` (also GPT-2's ``gelu_new`` formula), ``gelu_quick`` (``x·σ(1.702·x)``), ``relu``, ``relu2`` (squared
ReLU), ``silu``, ...), evaluated by the same Triton function. Backward, recomputing act from the saved pre-activation:

    dx    = dout · act'(x + bias)
    dbias = Σ_rows dx               (per-program partial sums, reduced in a second step: deterministic)

Forward saves x (the matmul's output, which the op reads anyway) and the bias, never the activation; backward
reads dout and x once and writes dx, and the bias gradient comes from the same pass instead of a second read of
dx. Elementwise tiles of ``[BLOCK_M rows, BLOCK_N columns]``; the backward's programs each own a column block and a
fixed set of row tiles, so the bias partials do not depend on scheduling.
"""

from __future__ import annotations

import torch

from fuser.kernels import _triton as tt
from fuser.kernels._triton import HAS_TRITON, tl, triton
from fuser.kernels.activations import ACTIVATION_CODE, check_activation, reference_activation_and_grad


def _check(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
    check_activation("bias_activation", activation)
    tt.check_floating("bias_activation", x=x, bias=bias)
    if x.dim() == 0:
        raise ValueError("fuser: bias_activation expects a tensor of at least one dim, got a scalar")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(
            f"fuser: bias_activation expects a 1-D bias of size {x.shape[-1]} (x's last dim), got {tuple(bias.shape)}"
        )


# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference: the same forward and backward formulas, used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _pre_activation(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    compute = tt.compute_dtype(x)
    return x.to(compute) if bias is None else x.to(compute) + bias.to(compute)


def _reference_forward(x, bias, activation, out_dtype) -> torch.Tensor:
    act, _ = reference_activation_and_grad(_pre_activation(x, bias), activation)
    return act.to(out_dtype)


def _reference_backward(dout, x, bias, activation, compute_dbias) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dbias in fp32 (fp64 for fp64 inputs) or None): the hand-written backward."""
    _, dact = reference_activation_and_grad(_pre_activation(x, bias), activation)
    dh = dout.to(dact.dtype) * dact
    dbias = dh.reshape(-1, x.shape[-1]).sum(0) if compute_dbias else None
    return dh.to(x.dtype), dbias


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from fuser.kernels.activations import _activation_and_grad

    @triton.jit
    def bias_act_fwd_kernel(
        x_ptr,
        b_ptr,
        out_ptr,
        x_row_stride,
        out_row_stride,
        n_rows,
        n_cols,
        ACTIVATION: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # this program's tile, column blocks fastest (consecutive programs sweep contiguous memory)
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        pid = tl.program_id(0)
        rows = (pid // n_col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]  # [BLOCK_M, BLOCK_N]
        h = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h = h + tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        act, _ = _activation_and_grad(h, ACTIVATION)
        tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bias_act_bwd_kernel(
        dout_ptr,
        x_ptr,
        b_ptr,
        dx_ptr,
        db_partial_ptr,
        dout_row_stride,
        x_row_stride,
        dx_row_stride,
        n_rows,
        n_cols,
        n_row_groups,
        tiles_per_group,
        ACTIVATION: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        COMPUTE_DB: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # program = (row group, column block), column blocks fastest; a group walks its row tiles in a fixed order
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        pid = tl.program_id(0)
        group = pid // n_col_blocks
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_mask = cols < n_cols
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, tiles_per_group):
            rows = (group + i * n_row_groups).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            h = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                h = h + b[None, :]
            dout = tl.load(dout_ptr + rows[:, None] * dout_row_stride + cols[None, :], mask=mask, other=0.0)
            # recompute act'(h) rather than saving anything of the forward's
            _, dact = _activation_and_grad(h, ACTIVATION)
            dh = tl.where(mask, dout.to(tl.float32) * dact, 0.0)
            tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dh.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DB:
                db_acc += tl.sum(dh, axis=0)
        if COMPUTE_DB:
            tl.store(db_partial_ptr + group * n_cols + cols, db_acc, mask=col_mask)


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """(rows per tile, BLOCK_N, warps): the gated activation's tiles (2048 elements, 8 warps), the same kind of
    elementwise work."""
    block_n = min(tt.next_power_of_2(n_cols), 1024)
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, 8


def _launch_forward(x, bias, out, activation) -> None:
    x2, out2 = tt.as_rows(x), tt.out_rows(out)
    n_rows, n_cols = x2.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_m, block_n, num_warps = _launch_config(n_cols)
    grid = (tt.cdiv(n_rows, block_m) * tt.cdiv(n_cols, block_n),)
    bias = bias.contiguous() if bias is not None else None
    tt.launchable(bias_act_fwd_kernel)[grid](
        x2,
        bias if bias is not None else x2,
        out2,
        x2.stride(0),
        out2.stride(0),
        n_rows,
        n_cols,
        ACTIVATION=ACTIVATION_CODE[activation],
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )


def _launch_backward(dout, x, bias, dx, activation, compute_dbias) -> torch.Tensor | None:
    """The backward kernel into ``dx``; returns dbias (fp32) or None."""
    x2, dout2, dx2 = tt.as_rows(x), tt.as_rows(dout), tt.out_rows(dx)
    n_rows, n_cols = x2.shape
    block_m, block_n, num_warps = _launch_config(n_cols)
    n_col_blocks = tt.cdiv(max(n_cols, 1), block_n)
    row_tiles = tt.cdiv(n_rows, block_m)
    # enough programs to fill the device, each a fixed set of row tiles of one column block
    n_row_groups = max(1, min(row_tiles, tt.cdiv(tt.num_programs_for(x, 4), n_col_blocks)))
    db_partial = torch.empty((n_row_groups, n_cols) if compute_dbias else (1,), dtype=torch.float32, device=x.device)
    if n_rows == 0 or n_cols == 0:
        db_partial.zero_()
    else:
        bias = bias.contiguous() if bias is not None else None
        tt.launchable(bias_act_bwd_kernel)[(n_row_groups * n_col_blocks,)](
            dout2,
            x2,
            bias if bias is not None else x2,
            dx2,
            db_partial,
            dout2.stride(0),
            x2.stride(0),
            dx2.stride(0),
            n_rows,
            n_cols,
            n_row_groups,
            tt.cdiv(row_tiles, n_row_groups),
            ACTIVATION=ACTIVATION_CODE[activation],
            HAS_BIAS=bias is not None,
            COMPUTE_DB=compute_dbias,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return db_partial.sum(0) if compute_dbias else None


# ---------------------------------------------------------------------------------------------------------
# One entry per direction: the Triton kernels or the plain-torch reference (used on CPU, and the test oracle)
# ---------------------------------------------------------------------------------------------------------


def bias_activation_forward(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype | None = None,
    *,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(x + bias)`` in ``out_dtype`` (default x's), computed in fp32 (fp64 for fp64 inputs on the reference
    path). ``out`` (contiguous, x's shape) receives it (tests pre-fill it with NaN). ``impl``: ``"triton"``,
    ``"reference"``, or ``"auto"`` (the kernel where Triton runs for x)."""
    out_dtype = out_dtype or x.dtype
    if tt.takes_triton(impl, impl == "auto" and tt.triton_runs(x, bias, out_dtypes=(out_dtype,))):
        out = out if out is not None else torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _launch_forward(x, bias, out, activation)
        return out
    y = _reference_forward(x, bias, activation, out_dtype)
    return out.copy_(y) if out is not None else y.contiguous()


def bias_activation_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    compute_dbias: bool = True,
    *,
    impl: str = "auto",
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dbias in fp32 or None): the backward of :func:`bias_activation_forward` from the saved
    pre-activation ``x`` (and bias). ``dx_out`` (contiguous, x's shape) receives dx. ``impl`` as there."""
    compute_dbias = compute_dbias and bias is not None
    if tt.takes_triton(impl, impl == "auto" and tt.triton_runs(x, dout, bias)):
        dx = dx_out if dx_out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return dx, _launch_backward(dout, x, bias, dx, activation, compute_dbias)
    dx, db = _reference_backward(dout, x, bias, activation, compute_dbias)
    return (dx_out.copy_(dx) if dx_out is not None else dx.contiguous()), db


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "fuser::bias_activation",
    mutates_args=(),
    schema="(Tensor x, Tensor? bias, str activation, ScalarType? out_dtype) -> Tensor",
)
def bias_activation_op(x, bias, activation, out_dtype):
    """``act(x + bias)`` in ``out_dtype`` (default x's)."""
    _check(x, bias, activation)
    return bias_activation_forward(x, bias, activation, out_dtype)


@bias_activation_op.register_fake
def _(x, bias, activation, out_dtype):
    _check(x, bias, activation)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.custom_op(
    "fuser::bias_activation_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor x, Tensor? bias, str activation, bool compute_dbias) -> (Tensor, Tensor)",
)
def bias_activation_backward_op(dout, x, bias, activation, compute_dbias):
    """(dx in x's dtype, dbias in the bias's dtype, or an empty tensor)."""
    dx, db = bias_activation_backward(dout, x, bias, activation, compute_dbias)
    return dx, tt.or_empty(db.to(bias.dtype) if db is not None else None, x)


@bias_activation_backward_op.register_fake
def _(dout, x, bias, activation, compute_dbias):
    has_db = bias is not None and compute_dbias
    return x.new_empty(x.shape), (bias.new_empty(bias.shape) if has_db else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, bias, activation, _ = inputs
    ctx.save_for_backward(x, bias)  # the pre-activation, never the activation
    ctx.activation = activation
    ctx.set_materialize_grads(False)


def _backward(ctx, dout):
    x, bias = ctx.saved_tensors
    need_x, need_b = ctx.needs_input_grad[:2]
    compute_dbias = bias is not None and need_b
    if dout is None or not (need_x or compute_dbias):
        return None, None, None, None
    dx, db = torch.ops.fuser.bias_activation_backward(dout, x, bias, ctx.activation, compute_dbias)
    return (dx if need_x else None), (db if compute_dbias else None), None, None


bias_activation_op.register_autograd(_backward, setup_context=_setup_context)


def bias_activation(
    x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "gelu", *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``act(x + bias)`` fused, with autograd: an un-gated MLP's activation on its first projection's output
    (``bias`` ``[x.shape[-1]]``, optional). ``activation`` is one of ``"gelu"`` (exact), ``"gelu_tanh"`` (also
    GPT-2's ``gelu_new``), ``"gelu_quick"``, ``"relu"``, ``"relu2"``, ``"silu"``; computed in fp32, the result in
    ``out_dtype`` (default ``x.dtype``). The backward recomputes the activation from the saved ``x``."""
    _check(x, bias, activation)
    return torch.ops.fuser.bias_activation(x, bias, activation, out_dtype)
