"""CI's convergence checks (benchmarks/convergence.py): fp32 training through fuser follows fp32 eager step for step;
bf16 LoRA through fuser learns as much per step as fp32 does (issue 16)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.tiny import load_benchmark

STEPS = 20
RTOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy sizes gain nothing from threads, and on a busy 2-core machine OpenMP's spinning makes them 100× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load_convergence():
    return load_benchmark("convergence")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fp32_fuser_losses_follow_fp32_eager_on_real_text(method):
    convergence = _load_convergence()
    data = convergence.batches(convergence.token_stream(convergence.english_documents()), STEPS, 2, 64, seed=0)
    base = convergence.build_model("llama", hidden=64, layers=2, seq=64, seed=0)
    cpu = torch.device("cpu")
    eager = convergence.train(base, method, "eager-fp32", data, cpu, lr=1e-3)
    fused = convergence.train(base, method, "fuser-fp32", data, cpu, lr=1e-3, fuser_inner_compiler="aot_eager")

    assert fused["fuser_counts"], "fuser fused nothing: the check would compare eager with eager"
    assert all(math.isfinite(x) for x in eager["losses"])
    assert eager["losses"][-1] < eager["losses"][0] - 0.1, "the model should learn something in 20 steps"
    for step, (got, want) in enumerate(zip(fused["losses"], eager["losses"], strict=True)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: fuser {got} vs eager {want}"
    verdicts = convergence.check({"eager-fp32": eager["losses"], "fuser-fp32": fused["losses"]})
    assert verdicts and all(ok for _, ok, _ in verdicts), verdicts


# issue 16: bf16 LoRA at a real learning rate. peft computes ``(base + lora_B(lora_A(x)) * s).to(bf16)`` with fp32
# adapters; the bf16 base output is bf16-exact and the LoRA term (B starts at 0) is far below its ulp, so rounding
# the sum erases it: the adapters train (evaluated in fp32 they are as good as fp32's), but the bf16 model's loss
# barely moves. Eager rounds there; Inductor fuses the cast into the consumers and keeps the term; fuser's lora_sum
# op rounds its output, and its swiglu op rounds the gate/up sums it absorbs.
# Preset cpu-tiny: 1-layer Llama, hidden 256, vocab 1024, one 2×64 batch of random tokens repeated for 8 steps,
# lr 3e-6. Loss drop ÷ fp32's, seeds 0/1/2 (benchmarks/results/convergence_bf16_cpu_2026-12-01.md): eager bf16
# 0.21/0.13/0.14, Inductor 1.18/1.34/1.24, fuser before the fix 0.19/0.19/0.08 (0.19/0.17/0.08 with aot_eager),
# after it (lora_sum_wide into the gated op, fp32 sums into the residual adds) 1.12/1.14/1.21 (1.13/1.14/1.19).
BF16_PRESET = "cpu-tiny"
BF16_SEED = 0
# aot_eager compiles in seconds (Inductor: ~40 s cold here). Under it the graph fuser leaves unrewritten rounds at
# every peft cast as eager does (fuser with no patterns: 0.12-0.23 of fp32's drop), so this test passes only once
# fuser's own ops keep the LoRA term; a fix that instead leaves the casts for Inductor to fuse needs "inductor" here.
BF16_FUSER_INNER = "aot_eager"


@pytest.fixture(scope="module")
def bf16_lora_case():
    """The cpu-tiny model (bf16-rounded fp32 weights), its repeated batch, and the fp32 and eager bf16 runs."""
    convergence = _load_convergence()
    preset = convergence.PRESETS[BF16_PRESET]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = convergence.round_parameters(convergence.build_preset(BF16_PRESET, None, BF16_SEED), torch.bfloat16)
        vocab = convergence.MODELS[preset.model].fields["vocab_size"]
        ids = convergence.fixed_batch(vocab, preset.batch, preset.seq, BF16_SEED)
        data = [ids] * preset.steps
        cpu = torch.device("cpu")
        runs = {
            run: convergence.train(base, "lora", run, data, cpu, lr=preset.lr, seed=BF16_SEED)
            for run in ("eager-fp32", "eager-bf16")
        }
    finally:
        torch.set_num_threads(threads)
    return convergence, base, data, preset, runs


def _drop(result):
    return result["losses"][0] - result["losses"][-1]


def test_bf16_lora_case_discriminates(bf16_lora_case):
    """The case of the next test shows issue 16 in eager bf16, so the next test can tell a fix from no fix."""
    _, _, _, _, runs = bf16_lora_case
    fp32, eager = _drop(runs["eager-fp32"]), _drop(runs["eager-bf16"])
    assert fp32 > 1e-3, f"fp32 should learn the repeated batch: loss drop {fp32}"
    assert eager < 0.5 * fp32, f"eager bf16's drop {eager:.2e} is not below half fp32's {fp32:.2e}"


def test_bf16_lora_learns_like_fp32(bf16_lora_case):
    """Issue 16: fuser bf16's loss falls like fp32's (today's code before the fix: 0.08-0.19 of it)."""
    convergence, base, data, preset, runs = bf16_lora_case
    cpu = torch.device("cpu")
    fused = convergence.train(
        base, "lora", "fuser-bf16", data, cpu, lr=preset.lr, seed=BF16_SEED, fuser_inner_compiler=BF16_FUSER_INNER
    )
    if not fused["fuser_counts"]:
        pytest.fail("fuser fused nothing: the check would compare eager with eager")
    fp32, got = _drop(runs["eager-fp32"]), _drop(fused)
    assert got >= 0.7 * fp32, f"fuser bf16's loss drop {got:.2e} is {got / fp32:.2f} of fp32's {fp32:.2e} (want ≥ 0.7)"


# The same case under bf16 autocast, as Trainer(bf16=True) trains a bf16-loaded model with peft's fp32 adapters:
# autocast runs the adapters' matmuls in bf16 and peft adds their term to the bf16 base output, so eager autocast
# loses it as eager bf16 does; fuser's lora_sum takes the autocast form whole (variant "peft autocast"). Preset
# cpu-tiny-amp (cpu-tiny's recipe, the *-amp runs), seeds 0/1/2 (benchmarks/results/convergence_cpu-tiny-amp_cpu_
# 2026-12-06.md): max |Δ| vs fp32 fuser (aot_eager) 4.2e-4 / 5.6e-4 / 2.7e-4, Inductor 1.07e-3 / 1.31e-3 / 1.16e-3;
# drop ÷ fp32's eager 0.23 / 0.18 / 0.18, Inductor 1.20 / 1.33 / 1.17, fuser 1.11 / 1.05 / 0.89. fuser without
# lora_sum passes the rule too here (max |Δ| 3.9e-4 to 5.5e-4, drop 0.62-0.79): what shows the LoRA sums fused under
# autocast is the "peft autocast" count, not the rule.
AMP_PRESET = "cpu-tiny-amp"
# eager-bf16 beside the autocast runs: its losses differ from eager-amp's only if autocast was applied
AMP_RUNS = ("eager-fp32", "eager-bf16", "eager-amp", "inductor-amp", "fuser-amp")
# the tests that read the record on one xdist worker, so its Inductor compile (about a minute cold) runs once
AMP_GROUP = pytest.mark.xdist_group("convergence_amp")


def test_autocast_presets_default_to_the_amp_runs():
    convergence = _load_convergence()
    args = convergence.parse_args(["--preset", "llama3-8b-amp", "--device", "cpu", "--lr", "2e-4"])
    assert args.runs == convergence.AUTOCAST_RUNS and args.methods == ["lora"]
    assert args.lr_lora == 2e-4, "--lr overrides the preset's learning rate"
    full = convergence.parse_args(["--preset", "llama32-1b-amp", "--device", "cpu"])
    assert full.methods == ["full"] and full.lr_full == 1e-5
    assert convergence.parse_args(["--preset", "llama3-8b", "--device", "cpu"]).runs == convergence.DEFAULT_RUNS["cuda"]
    amp = convergence.parse_run("eager-amp")
    assert amp.autocast and amp.weights_dtype("lora") == torch.bfloat16
    assert amp.weights_dtype("full") == torch.float32, "a full fine-tune under autocast keeps fp32 master weights"


@pytest.fixture(scope="module")
def amp_lora_record():
    """The harness's record of cpu-tiny-amp (its fuser run on aot_eager, as BF16_FUSER_INNER says why)."""
    convergence = _load_convergence()
    args = convergence.parse_args(
        ["--preset", AMP_PRESET, "--device", "cpu", "--seed", str(BF16_SEED), "--runs", ",".join(AMP_RUNS)]
        + ["--fuser-inner-compiler", BF16_FUSER_INNER]
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        record = convergence.run_all(args)
    finally:
        torch.set_num_threads(threads)
    return convergence, record


@AMP_GROUP
def test_autocast_lora_fuser_passes_the_rule(amp_lora_record):
    """fuser under autocast: max |Δ| vs fp32 within Inductor's under autocast (and the drop rule), no slack."""
    convergence, record = amp_lora_record
    (runs,) = record["results"].values()
    losses = {run: out["losses"] for run, out in runs.items()}
    verdicts = convergence.check(losses)
    assert len(verdicts) == 1 and "autocast" in verdicts[0][0], verdicts
    assert verdicts[0][1], verdicts
    _, passed = convergence.render([record], None)
    assert all(passed.values()), passed


@AMP_GROUP
def test_autocast_lora_runs_ran_under_autocast(amp_lora_record):
    """The case shows the lost LoRA term under autocast, the runs were autocast's, and fuser fused its LoRA sums."""
    _, record = amp_lora_record
    (runs,) = record["results"].values()
    assert runs["eager-amp"]["losses"] != runs["eager-bf16"]["losses"], "eager-amp ran as eager-bf16: no autocast"
    fp32, eager = _drop(runs["eager-fp32"]), _drop(runs["eager-amp"])
    assert eager < 0.5 * fp32, f"eager autocast's drop {eager:.2e} is not below half fp32's {fp32:.2e}"
    fused = runs["fuser-amp"]
    lora_sums = fused["fuser_counts"].get("lora_sum", 0)
    assert lora_sums > 0, f"fuser fused no LoRA sum under autocast: {fused['fuser_counts']}"
    # the autocast form matches only a graph Dynamo captured under autocast
    assert fused["fuser_variants"].get("lora_sum (peft autocast)", 0) == lora_sums, fused["fuser_variants"]


def test_autocast_full_fine_tune_trains_fp32_weights():
    """A full fine-tune under autocast runs (fp32 weights, bf16 matmuls): its losses are not the bf16 weights'."""
    convergence = _load_convergence()
    data = [convergence.fixed_batch(convergence.VOCAB, 2, 32, seed=0)] * 3
    base = convergence.round_parameters(
        convergence.build_model("llama", hidden=64, layers=1, seq=32, seed=0), torch.bfloat16
    )
    cpu = torch.device("cpu")
    amp = convergence.train(base, "full", "eager-amp", data, cpu, lr=1e-3)
    bf16 = convergence.train(base, "full", "eager-bf16", data, cpu, lr=1e-3)
    fp32 = convergence.train(base, "full", "eager-fp32", data, cpu, lr=1e-3)
    assert all(math.isfinite(x) for x in amp["losses"])
    assert amp["losses"] != bf16["losses"] and amp["losses"] != fp32["losses"]
