"""What the fused ops share around their kernels: when they take their Triton path, the Triton import itself, the
reference compute dtype, the dtype check every public op makes of its tensor arguments, and the ``[rows, n_cols]``
views the row-wise kernels read and write.

CUDA tensors always take Triton when it is installed. CPU tensors take the plain-torch reference, except inside
``with triton_on_cpu():`` while ``TRITON_INTERPRET=1`` is set (Triton reads it when it is first imported): then
the Triton kernels run through Triton's interpreter, which is how CI exercises them without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

try:  # Triton is optional: without it every op runs its reference path.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


class DtypeError(ValueError, NotImplementedError):
    """A tensor argument of a dtype the op has no kernel for (integer, bool, complex).

    A ``ValueError`` (a bad argument) that is also the ``NotImplementedError`` (a ``RuntimeError``) eager raises for
    the same input where eager raises one: ``F.rms_norm``, ``F.silu`` and ``F.gelu`` on an integer tensor give
    ``NotImplementedError: "silu_cpu" not implemented for 'Long'``, a matmul of an integer with a float tensor a
    ``RuntimeError``; so an ``except`` written for eager's error catches fuser's too. Where eager computes
    something for integers (``F.linear(x.to(w.dtype), w)`` of an integer ``x``, an integer weight of
    ``F.rms_norm``), the fused op still refuses: none of its kernels is written for integers.
    """


def check_floating(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`DtypeError` for the first named tensor that is not floating point (``None`` is skipped).

    A dtype test only: no device synchronisation, no cost on the hot path.
    """
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise DtypeError(
                f"fuser: {op} expects a floating-point {name} (float32, bfloat16 or float16), got {t.dtype}; "
                f"cast it first (e.g. {name}.float())"
            )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the reference paths compute in: fp32, or fp64 for fp64 inputs (the test oracle)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def interpreting() -> bool:
    """Triton runs kernels through its interpreter (on CPU tensors), not compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_TRITON_ON_CPU: ContextVar[bool] = ContextVar("fuser_triton_on_cpu", default=False)


@contextmanager
def triton_on_cpu(enabled: bool = True) -> Iterator[None]:
    """Inside this block the ops on CPU tensors launch their Triton kernels through Triton's interpreter (when it
    is on, ``TRITON_INTERPRET=1``) instead of taking their plain-torch reference path: for the calls made here,
    and for the backward of a graph run here (CPU autograd runs on the calling thread). ``enabled=False``: the
    reference path again, inside an enabling block."""
    token = _TRITON_ON_CPU.set(enabled)
    try:
        yield
    finally:
        _TRITON_ON_CPU.reset(token)


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on ``t`` should launch its Triton kernels."""
    if not HAS_TRITON:
        return False
    if t.device.type == "cuda":
        return not interpreting()
    return t.device.type == "cpu" and interpreting() and _TRITON_ON_CPU.get()


def num_programs_for(t: torch.Tensor, programs_per_sm: int = 4) -> int:
    """A persistent grid that fills the device: ``programs_per_sm`` per SM on a GPU, a handful on the interpreter."""
    if t.device.type == "cuda":
        return programs_per_sm * torch.cuda.get_device_properties(t.device).multi_processor_count
    return 4


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D ``[rows, n_cols]`` tensor the kernels read (any row stride, unit column stride): a view
    where one exists (a single column needs no unit stride), else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def out_rows(t: torch.Tensor) -> torch.Tensor:
    """An output buffer as ``[rows, n_cols]``: a view (never a copy, or the kernel's writes would be lost)."""
    rows = t.view(-1, t.shape[-1])
    assert rows.stride(-1) == 1 or rows.shape[-1] == 1, "fuser: a kernel's output buffer needs unit last stride"
    return rows
