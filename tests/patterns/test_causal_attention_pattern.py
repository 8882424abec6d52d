"""Tier 1: an explicit causal mask passed to SDPA becomes ``is_causal=True`` — only when the mask is proved causal.

The graphs are written as Hugging Face transformers 5.17 and 5.25 build them under ``torch.compile`` (the mask from
``arange`` comparisons, expanded over the batch; captured from a tiny Llama and copied here by hand), and as
near-misses that must stay as written: a window with a hole, a two-sided band, a mask written in place, a padding
mask from the batch, a finite float fill, a random mask, unequal lengths. With dynamic shapes (a symbolic length)
the mask is proved for every length, and a mask that is causal at the traced length only stays as written.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import fuser
import fuser.patterns.causal_attention as module
from fuser.dynamo_backend import FuserBackend
from fuser.engine.rewrite import rewrite
from fuser.patterns import PATTERNS

B, H, T, D = 2, 4, 16, 8
STRICT = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler="aot_eager", strict=True)
RUNTIME_CHECK = {"experimental": {"causal_attention": {"runtime_check": True}}}
BLOCK_MASKS = fuser.FuserConfig(
    patterns=("causal_attention",),
    inner_compiler="aot_eager",
    strict=True,
    causal_attention={"block_sparse_masks": True},
)
WITHOUT_BLOCK_MASKS = fuser.FuserConfig(
    patterns=("causal_attention",),
    inner_compiler="aot_eager",
    strict=True,
    causal_attention={"block_sparse_masks": False},
)


def qkv(gen, t_q=T, t_k=T, dtype=torch.float32):
    q = torch.randn(B, H, t_q, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, H, t_k, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, H, t_k, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --- masks that are the causal mask --------------------------------------------------------------------------


def hf_5_17(q, k, v):  # transformers 5.17 under torch.compile: arange comparisons, expanded over the batch
    t = q.shape[-2]
    kv_idx = (torch.arange(t, device=q.device) + 0)[None, None, None, :]
    q_idx = (torch.arange(t, device=q.device) + 0)[None, None, :, None]
    mask = (kv_idx <= q_idx).expand(q.shape[0], -1, t, t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=0.3, is_causal=False)


def hf_5_25(q, k, v):  # transformers 5.25 under torch.compile: positions from arange, packed-sequence detection
    b, t = q.shape[0], q.shape[-2]
    positions = (torch.arange(t, device=q.device) + 0).unsqueeze(0)
    expanded = positions.expand(b, -1)
    packed = (torch.diff(expanded, prepend=expanded[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # 0 where none restart
    batch_idx = torch.arange(b, device=q.device)[:, None, None, None]
    q_idx = (torch.arange(t, device=q.device) + 0)[None, None, :, None]
    kv_idx = (torch.arange(t, device=q.device) + 0)[None, None, None, :]
    positions = positions.expand(b, -1)
    mask = q_idx.new_ones((), dtype=torch.bool) & (positions[batch_idx, kv_idx] <= positions[batch_idx, q_idx])
    mask = (mask & (packed[batch_idx, q_idx] == packed[batch_idx, kv_idx])).expand(b, -1, t, t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=0.3, is_causal=False)


def tril_bool(q, k, v):  # a plain [T, T] tril of ones
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, mask)


def float_minus_inf(q, k, v):  # additive float mask: 0 on and below the diagonal, -inf above
    mask = torch.full((q.shape[-2], q.shape[-2]), float("-inf"), device=q.device).triu(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn", [hf_5_17, hf_5_25, tril_bool, float_minus_inf], ids=lambda f: f.__name__)
def test_causal_masks_become_is_causal_and_train_the_same(fn, gen):
    q, k, v = qkv(gen)
    report = fuser.explain(fn, q, k, v, config=STRICT)
    assert report.counts == {"causal_attention": 1}, str(report)
    expected = fn(q, k, v)
    expected.square().sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fuser.backend(STRICT).results.clear()
    out = torch.compile(fn, backend=fuser.backend(STRICT))(q, k, v)
    assert fuser.backend(STRICT).counts == {"causal_attention": 1}
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for name, t, r in zip("qkv", (q, k, v), ref_grads, strict=True):
        torch.testing.assert_close(t.grad, r, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_rewritten_graph_calls_sdpa_with_is_causal(gen):
    """The rewritten graph has no mask left: SDPA is called with is_causal=True and the original scale."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((len(args), {k: v for k, v in kwargs.items() if k != "dropout_p"}))
        return real(*args, **kwargs)

    q, k, v = qkv(gen)
    gm, _ = rewrite(_capture(hf_5_17, q, k, v), [PATTERNS["causal_attention"]], fuser.FuserConfig())
    module.F.scaled_dot_product_attention = spy
    try:
        gm(*[x.detach() for x in (q, k, v)])
    finally:
        module.F.scaled_dot_product_attention = real
    assert calls == [(3, {"is_causal": True, "scale": 0.3})]


