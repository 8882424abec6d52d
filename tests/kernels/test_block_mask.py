"""FlexAttention's block-sparse tensors as one op (``src/fuser/kernels/block_mask.py``): the same tensors as
``create_block_mask`` for masks real batches carry, sizes from a symbolic length under ``torch.compile``, and
FlexAttention on the :class:`BlockMask` built from them computing the masked attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from fuser.kernels.block_mask import block_mask, block_mask_tensors

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _reference(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx, kv_idx]

    made = create_block_mask(mask_mod, mask.shape[0], None, mask.shape[-2], mask.shape[-1], device=mask.device)
    return tuple(getattr(made, name) for name in FIELDS)


def _batch_mask(length: int, generator: torch.Generator) -> torch.Tensor:
    """[3, 1, T, T]: a packed row (documents of random lengths, each causal), a right-padded and a left-padded row."""
    i = torch.arange(length)
    causal = i[None, :] <= i[:, None]
    docs = (torch.rand(length, generator=generator) < 4 / length).cumsum(0)
    packed = causal & (docs[:, None] == docs[None, :])
    real = int(torch.randint(1, length + 1, (1,), generator=generator))
    right = causal & (i < real)[None, :]
    left = causal & (i >= length - real)[None, :]
    return torch.stack([packed, right, left])[:, None]


def _assert_same(found, expected):
    for name, a, b in zip(FIELDS, found, expected, strict=True):
        assert a.dtype == b.dtype == torch.int32, name
        assert a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("length", [1, 127, 128, 129, 300, 1000])
def test_tensors_equal_create_block_mask(length):
    generator = torch.Generator().manual_seed(length)
    mask = _batch_mask(length, generator)
    _assert_same(block_mask_tensors(mask), _reference(mask))


def test_random_mask_not_square():
    mask = torch.rand(2, 1, 200, 333, generator=torch.Generator().manual_seed(0)) < 0.3
    mask[0, :, :, :130] = True  # a row of full tiles beside partial ones
    _assert_same(block_mask_tensors(mask), _reference(mask))


def test_rejects_a_mask_it_cannot_read():
    with pytest.raises(ValueError, match=r"\[B, 1, T, S\] bool"):
        block_mask_tensors(torch.ones(2, 4, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[B, 1, T, S\] bool"):
        block_mask_tensors(torch.ones(1, 1, 8, 8))


def test_one_graph_serves_every_length():
    """Compiled for a symbolic length (``dynamic=True``), the op's outputs take sizes ceil(T / 128) from it."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    compiled = torch.compile(block_mask_tensors, backend=backend, dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    for length in (300, 517, 1100):
        mask = _batch_mask(length, generator)
        _assert_same(compiled(mask), _reference(mask))
    assert len(calls) == 1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("length", [100, 300])
def test_flex_attention_on_the_block_mask_is_the_masked_attention(length):
    """FlexAttention (eager, CPU, fp32) on :func:`block_mask`'s BlockMask against the masked SDPA in fp64, on every
    query row the mask leaves a key to."""
    generator = torch.Generator().manual_seed(length)
    mask = _batch_mask(length, generator)
    q, k, v = (torch.randn(3, 2, length, 16, generator=generator) for _ in range(3))

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, 0, q_idx, kv_idx]

    out = torch.full_like(q, float("nan"))
    out.copy_(flex_attention(q, k, v, block_mask=block_mask(mask, mask_mod, length, length)))
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    seen = mask.any(-1).expand(3, 2, length)
    assert torch.allclose(out[seen].double(), expected[seen], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))  # a row with no key: zeros, as FlexAttention gives
