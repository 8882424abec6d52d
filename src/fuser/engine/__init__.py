"""The pattern engine: the pattern protocol, canonical view, structural matcher, two-phase rewrite."""
