"""Rotary embedding of q and k, forward + backward, on one GPU: eager, Inductor, Liger-Kernel and fuser side by side.

Llama-3-8B attention: 32 q heads and 8 kv heads of head_dim 128, bf16, as Hugging Face calls it: q and k are
``x.view(B, T, H, D).transpose(1, 2)`` views of the projections' outputs, cos/sin are LlamaRotaryEmbedding's
``[1, T, 128]`` output for positions 0..T−1 (computed in fp32, then ``.to(x.dtype)``: bf16), and the rotation
is ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, same for k). For tokens B·T in (8192, 16384,
32768), at B = 1, 2 or 4:

- each implementation's q_out, k_out, dq and dk are first checked against an fp32-computed reference (the same
  formula and gradients on fp32 copies of the bf16 inputs; max of the four relative errors ‖a − b‖/‖b‖; the
  column says FAIL above 2e-2 and that time is left out);
- then one forward + backward of q and k together (``torch.autograd.grad`` of both outputs with respect to the
  q and k views, a fresh random dq_out/dk_out per shape) is timed twice, both with
  ``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")`` (which flushes L2 before every run):
  * GPU time: do_bench of the replay of a CUDA graph captured from that forward + backward. This is the kernel
    comparison: the host's launch cost is out of it (one graph launch), so bytes / time is meaningful;
  * launched from Python: do_bench of the plain call, as a training step issues it (host cost included).
  Warm-up (Inductor's compile, Triton's JIT) happens before either measurement and is not timed.

Liger-Kernel's ``LigerRopeFunction`` rotates q and k in place (their storage: HF's views are contiguous once
transposed back); the check gives it fresh copies, and in the timing the repeated in-place rotation is harmless.

Bytes counted for fuser's GB/s are the minimum any fused implementation must move: forward reads q and k and writes
q_out and k_out, backward reads dq_out and dk_out and writes dq and dk, i.e. 4 × B·T × (32 + 8) × 128 × 2 bytes,
plus cos and sin read once per pass (2 × 2 × T × 128 × 2 bytes). The copy ceiling is measured in the same run:
a 2 GiB device-to-device ``copy_``, bytes read + written over its median time (an H200 moves about 4.3 TB/s).

Run from the repository root, on a GPU (takes ~1–2 minutes on an H200):

    python benchmarks/bench_rope.py --out benchmarks/results/rope_<gpu>_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import shlex
import sys
from pathlib import Path

import torch
from bench_common import (
    FAIL_ABOVE,
    IMPLS,
    fmt_err,
    markdown_table,
    measure_copy_ceiling,
    rel_err,
    time_graph_and_launched,
    timing_columns,
)
from jobs import MODELS

SHAPES = ((1, 8192), (4, 2048), (2, 8192), (4, 4096), (4, 8192))  # (B, T): B·T = 8192, 8192, 16384, 16384, 32768
LLAMA3_8B = MODELS["llama3-8b"].fields
N_Q_HEADS, N_KV_HEADS, HEAD_DIM = (LLAMA3_8B[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
ROPE_THETA = LLAMA3_8B["rope_parameters"]["rope_theta"]
DTYPE = torch.bfloat16
NOMINAL_COPY_TBPS = 4.3  # H200 device-to-device copy, bytes read + written


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb (Llama, Mistral, Qwen)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def llama_cos_sin(seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaRotaryEmbedding.forward for position_ids = arange(T)[None]: [1, T, 128], fp32 math, cast to dtype."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device="cuda") / HEAD_DIM))
    freqs = torch.arange(seq_len, dtype=torch.float32, device="cuda")[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def import_fuser_rope():
    try:
        import fuser
    except ImportError:  # a checkout without `pip install -e .`
        sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]
        import fuser
    if hasattr(fuser, "rope"):
        return fuser.rope
    from fuser.kernels.rope import rope

    return rope


def import_liger():
    """LigerRopeFunction and its version, or (None, reason) when liger-kernel is not installed."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError as e:
        return None, f"not installed ({e})"
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return LigerRopeFunction, version


# ---------------------------------------------------------------------------------------------------------
# The implementations: each is forward(q, k, cos, sin) -> (q_out, k_out), with HF's 3-D cos/sin
# ---------------------------------------------------------------------------------------------------------


def make_eager():
    return apply_rotary_pos_emb


def make_inductor():
    # a fresh compile per shape: static shapes, as a training run at a fixed sequence length gets
    torch._dynamo.reset()
    return torch.compile(apply_rotary_pos_emb, dynamic=False)


def make_liger(liger_fn):
    return lambda q, k, cos, sin: liger_fn.apply(q, k, cos, sin)[:2]


def make_fuser(fuser_rope):
    return lambda q, k, cos, sin: fuser_rope(q, k, cos, sin)


# ---------------------------------------------------------------------------------------------------------
# Checking and timing
# ---------------------------------------------------------------------------------------------------------


def hf_views(q_proj: torch.Tensor, k_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as HF attention makes them: ``[B, T, H·D]`` → view ``[B, T, H, D]`` → transpose ``[B, H, T, D]``."""
    batch, seq_len, _ = q_proj.shape
    q = q_proj.view(batch, seq_len, N_Q_HEADS, HEAD_DIM).transpose(1, 2)
    k = k_proj.view(batch, seq_len, N_KV_HEADS, HEAD_DIM).transpose(1, 2)
    return q, k


def fp32_reference(q_proj, k_proj, cos, sin, dq_out, dk_out):
    """q_out, k_out, dq, dk of HF's formula computed entirely in fp32 (no bf16 rounding in between)."""
    q32 = q_proj.detach().float().requires_grad_()
    k32 = k_proj.detach().float().requires_grad_()
    q, k = hf_views(q32, k32)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out.float(), dk_out.float()))
    return q_out.detach(), k_out.detach(), dq, dk


def fwd_bwd(forward, q, k, cos, sin, dq_out, dk_out):
    """One forward + backward of q and k together: (q_out, k_out, dq, dk)."""
    q_out, k_out = forward(q, k, cos, sin)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    return q_out, k_out, dq, dk


def leaf_projections(q_proj, k_proj):
    # fresh copies (Liger rotates its inputs in place), leaves whose HF views are what the rotation sees
    return q_proj.detach().clone().requires_grad_(), k_proj.detach().clone().requires_grad_()


def check(forward, q_proj, k_proj, cos, sin, dq_out, dk_out, reference) -> float:
    """Max relative error of (q_out, k_out, dq, dk) against the fp32 reference."""
    q, k = hf_views(*leaf_projections(q_proj, k_proj))
    # copies of the incoming gradients: an implementation may rotate them in place
    results = fwd_bwd(forward, q, k, cos, sin, dq_out.clone(), dk_out.clone())
    return max(rel_err(a.detach(), b) for a, b in zip(results, reference, strict=True))


def time_fwd_bwd(forward, q_proj, k_proj, cos, sin, dq_out, dk_out) -> tuple[float, float]:
    """Median ms of one forward + backward: (GPU time, via a CUDA graph replay; launched from Python)."""
    q_leaf, k_leaf = leaf_projections(q_proj, k_proj)
    dq_out, dk_out = dq_out.clone(), dk_out.clone()

    def step():
        # the views are made inside the step: under CUDA-graph capture every autograd node of the step must run
        # on the capturing stream (views made outside, on the default stream, invalidate the capture)
        q, k = hf_views(q_leaf, k_leaf)
        fwd_bwd(forward, q, k, cos, sin, dq_out, dk_out)

    return time_graph_and_launched(step)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def bytes_moved(batch: int, seq_len: int, cos: torch.Tensor) -> int:
    """fwd: read q, k, write q_out, k_out; bwd: read dq_out, dk_out, write dq, dk; cos and sin once per pass."""
    qk = batch * seq_len * (N_Q_HEADS + N_KV_HEADS) * HEAD_DIM * DTYPE.itemsize
    return 4 * qk + 2 * 2 * cos.numel() * cos.element_size()


