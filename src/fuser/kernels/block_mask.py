"""FlexAttention's block-sparse index tensors for a boolean mask, as one op that Inductor does not lower.

FlexAttention skips the ``128 × 128`` tiles a mask hides entirely and masks the others element by element. What it
needs from a ``[B, 1, T, S]`` bool mask (True = attend) is, for each row of tiles, how many tiles are partly or
wholly visible and which (``kv_num_blocks``, ``kv_indices``, and the same for the wholly visible ones), and the
transpose for the backward (``q_num_blocks``, ``q_indices``, ...): the tensors of
:class:`torch.nn.attention.flex_attention.BlockMask`, the ones ``create_block_mask`` computes.

Why an op. ``create_block_mask`` traced into a compiled graph is a pad, a view into tiles, a sum and argsorts, which
Inductor lowers with the rest of the graph. In a graph compiled for a symbolic sequence length ``T``, that lowering
can fail on the tile count ``ceil(T / 128)`` (a view Inductor cannot split), and the whole graph would then run
unfused. Here the same computation runs as :func:`block_mask_tensors`, an opaque custom op: its fake
implementation gives the outputs' sizes as expressions of ``T``, and the op itself runs eagerly (a handful of
kernels on a ``[B, 1, T, S]`` mask, once per distinct mask in a graph: the layers that share one mask share the
op's call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # FlexAttention's default tile, the one its kernels are tuned for


def _tiles(length):
    return (length + BLOCK - 1) // BLOCK


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., rows, cols]`` bool → (tiles set per row ``[..., rows]``, their column indices first ``[..., rows,
    cols]``), int32, the order ``create_block_mask`` gives (a stable sort, set tiles first)."""
    ones = dense.to(torch.int32)
    count = ones.sum(-1, dtype=torch.int32)
    order = torch.argsort(ones, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
    return count.contiguous(), order


@torch.library.custom_op(
    "fuser::block_mask_tensors", mutates_args=(), schema=f"(Tensor mask) -> ({', '.join(['Tensor'] * 8)})"
)
def block_mask_tensors(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``mask`` ``[B, 1, T, S]`` bool → ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``, :class:`BlockMask`'s tensors for tiles of
    ``BLOCK``: a tile is *full* when the mask shows every element of it, *partial* when it shows some but not all
    (tiles past ``T`` or ``S`` count as hidden, as in ``create_block_mask``)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"block_mask_tensors takes a [B, 1, T, S] bool mask, got {mask.dtype} {tuple(mask.shape)}")
    batch, _, rows, cols = mask.shape
    nq, nk = _tiles(rows), _tiles(cols)
    padded = F.pad(mask, (0, nk * BLOCK - cols, 0, nq * BLOCK - rows))
    shown = padded.view(batch, 1, nq, BLOCK, nk, BLOCK).sum((3, 5))
    full = shown == BLOCK * BLOCK
    partial = (shown > 0) & ~full
    return (
        *_ordered(partial),
        *_ordered(full),
        *_ordered(partial.transpose(-2, -1)),
        *_ordered(full.transpose(-2, -1)),
    )


@block_mask_tensors.register_fake
def _(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, _, rows, cols = mask.shape
    nq, nk = _tiles(rows), _tiles(cols)

    def ordered(r, c):
        return mask.new_empty((batch, 1, r), dtype=torch.int32), mask.new_empty((batch, 1, r, c), dtype=torch.int32)

    return (*ordered(nq, nk), *ordered(nq, nk), *ordered(nk, nq), *ordered(nk, nq))


def block_mask(mask: torch.Tensor, mask_mod, query_length, key_length):
    """A :class:`BlockMask` for ``mask`` ``[B, 1, T, S]`` (its tensors from :func:`block_mask_tensors`) whose partial
    tiles ``mask_mod`` masks element by element."""
    from torch.nn.attention.flex_attention import BlockMask

    tensors = torch.ops.fuser.block_mask_tensors(mask)
    return BlockMask((query_length, key_length), *tensors, (BLOCK, BLOCK), mask_mod)
