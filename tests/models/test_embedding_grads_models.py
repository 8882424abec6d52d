"""Tier 3: ``FuserConfig.experimental.embedding_grads`` (the post-grad pass ``embedding_grads``, on by default): the
embedding's weight gradient, with a tied lm_head's gradient added, is one op (``fuser::embedding_grad``). Through
Inductor on CPU (caches off, so the post-grad passes run): one rewrite per embedding with a gradient, and the training
step equal bit for bit to the step without it: fp32, tied and untied, a padding row, GPT-2's two embeddings; bf16 tied
(Inductor's fused kernel rounds once, as the op does). Checked the same way by hand on Gemma, Qwen2, OPT, Phi, GPT-NeoX
and Bloom (2026-12-03): all equal."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from tests.models.tiny import assert_same_step, batch, from_config, grads, rel

ON = fuser.FuserConfig(strict=True)
OFF = fuser.FuserConfig(strict=True, experimental={"embedding_grads": False})
PAD = 5


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad passes, and with them the count
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def llama(tied: bool, dtype=torch.float32, pad: int | None = None):
    extra = {"attn_implementation": "sdpa", "tie_word_embeddings": tied, "pad_token_id": pad}
    return from_config("LlamaConfig", extra).to(dtype).train()


def step(model, config, data=None):
    """(loss, gradients) of one training step through fuser, and how many embedding gradients the op wrote."""
    backend = fuser.backend(config)
    before = backend.post_grad_counts.get("embedding_grads", 0)
    out = fuser.optimize(model, config)(**(data or batch()))
    out.loss.backward()
    taken = backend.post_grad_counts.get("embedding_grads", 0) - before
    torch._dynamo.reset()
    return (out.loss.detach(), grads(model)), taken


@pytest.mark.parametrize(("tied", "pad"), [(True, None), (False, PAD)])
def test_fp32_step_is_unchanged(tied, pad):
    """Tied, and untied with a padding_idx, whose row then gets no gradient although the batch holds it."""
    model = llama(tied, pad=pad)
    data = batch()
    data["input_ids"][:, :3] = PAD  # padding tokens in the batch (counted in the loss: labels are the ids)
    on, taken = step(copy.deepcopy(model), ON, data)
    off, taken_off = step(copy.deepcopy(model), OFF, data)
    assert taken == 1 and taken_off == 0
    assert_same_step(on, off)
    if pad is not None:
        grad = on[1]["model.embed_tokens.weight"]
        assert not grad[PAD].any() and grad[data["input_ids"][0, -1]].any()


def test_gpt2_token_and_position_embeddings_both_take_the_op():
    """GPT-2: a tied token embedding and a learned position embedding (ids: the positions), two rewrites."""
    extra = {"n_embd": 64, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    model = from_config("GPT2Config", extra).train()
    on, taken = step(copy.deepcopy(model), ON)
    off, _ = step(copy.deepcopy(model), OFF)
    assert taken == 2
    assert_same_step(on, off)


def test_bf16_tied_step_is_unchanged_and_as_close_to_fp32():
    model = llama(True, torch.bfloat16)
    on, taken = step(copy.deepcopy(model), ON)
    off, _ = step(copy.deepcopy(model), OFF)
    (_, grads32), _ = step(copy.deepcopy(model).float(), OFF)
    assert taken == 1
    assert_same_step(on, off)
    name = "model.embed_tokens.weight"
    assert rel(on[1][name], grads32[name]) < 2**-7


@pytest.mark.gpu
def test_gpu_bf16_tied_step_as_close_to_fp32_as_without_it():
    """On the GPU the scatter's atomics sum in another order than the op: each gradient as close to an fp32 copy's
    step as without the op, within one bf16 rounding."""
    model = from_config(
        "LlamaConfig",
        {
            "attn_implementation": "sdpa",
            "tie_word_embeddings": True,
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 512,
            "head_dim": 64,
        },  # fmt: skip
    ).cuda()
    ids = torch.randint(0, 4096, (2, 256), device="cuda")
    data = {"input_ids": ids, "labels": ids}
    (_, grads32), _ = step(copy.deepcopy(model).train(), OFF, data)
    on, taken = step(copy.deepcopy(model).bfloat16().train(), ON, data)
    off, _ = step(copy.deepcopy(model).bfloat16().train(), OFF, data)
    assert taken == 1
    for name, g in on[1].items():
        assert rel(g, grads32[name]) <= rel(off[1][name], grads32[name]) + 2**-8, name
