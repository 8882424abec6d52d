"""The registry of patterns, by name (the keys of ``fuser.explain(...).counts``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fuser.engine.match import Found
from fuser.patterns.base import Decline, Pattern, Replacement, Variant
from fuser.patterns.causal_attention import CAUSAL_ATTENTION
from fuser.patterns.gated_mlp import GEGLU, SWIGLU
from fuser.patterns.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from fuser.patterns.lora_sum import LORA_SUM
from fuser.patterns.rms_norm import RMS_NORM
from fuser.patterns.rope import ROPE
from fuser.patterns.upcast_linear import UPCAST_LINEAR

if TYPE_CHECKING:
    from fuser.config import FuserConfig


def _with_upcast_linear_triton(pattern: Pattern) -> Pattern:
    """``pattern`` (one without options of its own) whose op also receives
    ``allow_triton=config.upcast_linear.triton``: lora_sum's op runs upcast_linear's Triton kernels, so one switch
    covers both (``fuser.kernels.lora_sum``); its refinements carry the argument over to the ops they make."""
    check, after_apply = pattern.check, pattern.after_apply

    def check_with_triton(found: Found, variant: Variant, config: FuserConfig) -> Replacement:
        replacement = check(found, variant)
        kwargs = {**replacement.kwargs, "allow_triton": config.upcast_linear.triton}
        return dataclasses.replace(replacement, kwargs=kwargs)

    def after_apply_ignoring_config(graph: Any, config: FuserConfig) -> int:
        return after_apply(graph)

    return dataclasses.replace(
        pattern,
        check=check_with_triton,
        after_apply=None if after_apply is None else after_apply_ignoring_config,
        takes_config=True,
    )


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in (
        RMS_NORM,
        ROPE,
        SWIGLU,
        GEGLU,
        LINEAR_CROSS_ENTROPY,
        CAUSAL_ATTENTION,
        UPCAST_LINEAR,
        _with_upcast_linear_triton(LORA_SUM),
    )
}
# what ``FuserConfig(patterns=None)`` applies
DEFAULT_PATTERNS: tuple[str, ...] = tuple(name for name, p in PATTERNS.items() if p.default)

__all__ = ["DEFAULT_PATTERNS", "PATTERNS", "Decline", "Pattern", "Replacement", "Variant"]
