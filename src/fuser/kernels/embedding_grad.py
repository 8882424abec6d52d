"""An embedding's weight gradient, with the other gradient of a tied weight added, as one op.

The backward of ``embedding(ids, W)`` is a scatter-add of the output gradient's rows into ``[V, H]``. After AOT
autograd and Inductor's decompositions the backward graph writes it as

    acc  = zeros([V, H], fp32)                              (Inductor: a kernel writing 4·V·H bytes)
    acc  = index_put(acc, [ids], values, accumulate=True)   (masked rows: padding_idx, out-of-range ids)
    grad = acc.to(W.dtype)
    grad = W_other_grad * s + grad                          (tied lm_head: its gradient, scaled; a kernel reading
                                                            acc in fp32 and the lm_head's gradient)

That is three kernels, each moving a whole ``[V, H]`` buffer, although only the rows of the ids in the batch (at
most one per token) receive anything. This op computes the same values:

    out[v] = round(base[v] · s + Σ_{t: ids[t] = v, valid[t]} values[t])    (base, s: optional; fp32 sums, one
                                                                            rounding to out's dtype, as Inductor's
                                                                            fused kernel rounds)

in one pass over ``[V, H]`` that reads ``base`` (where given) and writes ``out``: the ids are sorted (stably: each
row's terms are summed in token order, as CPU's sequential scatter sums them, and the same every run, unlike the
GPU scatter's atomics), and each row reads its own terms. The fp32 ``[V, H]`` buffer is never written.
"""

from __future__ import annotations

import torch

from fuser.kernels import _triton as tt
from fuser.kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def embedding_grad_kernel(
        values_ptr,
        perm_ptr,
        bounds_ptr,
        base_ptr,
        scale_ptr,
        out_ptr,
        values_row_stride,
        base_row_stride,
        out_row_stride,
        n_rows,
        n_cols,
        HAS_BASE: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_mask = cols < n_cols
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        for r in range(ROWS):
            row = tl.program_id(0) * ROWS + r
            if row < n_rows:
                # this row's terms: positions [start, end) of the sorted ids
                start = tl.load(bounds_ptr + row)
                end = tl.load(bounds_ptr + row + 1)
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for i in range(start, end):
                    token = tl.load(perm_ptr + i).to(tl.int64)
                    acc += tl.load(values_ptr + token * values_row_stride + cols, mask=col_mask, other=0.0).to(
                        tl.float32
                    )
                if HAS_BASE:
                    b = tl.load(base_ptr + row.to(tl.int64) * base_row_stride + cols, mask=col_mask).to(tl.float32)
                    if HAS_SCALE:
                        b = b * scale
                    acc = b + acc
                tl.store(
                    out_ptr + row.to(tl.int64) * out_row_stride + cols,
                    acc.to(out_ptr.dtype.element_ty),
                    mask=col_mask,
                )


_ROWS = 4
_MAX_BLOCK_N = 1024


def _flat(ids: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None):
    """(ids [N] int64 with every masked or out-of-range id set to -1, values [N, H])."""
    n_cols = values.shape[-1]
    flat_ids = ids.reshape(-1).long()
    values2 = values.reshape(-1, n_cols)
    if valid is not None:
        flat_ids = torch.where(valid.reshape(-1), flat_ids, -1)
    return flat_ids, values2


def _check(values, ids, valid, num_weights, out_dtype, base, base_scale) -> None:
    tt.check_floating("embedding_grad", values=values, base=base, base_scale=base_scale)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"fuser: embedding_grad expects integer ids, got {ids.dtype}")
    if tuple(values.shape[:-1]) != tuple(ids.shape):
        raise ValueError(
            f"fuser: embedding_grad expects values of shape ids.shape + [H] = {(*ids.shape, 'H')}, "
            f"got {tuple(values.shape)}"
        )
    if valid is not None and valid.dtype != torch.bool:
        raise ValueError(f"fuser: embedding_grad expects a bool valid mask, got {valid.dtype}")
    if valid is not None and valid.numel() != ids.numel():
        raise ValueError(
            f"fuser: embedding_grad expects one valid flag per id ({ids.numel()}), got {tuple(valid.shape)}"
        )
    shape = (num_weights, values.shape[-1])
    if base is not None and (tuple(base.shape) != shape or base.dtype != out_dtype):
        raise ValueError(
            f"fuser: embedding_grad expects base of shape {shape} and dtype {out_dtype}, "
            f"got {tuple(base.shape)} {base.dtype}"
        )
    if base_scale is not None and (base is None or base_scale.numel() != 1):
        raise ValueError("fuser: embedding_grad's base_scale is one number, and only with a base")


