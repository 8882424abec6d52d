"""Kernel tests for the fused lm_head + cross-entropy (``src/fuser/kernels/linear_cross_entropy.py``).

Oracle: fp64 autograd of the loss written the way models write it, in plain torch, on fp64 copies of the inputs
(the same rounded fp16 values the op reads)::

    F.cross_entropy(softcap · tanh(logit_scale · F.linear(h, W, b) / softcap), labels, ignore_index, reduction)

divided by ``num_items_in_batch`` when given (then with ``reduction="sum"``, as transformers does). Every test draws
fresh random inputs from a generator seeded by the test id.

Error measure: ``rel_err(a, b) = ‖a − b‖ / ‖b‖`` over the whole tensor, in fp64. Tolerances:

- fp32 ≤ 1e-5: the logits are fp32 dot products of depth H (≤ 64 here: ~H·2^-24 relative at worst), the
  log-sum-exp, softmax and tanh a few fp32 roundings each, the gradient matmuls fp32 sums of depth V or T (≤ 2500,
  random-sign roundings: ~√depth·2^-24 ≈ 3e-6 at worst); measured ≤ 1e-6.
- fp16: see :func:`fp16_tolerance` (a few units of 2^-11, widened by the size of the softmax input and the
  matmul depth, each term stated there); and fuser's fp16 error may exceed the error of eager fp16 (the same
  formula in torch at fp16 with the logits upcast to fp32 as Hugging Face's loss does) by at most
  ``EAGER_FACTOR``: fuser rounds the same quantities eager rounds (the logits, the logits' gradient).

The op allocates its own outputs; every allocation it makes with ``torch.empty*`` is filled with NaN in these tests
(``torch.use_deterministic_algorithms`` + ``torch.utils.deterministic.fill_uninitialized_memory``: the allocation
hook torch offers), and every check first asserts there is no NaN (nor inf), so a row, element or chunk the op
never writes fails.

CPU tests run each case on both paths: the plain-torch reference (default on CPU) and the Triton kernel through the
interpreter (``triton_on_cpu()``; ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` without a GPU). A spy counts
the per-chunk calls, so a silent fall-back from Triton to the reference fails, and so do too few chunks. Only fp32
and fp16 run on the interpreter (its bf16 arithmetic is wrong, DESIGN.md "Testing tiers"); bf16 and real shapes
(vocab 32000 and 128256) are proven by the ``@pytest.mark.gpu`` tests against an fp32 (TF32 off) torch reference.

The interpreter kernel uses vocabulary blocks of 1024 (8192 on the GPU): the ``V = 2500`` case crosses three
blocks, so the online log-sum-exp rescaling and the masked tail block run on CPU too. Multi-chunk cases shrink the
logits budget (``chunk_rows`` with a small ``budget``) so that e.g. 130 rows run as chunks of 64, 64 and 2.
"""

from __future__ import annotations

import itertools
import math
import re
import types
import zlib

import pytest
import torch
import torch.nn.functional as F

import fuser.kernels.linear_cross_entropy as lce_module
from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.linear_cross_entropy import LOGITS_BUDGET_BYTES, chunk_rows, linear_cross_entropy

# the NaN-fill fixture turns torch's deterministic mode on (warn_only): cuBLAS then warns on every matmul
pytestmark = pytest.mark.filterwarnings("ignore:Deterministic behavior was enabled:UserWarning")

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)

TOL32 = 1e-5
U16 = 2.0**-11  # fp16 unit roundoff (half an ulp at 1)
EAGER_FACTOR = 1.5  # fuser's fp16 error ≤ EAGER_FACTOR · eager fp16's error (+ a hair of fp32 noise)
REAL_CHUNK_ROWS = chunk_rows  # the module's, before any test wraps it


def fp16_tolerance(z_rms: float, depth: int, accumulator_roundings: int = 0) -> float:
    """Relative error bound (norm-wise) for fp16 results against the fp64 oracle. With u = 2^-11, one rounding to
    nearest errs by ≤ u relative, r = u/√3 rms (uniform); the norm ratio of random-signed errors is their rms.

    - Each logit is rounded to fp16 once (the lm_head output, as eager's is): the softmax input z moves by ~r·|z|
      (logit_scale scales the error with the value, tanh' ≤ 1 only shrinks it), which moves p by
      p·(δz − E_p[δz]): ≤ r·z_rms relative in the loss terms and in the logits' gradient G.
    - G is rounded to fp16 (r), and so is each matmul output (dhidden = G·W, dweight = Gᵀ·h: r).
    - The matmuls accumulate in fp32 on CPU and on the GPU: depth·2^-24 at worst, ≪ u for every depth here, but
      kept so the bound stays honest for deep ones (fp16 accumulation would be √depth·r).
    - ``accumulator_roundings``: extra roundings of a running fp16 sum (the ``input`` dweight accumulator rounds
      once per chunk; random-signed: √n·r).
    Times 2 for the tails. Measured: ≤ 1/5 of the bound (≈ 5e-4 against 2.9e-3 at z_rms 3).
    """
    r = U16 / math.sqrt(3)
    return 2 * (r * (2 + z_rms) + depth * 2.0**-24 + r * math.sqrt(accumulator_roundings))


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per test and per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def nan_poisoned_allocations():
    """Every ``torch.empty*`` the op makes is NaN-filled, so anything it never writes shows up as NaN."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_fill
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


def randn(shape, gen, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    if torch.device(device).type == "cuda":  # GPU shapes: draw on the GPU, seeded from the test's generator
        cuda_gen = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        return (torch.randn(shape, generator=cuda_gen, device=device) * scale).to(dtype)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def make_labels(n_rows, vocab, gen, ignore_index=-100, n_ignored=0, device="cpu", dtype=torch.int64) -> torch.Tensor:
    """Random labels in [0, V) with ``n_ignored`` random rows set to ``ignore_index``."""
    labels = torch.randint(0, vocab, (n_rows,), generator=gen)
    if ignore_index in range(vocab):  # an in-range ignore_index (e.g. 0): keep it off the rows that count
        labels = torch.where(labels == ignore_index, (labels + 1) % vocab, labels)
    labels[torch.randperm(n_rows, generator=gen)[:n_ignored]] = ignore_index
    return labels.to(device=device, dtype=dtype)


def make_inputs(lead, hidden, vocab, dtype, gen, bias=False, logit_std=3.0, device="cpu"):
    """(h [*lead, H], W [V, H], b [V] or None): logits of standard deviation ~``logit_std``."""
    h = randn((*lead, hidden), gen, dtype, device)
    w = randn((vocab, hidden), gen, dtype, device, scale=logit_std / math.sqrt(hidden))
    b = randn((vocab,), gen, dtype, device, scale=0.5) if bias else None
    return h, w, b


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp64."""
    diff = (actual.detach().double() - expected.detach().double()).norm()
    denom = expected.detach().double().norm()
    return (diff / denom).item() if denom > 0 else diff.item()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> float:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {actual.numel()} elements are NaN/inf (never written?)"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    return err


