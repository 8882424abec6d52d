"""Every Triton kernel of fuser, launched by its op's own wrapper with the GPU's launch configuration, compiles
to sm_90 (the H200) here, without a GPU — bf16 included, which the Triton interpreter cannot run. A compile error
(last seen as the softcap kernel's "inconsistent return types", found only on the H200) fails CI instead of a
device call. See ``sm90_compile_check.py`` for how."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuser.kernels._triton import HAS_TRITON
from fuser.kernels.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[2]


def kernel_names() -> set[str]:
    names: list[str] = []
    for path in sorted((ROOT / "src" / "fuser" / "kernels").glob("*.py")):
        names += re.findall(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def\s+(\w+)", path.read_text())
    return {n for n in names if not n.startswith("_")}  # helpers (``_transform``) are inlined into kernels


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_every_kernel_compiles_for_an_h200_without_one():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    script = ROOT / "tests" / "kernels" / "sm90_compile_check.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    fp64 = {k[len("fp64 scalars: ") :]: v for k, v in results.items() if k.startswith("fp64 scalars: ")}
    rebuilt = {k[len("inductor source: ") :]: v for k, v in results.items() if k.startswith("inductor source: ")}
    compiled = {
        k: v for k, v in results.items() if not k.startswith(("scenario ", "fp64 scalars: ", "inductor source: "))
    }
    failed = {k: v for k, v in compiled.items() if v != "ok"}
    assert not failed, json.dumps(failed, indent=1)
    names = {k.split("(")[0] for k in compiled}
    missing = kernel_names() - names
    assert not missing, f"kernels never launched by the scenarios: {sorted(missing)}; scenario errors: {results}"
    in_bf16 = {k.split("(")[0] for k in compiled if "*bf16" in k}
    assert in_bf16 == names, f"not compiled with bf16 tensors: {sorted(names - in_bf16)}"
    # every kernel in fp16 and fp32 too, but the half-precision-only ones: the LoRA adapter's input cast (fp32
    # models have no upcast) and lm_head+CE's weight-gradient kernel (an fp32 weight stays on cuBLAS)
    for dtype in ("fp16", "fp32"):
        half_only = {"upcast_linear_fwd_kernel"} | ({"lce_dweight_kernel"} if dtype == "fp32" else set())
        assert {k.split("(")[0] for k in compiled if f"*{dtype}" in k} >= names - half_only
    # a kernel whose float scalars come in as fp64 (Inductor's typing of an inlined op's launch) computes in fp32,
    # as the JIT-launched kernel does: fp64 arithmetic made the RMSNorm backward 1.7x slower on the H200
    assert fp64 and all(v == "ok" for v in fp64.values()), json.dumps(fp64, indent=1)
    assert {"rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "upcast_linear_dx_kernel", "lce_chunk_kernel"} <= set(fp64)
    assert "layer_norm_fwd_kernel" in fp64
    # the kernels that dispatch on an activation code, as Inductor rebuilds their source to launch an inlined op's
    # kernel: every activation of the table compiles from it
    assert rebuilt and all(v == "ok" for v in rebuilt.values()), json.dumps(rebuilt, indent=1)
    activation_kernels = {"gated_act_fwd_kernel", "gated_act_bwd_kernel", "bias_act_fwd_kernel", "bias_act_bwd_kernel"}
    assert set(rebuilt) == {f"{k}({a})" for k in activation_kernels for a in ACTIVATIONS}
    for first in (True, False):  # the weight-gradient kernel's first chunk (write) and later ones (read and add)
        assert any(k.startswith("lce_dweight_kernel") and f"'FIRST': {first}" in k for k in compiled), first