def reference(values, ids, valid, num_weights, out_dtype, base=None, base_scale=None) -> torch.Tensor:
    """What Inductor's kernels compute for the decomposed backward graph: an fp32 (fp64 for fp64 values)
    scatter-add plus ``base · s``, computed in fp32 and rounded to ``out_dtype`` once (Inductor does not round the
    graph's intermediate casts inside a fused kernel)."""
    flat_ids, values2 = _flat(ids, values, valid)
    keep = (flat_ids >= 0) & (flat_ids < num_weights)
    dtype = tt.compute_dtype(values)
    acc = values2.new_zeros((num_weights, values2.shape[-1]), dtype=dtype)
    acc.index_put_((flat_ids[keep],), values2[keep].to(dtype), accumulate=True)
    if base is None:
        return acc.to(out_dtype)
    wide = base.to(dtype)
    if base_scale is not None:
        wide = wide * base_scale.to(dtype).reshape(())
    return (wide + acc).to(out_dtype)


def _launch(values, ids, valid, base, base_scale, out: torch.Tensor) -> None:
    """The kernel into ``out`` ([V, H], every element written)."""
    num_weights, n_cols = out.shape
    flat_ids, values2 = _flat(ids, values, valid)
    values2 = tt.as_rows(values2)
    # masked and out-of-range ids sort past every row (key V) and so are never read
    keys = torch.where((flat_ids >= 0) & (flat_ids < num_weights), flat_ids, num_weights)
    sorted_keys, perm = torch.sort(keys, stable=True)
    rows = torch.arange(num_weights + 1, device=keys.device, dtype=keys.dtype)
    bounds = torch.searchsorted(sorted_keys, rows, out_int32=True)  # row v's terms: [bounds[v], bounds[v + 1])
    perm = perm.to(torch.int32)
    base2 = tt.as_rows(base) if base is not None else None
    block_n = min(_MAX_BLOCK_N, tt.next_power_of_2(n_cols))
    if num_weights == 0 or n_cols == 0:
        return
    tt.launchable(embedding_grad_kernel)[(tt.cdiv(num_weights, _ROWS), tt.cdiv(n_cols, block_n))](
        values2,
        perm,
        bounds,
        base2 if base2 is not None else out,
        base_scale if base_scale is not None else out,
        out,
        values2.stride(0),
        base2.stride(0) if base2 is not None else 0,
        out.stride(0),
        num_weights,
        n_cols,
        HAS_BASE=base2 is not None,
        HAS_SCALE=base_scale is not None,
        ROWS=_ROWS,
        BLOCK_N=block_n,
        num_warps=4,
    )


def _triton_runs(values, base, out_dtype) -> bool:
    return tt.triton_runs(values, base, out_dtypes=(out_dtype,))


@torch.library.custom_op("fuser::embedding_grad", mutates_args=())
def embedding_grad_op(
    values: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor | None,
    num_weights: int,
    out_dtype: torch.dtype,
    base: torch.Tensor | None = None,
    base_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[num_weights, H]`` of ``out_dtype``: the rows of ``values`` (``ids.shape + [H]``) summed by id (where
    ``valid``, and where the id is in range), cast to ``out_dtype``, plus ``base · base_scale`` where given."""
    _check(values, ids, valid, num_weights, out_dtype, base, base_scale)
    if not _triton_runs(values, base, out_dtype):
        return reference(values, ids, valid, num_weights, out_dtype, base, base_scale)
    out = values.new_empty((num_weights, values.shape[-1]), dtype=out_dtype)
    _launch(values, ids, valid, base, base_scale, out)
    return out


@embedding_grad_op.register_fake
def _(values, ids, valid, num_weights, out_dtype, base=None, base_scale=None):
    return values.new_empty((num_weights, values.shape[-1]), dtype=out_dtype)


def embedding_grad(
    values: torch.Tensor,
    ids: torch.Tensor,
    num_weights: int,
    out_dtype: torch.dtype | None = None,
    valid: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
    base_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight gradient of ``embedding(ids, W)`` for the output gradient ``values`` (``W``: ``[num_weights,
    H]``), in ``out_dtype`` (default: ``values``'s), plus ``base · base_scale`` (e.g. a tied lm_head's gradient)."""
    return embedding_grad_op(values, ids, valid, num_weights, out_dtype or values.dtype, base, base_scale)
