"""The pattern engine: canonical view, structural matcher, two-phase rewrite."""
