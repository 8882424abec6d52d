"""When a linear fed an upcast copy of its input is one ``fuser::upcast_linear`` computes: the ``upcast_linear``
pattern's check, shared with ``rms_norm_linear``'s for the LoRA A readers of a norm (a module of its own, as each of
those pattern modules imports the other's pieces otherwise)."""

from __future__ import annotations

import torch

from fuser.engine.canonical import tensor_meta
from fuser.patterns.base import HALF_DTYPES, Decline, NotApplicable


def why_not_upcast(x: object, dtype: object, weight: object, out: object, bias: object) -> Decline | None:
    """None when ``linear(x.to(dtype), weight, bias)`` (``out``: the linear's node) is one the op computes: a
    bf16/fp16 ``x`` cast to fp32 for a 2-D fp32 weight on its device, an fp32 result and bias; else why not, as
    the decline to raise (the pattern's check), whose text ``rms_norm_linear`` quotes for the LoRA A readers of a
    norm. An input that is not half precision is :class:`NotApplicable`: there is no narrower copy to save."""
    xt, wt, yt = tensor_meta(x), tensor_meta(weight), tensor_meta(out)
    if xt is None or wt is None:
        return Decline("the input or the weight has no metadata")
    if xt.dtype not in HALF_DTYPES:
        return NotApplicable(
            f"the input is {xt.dtype} before the cast, not bf16/fp16, so there is no half-precision input to save in "
            "place of its fp32 copy"
        )
    if dtype != torch.float32 or wt.dtype != torch.float32:
        return Decline(f"cast to {dtype} for a {wt.dtype} weight (the op handles an fp32 weight and cast)")
    if yt is None or yt.dtype != wt.dtype:
        return Decline(f"the linear returns {None if yt is None else yt.dtype} (autocast?), not the weight's dtype")
    if wt.dim() != 2:
        return Decline(f"weight of rank {wt.dim()}")
    if xt.device != wt.device:
        return Decline("input and weight on different devices")
    if bias is not None and tensor_meta(bias).dtype != wt.dtype:
        return Decline(f"bias of dtype {tensor_meta(bias).dtype}, not the weight's {wt.dtype}")
    return None
