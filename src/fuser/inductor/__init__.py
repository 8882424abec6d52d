"""What fuser adds to Inductor, after AOT autograd: the post-grad passes the blocks declare for their fused ops
(``Pattern.post_grad``, :class:`fuser.engine.protocol.PostGradPass`: gradients written in place, a norm's backward
summing its projections' gradients, the embedding gradient in one pass, casts taken into the ops), and the runtime
that serves the compiled graphs (fused-op calls inlined as Inductor-launched kernels, direct overloads, gradients
kept out of a CUDA graph's pool). Nothing here matches a forward graph: it imports no pattern or refinement."""
