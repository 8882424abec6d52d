"""What the patterns share: the engine's pattern protocol (re-exported here for their imports) and the dtypes the
fused ops compute for."""

from __future__ import annotations

import torch

from fuser.engine.protocol import (
    ArgExpr,
    CastTo,
    Decline,
    EmptyLike,
    Pattern,
    PostGradPass,
    Replacement,
    Variant,
)

# the dtypes the fused ops compute for (in fp32 internally); anything else is left to the inner compiler
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = [
    "FLOAT_DTYPES",
    "ArgExpr",
    "CastTo",
    "Decline",
    "EmptyLike",
    "Pattern",
    "PostGradPass",
    "Replacement",
    "Variant",
]
