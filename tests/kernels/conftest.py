"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

import fuser.kernels.upcast_linear as U


@pytest.fixture
def triton_path(monkeypatch, triton_on_cpu):
    """upcast_linear's Triton path (which lora_sum reuses) through the interpreter, on by default as on a GPU:
    every buffer its kernels write starts as NaN (an element a kernel skips cannot pass for a value), and the
    list returned records which of its launchers ran."""
    triton_on_cpu()
    monkeypatch.setattr(U, "_alloc", lambda *shape, **kw: torch.full(shape, float("nan"), **kw))
    launched = []
    for name in ("_forward_triton", "_dx_triton", "_dw_triton"):
        real = getattr(U, name)
        monkeypatch.setattr(U, name, lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw))
    return launched
