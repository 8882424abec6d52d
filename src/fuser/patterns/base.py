"""What the patterns share, re-exported here for their imports: the engine's pattern protocol and the dtypes the
fused ops compute for (:mod:`fuser._dtypes`)."""

from __future__ import annotations

from fuser._dtypes import FLOAT_DTYPES, HALF_DTYPES
from fuser.engine.protocol import (
    ArgExpr,
    CastTo,
    Decline,
    EmptyLike,
    NotApplicable,
    Pattern,
    PostGradPass,
    Refinement,
    Replacement,
    Variant,
    call_args,
)

__all__ = [
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "ArgExpr",
    "CastTo",
    "Decline",
    "EmptyLike",
    "NotApplicable",
    "Pattern",
    "PostGradPass",
    "Refinement",
    "Replacement",
    "Variant",
    "call_args",
]
