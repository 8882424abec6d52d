"""Tier 1 and 3: attention written by hand (matmul, softmax, matmul; ``nn.MultiheadAttention`` returning its weights)
becomes ``F.scaled_dot_product_attention`` — only where the call is the same function of its inputs.

Each form is written as the model code it comes from (BLIP's vision and text attention, transformers'
``eager_attention_forward``, a CLIP-style tower's ``bmm`` on a pre-scaled q, ``nn.MultiheadAttention``'s ``baddbmm``,
GOT-OCR2's relative-position bias computed from q); the near-misses are declined with their reason and left as
written. fp32 training steps equal eager within 1e-5 relative (loss and every gradient, the mask's included); bf16 and
fp16 are no further from an fp64 reference than eager is (``tests/models/harness.py``'s rule for half dtypes).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.patterns.softmax_attention as module
from fuser.engine.rewrite import rewrite
from fuser.patterns import PATTERNS
from tests.models.harness import assert_no_further_than_eager
from tests.models.tiny import grads, load_benchmark, rel, vision_loss

B, H, L, S, E = 2, 4, 7, 9, 8  # queries and keys of other lengths: a form that mixes them up fails
STRICT = fuser.FuserConfig(patterns=("softmax_attention",), inner_compiler="aot_eager", strict=True)
FP32_TOL = 1e-5
HALF_FACTOR, HALF_FLOOR = 1.5, 4e-3  # tests/models/test_rms_norm.py: half precision against the higher precision


def blip_vision(q, k, v, mask):  # BlipAttention: scores * scale, nn.Dropout (off), matmul
    scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    probs = F.dropout(F.softmax(scores, dim=-1), 0.0, True, False)
    return torch.matmul(probs, v)


def blip_text(q, k, v, mask):  # BlipTextSelfAttention: / sqrt(d), an additive mask, nn.Softmax(dim=-1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(E) + mask
    return torch.matmul(torch.nn.Softmax(dim=-1)(scores), v)


def eager_attention_forward(q, k, v, mask):  # transformers' (GIT's vision tower): the softmax in fp32, cast back
    scores = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=0.1, training=False), v)


def clip_bmm(q, k, v, mask):  # a CLIP-style tower: q scaled first, heads folded into the batch, bmm
    q3, k3, v3 = (t.reshape(B * H, -1, t.shape[-1]) for t in (q * 0.3, k, v))
    probs = torch.bmm(q3, k3.transpose(1, 2)).softmax(-1)
    return torch.bmm(probs, v3)


def mha_baddbmm(q, k, v, mask):  # nn.MultiheadAttention's body with need_weights: baddbmm(mask, q_scaled, kᵀ)
    q3, k3, v3 = (t.reshape(B * H, -1, t.shape[-1]) for t in (q, k, v))
    scores = torch.baddbmm(mask.expand(B, H, L, S).reshape(B * H, L, S), q3 * E**-0.5, k3.transpose(-2, -1))
    return torch.bmm(F.softmax(scores, dim=-1), v3)


def relative_bias(q, k, v, mask):  # GOT-OCR2 (SAM): q scaled first, a bias computed from q itself (it has a gradient)
    bias = torch.einsum("bhle,se->bhls", q, k[0, 0])
    return F.softmax((q * 0.3) @ k.mT + bias, dim=-1) @ v


def other_spellings(q, k, v, mask):  # methods, torch.softmax over dim 2 of 3-d scores, torch.dropout, swapaxes
    q3, k3, v3 = (t.reshape(B * H, -1, t.shape[-1]) for t in (q, k, v))
    scores = q3.bmm(torch.swapaxes(k3, 1, 2)).mul(0.25)
    return torch.dropout(torch.softmax(scores, dim=2), 0.1, False).matmul(v3)


def baddbmm_method(q, k, v, mask):  # mask.baddbmm(q, kᵀ, beta=1, alpha=1), kᵀ as .mT
    q3, k3, v3 = (t.reshape(B * H, -1, t.shape[-1]) for t in (q, k, v))
    scores = mask.expand(B, H, L, S).reshape(B * H, L, S).baddbmm(q3 * 0.3, k3.mT, beta=1, alpha=1)
    return torch.bmm(scores.softmax(-1), v3)


FORMS = [blip_vision, blip_text, eager_attention_forward, clip_bmm, mha_baddbmm, relative_bias]
FORMS += [other_spellings, baddbmm_method]


def inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Fresh q, k, v and a float mask (a padded key for the second sample), each requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g)
    k, v = (torch.randn(B, H, S, E, generator=g) for _ in range(2))
    mask = torch.randn(B, 1, L, S, generator=g)
    mask[1, :, :, -2:] = torch.finfo(torch.float32).min  # HF's padding fill, not -inf
    return [t.to(dtype).requires_grad_() for t in (q, k, v, mask)]


def step(fn, tensors, weight):
    """(loss, every input's gradient) of ``(fn(*tensors) * weight).sum()``: a weighted sum, so no gradient is flat."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    loss = (fn(*tensors).to(weight.dtype) * weight).sum()
    loss.backward()
    return loss.detach(), {name: t.grad for name, t in zip("qkvm", tensors, strict=True) if t.grad is not None}


def assert_fp32_step_equals_eager(fn, tensors, expected_count=1):
    weight = torch.randn(fn(*tensors).shape, generator=torch.Generator().manual_seed(3))
    eager = step(fn, tensors, weight)
    torch._dynamo.reset()  # compiled afresh, so the counts are this compile's
    fuser.backend(STRICT).results.clear()
    fused = step(torch.compile(fn, backend=fuser.backend(STRICT)), tensors, weight)
    assert fuser.backend(STRICT).counts == {"softmax_attention": expected_count}
    assert rel(fused[0], eager[0]) <= FP32_TOL, (fused[0], eager[0])
    assert fused[1].keys() == eager[1].keys() and fused[1]
    for name, g in eager[1].items():
        assert rel(fused[1][name], g) <= FP32_TOL, f"d{name}: {rel(fused[1][name], g):.2e}"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fn", FORMS, ids=lambda f: f.__name__)
def test_forms_become_sdpa_and_train_the_same(fn):
    tensors = inputs()
    report = fuser.explain(fn, *tensors, config=STRICT)
    assert report.counts == {"softmax_attention": 1}, str(report)
    for seed in (1, 2):  # fresh random inputs for each step
        assert_fp32_step_equals_eager(fn, inputs(seed))


def test_mask_gradient_equals_eager():
    """A mask that requires grad (a learned bias): SDPA's mask gradient equals eager's on the CPU."""
    tensors = inputs(4)
    _, eager = step(blip_text, tensors, torch.ones(B, H, L, E))
    assert "m" in eager
    assert_fp32_step_equals_eager(blip_text, tensors)


@pytest.mark.parametrize(
    "fn, scale, masked",
    [(blip_vision, 0.25, False), (blip_text, 1 / math.sqrt(E), True), (clip_bmm, 1.0, False)],
    ids=["scale after", "divided, masked", "q scaled first"],
)
def test_rewritten_graph_calls_sdpa_with_the_scale_and_mask(fn, scale, masked, monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, scale=None):
        calls.append((tuple(k.shape), attn_mask is not None, scale))
        return real(q, k, v, attn_mask=attn_mask, scale=scale)

    captured, graph_inputs = _capture(fn, *inputs())
    gm, result = rewrite(captured, [PATTERNS["softmax_attention"]], fuser.FuserConfig())
    assert [m.pattern for m in result.matches] == ["softmax_attention"]
    assert not any(getattr(n.target, "__name__", "") == "softmax" for n in gm.graph.nodes)
    monkeypatch.setattr(module.F, "scaled_dot_product_attention", spy)
    gm(*[t.detach() for t in graph_inputs])
    keys = (B * H, S, E) if fn is clip_bmm else (B, H, S, E)
    assert len(calls) == 1 and calls[0][:2] == (keys, masked)
    assert calls[0][2] == pytest.approx(scale, rel=1e-12)


def _capture(fn, *args):
    """The one graph Dynamo captures of ``fn(*args)``, and its inputs (those of ``args`` it reads)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [blip_text, eager_attention_forward, clip_bmm], ids=lambda f: f.__name__)
def test_half_precision_no_further_from_fp64_than_eager(fn, dtype):
    tensors = inputs(5, dtype)
    weight = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(3)).reshape(fn(*tensors).shape)
    reference = step(fn, [t.double() for t in tensors], weight.double())
    eager = step(fn, tensors, weight)
    fused = step(torch.compile(fn, backend=fuser.backend(STRICT)), tensors, weight)
    assert fuser.backend(STRICT).counts.get("softmax_attention", 0) >= 1
    assert_no_further_than_eager(fused, eager, reference, HALF_FACTOR, HALF_FLOOR)


def test_under_autocast_no_further_from_fp64_than_eager():
    """``Trainer(bf16=True)``: autocast runs the products in bf16 and the softmax in fp32 (an autocast matmul reads the
    probabilities at bf16, as SDPA's kernels do); the fused step is no further from fp64 than eager autocast's."""

    def attention(projection, x):
        q = projection(x)
        return blip_vision(q, q * 0.5, q * 2.0, None)

    torch.manual_seed(0)
    projection = torch.nn.Linear(E, E)
    x = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(6))
    weight = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(3))

    def train_step(run, dtype=torch.float32, autocast=True):
        layer = copy.deepcopy(projection).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = run(layer, x.to(dtype))
        loss = (out.to(dtype) * weight.to(dtype)).sum()
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in layer.named_parameters()}

    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fuser.explain(attention, projection, x, config=STRICT)
    assert report.counts == {"softmax_attention": 1}, str(report)
    reference = train_step(attention, torch.float64, autocast=False)
    eager = train_step(attention)
    fuser.backend(STRICT).results.clear()
    fused = train_step(torch.compile(attention, backend=fuser.backend(STRICT)))
    assert fuser.backend(STRICT).counts == {"softmax_attention": 1}
    assert_no_further_than_eager(fused, eager, reference, HALF_FACTOR, HALF_FLOOR)


# --- nn.MultiheadAttention -------------------------------------------------------------------------------------


class Pooling(torch.nn.Module):
    """SigLIP's pooling head: a probe attends over the tokens through nn.MultiheadAttention, whose output is [0]."""

    def __init__(self, need_weights: bool, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.probe = torch.nn.Parameter(torch.randn(1, 1, 16))
        self.attention = torch.nn.MultiheadAttention(16, 4, dropout=dropout, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x, key_padding_mask=None):
        probe = self.probe.repeat(x.shape[0], 1, 1)
        out = self.attention(probe, x, x, need_weights=self.need_weights, key_padding_mask=key_padding_mask)
        return out[0]


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "key padding mask"])
def test_multihead_attention_returning_weights_nobody_reads_runs_sdpa(padded):
    head = Pooling(need_weights=True).train()
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, -3:] = True
    args = (x, pad) if padded else (x,)
    report = fuser.explain(head, *args, config=STRICT)
    assert report.counts == {"softmax_attention": 1}, str(report)
    assert [m.variant for m in report.matches] == ["nn.MultiheadAttention, need_weights off"]
    reference = copy.deepcopy(head)
    out_ref = reference(*args)
    (out_ref * 1.5).square().sum().backward()
    x_grad, x.grad = x.grad.clone(), None
    out = fuser.optimize(head, STRICT)(*args)
    (out * 1.5).square().sum().backward()
    assert rel(out, out_ref) <= FP32_TOL and rel(x.grad, x_grad) <= FP32_TOL
    g, g_ref = grads(head), grads(reference)
    assert g.keys() == g_ref.keys() and len(g) == 5  # the probe, in_proj weight and bias, out_proj weight and bias
    for name, want in g_ref.items():
        assert rel(g[name], want) <= FP32_TOL, name


