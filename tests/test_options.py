"""One configuration surface: no environment variable switches anything in fuser.

CPU tensors take the Triton kernels (through the interpreter) inside ``triton_on_cpu()``, not under an
environment variable.
"""

from __future__ import annotations

import torch

from fuser.kernels._triton import HAS_TRITON, interpreting, use_triton


def test_cpu_tensors_take_triton_only_inside_triton_on_cpu(monkeypatch):
    from fuser.kernels._triton import triton_on_cpu

    monkeypatch.setenv("FUSER_CPU_TRITON", "1")  # no longer read
    x = torch.ones(2)
    assert not use_triton(x)
    with triton_on_cpu():
        assert use_triton(x) == (HAS_TRITON and interpreting())
        with triton_on_cpu(False):
            assert not use_triton(x)
        assert use_triton(x) == (HAS_TRITON and interpreting())
    assert not use_triton(x)
