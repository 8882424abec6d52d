"""CI's convergence check: fp32 training through fuser follows fp32 eager step for step (benchmarks/convergence.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

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
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


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