def model_loss(h, w, b, labels, upcast, ignore_index=-100, reduction="mean", logit_scale=None, softcap=None,
               num_items_in_batch=None):  # fmt: skip
    """The loss as models write it: lm_head, logits upcast (HF's ``logits.float()``), scale, softcap, CE."""
    logits = F.linear(h, w, b).to(upcast)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    reduction = "sum" if num_items_in_batch is not None else reduction
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), labels.reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction)  # fmt: skip
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def leaves(h, w, b, requires, dtype=None):
    """Fresh leaf copies (cast to ``dtype``) with requires_grad per ``requires`` (hidden, weight, bias)."""
    out = []
    for t, r in zip((h, w, b), requires, strict=True):
        out.append(None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(r))
    return out


def grads_of(ts):
    return [None if t is None else t.grad for t in ts]


def run_model(h, w, b, labels, dtype, upcast, requires=(True, True, True), grad_scale=1.0, **kw):
    """(loss, [dh, dW, db]) of :func:`model_loss` at ``dtype`` (fp64: the oracle; fp16: eager) by autograd."""
    ts = leaves(h, w, b, requires, dtype)
    loss = model_loss(*ts, labels, upcast, **kw)
    if loss.requires_grad:
        (loss * grad_scale).backward()
    return loss.detach(), grads_of(ts)


def fp64_reference(h, w, b, labels, requires=(True, True, True), grad_scale=1.0, **kw):
    return run_model(h, w, b, labels, torch.float64, torch.float64, requires, grad_scale, **kw)


def eager_half(h, w, b, labels, requires=(True, True, True), grad_scale=1.0, **kw):
    return run_model(h, w, b, labels, torch.float16, torch.float32, requires, grad_scale, **kw)


