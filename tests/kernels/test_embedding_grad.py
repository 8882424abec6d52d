"""Kernel tests for ``fuser::embedding_grad`` (``src/fuser/kernels/embedding_grad.py``): an embedding's weight gradient
(a scatter-add of the output gradient's rows by id), plus an optional scaled tied-lm_head gradient.

Oracle: the reference on fp64 copies of the inputs, itself checked against the gradient autograd gives
``F.embedding`` in fp64. The kernel's output buffer is filled with NaN before it runs, so a row or column it never
writes fails. Ids repeat (one id 12 times, so a row sums many terms), some are masked or out of range, and H spans
two column blocks (1100 > 1024). On the interpreter fp32 and fp16 are compared bit for bit with the reference: both
sum each row's terms in token order in fp32 and round once. bf16 runs on the GPU test only (the interpreter's bf16
is not trusted, DESIGN.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels import embedding_grad as E

V, H, N = 37, 1100, 53


def inputs(dtype=torch.float32, seed=0, with_base=True, with_valid=True):
    """(values [1, N, H], ids [1, N], valid [1, N, 1] or None, base [V, H] or None, scale 0-dim or None)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, N), generator=g)
    ids[0, 5:17] = 3  # one row of 12 terms
    values = torch.randn(1, N, H, generator=g).to(dtype)
    valid = (torch.rand(1, N, 1, generator=g) > 0.2) if with_valid else None
    base = torch.randn(V, H, generator=g).to(dtype) if with_base else None
    scale = torch.tensor(0.37) if with_base else None
    return values, ids, valid, base, scale


def fp64(t):
    return t.double() if t is not None and t.is_floating_point() else t


def test_reference_is_embedding_backward_plus_the_scaled_base():
    """The fp64 reference against autograd of F.embedding (masked ids' rows zeroed) plus base * s."""
    values, ids, valid, base, scale = inputs(torch.float64)
    weight = torch.zeros(V, H, dtype=torch.float64, requires_grad=True)
    F.embedding(ids, weight).backward(values * valid)
    expected = weight.grad + base * scale.double()
    got = E.reference(values, ids, valid, V, torch.float64, base, scale.double())
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_reference_skips_out_of_range_ids():
    values, ids, _, _, _ = inputs(torch.float64, with_base=False)
    ids = ids.clone()
    ids[0, :3] = torch.tensor([-1, V, V + 5])
    weight = torch.zeros(V, H, dtype=torch.float64, requires_grad=True)
    keep = ((ids >= 0) & (ids < V)).unsqueeze(-1)
    F.embedding(ids.clamp(0, V - 1), weight).backward(values * keep)
    torch.testing.assert_close(E.reference(values, ids, None, V, torch.float64), weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("with_valid", [True, False])
def test_kernel_matches_reference_bit_for_bit(triton_on_cpu, dtype, with_base, with_valid):
    values, ids, valid, base, scale = inputs(dtype, seed=1, with_base=with_base, with_valid=with_valid)
    values = values.float()  # the graph hands the op fp32 values (the gradient after its cast)
    triton_on_cpu()
    out = torch.full((V, H), float("nan"), dtype=dtype)
    E._launch(values, ids, valid, base, scale, out)
    assert not out.isnan().any()
    expected = E.reference(values, ids, valid, V, dtype, base, scale)
    assert torch.equal(out, expected)
    oracle = E.reference(fp64(values), ids, valid, V, torch.float64, fp64(base), fp64(scale))
    bound = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]  # one rounding of out's dtype, relative
    assert (out.double() - oracle).norm() <= bound * oracle.norm()


def test_op_takes_the_kernel_on_the_interpreter_and_the_reference_elsewhere(triton_on_cpu):
    values, ids, valid, base, scale = inputs(torch.float16, seed=2)
    args = (values.float(), ids, valid, V, torch.float16, base, scale)
    reference = E.embedding_grad_op(*args)
    triton_on_cpu()
    launched = []
    original = E._launch
    try:
        E._launch = lambda *a: (launched.append(1), original(*a))[1]
        kernel = E.embedding_grad_op(*args)
    finally:
        E._launch = original
    assert launched and torch.equal(kernel, reference)


def test_bad_arguments_say_what_is_wrong():
    values, ids, valid, base, scale = inputs()
    with pytest.raises(ValueError, match="integer ids"):
        E.embedding_grad(values, ids.float(), V)
    with pytest.raises(ValueError, match=r"ids.shape \+ \[H\]"):
        E.embedding_grad(values, ids.view(N, 1), V)
    with pytest.raises(ValueError, match="base of shape"):
        E.embedding_grad(values, ids, V, base=base[:-1])
    with pytest.raises(ValueError, match="one valid flag per id"):
        E.embedding_grad(values, ids, V, valid=valid.view(N)[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [True, False])
def test_gpu_bf16_at_llama_32_1b_width(tied):
    """Vocabulary 128256, hidden 2048, 8192 tokens (4×2048), bf16 out: within one bf16 rounding of the fp64
    oracle, and equal to the reference, which sums in another order, within that rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    v, h, shape = 128256, 2048, (4, 2048)
    ids = torch.randint(0, v, shape, device="cuda", generator=g)
    ids[0, :512] = 7  # a frequent token: one row of 512 terms
    values = torch.randn(*shape, h, device="cuda", generator=g)
    base = torch.randn(v, h, device="cuda", generator=g).bfloat16() if tied else None
    scale = torch.tensor(0.5, device="cuda") if tied else None
    out = torch.full((v, h), float("nan"), device="cuda", dtype=torch.bfloat16)
    E._launch(values, ids, None, base, scale, out)
    assert not out.isnan().any()
    oracle = E.reference(values.double(), ids, None, v, torch.float64, fp64(base), fp64(scale))
    assert (out.double() - oracle).norm() <= 2**-8 * oracle.norm()
    rounded = E.reference(values, ids, None, v, torch.bfloat16, base, scale)
    assert (out.double() - rounded.double()).abs().max() <= 2**-7 * oracle.abs().max()
