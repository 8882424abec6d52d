"""CI's slice of the coverage harness (benchmarks/coverage.py, issue 20): on tiny models of several families, every
block the eager model runs is fused where fuser covers the architecture today, and no block is matched more often
than the eager model runs it (a false match) anywhere."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import load_benchmark

# fully fused today: every RMSNorm and LayerNorm, rotary application, gated and un-gated MLP and the lm_head loss the
# eager model runs (gpt2: its loss_function's logger.warning_once breaks no graph under FuserConfig.ignore_logging)
FULLY_FUSED = ["llama", "mistral", "qwen3", "gemma2", "phi3", "olmo2", "gpt_neox", "qwen3_moe", "gptj", "gpt2"]
FULLY_FUSED += ["deepseek_v2"]  # rotary through view_as_complex, rotations unsqueezed once for q and k
FULLY_FUSED += ["opt", "falcon", "phi", "starcoder2"]  # LayerNorm; ReLU, GELU (matmul projections), gelu_new, tanh
# one block is known not to fuse, and says why (every other block the eager model runs is fused): the block, and a
# piece of the near-miss reason
PARTIAL = {
    # clamped x·sigmoid(1.702x)·(up + 1) experts; its chunked-halves rotary fuses
    "gpt_oss": ("gated", "a sigmoid of the scaled gate"),
    # nll_loss(log_softmax(logits)) over the n-gram streams
    "prophetnet": ("loss", "the loss is nll_loss over log_softmax"),
    # the gated product feeds a split besides the projection; its norms run in graphs reused for the second layer
    "jetmoe": ("gated", "not only by a projection"),
}
# what the eager models run (2 layers; rope in rotated tensors, q and k of a layer are 2): guards the harness's
# own counting, without which every block would read "absent" and pass
EAGER = {
    "llama": {"norm": 5, "rope": 4, "gated": 2, "mlp": 0, "loss": 1},
    "qwen3": {"norm": 9, "rope": 4, "gated": 2, "mlp": 0, "loss": 1},
    "phi3": {"norm": 5, "rope": 4, "gated": 2, "mlp": 0, "loss": 1},  # packed gate_up_proj
    "gpt_neox": {"norm": 5, "rope": 4, "gated": 0, "mlp": 2, "loss": 1},  # LayerNorm, un-gated GELU MLP
    "gpt2": {"norm": 5, "rope": 0, "gated": 0, "mlp": 2, "loss": 1},  # Conv1D (addmm) MLP, gelu_new formula
    "gptj": {"norm": 3, "rope": 4, "gated": 0, "mlp": 2, "loss": 1},  # [B, T, H, D] with cos/sin unsqueezed on dim 2
    "opt": {"norm": 5, "rope": 0, "gated": 0, "mlp": 2, "loss": 1},  # fc1/fc2 in the decoder layer itself, ReLU
    "falcon": {"norm": 3, "rope": 4, "gated": 0, "mlp": 2, "loss": 1},  # parallel attention: one norm a layer
    "jetmoe": {"norm": 5, "rope": 4, "gated": 2, "mlp": 0, "loss": 1},  # 16 graph breaks: a layer's graphs run twice
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy sizes gain nothing from threads, and on a busy 2-core machine OpenMP's spinning makes them 100× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def coverage():
    return load_benchmark("coverage")


def _record(coverage, model_type: str) -> dict:
    record = coverage.run_one(model_type)
    assert record["status"] == "ok", f"{model_type}: {record.get('reason')}"
    return record


def _no_false_match(coverage, record: dict) -> None:
    over = {b: c["text"] for b, c in record["blocks"].items() if c["status"] == "over"}
    assert not over, f"{record['model_type']}: fuser matched more than the eager model runs: {over}"


@pytest.mark.parametrize("model_type", FULLY_FUSED)
def test_every_block_the_eager_model_runs_is_fused(coverage, model_type):
    record = _record(coverage, model_type)
    _no_false_match(coverage, record)
    if model_type in EAGER:
        assert {b: c["eager"] for b, c in record["blocks"].items()} == EAGER[model_type]
    not_fused = {b: c["text"] for b, c in record["blocks"].items() if c["status"] not in ("fused", "absent")}
    assert not not_fused, f"{model_type}: {not_fused}"
    assert coverage.fully_fused(record)


@pytest.mark.parametrize("model_type", sorted(PARTIAL))
def test_known_misses_are_reported_and_nothing_is_over_matched(coverage, model_type):
    record = _record(coverage, model_type)
    _no_false_match(coverage, record)
    if model_type in EAGER:
        assert {b: c["eager"] for b, c in record["blocks"].items()} == EAGER[model_type]
    name, reason = PARTIAL[model_type]
    block = record["blocks"][name]
    assert block["status"] == "partial", block
    assert any(reason in r for r in block["reasons"]), block
    others = {b: c["text"] for b, c in record["blocks"].items() if b != name and c["status"] not in ("fused", "absent")}
    assert not others, f"{model_type}: {others}"
    assert not coverage.fully_fused(record)
    assert coverage.why_not(record), "a model not fully fused must say why"


def test_gpt2_without_ignore_logging_says_a_graph_break_splits_lm_head_and_loss(coverage):
    import fuser

    record = coverage.run_one("gpt2", config=fuser.FuserConfig(ignore_logging=False))
    block = record["blocks"]["loss"]
    assert block["status"] == "partial" and record["graph_breaks"] == 1, block
    assert "of this graph, not computed in it" in block["reasons"][0] and "graph break" in block["reasons"][0], block


@pytest.mark.parametrize("model_type", ["llama", "gptj", "gpt2", "opt"])
def test_training_step_through_fuser_equals_eager(coverage, model_type):
    """The harness's --train-check (strict, aot_eager): loss and every gradient within 1e-4 of eager."""
    assert coverage.train_check(coverage.build(model_type), coverage.batch()) == "equal"


