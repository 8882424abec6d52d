"""Tier 3: CPU bf16 autocast over fp32 weights (a trainer's ``bf16=True`` on an fp32 model): the cast passes across
families, through Inductor with its caches off so that the post-grad passes run. (The blocks' own autocast tests are
in their files: test_rms_norm.py, test_rope.py, test_lora.py.)

``output_casts`` (a norm or rotation writes the bf16 result its readers cast to), ``rope_grad_upcasts`` (the
rotation's backward reads attention's bf16 gradients) and ``norm_grad_upcasts`` (a norm backward reads its bf16
gradient terms) only remove copies, so the step with them equals the step without them bit for bit. Checked on the
families whose norms sit differently: Qwen3 and Gemma-3 (per-head q/k norms before the rotation; Gemma's 1 + w and
GeGLU), OLMo-2 (norms after the attention and the MLP, and q/k norms over the whole projection) and Phi-3 (packed
qkv and gate/up projections).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
import fuser.dynamo_backend as dynamo_backend
from tests.models.harness import build_arch, post_grad_step
from tests.models.tiny import assert_same_step

# one decoder layer: each pass rewrites per norm and per rotation, the same in every layer, so a second layer only
# doubled each Dynamo trace and Inductor compile; the expected counts follow N_LAYERS
N_LAYERS = 1
CAST_PASSES = ("norm_grad_upcasts", "output_casts", "rope_grad_upcasts")
CONFIG = fuser.FuserConfig(strict=True)  # Inductor, every default on


def _model(arch: str) -> torch.nn.Module:
    model = build_arch(arch, layers=N_LAYERS).train()
    model.config.use_cache = False  # a returned cache keeps the rotated k in fp32, and its cast with it
    return model


def _expected(arch: str) -> dict[str, int]:
    """Calls each pass rewrites. Where each layer's two norms feed projections (q/k/v; gate/up), every such norm's
    backward reads bf16 terms and every such norm writes its bf16 output, as the final norm does for the lm_head;
    each layer's rotation writes bf16 for attention and reads its bf16 gradients. OLMo-2's layer norms follow the
    attention and the MLP: only the final norm feeds a projection; its rotation casts its fp32 result back to q's
    dtype itself (``q_embed.to(q_type)``), a cast the rope match takes in, so that op writes bf16 and reads bf16
    gradients with no cast left for these passes."""
    feeding = 1 if arch == "olmo2" else 2 * N_LAYERS + 1
    rotations = 0 if arch == "olmo2" else N_LAYERS
    return {"norm_grad_upcasts": feeding, "output_casts": feeding + rotations, "rope_grad_upcasts": rotations}


def _autocast_step(model, monkeypatch, with_casts: bool):
    """(loss, gradients) of one autocast step through fuser, and the calls each cast pass rewrote."""
    real = dynamo_backend.post_grad_passes
    if not with_casts:
        without = lambda patterns: [p for p in real(patterns) if p.name not in CAST_PASSES]  # noqa: E731
        monkeypatch.setattr(dynamo_backend, "post_grad_passes", without)
    try:
        step, counts = post_grad_step(model, CONFIG, autocast=True)
    finally:
        monkeypatch.setattr(dynamo_backend, "post_grad_passes", real)
        torch._dynamo.reset()
    return step, {name: counts.get(name, 0) for name in CAST_PASSES}


@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "olmo2", "phi3"])
def test_autocast_step_with_the_cast_passes_equals_the_step_without_them(arch, monkeypatch):
    model = _model(arch)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    on, taken = _autocast_step(copy.deepcopy(model), monkeypatch, with_casts=True)
    off, taken_off = _autocast_step(copy.deepcopy(model), monkeypatch, with_casts=False)
    assert taken == _expected(arch)
    assert taken_off == dict.fromkeys(CAST_PASSES, 0)
    assert on[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in on[1].values())
    assert_same_step(on, off)
