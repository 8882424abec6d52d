"""Attention under the masks real batches carry, through fuser without ``padding_free``: a batch with right- and
left-padded rows (transformers' 4-D mask built from ``attention_mask``) and the same rows packed into one row
(``DataCollatorWithFlattening``: ``position_ids`` restart at each row, the block-diagonal causal mask built from
them). For each tiny architecture, every layer's attention fuses on the block mask (``fuser.explain`` on the packed
row; the compiled graphs of both), and a step through ``fuser.optimize`` gives eager's loss and gradients (fp32
within 1e-5 relative). On a CPU the
block-sparse op runs the masked SDPA; its FlexAttention path is tested on a GPU (``test_padding_free.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import fuser
from tests.models.test_padding_free import ARCHS, BATCHES, COMMON, padded_batch, tiny
from tests.models.tiny import grads, rel


def packed_batch(padded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The padded batch's rows packed as ``DataCollatorWithFlattening`` packs them (labels -100 at each row's first
    token, so that no row predicts the next one's first token), called with ``use_cache=False``: with a cache (the
    config's default, in training too) transformers builds one causal mask over the packed row, and its rows would
    attend to each other."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(padded["input_ids"], padded["attention_mask"], strict=True)]
    features = [{"input_ids": row, "labels": row} for row in rows]
    return {**transformers.DataCollatorWithFlattening(return_tensors="pt")(features), "use_cache": False}


def _step(run, model, data):
    out = run(**data)
    out.loss.backward()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), found


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_padded_and_packed_attention_fuses_and_trains_as_eager(arch):
    padded = padded_batch(*BATCHES["mixed"])  # right-padded rows and a left-padded one
    batches = {"padded": padded, "packed": packed_batch(padded)}
    assert "attention_mask" not in batches["packed"] and batches["packed"]["input_ids"].shape[0] == 1
    config = fuser.FuserConfig(strict=True, inner_compiler="eager")
    layers = COMMON["num_hidden_layers"]
    model = tiny(arch)
    reference = copy.deepcopy(model)
    # what a user sees first: explain on the packed row (the padded batch's graph is the backend's first below)
    report = fuser.explain(copy.deepcopy(model), **batches["packed"], config=config)
    variants = [m.variant for m in report.matches if m.pattern == "causal_attention"]
    assert variants == ["block-sparse mask"] * layers, str(report)
    compiled = fuser.optimize(model, config)
    for name, data in batches.items():
        (loss, g), (loss_ref, g_ref) = _step(compiled, model, data), _step(reference, reference, data)
        assert rel(loss, loss_ref) <= 1e-5, (name, loss, loss_ref)
        assert g.keys() == g_ref.keys() and len(g) == len(list(model.parameters()))
        for param in g_ref:
            assert rel(g[param], g_ref[param]) <= 1e-5, (name, param)
    results = fuser.backend(config).results
    assert len(results) == 2  # the padded batch's graph, then the packed row's
    for result in results:
        variants = [m.variant for m in result.matches if m.pattern == "causal_attention"]
        assert variants == ["block-sparse mask"] * layers, str(result.counts)
