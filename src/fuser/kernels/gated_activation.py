"""The gated activation of SwiGLU / GeGLU MLPs as one fused op, forward and backward, LoRA sums absorbed.

    g   = gate + gate_scale · gate_lora        (only with a gate LoRA term; rounded to the input dtype, saved)
    u   = up + up_scale · up_lora              (likewise)
    out = act(g) · u

with act one of the activations of :data:`fuser.kernels.activations.TABLE` (each formula stated there), computed
in fp32 (fp64 for fp64 inputs) whatever the input dtype.

Backward, recomputing act from the saved g:

    dgate      = dout · u · act'(g)          dup      = dout · act(g)
    dgate_lora = gate_scale · dgate          dup_lora = up_scale · dup

Forward saves g and u: the inputs themselves without LoRA, otherwise the sums the forward wrote anyway (eager
would keep g, act(g) and u). The sums are rounded to the input dtype before act, as eager's ``base + lora * s``
in bf16 rounds them; the product ``lora · s`` is not rounded separately (one rounding fewer than eager). The sums
are op outputs only so that backward can save them: they are marked non-differentiable.

The packed form (Phi-3's ``gate_up_proj``, MoE experts: ``gate, up = gate_up.chunk(2, -1)``) passes the two halves
to the same kernels as strided views, and its backward writes d(gate_up) into one ``[..., 2I]`` tensor, so
nothing is split or concatenated. Every kernel is elementwise: one program per [BLOCK_M rows, BLOCK_N columns]
tile, any row stride, no reductions, hence deterministic. The tiles are numbered on a 1-D grid with the column
block varying fastest, so programs launched together sweep contiguous memory: the (row, column) grid order was
slower whatever the tile shape (``docs/notes/kernels.md``, gated activation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser._dtypes import FLOAT_DTYPES
from fuser.kernels import _triton as tt
from fuser.kernels._triton import HAS_TRITON, tl, triton
from fuser.kernels.activations import ACTIVATION_CODE, check_activation, reference_activation_and_grad


@dataclass(frozen=True)
class Lora:
    """The forward's LoRA terms, as its functions pass them around: ``g = gate + gate_scale · gate_lora`` and
    ``u = up + up_scale · up_lora`` (a term ``None``: none on that side, its scale unused)."""

    gate_lora: torch.Tensor | None = None
    up_lora: torch.Tensor | None = None
    gate_scale: float = 1.0
    up_scale: float = 1.0


@dataclass(frozen=True)
class LoraGrads:
    """How the backward forms the LoRA terms' gradients ``scale · dg`` / ``scale · du`` (when asked for): the
    forward's scales, and each term's dtype (``None``: g's dtype)."""

    gate_scale: float = 1.0
    up_scale: float = 1.0
    gate_dtype: torch.dtype | None = None
    up_dtype: torch.dtype | None = None


NO_LORA, NO_LORA_GRADS = Lora(), LoraGrads()
# the backward's four gradients (dgate, dup, dgate_lora, dup_lora): which are asked for
Wanted = tuple[bool, bool, bool, bool]
BASE_GRADS: Wanted = (True, True, False, False)


def _check_activation(activation: str) -> None:
    check_activation("gated_activation", activation)


def _check_inputs(gate: torch.Tensor, up: torch.Tensor, lora: Lora, activation: str) -> None:
    _check_activation(activation)
    tt.check_floating("gated_activation", gate=gate)  # F.silu / F.gelu raise NotImplementedError for integers
    named = [("gate", gate), ("up", up), ("gate_lora", lora.gate_lora), ("up_lora", lora.up_lora)]
    for name, t in named[1:]:
        if t is None:
            continue
        if t.shape != gate.shape:
            raise ValueError(
                f"fuser: gated_activation expects {name} of gate's shape {tuple(gate.shape)}, got {tuple(t.shape)}"
            )
        # LoRA terms may be of another float dtype (peft keeps adapters in fp32 under bf16 bases)
        allowed = (gate.dtype,) if name == "up" else FLOAT_DTYPES
        if t.dtype not in allowed:
            raise ValueError(
                f"fuser: gated_activation expects {name} of gate's dtype {gate.dtype}"
                f"{'' if name == 'up' else ' or another float dtype'}, got {t.dtype}; cast it first"
            )


def _check_packed(gate_up: torch.Tensor, gate_up_lora: torch.Tensor | None, activation: str) -> None:
    _check_activation(activation)
    tt.check_floating("gated_activation_packed", gate_up=gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            "fuser: gated_activation_packed expects gate_up with an even last dim (gate and up halves), "
            f"got shape {tuple(gate_up.shape)}"
        )
    if gate_up_lora is not None and (gate_up_lora.shape != gate_up.shape or gate_up_lora.dtype != gate_up.dtype):
        raise ValueError(
            f"fuser: gated_activation_packed expects gate_up_lora of gate_up's shape {tuple(gate_up.shape)} and "
            f"dtype {gate_up.dtype}, got {tuple(gate_up_lora.shape)} {gate_up_lora.dtype}"
        )


# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference: the same forward and backward formulas, used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _reference_wide(base: torch.Tensor, lora: torch.Tensor | None, scale: float, compute: torch.dtype):
    """base + scale · lora in the compute dtype, not rounded (base alone without a LoRA term)."""
    if lora is None:
        return base.to(compute)
    return base.to(compute) + scale * lora.to(compute)


def _reference_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, lora: Lora
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, g, u) in the inputs' dtype; g / u are the LoRA sums (None without the LoRA term)."""
    compute = tt.compute_dtype(gate)
    # the product is computed from the LoRA sums before their rounding (as Inductor computes peft's
    # ``(base + lora * s).to(bf16)`` fused into its consumer: a LoRA term below half an ulp of the base would
    # otherwise vanish); the rounded sums are what backward saves
    g_wide = _reference_wide(gate, lora.gate_lora, lora.gate_scale, compute)
    u_wide = _reference_wide(up, lora.up_lora, lora.up_scale, compute)
    act, _ = reference_activation_and_grad(g_wide, activation)
    out = (act * u_wide).to(gate.dtype)
    g = None if lora.gate_lora is None else g_wide.to(gate.dtype)
    return out, g, None if lora.up_lora is None else u_wide.to(up.dtype)


