"""The models and jobs the benchmarks run, declared once: every script reads its shapes and recipes from here.

A model is a transformers model type (what ``AutoConfig.for_model`` takes: ``"llama"``, ``"gemma3_text"``) and its
config fields (the public checkpoint's, or a CPU-sized Llama's), with random weights: nothing is downloaded.
``fields`` leave out the depth; ``layers`` is the checkpoint's own. Another family's public shapes are one more
entry here (and a job below), no code.

- ``JOBS``: the training-step jobs of ``train_step.py`` (a model, a method, a batch), ``TINY_*`` its ``--tiny``;
- ``PRESETS``: the convergence recipes of ``convergence.py --preset`` (a model cut to a few layers, a batch,
  steps and a learning rate);
- ``LORA``: the one LoRA recipe (peft, r 16, alpha 32, every linear layer).

The recorded results in ``benchmarks/results/`` were measured with these values: change one and the record no
longer says how it was obtained.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Model:
    model_type: str  # transformers model type (``AutoConfig.for_model``)
    fields: dict[str, Any]  # its fields, all but num_hidden_layers
    layers: int  # the checkpoint's decoder layers


MODELS: dict[str, Model] = {
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": Model(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        ),
        32,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": Model(
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
        36,
    ),
    # meta-llama/Llama-3.2-1B: tied embeddings, llama3 rope scaling
    "llama32-1b": Model(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
        ),
        16,
    ),
    # Qwen/Qwen2.5-7B: biases on q/k/v
    "qwen25-7b": Model(
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
        28,
    ),
    # google/gemma-3-4b-pt's text model: GeGLU, head_dim 256, q/k norms, 5 sliding-window (1024) layers to 1 global,
    # tied 262k embeddings
    "gemma3-4b": Model(
        "gemma3_text",
        dict(
            vocab_size=262208,
            hidden_size=2560,
            intermediate_size=10240,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
        34,
    ),
    # microsoft/Phi-3-mini-4k-instruct: packed qkv_proj and gate_up_proj, 32k vocab, no GQA (held out: no issue
    # names it)
    "phi3-mini": Model(
        "phi3",
        dict(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            pad_token_id=32000,
        ),
        32,
    ),
    # allenai/OLMo-2-1124-7B: norms after attention and MLP (post-norm residuals), q/k RMSNorm over all heads' width
    # (held out)
    "olmo2-7b": Model(
        "olmo2",
        dict(
            vocab_size=100352,
            hidden_size=4096,
            intermediate_size=11008,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
            pad_token_id=100277,
        ),
        32,
    ),
    # issue 16's smallest clear CPU configuration (fp32 drop ≈ 0.0025; eager/fuser bf16 10-19 % of it)
    "cpu-small": Model(
        "llama",
        dict(
            vocab_size=2048,
            hidden_size=512,
            intermediate_size=1792,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
        1,
    ),
    # the smallest one found that still separates eager from Inductor at 3 seeds (tests/test_convergence_cpu.py):
    # eager bf16 ~0.15-0.2 of fp32's drop, Inductor ~1.2 (benchmarks/results/convergence_bf16_cpu_2026-12-01.md)
    "cpu-tiny": Model(
        "llama",
        dict(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=896,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
        1,
    ),
}

LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def model_config(name: str, **fields: Any):
    """The transformers config of ``MODELS[name]`` at the checkpoint's depth; ``fields`` override any of it."""
    import transformers

    model = MODELS[name]
    return transformers.AutoConfig.for_model(
        model.model_type, **{**model.fields, "num_hidden_layers": model.layers, **fields}
    )


# ---------------------------------------------------------------------------------------------------------
# train_step.py: whole training steps of real fine-tuning jobs
# ---------------------------------------------------------------------------------------------------------

MODES = ("eager", "compile", "liger", "fuser")
MODE_TITLES = {"eager": "eager", "compile": "Inductor (torch.compile)", "liger": "Liger-Kernel", "fuser": "fuser"}
TRAIN_STEP_LR = 1e-5


@dataclasses.dataclass(frozen=True)
class Job:
    model: str  # key of MODELS
    method: str  # "lora", "qlora" (NF4 base + LoRA) or "full"
    batch: int
    seq: int
    checkpointing: bool = False
    about: str = ""
    # fp32 weights (and AdamW states) with the forward under bf16 autocast: what a trainer's ``bf16=True`` runs on a
    # model loaded in fp32; the run's dtype is then fp32 unless --dtype says otherwise
    autocast: bool = False


