"""What the fused ops share around their kernels: the Triton import itself; when an op takes its Triton path
(:func:`triton_runs`), and which path an op's single entry takes for its ``impl`` argument (:func:`takes_triton`);
the reference compute dtype; the dtype check every public op makes of its tensor arguments, and the weight and bias
check of the ops that apply a linear layer; the ``[rows, n_cols]`` views the row-wise kernels read and write.

CUDA tensors always take Triton when it is installed. CPU tensors take the plain-torch reference, except inside
``with triton_on_cpu():`` while ``TRITON_INTERPRET=1`` is set (Triton reads it when it is first imported): then
the Triton kernels run through Triton's interpreter, which is how CI exercises them without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from fuser._dtypes import FLOAT_DTYPES
from fuser.kernels.launches import launchable  # noqa: F401  (how every kernel module launches its kernels)

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


def check_linear(
    op: str,
    x_name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dims: tuple[str, str] = ("out", "in"),
) -> None:
    """Raise ``ValueError`` unless ``weight`` is ``[out, in]`` with in = ``x.shape[-1]`` and ``bias`` (if any) is
    ``[out]`` of the weight's dtype, as ``F.linear(x, weight, bias)`` needs; ``dims``: how the op names out and in
    (``("V", "H")`` for a vocabulary projection)."""
    out_dim, in_dim = dims
    # the bias's size, after its dim's name where the op has one ("[V] = [32000]"; plain "out" adds nothing)
    bias_dims = f"[{weight.shape[0]}]" if out_dim == "out" else f"[{out_dim}] = [{weight.shape[0]}]"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fuser: {op} expects weight [{out_dim}, {in_dim}] with {in_dim} = {x_name}.shape[-1] = {x.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"fuser: {op} expects bias {bias_dims} of the weight's dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the reference paths compute in: fp32, or fp64 for fp64 inputs (the test oracle)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# Triton reads TRITON_INTERPRET when a kernel is decorated, so fuser's kernels took their form when this module was
# imported; read here once too (an environment lookup costs host time on every call, and every fused op's launch
# asks, up to a few times)
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Triton runs fuser's kernels through its interpreter (on CPU tensors), not compiled for a GPU:
    ``TRITON_INTERPRET=1`` was set when fuser was imported."""
    return _INTERPRETING


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
    if t.is_cuda:  # an attribute, not the device object (cheaper to read, and asked several times a fused op)
        return not _INTERPRETING
    return t.is_cpu and _INTERPRETING and _TRITON_ON_CPU.get()


def kernel_dtypes(*tensors: torch.Tensor | None, out_dtypes: Iterable[torch.dtype | None] = ()) -> bool:
    """The kernels are written for the dtype of every tensor given and every result dtype asked for (``None`` is
    skipped): fp32, fp16 and bf16. Anything else (fp64, the test oracle's) takes the op's reference path."""
    for t in tensors:
        if t is not None and t.dtype not in FLOAT_DTYPES:
            return False
    return all(d is None or d in FLOAT_DTYPES for d in out_dtypes)


def triton_runs(x: torch.Tensor, *others: torch.Tensor | None, out_dtypes: Iterable[torch.dtype | None] = ()) -> bool:
    """The op on ``x`` launches its Triton kernels: Triton runs for ``x``'s device (:func:`use_triton`), and the
    kernels are written for the dtypes of ``x``, of ``others`` and of ``out_dtypes`` (:func:`kernel_dtypes`)."""
    return use_triton(x) and kernel_dtypes(x, *others, out_dtypes=out_dtypes)


IMPLS = ("auto", "triton", "reference")


def takes_triton(impl: str, on_triton: bool) -> bool:
    """Which path an op's entry takes for its ``impl`` argument: ``"triton"`` its kernels, ``"reference"`` its
    plain-torch formulas (the only path for fp64, the test oracle), ``"auto"`` the kernels where ``on_triton`` (the
    op's own test, e.g. :func:`triton_runs`)."""
    if impl not in IMPLS:
        raise ValueError(f"fuser: impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    return impl == "triton" or (impl == "auto" and on_triton)


def or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``t``, or a 0-element tensor like ``like`` for ``None``: custom ops cannot return ``None``, so an empty tensor
    stands for "not computed"."""
    return t if t is not None else like.new_empty(0)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host code around the kernels. ``triton.cdiv`` is a constexpr function since Triton
    3.x, whose calls from Python unwrap their arguments as constexprs: microseconds each, a few per launch, where
    every microsecond of host time per op shows as idle GPU in a model of many small ops
    (``docs/notes/host-overhead.md``)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ ``n`` (0 for 0, as ``triton.next_power_of_2``), in plain Python, for the reason
    :func:`cdiv` says."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_SM_COUNT: dict[int | None, int] = {}


def num_programs_for(t: torch.Tensor, programs_per_sm: int = 4) -> int:
    """A persistent grid that fills the device: ``programs_per_sm`` per SM on a GPU, a handful on the interpreter."""
    if t.device.type == "cuda":
        if t.device.index not in _SM_COUNT:  # the properties' lookup costs host time on every launch otherwise
            _SM_COUNT[t.device.index] = torch.cuda.get_device_properties(t.device).multi_processor_count
        return programs_per_sm * _SM_COUNT[t.device.index]
    return 4


def as_rows(t: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``t`` as the 2-D ``[rows, n_cols]`` tensor the kernels read (any row stride, unit column stride): a view
    where one exists (a single column needs no unit stride), else a copy. ``order`` (from :func:`row_order`): the
    rows taken in that order of the leading dims, as another tensor of that layout stores them (a view for such a
    tensor, a copy in that order for any other)."""
    if order is not None:
        t = t.permute(order)
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def out_rows(t: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """An output buffer as ``[rows, n_cols]`` (rows in ``order``, as :func:`as_rows`): a view (never a copy, or the
    kernel's writes would be lost; a buffer not laid out in ``order`` raises)."""
    if order is not None:
        t = t.permute(order)
    rows = t.view(-1, t.shape[-1])
    assert rows.stride(-1) == 1 or rows.shape[-1] == 1, "fuser: a kernel's output buffer needs unit last stride"
    return rows


def row_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s dims that its storage follows, where that is not its shape's: a dense tensor with unit
    last stride whose leading dims are permuted in memory (Hugging Face's per-head ``[B, H, T, D]`` q and k, views
    of ``[B, T, H, D]`` storage). ``None`` for a contiguous tensor or one with gaps.

    A row-wise op (a norm over the last dim) computes each row alone, so it can read such a tensor's rows in
    storage order, with no copy, and write its results in the same layout: what eager's elementwise ops do with
    it, and what the next op (RoPE, attention's ``[B·T, H, D]`` rows, the output projection's reshape) reads
    without a copy."""
    if t.dim() < 3 or t.stride(-1) != 1 or t.is_contiguous():
        return None
    lead = sorted(range(t.dim() - 1), key=t.stride, reverse=True)  # stable: size-1 dims keep their place
    order = (*lead, t.dim() - 1)
    return order if t.permute(order).is_contiguous() else None


def empty_in_order(
    shape: Sequence[int], order: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An empty tensor of ``shape`` stored in ``order`` (as :func:`row_order` gives it; contiguous for ``None``);
    ``order`` may be longer than ``shape`` (a tensor's order, for its per-row statistics: the leading dims' part)."""
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    order = tuple(d for d in order if d < len(shape))
    stored = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return stored.permute(inverse)