def bench_shape(batch: int, seq_len: int, fuser_rope, liger_fn) -> tuple[dict, dict, int]:
    """Per implementation: (GPU ms, launched ms) and the max relative error (None: not installed or failed)."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + seq_len)
    q_proj = torch.randn(batch, seq_len, N_Q_HEADS * HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    k_proj = torch.randn(batch, seq_len, N_KV_HEADS * HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    # incoming gradients in [B, H, T, D] storage, what SDPA's backward gives for contiguous q/k
    dq_out = torch.randn(batch, N_Q_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    dk_out = torch.randn(batch, N_KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    cos, sin = llama_cos_sin(seq_len, DTYPE)
    reference = fp32_reference(q_proj, k_proj, cos, sin, dq_out, dk_out)
    makers = {
        "eager": (make_eager, ()),
        "inductor": (make_inductor, ()),
        "liger": (make_liger, (liger_fn,)) if liger_fn is not None else None,
        "fuser": (make_fuser, (fuser_rope,)),
    }
    ms, err = {}, {}
    for name in IMPLS:
        if makers[name] is None:
            ms[name], err[name] = (None, None), None
            continue
        make, extra = makers[name]
        forward = make(*extra)
        try:
            err[name] = check(forward, q_proj, k_proj, cos, sin, dq_out, dk_out, reference)
        except Exception as e:  # an implementation that cannot run this case is reported, not fatal
            print(f"{name}: failed at B {batch} T {seq_len}: {type(e).__name__}: {e}", flush=True)
            ms[name], err[name] = (None, None), None
            continue
        args = (q_proj, k_proj, cos, sin, dq_out, dk_out)
        ms[name] = time_fwd_bwd(forward, *args) if err[name] <= FAIL_ABOVE else (None, None)
        del forward
        torch.cuda.empty_cache()
    return ms, err, bytes_moved(batch, seq_len, cos)


def run(args) -> str:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("bench_rope: needs a CUDA GPU (torch.cuda.is_available() is False)")
    fuser_rope = import_fuser_rope()
    liger_fn, liger_version = import_liger()

    gpu = torch.cuda.get_device_name()
    header = [
        f"# RoPE of q and k, forward + backward (bf16, {N_Q_HEADS} q / {N_KV_HEADS} kv heads × {HEAD_DIM}, "
        "Hugging Face layout)",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- GPU: {gpu}",
        f"- torch {torch.__version__}, triton {triton.__version__}, liger-kernel {liger_version}",
        "- inputs: q, k = `x.view(B, T, H, D).transpose(1, 2)` of bf16 projections; cos/sin Llama-3's [1, T, 128] "
        "(fp32 math, `.to(bf16)`); dq_out/dk_out random [B, H, T, D]",
        "- times: median ms of one forward + backward of q and k (`torch.autograd.grad` w.r.t. the q/k views), "
        '`triton.testing.do_bench(warmup=25, rep=100, return_mode="median")` (L2 flushed before each run); '
        "compiles excluded. GPU time: do_bench of a CUDA graph replay of the step; launched: of the Python call",
        "- fuser GB/s: (4 × B·T × 40 heads × 128 × 2 bytes + 2 × 2 × T × 128 × 2 bytes of cos/sin) / time "
        "(fwd reads q, k and writes q_out, k_out; bwd reads dq_out, dk_out and writes dq, dk)",
    ]
    print("\n".join(header), flush=True)
    ceiling = measure_copy_ceiling()
    ceiling_line = (
        f"- measured copy ceiling: {ceiling:.0f} GB/s (2 GiB device-to-device `copy_`, read + write; "
        f"{ceiling / (NOMINAL_COPY_TBPS * 1e3):.0%} of a nominal {NOMINAL_COPY_TBPS} TB/s)"
    )
    print(ceiling_line, flush=True)
    header.append(ceiling_line)

    gpu_rows, launched_rows, error_rows = [], [], []
    for batch, seq_len in SHAPES:
        ms, err, nbytes = bench_shape(batch, seq_len, fuser_rope, liger_fn)
        shape_cols = [str(batch), str(seq_len), str(batch * seq_len)]
        for which, table_rows in ((0, gpu_rows), (1, launched_rows)):
            times = {n: ms[n][which] for n in IMPLS}
            table_rows.append(shape_cols + timing_columns(times, err, nbytes, ceiling))
        error_rows.append(shape_cols + [fmt_err(err[n]) for n in IMPLS])
        print(
            f"B {batch} T {seq_len} | GPU:",
            " | ".join(gpu_rows[-1][3:]),
            "| launched:",
            " | ".join(launched_rows[-1][3:7]),
            "| max rel err:",
            " ".join(error_rows[-1][3:]),
            flush=True,
        )

    columns = [
        "B",
        "T",
        "tokens",
        "eager ms",
        "inductor ms",
        "liger ms",
        "fuser ms",
        "fuser GB/s",
        "% of copy ceiling",
        "fuser / best other",
    ]
    report = "\n".join(
        header
        + [
            "",
            "## GPU time (CUDA graph replay: kernels only, host launch cost excluded)",
            "",
            markdown_table(columns, gpu_rows),
            "",
            "fuser / best other: fuser's time over the fastest of eager, Inductor and Liger (below 1: fuser faster).",
            "",
            "## Launched from Python (host cost included: autograd, op dispatch, kernel launches)",
            "",
            markdown_table(columns, launched_rows),
            "",
            f"## Max relative error of (q_out, k_out, dq, dk) vs an fp32 reference (FAIL above {FAIL_ABOVE:g})",
            "",
            markdown_table(["B", "T", "tokens", "eager", "inductor", "liger", "fuser"], error_rows),
            "",
        ]
    )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    report = run(args)
    print()
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