def _capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    assert len(graphs) == 1
    return graphs[0]


def test_mask_computed_outside_a_checkpointed_body(gen):
    """Activation checkpointing passes the mask into the checkpointed body as an input: it is followed back to the
    enclosing graph, proved causal there, and the training step equals eager."""

    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def model(q, k, v):
        t = q.shape[-2]
        mask = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        return torch.utils.checkpoint.checkpoint(attention, q * 2, k, v, mask, use_reentrant=False)

    q, k, v = qkv(gen)
    assert fuser.explain(model, q, k, v, config=STRICT).counts == {"causal_attention": 1}
    expected = model(q, k, v)
    expected.sum().backward()
    ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = torch.compile(model, backend=fuser.backend(STRICT))(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for t, r in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(t.grad, r, rtol=1e-5, atol=1e-5)


# --- near-misses: left as written, with the reason --------------------------------------------------------------


def window_with_a_hole(q, k, v):  # a causal window of 4 with one more key hidden from the last query
    i = torch.arange(q.shape[-2])
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
    hole = (i[:, None] == i[-1]) & (i[None, :] == i[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask & ~hole)


def causal_written_in_place(q, k, v):  # the causal mask's nodes, then one cell cleared in place: not causal
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    mask[-1, 0] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def band(q, k, v):  # a two-sided window: not causal
    i = torch.arange(q.shape[-2])
    mask = (i[:, None] - i[None, :]).abs() < 4
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def finite_fill(q, k, v):  # finfo.min, not -inf: not the same function as is_causal
    mask = torch.full((q.shape[-2], q.shape[-2]), torch.finfo(q.dtype).min).triu(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def random_mask(q, k, v):
    mask = torch.rand(q.shape[-2], q.shape[-2]) > 0.5
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def upper_triangle(q, k, v):  # anti-causal
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def one_batch_differs(q, k, v):  # causal for batch 0, a window for batch 1
    i = torch.arange(q.shape[-2])
    causal = i[None, :] <= i[:, None]
    mask = torch.stack([causal, causal & (i[:, None] - i[None, :] < 4)])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "fn, reason",
    [
        (window_with_a_hole, "neither the plain causal mask nor a causal sliding window"),
        (causal_written_in_place, "modified in place by the code `mask[-1, 0] = False`"),
        (band, "neither the plain causal mask nor a causal sliding window"),
        (finite_fill, "values other than 0 and -inf"),
        (random_mask, "random op"),
        (upper_triangle, "neither the plain causal mask nor a causal sliding window"),
        (one_batch_differs, "neither the plain causal mask nor a causal sliding window"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_masks_that_are_not_causal_are_declined(fn, reason, gen):
    q, k, v = qkv(gen)
    report = fuser.explain(fn, q, k, v, config=STRICT)
    assert report.counts == {}, str(report)
    reasons = [nm.reason for nm in report.near_misses if nm.pattern == "causal_attention"]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    out = torch.compile(fn, backend=fuser.backend(STRICT))(q, k, v)
    if fn is not random_mask:
        torch.testing.assert_close(out, fn(q, k, v))


def test_padding_mask_from_the_batch_is_declined(gen):
    def model(q, k, v, keep):
        i = torch.arange(q.shape[-2])
        mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(gen)
    keep = torch.ones(B, T, dtype=torch.bool)  # all ones today; its values are not known when compiling
    report = fuser.explain(model, q, k, v, keep, config=WITHOUT_BLOCK_MASKS)
    assert report.counts == {}
    assert any("depends on the graph input" in nm.reason for nm in report.near_misses), str(report)
    # with block_sparse_masks it runs on a block mask built from its values (FlexAttention on a GPU)
    report = fuser.explain(model, q, k, v, keep, config=BLOCK_MASKS)
    assert report.counts == {"causal_attention": 1} and report.matches[0].variant == "block-sparse mask", str(report)


def test_padding_mask_in_a_graph_for_any_length_runs_on_the_block_mask(gen):
    """A dynamic-shape graph (the second length of a padded run) fuses the padding mask too: the block mask's
    tensors come from an op whose output sizes follow the symbolic length, which Inductor does not lower (its
    lowering of the traced construction failed there)."""

    def model(q, k, v, keep):
        i = torch.arange(q.shape[-2], device=q.device)
        mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    backend = FuserBackend(BLOCK_MASKS)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for t in (T, 24):
        q, k, v = qkv(gen, t, t)
        keep = torch.ones(B, t, dtype=torch.bool)
        keep[0, -3:] = False
        torch.testing.assert_close(compiled(q, k, v, keep), model(q, k, v, keep), rtol=1e-5, atol=1e-6)
    assert len(backend.results) == 1 and backend.counts == {"causal_attention": 1}, backend.counts
    assert backend.results[0].matches[0].variant == "block-sparse mask"


def test_unequal_lengths_and_is_causal_already_set(gen):
    q, k, v = qkv(gen, t_q=8, t_k=T)

    def cross(q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    report = fuser.explain(cross, q, k, v, config=STRICT)
    assert report.counts == {} and "differs from key length" in report.near_misses[0].reason, str(report)

    def already(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv(gen)
    report = fuser.explain(already, q, k, v, config=STRICT)
    assert report.counts == {} and report.near_misses == [], str(report)


def _train_at_lengths(fn, backend, gen, lengths=(T, 24)):
    """Forward and backward of ``fn`` compiled with dynamic shapes, at each of ``lengths``, against eager."""
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for t in lengths:
        q, k, v = qkv(gen, t, t)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        expected = fn(q, k, v)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [hf_5_17, hf_5_25, tril_bool], ids=lambda f: f.__name__)
def test_dynamic_shapes_causal_mask_is_proved_for_every_length(fn, gen):
    """With a symbolic length the mask is proved causal by algebra on its index expressions (one graph serves
    every length), and each length trains as eagerly."""
    backend = FuserBackend(STRICT)
    _train_at_lengths(fn, backend, gen)
    assert len(backend.results) == 1 and backend.counts == {"causal_attention": 1}, backend.results


def causal_up_to_20(q, k, v):  # the causal mask, and keys past position 20 hidden: causal at the traced length only
    i = torch.arange(q.shape[-2], device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] < 20)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def wrapped_gather(q, k, v):  # each query's previous position, gathered at i - 1: the first wraps around to the last
    i = torch.arange(q.shape[-2], device=q.device)
    previous = i[i - 1]  # [T - 1, 0, 1, …]: the formula i - 1 holds except at 0, where query 0 then sees every key
    mask = i[None, :] <= previous[:, None] + 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_below_length(q, k, v):  # keys below the length: always true, decided by the indices' range
    t = q.shape[-2]
    i = torch.arange(t, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] < t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "fn, reason, static",
    [
        (causal_up_to_20, "neither the plain causal mask nor a causal sliding window at every length", True),
        (upper_triangle, "neither the plain causal mask nor a causal sliding window at every length", False),
        (window_with_a_hole, "indexes from the end", False),
        (band, "not read symbolically", False),
        (float_minus_inf, "not read symbolically", True),  # a float mask: proved at a static length only
        (wrapped_gather, "not proved inside a dim", False),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_dynamic_shapes_decline_a_mask_not_proved_for_every_length(fn, reason, static, gen):
    """``causal_up_to_20`` is the causal mask at the traced length 16 (the static graph proves it there), not past
    20: the dynamic graph, which serves every length, keeps it as written."""
    backend = FuserBackend(STRICT)
    _train_at_lengths(fn, backend, gen, lengths=(T, 24, 32))
    assert backend.counts == {}
    reasons = [nm.reason for r in backend.results for nm in r.near_misses]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert fuser.explain(fn, *qkv(gen), config=STRICT).counts == ({"causal_attention": 1} if static else {})


def test_dynamic_shapes_a_comparison_the_ranges_decide_is_read_as_its_value(gen):
    backend = FuserBackend(STRICT)
    _train_at_lengths(causal_below_length, backend, gen)
    assert backend.counts == {"causal_attention": 1}


# --- a mask from a graph input, checked at run time (causal_attention.runtime_check) ------------------------------


def padded(q, k, v, keep):  # transformers 5.17's mask with a padding mask from the batch
    i = torch.arange(q.shape[-2], device=q.device)
    mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_runtime_check_takes_the_branch_the_mask_calls_for(inner, gen):
    config = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler=inner, strict=True, **RUNTIME_CHECK)
    q, k, v = qkv(gen)
    keep = torch.ones(B, T, dtype=torch.bool)
    assert fuser.explain(padded, q, k, v, keep, config=config).counts == {"causal_attention": 1}
    compiled = torch.compile(padded, backend=fuser.backend(config))
    for case in ("nothing padded", "row 1 padded"):
        if case == "row 1 padded":
            keep[1, :5] = False  # the same compiled graph, the other branch
        for t in (q, k, v):
            t.grad = None
        expected = padded(q, k, v, keep)
        expected.square().sum().backward()
        ref = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        out = compiled(q, k, v, keep)
        out.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=case)
        for name, t, r in zip("qkv", (q, k, v), ref, strict=True):
            torch.testing.assert_close(t.grad, r, rtol=1e-5, atol=1e-5, msg=f"{case}: d{name}")
    assert fuser.backend(config).counts == {"causal_attention": 1}


def test_runtime_check_under_dynamic_lengths_fuses_and_takes_each_branch(gen):
    """Over three lengths Dynamo compiles the first statically and then one graph with a symbolic sequence length;
    that graph takes the run-time check too (the branch compares the mask's values, so its length need not be known
    when compiling), and each branch computes what the masked call would."""
    config = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler="aot_eager", strict=True, **RUNTIME_CHECK)
    backend = fuser.backend(config)
    compiled = torch.compile(padded, backend=backend)
    for t, padding in ((12, 0), (20, 3), (28, 0)):
        q, k, v = qkv(gen, t, t)
        keep = torch.ones(B, t, dtype=torch.bool)
        keep[1, :padding] = False
        out = compiled(q, k, v, keep)
        out.square().sum().backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        expected = padded(q, k, v, keep)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for name, x, got in zip("qkv", (q, k, v), grads, strict=True):
            torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-5, msg=f"t={t}: d{name}")
    lengths = [m.found.bindings["q"].meta["example_value"].shape[-2] for r in backend.results for m in r.matches]
    assert len(backend.results) == 2 and len(lengths) == 2, backend.report()
    assert lengths[0] == 12 and not isinstance(lengths[1], int), lengths


def test_runtime_check_calls_is_causal_only_for_the_causal_mask(gen, monkeypatch):
    """The device-side predicate is True for an all-ones padding mask and False once a key is padded (seen through
    a stand-in for torch.cond that records it and runs the branch it picks)."""
    config = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler="eager", strict=True, **RUNTIME_CHECK)
    picked = []

    def recording_cond(pred, true_fn, false_fn, operands):
        picked.append(bool(pred))
        return (true_fn if pred else false_fn)(*operands)

    q, k, v = (t.detach() for t in qkv(gen))
    keep = torch.ones(B, T, dtype=torch.bool)
    compiled = torch.compile(padded, backend=fuser.backend(config))
    monkeypatch.setattr(module.torch, "cond", recording_cond)
    out_causal = compiled(q, k, v, keep)
    torch.testing.assert_close(out_causal, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    keep[0, :2] = False
    torch.testing.assert_close(compiled(q, k, v, keep), padded(q, k, v, keep))
    assert picked == [True, False], picked


def test_runtime_check_declines_what_it_cannot_branch_around(gen):
    config = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler="aot_eager", strict=True, **RUNTIME_CHECK)
    q, k, v = qkv(gen)
    keep = torch.ones(B, T, dtype=torch.bool)

    def float_mask(q, k, v, keep):
        i = torch.arange(q.shape[-2])
        allowed = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def with_dropout(q, k, v, keep):
        i = torch.arange(q.shape[-2])
        mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)

    def checkpointed(q, k, v, keep):
        i = torch.arange(q.shape[-2])
        mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        body = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
        return torch.utils.checkpoint.checkpoint(body, q, k, v, mask, use_reentrant=False)

    for fn, reason in ((float_mask, "bool masks"), (with_dropout, "dropout"), (checkpointed, "nested body")):
        report = fuser.explain(fn, q, k, v, keep, config=config)
        assert report.counts == {}, f"{fn.__name__}: {report}"
        reasons = [nm.reason for nm in report.near_misses if nm.pattern == "causal_attention"]
        assert any(reason in r for r in reasons), f"{fn.__name__}: {reasons}"