def _reference_backward(
    dout: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str, wanted: Wanted, lora: LoraGrads
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The hand-written backward (not autograd of the forward): (dgate, dup, dgate_lora, dup_lora), or None where
    not ``wanted``; the LoRA gradients in ``lora``'s dtypes (default g's dtype), the others in g's dtype. ``g`` and
    ``u`` are what the forward saved (the sums under LoRA)."""
    compute_dgate, compute_dup, compute_dgate_lora, compute_dup_lora = wanted
    compute = tt.compute_dtype(g)
    gc, uc, dc = g.to(compute), u.to(compute), dout.to(compute)
    act, dact = reference_activation_and_grad(gc, activation)
    dgate = dup = dgate_lora = dup_lora = None
    if compute_dgate or compute_dgate_lora:
        dg = dc * uc * dact
        dgate = dg.to(g.dtype) if compute_dgate else None
        dgate_lora = (lora.gate_scale * dg).to(lora.gate_dtype or g.dtype) if compute_dgate_lora else None
    if compute_dup or compute_dup_lora:
        du = dc * act
        dup = du.to(g.dtype) if compute_dup else None
        dup_lora = (lora.up_scale * du).to(lora.up_dtype or g.dtype) if compute_dup_lora else None
    return dgate, dup, dgate_lora, dup_lora


def _halves(gate_up: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate, up) = gate_up.chunk(2, -1) of a packed ``[..., 2I]`` tensor: two views, no copy; (None, None) for
    None."""
    if gate_up is None:
        return None, None
    n_cols = gate_up.shape[-1] // 2
    return gate_up[..., :n_cols], gate_up[..., n_cols:]


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from fuser.kernels.activations import _activation_and_grad

    @triton.jit
    def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # this program's tile (row block, column block), column blocks fastest: consecutive programs sweep
        # contiguous memory; (rows [BLOCK_M, 1] int64, cols [1, BLOCK_N], mask [BLOCK_M, BLOCK_N])
        n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
        pid = tl.program_id(0)
        rows = (pid // n_col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], int64 offsets
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]  # [BLOCK_M, BLOCK_N]
        return rows[:, None], cols[None, :], mask

    @triton.jit
    def gated_act_fwd_kernel(
        gate_ptr,
        up_ptr,
        gate_lora_ptr,
        up_lora_ptr,
        out_ptr,
        gate_sum_ptr,
        up_sum_ptr,
        gate_row_stride,
        up_row_stride,
        gate_lora_row_stride,
        up_lora_row_stride,
        out_row_stride,
        gate_sum_row_stride,
        up_sum_row_stride,
        n_rows,
        n_cols,
        gate_scale,
        up_scale,
        ACTIVATION: tl.constexpr,
        HAS_GATE_LORA: tl.constexpr,
        HAS_UP_LORA: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        gate_scale, up_scale = tl.cast(gate_scale, tl.float32), tl.cast(up_scale, tl.float32)
        rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
        g = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # absorb the LoRA sums: store them rounded to the input dtype (what backward saves), and act on the fp32
        # sums, as Inductor does with peft's cast fused into this consumer (a small LoRA term survives)
        if HAS_GATE_LORA:
            gate_lora = tl.load(gate_lora_ptr + rows * gate_lora_row_stride + cols, mask=mask, other=0.0)
            g = g + gate_scale * gate_lora.to(tl.float32)
            tl.store(gate_sum_ptr + rows * gate_sum_row_stride + cols, g.to(gate_sum_ptr.dtype.element_ty), mask=mask)
        if HAS_UP_LORA:
            up_lora = tl.load(up_lora_ptr + rows * up_lora_row_stride + cols, mask=mask, other=0.0)
            u = u + up_scale * up_lora.to(tl.float32)
            tl.store(up_sum_ptr + rows * up_sum_row_stride + cols, u.to(up_sum_ptr.dtype.element_ty), mask=mask)
        act, _ = _activation_and_grad(g, ACTIVATION)
        out = act * u
        tl.store(out_ptr + rows * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_act_bwd_kernel(
        dout_ptr,
        g_ptr,
        u_ptr,
        dgate_ptr,
        dup_ptr,
        dgate_lora_ptr,
        dup_lora_ptr,
        product_ptr,
        dout_row_stride,
        g_row_stride,
        u_row_stride,
        dgate_row_stride,
        dup_row_stride,
        dgate_lora_row_stride,
        dup_lora_row_stride,
        product_row_stride,
        n_rows,
        n_cols,
        gate_scale,
        up_scale,
        ACTIVATION: tl.constexpr,
        NEED_DG: tl.constexpr,
        NEED_DU: tl.constexpr,
        WRITE_DGATE: tl.constexpr,
        WRITE_DUP: tl.constexpr,
        WRITE_DGATE_LORA: tl.constexpr,
        WRITE_DUP_LORA: tl.constexpr,
        WRITE_PRODUCT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        gate_scale, up_scale = tl.cast(gate_scale, tl.float32), tl.cast(up_scale, tl.float32)
        # the forward kernel's opening (the tile, fp32 loads of the first operands), here of the backward's operands
        rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
        dout = tl.load(dout_ptr + rows * dout_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # recompute act(g) and act'(g) rather than saving act(g)
        act, dact = _activation_and_grad(g, ACTIVATION)
        if NEED_DG or WRITE_PRODUCT:
            u = tl.load(u_ptr + rows * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if NEED_DG:
            dg = dout * u * dact
            if WRITE_DGATE:
                tl.store(dgate_ptr + rows * dgate_row_stride + cols, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
            if WRITE_DGATE_LORA:
                dg_lora = (gate_scale * dg).to(dgate_lora_ptr.dtype.element_ty)
                tl.store(dgate_lora_ptr + rows * dgate_lora_row_stride + cols, dg_lora, mask=mask)
        if NEED_DU:
            du = dout * act
            if WRITE_DUP:
                tl.store(dup_ptr + rows * dup_row_stride + cols, du.to(dup_ptr.dtype.element_ty), mask=mask)
            if WRITE_DUP_LORA:
                du_lora = (up_scale * du).to(dup_lora_ptr.dtype.element_ty)
                tl.store(dup_lora_ptr + rows * dup_lora_row_stride + cols, du_lora, mask=mask)
        if WRITE_PRODUCT:
            # the forward's product act(g) · u, as its kernel computes it, for the down projection's dW (it may
            # be written over dout: this program has read its tile of dout above)
            product = act * u
            tl.store(
                product_ptr + rows * product_row_stride + cols, product.to(product_ptr.dtype.element_ty), mask=mask
            )


def _launch_config(n_cols: int) -> tuple[int, int, int]:
    """(rows per tile, BLOCK_N, warps): tiles of 2048 elements, 8 per thread at 8 warps, the best of the tile
    shapes ``benchmarks/tune_gated_activation.py`` sweeps in every pass; larger tiles lose in GeGLU's backward
    (register pressure of the longer formula). The sweep's figures: ``docs/notes/kernels.md``."""
    block_n = min(tt.next_power_of_2(n_cols), 1024)
    block_m = max(1, 2048 // block_n)
    return block_m, block_n, 8


def _launch_grid(n_rows: int, n_cols: int) -> tuple[tuple[int], dict[str, int]]:
    """Both kernels' launch over ``[n_rows, n_cols]``: the 1-D grid of tiles (column blocks fastest, as ``_tile``
    numbers them) and the tile sizes and warps of :func:`_launch_config`, as the kernels' keyword arguments."""
    block_m, block_n, num_warps = _launch_config(n_cols)
    grid = (tt.cdiv(n_rows, block_m) * tt.cdiv(n_cols, block_n),)
    return grid, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps}


def _row_stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _launch_forward(gate2, up2, gate_lora2, up_lora2, out2, gate_sum2, up_sum2, gate_scale, up_scale, activation):
    """The forward kernel on ``[rows, n_cols]`` views (None: no such LoRA term)."""
    n_rows, n_cols = gate2.shape
    if n_rows == 0 or n_cols == 0:
        return
    grid, tiles = _launch_grid(n_rows, n_cols)
    tt.launchable(gated_act_fwd_kernel)[grid](
        gate2,
        up2,
        gate_lora2 if gate_lora2 is not None else gate2,
        up_lora2 if up_lora2 is not None else up2,
        out2,
        gate_sum2 if gate_sum2 is not None else out2,
        up_sum2 if up_sum2 is not None else out2,
        gate2.stride(0),
        up2.stride(0),
        _row_stride(gate_lora2),
        _row_stride(up_lora2),
        out2.stride(0),
        _row_stride(gate_sum2),
        _row_stride(up_sum2),
        n_rows,
        n_cols,
        float(gate_scale),
        float(up_scale),
        ACTIVATION=ACTIVATION_CODE[activation],
        HAS_GATE_LORA=gate_lora2 is not None,
        HAS_UP_LORA=up_lora2 is not None,
        **tiles,
    )


def _launch_backward(
    dout2, g2, u2, dgate2, dup2, dgate_lora2, dup_lora2, gate_scale, up_scale, activation, product2=None
):
    """The backward kernel on ``[rows, n_cols]`` views (None: that gradient, or the product, is not written)."""
    n_rows, n_cols = g2.shape
    written = [t for t in (dgate2, dup2, dgate_lora2, dup_lora2, product2) if t is not None]
    if n_rows == 0 or n_cols == 0 or not written:
        return
    grid, tiles = _launch_grid(n_rows, n_cols)
    tt.launchable(gated_act_bwd_kernel)[grid](
        dout2,
        g2,
        u2,
        dgate2 if dgate2 is not None else written[0],
        dup2 if dup2 is not None else written[0],
        dgate_lora2 if dgate_lora2 is not None else written[0],
        dup_lora2 if dup_lora2 is not None else written[0],
        product2 if product2 is not None else written[0],
        dout2.stride(0),
        g2.stride(0),
        u2.stride(0),
        _row_stride(dgate2),
        _row_stride(dup2),
        _row_stride(dgate_lora2),
        _row_stride(dup_lora2),
        _row_stride(product2),
        n_rows,
        n_cols,
        float(gate_scale),
        float(up_scale),
        ACTIVATION=ACTIVATION_CODE[activation],
        NEED_DG=dgate2 is not None or dgate_lora2 is not None,
        NEED_DU=dup2 is not None or dup_lora2 is not None,
        WRITE_DGATE=dgate2 is not None,
        WRITE_DUP=dup2 is not None,
        WRITE_DGATE_LORA=dgate_lora2 is not None,
        WRITE_DUP_LORA=dup_lora2 is not None,
        WRITE_PRODUCT=product2 is not None,
        **tiles,
    )


# ---------------------------------------------------------------------------------------------------------
# One entry per direction: the Triton kernels or the plain-torch reference (used on CPU, and the test oracle);
# the packed form passes its halves to the same entries
# ---------------------------------------------------------------------------------------------------------


def _into(buffer: torch.Tensor | None, result: torch.Tensor | None) -> torch.Tensor | None:
    """A reference result written into its buffer where one is given, else made contiguous, as the kernels write
    theirs (None stays None)."""
    if result is None:
        return None
    return buffer.copy_(result) if buffer is not None else result.contiguous()


def _sum_buffer(base: torch.Tensor, lora: torch.Tensor | None, buffer: torch.Tensor | None) -> torch.Tensor | None:
    """Where the kernel writes a LoRA sum: ``buffer``, or a new one of base's shape and dtype; None without the LoRA
    term (nothing is written)."""
    if lora is None:
        return None
    return buffer if buffer is not None else torch.empty(base.shape, dtype=base.dtype, device=base.device)


def gated_activation_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    lora: Lora = NO_LORA,
    *,
    impl: str = "auto",
    out: torch.Tensor | None = None,
    gate_sum: torch.Tensor | None = None,
    up_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, g, u): ``act(g) · u``, and the LoRA sums g / u rounded to the inputs' dtype (what backward saves;
    None without that LoRA term). ``out`` / ``gate_sum`` / ``up_sum`` (gate's shape, rows viewable with unit last
    stride) receive the results where given: tests pre-fill them with NaN, the packed form passes the halves of one
    packed tensor. ``out`` may have another dtype than gate's: the op's wide path passes fp32 sums and a buffer in
    the narrow dtype, into which the product is rounded once. ``impl``: ``"triton"``, ``"reference"``, or
    ``"auto"`` (the kernel where Triton runs for gate). What ``fuser::gated_activation`` computes, and what the down
    projections' backwards (``fuser::linear_gated``, ``fuser::upcast_linear_gated``) recompute the product with."""
    gate_lora, up_lora = lora.gate_lora, lora.up_lora
    if not tt.takes_triton(impl, impl == "auto" and tt.triton_runs(gate)):
        y, g, u = _reference_forward(gate, up, activation, lora)
        return _into(out, y), _into(gate_sum, g), _into(up_sum, u)
    _check_inputs(gate, up, lora, activation)
    out = out if out is not None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    gate_sum, up_sum = _sum_buffer(gate, gate_lora, gate_sum), _sum_buffer(up, up_lora, up_sum)
    _launch_forward(
        tt.as_rows(gate),
        tt.as_rows(up),
        tt.as_rows(gate_lora) if gate_lora is not None else None,
        tt.as_rows(up_lora) if up_lora is not None else None,
        tt.out_rows(out),
        tt.out_rows(gate_sum) if gate_sum is not None else None,
        tt.out_rows(up_sum) if up_sum is not None else None,
        lora.gate_scale,
        lora.up_scale,
        activation,
    )
    return out, gate_sum, up_sum


def gated_activation_backward(
    dout: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    activation: str,
    wanted: Wanted = BASE_GRADS,
    lora: LoraGrads = NO_LORA_GRADS,
    *,
    impl: str = "auto",
    out: tuple[torch.Tensor | None, ...] = (None,) * 4,
    product_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dgate, dup, dgate_lora, dup_lora), each None where ``wanted`` does not ask for it; dgate and dup in g's
    dtype, the LoRA gradients in ``lora``'s dtypes. ``g`` and ``u`` are what the forward saved (the sums under
    LoRA). ``out`` (four buffers or None, g's shape) receive the gradients where given: tests pre-fill them with
    NaN, the in-place op passes g and u themselves (each element is read before it is written). ``product_out``
    (g's shape and dtype), where given, also receives the forward's product ``act(g) · u`` (what
    :func:`gated_activation_forward` computes from g and u without LoRA terms), for the down projection's weight
    gradient: it may be ``dout`` itself. ``impl`` as for :func:`gated_activation_forward`."""
    if not tt.takes_triton(impl, impl == "auto" and tt.triton_runs(g)):
        grads = _reference_backward(dout, g, u, activation, wanted, lora)
        # the product before anything is written: g, u or dout may be the buffers written
        product = _reference_forward(g, u, activation, NO_LORA)[0] if product_out is not None else None
        grads = tuple(_into(b, t) for b, t in zip(out, grads, strict=True))
        if product_out is not None:
            product_out.copy_(product)
        return grads
    _check_inputs(g, u, NO_LORA, activation)
    dtypes = (g.dtype, g.dtype, lora.gate_dtype or g.dtype, lora.up_dtype or g.dtype)
    grads = [
        (b if b is not None else torch.empty(g.shape, dtype=d, device=g.device)) if w else None
        for w, b, d in zip(wanted, out, dtypes, strict=True)
    ]
    _launch_backward(
        tt.as_rows(dout),
        tt.as_rows(g),
        tt.as_rows(u),
        *[tt.out_rows(t) if t is not None else None for t in grads],
        lora.gate_scale,
        lora.up_scale,
        activation,
        tt.out_rows(product_out) if product_out is not None else None,
    )
    return grads[0], grads[1], grads[2], grads[3]


def gated_activation_packed_forward(
    gate_up: torch.Tensor,
    activation: str,
    gate_up_lora: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    impl: str = "auto",
    out: torch.Tensor | None = None,
    gate_up_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out ``[..., I]``, gate_up_sum or None): :func:`gated_activation_forward` on the two halves of ``gate_up``
    (and of ``gate_up_lora``, both halves scaled by ``scale``), the sums written into the halves of one packed
    ``gate_up_sum``. ``out`` / ``gate_up_sum``: buffers, as there."""
    gate_up_sum = _sum_buffer(gate_up, gate_up_lora, gate_up_sum)
    gate, up = _halves(gate_up)
    gate_sum, up_sum = _halves(gate_up_sum)
    lora = Lora(*_halves(gate_up_lora), scale, scale)
    out, _, _ = gated_activation_forward(
        gate, up, activation, lora, impl=impl, out=out, gate_sum=gate_sum, up_sum=up_sum
    )
    return out, gate_up_sum


def gated_activation_packed_backward(
    dout: torch.Tensor,
    gate_up: torch.Tensor,
    activation: str,
    scale: float = 1.0,
    wanted: tuple[bool, bool] = (True, False),
    *,
    impl: str = "auto",
    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d gate_up, d gate_up_lora), each one packed ``[..., 2I]`` tensor (None where ``wanted`` does not ask for
    it) whose halves :func:`gated_activation_backward` writes directly: nothing is split or concatenated.
    ``out``: buffers, as there."""
    packed = [
        (b if b is not None else torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)) if w else None
        for w, b in zip(wanted, out, strict=True)
    ]
    need_base, need_lora = wanted
    gated_activation_backward(
        dout,
        *_halves(gate_up),
        activation,
        (need_base, need_base, need_lora, need_lora),
        LoraGrads(scale, scale),
        impl=impl,
        out=(*_halves(packed[0]), *_halves(packed[1])),
    )
    return packed[0], packed[1]


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::gated_activation", mutates_args=())
def gated_activation_op(
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_lora: torch.Tensor | None,
    up_lora: torch.Tensor | None,
    gate_scale: float,
    up_scale: float,
    activation: str,
    gate_wide: torch.Tensor | None = None,
    up_wide: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out, g, u): g / u are the LoRA sums backward saves, or empty tensors without that LoRA term.

    ``gate_wide`` / ``up_wide`` (fp32, gate's shape; only without LoRA terms): the values ``gate`` / ``up`` are
    the rounding of (``fuser::lora_sum_wide``): the product is computed from them, ``gate`` and ``up`` are
    saved, and the gradients are those of ``gate`` and ``up``."""
    if gate_wide is not None or up_wide is not None:
        _check_wide(gate, up, gate_lora, up_lora, gate_wide, up_wide)
        # one half without a LoRA sum (an adapter on gate_proj or up_proj alone): its fp32 copy is exact
        gate_wide = gate.to(torch.float32) if gate_wide is None else gate_wide
        up_wide = up.to(torch.float32) if up_wide is None else up_wide
        _check_inputs(gate_wide, up_wide, NO_LORA, activation)
        # the product from the wide sums, rounded once to gate's dtype
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        gated_activation_forward(gate_wide, up_wide, activation, out=out)
        return out, gate.new_empty(0), up.new_empty(0)
    lora = Lora(gate_lora, up_lora, gate_scale, up_scale)
    _check_inputs(gate, up, lora, activation)
    out, g, u = gated_activation_forward(gate, up, activation, lora)
    return out, tt.or_empty(g, gate), tt.or_empty(u, up)


def _check_wide(gate, up, gate_lora, up_lora, gate_wide, up_wide) -> None:
    if gate_lora is not None or up_lora is not None:
        raise ValueError("fuser: gated_activation takes gate_wide/up_wide only without LoRA terms")
    for name, wide, narrow in (("gate_wide", gate_wide, gate), ("up_wide", up_wide, up)):
        if wide is not None and (wide.shape != narrow.shape or wide.dtype != torch.float32):
            raise ValueError(
                f"fuser: gated_activation expects {name} in fp32 of shape {tuple(narrow.shape)}, "
                f"got {wide.dtype} {tuple(wide.shape)}"
            )


@gated_activation_op.register_fake
def _(gate, up, gate_lora, up_lora, gate_scale, up_scale, activation, gate_wide=None, up_wide=None):
    _check_inputs(gate, up, Lora(gate_lora, up_lora), activation)
    if gate_wide is not None or up_wide is not None:
        _check_wide(gate, up, gate_lora, up_lora, gate_wide, up_wide)
    return (
        gate.new_empty(gate.shape),
        gate.new_empty(gate.shape if gate_lora is not None else 0),
        up.new_empty(up.shape if up_lora is not None else 0),
    )


@torch.library.custom_op("fuser::gated_activation_backward", mutates_args=())
def gated_activation_backward_op(
    dout: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    gate_scale: float,
    up_scale: float,
    gate_grad: bool,
    up_grad: bool,
    gate_lora_grad: bool,
    up_lora_grad: bool,
    activation: str,
    gate_lora_dtype: torch.dtype | None = None,
    up_lora_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dup, dgate_lora, dup_lora); each one not asked for is an empty tensor."""
    wanted = (gate_grad, up_grad, gate_lora_grad, up_lora_grad)
    lora = LoraGrads(gate_scale, up_scale, gate_lora_dtype, up_lora_dtype)
    return tuple(tt.or_empty(t, g) for t in gated_activation_backward(dout, g, u, activation, wanted, lora))


@gated_activation_backward_op.register_fake
def _(
    dout, g, u, gate_scale, up_scale, gate_grad, up_grad, gate_lora_grad, up_lora_grad, activation,
    gate_lora_dtype=None, up_lora_dtype=None,
):  # fmt: skip
    _check_activation(activation)
    wanted = (gate_grad, up_grad, gate_lora_grad, up_lora_grad)
    dtypes = (g.dtype, g.dtype, gate_lora_dtype or g.dtype, up_lora_dtype or g.dtype)
    return tuple(
        g.new_empty(g.shape if w else 0, dtype=d if w else g.dtype) for w, d in zip(wanted, dtypes, strict=True)
    )


@torch.library.custom_op("fuser::gated_activation_backward_", mutates_args=("g", "u"))
def gated_activation_backward_inplace_op(
    dout: torch.Tensor, g: torch.Tensor, u: torch.Tensor, gate_scale: float, up_scale: float, activation: str
) -> None:
    """dgate over ``g``, dup over ``u``: the backward without LoRA gradients, writing into its inputs.

    Never called by autograd: a post-grad pass (:mod:`fuser.inductor.gated_mlp_inplace`) puts it in place of
    ``fuser::gated_activation_backward`` when nothing reads g and u afterwards (a checkpointed layer's recomputed
    gate and up), which saves two ``[tokens, intermediate]`` buffers at the peak of the layer's backward. The
    kernel reads each element of g and u before it writes the same element, so writing in place is exact."""
    # the kernels write rows of unit last stride; the reference computes both gradients before it writes either
    impl = "triton" if tt.triton_runs(g) and g.is_contiguous() and u.is_contiguous() else "reference"
    lora = LoraGrads(gate_scale, up_scale)
    gated_activation_backward(dout, g, u, activation, BASE_GRADS, lora, impl=impl, out=(g, u, None, None))


@gated_activation_backward_inplace_op.register_fake
def _(dout, g, u, gate_scale, up_scale, activation):
    _check_activation(activation)


def _setup_context(ctx, inputs, output):
    gate, up, gate_lora, up_lora, gate_scale, up_scale, activation = inputs[:7]  # (gate_wide, up_wide): not saved
    ctx.n_inputs = len(inputs)
    _, gate_sum, up_sum = output
    # save g and u (the sums under LoRA), never act(g): backward recomputes it
    ctx.save_for_backward(gate if gate_lora is None else gate_sum, up if up_lora is None else up_sum)
    ctx.has_gate_lora, ctx.has_up_lora = gate_lora is not None, up_lora is not None
    ctx.lora_dtypes = (
        gate_lora.dtype if gate_lora is not None else None,
        up_lora.dtype if up_lora is not None else None,
    )
    ctx.gate_scale, ctx.up_scale, ctx.activation = gate_scale, up_scale, activation
    # the sums are handed out for saving, not as results: nothing may backpropagate into them
    ctx.mark_non_differentiable(gate_sum, up_sum)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dgate_sum, _dup_sum):
    g, u = ctx.saved_tensors
    needs = ctx.needs_input_grad
    wanted = (needs[0], needs[1], needs[2] and ctx.has_gate_lora, needs[3] and ctx.has_up_lora)
    rest = (None,) * (ctx.n_inputs - 4)  # scales, activation and the wide sums: not differentiable
    if dout is None or not any(wanted):
        return None, None, None, None, *rest
    grads = torch.ops.fuser.gated_activation_backward(
        dout, g, u, ctx.gate_scale, ctx.up_scale, *wanted, ctx.activation, *ctx.lora_dtypes
    )
    return (*(t if w else None for t, w in zip(grads, wanted, strict=True)), *rest)


gated_activation_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("fuser::gated_activation_packed", mutates_args=())
def gated_activation_packed_op(
    gate_up: torch.Tensor,
    gate_up_lora: torch.Tensor | None,
    scale: float,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out ``[..., I]``, gate_up_sum): the packed LoRA sum backward saves, or an empty tensor."""
    _check_packed(gate_up, gate_up_lora, activation)
    out, gate_up_sum = gated_activation_packed_forward(gate_up, activation, gate_up_lora, scale)
    return out, tt.or_empty(gate_up_sum, gate_up)


@gated_activation_packed_op.register_fake
def _(gate_up, gate_up_lora, scale, activation):
    _check_packed(gate_up, gate_up_lora, activation)
    out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    return out, gate_up.new_empty(gate_up.shape if gate_up_lora is not None else 0)


@torch.library.custom_op("fuser::gated_activation_packed_backward", mutates_args=())
def gated_activation_packed_backward_op(
    dout: torch.Tensor,
    gate_up: torch.Tensor,
    scale: float,
    gate_up_grad: bool,
    gate_up_lora_grad: bool,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate_up, d gate_up_lora), packed ``[..., 2I]``; each one not asked for is an empty tensor."""
    wanted = (gate_up_grad, gate_up_lora_grad)
    grads = gated_activation_packed_backward(dout, gate_up, activation, scale, wanted)
    return tt.or_empty(grads[0], gate_up), tt.or_empty(grads[1], gate_up)


@gated_activation_packed_backward_op.register_fake
def _(dout, gate_up, scale, gate_up_grad, gate_up_lora_grad, activation):
    _check_packed(gate_up, None, activation)
    return tuple(gate_up.new_empty(gate_up.shape if w else 0) for w in (gate_up_grad, gate_up_lora_grad))


def _packed_setup_context(ctx, inputs, output):
    gate_up, gate_up_lora, scale, activation = inputs
    _, gate_up_sum = output
    ctx.save_for_backward(gate_up if gate_up_lora is None else gate_up_sum)
    ctx.has_lora, ctx.scale, ctx.activation = gate_up_lora is not None, scale, activation
    ctx.mark_non_differentiable(gate_up_sum)
    ctx.set_materialize_grads(False)


def _packed_backward(ctx, dout, _dgate_up_sum):
    (gate_up,) = ctx.saved_tensors
    wanted = (ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.has_lora)
    if dout is None or not any(wanted):
        return None, None, None, None
    grads = torch.ops.fuser.gated_activation_packed_backward(dout, gate_up, ctx.scale, *wanted, ctx.activation)
    return (*(t if w else None for t, w in zip(grads, wanted, strict=True)), None, None)


gated_activation_packed_op.register_autograd(_packed_backward, setup_context=_packed_setup_context)


# ---------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------


def gated_activation(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    *,
    gate_lora: torch.Tensor | None = None,
    up_lora: torch.Tensor | None = None,
    gate_scale: float = 1.0,
    up_scale: float = 1.0,
) -> torch.Tensor:
    """``act(gate + gate_scale·gate_lora) · (up + up_scale·up_lora)``, fused, with autograd.

    ``activation`` is a name of :data:`fuser.kernels.activations.ACTIVATIONS` (``"silu"``, ``"gelu_tanh"``,
    ``"gelu"``, ...); the LoRA terms are optional. gate, up and the LoRA terms share one shape and dtype; the maths
    runs in fp32 and the result has the inputs' dtype.
    """
    _check_inputs(gate, up, Lora(gate_lora, up_lora), activation)
    return torch.ops.fuser.gated_activation(
        gate, up, gate_lora, up_lora, float(gate_scale), float(up_scale), activation
    )[0]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (Llama, Mistral, Qwen MLPs), fused, with autograd."""
    tt.check_floating("swiglu", gate=gate, up=up)
    return gated_activation(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` (Gemma: ``"tanh"``), fused, with autograd."""
    tt.check_floating("geglu", gate=gate, up=up)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"fuser: geglu expects approximate 'tanh' or 'none' (as F.gelu), got {approximate!r}")
    return gated_activation(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


def gated_activation_packed(
    gate_up: torch.Tensor,
    activation: str,
    *,
    gate_up_lora: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """``gate, up = (gate_up + scale·gate_up_lora).chunk(2, -1); act(gate) · up`` (Phi-3, MoE experts), fused.

    The gradient of ``gate_up`` comes back as one packed tensor; no half is copied or concatenated.
    """
    _check_packed(gate_up, gate_up_lora, activation)
    return torch.ops.fuser.gated_activation_packed(gate_up, gate_up_lora, float(scale), activation)[0]
