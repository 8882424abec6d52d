"""The patterns fuser ships, registered with the engine by name (the keys of ``fuser.explain(...).counts``)."""

from __future__ import annotations

from fuser.engine.protocol import PATTERNS, register_pattern
from fuser.patterns.base import Decline, NotApplicable, Pattern, Replacement, Variant
from fuser.patterns.causal_attention import CAUSAL_ATTENTION
from fuser.patterns.gated_mlp import GATED
from fuser.patterns.layer_norm import LAYER_NORM
from fuser.patterns.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from fuser.patterns.lora_sum import LORA_SUM
from fuser.patterns.mlp_activation import MLP_ACTIVATION
from fuser.patterns.rms_norm import RMS_NORM, RMS_NORM_LINEAR
from fuser.patterns.rope import ROPE
from fuser.patterns.softmax_attention import SOFTMAX_ATTENTION
from fuser.patterns.upcast_linear import UPCAST_LINEAR

# in this order: at a node, the first pattern whose check accepts a match there takes it (a LayerNorm written by hand
# before RMSNorm, whose no-weight form its centred value would match; a norm that feeds only projections is
# rms_norm_linear's, any other rms_norm's; a gated product before an un-gated activation)
_NORMS = (LAYER_NORM, RMS_NORM_LINEAR, RMS_NORM)
_MLPS = (*GATED.values(), MLP_ACTIVATION)
_ATTENTION = (CAUSAL_ATTENTION, SOFTMAX_ATTENTION)
for _pattern in (*_NORMS, ROPE, *_MLPS, LINEAR_CROSS_ENTROPY, *_ATTENTION, UPCAST_LINEAR, LORA_SUM):
    register_pattern(_pattern)

# what ``FuserConfig(patterns=None)`` applies
DEFAULT_PATTERNS: tuple[str, ...] = tuple(name for name, p in PATTERNS.items() if p.default)

__all__ = [
    "DEFAULT_PATTERNS",
    "PATTERNS",
    "Decline",
    "NotApplicable",
    "Pattern",
    "Replacement",
    "Variant",
    "register_pattern",
]