def test_verdict_cells():
    coverage = load_benchmark("coverage")
    assert coverage.verdict(2, 2, [])["status"] == "fused"
    assert coverage.verdict(0, 0, [])["status"] == "absent"
    assert coverage.verdict(2, 3, [])["status"] == "over"
    assert coverage.verdict(0, 1, [])["status"] == "over"
    cell = coverage.verdict(2, 1, ["the product is also used by mul_3"])
    assert cell["status"] == "partial" and "also used" in cell["text"]


# ------------------------------------------------------------------------------------------- image-text models

# what the eager models run per side (2 text layers, 2 vision layers): Qwen2-VL's vision tower runs one SDPA call per
# image (its attention splits the patches by image) and an un-gated MLP in its merger; LLaVA's CLIP tower has pre-
# and post-layernorms, and its projector is an un-gated MLP
VLM_EAGER = {
    "qwen2_vl": {
        "text": {"norm": 5, "rope": 4, "gated": 2, "mlp": 0, "attention": 2, "loss": 1},
        "vision": {"norm": 5, "rope": 4, "gated": 0, "mlp": 3, "attention": 4, "loss": 0},
    },
    "llava": {
        "text": {"norm": 5, "rope": 4, "gated": 2, "mlp": 0, "attention": 2, "loss": 1},
        "vision": {"norm": 6, "rope": 0, "gated": 0, "mlp": 3, "attention": 2, "loss": 0},
    },
}


@pytest.fixture(scope="module")
def coverage_vlm():
    return load_benchmark("coverage_vlm")


@pytest.mark.parametrize("model_type", sorted(VLM_EAGER))
def test_vlm_inputs_hold_as_many_image_tokens_as_the_vision_tower_gives(coverage_vlm, model_type):
    model = coverage_vlm.build(model_type)
    batch = coverage_vlm.inputs(model_type, model)
    image_token = coverage_vlm.image_token_id(model.config)
    features = coverage_vlm._rows(coverage_vlm._image_features(model, batch))
    assert features > 0 and (batch["input_ids"] == image_token).sum() == features
    assert (batch["labels"][batch["input_ids"] == image_token] == -100).all()
    if model_type == "qwen2_vl":  # 4 × 4 patches of 8 × 8 pixels × 2 frames, merged 2 × 2 into 4 tokens an image
        assert (
            batch["pixel_values"].shape == (2 * 16, 3 * 2 * 8 * 8)
            and batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
        )
        assert (batch["mm_token_type_ids"] == (batch["input_ids"] == image_token)).all() and features == 8
    else:
        assert batch["pixel_values"].shape == (2, 3, 32, 32) and features == 2 * 16
    counts = coverage_vlm.eager_counts(model, batch)
    assert {s: {b: counts[s][b] for b in coverage_vlm.BLOCKS} for s in coverage_vlm.SIDES} == VLM_EAGER[model_type]


def test_vlm_blocks_are_reported_on_their_side(coverage_vlm):
    """Qwen2-VL: the text decoder fuses every block; the vision tower's norms, MLPs, mask-free attention and rotary
    embedding of [tokens, heads, dim] tensors count as fused on the vision side, also where a graph break (its
    attention's .tolist()) leaves a resumed frame with no module path."""
    record = coverage_vlm.run_one("qwen2_vl")
    assert record["status"] == "ok", record.get("reason")
    text, vision = record["sides"]["text"], record["sides"]["vision"]
    assert {b: c["eager"] for b, c in text.items()} == VLM_EAGER["qwen2_vl"]["text"]
    assert {b: c["status"] for b, c in text.items()} == {b: "absent" if b == "mlp" else "fused" for b in text}
    assert coverage_vlm.side_fused(record, "text") and coverage_vlm.side_fused(record, "vision"), vision
    assert {b: vision[b]["text"] for b in ("norm", "mlp")} == {"norm": "fused 5/5", "mlp": "fused 3/3"}
    assert vision["attention"]["text"] == "fused 4/4 (SDPA, no mask)"
    assert vision["rope"]["status"] == "fused" and vision["rope"]["fused"] == vision["rope"]["eager"] > 0
    assert not any(c["status"] == "over" for side in record["sides"].values() for c in side.values())
    assert coverage_vlm.miss_reasons([record]) == []


def test_vlm_side_of_a_module_path(coverage_vlm):
    vision = ["model.visual.blocks.0.attn", "model.vision_tower.encoder.layers.1.mlp", "model.multi_modal_projector"]
    text = ["model.language_model.layers.0.mlp", "lm_head", "model.language_model.norm", ""]
    assert {coverage_vlm.side_of_path(p) for p in vision} == {"vision"}
    assert {coverage_vlm.side_of_path(p) for p in text} == {"text"}
