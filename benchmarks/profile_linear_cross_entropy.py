"""Where fuser's linear_cross_entropy spends its time: each step of one chunk timed alone, variants beside it,
and a torch.profiler kernel table of the whole op. A tool for choosing the implementation, not a test.

Per shape (bf16, rows per chunk as ``chunk_rows`` gives): the logits matmul, the Triton loss+gradient kernel
(launch configurations swept, ``CE_CONFIGS``), the dhidden matmul (plain, and split over the
vocabulary into S batched matmuls with fp32 outputs summed after), the dweight matmul accumulating into bf16 / fp32
and into a fresh buffer, and fuser's Triton dweight kernel (``dw_kernel="triton"``) at the tile configurations of
``DW_CONFIGS``.

    python benchmarks/profile_linear_cross_entropy.py [--out FILE] [--only-dweight]
    python benchmarks/profile_linear_cross_entropy.py --budgets 250,500,1000   # the whole forward per chunk budget
    python benchmarks/profile_linear_cross_entropy.py --budgets 0 --kernels "BLOCK_V=8192,num_warps=16"
        # the whole forward at one budget: the defaults, then each listed change to the tuning entries
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench

from fuser.kernels import linear_cross_entropy as K

SHAPES = ((8192, 2304, 256000), (8192, 4096, 128256), (16384, 4096, 151936))
DW_CONFIGS = [
    {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_V": 128, "BLOCK_H": 256, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_V": 256, "BLOCK_H": 128, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 4, "num_stages": 4},
    {"BLOCK_V": 128, "BLOCK_H": 256, "BLOCK_R": 32, "GROUP_V": 8, "num_warps": 8, "num_stages": 4},
    {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_R": 64, "GROUP_V": 16, "num_warps": 8, "num_stages": 4},
    {"BLOCK_V": 256, "BLOCK_H": 128, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 8, "num_stages": 4},
    {"BLOCK_V": 256, "BLOCK_H": 128, "BLOCK_R": 32, "GROUP_V": 8, "num_warps": 8, "num_stages": 5},
    {"BLOCK_V": 128, "BLOCK_H": 128, "BLOCK_R": 128, "GROUP_V": 8, "num_warps": 8, "num_stages": 3},
    {"BLOCK_V": 256, "BLOCK_H": 64, "BLOCK_R": 64, "GROUP_V": 8, "num_warps": 4, "num_stages": 4},
]


# the loss kernel's launch configurations (``K.CHUNK_KERNEL_CONFIG``'s keys), the default first
_DEFAULT_CE = (K.CHUNK_KERNEL_CONFIG["BLOCK_V"], K.CHUNK_KERNEL_CONFIG["num_warps"])
CE_CONFIGS = [dict(K.CHUNK_KERNEL_CONFIG)] + [
    {"BLOCK_V": block_v, "num_warps": warps}
    for block_v, warps in ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
    if (block_v, warps) != _DEFAULT_CE
]


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def dweight_kernel(acc16, logits, h, cfg) -> float:
    """ms of one chunk's share added by fuser's Triton dweight kernel at launch configuration ``cfg``."""
    saved = dict(K.DWEIGHT_CONFIG)
    K.DWEIGHT_CONFIG.clear()
    K.DWEIGHT_CONFIG.update(cfg)
    try:
        return ms(lambda: K._launch_dweight(acc16, logits.t(), h, False))
    finally:
        K.DWEIGHT_CONFIG.clear()
        K.DWEIGHT_CONFIG.update(saved)


def chunk_parts(tokens, hidden, vocab, out, only_dweight=False):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = K.chunk_rows(tokens, vocab, 2)
    h = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    logits = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
    loss = torch.empty(rows, device="cuda", dtype=torch.float32)
    scale = torch.ones((), device="cuda")
    dh = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
    acc16 = torch.zeros(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    acc32 = torch.zeros(vocab, hidden, device="cuda", dtype=torch.float32)
    flop = 2 * rows * hidden * vocab
    n_chunks = triton.cdiv(tokens, rows)
    res = []

    def add(name, t, flops=None):
        rate = "" if flops is None else f"{flops / t / 1e9:.0f} TFLOP/s"
        res.append(f"| {tokens}×{hidden}×{vocab} | {rows} | {name} | {t:.3f} | {t * n_chunks:.1f} | {rate} |")
        print(res[-1], flush=True)

    torch.mm(h, w.t(), out=logits)
    if only_dweight:
        dweight_rows(add, acc16, logits, h, flop)
        out += res
        return
    add("logits mm", ms(lambda: torch.mm(h, w.t(), out=logits)), flop)
    base = logits.clone()
    for cfg in CE_CONFIGS:

        def ce(cfg=cfg):
            K.lce_chunk_kernel[(rows,)](
                logits, labels, loss, scale, logits.stride(0), vocab, -100, 1.0, 1.0,
                HAS_SOFTCAP=False, WRITE_GRAD=True, **cfg,
            )  # fmt: skip

        logits.copy_(base)
        add("CE kernel " + " ".join(f"{k}={v}" for k, v in cfg.items()), ms(ce))
    logits.copy_(base)
    add("dh mm (G @ W)", ms(lambda: torch.mm(logits, w, out=dh)), flop)
    for splits in (2, 4, 8):
        seg = vocab // splits
        if seg * splits != vocab:
            continue
        g3 = logits.view(rows, splits, seg).transpose(0, 1)  # [S, rows, seg], row stride vocab
        w3 = w.view(splits, seg, hidden)

        def split_k(g3=g3, w3=w3):
            return torch.bmm(g3, w3, out_dtype=torch.float32).sum(0).to(torch.bfloat16)

        try:
            add(f"dh split-K {splits} (bmm fp32 + sum)", ms(split_k), flop)
        except Exception as e:
            res.append(f"| split-K {splits} failed: {type(e).__name__}: {str(e)[:120]} |")
    add("dW addmm_ into bf16 acc", ms(lambda: acc16.addmm_(logits.t(), h)), flop)
    add("dW mm into fresh bf16", ms(lambda: torch.mm(logits.t(), h)), flop)
    try:
        add("dW addmm into fp32 acc (out_dtype)",
            ms(lambda: torch.addmm(acc32, logits.t(), h, out_dtype=torch.float32, out=acc32)), flop)  # fmt: skip
    except Exception as e:
        res.append(f"| fp32 addmm failed: {type(e).__name__}: {str(e)[:120]} |")
    add("dW^T addmm_ (h^T @ G into [H, V] bf16)",
        ms(lambda: acc16.view(hidden, vocab).addmm_(h.t(), logits)), flop)  # fmt: skip
    dweight_rows(add, acc16, logits, h, flop)
    out += res


def dweight_rows(add, acc16, logits, h, flop):
    add("dW addmm_ into bf16 acc (cuBLAS, the default)", ms(lambda: acc16.addmm_(logits.t(), h)), flop)
    add("dW mm into fresh bf16 (no read of the sum)", ms(lambda: torch.mm(logits.t(), h)), flop)
    for cfg in DW_CONFIGS:
        name = "dW Triton kernel " + " ".join(f"{k}={v}" for k, v in cfg.items())
        try:
            add(name, dweight_kernel(acc16, logits, h, cfg), flop)
        except Exception as e:  # a configuration that does not fit is reported, not fatal
            add(f"{name}: {type(e).__name__}", float("nan"))


def whole_op_profile(tokens, hidden, vocab, out):
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)

    def step():
        h.grad = w.grad = None
        K.linear_cross_entropy(h, w, labels).backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    total = ms(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out.append(f"\n### whole op {tokens}×{hidden}×{vocab}: {total:.1f} ms (do_bench median)\n")
    out.append("```")
    out.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    out.append("```")
    print("\n".join(out[-4:]), flush=True)


def chunked_variants(tokens, hidden, vocab, budgets, out, kernel_cfgs=((),)):
    """The chunked forward (all of the op's work: the backward only scales) at each logits budget, and with each of
    ``kernel_cfgs`` (changes to ``K.CHUNK_KERNEL_CONFIG``; none: the defaults): rows per
    chunk, median ms, extra memory, and the profiler's device time per aten op / kernel."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    ce = K.CrossEntropy(-100, "mean", 1.0, 0.0)
    wanted = K.GradsWanted(True, True, False)
    for budget, changes in [(b, dict(c)) for b in budgets for c in kernel_cfgs]:
        rows = K.chunk_rows(tokens, vocab, 2, (budget << 20) if budget else None)  # 0: the op's own budget
        saved = dict(K.CHUNK_KERNEL_CONFIG)
        K.CHUNK_KERNEL_CONFIG.update(changes)

        def run(rows=rows):
            real = K.chunk_rows
            K.chunk_rows = lambda *a: rows
            try:
                return K._forward_chunked(h, w, None, labels, ce, wanted, K.DweightOptions(), True)
            finally:
                K.chunk_rows = real

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        res = run()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - before - res[1].nbytes - res[2].nbytes) / 2**20
        del res
        t = ms(run)
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            run()
            torch.cuda.synchronize()
        parts = []
        for e in prof.key_averages():
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if e.key in ("aten::mm", "aten::bmm", "aten::addmm_", "lce_chunk_kernel") and dev > 0:
                parts.append(f"{e.key}: {dev / 1e3:.1f}")
        K.CHUNK_KERNEL_CONFIG.clear()
        K.CHUNK_KERNEL_CONFIG.update(saved)
        kernel = " ".join(f"{k}={v}" for k, v in changes.items()) or "default"
        line = (
            f"| {tokens}×{hidden}×{vocab} | {budget} | {kernel} | {rows} | {-(-tokens // rows)} | {t:.2f} | "
            f"{extra:.0f} | {'; '.join(parts)} |"
        )
        out.append(line)
        print(line, flush=True)
        torch.cuda.empty_cache()


