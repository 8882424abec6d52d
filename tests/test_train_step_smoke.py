"""Smoke test of benchmarks/train_step.py on a CPU (tiny configs), and of its reports, profile and memory replay
on made-up numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import fuser
from tests.models.tiny import load_benchmark


@pytest.fixture(scope="module")
def train_step():
    return load_benchmark("train_step")


@pytest.fixture(scope="module")
def report():
    return load_benchmark("train_step_report")


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("train_step_profile")


@pytest.fixture(scope="module")
def memory():
    return load_benchmark("train_step_memory")


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy sizes gain nothing from threads, and on a busy 2-core machine OpenMP's spinning makes them 100× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(train_step, tmp_path: Path, mode: str, *extra: str, job: str = "llama3-8b-lora") -> dict:
    out = tmp_path / f"{job}-{mode}.json"
    argv = ["--job", job, "--mode", mode, "--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1"]
    assert train_step.main([*argv, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_tiny_lora_job_runs_eager_and_fuser_with_equal_first_losses(train_step, tmp_path):
    eager = _run(train_step, tmp_path, "eager")
    fused = _run(train_step, tmp_path, "fuser", "--fuser-inner-compiler", "aot_eager")
    for result in (eager, fused):
        assert result["status"] == "ok"
        assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
        assert result["tokens_per_s"] > 0 and result["step_ms"] > 0
        # per step (warm-up included): the host's launch time within the step's time, and GC time within that
        steps = result["warmup_step_s"] + result["step_s"]
        assert len(result["host_s"]) == len(result["gc_s"]) == len(steps) == 3
        assert all(0 < h <= t and 0 <= g <= h for h, g, t in zip(result["host_s"], result["gc_s"], steps, strict=True))
        # the fuser package the run measured: this checkout's (gpu_ab.sh's A/B reads it)
        assert result["fuser_source"] == str(Path(fuser.__file__).resolve().parent)
    assert abs(fused["first_loss"] - eager["first_loss"]) <= 1e-4 * abs(eager["first_loss"])
    assert fused["fuser_counts"], "fuser fused nothing in the tiny Llama"
    assert eager["trainable_params"] < eager["params"]  # LoRA: the base is frozen


def _one_job_per_model():
    """Each model's first job that runs on a CPU (no QLoRA) without checkpointing."""
    first: dict[str, str] = {}
    for name, job in load_benchmark("jobs").JOBS.items():
        if job.method != "qlora" and not job.checkpointing:
            first.setdefault(job.model, name)
    return sorted(first.values())


@pytest.mark.parametrize("job", _one_job_per_model())
def test_every_models_job_fuses_at_tiny_size_with_eagers_first_loss(train_step, tmp_path, job):
    """Every model in benchmarks/jobs.py (each family's public shapes as data) builds at ``--tiny`` size through
    ``AutoConfig.for_model``, fuses its norms, rotations and loss, and starts from eager's loss."""
    eager = _run(train_step, tmp_path, "eager", job=job)
    fused = _run(train_step, tmp_path, "fuser", "--fuser-inner-compiler", "aot_eager", job=job)
    assert eager["status"] == fused["status"] == "ok"
    assert abs(fused["first_loss"] - eager["first_loss"]) <= 1e-4 * abs(eager["first_loss"])
    counts = fused["fuser_counts"]
    assert counts.get("rope") and counts.get("linear_cross_entropy") == 1, counts
    assert counts.get("rms_norm", 0) + counts.get("rms_norm_linear", 0) > 0, counts


