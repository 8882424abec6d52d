"""FuserConfig: every knob of the optimizer, as one frozen (hashable) dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class FuserConfig:
    """What fuser rewrites and what compiles the result.

    patterns:        names of the patterns to apply (``None``: every registered pattern).
    inner_compiler:  what compiles the rewritten graph: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"``.
    keep_logits:     for ``linear_cross_entropy`` (not yet implemented): also compute the logits the model returns.
    strict:          raise instead of falling back to the unrewritten graph when the rewrite fails (tests use it).
    """

    patterns: tuple[str, ...] | None = None
    inner_compiler: str = "inductor"
    keep_logits: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        if self.inner_compiler not in INNER_COMPILERS:
            raise ValueError(f"fuser: inner_compiler must be one of {INNER_COMPILERS}, got {self.inner_compiler!r}")
        if self.patterns is not None:
            object.__setattr__(self, "patterns", tuple(self.patterns))
            from fuser.patterns import PATTERNS

            unknown = sorted(set(self.patterns) - set(PATTERNS))
            if unknown:
                raise ValueError(f"fuser: unknown pattern(s) {unknown}; known patterns are {sorted(PATTERNS)}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> FuserConfig:
        """Map ``torch.compile(..., backend="fuser", options={...})`` onto the config's fields."""
        options = dict(options or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"fuser: unknown option(s) {unknown}; FuserConfig fields are {sorted(fields)}")
        return cls(**options)

    def enabled(self, pattern_name: str) -> bool:
        return self.patterns is None or pattern_name in self.patterns
