"""How fused ops launch their Triton kernels: ``launchable(kernel)[grid](...)``.

Outside a trace that is the kernel itself, at the cost of one context-variable read. While
:mod:`fuser.inductor.inline_ops` traces an op's body (:func:`tracing_kernels`), it is
``torch.library.wrap_triton(kernel)``, whose launch is recorded in the graph as a node that Inductor then launches
from its generated code. The switch lives with the kernels, so that they import nothing of the Inductor passes
that trace them; every kernel module imports :func:`launchable` (through ``fuser.kernels._triton``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_TRACING_KERNELS: ContextVar[bool] = ContextVar("fuser_tracing_kernels", default=False)


@contextmanager
def tracing_kernels() -> Iterator[None]:
    """Inside this block :func:`launchable` gives the traceable form of each kernel."""
    token = _TRACING_KERNELS.set(True)
    try:
        yield
    finally:
        _TRACING_KERNELS.reset(token)


def launchable(kernel: Any) -> Any:
    """``kernel``, or inside :func:`tracing_kernels` ``torch.library.wrap_triton(kernel)``."""
    if _TRACING_KERNELS.get():
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    return kernel
