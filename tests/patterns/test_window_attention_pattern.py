"""A causal sliding-window mask passed to SDPA becomes :func:`fuser.kernels.window_attention.window_sdpa`, only when
the mask is proved to be that window (``causal_attention`` pattern, ``sliding_window`` switch).

On the CPU ``window_sdpa`` runs the masked SDPA with the window it was given, so a wrong window or a wrong kv-head
mapping shows as a different result from eager's; the GPU tests of ``tests/kernels/test_window_attention.py`` cover
the FlashAttention kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser.kernels import window_attention as W

B, HQ, HKV, T, D = 2, 4, 2, 16, 8
STRICT = fuser.FuserConfig(patterns=("causal_attention",), inner_compiler="aot_eager", strict=True)


def inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=gen).requires_grad_()
    k = torch.randn(B, HKV, T, D, generator=gen).requires_grad_()
    v = torch.randn(B, HKV, T, D, generator=gen).requires_grad_()
    return q, k, v


def repeat_kv(x, n_rep):  # transformers' spelling
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def hf_sliding(q, k, v, window=5, dropout_p=0.0):
    """transformers' sliding_window_causal mask under torch.compile: arange comparisons, expanded over the batch."""
    t = q.shape[-2]
    kv_idx = torch.arange(t, device=q.device)[None, None, None, :]
    q_idx = torch.arange(t, device=q.device)[None, None, :, None]
    mask = ((kv_idx <= q_idx) & (kv_idx > q_idx - window)).expand(q.shape[0], -1, t, t)
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask, dropout_p=dropout_p, scale=0.3
    )


@pytest.mark.parametrize("window", [1, 5, T - 1])
def test_sliding_window_is_rewritten_and_equal(window):
    q, k, v = inputs(window)
    report = fuser.explain(hf_sliding, q, k, v, window, config=STRICT)
    assert report.counts == {"causal_attention": 1}, str(report)
    compiled = torch.compile(hf_sliding, backend=fuser.backend(STRICT))
    out = compiled(q, k, v, window)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = hf_sliding(q, k, v, window)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_the_replacement_gets_the_window_and_the_unexpanded_heads(monkeypatch):
    seen = []

    def spy(query, key, value, window, dropout_p=0.0, scale=None, enable_gqa=False):
        seen.append((tuple(key.shape), window, scale, enable_gqa))
        return W.window_sdpa(query, key, value, window, dropout_p, scale, enable_gqa)

    monkeypatch.setattr("fuser.patterns.causal_attention.window_sdpa", spy)
    q, k, v = inputs(3)
    torch.compile(hf_sliding, backend=fuser.backend(STRICT))(q, k, v, 6)
    assert seen and set(seen) == {((B, HKV, T, D), 6, 0.3, True)}  # traced once per pass, always so


def test_a_window_as_long_as_the_sequence_is_plain_causal():
    q, k, v = inputs(4)
    report = fuser.explain(hf_sliding, q, k, v, T, config=STRICT)
    assert report.counts == {"causal_attention": 1}


def test_switched_off_and_dropout_are_declined():
    q, k, v = inputs(5)
    off = fuser.FuserConfig(
        patterns=("causal_attention",), inner_compiler="aot_eager", causal_attention={"sliding_window": False}
    )
    report = fuser.explain(hf_sliding, q, k, v, 5, config=off)
    assert report.counts == {}
    assert any("sliding window of 5 keys (causal_attention.sliding_window is off)" in nm.reason
               for nm in report.near_misses), str(report)  # fmt: skip
    report = fuser.explain(hf_sliding, q, k, v, 5, 0.1, config=STRICT)
    assert report.counts == {}
    assert any("with dropout" in nm.reason for nm in report.near_misses), str(report)