def parse_kernel(text: str) -> tuple[tuple[str, int], ...]:
    """'BLOCK_V=8192,num_warps=16' → (("BLOCK_V", 8192), ("num_warps", 16)); keys of ``K.CHUNK_KERNEL_CONFIG``."""
    pairs = []
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in K.CHUNK_KERNEL_CONFIG or not value.isdigit():
            raise SystemExit(f"--kernels: {item!r} is not KEY=INTEGER with KEY one of {sorted(K.CHUNK_KERNEL_CONFIG)}")
        pairs.append((key, int(value)))
    return tuple(pairs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-dweight", action="store_true", help="only the weight-gradient rows, no profile")
    parser.add_argument(
        "--budgets",
        default="",
        help="MiB, comma-separated (0: the op's default): only the chunked forward at each budget",
    )
    parser.add_argument(
        "--kernels",
        default="",
        help="with --budgets: ';'-separated loss-kernel configurations beside the default, each "
        "'KEY=VALUE,...' of CHUNK_KERNEL_CONFIG (e.g. 'BLOCK_V=8192,num_warps=16;BLOCK_V=2048,num_warps=4')",
    )
    args = parser.parse_args()
    if args.budgets:
        out = [
            "| T×H×V | budget MiB | loss kernel | rows/chunk | chunks | ms | extra MiB | device ms per aten op |",
            "|---|---:|---|---:|---:|---:|---:|---|",
        ]
        kernel_cfgs = [()] + [parse_kernel(k) for k in args.kernels.split(";") if k]
        for shape in SHAPES:
            chunked_variants(*shape, [int(b) for b in args.budgets.split(",")], out, kernel_cfgs)
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(out) + "\n")
        return
    out = [
        "| T×H×V | rows/chunk | step | ms per chunk | ms × chunks | rate |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for shape in SHAPES:
        chunk_parts(*shape, out, only_dweight=args.only_dweight)
        torch.cuda.empty_cache()
    for shape in [] if args.only_dweight else SHAPES:
        whole_op_profile(*shape, out)
        torch.cuda.empty_cache()
    text = "\n".join(out) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
