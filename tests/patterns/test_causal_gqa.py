"""causal_attention's grouped-query fold (``options={"experimental.causal_attention.gqa_fold": True}``): a proved-causal
SDPA call on transformers' ``repeat_kv`` copies is given the unexpanded k and v with ``enable_gqa=True``. Same values
and gradients as the call as written; forms with another head order (``repeat``'s tiling) are left alone; on by
default."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.patterns.causal_attention as module
from fuser.engine.rewrite import rewrite
from fuser.patterns import PATTERNS
from tests.models import tiny

B, H, KV, T, D = 2, 6, 2, 16, 8
STRICT = fuser.FuserConfig(
    patterns=("causal_attention",),
    inner_compiler="aot_eager",
    strict=True,
    experimental={"causal_attention": {"gqa_fold": False}},
)
FOLD = fuser.FuserConfig(
    patterns=("causal_attention",),
    inner_compiler="aot_eager",
    strict=True,
    experimental={"causal_attention": {"gqa_fold": True}},
)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def qkv(gen):
    q = torch.randn(B, H, T, D, generator=gen).requires_grad_()
    k = torch.randn(B, KV, T, D, generator=gen).requires_grad_()
    v = torch.randn(B, KV, T, D, generator=gen).requires_grad_()
    return q, k, v


def causal_mask(q):  # transformers 5.17 under torch.compile: arange comparisons, expanded over the batch
    t = q.shape[-2]
    kv_idx = torch.arange(t, device=q.device)[None, None, None, :]
    q_idx = torch.arange(t, device=q.device)[None, None, :, None]
    return (kv_idx <= q_idx).expand(q.shape[0], -1, t, t)


def repeat_kv(x, n):  # transformers' own
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def hf_repeat_kv(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=causal_mask(q), scale=0.3)


def unsqueeze_form(q, k, v):  # the same expansion spelled with unsqueeze and torch.reshape
    b, h, s, d = k.shape
    n = q.shape[1] // h
    k2 = torch.reshape(k.unsqueeze(2).expand(b, h, n, s, d), (b, h * n, s, d))
    v2 = torch.reshape(v.unsqueeze(2).expand(b, h, n, s, d), (b, h * n, s, d))
    return F.scaled_dot_product_attention(q, k2, v2, attn_mask=causal_mask(q))


def tiled(q, k, v):  # head i reads kv head i % kv_heads: not what enable_gqa computes
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1), attn_mask=causal_mask(q))


def head_major(q, k, v):  # the new dim in front of the heads: again head i % kv_heads
    b, h, s, d = k.shape
    n = q.shape[1] // h
    k2 = k[:, None].expand(b, n, h, s, d).reshape(b, n * h, s, d)
    v2 = v[:, None].expand(b, n, h, s, d).reshape(b, n * h, s, d)
    return F.scaled_dot_product_attention(q, k2, v2, attn_mask=causal_mask(q))


def sdpa_calls(fn, q, k, v, config):
    """(key heads, enable_gqa, is_causal) of each SDPA call the graph of ``fn`` makes, rewritten as ``config``
    asks."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, [x.detach() for x in example_inputs]))  # Dynamo orders inputs by first use
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(q, k, v)
    (captured, inputs), *_ = graphs
    gm, _ = rewrite(captured, [PATTERNS["causal_attention"]], config)
    calls, real = [], F.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((key.shape[1], kwargs.get("enable_gqa", False), kwargs.get("is_causal", False)))
        return real(query, key, value, *args, **kwargs)

    module.F.scaled_dot_product_attention = spy
    try:
        gm(*inputs)
    finally:
        module.F.scaled_dot_product_attention = real
    return calls


