"""lm_head + cross-entropy as one op that never holds the ``[tokens, vocab]`` logits, forward and backward.

    x      = hidden @ weight.T (+ bias)                   the lm_head, rounded to the input dtype as eager's is
    y      = logit_scale · x                              Cohere multiplies, Granite divides (scale = 1/s)
    z      = softcap · tanh(y / softcap)                  Gemma-2's final-logit softcapping (softcap 0: z = y)
    loss_t = logsumexp(z_t) − z_t[label_t]                0 for rows whose label is ``ignore_index``
    loss   = Σ loss_t / n_valid  ("mean";  NaN when every row is ignored, as PyTorch)   or  Σ loss_t  ("sum")

Gradients, per row (fp32): ``dL/dx_t = c · (softmax(z_t) − onehot(label_t)) · (1 − tanh²(y_t/softcap)) ·
logit_scale`` with ``c = 1/n_valid`` (mean; 0 when n_valid is 0, so an all-ignored batch gets zero gradients as
in PyTorch) or 1 (sum), and 0 for ignored rows. For fp16 inputs ``c`` is applied in the backward together with
``grad_output`` instead: ``c · (softmax − onehot) ~ 1/T`` would fall into fp16's subnormal range before a
GradScaler's factor could lift it (bf16 has fp32's exponent range and keeps ``c`` in the forward). Then
``dhidden = G @ W``, ``dweight = Gᵀ @ hidden``, ``dbias = Σ_t G``.

How (``_forward_chunked``): the rows are processed in chunks whose logits fit a budget (:func:`logits_budget`: at
most 1 GiB and a quarter of the whole logits; :func:`chunk_rows`, a function of the shapes only: the fewest chunks
that fit, of near-equal size). Per chunk: one tensor-core matmul writes
the chunk's logits in the input dtype; one Triton kernel (one program per row) computes each row's log-sum-exp online
over the vocabulary, the row's loss, and then overwrites the logits with the row's gradient (in the input dtype, as
eager's bf16 logits gradient is); two more matmuls turn that into the chunk's rows of ``dhidden`` and add its share of
``dweight`` (skipped for a frozen weight, e.g. under LoRA: a third of the FLOPs). The gradients are thus formed in the
forward (as Liger-Kernel does) rather than by recomputing the logits in the backward, which would cost 8·T·H·V FLOPs
instead of 6. The backward only multiplies them by ``grad_output`` (eagerly: in place, in a Triton kernel that skips
the pass when ``grad_output`` is 1, decided on the device). No host synchronisation: ``n_valid`` stays on the device.

The weight gradient is accumulated over the chunks in the weight's dtype (``dw_accumulator="input"``, the default: no
extra memory, one rounding of the running sum per chunk) or in fp32 (``"fp32"``: one extra ``[V, H]`` fp32 buffer during
the forward); the bf16 running sum's error was measured close to the fp32 one's, and the fp32 sum slower
(``docs/defaults.md``, ``experimental.linear_cross_entropy.dw_accumulator``). ``dw_kernel="triton"`` adds each chunk's
share with a Triton kernel that reads the running sum's tile before its matmul instead of after it, as cuBLAS's
``addmm_`` does (half-precision accumulator only); it measured slower than cuBLAS at every shape, so it stays off, kept
as a measured alternative (``docs/defaults.md``, ``experimental.linear_cross_entropy.dw_kernel``). With ``streams=True``
(the default) the weight gradient's accumulation runs on a second CUDA stream, beside the ``dhidden`` matmul.

These three are arguments of the op (and keywords of :func:`linear_cross_entropy`); the ``linear_cross_entropy``
pattern passes ``FuserConfig.experimental.linear_cross_entropy``'s values.

Labels outside ``[0, V)`` that are not ``ignore_index``: on CPU the op raises what ``F.cross_entropy`` raises
there (``IndexError: Target 256 is out of bounds.``), after a host check of the labels. On a GPU it does not
check (that would synchronise; eager's CUDA kernel fails with a device-side assert): such a row's loss is NaN,
hence the mean or sum is NaN, its gradient ``c · softmax`` without the one-hot term, and the kernel never reads
outside the row (the label's gather is masked).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from fuser._dtypes import HALF_DTYPES
from fuser.kernels._triton import (
    HAS_TRITON,
    as_rows,
    cdiv,
    check_floating,
    check_linear,
    compute_dtype,
    launchable,
    next_power_of_2,
    tl,
    triton,
    triton_runs,
    use_triton,
)

REDUCTIONS = ("mean", "sum")
# the budget for one chunk's logits, which are the op's extra memory (with the returned gradients excluded): at most
# 1 GiB, and at most a quarter of the whole [T, V] logits, which are Inductor's extra at the same shape. Larger
# chunks are faster (fewer passes over the [V, H] weight gradient) up to that budget (docs/notes/kernels.md)
LOGITS_BUDGET_BYTES = 1023 << 20
LOGITS_SHARE = 4  # a chunk's logits hold at most 1/LOGITS_SHARE of the whole logits
# how the weight gradient's running sum over the chunks is kept, and which kernel adds each chunk's share to it
DwAccumulator = Literal["input", "fp32"]
DwKernel = Literal["cublas", "triton"]
DW_ACCUMULATORS: tuple[str, ...] = get_args(DwAccumulator)
DW_KERNELS: tuple[str, ...] = get_args(DwKernel)


@dataclass(frozen=True)
class CrossEntropy:
    """The loss's own parameters, as the op's arguments give them (module docstring): rows labelled
    ``ignore_index`` count for nothing, ``reduction`` is ``"mean"`` or ``"sum"``, ``softcap`` 0 is none."""

    ignore_index: int
    reduction: str
    logit_scale: float
    softcap: float


@dataclass(frozen=True)
class GradsWanted:
    """Which gradients the forward forms on its way: hidden's, the weight's, the bias's."""

    hidden: bool
    weight: bool
    bias: bool