def run_fuser(h, w, b, labels, requires=(True, True, True), grad_scale=1.0, **kw):
    """(loss, [dh, dW, db]) through ``linear_cross_entropy`` and ``(loss * grad_scale).backward()``."""
    ts = leaves(h, w, b, requires)
    loss = linear_cross_entropy(ts[0], ts[1], labels, bias=ts[2], **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    if loss.requires_grad:
        (loss * grad_scale).backward()
    return loss.detach(), grads_of(ts)


@pytest.fixture(params=["reference", pytest.param("triton", marks=interpreter)])
def path(request, monkeypatch, triton_on_cpu):
    """Both CPU paths; ``path.chunks`` records which per-chunk step ran, once per chunk."""
    chunks = []
    triton_on_cpu(request.param == "triton")
    for name in ("_launch_chunk", "_reference_chunk"):
        real = getattr(lce_module, name)

        def spy(logits, *args, _real=real, _name=name):
            chunks.append((_name, logits.shape[0]))
            return _real(logits, *args)

        monkeypatch.setattr(lce_module, name, spy)
    expected = "_launch_chunk" if request.param == "triton" else "_reference_chunk"

    def check(rows_per_chunk):
        """The expected step ran on every chunk, in order, with these row counts (then forget them)."""
        assert chunks == [(expected, r) for r in rows_per_chunk], f"chunks run: {chunks}"
        chunks.clear()

    return types.SimpleNamespace(name=request.param, chunks=chunks, check=check)


def small_chunks(monkeypatch, rows=64):
    """Shrink the logits budget so a chunk holds at most ``rows`` (≥ 64, a multiple of 8) rows; the op then splits
    the rows evenly (70 rows: 40 + 30; 130 rows: 48 + 48 + 34)."""
    assert rows >= 64 and rows % 8 == 0
    monkeypatch.setattr(
        lce_module, "chunk_rows", lambda n, v, size: REAL_CHUNK_ROWS(n, v, size, budget=rows * v * size)
    )


def split(n_rows, most):
    """The chunks ``chunk_rows`` gives for at most ``most`` rows each, worked out by hand: the fewest chunks, their
    rows rounded up to a multiple of 8 (the last one takes the rest)."""
    if n_rows <= most:
        return [n_rows] if n_rows else []
    n_chunks = -(-n_rows // most)
    rows_per_chunk = math.ceil(math.ceil(n_rows / n_chunks) / 8) * 8
    return [min(rows_per_chunk, n_rows - s) for s in range(0, n_rows, rows_per_chunk)] if n_rows else []


def check_grads(grads, ref_grads, tol, requires, names=("hidden.grad", "weight.grad", "bias.grad"), eager=None):
    """Each asked-for gradient against the oracle (and, for fp16, against eager's error); the rest None."""
    for i, (name, g, r) in enumerate(zip(names, grads, ref_grads, strict=True)):
        if r is None and g is None:
            continue
        if not requires[i]:
            assert g is None, f"{name}: a gradient was formed for a leaf that does not require grad"
            continue
        err = assert_close(name, g, r, tol)
        if eager is not None:
            eager_err = rel_err(eager[i], r)
            assert err <= EAGER_FACTOR * eager_err + 1e-6, f"{name}: fuser {err:.3e} vs eager fp16 {eager_err:.3e}"


# ---------------------------------------------------------------------------------------------------------
# Loss and every gradient against fp64 autograd, both paths, fp32 and fp16
# ---------------------------------------------------------------------------------------------------------

# name → (lead shape, H, V, options); options: bias, logit_std, chunk (rows per chunk, multiple of 64),
# n_ignored, label_shape ("flat" | "lead"), label_dtype, and the functional's keyword arguments
CASES = {
    "one_row": ((1,), 64, 257, {}),
    "3d_bias_ignored": ((1, 37), 24, 50, {"bias": True, "n_ignored": 5}),
    "3d_chunks_mean": ((2, 65), 64, 1000, {"chunk": 64, "n_ignored": 9, "label_shape": "lead",
                                           "label_dtype": torch.int32}),
    "chunks_sum_softcap30_cohere_scale": ((3, 23), 24, 257, {"chunk": 64, "bias": True, "n_ignored": 4,
                                                             "logit_std": 8.0, "reduction": "sum",
                                                             "logit_scale": 0.5, "softcap": 30.0}),
    "granite_scale_softcap2_ignore_minus1": ((37,), 64, 1000, {"logit_std": 24.0, "logit_scale": 1 / 8,
                                                               "softcap": 2.0, "ignore_index": -1, "n_ignored": 6}),
    "ignore_index_0_bias": ((3, 13), 24, 257, {"bias": True, "ignore_index": 0, "n_ignored": 7}),
    "vocab_three_blocks_sum_softcap": ((9,), 24, 2500, {"bias": True, "reduction": "sum", "softcap": 30.0,
                                                        "logit_std": 10.0}),
}  # fmt: skip
FUNCTIONAL_KW = ("ignore_index", "reduction", "logit_scale", "softcap", "num_items_in_batch")


def case_inputs(case, dtype, gen, device="cpu"):
    lead, hidden, vocab, opt = CASES[case] if isinstance(case, str) else case
    h, w, b = make_inputs(lead, hidden, vocab, dtype, gen, opt.get("bias", False), opt.get("logit_std", 3.0), device)
    n_rows = math.prod(lead)
    labels = make_labels(n_rows, vocab, gen, opt.get("ignore_index", -100), opt.get("n_ignored", 0), device,
                         opt.get("label_dtype", torch.int64))  # fmt: skip
    if opt.get("label_shape") == "lead":
        labels = labels.view(lead)
    kw = {k: opt[k] for k in FUNCTIONAL_KW if k in opt}
    return h, w, b, labels, kw, n_rows, opt


def z_rms(h, w, b, logit_scale=None, softcap=None, **_) -> float:
    """rms of the softmax input z = softcap(logit_scale · x): the size of fp16's logit rounding error in it."""
    z = F.linear(h.double(), w.double(), None if b is None else b.double()) * (logit_scale or 1.0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z.pow(2).mean().sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_autograd(case, dtype, path, gen, monkeypatch):
    h, w, b, labels, kw, n_rows, opt = case_inputs(case, dtype, gen)
    if "chunk" in opt:
        small_chunks(monkeypatch, opt["chunk"])
    loss, grads = run_fuser(h, w, b, labels, **kw)
    path.check(split(n_rows, opt.get("chunk", n_rows)))
    ref_loss, ref_grads = fp64_reference(h, w, b, labels, **kw)
    if dtype == torch.float32:
        assert_close("loss", loss, ref_loss, TOL32)
        check_grads(grads, ref_grads, TOL32, (True, True, True))
        return
    depth = max(w.shape[1], w.shape[0], n_rows)  # the deepest of the three matmuls (H, V, T)
    tol = fp16_tolerance(z_rms(h, w, b, **kw), depth)
    eager_loss, eager_grads = eager_half(h, w, b, labels, **kw)
    err = assert_close("loss", loss, ref_loss, tol)
    eager_err = rel_err(eager_loss, ref_loss)
    assert err <= EAGER_FACTOR * eager_err + 1e-6, f"loss: fuser {err:.3e} vs eager fp16 {eager_err:.3e}"
    check_grads(grads, ref_grads, tol, (True, True, True), eager=eager_grads)
    assert all(g.dtype == torch.float16 for g in grads if g is not None)


@pytest.mark.parametrize("confidence", [0.6, 1.0], ids=["loss~1e-6", "loss~1e-9"])
def test_confident_rows_keep_fp32_precision(confidence, path, gen):
    """Rows whose label takes nearly all the probability (a model that has learned its batch): ``lse − z_label``
    and the label's gradient ``p − 1`` are differences of nearly equal numbers, and a loss below ~6e-8 of lse
    rounds to 0 in fp32 (before: 1e0 relative error at loss ~1e-9, 7e-3 on the gradients at ~1e-6; eager fp32 on
    a GPU forms them the same way). fuser takes both from the other columns' log-sum-exp and stays at fp32's
    precision."""
    n_rows, hidden, vocab = 48, 64, 512
    h = torch.randn(n_rows, hidden, generator=gen)
    labels = torch.randperm(vocab, generator=gen)[:n_rows]  # distinct: each label's weight row serves one row
    w = 0.5 * torch.randn(vocab, hidden, generator=gen)
    w[labels] += confidence * h
    loss, grads = run_fuser(h, w, None, labels)
    path.check([n_rows])
    ref_loss, ref_grads = fp64_reference(h, w, None, labels)
    assert ref_loss.item() < 1e-5, ref_loss  # the regime the test is about
    assert_close("loss", loss, ref_loss, TOL32)
    check_grads(grads, ref_grads, TOL32, (True, True, False))


# ---------------------------------------------------------------------------------------------------------
# num_items_in_batch, frozen leaves, grad_output
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensor", "int"])
def test_num_items_in_batch(kind, path, gen):
    """``sum / num_items_in_batch`` (overriding ``reduction``), as transformers passes it for accumulation."""
    h, w, b = make_inputs((3, 11), 24, 257, torch.float32, gen, bias=True)
    labels = make_labels(33, 257, gen, n_ignored=4)
    num_items = 53 if kind == "int" else torch.tensor(53)  # more than this micro-batch: gradient accumulation
    loss, grads = run_fuser(h, w, b, labels, reduction="mean", num_items_in_batch=num_items)
    path.check([33])
    ref_loss, ref_grads = fp64_reference(h, w, b, labels, num_items_in_batch=53)
    assert_close("loss", loss, ref_loss, TOL32)
    check_grads(grads, ref_grads, TOL32, (True, True, True))


# (hidden, weight, bias) requires_grad; LoRA freezes the lm_head weight, a frozen trunk leaves only the head
FROZEN = {
    "weight_frozen": (True, False, False),
    "weight_frozen_bias_trains": (True, False, True),
    "hidden_frozen": (False, True, True),
    "only_weight": (False, True, False),
}


def record_grads_wanted(monkeypatch) -> list:
    """The (grad_hidden, grad_weight, grad_bias) each run of the op asked its chunked forward for."""
    flags = []
    real = lce_module._forward_chunked

    def spy(hidden, weight, bias, labels, ce, wanted, *rest):
        flags.append((wanted.hidden, wanted.weight, wanted.bias))
        return real(hidden, weight, bias, labels, ce, wanted, *rest)

    monkeypatch.setattr(lce_module, "_forward_chunked", spy)
    return flags


@pytest.mark.parametrize("requires", list(FROZEN.values()), ids=list(FROZEN))
def test_frozen_leaves_form_only_the_asked_gradients(requires, path, gen, monkeypatch):
    flags = record_grads_wanted(monkeypatch)
    small_chunks(monkeypatch)
    h, w, b = make_inputs((70,), 24, 257, torch.float32, gen, bias=True)
    labels = make_labels(70, 257, gen, n_ignored=10)
    loss, grads = run_fuser(h, w, b, labels, requires)
    assert flags == [requires], "the op was asked to form gradients nobody needs (or not the ones needed)"
    path.check([40, 30])
    ref_loss, ref_grads = fp64_reference(h, w, b, labels, requires)
    assert_close("loss", loss, ref_loss, TOL32)
    check_grads(grads, ref_grads, TOL32, requires)


def test_frozen_weight_op_returns_no_dweight(path, gen):
    h, w, _ = make_inputs((2, 5), 24, 50, torch.float32, gen)
    labels = make_labels(10, 50, gen)
    loss, dh, dw, db, _ = torch.ops.fuser.linear_cross_entropy(h, w, None, labels, -100, "mean", 1.0, 0.0, True, False,
                                                            True)  # fmt: skip
    assert dw.numel() == 0 and db.numel() == 0  # grad_bias without a bias: nothing
    assert dh.shape == h.shape
    ref_loss, (ref_dh, _, _) = fp64_reference(h, w, None, labels)
    assert_close("loss", loss, ref_loss, TOL32)
    assert_close("dhidden", dh, ref_dh, TOL32)


def test_no_grad_forms_no_gradients(path, gen, monkeypatch):
    flags = record_grads_wanted(monkeypatch)
    h, w, b = make_inputs((7, 3), 24, 257, torch.float32, gen, bias=True)
    labels = make_labels(21, 257, gen, n_ignored=2)
    h.requires_grad_()
    w.requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, bias=b, softcap=30.0)
    assert flags == [(False, False, False)] and not loss.requires_grad
    assert_close("loss", loss, fp64_reference(h, w, b, labels, softcap=30.0)[0], TOL32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grad_output_scales_the_gradients(dtype, path, gen):
    """``(loss * 3).backward()`` gives 3× the gradients: exactly (one fp32 product, one rounding) where the op
    forms normalised gradients; for fp16 it forms them unnormalised and multiplies by grad_output / n_valid in
    backward, so g1 and g3 are each one rounding of the same fp32 product: equal to within half an fp16 ulp each."""
    h, w, b = make_inputs((2, 9), 24, 257, dtype, gen, bias=True)
    labels = make_labels(18, 257, gen, n_ignored=3)
    loss1, grads1 = run_fuser(h, w, b, labels)
    loss3, grads3 = run_fuser(h, w, b, labels, grad_scale=3.0)
    assert torch.equal(loss1, loss3)
    for name, g1, g3 in zip(("hidden", "weight", "bias"), grads1, grads3, strict=True):
        expected = (g1.float() * 3.0).to(g1.dtype)
        if dtype == torch.float16:
            torch.testing.assert_close(g3.float(), g1.float() * 3.0, rtol=2.0**-10, atol=3 * 2.0**-24)
        else:
            assert torch.equal(g3, expected), f"{name}.grad is not 3× the grad_output=1 one"
        assert rel_err(g3, g1) > 1.9  # not trivially equal


def test_grad_output_inf_and_nan_pass_through(path, gen):
    """An overflowed fp16 GradScaler loss must reach the gradients as inf/NaN so the step is skipped."""
    h, w, b = make_inputs((10,), 24, 50, torch.float16, gen)
    labels = make_labels(10, 50, gen)
    for scale in (float("inf"), float("nan")):
        _, grads = run_fuser(h, w, b, labels, grad_scale=scale)
        assert all(not torch.isfinite(g).all() for g in grads if g is not None)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_scale_inplace_kernel(dtype, gen, triton_on_cpu):
    """The eager backward's in-place ``g *= grad_output`` (Triton): one fp32 product rounded once, the masked tail
    left alone, and no write at all when the scale is 1."""
    triton_on_cpu()
    n = 2 * 1024 + 17  # two full blocks and a partial one
    storage = torch.randn(n + 40, generator=gen).to(dtype)
    g, beyond = storage[:n], storage[n:].clone()
    for s in (2.5, 1.0, -3.0, float("nan")):
        before = g.clone()
        lce_module._scale_inplace(g, torch.tensor(s))
        expected = before if s == 1.0 else (before.float() * s).to(dtype)
        assert torch.equal(g, expected) or (s != s and g.isnan().all()), f"scale {s}: wrong product"
        assert torch.equal(storage[n:], beyond), f"scale {s}: wrote past the tensor's end"
        g.copy_(before if s == s else torch.randn(n, generator=gen).to(dtype))


# ---------------------------------------------------------------------------------------------------------
# The weight gradient's accumulators (fp16 weight, several chunks)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulator", ["fp32", "input"])
def test_dweight_accumulators(accumulator, path, gen, monkeypatch):
    fp32_adds = []
    real = lce_module._accumulate_fp32
    monkeypatch.setattr(
        lce_module, "_accumulate_fp32", lambda acc, a, b: fp32_adds.append(acc.dtype) or real(acc, a, b)
    )
    small_chunks(monkeypatch)
    n_rows = 130  # chunks of 48, 48, 34
    h, w, b = make_inputs((n_rows,), 64, 257, torch.float16, gen, bias=True)
    labels = make_labels(n_rows, 257, gen, n_ignored=12)
    loss, grads = run_fuser(h, w, b, labels, dw_accumulator=accumulator)
    path.check([48, 48, 34])
    n_chunks = 3
    # the fp32 accumulator adds every chunk's share into an fp32 buffer; "input" accumulates in fp16 in place
    assert fp32_adds == ([torch.float32] * n_chunks if accumulator == "fp32" else [])
    ref_loss, ref_grads = fp64_reference(h, w, b, labels)
    eager_loss, eager_grads = eager_half(h, w, b, labels)
    tol = fp16_tolerance(z_rms(h, w, b), n_rows, accumulator_roundings=n_chunks if accumulator == "input" else 0)
    assert_close("loss", loss, ref_loss, tol)
    # only the fp32 accumulator is held to eager's error: "input" trades one fp16 rounding per chunk for memory
    check_grads(grads, ref_grads, tol, (True, True, True), eager=eager_grads if accumulator == "fp32" else None)
    assert grads[1].dtype == torch.float16


def test_dweight_accumulator_choice():
    w16, w32 = torch.zeros(2, 2, dtype=torch.float16), torch.zeros(2, 2)
    assert lce_module.dweight_accumulator(w16) == "input"  # default: the weight's dtype (measured: accurate enough)
    assert lce_module.dweight_accumulator(torch.zeros(2, 2, dtype=torch.bfloat16)) == "input"
    assert lce_module.dweight_accumulator(w32) == "input"  # fp32 weights accumulate in fp32 either way
    assert lce_module.dweight_accumulator(w16, "fp32") == "fp32"
    assert lce_module.dweight_accumulator(w32, "fp32") == "input"
    h, labels = torch.zeros(4, 2, dtype=torch.float16), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="dw_accumulator must be one of"):
        linear_cross_entropy(h, w16, labels, dw_accumulator="bf16")


# ---------------------------------------------------------------------------------------------------------
# The weight gradient's Triton kernel (dw_kernel="triton"; cuBLAS's addmm_ by default)
# ---------------------------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("n_rows, vocab, hidden", [(37, 50, 24), (1, 33, 17), (64, 16, 16), (100, 70, 40)], ids=str)
@pytest.mark.parametrize("first", [True, False], ids=["first chunk", "later chunk"])
def test_dweight_kernel_matches_fp64(n_rows, vocab, hidden, first, gen, triton_on_cpu):
    """dw (=, first | +=) gᵀ·h for a chunk's gradient g [rows, V] (a slice of a wider buffer, as the op's) and its
    hidden rows h: fp32 sums rounded once to fp16, so each element is within an fp16 rounding (and fp32 sums'
    noise) of the fp64 result; a first chunk writes the NaN-filled accumulator without reading it."""
    triton_on_cpu()
    buffer = randn((n_rows + 5, vocab), gen, torch.float16)
    g = buffer[:n_rows]
    h = randn((n_rows + 3, hidden), gen, torch.float16)[2 : 2 + n_rows]
    old = randn((vocab, hidden), gen, torch.float16)
    dw = torch.full_like(old, float("nan")) if first else old.clone()
    lce_module._launch_dweight(dw, g.t(), h, first)
    want = g.double().t() @ h.double() + (0 if first else old.double())
    scale = g.double().abs().t() @ h.double().abs() + (0 if first else old.double().abs())
    bound = want.abs() * U16 + scale * n_rows * 2.0**-24 + 2.0**-24  # one fp16 rounding; fp32 sums; subnormals
    err = (dw.double() - want).abs()
    assert torch.isfinite(dw).all() and (err <= bound).all(), f"worst excess {(err - bound).max().item():.3e}"
    # the cuBLAS path's arithmetic (fp32 sum, one rounding) gives the same fp16 values up to one ulp
    cublas = (g.float().t() @ h.float() + (0 if first else old.float())).half()
    assert ((dw.float() - cublas.float()).abs() <= cublas.float().abs() * 2 * U16 + 2.0**-24).all()


def test_dweight_kernel_choice(triton_on_cpu):
    g16, w16, w32 = torch.zeros(4, 2, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.float16), torch.zeros(2, 2)
    triton_on_cpu()
    assert not lce_module.dweight_kernel_enabled(w16, g16.t())  # default: cuBLAS
    assert lce_module.dweight_kernel_enabled(w16, g16.t(), "triton") == (HAS_TRITON and interpreting())
    assert not lce_module.dweight_kernel_enabled(w32, g16.t(), "triton")  # an fp32 accumulator stays on cuBLAS
    assert not lce_module.dweight_kernel_enabled(w32, g16.float().t(), "triton")  # fp32 weights too
    triton_on_cpu(False)
    assert not lce_module.dweight_kernel_enabled(w16, g16.t(), "triton")  # only where Triton runs
    with pytest.raises(ValueError, match="dw_kernel must be one of"):
        linear_cross_entropy(g16, w16, torch.zeros(4, dtype=torch.long), dw_kernel="cutlass")


@interpreter
def test_dweight_kernel_in_the_op(gen, monkeypatch, triton_on_cpu):
    """Through the op (fp16, three chunks, interpreter): the kernel runs once per chunk, writing on the first and
    adding on the others, and the loss and gradients equal the cuBLAS path's to within an fp16 ulp per chunk."""
    triton_on_cpu()
    small_chunks(monkeypatch)
    n_rows = 130  # chunks of 48, 48, 34
    h, w, _ = make_inputs((n_rows,), 64, 257, torch.float16, gen)
    labels = make_labels(n_rows, 257, gen, n_ignored=12)
    ref_loss, ref_grads = run_fuser(h, w, None, labels, (True, True, False))
    launched = []
    real = lce_module._launch_dweight
    monkeypatch.setattr(
        lce_module, "_launch_dweight", lambda dw, g_t, h_c, first: launched.append(first) or real(dw, g_t, h_c, first)
    )
    loss, grads = run_fuser(h, w, None, labels, (True, True, False), dw_kernel="triton")
    assert launched == [True, False, False]
    assert torch.equal(loss, ref_loss) and torch.equal(grads[0], ref_grads[0])  # the rest of the op is unchanged
    dw, ref_dw = grads[1].float(), ref_grads[1].float()
    assert ((dw - ref_dw).abs() <= ref_dw.abs() * 3 * 2 * U16 + 3 * 2.0**-24).all()
    assert rel_err(grads[1], fp64_reference(h, w, None, labels)[1][1]) < fp16_tolerance(
        z_rms(h, w, None), n_rows, accumulator_roundings=3
    )


# ---------------------------------------------------------------------------------------------------------
# Ignored rows, out-of-range labels, empty input
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction, ignore_index", [("mean", -100), ("sum", 0), ("mean", 0)])
def test_all_rows_ignored_behaves_like_pytorch(reduction, ignore_index, path, gen, monkeypatch):
    small_chunks(monkeypatch)
    h, w, b = make_inputs((2, 35), 24, 50, torch.float32, gen, bias=True)
    labels = torch.full((70,), ignore_index)
    loss, grads = run_fuser(h, w, b, labels, ignore_index=ignore_index, reduction=reduction)
    path.check([40, 30])
    # what PyTorch does (checked here, not assumed): mean over no rows is 0/0 = NaN, sum is 0, gradients all zero
    ref_loss, ref_grads = run_model(h, w, b, labels, torch.float32, torch.float32, ignore_index=ignore_index,
                                    reduction=reduction)  # fmt: skip
    assert ref_loss.isnan().item() == (reduction == "mean")
    assert torch.equal(loss, ref_loss) or (loss.isnan().item() and ref_loss.isnan().item())
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert torch.equal(r, torch.zeros_like(r)), f"PyTorch's {name}.grad is not zero: the premise changed"
        assert torch.equal(g, torch.zeros_like(g)), f"{name}.grad is not all zero"


@pytest.mark.parametrize("bad_label", [50, 1000, -1, -101])
def test_out_of_range_labels_raise_on_cpu_and_give_nan_unchecked(bad_label, path, gen, monkeypatch):
    """On CPU the op raises what PyTorch raises (a host check of the labels). A GPU cannot check without a host
    synchronisation: there (here, with the check patched out) the loss is NaN, the gradients finite, and the
    kernel's label gather stays inside the row."""
    h, w, _ = make_inputs((2, 8), 24, 50, torch.float32, gen)
    labels = make_labels(16, 50, gen, n_ignored=3)
    labels[5] = bad_label
    with pytest.raises(IndexError) as eager:
        F.cross_entropy(F.linear(h, w).reshape(16, 50), labels)  # the premise: PyTorch rejects it
    for reduction in ("mean", "sum"):
        with pytest.raises(IndexError, match=f"^{re.escape(str(eager.value))}$"):
            run_fuser(h, w, None, labels, reduction=reduction)
    with monkeypatch.context() as m:
        m.setattr(lce_module, "_check_label_range", lambda *args: None)  # what the op does on a GPU
        for reduction in ("mean", "sum"):
            loss, grads = run_fuser(h, w, None, labels, reduction=reduction)
            assert loss.isnan().item(), f"{reduction}: loss {loss.item()} is not NaN"
            for g, t in zip(grads[:2], (h, w), strict=True):
                assert g.shape == t.shape and g.isfinite().all()
    # the same label is fine where it is the ignore_index
    labels = torch.where(labels == -100, 0, labels)
    ok_loss, _ = run_fuser(h, w, None, labels, ignore_index=bad_label)
    ok_ref, _ = fp64_reference(h, w, None, labels, ignore_index=bad_label)
    assert_close("loss", ok_loss, ok_ref, TOL32)


def test_zero_rows(path, gen):
    h, w, b = make_inputs((0, 4), 24, 50, torch.float32, gen, bias=True)
    labels = torch.zeros(0, dtype=torch.long)
    loss, grads = run_fuser(h, w, b, labels)
    path.check([])
    assert loss.isnan().item() and F.cross_entropy(F.linear(h, w, b).reshape(0, 50), labels).isnan().item()
    assert grads[0].shape == h.shape
    assert torch.equal(grads[1], torch.zeros_like(w)) and torch.equal(grads[2], torch.zeros_like(b))


# ---------------------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------------------


def test_strided_hidden_and_transposed_weight(path, gen):
    """hidden sliced out of a wider tensor (row stride ≠ H), the weight a transposed view (tied embeddings)."""
    wide = randn((2, 11, 40), gen)
    h = wide[..., 8:32]
    w_t = randn((24, 257), gen, scale=3 / math.sqrt(24))
    labels = make_labels(22, 257, gen, n_ignored=2)
    ht, wt = h.detach().requires_grad_(), w_t.detach().requires_grad_()
    loss = linear_cross_entropy(ht, wt.t(), labels, softcap=30.0)
    loss.backward()
    path.check([22])
    ref_loss, (ref_dh, ref_dw, _) = fp64_reference(h, w_t.t(), None, labels, softcap=30.0)
    assert_close("loss", loss, ref_loss, TOL32)
    assert_close("hidden.grad", ht.grad, ref_dh, TOL32)
    assert_close("weight.grad", wt.grad, ref_dw.t(), TOL32)


def test_strided_labels(path, gen):
    """A strided 1-D labels view (here every other label of a [T, 2] tensor)."""
    h, w, _ = make_inputs((37,), 24, 50, torch.float32, gen)
    labels = make_labels(74, 50, gen, n_ignored=6).view(37, 2)[:, 0]  # stride 2
    assert labels.stride() == (2,)
    loss, grads = run_fuser(h, w, None, labels)
    ref_loss, ref_grads = fp64_reference(h, w, None, labels)
    assert_close("loss", loss, ref_loss, TOL32)
    check_grads(grads, ref_grads, TOL32, (True, True, True))


# ---------------------------------------------------------------------------------------------------------
# fp16 under loss scaling (GradScaler)
# ---------------------------------------------------------------------------------------------------------


def test_fp16_gradients_keep_precision_under_loss_scaling(gen, triton_on_cpu):
    """fp16 training scales the loss (GradScaler, 2^16) to keep the fp16 gradients in the normal range; fuser's
    unscaled gradients must then be as accurate as eager's. The reference path only: it rounds exactly where the
    kernel does, and 1024 rows are too slow on the interpreter. Before fp16 gradients were formed unnormalised (1/n
    applied with grad_output in the backward), fuser measured 6.2e-4 here against eager's 2.5e-4."""
    triton_on_cpu(False)
    h, w, b = make_inputs((1024,), 16, 1024, torch.float16, gen, logit_std=0.5)
    labels = make_labels(1024, 1024, gen)
    scale = 2.0**16
    _, grads = run_fuser(h, w, b, labels, grad_scale=scale)
    _, ref_grads = fp64_reference(h, w, b, labels)
    _, eager_grads = eager_half(h, w, b, labels, grad_scale=scale)
    unscaled = [g.double() / scale for g in grads[:2]]
    eager_unscaled = [g.double() / scale for g in eager_grads[:2]]
    check_grads(unscaled, ref_grads[:2], 1.0, (True, True), ("hidden.grad", "weight.grad"), eager=eager_unscaled)


# ---------------------------------------------------------------------------------------------------------
# chunk_rows and argument checks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [LOGITS_BUDGET_BYTES, 1 << 20, 64 * 1000 * 4 + 1])
def test_chunk_rows(budget):
    for n_rows, vocab, itemsize in itertools.product(
        [1, 37, 63, 64, 65, 130, 4096, 8192, 1 << 20], [50, 257, 1000, 32000, 128256, 262144, 4_000_000], [2, 4]
    ):
        rows = chunk_rows(n_rows, vocab, itemsize, budget)
        case = f"chunk_rows({n_rows}, {vocab}, {itemsize}, {budget}) = {rows}"
        assert rows == chunk_rows(n_rows, vocab, itemsize, budget), case  # a function of the shapes only
        assert 1 <= rows <= n_rows, case
        assert rows == n_rows or rows % 8 == 0, f"{case}: neither all rows nor a multiple of 8"
        if rows > 64:
            assert rows * vocab * itemsize <= budget, f"{case}: a chunk's logits exceed the budget"
        n_chunks = -(-n_rows // rows)
        if n_chunks > 1 and 64 * vocab * itemsize <= budget:
            # the fewest chunks: one fewer would need more rows (a multiple of 8) than the budget holds
            fewer = -(-n_rows // (n_chunks - 1))
            assert -(-fewer // 8) * 8 * vocab * itemsize > budget, f"{case}: {n_chunks - 1} chunks would fit"
        if n_chunks > 1:
            # as even as multiples of 8 allow: no chunk more than 8 rows above the mean
            assert rows < n_rows / n_chunks + 8, f"{case}: uneven ({n_chunks} chunks)"


def test_chunk_rows_at_real_shapes():
    assert lce_module.LOGITS_BUDGET_BYTES == 1023 << 20 and lce_module.LOGITS_SHARE == 4  # the figures below
    assert chunk_rows(8192, 128256, 2) == 2048  # Llama-3: 4 chunks of 501 MiB, a quarter of the 2004 MiB logits
    assert chunk_rows(8192, 256000, 2) == 2048  # Gemma: 4 chunks of 1000.0 MiB, a quarter
    assert chunk_rows(16384, 151936, 2) == 3280  # Qwen: 5 chunks of 950.5 MiB (a quarter, 1187 MiB, is over 1 GiB)
    assert chunk_rows(8192, 262208, 2) == 1640  # Gemma-3: 5 chunks of 820.2 MiB (a quarter is 1024.25 MiB)
    assert chunk_rows(100, 32000, 2) == 56  # 2 chunks: at most 64 rows (one tile), even over a quarter
    assert chunk_rows(4096, 4_000_000, 4) == 64  # never below one tensor-core tile, even over the budget
    assert split(70, 64) == [40, 30] and split(130, 64) == [48, 48, 34] and split(33, 64) == [33]


@pytest.mark.parametrize(
    "n_rows, vocab, itemsize",
    [(8192, 128256, 2), (8192, 256000, 2), (16384, 151936, 2), (2048, 32000, 2), (4096, 50257, 4), (100000, 262208, 2)],
)
def test_default_budget_is_a_quarter_of_the_logits_and_at_most_a_gib(n_rows, vocab, itemsize):
    """The default chunk's logits (the op's extra memory) never exceed 1 GiB or a quarter of the whole logits
    (Inductor's extra at the same shape), and the chunks are the fewest that fit."""
    rows = chunk_rows(n_rows, vocab, itemsize)
    chunk = rows * vocab * itemsize
    assert chunk <= 1 << 30 and chunk * 4 <= n_rows * vocab * itemsize
    assert (
        chunk
        == chunk_rows(n_rows, vocab, itemsize, lce_module.logits_budget(n_rows, vocab, itemsize)) * vocab * itemsize
    )


def test_op_uses_chunk_rows(path, gen, monkeypatch):
    """The op splits the rows exactly as ``chunk_rows`` says, with the op's real default budget."""
    calls = []
    monkeypatch.setattr(lce_module, "chunk_rows", lambda *a: calls.append(a) or REAL_CHUNK_ROWS(*a))
    h, w, _ = make_inputs((3, 7), 24, 50, torch.float16, gen)
    run_fuser(h, w, None, make_labels(21, 50, gen))
    assert calls == [(21, 50, 2)]
    path.check([21])
    # the budget is read at call time: shrinking LOGITS_BUDGET_BYTES shrinks the chunks
    monkeypatch.setattr(lce_module, "LOGITS_BUDGET_BYTES", 64 * 50 * 2)
    h, w, _ = make_inputs((70,), 24, 50, torch.float16, gen)
    run_fuser(h, w, None, make_labels(70, 50, gen))
    path.check([40, 30])


@pytest.mark.parametrize("with_bias", [False, True])
def test_first_matmul_is_queued_before_the_gradient_scale(with_bias, gen, monkeypatch):
    """The first chunk's logits matmul comes before the labels' count (``_grad_scale``'s ``sum``) and the fills that
    follow it: queued first, those tiny kernels left the GPU idle before the matmul
    (lce_gaps_h100_2026-12-06.md). Every chunk still has exactly one logits matmul."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Order(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(lce_module, "chunk_rows", lambda *a: 32)  # 80 rows: chunks of 32, 32 and 16
    h, w, b = make_inputs((2, 40), 16, 30, torch.float32, gen, bias=True)
    labels = make_labels(80, 30, gen)
    with Order() as order:
        lce_module._forward_chunked(
            h, w, b if with_bias else None, labels, lce_module.CrossEntropy(-100, "mean", 1.0, 0.0),
            lce_module.GradsWanted(True, True, with_bias), lce_module.DweightOptions("cublas", "input", True), False,
        )  # fmt: skip
    matmul = "addmm" if with_bias else "mm"
    first = order.names.index(matmul)
    assert first < order.names.index("sum"), order.names
    assert first < order.names.index("ones_like"), order.names
    # per chunk: the logits (addmm with a bias), dW (mm for the first chunk, then addmm_) and dh (mm)
    if with_bias:
        assert order.names.count("addmm") == 3 and order.names.count("mm") == 4, order.names
    else:
        assert order.names.count("mm") == 7, order.names
    assert order.names.count("addmm_") == 2, order.names


def test_rejects_bad_arguments():
    h, w, b = torch.randn(2, 3, 8), torch.randn(10, 8), torch.randn(10)
    labels = torch.zeros(6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"weight \[V, H\] with H = hidden.shape\[-1\] = 8, got \(10, 7\)"):
        linear_cross_entropy(h, torch.randn(10, 7), labels)
    with pytest.raises(ValueError, match=r"weight \[V, H\]"):
        linear_cross_entropy(h, torch.randn(10, 8, 1), labels)
    with pytest.raises(ValueError, match=r"bias \[V\] = \[10\] of the weight's dtype torch.float32, got \(11,\)"):
        linear_cross_entropy(h, w, labels, bias=torch.randn(11))
    with pytest.raises(ValueError, match=r"bias .* got \(10,\) torch.float16"):
        linear_cross_entropy(h, w, labels, bias=torch.randn(10).half())
    with pytest.raises(ValueError, match=r"one label per row of hidden \(6\), got 5"):
        linear_cross_entropy(h, w, labels[:5])
    with pytest.raises(ValueError, match="integer labels, got torch.float32"):
        linear_cross_entropy(h, w, labels.float())
    with pytest.raises(ValueError, match="integer labels, got torch.bool"):
        linear_cross_entropy(h, w, labels.bool())
    with pytest.raises(ValueError, match="hidden and weight of one dtype, got torch.float16 and torch.float32"):
        linear_cross_entropy(h.half(), w, labels)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        torch.ops.fuser.linear_cross_entropy(h, w, b, labels, -100, "avg", 1.0, 0.0, False, False, False)


# ---------------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------------


def _opcheck_cases(gen):
    h, w, b = make_inputs((2, 5), 24, 50, torch.float32, gen, bias=True)
    labels = make_labels(10, 50, gen, n_ignored=2)
    h1, w1, _ = make_inputs((7,), 16, 33, torch.float32, gen)
    labels1 = make_labels(7, 33, gen, ignore_index=0, n_ignored=2)
    return {
        "all_grads_softcap": (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels, -100, "mean", 0.5,
                              30.0, True, True, True),
        "frozen_weight_sum": (h1.requires_grad_(), w1, None, labels1, 0, "sum", 0.125, 0.0, True, False, False),
        "only_weight": (h1.detach(), w1.detach().requires_grad_(), None, labels1, 0, "mean", 1.0, 2.0, False,
                        True, False),
        "no_grad": (h.detach(), w.detach(), b.detach(), labels, -100, "mean", 1.0, 0.0, False, False, False),
    }  # fmt: skip


@pytest.mark.parametrize("case", ["all_grads_softcap", "frozen_weight_sum", "only_weight", "no_grad"])
def test_opcheck(case, gen, triton_on_cpu):
    triton_on_cpu(False)
    # all of opcheck's default test_utils, test_aot_dispatch_dynamic included: the fake returns the real shapes
    torch.library.opcheck(torch.ops.fuser.linear_cross_entropy.default, _opcheck_cases(gen)[case])


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, bf16/fp16/fp32, against an fp32 (TF32 off) torch reference
# ---------------------------------------------------------------------------------------------------------

GPU_SHAPES = {
    "llama2_vocab": (4096, 2048, 32000),
    "llama3_vocab": (1024, 2048, 128256),
}
# (loss, dhidden, dweight) relative to an fp32 reference on the same rounded inputs. bf16 (u = 2^-9): the logits
# and their gradient are rounded to bf16 once each, as eager's are, and each matmul output once: a CPU simulation
# at V = 32000 measured 3.0e-3 (3.5e-3 with logits of std 6 under softcap 30) for fuser and eager alike, so 4e-3
# leaves little room; the eager comparison below is the sharper check. fp16 (u = 2^-11): measured 6.6e-4.
# fp32 with TF32 off: only fp32 sums of depth ≤ 128256.
GPU_TOL = {
    torch.bfloat16: (1e-3, 4e-3, 4e-3),
    torch.float16: (1e-3, 2e-3, 2e-3),
    torch.float32: (1e-5, 1e-4, 1e-4),
}


@pytest.fixture
def no_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def gpu_inputs(shape, dtype, gen):
    n_rows, hidden, vocab = shape
    h, w, _ = make_inputs((n_rows,), hidden, vocab, dtype, gen, logit_std=3.0, device="cuda")
    labels = make_labels(n_rows, vocab, gen, n_ignored=n_rows // 10, device="cuda")
    return h, w, labels


def run_gpu_fuser(h, w, labels, monkeypatch, **kw):
    launched = []
    real = lce_module._launch_chunk
    monkeypatch.setattr(lce_module, "_launch_chunk", lambda *a: launched.append(1) or real(*a))
    loss, grads = run_fuser(h, w, None, labels, (True, True, False), **kw)
    assert launched, "the Triton kernel did not run"
    return loss, grads


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap30"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(GPU_SHAPES.values()), ids=list(GPU_SHAPES))
def test_gpu_matches_fp32_reference(shape, dtype, softcap, gen, no_tf32, monkeypatch):
    h, w, labels = gpu_inputs(shape, dtype, gen)
    # fp16 with "mean" over 4096 rows puts c·(softmax − onehot) ~ 1/(T·V) below fp16's normal range (6e-5), in
    # eager too (CPU, 4096 × 64 × 32000: dhidden 1.9e-2 for both): fp16's range, not the op. "sum" keeps G in range
    # for the fixed tolerances; "mean" is covered against eager by the CPU tests.
    kw = {"softcap": softcap, "reduction": "sum" if dtype == torch.float16 else "mean"}
    loss, (dh, dw, _) = run_gpu_fuser(h, w, labels, monkeypatch, dw_accumulator="fp32", **kw)
    assert dh.dtype == dw.dtype == dtype
    ref_loss, ref_grads = run_model(h, w, None, labels, torch.float32, torch.float32, (True, True, False), **kw)
    tol_loss, tol_dh, tol_dw = GPU_TOL[dtype]
    errs = (
        assert_close("loss", loss, ref_loss, tol_loss),
        assert_close("hidden.grad", dh, ref_grads[0], tol_dh),
        assert_close("weight.grad", dw, ref_grads[1], tol_dw),
    )
    print(f"\n{shape} {dtype} {kw} fp32 accumulator: loss {errs[0]:.2e} dh {errs[1]:.2e} dW {errs[2]:.2e}; "
          f"addmm(out_dtype=fp32) used: {lce_module._ADDMM_OUT_DTYPE_OK}")  # fmt: skip
    if dtype == torch.float32:
        return
    # eager at the same dtype (logits upcast as Hugging Face does): fuser rounds where eager does, never more
    _, eager_grads = run_model(h, w, None, labels, dtype, torch.float32, (True, True, False), **kw)
    for name, err, eager, ref in zip(("hidden.grad", "weight.grad"), errs[1:], eager_grads, ref_grads, strict=False):
        eager_err = rel_err(eager, ref)
        assert err <= EAGER_FACTOR * eager_err + 1e-6, f"{name}: fuser {err:.3e} vs eager {eager_err:.3e}"
    # the "input" accumulator (one rounding of the running dweight per chunk): reported, not asserted
    _, (_, dw_input, _) = run_gpu_fuser(h, w, labels, monkeypatch, dw_accumulator="input", **kw)
    print(f"{shape} {dtype} {kw} input accumulator: dW {rel_err(dw_input, ref_grads[1]):.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("accumulator", ["fp32", "input"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_is_deterministic(dtype, accumulator, gen, monkeypatch):
    """Deterministic by default: without torch's deterministic mode (the NaN-fill fixture turns it on)."""
    torch.use_deterministic_algorithms(False)
    h, w, labels = gpu_inputs(GPU_SHAPES["llama2_vocab"], dtype, gen)
    first = run_gpu_fuser(h, w, labels, monkeypatch, softcap=30.0, dw_accumulator=accumulator)
    second = run_gpu_fuser(h, w, labels, monkeypatch, softcap=30.0, dw_accumulator=accumulator)
    assert torch.equal(first[0], second[0]), "the loss differs between two identical runs"
    for name, a, b in zip(("hidden.grad", "weight.grad"), first[1][:2], second[1][:2], strict=True):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2304, 4096])
def test_gpu_side_stream_changes_nothing(hidden, gen, monkeypatch):
    """``streams=True`` (the default) runs the weight gradient on a side stream, ``streams=False`` on the caller's
    stream, and the results are the same bit for bit (4 chunks: each waits for the previous one's matmuls)."""
    shape = (4096, hidden, 32000)
    monkeypatch.setattr(lce_module, "LOGITS_BUDGET_BYTES", shape[0] // 4 * shape[2] * 2)  # 4 chunks
    h, w, labels = gpu_inputs(shape, torch.bfloat16, gen)
    taken = []
    real = lce_module._side_stream
    monkeypatch.setattr(lce_module, "_side_stream", lambda *a: taken.append(real(*a)) or taken[-1])
    one = run_gpu_fuser(h, w, labels, monkeypatch, streams=False)
    assert all(s is None for s in taken)
    taken.clear()
    two = run_gpu_fuser(h, w, labels, monkeypatch, streams=True)
    assert len(taken) == 1 and taken[0] is not None, "no side stream with streams=True"
    assert torch.equal(one[0], two[0])
    for name, a, b in zip(("hidden.grad", "weight.grad"), one[1][:2], two[1][:2], strict=True):
        assert torch.equal(a, b), f"{name} differs with the side stream"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", list(GPU_SHAPES.values()), ids=list(GPU_SHAPES))
def test_gpu_triton_dweight_kernel(shape, dtype, gen, no_tf32, monkeypatch):
    """``dw_kernel="triton"`` at real shapes, over several chunks: the kernel ran on every chunk, dW is as
    close to the fp32 reference as GPU_TOL asks and within rounding of the cuBLAS path's, and the loss and
    dhidden (which the kernel does not touch) are the cuBLAS path's bit for bit."""
    monkeypatch.setattr(lce_module, "LOGITS_BUDGET_BYTES", shape[0] // 4 * shape[2] * 2)  # 4 chunks
    h, w, labels = gpu_inputs(shape, dtype, gen)
    kw = {"reduction": "sum" if dtype == torch.float16 else "mean"}  # fp16's range, as in the test above
    loss_ref, (dh_ref, dw_ref, _) = run_gpu_fuser(h, w, labels, monkeypatch, dw_kernel="cublas", **kw)
    firsts = []
    real = lce_module._launch_dweight
    monkeypatch.setattr(
        lce_module, "_launch_dweight", lambda dw, g, x, first: firsts.append(first) or real(dw, g, x, first)
    )
    loss, (dh, dw, _) = run_gpu_fuser(h, w, labels, monkeypatch, dw_kernel="triton", **kw)
    assert firsts == [True, False, False, False]
    assert torch.equal(loss, loss_ref) and torch.equal(dh, dh_ref)
    _, ref_grads = run_model(h, w, None, labels, torch.float32, torch.float32, (True, True, False), **kw)
    err = assert_close("weight.grad", dw, ref_grads[1], GPU_TOL[dtype][2])
    # both sum in fp32 and round the running sum once per chunk (4 roundings, random-signed: ~√4·u/√3 norm-wise)
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    diff = rel_err(dw, dw_ref)
    print(f"\n{shape} {dtype}: Triton dW {err:.2e} vs fp32; {diff:.2e} from cuBLAS's ({diff / u:.2f} u)")
    assert diff <= 2 * u, f"Triton dW is {diff / u:.2f} u from cuBLAS's"