def test_multihead_attention_without_weights_calls_sdpa_already():
    head = Pooling(need_weights=False).train()
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    report = fuser.explain(head, x, config=STRICT)
    assert report.counts == {}
    (near_miss,) = [nm for nm in report.near_misses if nm.pattern == "softmax_attention"]
    assert "runs SDPA already" in near_miss.reason and not near_miss.applicable


# --- near-misses: left as written, with the reason --------------------------------------------------------------


def returned_probabilities(q, k, v, mask):  # output_attentions: the probabilities are an output
    probs = F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-1)
    return torch.matmul(probs, v), probs


def dropout_in_training(q, k, v, mask):
    probs = F.dropout(F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-1), p=0.1, training=True)
    return torch.matmul(probs, v)


def softmax_over_queries(q, k, v, mask):
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-2), v)


def scaled_after_the_mask(q, k, v, mask):  # the mask is scaled too
    return torch.matmul(F.softmax((torch.matmul(q, k.transpose(-1, -2)) + mask) * 0.25, dim=-1), v)


def bool_mask_added(q, k, v, mask):  # + 0/1, not a mask: SDPA would read a bool mask as which keys to attend
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-1, -2)) + (mask > 0), dim=-1), v)


def mask_widens_the_scores(q, k, v, mask):  # [H, L, S] scores plus a [B, H, L, S] mask
    scores = torch.matmul(q[0], k[0].transpose(-1, -2)) + mask.expand(B, H, L, S)
    return torch.matmul(F.softmax(scores, dim=-1), v[0])