@dataclass(frozen=True)
class DweightOptions:
    """How the weight gradient is accumulated over the chunks (module docstring): ``kernel`` (``dw_kernel``),
    ``accumulator`` (``dw_accumulator``), and ``streams``."""

    kernel: str = "cublas"
    accumulator: str = "input"
    streams: bool = True


def logits_budget(n_rows: int, vocab: int, itemsize: int) -> int:
    """Bytes one chunk's logits may take: ``LOGITS_BUDGET_BYTES`` or a ``1/LOGITS_SHARE`` share of the whole logits,
    whichever is smaller."""
    return min(LOGITS_BUDGET_BYTES, n_rows * vocab * itemsize // LOGITS_SHARE)


def chunk_rows(n_rows: int, vocab: int, itemsize: int, budget: int | None = None) -> int:
    """Rows per chunk: the fewest chunks whose logits each fit ``budget`` bytes (default :func:`logits_budget`),
    split as evenly as a multiple of 8 rows allows; never below 64 rows (one tensor-core tile), even over budget.

    Even, not "as many as fit, then the rest" (the same number of chunks): every chunk costs one read and write of the
    whole ``[V, H]`` weight gradient, so a small tail chunk would pay that pass for a sliver of rows, at low matmul
    efficiency (8200 rows at V = 256000: 16 chunks of 488 and one of 392, not 16 of 512 and one of 8). Multiples of
    8 keep the matmuls' K (the weight gradient's) 16-byte aligned.
    """
    budget = logits_budget(n_rows, vocab, itemsize) if budget is None else budget
    most = max(64, budget // max(1, vocab * itemsize) // 8 * 8)
    if n_rows <= most:
        return max(1, n_rows)
    n_chunks = -(-n_rows // most)
    even = -(-n_rows // n_chunks)
    return min(most, -(-even // 8) * 8)


def dweight_accumulator(weight: torch.Tensor, choice: str = "input") -> str:
    """The accumulator ``choice`` (``"input"``: the weight's dtype, the default | ``"fp32"``) takes for ``weight``:
    an fp32 weight accumulates in fp32 either way (``"input"``)."""
    return choice if weight.dtype in HALF_DTYPES else "input"


def _check(hidden, weight, bias, labels, reduction, dw_kernel="cublas", dw_accumulator="input") -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"fuser: linear_cross_entropy reduction must be 'mean' or 'sum', got {reduction!r}")
    if dw_kernel not in DW_KERNELS:
        raise ValueError(f"fuser: linear_cross_entropy dw_kernel must be one of {DW_KERNELS}, got {dw_kernel!r}")
    if dw_accumulator not in DW_ACCUMULATORS:
        raise ValueError(
            f"fuser: linear_cross_entropy dw_accumulator must be one of {DW_ACCUMULATORS}, got {dw_accumulator!r}"
        )
    check_floating("linear_cross_entropy", hidden=hidden, weight=weight, bias=bias)
    check_linear("linear_cross_entropy", "hidden", hidden, weight, bias, dims=("V", "H"))
    n_rows = hidden.numel() // max(1, hidden.shape[-1])
    if labels.numel() != n_rows:
        raise ValueError(
            f"fuser: linear_cross_entropy expects one label per row of hidden ({n_rows}), got {labels.numel()}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"fuser: linear_cross_entropy expects integer labels, got {labels.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"fuser: linear_cross_entropy expects hidden and weight of one dtype, got {hidden.dtype} and "
            f"{weight.dtype}; cast first"
        )


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """On CPU, raise eager's ``IndexError: Target 256 is out of bounds.`` (``F.cross_entropy`` / ``nll_loss``: the
    first such label in row order) for a label outside ``[0, vocab)`` that is not ``ignore_index``.

    CPU tensors only: there the check is one pass over the labels on the host, next to the op's matmuls. On a
    GPU it would be a device-to-host synchronisation inside the op (DESIGN.md forbids it; eager's CUDA kernel
    raises a device-side assert instead): there such a row's loss is NaN, so the mean or sum is NaN, and its
    logits' gradient is ``c · softmax`` (no one-hot term; finite). The kernel masks the label's gather, so it
    never reads outside the row.
    """
    if labels.device.type != "cpu" or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]]
        raise IndexError(f"Target {int(first)} is out of bounds.")


def _grad_scale(labels: torch.Tensor, ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_valid as fp32, per-valid-row gradient scale c) as 0-dim device tensors; no host synchronisation."""
    n_valid = (labels != ignore_index).sum().to(torch.float32)
    if reduction == "sum":
        return n_valid, torch.ones((), dtype=torch.float32, device=labels.device)
    return n_valid, torch.where(n_valid > 0, 1.0 / n_valid.clamp_min(1.0), torch.zeros_like(n_valid))


def _finish_loss(loss_rows: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    total = loss_rows.sum(dtype=torch.float32)
    return total / n_valid if reduction == "mean" else total


# ---------------------------------------------------------------------------------------------------------
# Plain-torch reference of the per-chunk step (the same formulas), used on CPU and as the test oracle.
# ---------------------------------------------------------------------------------------------------------


def _reference_chunk(logits, labels, loss_rows, scale, ce: CrossEntropy, write_grad: bool) -> None:
    """What the kernel does to one chunk: loss per row into ``loss_rows``; with ``write_grad``, the gradient
    with respect to ``logits`` (scaled by the 0-dim ``scale`` for valid rows) written over ``logits``."""
    ignore_index, logit_scale, softcap = ce.ignore_index, ce.logit_scale, ce.softcap
    compute = compute_dtype(logits)
    y = logits.to(compute) * logit_scale
    t = torch.tanh(y / softcap) if softcap else None
    z = softcap * t if softcap else y
    lse = torch.logsumexp(z, dim=-1)
    vocab = z.shape[-1]
    valid = labels != ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    safe = torch.where(in_range, labels, torch.zeros_like(labels)).long()
    z_label = z.gather(1, safe[:, None])[:, 0]
    # the loss and the label's gradient from the other columns' log-sum-exp: with xr = lse_rest − z_label,
    # loss = softplus(xr) and p_label − 1 = −sigmoid(xr). Where p_label ≈ 1, lse − z_label and p_label − 1 would be
    # differences of nearly equal numbers (an fp32 loss below ~6e-8 of lse comes out as 0)
    target = (torch.arange(vocab, device=z.device)[None, :] == labels[:, None]) & in_range[:, None]
    xr = torch.logsumexp(z.masked_fill(target, float("-inf")), dim=-1) - z_label
    loss = torch.where(valid, F.softplus(xr), torch.zeros_like(lse))
    loss_rows.copy_(torch.where(valid & ~in_range, torch.full_like(loss, float("nan")), loss))
    if write_grad:
        d = torch.where(target, -torch.sigmoid(xr)[:, None], torch.exp(z - lse[:, None]))
        if softcap:
            d = d * (1.0 - t * t)
        row_scale = torch.where(valid, scale.to(compute) * logit_scale, torch.zeros((), dtype=compute))
        logits.copy_(d * row_scale[:, None])


# ---------------------------------------------------------------------------------------------------------
# Triton kernel: one chunk's loss and, optionally, its logits gradient in place
# ---------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _transform(x, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
        # (z, t): the scaled, softcapped logit in fp32 and t = tanh(y / softcap) (t = y without softcap: unused);
        # tanh via exp, as the interpreter has no libdevice.tanh
        y = x * logit_scale
        if HAS_SOFTCAP:
            t = 1.0 - 2.0 / (tl.exp(2.0 * y / softcap) + 1.0)
            z = softcap * t
        else:
            t = y
            z = y
        return z, t

    @triton.jit
    def lce_chunk_kernel(
        logits_ptr,
        labels_ptr,
        loss_ptr,
        scale_ptr,
        logits_row_stride,
        n_cols,
        ignore_index,
        logit_scale,
        softcap,
        HAS_SOFTCAP: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # fp32, also where the launcher passes fp64 (Inductor does, for inline_ops)
        logit_scale, softcap = tl.cast(logit_scale, tl.float32), tl.cast(softcap, tl.float32)
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * logits_row_stride
        label = tl.load(labels_ptr + row).to(tl.int64)
        # pass 1: log-sum-exp, online over blocks of the vocabulary (one max and one sum per block)
        # (s_rest: the same sum without the label's column)
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        s_rest = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            z, _ = _transform(x, logit_scale, softcap, HAS_SOFTCAP)
            z = tl.where(mask, z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            e = tl.exp(z - m_new)
            rescale = tl.exp(m - m_new)
            s = s * rescale + tl.sum(e, axis=0)
            s_rest = s_rest * rescale + tl.sum(tl.where(cols == label, 0.0, e), axis=0)
            m = m_new
        lse = m + tl.log(s)
        valid = label != ignore_index
        out_of_range = (label < 0) | (label >= n_cols)
        x_label = tl.load(row_ptr + label, mask=valid & (~out_of_range), other=0.0).to(tl.float32)
        z_label, _ = _transform(x_label, logit_scale, softcap, HAS_SOFTCAP)
        # loss = softplus(xr), p_label − 1 = −sigmoid(xr), xr = lse_rest − z_label: no difference of nearly equal
        # numbers where p_label ≈ 1 (lse − z_label would round a loss below ~6e-8 of lse to 0); log1p by
        # log(w)·u/(w − 1), w = 1 + u, exact to fp32 rounding without libdevice (the interpreter has none)
        xr = m + tl.log(s_rest) - z_label
        u = tl.exp(-tl.abs(xr))
        w = 1.0 + u
        softplus = tl.maximum(xr, 0.0) + tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
        label_grad = -1.0 / (1.0 + tl.exp(-xr))
        loss = tl.where(valid, softplus, 0.0)
        loss = tl.where(valid & out_of_range, float("nan"), loss)
        tl.store(loss_ptr + row, loss)
        if WRITE_GRAD:
            # pass 2: overwrite the logits with c · (softmax − onehot) · dz/dx (0 for an ignored row)
            c = tl.where(valid, tl.load(scale_ptr), 0.0)
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < n_cols
                x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                z, t = _transform(x, logit_scale, softcap, HAS_SOFTCAP)
                d = tl.where(cols == label, label_grad, tl.exp(z - lse)) * (c * logit_scale)
                if HAS_SOFTCAP:
                    d = d * (1.0 - t * t)
                tl.store(row_ptr + cols, d.to(logits_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def scale_inplace_kernel(x_ptr, n, s_ptr, BLOCK: tl.constexpr):
        # x *= s (fp32 math, one rounding), skipped on the device when s == 1: a plain loss.backward() then costs
        # no pass over the [V, H] weight gradient, and no host synchronisation decides it
        s = tl.load(s_ptr)
        if s != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def lce_dweight_kernel(
        g_ptr,
        h_ptr,
        dw_ptr,
        n_rows,
        vocab,
        hidden,
        g_row_stride,
        h_row_stride,
        FIRST: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        GROUP_V: tl.constexpr,
    ):
        # dw[v, j] (=, FIRST | +=) Σ_r g[r, v] · h[r, j] in fp32, rounded once to dw's dtype (dw [V, H] contiguous).
        # The running sum's tile is loaded before the reduction over the chunk's rows, so its read overlaps the
        # matmul instead of following it (cuBLAS's addmm_ reads it in the epilogue, after the matmul)
        pid = tl.program_id(0)
        n_v = tl.cdiv(vocab, BLOCK_V)
        n_h = tl.cdiv(hidden, BLOCK_H)
        per_group = GROUP_V * n_h  # GROUP_V vocabulary tiles in a row share h's column tiles in L2
        first_v = (pid // per_group) * GROUP_V
        group_size = tl.minimum(n_v - first_v, GROUP_V)
        pid_v = first_v + (pid % per_group) % group_size
        pid_h = (pid % per_group) // group_size
        vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        hs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        tile_ok = (vs < vocab)[:, None] & (hs < hidden)[None, :]
        dw_ptrs = dw_ptr + vs[:, None].to(tl.int64) * hidden + hs[None, :]
        if not FIRST:
            old = tl.load(dw_ptrs, mask=tile_ok, other=0.0)
        acc = tl.zeros((BLOCK_V, BLOCK_H), tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_ok = rs < n_rows
            g_t = tl.load(g_ptr + rs[None, :].to(tl.int64) * g_row_stride + vs[:, None],
                          mask=(vs < vocab)[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
            h = tl.load(h_ptr + rs[:, None].to(tl.int64) * h_row_stride + hs[None, :],
                        mask=r_ok[:, None] & (hs < hidden)[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(g_t, h, acc)
        if not FIRST:
            acc += old.to(tl.float32)
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=tile_ok)


# the weight-gradient kernel's tiles (GPU; the interpreter takes small ones): the best of the tile sweep at most of
# its shapes, still slower than cuBLAS's addmm_ (docs/notes/kernels.md)
DWEIGHT_CONFIG = {"BLOCK_V": 128, "BLOCK_H": 256, "BLOCK_R": 32, "GROUP_V": 8, "num_warps": 8, "num_stages": 4}
_CPU_DWEIGHT_CONFIG = {"BLOCK_V": 16, "BLOCK_H": 16, "BLOCK_R": 16, "GROUP_V": 2}


def dweight_kernel_enabled(dw_acc: torch.Tensor, g_t: torch.Tensor, choice: str = "cublas") -> bool:
    """With ``choice="triton"`` the weight gradient's running sum in half precision goes through
    ``lce_dweight_kernel`` instead of cuBLAS's ``addmm_`` (``"cublas"``, the default: measured faster) where
    Triton runs; an fp32 running sum stays on cuBLAS."""
    return choice == "triton" and dw_acc.dtype == g_t.dtype and g_t.dtype in HALF_DTYPES and use_triton(g_t)


def _launch_dweight(dw_acc: torch.Tensor, g_t: torch.Tensor, h_c: torch.Tensor, first: bool) -> None:
    """dw_acc (=, first | +=) g_t @ h_c, with g_t the transposed view of a chunk's [rows, V] gradient."""
    g = g_t.t()
    vocab, hidden = dw_acc.shape
    n_rows = g.shape[0]
    if g.stride(1) != 1 or h_c.stride(1) != 1 or not dw_acc.is_contiguous():
        raise ValueError("fuser: lce_dweight_kernel needs unit-stride rows of g, h and a contiguous dw")
    cfg = DWEIGHT_CONFIG if dw_acc.is_cuda else _CPU_DWEIGHT_CONFIG
    grid = (cdiv(vocab, cfg["BLOCK_V"]) * cdiv(hidden, cfg["BLOCK_H"]),)
    strides = (g.stride(0), h_c.stride(0))
    launchable(lce_dweight_kernel)[grid](g, h_c, dw_acc, n_rows, vocab, hidden, *strides, FIRST=first, **cfg)


# the loss kernel's launch on a GPU: the widest vocabulary block and the warps. A tuning table
# (benchmarks/profile_linear_cross_entropy.py sweeps it), not a user option: the kernel's results do not depend on it
# beyond fp32 summation order. The best block × warps of the sweep at every shape; a lane-sum form of the first
# pass and a dhidden split over the vocabulary were also timed in the op and dropped (docs/notes/kernels.md)
CHUNK_KERNEL_CONFIG = {"BLOCK_V": 4096, "num_warps": 8}
_CPU_CHUNK_KERNEL_CONFIG = {"BLOCK_V": 1024, "num_warps": 4}


def _launch_chunk(logits, labels, loss_rows, scale, ce: CrossEntropy, write_grad: bool) -> None:
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    cfg = CHUNK_KERNEL_CONFIG if logits.is_cuda else _CPU_CHUNK_KERNEL_CONFIG
    block_v = min(next_power_of_2(n_cols), cfg["BLOCK_V"])
    launchable(lce_chunk_kernel)[(n_rows,)](
        logits,
        labels,
        loss_rows,
        scale,
        logits.stride(0),
        n_cols,
        int(ce.ignore_index),
        float(ce.logit_scale),
        float(ce.softcap) if ce.softcap else 1.0,
        HAS_SOFTCAP=bool(ce.softcap),
        WRITE_GRAD=write_grad,
        BLOCK_V=block_v,
        num_warps=cfg["num_warps"],
    )


# ---------------------------------------------------------------------------------------------------------
# The chunked forward (gradients formed on the way), shared by the Triton and the reference path
# ---------------------------------------------------------------------------------------------------------

_ADDMM_OUT_DTYPE_OK: dict[torch.device, bool] = {}


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for half-precision a, b: one cuBLAS call with an fp32 output where torch has it."""
    if acc.is_cuda and _ADDMM_OUT_DTYPE_OK.get(acc.device, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _ADDMM_OUT_DTYPE_OK[acc.device] = True
            return
        except (RuntimeError, TypeError):
            _ADDMM_OUT_DTYPE_OK[acc.device] = False
    acc.add_(torch.mm(a, b))


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device, enabled: bool = True) -> torch.cuda.Stream | None:
    """A second CUDA stream for the weight-gradient matmul (``enabled=False``, the op's ``streams=False``: none)."""
    if device.type != "cuda" or not enabled:
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _accumulate_dweight(
    dw_acc: torch.Tensor, g_t: torch.Tensor, h_c: torch.Tensor, first: bool, triton_kernel: bool = False
) -> None:
    """dw_acc (=, first chunk | +=) g_t @ h_c, in dw_acc's dtype (the weight's or fp32); ``triton_kernel``: through
    ``lce_dweight_kernel`` (decided once per call by :func:`dweight_kernel_enabled`)."""
    if triton_kernel:
        _launch_dweight(dw_acc, g_t, h_c, first)
        return
    if dw_acc.dtype == g_t.dtype:
        if first:
            torch.mm(g_t, h_c, out=dw_acc)
        else:
            dw_acc.addmm_(g_t, h_c)
        return
    if first:
        dw_acc.zero_()
    _accumulate_fp32(dw_acc, g_t, h_c)


def _chunk_logits(h_c: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, buffer: torch.Tensor):
    """A chunk's logits, h_c @ weight_t (+ bias), written into the first rows of ``buffer``; returns them."""
    logits = buffer[: h_c.shape[0]]
    if bias is not None:
        torch.addmm(bias, h_c, weight_t, out=logits)
    else:
        torch.mm(h_c, weight_t, out=logits)
    return logits


def _forward_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ce: CrossEntropy,
    wanted: GradsWanted,
    dw_options: DweightOptions,
    triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's results (:func:`linear_cross_entropy_op`), chunk by chunk; ``triton_path``: each chunk's loss and
    gradient by the Triton kernel, else by the reference."""
    h2 = as_rows(hidden)
    labels1 = labels.reshape(-1)
    labels1 = labels1 if labels1.stride(0) == 1 else labels1.contiguous()  # the kernel reads labels at unit stride
    n_rows, vocab = h2.shape[0], weight.shape[0]
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=h2.device)
    write_grad = wanted.hidden or wanted.weight or wanted.bias
    dh = torch.empty_like(h2) if wanted.hidden else h2.new_empty(0)
    accumulator = dweight_accumulator(weight, dw_options.accumulator)
    dw_acc = None
    if wanted.weight:
        # the first chunk writes it (no zero fill, no read of zeros); the later ones add to it
        dw_acc = torch.empty(weight.shape, dtype=torch.float32 if accumulator == "fp32" else weight.dtype,
                             device=weight.device)  # fmt: skip
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=h2.device) if wanted.bias else None
    rows = chunk_rows(n_rows, vocab, h2.element_size())
    buffer = torch.empty(min(rows, n_rows), vocab, dtype=h2.dtype, device=h2.device)
    triton_dw = wanted.weight and dweight_kernel_enabled(dw_acc, buffer, dw_options.kernel)
    weight_t = weight.t()
    # The first chunk's matmul is queued before the labels' count and the gradient scale: those are a few tiny
    # kernels whose host time, queued first, left the GPU idle before the matmul (docs/notes/kernels.md); queued
    # after it, they run behind it.
    if n_rows:
        _chunk_logits(h2[:rows], weight_t, bias, buffer)
    n_valid, scale = _grad_scale(labels1, ce.ignore_index, ce.reduction)
    # fp16: c · (softmax − onehot) with c = 1/n_valid would sit in fp16's subnormal range (a GradScaler multiplies
    # only afterwards), so fp16 gradients are formed unnormalised and c joins grad_output in the backward
    ones = torch.ones_like(scale)
    scale, late_scale = (ones, scale) if h2.dtype == torch.float16 else (scale, ones)
    chunk_step = _launch_chunk if triton_path else _reference_chunk  # a chunk's loss and gradient, alike
    # dhidden and dweight both only read a chunk's gradient: with a side stream the weight gradient's memory-bound
    # accumulation overlaps the compute-bound dhidden matmul (no extra memory); the next chunk waits for both
    # before it overwrites the buffer
    side = _side_stream(h2.device, dw_options.streams) if wanted.weight and wanted.hidden else None
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        h_c = h2[start:end]
        logits = _chunk_logits(h_c, weight_t, bias, buffer) if start else buffer[: end - start]
        chunk_step(logits, labels1[start:end], loss_rows[start:end], scale, ce, write_grad)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(h2.device))
        if wanted.weight:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _accumulate_dweight(dw_acc, logits.t(), h_c, first=start == 0, triton_kernel=triton_dw)
        if wanted.hidden:
            torch.mm(logits, weight, out=dh[start:end])
        if side is not None:
            torch.cuda.current_stream(h2.device).wait_stream(side)
        if wanted.bias:
            db_acc += logits.sum(0, dtype=torch.float32)
    del buffer
    if wanted.weight and n_rows == 0:
        dw_acc.zero_()
    loss = _finish_loss(loss_rows, n_valid, ce.reduction)
    # distinct 0-element tensors for the gradients not formed: a custom op's outputs must not alias
    dw = dw_acc.to(weight.dtype) if wanted.weight else h2.new_empty(0)
    db = db_acc.to(bias.dtype) if wanted.bias else h2.new_empty(0)
    return loss, dh.view(hidden.shape) if wanted.hidden else dh, dw, db, late_scale


# ---------------------------------------------------------------------------------------------------------
# The custom op and its autograd
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    logit_scale: float,
    softcap: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    dw_kernel: str = "cublas",
    dw_accumulator: str = "input",
    streams: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dhidden, dweight, dbias, grad_scale): the gradients for grad_output = 1 once multiplied by the fp32
    0-dim ``grad_scale`` (1, except for fp16: 1/n_valid under "mean"), 0-element where not asked for.
    ``dw_kernel``, ``dw_accumulator``, ``streams``: how the weight gradient is accumulated (module docstring)."""
    _check(hidden, weight, bias, labels, reduction, dw_kernel, dw_accumulator)
    _check_label_range(labels, weight.shape[0], ignore_index)
    ce = CrossEntropy(ignore_index, reduction, logit_scale, softcap)
    wanted = GradsWanted(grad_hidden, grad_weight, grad_bias and bias is not None)
    dw_options = DweightOptions(dw_kernel, dw_accumulator, streams)
    return _forward_chunked(hidden, weight, bias, labels, ce, wanted, dw_options, triton_runs(hidden))


@linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, reduction, logit_scale, softcap, grad_hidden, grad_weight, grad_bias,
      dw_kernel="cublas", dw_accumulator="input", streams=True):  # fmt: skip
    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if grad_bias and bias is not None else hidden.new_empty(0),
        hidden.new_empty((), dtype=torch.float32),
    )


def _scale_inplace(g: torch.Tensor, s: torch.Tensor) -> None:
    """g *= s for a contiguous gradient buffer and a 0-dim fp32 device scalar; nothing is written when s == 1."""
    block = 4096 if g.is_cuda else 1024
    launchable(scale_inplace_kernel)[(cdiv(g.numel(), block),)](g, g.numel(), s.reshape(1), BLOCK=block, num_warps=4)


def _setup_context(ctx, inputs, output):
    _, dh, dw, db, grad_scale = output
    ctx.save_for_backward(dh, dw, db, grad_scale)
    ctx.flags = inputs[8:11]
    ctx.has_bias = inputs[2] is not None
    ctx.n_inputs = len(inputs)  # the weight-gradient choices may be absent when left at their defaults
    ctx.mark_non_differentiable(dh, dw, db, grad_scale)
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, _ddh, _ddw, _ddb, _dscale):
    dh, dw, db, grad_scale = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = ctx.flags
    needs = ctx.needs_input_grad
    for i, (need, formed) in enumerate(((needs[0], grad_hidden), (needs[1], grad_weight),
                                         (needs[2], grad_bias and ctx.has_bias))):  # fmt: skip
        if need and not formed:
            name = ("hidden", "weight", "bias")[i]
            raise RuntimeError(
                f"fuser: linear_cross_entropy was called with grad_{name}=False but autograd asks for its gradient"
            )
    rest = (None,) * (ctx.n_inputs - 3)  # no gradient for labels and the scalar arguments
    if dloss is None:
        return (None,) * ctx.n_inputs
    dloss = dloss * grad_scale

    grads = ((dh, needs[0]), (dw, needs[1]), (db, needs[2]))
    if all(type(g) is torch.Tensor for g, _ in grads):
        # Eagerly: in place, in one vectorised pass. The gradients are this op's own buffers, used nowhere else;
        # a second [V, H] weight gradient would double the op's memory here, and the generic mul_ with a 0-dim
        # CUDA tensor of another dtype takes several times its bytes' time (docs/notes/kernels.md).
        wanted = [g for g, need in grads if need and g.numel()]
        if wanted and all(triton_runs(g) and g.is_contiguous() for g in wanted):
            for g in wanted:
                _scale_inplace(g, dloss)
        elif wanted:
            torch._foreach_mul_(wanted, dloss)
        return *(g if need else None for g, need in grads), *rest
    # Traced (AOT autograd: functional tensor subclasses): out of place, as AOT rejects mutating a saved tensor in
    # backward; Inductor reuses the saved buffer anyway. A 0-dim fp32 grad_output: computed in fp32, rounded once.
    return *(g * dloss if need else None for g, need in grads), *rest


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | float | int | None = None,
    dw_kernel: DwKernel = "cublas",
    dw_accumulator: DwAccumulator = "input",
    streams: bool = True,
) -> torch.Tensor:
    """``cross_entropy(softcap(logit_scale · (hidden @ weight.T + bias)).float(), labels)`` without the logits.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` one integer per row of ``hidden`` (already
    shifted for causal LM). ``num_items_in_batch`` (gradient accumulation, as transformers passes it) gives
    ``sum / num_items_in_batch`` and overrides ``reduction``. The loss is fp32; gradients reach hidden, weight
    and bias through autograd (the weight's is skipped when it does not require grad). ``dw_kernel``,
    ``dw_accumulator`` and ``streams`` choose how the weight gradient is accumulated (see the module docstring;
    why the defaults: ``docs/defaults.md``).
    """
    if num_items_in_batch is not None:
        reduction = "sum"
    grad = torch.is_grad_enabled()
    loss = torch.ops.fuser.linear_cross_entropy(
        hidden,
        weight,
        bias,
        labels,
        int(ignore_index),
        reduction,
        1.0 if logit_scale is None else float(logit_scale),
        0.0 if not softcap else float(softcap),
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
        dw_kernel,
        dw_accumulator,
        streams,
    )[0]
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss
