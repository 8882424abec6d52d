"""Sliding-window attention, forward + backward, at Gemma-3-4B's shapes: is a windowed kernel exact and faster than
the masked SDPA that Hugging Face's sdpa path runs (issue 19, item 3)?

Gemma-3's sliding layers (5 of every 6) attend to the last ``window`` tokens, themselves included: key j is seen by
query i when ``i - window < j <= i`` (transformers' ``sliding_window_causal`` mask). With ``attn_implementation=
"sdpa"`` the model builds that mask as a boolean ``[B, 1, T, T]`` tensor and calls ``scaled_dot_product_attention``
on k and v expanded to every query head (``repeat_kv``: a mask rules out SDPA's own GQA path). fuser keeps that call
as it is (its causal_attention pattern takes only the plain causal mask). Implementations, each on the same bf16 q,
k, v (``[B, H, T, D]``, k and v with the kv heads):

- ``masked sdpa``: what the model runs (repeat_kv copies, boolean mask, the backend SDPA picks);
- ``fuser window_sdpa``: what fuser's causal_attention pattern calls instead (FlashAttention-2's window kernels);
- ``flex (window)``: ``flex_attention`` compiled, with a block mask of the window (blocks outside it are skipped),
  ``enable_gqa=True`` (no copies);
- ``causal sdpa (not the window)``: ``is_causal=True`` with SDPA's GQA: the global layers' call, the work of a plain
  causal mask; not the sliding layers' values (its error is reported, its time is the reference for the causal
  kernel's speed).

Each is checked first against fp32 math with the same mask (the output and dq, dk, dv; max relative error; FAIL
above ``FAIL_ABOVE`` and its time left out), then one forward + backward is timed (``bench_common.
time_graph_and_launched``: the GPU time of a CUDA-graph replay, and launched from Python). The last columns count the
score blocks each mask needs: the window's share of the causal triangle bounds what skipping blocks can save.

    python benchmarks/bench_sliding_window.py [--out benchmarks/results/sliding_window_<gpu>_<date>.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from bench_common import FAIL_ABOVE, markdown_table, rel_err, time_graph_and_launched

from fuser.kernels.window_attention import window_mask, window_sdpa  # window_mask: i - window < j <= i

GEMMA3_4B = dict(heads=8, kv_heads=4, head_dim=256, window=1024, scale=256**-0.5)
SHAPES = ((4, 2048), (2, 4096), (1, 8192))  # (B, T): B·T = 8192 tokens


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' repeat_kv: ``[B, KV, T, D]`` → ``[B, KV·groups, T, D]`` (a copy)."""
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)


def reference(q, k, v, window: int, scale: float) -> torch.Tensor:
    """The windowed attention in fp32 math (the oracle)."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k.float(), groups), repeat_kv(v.float(), groups)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~window_mask(q.shape[2], window, q.device), float("-inf"))
    return scores.softmax(-1) @ v


def masked_sdpa(window: int, scale: float):
    def run(q, k, v):
        groups = q.shape[1] // k.shape[1]
        mask = window_mask(q.shape[2], window, q.device)[None, None]
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=scale
        )

    return run


def causal_sdpa(window: int, scale: float):
    def run(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    return run


def flex_window(window: int, scale: float, compiled: bool = True):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention) if compiled else flex_attention
    masks: dict = {}

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    def run(q, k, v):
        key = (q.shape[2], q.device)
        if key not in masks:
            masks[key] = create_block_mask(sliding, None, None, q.shape[2], q.shape[2], device=q.device)
        return attend(q, k, v, block_mask=masks[key], scale=scale, enable_gqa=True)

    return run


def fuser_window(window: int, scale: float):
    """fuser's ``window_sdpa``, what the causal_attention pattern puts in place of the masked call (FlashAttention's
    window kernels on a GPU; the masked SDPA elsewhere)."""

    def run(q, k, v):
        return window_sdpa(q, k, v, window, scale=scale, enable_gqa=True)

    return run


def implementations(window: int, scale: float, compiled: bool = True) -> dict:
    return {
        "masked sdpa": masked_sdpa(window, scale),
        "fuser window_sdpa": fuser_window(window, scale),
        "flex (window)": flex_window(window, scale, compiled),
        "causal sdpa (not the window)": causal_sdpa(window, scale),
    }


def inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, device=device, dtype=dtype, generator=g).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    dout = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, generator=g)
    return q, k, v, dout


def error(run, q, k, v, dout, window: int, scale: float) -> float:
    """Max relative error of the output and dq, dk, dv against :func:`reference` on fp32 copies (the output alone
    where q, k, v do not require grad: FlexAttention has no backward on CPU)."""
    backward = q.requires_grad
    wide = [t.detach().float().requires_grad_(backward) for t in (q, k, v)]
    want = reference(*wide, window, scale)
    got = run(q, k, v)
    pairs = [(got, want)]
    if backward:
        want_grads = torch.autograd.grad(want, wide, dout.float())
        pairs += zip(torch.autograd.grad(got, (q, k, v), dout), want_grads, strict=True)
    return max(rel_err(a, b) for a, b in pairs)


def blocks(seq: int, window: int, block: int = 128) -> tuple[int, int]:
    """(score blocks of ``block``×``block`` the window touches, blocks the causal triangle touches)."""
    n = -(-seq // block)
    causal = n * (n + 1) // 2
    windowed = sum(1 for i in range(n) for j in range(i + 1) if (j + 1) * block - 1 > i * block - window)
    return windowed, causal


def measure(name: str, run, q, k, v, dout, window: int, scale: float) -> list[str]:
    """(error, GPU ms, launched ms) of one implementation: timed when exact, or when it is the causal reference."""
    err = error(run, q, k, v, dout, window, scale)
    if err > FAIL_ABOVE and "not the window" not in name:
        return [f"{err:.1e}", "FAIL", "FAIL"]
    gpu, launched = time_graph_and_launched(lambda: torch.autograd.backward(run(q, k, v), dout), grads=(q, k, v))
    return [f"{err:.1e}", f"{gpu:.3f}", f"{launched:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = GEMMA3_4B
    window, scale = shape["window"], shape["scale"]
    rows = []
    for batch, seq in SHAPES:
        q, k, v, dout = inputs(batch, seq, shape["heads"], shape["kv_heads"], shape["head_dim"], "cuda", torch.bfloat16)
        windowed, causal = blocks(seq, window)
        for name, run in implementations(window, scale).items():
            try:
                cells = measure(name, run, q, k, v, dout, window, scale)
            except Exception as failure:  # noqa: BLE001  (one failing implementation is a row)
                cells = [f"error: {type(failure).__name__}: {str(failure)[:80]}", "", ""]
            rows.append([f"{batch}×{seq}", name, *cells, f"{windowed} / {causal}"])
    now = datetime.datetime.now(datetime.UTC)
    text = (
        f"# Sliding-window attention, forward + backward (`{' '.join(sys.argv)}`, {now:%Y-%m-%d %H:%M} UTC, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__})\n\n"
        f"Gemma-3-4B: {shape['heads']} q heads, {shape['kv_heads']} kv heads, head_dim {shape['head_dim']}, "
        f"window {window}, bf16; error: max relative error of out, dq, dk, dv against fp32 math with the window "
        "mask\n\n"
        + markdown_table(
            ["B×T", "implementation", "error", "GPU ms (graph)", "launched ms", "128² blocks: window / causal"],
            rows,
            label_columns=2,
        )
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
