"""peft's LoRA output under a half-precision base: ``(base + (a @ Bᵀ) · s).to(base.dtype)`` as one op.

peft keeps the adapters in fp32 under a bf16/fp16 base layer and computes
``result = (base(x) + lora_B(lora_A(x.float())) · scaling).to(base dtype)``. Inductor runs ``lora_B`` (an fp32
matmul with a reduction over the rank, 8–64) on cuBLAS's CUDA-core kernels, which write the fp32
``[tokens, out]`` product; a second kernel reads it and the base output and writes the sum. In the backward it
writes ``g.float() · s`` as another fp32 ``[tokens, out]`` tensor, read by two more fp32 matmuls. Per element of
the output that is 12 bytes moved in the forward and 14 in the backward where 4 and 4 would do.

This op computes the same values from the same inputs, in one kernel each way:

    out    = (base + s · (a @ Bᵀ)).to(base.dtype)     fp32 sums, one rounding (as eager's fp32 sum and cast)
                                                       (QLoRA: peft's bitsandbytes layers round s · (a @ Bᵀ)
                                                       to the base dtype first, then add: so does the op)
    dbase  = g                                         (the cast's and the sum's backward: exact)
    da     = s · (g @ B)                               g read in its own dtype, fp32 sums
    dB     = s · (gᵀ @ a)

With the Triton path (``fuser.kernels.upcast_linear``'s kernels and launch configurations: ≤ 64-rank fp32 adapters, a
half ``base``, on a GPU or through the interpreter; the ops' ``allow_triton=False`` switches it off, and the pattern
passes ``FuserConfig.experimental.upcast_linear.triton``, the switch of the kernels it shares) nothing of size
``[tokens, out]`` is written in fp32. Elsewhere it computes exactly what the graph computed (the reference path).
It saves ``a`` and ``B`` (what eager saves). Eager multiplies ``g`` by ``s`` before its two matmuls; the kernels
multiply the fp32 sums by ``s`` after them: the same value within fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuser._dtypes import FLOAT_DTYPES, HALF_DTYPES
from fuser.kernels import upcast_linear as U
from fuser.kernels._triton import as_rows, check_floating, check_linear, out_rows


def _check(base: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
    check_floating("lora_sum", base=base, a=a, weight=weight)
    if weight.dim() != 2 or a.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fuser: lora_sum expects weight [out, rank] with rank = a.shape[-1] = {a.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if tuple(base.shape) != (*a.shape[:-1], weight.shape[0]):
        raise ValueError(
            f"fuser: lora_sum expects base of shape {(*a.shape[:-1], weight.shape[0])} (a's rows × weight's "
            f"outputs), got {tuple(base.shape)}"
        )


def triton_path(
    base: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    base_dtypes: tuple[torch.dtype, ...] = HALF_DTYPES,
    allow_triton: bool = True,
) -> bool:
    """The Triton kernels: an adapter (≤ 64 rank) and input both fp32, or both of one half dtype (autocast's rounded
    copies), a bf16/fp16 base, where Triton runs and ``allow_triton``. The gradients' kernels read ``g`` (in
    ``base``'s place) in its own dtype, at fp32 accuracy: half or fp32."""
    return (
        U.triton_enabled(base, allow_triton)
        and weight.dtype == a.dtype
        and a.dtype in (torch.float32, *HALF_DTYPES)
        and base.dtype in base_dtypes
        and 0 < weight.shape[1] <= U.TRITON_MAX_OUT
    )