def test_cpu_refuses_qlora_and_liger_with_a_message(train_step, capsys):
    argv = ["--tiny", "--device", "cpu"]
    assert train_step.main(["--job", "llama3-8b-qlora", "--mode", "eager", *argv]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert train_step.main(["--job", "llama3-8b-lora", "--mode", "liger", *argv]) == 2
    assert "Liger-Kernel needs CUDA" in capsys.readouterr().err


def _ok(tps, peak, warm, **extra):
    return dict(status="ok", tokens_per_s=tps, step_ms=1.0, peak_gib=peak, warmup_s=warm, first_loss=12.0,
                last_loss=11.9, batch=4, seq=2048, steps=10, warmup=3, layers=32, **extra)  # fmt: skip


def test_table_shows_oom_crash_and_the_ratios_against_the_targets(report):
    results = {
        "eager": {"status": "OOM", "error": "CUDA out of memory", "peak_gib": 139.0},
        "compile": _ok(11764.0, 75.6, 101.0),
        "liger": {"status": "crashed", "error": "RuntimeError: CUDA error: an illegal memory access"},
        "fuser": _ok(14000.0, 60.0, 105.0, fuser_counts={"rms_norm": 65, "swiglu": 32}, graphs=1, graph_breaks=0),
    }
    text = report.results_table("llama3-8b-lora", results, "python benchmarks/train_step.py ...")
    assert "| eager | OOM |" in text
    assert "crashed (RuntimeError: CUDA error: an illegal memory access)" in text
    # Liger crashed: the ratios are against Inductor alone, and say so
    assert "| tokens/s ÷ the better of Inductor | 1.19 | ≥ 1.15 | yes |" in text
    assert "| peak memory ÷ the lower of Inductor | 0.79 | ≤ 0.85 | yes |" in text
    assert "| warm-up ÷ Inductor's | 1.04 | ≤ 1.1 | yes |" in text
    assert "fuser fused: rms_norm=65, swiglu=32" in text
    for name in ("torch", "triton", "transformers", "peft", "liger-kernel", "bitsandbytes"):
        assert f"{name} " in text


def test_profile_groups_kernels_by_family(profile):
    fused = profile.fuser_kernel_names()
    assert "rms_norm_fwd_kernel" in fused and not any(n.startswith("_") for n in fused)
    family = lambda name: profile.kernel_family(name, fused)  # noqa: E731
    assert family("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    # fp32 without TF32 (peft's fp32 LoRA adapters): cuBLAS's CUDA-core kernels, a family of their own
    fp32_gemm = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4"
    assert family(fp32_gemm) == "matmul fp32 (CUDA cores)"
    assert family("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>") == (
        "attention"
    )
    assert family("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)") == "attention"
    assert family("void kgemm_4bit_inference_naive<__nv_bfloat16, 128, 16>") == "bitsandbytes NF4"
    assert family("rms_norm_bwd_kernel") == "fused ops (fuser)"
    assert family("_rms_norm_forward_kernel") == "fused ops (Liger)"
    assert family("triton_poi_fused_add_mul_0") == "elementwise: Inductor (triton_)"
    assert family("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == (
        "optimizer"
    )
    assert family("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == (
        "elementwise: other"
    )
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst_a", "dur": 300.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst_a", "dur": 300.0},
            {"ph": "X", "cat": "kernel", "name": "rms_norm_fwd_kernel", "dur": 100.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000.0},
        ]
    }
    times = profile.kernel_times_from_trace(trace)
    assert times == {"nvjet_tst_a": [600.0, 2], "rms_norm_fwd_kernel": [100.0, 1]}
    families, top = profile.family_table(times, n_steps=2, wall_ms=0.5)
    assert "| matmul | 0.30 | 85.7% |" in families
    assert "| fused ops (fuser) | 0.05 | 14.3% |" in families
    assert "`nvjet_tst_a` | matmul | 1 | 0.300 | 85.7% |" in top


def test_live_at_peak_replays_the_allocator_trace(memory):
    """--memory-at-peak's replay on a made-up trace: the peak and exactly the blocks live then; a block freed
    (first free event) no longer counts, its second free event changes nothing, an unknown free is ignored."""

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size}

    events = [
        ev("alloc", 1, 100),
        ev("alloc", 2, 50),
        ev("free_requested", 1, 100),
        ev("free_completed", 1, 100),
        ev("alloc", 3, 120),  # 170 live: the peak
        ev("free_requested", 99, 7),  # allocated before the trace began
        ev("free_requested", 2, 50),
        ev("alloc", 4, 40),  # 120 + 40 = 160 live: below the peak
    ]
    peak, live = memory.live_at_peak(events)
    assert peak == 170
    assert sorted(e["addr"] for e in live) == [2, 3]
    assert memory.live_at_peak([]) == (0, [])


def test_python_holders_names_what_keeps_a_stray_tensor(memory):
    """--memory-at-peak's list of tensors live between steps: a stray 4 MiB tensor kept in a dict is listed with
    the dict as its holder; a known one (a parameter's pointer) and a small one are not."""
    stray = torch.randn(1 << 20)  # 4 MiB
    known = torch.randn(1 << 20)
    small = torch.randn(1000)
    keeper = {"stray_keep": stray}
    lines = memory.python_holders({known.data_ptr()}, device_type="cpu")
    listed = [line for line in lines if line.startswith("- (1048576,)")]
    assert len(listed) == 1, lines
    at = lines.index(listed[0])
    assert any("'stray_keep'" in line for line in lines[at + 1 :]), lines
    assert small.numel() == 1000 and keeper  # kept alive past the scan