@pytest.mark.gpu
@pytest.mark.parametrize("runtime_check", [False, True])
def test_gpu_causal_rewrites_through_inductor(runtime_check):
    """On CUDA (flash / cuDNN kernels), bf16, through Inductor: the constant mask and, with the run-time check, the
    padding-mask form give eager's values and gradients (to bf16 attention's rounding) in both branches."""
    config = fuser.FuserConfig(
        patterns=("causal_attention",), strict=True, experimental={"causal_attention": {"runtime_check": runtime_check}}
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 8, 512, 64)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
    keep = torch.ones(2, 512, dtype=torch.bool, device="cuda")
    cases = [(hf_5_17, (q, k, v))] + ([(padded, (q, k, v, keep))] if runtime_check else [])
    for fn, args in cases:
        compiled = torch.compile(fn, backend=fuser.backend(config))
        for step in range(2 if fn is padded else 1):
            if step == 1:
                keep[1, :100] = False
            for t in (q, k, v):
                t.grad = None
            expected = fn(*args)
            expected.float().square().sum().backward()
            ref = [t.grad.float().clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            out = compiled(*args)
            out.float().square().sum().backward()
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
            for t, r in zip((q, k, v), ref, strict=True):
                assert ((t.grad.float() - r).norm() / r.norm()).item() < 2e-2
    assert fuser.backend(config).counts == {"causal_attention": len(cases)}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_block_sparse_masks_through_inductor(dtype, head_dim, monkeypatch):
    """A mask from graph inputs on FlexAttention with a block mask from its values (``block_sparse_masks``, the
    default), through Inductor at a real attention's widths: nothing padded, right padding and left padding, forward
    and every gradient no further from an fp32 masked SDPA than the masked SDPA in ``dtype`` is (with 2x slack for
    the other summation order: both are one rounding of the same fp32 sums), on every query row the mask leaves a
    key (a row it hides entirely is a pad's, and the two kernels fill it differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = fuser.FuserConfig(
        patterns=("causal_attention",), strict=True, causal_attention={"block_sparse_masks": True}
    )
    b, h, t, d = 2, 8, 1024, head_dim
    monkeypatch.setattr(module, "MAX_FLEX_HEAD_DIM", max(module.MAX_FLEX_HEAD_DIM, head_dim))  # is 256 usable?
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    compiled = torch.compile(padded, backend=fuser.backend(config))
    for case in ("nothing padded", "right padded", "left padded"):
        keep = torch.ones(b, t, dtype=torch.bool, device="cuda")
        if case == "right padded":
            keep[1, 700:] = False
        elif case == "left padded":
            keep[1, :300] = False
        rows = torch.ones(b, 1, t, 1, dtype=torch.bool, device="cuda")
        if case == "left padded":
            rows[1, :, :300] = False  # queries before the first real key see nothing
        grad = torch.randn(b, h, t, d, device="cuda", dtype=dtype, generator=gen) * rows
        results = {}
        for name, fn, cast in (("fp32", padded, torch.float32), ("eager", padded, dtype), ("fuser", compiled, dtype)):
            inputs = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
            out = fn(*inputs, keep)
            out.backward(grad.to(cast))
            results[name] = [out.detach(), *(x.grad for x in inputs)]
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            keep_rows = rows if i == 0 else 1
            ref = results["fp32"][i].double() * keep_rows
            err = {n: rel_err(results[n][i].double() * keep_rows, ref) for n in ("eager", "fuser")}
            print(f"block-sparse {dtype} d={d} {case} {what}: {err}")
            assert err["fuser"] <= 2 * err["eager"] + 1e-6, f"{case} {what}: {err}"
    assert fuser.backend(config).counts.get("causal_attention", 0) >= 1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