def test_gemma3_sliding_layers_train_as_in_eager():
    """A tiny Gemma-3 (two sliding layers of window 4, one global): both sliding layers are rewritten, and one fp32
    training step gives eager's loss and gradients."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    config = fuser.FuserConfig(inner_compiler="aot_eager")
    report = fuser.explain(model, input_ids=ids, labels=ids, config=config)
    # the two sliding layers become windows of 4, shown so in the report; the global layer's causal mask may be
    # rewritten to is_causal or be passed as is_causal by transformers already (versions differ), never a window
    windows = sorted(m.module for m in report.matches if m.variant == "window 4")
    assert len(windows) == 2 and "layers.0." in windows[0] and "layers.1." in windows[1], str(report)
    assert "window 4" in str(report)
    assert all(m.variant in ("window 4", "explicit mask") for m in report.matches if m.pattern == "causal_attention")

    eager_loss = model(input_ids=ids, labels=ids).loss
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    fused = fuser.optimize(model, config)
    loss = fused(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_operands_the_window_op_does_not_take_are_declined():
    """3-D q/k/v (no batch dim) and a key with one head broadcast over the query's: SDPA takes both, the window op
    neither, so the call stays as written (and still computes eager's values)."""

    def unbatched(q, k, v):
        i = torch.arange(q.shape[-2])
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 5)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(HQ, T, D, generator=gen) for _ in range(3))
    report = fuser.explain(unbatched, q, k, v, config=STRICT)
    assert report.counts == {}
    assert any("not all [batch, heads, tokens, head_dim]" in nm.reason for nm in report.near_misses), str(report)
    torch._dynamo.reset()  # new shapes below: a fresh static compile, not a dynamic recompile
    q, k, v = (torch.randn(B, h, T, D, generator=gen) for h in (HQ, 1, 1))
    report = fuser.explain(unbatched, q, k, v, config=STRICT)
    assert report.counts == {}
    assert any("without enable_gqa" in nm.reason for nm in report.near_misses), str(report)
    torch._dynamo.reset()
    out = torch.compile(unbatched, backend=fuser.backend(STRICT))(q, k, v)
    torch.testing.assert_close(out, unbatched(q, k, v))


# sliding-window families beside Gemma-3, each as its config spells the window (a tiny random model, window 8 at 24
# tokens, so every sliding layer's mask is narrower than the sequence)
WINDOW_ARCHS = {
    "mistral": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen3": {"use_sliding_window": True, "max_window_layers": 0},
    "starcoder2": {},
    "phi3": {"pad_token_id": 0},  # its default pad id (32000) is outside the tiny vocabulary
    "cohere2": {},
    "olmo3": {},
    "exaone4": {},
}


@pytest.mark.parametrize("model_type", list(WINDOW_ARCHS))
def test_sliding_window_families_train_as_in_eager(model_type):
    """Every sliding layer of each family is rewritten to a window of 8 (named so in the report), no other
    causal_attention rewrite is a window, and one fp32 training step gives eager's loss and gradients."""
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        attn_implementation="sdpa", use_cache=False, **WINDOW_ARCHS[model_type],
    )  # fmt: skip
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError) as e:  # a transformers without this family
        pytest.skip(f"{model_type}: {e}")
    layer_types = getattr(cfg, "layer_types", None)  # none: the window applies to every layer (Mistral's config)
    sliding = [t == "sliding_attention" for t in layer_types] if layer_types else [True] * cfg.num_hidden_layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    config = fuser.FuserConfig(inner_compiler="aot_eager")
    report = fuser.explain(model, input_ids=ids, labels=ids, config=config)
    windows = [m.module for m in report.matches if m.variant == "window 8"]
    assert len(windows) == sum(sliding) > 0, str(report)
    for i, is_sliding in enumerate(sliding):
        assert sum(f"layers.{i}." in w for w in windows) == int(is_sliding), str(report)
    assert all(m.variant in ("window 8", "explicit mask") for m in report.matches if m.pattern == "causal_attention")

    params = list(model.parameters())
    eager_loss = model(input_ids=ids, labels=ids).loss
    eager_grads = torch.autograd.grad(eager_loss, params)
    fused = fuser.optimize(model, config)
    loss = fused(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [5, 4096])
def test_sliding_window_with_dynamic_shapes(window):
    """A second length recompiles with a symbolic one, where the window is proved for every length: a window longer
    than the traced sequences (the causal mask at their lengths) is still the window, which a longer one sees."""
    backend = fuser.dynamo_backend.FuserBackend(STRICT)
    compiled = torch.compile(hf_sliding, backend=backend)
    gen = torch.Generator().manual_seed(window)
    for t in (T, 24, 32):
        q = torch.randn(B, HQ, t, D, generator=gen).requires_grad_()
        k, v = (torch.randn(B, HKV, t, D, generator=gen).requires_grad_() for _ in range(2))
        out = compiled(q, k, v, window)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected = hf_sliding(q, k, v, window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert [r.recompile for r in backend.results] == [False, True]
    # the static graph of length 16 proves a window of 4096 to be the causal mask there
    static = "explicit mask" if window > T else f"window {window}"
    assert [m.variant for r in backend.results for m in r.matches] == [static, f"window {window}"], [
        nm.reason for r in backend.results for nm in r.near_misses
    ]