def test_gradient_watch_tells_which_steps_gradients_are_still_allocated(memory):
    """--memory-at-peak's gradient watch: a gradient something keeps past its step is counted alive for that step
    alone; the gradients an optimizer step and zero_grad(set_to_none=True) release are not."""
    model = torch.nn.Linear(64, 64)
    watch = memory.GradientWatch(list(model.parameters()))
    kept = []
    # what a leak would do: a reference to the backward's output past zero_grad (in step 1 only)
    model.weight.register_hook(lambda grad: kept.append(grad) if len(watch.steps) == 2 else None)
    for _ in range(3):
        watch.begin_step()
        model(torch.randn(8, 64)).sum().backward()
        model.zero_grad(set_to_none=True)
    rows = watch.alive()
    assert [(s, n, alive) for s, n, alive, _ in rows] == [(0, 2, 0), (1, 2, 1), (2, 2, 0)]
    assert rows[1][3] == 64 * 64 * 4
    assert "- step 1: 1 of 2 (0.000 GiB)" in watch.lines(rows)
    assert kept


def test_memory_at_peak_on_cpu_records_which_gradients_stay_allocated(train_step, tmp_path):
    """Without CUDA the allocator replay is skipped, but the run still records, per step, how many gradients are
    still allocated: none, after each step's zero_grad(set_to_none=True)."""
    result = _run(train_step, tmp_path, "eager", "--memory-at-peak", str(tmp_path / "mem"))
    assert result["status"] == "ok"
    rows = result["gradients_alive"]
    assert [row[0] for row in rows] == [0, 1, 2]  # warm-up and timed steps; the memory step is not counted
    assert all(row[1] > 0 and row[2] == 0 and row[3] == 0 for row in rows), rows


def test_fuser_options_by_name_reach_the_config():
    import argparse

    model = load_benchmark("train_step_model")
    args = argparse.Namespace(
        fuser_patterns="+lora_sum",
        fuser_inner_compiler="aot_eager",
        fuser_option=[
            "experimental.upcast_linear.triton=false",
            "experimental.linear_cross_entropy.dw_kernel=triton",
            "keep_logits=true",
            "gated_mlp.recompute_for_down_weight=false",
        ],
    )
    config = model.fuser_config(args)
    assert config.experimental.upcast_linear.triton is False and config.upcast_linear.recompute_gated_input is True
    assert config.experimental.linear_cross_entropy.dw_kernel == "triton" and config.keep_logits is True
    assert config.gated_mlp.recompute_for_down_weight is False
    assert config.inner_compiler == "aot_eager"
    with pytest.raises(ValueError, match="unknown option"):
        model.fuser_config(
            argparse.Namespace(**{**vars(args), "fuser_option": ["experimental.upcast_linear.tritn=false"]})
        )


def test_tiny_autocast_job_keeps_fp32_weights_and_runs_its_forward_under_bf16_autocast(train_step, tmp_path):
    """The full fine-tuning job with fp32 weights under bf16 autocast (a trainer's ``bf16=True`` on an fp32 model):
    the record says so, the first loss is what eager computes under autocast, and fuser takes the residual adds of
    the fp32 stream and the bf16 projections into its norms."""
    out = {}
    for mode, extra in (("eager", ()), ("fuser", ("--fuser-inner-compiler", "aot_eager"))):
        path = tmp_path / f"{mode}.json"
        argv = ["--job", "llama32-1b-full-amp", "--mode", mode, "--tiny", "--device", "cpu", "--steps", "1"]
        assert train_step.main([*argv, "--warmup", "1", *extra, "--json", str(path)]) == 0
        out[mode] = json.loads(path.read_text())
    for result in out.values():
        assert result["status"] == "ok" and result["dtype"] == "float32" and result["autocast"] == "bfloat16"
        assert result["trainable_params"] == result["params"]
    assert abs(out["fuser"]["first_loss"] - out["eager"]["first_loss"]) <= 1e-3 * abs(out["eager"]["first_loss"])
    # every norm but the first layer's input norm reads a residual add of the fp32 stream and a bf16 projection
    layers = out["fuser"]["layers"]
    assert out["fuser"]["fuser_refined"].get("rms_norm") == 2 * layers, out["fuser"]["fuser_refined"]
