"""The registry of patterns, by name (the keys of ``fuser.explain(...).counts``)."""

from __future__ import annotations

from fuser.patterns.base import Decline, Pattern, Replacement, Variant
from fuser.patterns.causal_attention import CAUSAL_ATTENTION
from fuser.patterns.gated_mlp import GEGLU, SWIGLU
from fuser.patterns.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from fuser.patterns.lora_sum import LORA_SUM
from fuser.patterns.rms_norm import RMS_NORM
from fuser.patterns.rope import ROPE
from fuser.patterns.upcast_linear import UPCAST_LINEAR

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
        LORA_SUM,
    )
}
# what ``FuserConfig(patterns=None)`` applies
DEFAULT_PATTERNS: tuple[str, ...] = tuple(name for name, p in PATTERNS.items() if p.default)

__all__ = ["DEFAULT_PATTERNS", "PATTERNS", "Decline", "Pattern", "Replacement", "Variant"]