def _graph_sum(
    base: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, scale: float, round_term: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The reference path: what peft's graph computes, op by op, the sum cast to ``dtype`` (``round_term``: its
    bitsandbytes layers' order, the term rounded to the base's dtype and added in it). A half adapter (autocast's
    rounded copy) is multiplied in fp32, as the kernels do: exact products, fp32 sums."""
    term = F.linear(a.to(torch.float32), weight.to(torch.float32)) * scale
    if round_term:
        return base + term.to(base.dtype)
    return (base + term).to(dtype)


@torch.library.custom_op("fuser::lora_sum", mutates_args=())
def lora_sum_op(
    base: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
    round_term: bool = False,
    out_dtype: torch.dtype | None = None,
    allow_triton: bool = True,
) -> torch.Tensor:
    """``out_dtype`` (not with ``round_term``): the sum's dtype instead of the base's: fp32 where the sum feeds a
    residual add that rounds once (``(h + sum).to(bf16)``), as Inductor computes peft's cast fused into the add;
    half with an fp32 ``base`` (``fuser::linear_wide``'s): the sum of the unrounded base, rounded once.
    ``allow_triton``: whether the Triton kernels may run (forward and backward)."""
    _check(base, a, weight)
    dtype = base.dtype if out_dtype is None else out_dtype
    # an fp32 base (``fuser::linear_wide``'s unrounded output) summed into a half result: the same kernel
    base_dtypes = FLOAT_DTYPES if dtype in HALF_DTYPES else HALF_DTYPES
    if triton_path(base, a, weight, base_dtypes=base_dtypes, allow_triton=allow_triton):
        # a @ Bᵀ: the dx kernel's ``dy @ W`` with W = Bᵀ (a strided view), base and scale in its epilogue
        rows = as_rows(base).contiguous()
        return U._dx_triton(a, weight.t(), dtype, rows, scale, round_term).view(base.shape)
    return _graph_sum(base, a, weight, scale, round_term, dtype)


@lora_sum_op.register_fake
def _(base, a, weight, scale, round_term=False, out_dtype=None, allow_triton=True):
    return torch.empty_like(base, dtype=base.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("fuser::lora_sum_grads", mutates_args=())
def lora_sum_grads(
    g: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
    need_a: bool,
    need_w: bool,
    allow_triton: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da in a's dtype, dB in B's dtype), each 0-element where not asked for; ``g`` is read in its own dtype
    (half, or fp32 where the consumer's backward kept it unrounded)."""
    if triton_path(g, a, weight, base_dtypes=FLOAT_DTYPES, allow_triton=allow_triton):
        # s · (g @ B): the forward kernel's x @ Wᵀ with x = g, W = Bᵀ; fp32 sums, rounded once to a half ``a``
        da = U._forward_triton(g, weight.t(), scale).to(a.dtype) if need_a else a.new_empty(0)
        # s · (aᵀ @ g)ᵀ: the weight-gradient kernel's dyᵀ @ x with dy = a, x = g
        dw = U._dw_triton(a, g, scale, transposed=True).to(weight.dtype) if need_w else weight.new_empty(0)
        return da, dw
    da, dw = a.new_empty(0), weight.new_empty(0)
    # eager: the cast's backward, then the product's; a half adapter's in fp32, as the kernels compute it
    wide = weight.to(torch.float32)
    d = g.to(wide.dtype) * scale
    if need_a:
        da = (d @ wide).to(a.dtype)
    if need_w:
        dw = (d.reshape(-1, d.shape[-1]).t() @ a.reshape(-1, a.shape[-1]).to(wide.dtype)).to(weight.dtype)
    return da, dw


@lora_sum_grads.register_fake
def _(g, a, weight, scale, need_a, need_w, allow_triton=True):
    da = a.new_empty(a.shape) if need_a else a.new_empty(0)
    return da, weight.new_empty(weight.shape) if need_w else weight.new_empty(0)


def _setup_context(ctx, inputs, output, allow_triton_at: int = 6):
    base, a, weight, scale = inputs[:4]  # round_term is absent from ``inputs`` when left at its default
    ctx.save_for_backward(a, weight)
    ctx.scale = scale
    ctx.base_dtype = base.dtype
    ctx.allow_triton = inputs[allow_triton_at] if len(inputs) > allow_triton_at else True
    ctx.n_inputs = len(inputs)


def _backward(ctx, g):
    a, weight = ctx.saved_tensors
    # an fp32 sum (out_dtype, lora_sum_wide's fp32 result) receives an fp32 gradient: the adapter's gradients are
    # computed from it unrounded, as Inductor computes them from the consumer's fused backward; the base's is
    # rounded to its dtype
    need_base, need_a, need_w = ctx.needs_input_grad[:3]
    da = dw = None
    if need_a or need_w:
        da, dw = torch.ops.fuser.lora_sum_grads(g, a, weight, ctx.scale, need_a, need_w, ctx.allow_triton)
    dbase = g.to(ctx.base_dtype) if need_base else None
    return dbase, (da if need_a else None), (dw if need_w else None), *[None] * (ctx.n_inputs - 3)


def _summed(g: torch.Tensor | None, g_wide: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient of lora_sum_wide's sum: its rounded result's (half) plus its fp32 result's (fp32)."""
    if g is None or g_wide is None:
        return g_wide if g is None else g
    return g_wide + g


lora_sum_op.register_autograd(_backward, setup_context=_setup_context)


def _wide_sum_into(base, a, weight, scale, allow_triton, out, wide) -> None:
    """``fuser::lora_sum_wide(base, a, weight, scale, allow_triton)`` on ``[rows, n]`` views, written into ``out``
    (base's dtype) and ``wide`` (fp32): the same kernel or the same reference ops."""
    if triton_path(base, a, weight, allow_triton=allow_triton):
        U._dx_triton(a, weight.t(), base.dtype, base.contiguous(), scale, False, out=out, wide_out=wide)
        return
    wide.copy_(_graph_sum(base, a, weight, scale, False, torch.float32))
    out.copy_(wide)


@torch.library.custom_op("fuser::lora_sum_wide", mutates_args=())
def lora_sum_wide_op(
    base: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, scale: float, allow_triton: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, wide)``: ``out`` is ``fuser::lora_sum``'s (the rounded sum, the differentiable result), ``wide`` the
    same sum before its rounding, in fp32 (differentiable too: its gradient is added to ``out``'s, in fp32).

    peft's sum ``base + s · lora`` rounds away a LoRA term smaller than half a bf16 ulp of ``base`` (B starts at
    zero, so early in training every term is): a bf16 base is exact in bf16, so the rounded sum is the base
    itself. Inductor fuses peft's ``.to(bf16)`` into the kernel that consumes the sum and computes from the fp32
    value. A gated activation fed this op computes its product from ``wide`` the same way, and saves ``out``.
    """
    _check(base, a, weight)
    out = U._alloc(*base.shape, dtype=base.dtype, device=base.device)
    wide = torch.empty(base.shape, dtype=torch.float32, device=base.device)
    _wide_sum_into(as_rows(base), as_rows(a), weight, scale, allow_triton, out_rows(out), out_rows(wide))
    return out, wide


@lora_sum_wide_op.register_fake
def _(base, a, weight, scale, allow_triton=True):
    return torch.empty_like(base), torch.empty_like(base, dtype=torch.float32)


def _setup_context_wide(ctx, inputs, output):
    _setup_context(ctx, inputs, output, allow_triton_at=4)
    ctx.set_materialize_grads(False)


def _backward_wide(ctx, g, g_wide):
    g = _summed(g, g_wide)
    if g is None:
        return (None,) * ctx.n_inputs
    return _backward(ctx, g)


lora_sum_wide_op.register_autograd(_backward_wide, setup_context=_setup_context_wide)


def lora_sum(
    base: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
    *,
    round_term: bool = False,
    allow_triton: bool = True,
) -> torch.Tensor:
    """``(base + F.linear(a, weight) * scale).to(base.dtype)``: peft's LoRA output, fused (see the module doc).
    ``round_term=True``: ``base + (F.linear(a, weight) * scale).to(base.dtype)``, the order of peft's
    bitsandbytes (QLoRA) layers; the gradients are the same functions of ``g``. ``allow_triton=False``: the
    reference path (cuBLAS's fp32 matmuls) where the Triton kernels would run."""
    return torch.ops.fuser.lora_sum(base, a, weight, float(scale), round_term, allow_triton=allow_triton)


def _wide_matmul(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weightᵀ`` in fp32, from half operands: cuBLAS's fp32 accumulator written as it is (``out_dtype``) on a
    GPU; elsewhere the operands upcast (exact) and multiplied in fp32."""
    if x2.is_cuda and x2.dtype in HALF_DTYPES:
        return torch.mm(x2, weight.t(), out_dtype=torch.float32)
    return x2.to(torch.float32) @ weight.to(torch.float32).t()


@torch.library.custom_op("fuser::linear_wide", mutates_args=())
def linear_wide_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of half operands, returned in fp32 before its rounding: the base output a
    LoRA sum adds its term to (``fuser::lora_sum`` with an fp32 base rounds the sum once). Rounding the base
    first and the sum again erases a LoRA term below half an ulp entirely: a rounded base is on the half grid,
    so the second rounding returns it. The gradients are the linear's, from the gradient rounded to
    ``x``'s dtype (what the rounded output's gradient was)."""
    check_floating("linear_wide", x=x, weight=weight, bias=bias)
    check_linear("linear_wide", "x", x, weight, bias)
    if weight.dtype != x.dtype:
        raise ValueError(f"fuser: linear_wide expects a weight of x's dtype {x.dtype}, got {weight.dtype}")
    y = _wide_matmul(as_rows(x), weight)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.view(*x.shape[:-1], weight.shape[0])


@linear_wide_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


def _setup_context_linear_wide(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
    ctx.bias_dtype = inputs[2].dtype if len(inputs) > 2 and inputs[2] is not None else None


def _backward_linear_wide(ctx, g):
    x, weight = ctx.saved_tensors
    need = (*ctx.needs_input_grad, False, False)[:3]
    half = g.to(weight.dtype)
    dx = half @ weight if need[0] else None
    dw = half.reshape(-1, half.shape[-1]).t() @ as_rows(x) if need[1] else None
    db = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype) if need[2] else None
    return (dx, dw, db)[: len(ctx.needs_input_grad)]


linear_wide_op.register_autograd(_backward_linear_wide, setup_context=_setup_context_linear_wide)


# ---------------------------------------------------------------------------------------------------------
# The gated activation of two wide sums, in row slices: never differentiated, put in place by a post-grad pass
# ---------------------------------------------------------------------------------------------------------

# the most bytes each fp32 sum of ``fuser::gated_activation_of_lora_sums`` takes at once: a batch a few times this
# size runs in a few slices, a long sequence in more, where the whole sums would each be [tokens, intermediate] fp32
WIDE_SLICE_BYTES = 256 << 20


@torch.library.custom_op("fuser::gated_activation_of_lora_sums", mutates_args=())
def gated_activation_of_lora_sums_op(
    gate_base: torch.Tensor,
    gate_a: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_scale: float,
    gate_allow_triton: bool,
    up_base: torch.Tensor,
    up_a: torch.Tensor,
    up_weight: torch.Tensor,
    up_scale: float,
    up_allow_triton: bool,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, gate_sum, up_sum)``: what ``fuser::lora_sum_wide`` of gate's and of up's terms, then
    ``fuser::gated_activation(gate_sum, up_sum, ..., gate_wide=, up_wide=)[0]`` compute, with the same kernels,
    over row slices of at most ``WIDE_SLICE_BYTES`` bytes per fp32 sum: two such slices live at a time instead of two
    whole ``[tokens, intermediate]`` fp32 sums. Each element is computed as by the three calls (the kernels are
    elementwise across rows), so the results are theirs bit for bit.

    Never called by autograd: the post-grad pass ``gated_sums_in_slices`` (:mod:`fuser.patterns.lora_sum`) puts it
    in place of those three calls in compiled forward graphs and in the recomputation of checkpointed layers."""
    from fuser.kernels.gated_activation import gated_activation_forward

    _check(gate_base, gate_a, gate_weight)
    _check(up_base, up_a, up_weight)
    if gate_base.shape != up_base.shape or gate_base.dtype != up_base.dtype:
        raise ValueError(
            f"fuser: gated_activation_of_lora_sums expects gate and up bases of one shape and dtype, got "
            f"{gate_base.dtype} {tuple(gate_base.shape)} and {up_base.dtype} {tuple(up_base.shape)}"
        )
    out, gate_sum, up_sum = (
        U._alloc(*gate_base.shape, dtype=gate_base.dtype, device=gate_base.device) for _ in range(3)
    )
    bases, adapters = (as_rows(gate_base), as_rows(up_base)), (as_rows(gate_a), as_rows(up_a))
    sums, out2 = (gate_sum.view(bases[0].shape), up_sum.view(bases[1].shape)), out.view(bases[0].shape)
    n_rows, n_cols = bases[0].shape
    step = max(1, WIDE_SLICE_BYTES // max(1, 4 * n_cols))
    wide = U._alloc(2, min(step, n_rows), n_cols, dtype=torch.float32, device=gate_base.device)
    terms = ((gate_weight, gate_scale, gate_allow_triton), (up_weight, up_scale, up_allow_triton))
    for start in range(0, n_rows, step):
        rows, n = slice(start, min(start + step, n_rows)), min(step, n_rows - start)
        for i, (weight, scale, allow) in enumerate(terms):
            _wide_sum_into(bases[i][rows], adapters[i][rows], weight, scale, allow, sums[i][rows], wide[i, :n])
        gated_activation_forward(wide[0, :n], wide[1, :n], activation, out=out2[rows])
    return out, gate_sum, up_sum


@gated_activation_of_lora_sums_op.register_fake
def _(gate_base, gate_a, gate_weight, gate_scale, gate_allow_triton, up_base, up_a, up_weight, up_scale,
      up_allow_triton, activation):  # fmt: skip
    return tuple(gate_base.new_empty(gate_base.shape) for _ in range(3))