def train_the_same(fn, q, k, v, config):
    expected = fn(q, k, v)
    expected.square().sum().backward()
    ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fuser.backend(config).results.clear()
    out = torch.compile(fn, backend=fuser.backend(config))(q, k, v)
    assert fuser.backend(config).counts == {"causal_attention": 1}
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for name, t, r in zip("qkv", (q, k, v), ref, strict=True):
        torch.testing.assert_close(t.grad, r, rtol=1e-5, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("fn", [hf_repeat_kv, unsqueeze_form], ids=lambda f: f.__name__)
def test_repeat_kv_is_folded_into_enable_gqa(fn, gen):
    q, k, v = qkv(gen)
    assert sdpa_calls(fn, q, k, v, FOLD) == [(KV, True, True)]
    train_the_same(fn, q, k, v, FOLD)


@pytest.mark.parametrize("fn", [tiled, head_major], ids=lambda f: f.__name__)
def test_other_head_orders_are_not_folded(fn, gen):
    q, k, v = qkv(gen)
    assert sdpa_calls(fn, q, k, v, FOLD) == [(H, False, True)]  # causal still, on the copies as written
    train_the_same(fn, q, k, v, FOLD)


def test_on_by_default_and_off_by_name(gen):
    q, k, v = qkv(gen)
    assert fuser.FuserConfig().experimental.causal_attention.gqa_fold is True
    assert sdpa_calls(
        hf_repeat_kv, q, k, v, fuser.FuserConfig(experimental={"causal_attention": {"gqa_fold": False}})
    ) == [(H, False, True)]
    assert sdpa_calls(hf_repeat_kv, q, k, v, STRICT) == [(H, False, True)]  # STRICT: the fold off by name
    assert sdpa_calls(hf_repeat_kv, q, k, v, fuser.FuserConfig()) == sdpa_calls(hf_repeat_kv, q, k, v, FOLD)


def test_llama_step_the_same_and_saves_the_unexpanded_kv():
    """A tiny GQA Llama (4 query heads, 2 kv heads, use_cache=False as in training): one fp32 step through fuser
    with the fold equals eager; the partitioner then saves k and v with 2 heads, not their 4-head copies."""

    def build():
        return tiny.from_config("LlamaConfig", {"attn_implementation": "sdpa", "use_cache": False})

    tiny.assert_training_step_equals_eager(build(), FOLD)

    def kv_sized(fold: bool) -> list[tuple[int, ...]]:
        model, ids = build(), torch.randint(0, tiny.VOCAB, (2, 8))
        saved = tiny.load_saved_activations().saved_for_backward(
            model,
            (),
            {"input_ids": ids, "labels": ids},
            [PATTERNS["causal_attention"]],
            config=fuser.FuserConfig(experimental={"causal_attention": {"gqa_fold": fold}}),
        )
        return sorted(shape for _, shape in saved if len(shape) == 4 and shape[-1] == 16)  # head_dim 16

    # per layer (2 layers): q's 4 heads saved either way; k and v as 4-head copies without the fold, 2-head with it
    heads_unfolded, heads_folded = ([s[1] for s in kv_sized(fold)] for fold in (False, True))
    assert heads_unfolded.count(4) >= heads_folded.count(4) + 4
    assert heads_folded.count(2) >= 4


@pytest.mark.gpu
def test_gpu_folded_call_through_inductor():
    """On CUDA, bf16, through Inductor: the folded call gives eager's values and gradients (to bf16 rounding)."""
    config = fuser.FuserConfig(
        patterns=("causal_attention",), strict=True, experimental={"causal_attention": {"gqa_fold": True}}
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 512, 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 8, 512, 64, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    expected = hf_repeat_kv(q, k, v)
    expected.float().square().sum().backward()
    ref = [t.grad.float().clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = torch.compile(hf_repeat_kv, backend=fuser.backend(config))(q, k, v)
    out.float().square().sum().backward()
    assert fuser.backend(config).counts == {"causal_attention": 1}
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    for t, r in zip((q, k, v), ref, strict=True):
        assert ((t.grad.float() - r).norm() / r.norm()).item() < 2e-2
