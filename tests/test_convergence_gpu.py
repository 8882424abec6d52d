"""Issue 16 on a GPU: bf16 LoRA through fuser (Triton kernels, Inductor) learns a repeated batch as fp32 does.

The cpu-tiny case of tests/test_convergence_cpu.py (LoRA B starts at zero, lr 3e-6: every LoRA term is below half a
bf16 ulp of its base), on CUDA: before the fix fuser's lora_sum and gated ops rounded those sums away, and its loss
fell as little as eager bf16's.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_convergence_cpu import BF16_PRESET, BF16_SEED, _drop, _load_convergence


@pytest.mark.gpu
def test_bf16_lora_learns_like_fp32_on_cuda():
    convergence = _load_convergence()
    preset = convergence.PRESETS[BF16_PRESET]
    base = convergence.round_parameters(convergence.build_preset(BF16_PRESET, None, BF16_SEED), torch.bfloat16)
    vocab = convergence.MODELS[preset.model].fields["vocab_size"]
    ids = convergence.fixed_batch(vocab, preset.batch, preset.seq, BF16_SEED)
    data, cuda = [ids] * preset.steps, torch.device("cuda")
    runs = {
        run: convergence.train(base, "lora", run, data, cuda, lr=preset.lr, seed=BF16_SEED)
        for run in ("eager-fp32", "eager-bf16", "fuser-bf16")
    }
    assert runs["fuser-bf16"]["fuser_counts"].get("lora_sum"), runs["fuser-bf16"]["fuser_counts"]
    fp32, eager, fused = (_drop(runs[r]) for r in ("eager-fp32", "eager-bf16", "fuser-bf16"))
    assert eager < 0.5 * fp32, f"the case must show the effect in eager bf16: {eager:.2e} vs fp32 {fp32:.2e}"
    assert fused >= 0.7 * fp32, f"fuser bf16's loss drop {fused:.2e} is {fused / fp32:.2f} of fp32's {fp32:.2e}"
