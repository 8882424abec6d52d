"""Tiny random-weight Hugging Face causal LMs built from configs (no downloads)."""

from __future__ import annotations

import copy

import torch
import transformers

ARCHS = {
    # name: (config class, norms per layer)
    "llama": ("LlamaConfig", 2),
    "mistral": ("MistralConfig", 2),
    "qwen3": ("Qwen3Config", 4),
    "gemma": ("GemmaConfig", 2),
    "olmo2": ("Olmo2Config", 4),
}
N_LAYERS = 2
VOCAB = 128


def from_config(cls_name: str, extra: dict | None = None, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight causal LM of ``transformers.<cls_name>`` (``N_LAYERS`` layers unless ``extra`` says
    ``num_hidden_layers``, hidden 64), dropout off."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    fields.update(extra or {})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**fields))
    return model.eval()  # dropout off: eager and fuser must compute the same function


def build(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = N_LAYERS) -> torch.nn.Module:
    model = from_config(ARCHS[arch][0], {"attn_implementation": "sdpa", "num_hidden_layers": layers}, seed).to(dtype)
    # random norm weights, so a kernel that ignored the weight (or its 1 + w offset) would be caught
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if arch == "gemma" else 1.0, 0.2)
    return model


def expected_norms(arch: str, layers: int = N_LAYERS) -> int:
    return ARCHS[arch][1] * layers + 1


NORM_PATTERNS = ("rms_norm", "rms_norm_linear")  # a norm counts under one: rms_norm_linear if only projections read it


def fused_norms(counts: dict[str, int]) -> int:
    """How many RMSNorms ``counts`` (a report's or a backend's) fused, under either pattern."""
    return sum(counts.get(name, 0) for name in NORM_PATTERNS)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(copy.deepcopy(model), config)


def lora_model(dtype: torch.dtype = torch.bfloat16, layers: int = N_LAYERS) -> torch.nn.Module:
    """A tiny Llama in ``dtype`` (``layers`` decoder layers) with peft's adapters on every linear layer, kept in fp32
    (peft's default)."""
    model = with_lora(build("llama", dtype, layers=layers))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    return model


