"""``transformers.Trainer`` with data parallelism, launched as users launch it (``torch.distributed.run``, two CPU
processes, gloo): after ``fuser.optimize_(model)`` the trainer wraps the model in DDP as without fuser, every
block fuses, and the logged losses and trained parameters equal the run without fuser (the model tests'
tolerances: losses within 1e-5, updates within 1e-4 relative). What each process runs:
``_trainer_distributed_worker.py``. (On CPU the Trainer's ``fsdp`` arguments give DDP too: accelerate runs
multi-CPU jobs data-parallel, so its FSDP2 route needs GPUs.)"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny import rel

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = "tests.integrations._trainer_distributed_worker"
# every block of the tiny Llama: 2 layers of 2 norms (feeding only projections) plus the final one, q/k rotated
# once per layer, the loss
FUSED = {"rms_norm_linear": 4, "rms_norm": 1, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_ddp_through_optimize_in_place_trains_like_eager(tmp_path):
    out = tmp_path / "results.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), "-m", WORKER, str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(out, weights_only=False)
    eager, fused = results["eager"], results["fuser"]
    assert eager["wrapper"] == fused["wrapper"] == "DistributedDataParallel"
    # fuser's counts, with any causal-mask proof the transformers version allows on top
    assert {k: v for k, v in fused["counts"].items() if k != "causal_attention"} == FUSED
    assert len(fused["losses"]) == len(eager["losses"]) == 3
    for got, want in zip(fused["losses"], eager["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (fused["losses"], eager["losses"])
    assert fused["params"].keys() == eager["params"].keys()
    for name, value in eager["params"].items():
        want = value - eager["initial"][name]
        if want.norm() == 0:  # not trained (none here but tied or frozen buffers)
            assert torch.equal(fused["params"][name], value), name
            continue
        assert rel(fused["params"][name] - eager["initial"][name], want) <= 1e-4, name