JOBS = {
    "llama3-8b-lora": Job("llama3-8b", "lora", 4, 2048, about="Llama-3-8B, LoRA r16 on all linear layers"),
    "qwen3-8b-lora": Job("qwen3-8b", "lora", 4, 2048, about="Qwen3-8B, LoRA r16 on all linear layers"),
    "llama3-8b-lora-amp": Job(
        "llama3-8b", "lora", 4, 2048, autocast=True, about="Llama-3-8B, LoRA r16, bf16 autocast (as Trainer(bf16=True))"
    ),
    "llama32-1b-full": Job("llama32-1b", "full", 4, 2048, about="Llama-3.2-1B, full fine-tune"),
    "llama32-1b-full-amp": Job(
        "llama32-1b", "full", 4, 2048, autocast=True, about="Llama-3.2-1B, full fine-tune, fp32 weights, bf16 autocast"
    ),
    "qwen25-7b-lora": Job("qwen25-7b", "lora", 4, 2048, about="Qwen2.5-7B, LoRA r16 on all linear layers"),
    "gemma3-4b-lora": Job("gemma3-4b", "lora", 4, 2048, about="Gemma-3-4B (text), LoRA r16 on all linear layers"),
    "phi3-mini-lora": Job("phi3-mini", "lora", 4, 2048, about="Phi-3-mini (3.8B), LoRA r16 on all linear layers"),
    "olmo2-7b-lora": Job(
        "olmo2-7b", "lora", 4, 2048, about="OLMo-2-7B (post-norms, q/k norms), LoRA r16 on all linear layers"
    ),
    "llama3-8b-qlora": Job("llama3-8b", "qlora", 4, 2048, about="Llama-3-8B, QLoRA (bitsandbytes NF4 base) r16"),
    "llama3-8b-lora-gc-32k": Job(
        "llama3-8b", "lora", 1, 32768, checkpointing=True, about="Llama-3-8B, LoRA r16, gradient checkpointing"
    ),
    "llama3-8b-lora-16k": Job("llama3-8b", "lora", 1, 16384, about="Llama-3-8B, LoRA r16, no checkpointing"),
}

# --tiny: the job's config at toy size (rope, tying and the model type stay the job's own)
TINY_FIELDS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
)
TINY_BATCH, TINY_SEQ = 2, 64


# ---------------------------------------------------------------------------------------------------------
# convergence.py --preset: a model trained for a few steps against its fp32 reference
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model (a key of MODELS) and the recipe it runs by default."""

    model: str
    layers: int
    batch: int
    seq: int
    steps: int
    lr: float  # ``--lr`` overrides it
    about: str
    method: str = "lora"  # ``--methods``' default: "lora" or "full"
    # every bf16 run under bf16 autocast, as Trainer(bf16=True) trains (convergence.py's *-amp runs): LoRA on the
    # bf16 base with fp32 adapters, a full fine-tune on fp32 weights
    autocast: bool = False


PRESETS: dict[str, Preset] = {
    # issue 16 measured Llama-3-8B's widths at 4 layers, 2×1024 tokens, 12 steps, lr 1e-5
    "llama3-8b": Preset("llama3-8b", 4, 2, 1024, 12, 1e-5, "Llama-3-8B widths"),
    "qwen3-8b": Preset("qwen3-8b", 4, 2, 1024, 12, 1e-5, "Qwen3-8B widths"),
    "llama32-1b": Preset("llama32-1b", 16, 2, 1024, 12, 1e-5, "Llama-3.2-1B"),  # all 16 layers
    # 2048 tokens a row, so the five sliding layers' window of 1024 keys is narrower than the sequence
    "gemma3-4b": Preset("gemma3-4b", 6, 2, 2048, 12, 1e-4, "Gemma-3-4B widths, 5 sliding + 1 global"),
    "cpu-small": Preset("cpu-small", 1, 2, 128, 8, 3e-6, "issue 16's small CPU Llama"),
    "cpu-tiny": Preset("cpu-tiny", 1, 2, 64, 8, 3e-6, "a smaller CPU Llama that shows issue 16"),
    # the same recipes under bf16 autocast; the LoRA ones are also run at --lr 2e-4 (a common LoRA rate)
    "llama3-8b-amp": Preset("llama3-8b", 4, 2, 1024, 12, 1e-5, "Llama-3-8B widths, bf16 autocast", autocast=True),
    "qwen3-8b-amp": Preset("qwen3-8b", 4, 2, 1024, 12, 1e-5, "Qwen3-8B widths, bf16 autocast", autocast=True),
    "llama32-1b-amp": Preset(
        "llama32-1b", 16, 2, 1024, 12, 1e-5, "Llama-3.2-1B, fp32 weights, bf16 autocast", method="full", autocast=True
    ),
    "cpu-tiny-amp": Preset("cpu-tiny", 1, 2, 64, 8, 3e-6, "cpu-tiny under bf16 autocast", autocast=True),
}
