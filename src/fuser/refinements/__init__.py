"""Follow-on rewrites of fused ops, run on each rewritten graph once every match is applied (the ``after_apply`` of
the pattern whose ops they refine): they use what the other patterns' ops became. Each is a
:class:`fuser.engine.protocol.Refinement` that names the patterns whose refinements it runs after; the engine runs
them in an order that honours those (:func:`fuser.engine.protocol.refinement_order`). They import no pattern module:
a pattern imports its refinement, and the helpers its check shares with it come from here."""
