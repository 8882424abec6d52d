"""Tier 1: the post-grad cast passes of :mod:`fuser.inductor.op_casts` on toy post-grad graphs, traced with fake
tensors and run on real ones: the rewritten graph computes the original's values bit for bit."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
import fuser.kernels.rope  # noqa: F401  (registers torch.ops.fuser.rope and rope_backward)
from fuser.inductor.op_casts import (
    apply_output_casts,
    apply_rope_grad_upcasts,
    plan_output_casts,
    plan_rope_grad_upcasts,
)

UP = torch.ops.prims.convert_element_type.default
B, HQ, HK, T, D = 2, 4, 2, 8, 16


def inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=g).bfloat16()
    k = torch.randn(B, HK, T, D, generator=g).bfloat16()
    angles = torch.randn(1, 1, T, D, generator=g)
    return [q, k, angles.cos(), angles.sin()]


def converts(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is UP for n in gm.graph.nodes)


def forward(case: str):
    def f(q, k, cos, sin):
        q_out, k_out = torch.ops.fuser.rope(q, k, cos, sin, D, "half", torch.float32)
        if case == "fp32 reader":
            return UP(q_out, torch.bfloat16), UP(k_out, torch.bfloat16), q_out
        if case == "two dtypes":
            return UP(q_out, torch.bfloat16), UP(k_out, torch.float16)
        return UP(q_out, torch.bfloat16), UP(k_out, torch.bfloat16)

    return f


def backward(case: str):
    def f(dq, dk, cos, sin):
        dq32 = UP(dq, torch.float32)
        dk32 = dq32 if case == "one upcast twice" else UP(dk, torch.float32)
        dq_in, dk_in = torch.ops.fuser.rope_backward(dq32, dk32, cos, sin, D, "half", torch.bfloat16, torch.bfloat16)
        if case == "upcast read elsewhere":
            return dq_in, dk_in, dk32
        return dq_in, dk_in

    return f


def rewrite(f, plan, apply, seed=0) -> tuple[int, torch.fx.GraphModule, torch.fx.GraphModule]:
    """(calls rewritten, the traced graph, the rewritten one)."""
    args = inputs(seed)
    before = make_fx(f, tracing_mode="fake")(*args)
    after = make_fx(f, tracing_mode="fake")(*args)
    taken = apply(after.graph, plan(after.graph))
    after.graph.lint()
    after.recompile()
    return taken, before, after


def same(before, after, seed=1) -> None:
    args = inputs(seed)
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.stride() == ref.stride() and torch.equal(got, ref)


def test_rope_writes_its_half_precision_results_itself():
    taken, before, after = rewrite(forward("both cast"), plan_output_casts, apply_output_casts)
    assert taken == 1 and converts(before) == 2 and converts(after) == 0
    (call,) = [n for n in after.graph.nodes if n.target is torch.ops.fuser.rope.default]
    assert call.args[6] is torch.bfloat16 and all(u.meta["val"].dtype == torch.bfloat16 for u in call.users)
    same(before, after)


def test_rope_results_read_in_fp32_or_cast_to_two_dtypes_stay():
    for case in ("fp32 reader", "two dtypes"):
        taken, before, after = rewrite(forward(case), plan_output_casts, apply_output_casts)
        assert taken == 0 and converts(after) == converts(before), case


def test_rope_backward_reads_its_half_precision_gradients():
    taken, before, after = rewrite(backward("both"), plan_rope_grad_upcasts, apply_rope_grad_upcasts)
    assert taken == 1 and converts(before) == 2 and converts(after) == 0
    same(before, after)


def test_an_upcast_read_elsewhere_or_twice_stays():
    taken, before, after = rewrite(backward("upcast read elsewhere"), plan_rope_grad_upcasts, apply_rope_grad_upcasts)
    assert taken == 1 and converts(after) == 1  # dq's upcast goes, dk's stays for its other reader
    same(before, after)
    taken, _, after = rewrite(backward("one upcast twice"), plan_rope_grad_upcasts, apply_rope_grad_upcasts)
    assert taken == 0 and converts(after) == 1


def norms(case: str):
    def f(q, k, cos, sin):  # the same inputs: q's rows [.., D] normalised, k's as a residual of another shape's rows
        x = q.float().reshape(-1, D)
        w = cos.reshape(-1, D)[0] + 1.0
        y, _ = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, None, None)
        y2, _, h = torch.ops.fuser.add_rms_norm(x, sin.reshape(-1, D)[:1].expand_as(x), w, 1e-6, 0.0, None, None)
        if case == "fp32 reader":
            return UP(y, torch.bfloat16), UP(y2, torch.bfloat16), h, y2
        return UP(y, torch.bfloat16), UP(y, torch.bfloat16), UP(y2, torch.float16), h

    return f


def test_norms_write_their_half_precision_output_themselves():
    taken, before, after = rewrite(norms("cast"), plan_output_casts, apply_output_casts)
    assert taken == 2 and converts(before) == 3 and converts(after) == 0
    same(before, after)


def test_a_norm_output_read_in_fp32_stays():
    taken, before, after = rewrite(norms("fp32 reader"), plan_output_casts, apply_output_casts)
    assert taken == 1 and converts(after) == converts(before) - 1  # rms_norm's cast goes, add_rms_norm's stays
    same(before, after)
