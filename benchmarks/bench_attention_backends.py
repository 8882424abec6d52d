"""Causal attention, forward + backward, by SDPA backend at the training jobs' shapes: is another backend than the
one PyTorch picks both as close to fp32 and faster (issue 19: attention is 13.0 ms of the 122.8 ms Llama-3.2-1B
step)?

fuser's causal_attention pattern turns the model's masked call into ``F.scaled_dot_product_attention(q, k, v,
is_causal=True, enable_gqa=True)`` on the unexpanded k and v (``gqa_fold``), and PyTorch picks the backend: on the
H200, FlashAttention-2. Each row here runs one backend alone (``torch.nn.attention.sdpa_kernel``), with SDPA's GQA
(``gqa``) or on k and v expanded to every query head first (``expanded``: transformers' ``repeat_kv`` copies, whose
time is included), on q, k, v and the output's gradient in Hugging Face's layout (``[B, T, H, D]`` storage seen as
``[B, H, T, D]``, as the projections' views give them). Every implementation is first checked against fp32 math
(the output and dq, dk, dv; the max of their relative errors, ``bench_common.rel_err``), then one forward +
backward is timed (``bench_common.time_graph_and_launched``: a CUDA-graph replay's GPU time, and launched from
Python). A backend that cannot take the shape is a row with its error message.

The floor: the causal triangle's FLOPs (forward 2 matmuls, backward 5, of ``2·T²·D/2`` each per head) at the rate
in the last column.

    python benchmarks/bench_attention_backends.py [--out benchmarks/results/attention_backends_<gpu>_<date>.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from bench_common import markdown_table, rel_err, time_graph_and_launched
from bench_sliding_window import repeat_kv
from torch.nn.attention import SDPBackend, sdpa_kernel

# name: (batch, seq, heads, kv_heads, head_dim) — the train_step.py jobs' attention at 4×2048, and one long one.
SHAPES = {
    "llama32-1b": (4, 2048, 32, 8, 64),
    "llama3-8b / qwen3-8b": (4, 2048, 32, 8, 128),
    "qwen25-7b": (4, 2048, 28, 4, 128),
    "gemma3-4b (global layers)": (4, 2048, 8, 4, 256),
    "llama3-8b 1×8192": (1, 8192, 32, 8, 128),
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def implementation(backend: SDPBackend, gqa: bool):
    def run(q, k, v):
        with sdpa_kernel([backend]):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            groups = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)

    return run


def reference(q, k, v):
    """Causal attention in fp32 math (TF32 off), k and v expanded."""
    groups = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)


def inputs(batch, seq, heads, kv_heads, head_dim, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h):  # Hugging Face's layout: [B, T, H, D] storage seen as [B, H, T, D]
        x = torch.randn(batch, seq, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        return x.requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    return q, k, v, rand(heads).detach()


def error(run, q, k, v, dout, want, want_grads) -> float:
    got = run(q, k, v)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    return max(rel_err(a, b) for a, b in zip((got, *grads), (want, *want_grads), strict=True))


def shape_rows(name: str) -> list[list[str]]:
    batch, seq, heads, kv_heads, head_dim = SHAPES[name]
    q, k, v, dout = inputs(batch, seq, heads, kv_heads, head_dim)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = reference(*wide)
    want_grads = torch.autograd.grad(want, wide, dout.float())
    del wide
    flops = 7 * 2 * batch * heads * seq * seq * head_dim / 2
    rows = []
    for backend_name, backend in BACKENDS.items():
        for gqa in (True, False):
            run = implementation(backend, gqa)
            label = f"{backend_name} ({'gqa' if gqa else 'expanded'})"
            try:
                err = error(run, q, k, v, dout, want, want_grads)
                gpu, launched = time_graph_and_launched(
                    lambda run=run: torch.autograd.backward(run(q, k, v), dout), grads=(q, k, v)
                )
                cells = [f"{err:.2e}", f"{gpu:.3f}", f"{launched:.3f}", f"{flops / gpu / 1e9:.0f}"]
            except Exception as failure:  # noqa: BLE001  (one backend that cannot run is a row)
                cells = [f"error: {type(failure).__name__}: {str(failure).splitlines()[0][:90]}", "", "", ""]
            rows.append([name, f"{batch}×{seq}, {heads}/{kv_heads} heads, d {head_dim}", label, *cells])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name in args.shapes.split(","):
        rows += shape_rows(name)
        torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.UTC)
    text = (
        f"# Causal attention by SDPA backend, forward + backward (`{' '.join(sys.argv)}`, {now:%Y-%m-%d %H:%M} UTC, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()})\n\n"
        "bf16 q, k, v; error: max relative error (norm) of out, dq, dk, dv against fp32 math; TFLOP/s: the causal "
        "triangle's 7 matmuls over the graph time\n\n"
        + markdown_table(
            ["job", "shape", "backend", "error", "GPU ms (graph)", "launched ms", "TFLOP/s"], rows, label_columns=3
        )
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