def bias_shaped_like_the_scores(q, k, v, mask):  # GOT-OCR2: the bias reshaped as the scores (their shape read)
    scores = (q * 0.3) @ k.mT
    bias = mask.expand(B, H, L, S).reshape(-1).reshape_as(scores)
    return F.softmax(scores + bias, dim=-1) @ v


class WeightsRead(torch.nn.Module):  # the averaged weights returned beside the output, and read
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.attention(x[:, :1], x, x)
        return out + weights.sum()


@pytest.mark.parametrize(
    "fn, reason",
    [
        (returned_probabilities, "the attention probabilities are also returned by the captured graph"),
        (dropout_in_training, "dropout with p=0.1 on the probabilities in training"),
        (softmax_over_queries, "the softmax is over dim -2 of the scores, not the last"),
        (scaled_after_the_mask, "after the mask was added"),
        (bool_mask_added, "scores is torch.bool: SDPA takes a float mask"),
        (mask_widens_the_scores, "does not broadcast to [..., L, S]"),
        (bias_shaped_like_the_scores, "the shape of the attention scores is read by the code `bias = "),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_near_misses_are_declined_with_the_reason(fn, reason):
    tensors = inputs()
    report = fuser.explain(fn, *tensors, config=STRICT)
    assert report.counts == {}, str(report)
    reasons = [nm.reason for nm in report.near_misses if nm.pattern == "softmax_attention"]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    if fn is not dropout_in_training:
        out, expected = torch.compile(fn, backend=fuser.backend(STRICT))(*tensors), fn(*tensors)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_multihead_attention_declines(dropout):
    """The weights read, or dropout in training: nn.MultiheadAttention is left as written."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 16)
    if dropout == 0.0:
        report = fuser.explain(WeightsRead().train(), x, config=STRICT)
        reason = "the attention weights nn.MultiheadAttention returns are read by the code"
    else:
        report = fuser.explain(Pooling(need_weights=True, dropout=dropout).train(), x, config=STRICT)
        reason = "with dropout 0.1 in training"
    assert report.counts == {}, str(report)
    reasons = [nm.reason for nm in report.near_misses if nm.pattern == "softmax_attention"]
    assert len(reasons) == 1 and reason in reasons[0], reasons


# --- transformers models ---------------------------------------------------------------------------------------


def assert_model_grads_equal(got: dict, expected: dict) -> None:
    """Every parameter's gradient within ``FP32_TOL`` relative of eager's; a key projection's bias, whose gradient is
    zero in exact arithmetic (it adds one number to all of a query's scores, which the softmax cancels), holds
    rounding noise on both sides: far below the model's gradients."""
    assert got.keys() == expected.keys() and got
    noise = 1e-6 * max(want.norm() for want in expected.values())
    for name, want in expected.items():
        if name.endswith(("key.bias", "k_proj.bias")):
            assert got[name].norm() <= noise and want.norm() <= noise, name
            continue
        assert rel(got[name], want) <= FP32_TOL, f"{name}: {rel(got[name], want):.2e}"


def test_blip_fuses_its_attention_and_trains_the_same():
    """A tiny BlipForConditionalGeneration (coverage_vlm's build and inputs), in training: the vision tower's two
    attentions (scores * scale) and the text decoder's self (+ causal mask) and cross attentions (/ sqrt(d)) become
    SDPA calls; the loss and every parameter's gradient equal eager's."""
    coverage_vlm = load_benchmark("coverage_vlm")
    model = coverage_vlm.build("blip").train()
    batch = coverage_vlm.inputs("blip", model)
    report = fuser.explain(model, config=STRICT, **batch)
    variants = sorted(m.variant for m in report.matches)
    assert variants == ["scores * scale"] * 2 + ["scores / scale"] * 2 + ["scores / scale + mask"] * 2, str(report)
    reference = copy.deepcopy(model)
    out_ref = reference(**batch)
    out_ref.loss.backward()
    out = fuser.optimize(model, STRICT)(**batch)
    out.loss.backward()
    assert rel(out.loss, out_ref.loss) <= FP32_TOL
    assert_model_grads_equal(grads(model), grads(reference))


def test_siglip_pooling_head_fuses_and_trains_the_same():
    """SigLIP's vision model with its head (Gemma-3's and the other SigLIP towers'), in training: the head's
    nn.MultiheadAttention, whose weights the head drops, runs with need_weights=False; the encoder calls SDPA itself."""
    import transformers

    config = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
    )
    torch.manual_seed(0)
    tower = transformers.SiglipVisionModel._from_config(config, attn_implementation="sdpa").train()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    report = fuser.explain(tower, pixel_values=pixels, config=STRICT)
    assert report.counts == {"softmax_attention": 1}, str(report)
    reference = copy.deepcopy(tower)
    loss_ref = vision_loss(reference, (), {"pixel_values": pixels})
    loss_ref.backward()
    loss = vision_loss(fuser.optimize(tower, STRICT), (), {"pixel_values": pixels})
    loss.backward()
    assert rel(loss, loss_ref) <= FP32_TOL
    g = grads(tower)
    assert any("head.attention" in name for name in g)
    assert_model_grads_equal(g, grads(reference))


@pytest.mark.parametrize("fn", [blip_text, clip_bmm], ids=lambda f: f.__name__)
def test_symbolic_lengths_match_and_train_the_same(fn):
    """A second batch length makes Dynamo recompile with symbolic lengths: the form matches there too, and each
    length's step equals eager."""
    compiled = torch.compile(fn, backend=fuser.backend(STRICT))
    fuser.backend(STRICT).results.clear()
    for keys in (S, S + 4, S + 7):
        g = torch.Generator().manual_seed(keys)
        q = torch.randn(B, H, L, E, generator=g, requires_grad=True)
        k, v = (torch.randn(B, H, keys, E, generator=g, requires_grad=True) for _ in range(2))
        mask = torch.randn(B, 1, L, keys, generator=g)
        out, expected = compiled(q, k, v, mask), fn(q, k, v, mask)
        torch.testing.assert_close(out, expected, rtol=FP32_TOL, atol=1e-6)
        grads_fused = torch.autograd.grad(out.square().sum(), (q, k, v))
        grads_eager = torch.autograd.grad(expected.square().sum(), (q, k, v))
        for got, want in zip(grads_fused, grads_eager, strict=True):
            assert rel(got, want) <= FP32_TOL
    results = fuser.backend(STRICT).results
    assert len(results) == 2 and all(r.counts == {"softmax_attention": 1} for r in results), results