def lora_step(model: torch.nn.Module, config=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, LoRA gradients) of one forward+backward of a ``lora_model``, eagerly or through fuser."""
    import fuser

    run = model if config is None else fuser.optimize(model, config)
    out = run(**batch())
    out.loss.backward()
    found = grads(model)
    assert found and all("lora_" in n for n in found)
    return out.loss.detach(), found


def assert_step_as_close_to_fp32_as_eager(dtype: torch.dtype, config, model: torch.nn.Module | None = None) -> None:
    """One ``lora_model(dtype)`` (or ``model``'s, a LoRA model in ``dtype``) step through fuser (``config``) against
    the same model in fp32 and eagerly in ``dtype``: the loss, and the LoRA gradients summed over the model, at least
    as close to fp32's as eager's; each gradient within 2x eager's distance. One gradient's half-precision error is
    one draw of rounding noise: on this model, over build seeds 0-3, fuser's ratio to eager's for single LoRA
    gradients reached 1.62 before the v sums' fp32 bases (issue 16) and 1.64 after (CPU, bf16), while the sums over
    the model were smaller than eager's in every seed. A wrong gradient is off by about its own size, far past either
    bar."""
    from tests.models.harness import assert_as_close_to_fp32_as_eager  # (the harness imports this module)

    model = lora_model(dtype) if model is None else model
    fp32 = lora_step(copy.deepcopy(model).float())  # the same values, computed in fp32
    eager = lora_step(copy.deepcopy(model))
    assert_as_close_to_fp32_as_eager(lora_step(model, config), eager, fp32)


def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with transformers' non-reentrant gradient checkpointing on, in training mode."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def assert_same_step(on, off) -> None:
    """Two ``lora_step`` results (loss, gradients) equal bit for bit, with some gradient to compare."""
    (loss, g), (loss_off, g_off) = on, off
    assert torch.equal(loss, loss_off) and g.keys() == g_off.keys() and g
    for name in g:
        assert torch.equal(g[name], g_off[name]), name


def batch(seq: int = 16, bsz: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (bsz, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Architectures for the gated-MLP tier: config class, extra config fields, and the fused-op counts per layer.
GATED_ARCHS = {
    "llama": ("LlamaConfig", {}, {"swiglu": 1}),
    "qwen3": ("Qwen3Config", {}, {"swiglu": 1}),
    "mistral": ("MistralConfig", {}, {"swiglu": 1}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, {"swiglu": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, {"swiglu": 1}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
        {"swiglu": 1},
    ),
    "gemma": ("GemmaConfig", {}, {"geglu": 1}),
    # not gated: must fuse no MLP
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4}, {}),
    "arcee": ("ArceeConfig", {}, {}),  # relu² MLP
    "starcoder2": ("Starcoder2Config", {}, {}),  # gelu_pytorch_tanh, un-gated
}


def build_any(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = N_LAYERS) -> torch.nn.Module:
    cls_name, extra, _ = GATED_ARCHS[arch]
    sizes = {"num_hidden_layers": layers, **({"n_layer": layers} if cls_name == "GPT2Config" else {})}  # GPT-2's name
    return from_config(cls_name, {**extra, **sizes}, seed).to(dtype)


def expected_mlp_counts(arch: str, layers: int = N_LAYERS) -> dict[str, int]:
    return {name: per_layer * layers for name, per_layer in GATED_ARCHS[arch][2].items()}


# Architectures for the RoPE tier: config class, extra config fields, RoPE ops expected per model (one per layer).
ROPE_ARCHS = {
    "llama": ("LlamaConfig", {}, N_LAYERS),
    "qwen3": ("Qwen3Config", {}, N_LAYERS),
    "mistral": ("MistralConfig", {}, N_LAYERS),
    "gemma": ("GemmaConfig", {}, N_LAYERS),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, N_LAYERS),
    "glm4": ("Glm4Config", {"partial_rotary_factor": 0.5, "pad_token_id": 0}, N_LAYERS),  # interleaved, partial
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}, N_LAYERS),  # partial rotate_half
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "hidden_dropout": 0.0, "attention_dropout": 0.0}, N_LAYERS),
    # MLA with interleaved pairs written back as halves, no neg (rope_interleave=True, the default)
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "head_dim": 8,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "pad_token_id": 0,
        },
        N_LAYERS,
    ),
    # view_as_complex rotation of [B, T, H, D] (no_rope_layers: 1 = this layer uses RoPE)
    "llama4_text": (
        "Llama4TextConfig",
        {
            "intermediate_size_mlp": 96,
            "num_local_experts": 2,
            "interleave_moe_layer_step": 1,
            "no_rope_layers": [1] * N_LAYERS,
            "pad_token_id": 0,
        },
        N_LAYERS,
    ),
    # no RoPE at all
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": N_LAYERS, "n_head": 4}, 0),
    "bloom": ("BloomConfig", {"n_layer": N_LAYERS, "n_head": 4}, 0),
}


def build_rope_arch(arch: str, seed: int = 0) -> torch.nn.Module:
    cls_name, extra, _ = ROPE_ARCHS[arch]
    return from_config(cls_name, extra, seed)


def assert_training_step_equals_eager(model: torch.nn.Module, config, data: dict | None = None, grad_tol: float = 1e-4):
    """One fp32 forward+backward through ``fuser.optimize(model, config)`` against a deep copy run eagerly:
    loss within 1e-5 relative, every parameter gradient within ``grad_tol`` relative. Returns both outputs."""
    import fuser

    reference = copy.deepcopy(model)
    data = data or batch()
    out_ref = reference(**data)
    out_ref.loss.backward()
    out = fuser.optimize(model, config)(**data)
    out.loss.backward()
    assert rel(out.loss, out_ref.loss) <= 1e-5
    g, g_ref = grads(model), grads(reference)
    assert g.keys() == g_ref.keys() and g
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= grad_tol, name
    return out, out_ref


# Architectures for the lm_head + cross-entropy tier: config class and extra config fields (one layer is enough:
# the pattern sits after the last layer). Gemma and Gemma-2 tie lm_head to the embedding by default; Gemma-2's
# softcap is small so that tanh is far from linear on these tiny logits.
LCE_ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"final_logit_softcapping": 0.1}),
}


def build_lce_arch(arch: str, seed: int = 0) -> torch.nn.Module:
    cls_name, extra = LCE_ARCHS[arch]
    return from_config(cls_name, {"num_hidden_layers": 1, **extra}, seed)


def lm_batch(seq: int = 16, bsz: int = 2, seed: int = 1, num_items_in_batch: bool = False) -> dict:
    """input_ids and labels with a few ignored (-100) positions; optionally ``num_items_in_batch`` as a tensor
    (what the HF Trainer passes under gradient accumulation)."""
    data = batch(seq, bsz, seed)
    labels = data["input_ids"].clone()
    labels[0, 3:5] = -100
    labels[-1, seq // 2] = -100
    data["labels"] = labels
    if num_items_in_batch:
        # the shifted labels that count, plus some, as if this were one of several micro-batches
        data["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()) + 7)
    return data


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module; benchmarks/ goes on ``sys.path``, as for a script run from there, so
    the script finds the modules it imports beside it (``jobs``, ``bench_common``, ...)."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module(name)


def load_saved_activations():
    """``benchmarks/saved_activations.py`` as a module (what the forward saves under Inductor's partitioner)."""
    return load_benchmark("saved_activations")


def saved_wide_tensors(model: torch.nn.Module, width: int, config=None) -> list[tuple[int, ...]]:
    """Shapes of the bf16 tensors of last dim ``width`` that a step of ``model`` (the patterns and options of
    ``config``, default ``FuserConfig()``; Inductor's partitioner) saves for the backward:
    ``benchmarks/saved_activations.py``'s count."""
    import fuser

    ids = torch.randint(0, 128, (2, 8))
    enabled = config or fuser.FuserConfig()
    patterns = [pattern for name, pattern in fuser.patterns.PATTERNS.items() if enabled.enabled(name)]
    saved = load_saved_activations().saved_for_backward(
        model, (), {"input_ids": ids, "labels": ids}, patterns, config=config
    )
    return [shape for dtype, shape in saved if dtype == torch.bfloat16 and shape[-1] == width]


def small_llama(intermediate: int, dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> torch.nn.Module:
    """A Llama of ``layers`` layers (vocab 128, hidden 32) with a distinctive intermediate size, for counting saved
    tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


# Vision-language models for the RoPE tier: the text decoder's M-RoPE (cos/sin of the (t, h, w) positions,
# recomposed by sections) and the vision tower's 2-D rotary embedding (the (h, w) positions). Config class, text
# config fields, vision config fields.
_TEXT_VL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=N_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
)
_VISION_VL = dict(depth=N_LAYERS, num_heads=2, patch_size=2, temporal_patch_size=2, in_channels=3, spatial_merge_size=2)


def _mrope(section: list[int], **extra) -> dict:
    """M-RoPE rotary parameters: ``section`` splits the head_dim/2 frequencies among the t, h and w positions."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section, **extra}}


VL_ARCHS = {
    "qwen2_vl": ("Qwen2VLConfig", _mrope([2, 3, 3]), {"embed_dim": 32, "hidden_size": 64}),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        _mrope([2, 3, 3]),
        {"hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 64, "window_size": 8},
    ),
    # interleaved M-RoPE (h and w on every third frequency)
    "qwen3_vl": (
        "Qwen3VLConfig",
        {"head_dim": 16, **_mrope([4, 2, 2], mrope_interleaved=True)},
        {"hidden_size": 32, "intermediate_size": 48, "out_hidden_size": 64, "num_position_embeddings": 64},
    ),
}
# the image of the vision tests: one frame of 4 × 6 patches (t, h, w), 3 channels of 2 × 2 × 2 pixels per patch
VISION_GRID = (1, 4, 6)


def build_vl(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight ``<arch>ForConditionalGeneration`` (text decoder and vision tower of ``N_LAYERS`` each),
    sdpa attention, dropout off."""
    cls_name, text, vision = VL_ARCHS[arch]
    config = getattr(transformers, cls_name)(
        text_config={**_TEXT_VL, **text},
        vision_config={**_VISION_VL, **vision},
        image_token_id=3,
        video_token_id=4,
        vision_start_token_id=5,
    )
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(config).eval()


def mrope_batch(seq: int = 16, bsz: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    """Text ids and labels with 3-D M-RoPE position ids [3, B, T] that differ per axis, as an image's grid gives
    them (text-only positions would be the same on all three, hiding a wrong section)."""
    data = batch(seq, bsz, seed)
    t = torch.arange(seq)
    data["position_ids"] = torch.stack([t, t // 2, t % 4 + 3])[:, None, :].expand(3, bsz, seq).contiguous()
    return data


# vision towers with a 2-D rotary embedding, beside those of VL_ARCHS: built alone from their vision configs
VISION_TOWERS = [*VL_ARCHS, "pixtral", "inkling2"]


def build_vision_tower(arch: str, seed: int = 1) -> tuple[torch.nn.Module, tuple, dict]:
    """A tiny vision tower of ``N_LAYERS`` blocks (dropout off, sdpa attention) and its inputs, (tower, args,
    kwargs): one image of ``VISION_GRID``'s 4 × 6 patches (Qwen's lineage, Inkling-2: merged 2 × 2 into 2 × 3
    language-model tokens), or a 3-channel 8 × 12 image of 2 × 2 patches (Pixtral)."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = VISION_GRID
    if arch in VL_ARCHS:
        tower = build_vl(arch).model.visual
        return tower, (torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=g),), {"grid_thw": torch.tensor([VISION_GRID])}
    models = transformers.models
    if arch == "pixtral":
        config = transformers.PixtralVisionConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=N_LAYERS, num_attention_heads=2, head_dim=16,
            image_size=16, patch_size=2,
        )  # fmt: skip
        cls = models.pixtral.modeling_pixtral.PixtralVisionModel
        args, kwargs = (torch.randn(1, 3, 2 * h, 2 * w, generator=g),), {"image_sizes": torch.tensor([[2 * h, 2 * w]])}
    else:
        config = models.inkling2.configuration_inkling2.Inkling2VisionConfig(
            hidden_size=32, num_hidden_layers=N_LAYERS, num_attention_heads=2, patch_size=2, posemb_grid_size=4,
            projection_hidden_dim=32, text_hidden_size=32,
        )  # fmt: skip
        cls = models.inkling2.modeling_inkling2.Inkling2VisionModel
        pixels = torch.rand(h * w // 4, 4, 4, 3, generator=g) * 2 - 1
        args, kwargs = (pixels,), {"image_grid_thw": torch.tensor([[t, h // 2, w // 2]])}
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).eval(), args, kwargs


def vision_loss(tower: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """A scalar of every output of the tower (its merged or pooled tokens where it has them, and the last hidden
    states), weighted so that no gradient is a plain sum."""
    out = tower(*args, **dict(kwargs))
    g = torch.Generator().manual_seed(2)
    outputs = [y for y in (out.get("pooler_output"), out.last_hidden_state) if y is not None]
    return sum((y * torch.randn(y.shape, generator=g)).sum() for y in outputs)
