"""Tier 1: the lm_head + cross-entropy pattern on toy graphs — every variant matches and equals eager (loss and
every gradient); near-misses don't, and say why; returned logits are dropped in training, kept otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser

H = 16  # hidden size
V = 37  # vocab: not a power of two
B, T = 2, 7
IGNORE = -100

AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


def _inputs(requires_grad=True, dtype=torch.float32, ignore_index=IGNORE):
    h = torch.randn(B, T, H, dtype=dtype)
    w = torch.randn(V, H, dtype=dtype) / 3
    b = torch.randn(V, dtype=dtype) / 3
    y = torch.randint(0, V, (B, T))
    y[0, 2] = y[1, 5] = ignore_index  # a few ignored tokens
    return [t.requires_grad_(requires_grad) for t in (h, w, b)] + [y]


# --- variants (each returns the loss, and some the logits as a model does) ------------------------------------


def plain(h, w, b, y):  # hand-written loop
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1))


def upcast(h, w, b, y):  # transformers' ForCausalLMLoss: .float() before the view
    return F.cross_entropy(F.linear(h, w).float().view(-1, V), y.view(-1), ignore_index=-100, reduction="mean")


def hf_causal_lm(h, w, b, y):  # transformers 5: logits_to_keep=0 slice, pad-and-slice label shift, logits returned
    logits = F.linear(h[:, slice(-0, None), :], w)
    labels = F.pad(y, (0, 1), value=-100)[..., 1:].contiguous()
    loss = F.cross_entropy(logits.float().view(-1, V), labels.view(-1).to(h.device), ignore_index=-100)
    return loss, logits


def contiguous_logits(h, w, b, y):  # OPT: lm_head(h).contiguous(), the logits returned
    logits = F.linear(h, w).contiguous()
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1), ignore_index=-100), logits


def scale_multiply(h, w, b, y):  # Cohere: logits * logit_scale
    return F.cross_entropy((F.linear(h, w) * 0.25).float().view(-1, V), y.view(-1))


def scale_divide(h, w, b, y):  # Granite: logits / logits_scaling
    return F.cross_entropy((F.linear(h, w) / 4.0).float().view(-1, V), y.view(-1))


def softcap(h, w, b, y):  # Gemma-2: final-logit softcapping, logits returned
    logits = F.linear(h, w)
    logits = torch.tanh(logits / 1.5) * 1.5
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits


def scale_and_softcap(h, w, b, y):
    logits = F.linear(h, w) * 2.0
    logits = (logits / 3.0).tanh() * 3.0
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def bias(h, w, b, y):
    return F.cross_entropy(F.linear(h, w, b).view(-1, V), y.view(-1))


def ignore_index(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), torch.where(y < 0, -1, y).view(-1), ignore_index=-1)


def reduction_sum(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="sum")


def divided_by_num_items_tensor(h, w, b, y):  # transformers with num_items_in_batch: sum, then a division
    num_items = (y != -100).sum()
    return F.cross_entropy(F.linear(h, w).float().view(-1, V), y.view(-1), reduction="sum") / num_items


def divided_by_num_items_number(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="sum") / 13


def loss_module(h, w, b, y):  # nn.CrossEntropyLoss, flatten(0, 1) rows
    return torch.nn.CrossEntropyLoss()(F.linear(h, w, b).flatten(0, 1), y.flatten())


def rows_already(h, w, b, y):  # 2-D hidden states: no view at all
    return F.cross_entropy(F.linear(h.reshape(-1, H), w), y.reshape(-1))


def text_positions(h, w, b, y):  # BLIP-2: the logits of the text positions, after the image's query tokens
    labels = y[:, 3:]
    logits = F.linear(h, w).contiguous()[:, -labels.size(1) :, :]
    return F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=-100), logits


def image_tokens_sliced(h, w, b, y):  # GIT: the image tokens and the last position cut off, rows viewed twice
    shifted = F.linear(h, w)[:, 2:-1, :].contiguous()
    return F.cross_entropy(shifted.view(-1, V).float().view(-1, V), y[:, 3:].contiguous().view(-1))


def last_position(h, w, b, y):  # an int index: one position a row (a classifier on the last token)
    return F.cross_entropy(F.linear(h, w, b)[:, -1], y[:, -1].clamp(min=0))


VARIANTS = [
    plain,
    upcast,
    hf_causal_lm,
    contiguous_logits,
    scale_multiply,
    scale_divide,
    softcap,
    scale_and_softcap,
    bias,
    ignore_index,
    reduction_sum,
    divided_by_num_items_tensor,
    divided_by_num_items_number,
    loss_module,
    rows_already,
    text_positions,
    image_tokens_sliced,
    last_position,
]


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def _assert_step_equals_eager(fn, config, inputs=None, tol=1e-5):
    """One forward + backward of ``fn`` compiled through fuser against eager: loss and every gradient."""
    inputs = inputs or _inputs()
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = torch.compile(fn, backend=fuser.backend(config))(*inputs)
    ref = fn(*ref_inputs)
    torch.testing.assert_close(_loss(out), _loss(ref), rtol=tol, atol=tol)
    if _loss(ref).requires_grad:
        _loss(out).backward()
        _loss(ref).backward()
        for t, r in zip(inputs, ref_inputs, strict=True):
            if r.grad is not None:
                torch.testing.assert_close(t.grad, r.grad, rtol=tol, atol=tol)
    return out, ref


@pytest.mark.parametrize("fn", VARIANTS, ids=lambda f: f.__name__)
def test_variant_fuses_once_and_loss_and_gradients_equal_eager(fn):
    out, ref = _assert_step_equals_eager(fn, AOT)
    assert fuser.backend(AOT).counts == {"linear_cross_entropy": 1}
    if isinstance(ref, tuple):  # the logits were returned: in training the fused graph never computes them
        assert out[1] is None


def test_bf16_upcast_equals_eager_within_bf16_rounding():
    """bf16 hidden states and weight, ``.float()`` before the loss: the op computes the logits in fp32 (eager
    rounds them to bf16 first), so the two agree to bf16 rounding of the logits."""
    _assert_step_equals_eager(upcast, AOT, _inputs(dtype=torch.bfloat16), tol=2e-2)


def test_autocast_equals_eager_under_autocast():
    """Under autocast the linear runs in bf16 on fp32 parameters: the op gets bf16 operands (custom ops see no
    autocast), and fp32 gradients flow back to the fp32 parameters."""
    inputs = _inputs()
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(bias, backend=fuser.backend(AOT))(*inputs)
        ref = bias(*ref_inputs)
    assert fuser.backend(AOT).counts == {"linear_cross_entropy": 1}
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.backward()
    ref.backward()
    for t, r in zip(inputs[:3], ref_inputs[:3], strict=True):
        assert t.grad.dtype == torch.float32
        torch.testing.assert_close(t.grad, r.grad, rtol=5e-2, atol=5e-2)


def test_keep_logits_returns_the_logits_unfused():
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", keep_logits=True)
    report = fuser.explain(softcap, *_inputs(), config=config)
    assert "linear_cross_entropy" not in report.counts, str(report)
    assert any("keep_logits=True" in nm.reason for nm in report.near_misses), str(report)
    out, ref = _assert_step_equals_eager(softcap, config)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert fuser.backend(config).counts == {}


def test_explain_counts_and_shows_the_match():
    report = fuser.explain(hf_causal_lm, *_inputs())
    assert report.counts == {"linear_cross_entropy": 1}, str(report)
    assert "linear_cross_entropy" in str(report) and "F.cross_entropy" in str(report)


def test_keep_logits_still_fuses_a_loss_whose_logits_are_not_returned():
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", keep_logits=True)
    assert fuser.explain(plain, *_inputs(), config=config).counts == {"linear_cross_entropy": 1}


def test_evaluation_keeps_returned_logits():
    """Under no_grad (evaluation) logits that are returned are computed, and the loss from them, as written."""
    inputs = _inputs()
    with torch.no_grad():
        report = fuser.explain(hf_causal_lm, *inputs)
        assert "linear_cross_entropy" not in report.counts, str(report)
        # several structural matches (the optional slice and cast) decline alike: reported once
        assert sum("no gradient is wanted" in nm.reason for nm in report.near_misses) == 1, str(report)
        out = torch.compile(hf_causal_lm, backend=fuser.backend(AOT))(*inputs)
        ref = hf_causal_lm(*inputs)
    assert fuser.backend(AOT).counts == {}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_returned_logits_are_kept_in_a_nested_graph():
    """Inside activation checkpointing the block is a nested graph whose outputs belong to the higher-order op:
    returned logits keep it unfused there; a loss alone is fused."""

    def checkpointed(h, w, b, y):
        return torch.utils.checkpoint.checkpoint(hf_causal_lm, h, w, b, y, use_reentrant=False)

    report = fuser.explain(checkpointed, *_inputs())
    assert "linear_cross_entropy" not in report.counts, str(report)
    assert any("nested graph" in nm.reason for nm in report.near_misses), str(report)
    _assert_step_equals_eager(checkpointed, AOT)
    assert fuser.backend(AOT).counts == {}

    def checkpointed_loss(h, w, b, y):
        return torch.utils.checkpoint.checkpoint(upcast, h, w, b, y, use_reentrant=False)

    _assert_step_equals_eager(checkpointed_loss, AOT)
    assert fuser.backend(AOT).counts == {"linear_cross_entropy": 1}


def test_evaluation_fuses_a_loss_whose_logits_are_not_returned():
    with torch.no_grad():
        out, _ = _assert_step_equals_eager(upcast, AOT)
    assert fuser.backend(AOT).counts == {"linear_cross_entropy": 1}


def test_frozen_weight_and_hidden_without_gradient():
    """LoRA freezes lm_head: only the hidden states want a gradient, and the op is asked for that one alone."""
    h, w, b, y = _inputs()
    w.requires_grad_(False)
    _assert_step_equals_eager(bias, AOT, [h, w, b.requires_grad_(False), y])
    match = fuser.explain(bias, h, w, b, y).matches[0]
    assert match.replacement.args[-3:] == (True, False, False)


def test_all_ignored_labels_give_nan_mean_and_zero_gradients_like_eager():
    h, w, b, y = _inputs()
    y = torch.full_like(y, IGNORE)
    out = torch.compile(upcast, backend=fuser.backend(AOT))(h, w, b, y)
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = upcast(ref_h, ref_w, b, y)
    assert torch.isnan(out) and torch.isnan(ref)
    out.backward()
    ref.backward()
    torch.testing.assert_close(h.grad, ref_h.grad, equal_nan=True)
    torch.testing.assert_close(w.grad, ref_w.grad, equal_nan=True)


# --- near-misses --------------------------------------------------------------------------------------------


def label_smoothing(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), label_smoothing=0.1)


def class_weights(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), weight=b.detach().abs())


def reduction_none(h, w, b, y):
    return F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1), reduction="none").mean()


def softcap_two_constants(h, w, b, y):
    logits = torch.tanh(F.linear(h, w) / 1.5) * 2.5
    return F.cross_entropy(logits.view(-1, V), y.view(-1))


def tensor_scale(h, w, b, y):  # a learned scale: not a constant the op could take
    return F.cross_entropy((F.linear(h, w) * b[0]).view(-1, V), y.view(-1))


def logits_used_elsewhere(h, w, b, y):  # e.g. an accuracy metric computed from the logits in the graph
    logits = F.linear(h, w)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)) + 0 * logits.argmax(-1).sum()


def soft_targets(h, w, b, y):  # class probabilities, not indices
    return F.cross_entropy(F.linear(h, w).view(-1, V), torch.softmax(F.linear(h, w), -1).detach().view(-1, V))


def class_dim_not_last(h, w, b, y):  # [B, V, T] logits: the class dim is 1 by construction of the loss
    return F.cross_entropy(F.linear(h, w).transpose(1, 2), y)


def graph_break_before_loss(h, w, b, y):  # the loss in the graph after a break: its logits are that graph's input
    logits = F.linear(h, w)
    torch._dynamo.graph_break()
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def nll_of_log_softmax(h, w, b, y):  # ProphetNet: cross_entropy's value in two steps
    log_probs = F.log_softmax(F.linear(h, w).view(-1, V), dim=-1, dtype=torch.float32)
    return F.nll_loss(log_probs, y.view(-1), reduction="mean")


def nll_of_log_softmax_smoothed(h, w, b, y):  # ProphetNet with eps > 0: the log-probabilities feed a smoothing term
    log_probs = F.linear(h, w).view(-1, V).log_softmax(-1)
    kept = (y.view(-1) != IGNORE).float()
    smooth = (-log_probs.sum(dim=-1) * kept).sum() / kept.sum()
    return 0.9 * F.nll_loss(log_probs, y.view(-1)) + 0.1 / V * smooth


def vocab_sliced(h, w, b, y):  # a slice of the vocab (the last dim): not the rows the op can select
    return F.cross_entropy(F.linear(h, w)[..., : V - 5].reshape(-1, V - 5), y.clamp(min=0, max=V - 6).view(-1))


NEAR_MISSES = {
    nll_of_log_softmax: "the loss is nll_loss over log_softmax: cross_entropy's value, written in two steps",
    nll_of_log_softmax_smoothed: "the log-probabilities are also used by",
    label_smoothing: "label_smoothing=0.1",
    class_weights: "class weights",
    reduction_none: "reduction='none'",
    softcap_two_constants: "two different constants",
    tensor_scale: "not a constant",
    logits_used_elsewhere: "also used by",
    soft_targets: "not a 1-D tensor of class indices",
    class_dim_not_last: "looked like part of linear_cross_entropy",
    graph_break_before_loss: "the logits are the input `logits` (a 2×7×37 float32 tensor) of this graph",
    vocab_sliced: "looked like part of linear_cross_entropy",
}


@pytest.mark.parametrize("fn", list(NEAR_MISSES), ids=lambda f: f.__name__)
def test_near_miss_does_not_match_and_says_why(fn):
    report = fuser.explain(fn, *_inputs())
    assert "linear_cross_entropy" not in report.counts, str(report)
    assert any(NEAR_MISSES[fn] in nm.reason for nm in report.near_misses), str(report)
    assert NEAR_MISSES[fn] in str(report)
    _assert_step_equals_eager(fn, AOT)
    assert fuser.backend(AOT).counts == {}
