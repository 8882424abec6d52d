"""lm_head + cross-entropy, forward + backward, on one GPU: eager, Inductor, Liger-Kernel, Cut Cross-Entropy and
fuser side by side (time, extra memory, gradient error), then a tiny-model training step's peak memory.

For each (tokens, hidden, vocab) of the issue (bf16 hidden states h ~ N(0, 1) and lm_head weight W ~ N(0, 0.02²),
labels uniform with 5% set to -100):

- reference: fp32 (TF32 off) ``F.cross_entropy(F.linear(h, W).float(), labels)`` and its dh, dW, on fp32 copies
  of the bf16 inputs; each implementation's error is ‖a − b‖/‖b‖ of loss, dh and dW against it;
- time: median of 10 timed forward + backward calls (``torch.cuda.Event``s around each, after 2 warm-up calls
  that include compiles), gradients reset to None before each call; ``--rounds`` times (default 3), the
  implementations alternated, and the best round's median counts (each round's is in the note column);
- extra memory: ``max_memory_allocated`` during one call minus the allocation before it (inputs present,
  gradients None), minus the returned gradients dh and dW in bf16: what the implementation needs beyond its
  inputs and outputs. fuser's fp32 weight-gradient accumulator (V·H·4 bytes, alive during the forward) is
  shown on its own row: ``fuser`` (the default) accumulates dW in the weight's dtype, ``fuser (fp32 dW acc)`` in
  fp32; ``fuser (Triton dW)`` accumulates it with ``dw_kernel="triton"`` (the running sum's tile read
  before the matmul, not after) instead of cuBLAS's ``addmm_``;
- floor: 6·T·H·V FLOPs at the bf16 matmul rate measured in the same run (a 8192³ ``torch.mm``).

Second section: one training step (forward + backward) of a tiny Llama with a real vocabulary (128256, hidden
512, 2 layers, batch 4×2048, bf16) under ``torch.compile`` and under ``fuser.optimize``: peak memory, and the
bytes of the logits (bf16 and their fp32 upcast) that fuser no longer keeps.

    python benchmarks/bench_linear_cross_entropy.py --out benchmarks/results/linear_cross_entropy_<gpu>_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F
from bench_common import rel_err

SHAPES = ((8192, 2304, 256000), (8192, 4096, 128256), (16384, 4096, 151936))
IGNORED_FRACTION = 0.05
MIB = 1 << 20


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def eager_loss(h, w, labels):
    return F.cross_entropy(F.linear(h, w).float(), labels)


def make_impls(only: list[str] | None = None) -> dict:
    import fuser

    impls = {"eager": eager_loss, "inductor": None}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        impls["liger"] = lambda h, w, labels: liger(w, h, labels)
    except ImportError as e:
        print(f"liger-kernel not available: {e}", flush=True)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cce"] = lambda h, w, labels: cce(h, w, labels)
    except ImportError as e:
        print(f"cut-cross-entropy not available: {e}", flush=True)

    def fuser_with(**options):  # FuserConfig.experimental.linear_cross_entropy's fields, as the op's arguments
        return lambda h, w, labels: fuser.linear_cross_entropy(h, w, labels, **options)

    impls["fuser"] = fuser_with()
    impls["fuser (Triton dW)"] = fuser_with(dw_kernel="triton")
    impls["fuser (one stream)"] = fuser_with(streams=False)
    impls["fuser (fp32 dW acc)"] = fuser_with(dw_accumulator="fp32")
    if only:
        impls = {name: fn for name, fn in impls.items() if name in only}
    return impls


def reference(h, w, labels):
    torch.backends.cuda.matmul.allow_tf32 = False
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    loss = eager_loss(h32, w32, labels)
    loss.backward()
    return loss.detach(), h32.grad, w32.grad


def one_call(fn, h, w, labels):
    h.grad = w.grad = None
    loss = fn(h, w, labels)
    loss.backward()
    return loss


def bench_impl(name, fn, h0, w0, labels, ref, frozen_weight=False):
    h = h0.detach().clone().requires_grad_()
    w = w0.detach().clone().requires_grad_(not frozen_weight)
    try:
        for _ in range(2):  # warm-up: compiles, autotuning
            loss = one_call(fn, h, w, labels)
        torch.cuda.synchronize()
        errors = (
            rel_err(loss.detach(), ref[0]),
            rel_err(h.grad, ref[1]),
            rel_err(w.grad, ref[2]) if not frozen_weight else None,
        )
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        one_call(fn, h, w, labels)
        torch.cuda.synchronize()
        grads = h.grad.numel() * h.grad.element_size() + (
            0 if frozen_weight else w.grad.numel() * w.grad.element_size()
        )
        extra = torch.cuda.max_memory_allocated() - base - grads
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h.grad = w.grad = None
            start.record()
            loss = fn(h, w, labels)
            loss.backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return {"ms": statistics.median(times), "extra": extra, "errors": errors}
    except torch.OutOfMemoryError:
        return {"ms": None, "extra": None, "errors": None, "note": "OOM"}
    except Exception as e:  # an implementation that cannot run a case is reported, not fatal
        print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
        return {"ms": None, "extra": None, "errors": None, "note": f"failed: {type(e).__name__}"}
    finally:
        h.grad = w.grad = None
        torch.cuda.empty_cache()


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def rounds_words(rounds: int) -> str:
    return "" if rounds == 1 else f", the best of {rounds} rounds with the implementations alternated"


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def bench_rounds(impls, h, w, labels, ref, frozen, rounds) -> dict[str, dict]:
    """Each implementation ``rounds`` times, the implementations alternated round by round (fresh input copies
    each time): ``ms`` is the best round's median, ``rounds_ms`` every round's, errors and memory from the first.

    One timing per implementation in a fixed order is not enough on the H100s we are lent: there the same code's
    median moved by 10% from one timing to the next, for Inductor as for fuser
    (``benchmarks/results/lce_side_stream_h100_2026-12-06.md``)."""
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for name, fn in impls.items():
            r = bench_impl(name, fn, h, w, labels, ref, frozen_weight=frozen)
            kept = results.setdefault(name, {**r, "rounds_ms": []})
            kept["rounds_ms"].append(r["ms"])
    for r in results.values():
        times = [ms for ms in r["rounds_ms"] if ms is not None]
        r["ms"] = min(times) if times else None
    return results


def bench_shapes(impls, tflops, lines, frozen=False, budgets=(), rounds=1):
    for shape in SHAPES[1:2] if frozen else SHAPES:  # frozen: the Llama-3-8B LoRA shape only (compiles are slow)
        tokens, hidden, vocab = shape
        gen = torch.Generator(device="cuda").manual_seed(tokens + hidden + vocab)
        h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
        w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).bfloat16()
        labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
        labels[torch.rand(tokens, device="cuda", generator=gen) < IGNORED_FRACTION] = -100
        ref = reference(h, w, labels)
        torch.cuda.empty_cache()
        floor = (4 if frozen else 6) * tokens * hidden * vocab / (tflops * 1e12) * 1e3
        chosen = {}
        for name, fn in impls.items():
            if frozen and name not in ("eager", "inductor", "liger", "fuser", "fuser (one stream)"):
                continue
            if name == "inductor":
                torch._dynamo.reset()
                fn = torch.compile(eager_loss, dynamic=False)
            chosen[name] = fn
        results = bench_rounds(chosen, h, w, labels, ref, frozen, rounds)
        inductor_ms = results.get("inductor", {}).get("ms")
        for name, r in results.items():
            e = r["errors"] or (None, None, None)
            ratio = None if r["ms"] is None or inductor_ms is None else r["ms"] / inductor_ms
            note = r.get("note", "")
            if rounds > 1:
                each = "rounds " + " / ".join(fmt(ms, ".1f") for ms in r["rounds_ms"])
                note = f"{note}; {each}" if note else each
            lines.append(
                f"| {tokens}×{hidden}×{vocab} | {name} | {fmt(r['ms'], '.1f')} | {fmt(floor, '.1f')} | "
                f"{fmt(None if r['extra'] is None else r['extra'] / MIB, '.0f')} | {fmt(e[0], '.1e')} | "
                f"{fmt(e[1], '.1e')} | {fmt(e[2], '.1e')} | {fmt(ratio, '.2f')} | {note} |"
            )
            print(lines[-1], flush=True)
        for budget_mib in () if frozen or "fuser" not in impls else budgets:
            lines.append(with_budget(budget_mib, impls["fuser"], h, w, labels, ref, floor, inductor_ms))
            print(lines[-1], flush=True)
        if not frozen and "fuser (fp32 dW acc)" in impls:
            lines.append(
                f"| {tokens}×{hidden}×{vocab} | (fp32 dW accumulator of 'fuser (fp32 dW acc)', in its extra above) | "
                f"| | {vocab * hidden * 4 / MIB:.0f} | | | | | |"
            )
        del h, w, labels, ref
        torch.cuda.empty_cache()


def with_budget(budget_mib, fn, h, w, labels, ref, floor, inductor_ms) -> str:
    """One table row: fuser with its chunk budget (``LOGITS_BUDGET_BYTES``) set to ``budget_mib``."""
    from fuser.kernels import linear_cross_entropy as K

    default = K.LOGITS_BUDGET_BYTES
    K.LOGITS_BUDGET_BYTES = budget_mib * MIB
    try:
        tokens, vocab = h.shape[0], w.shape[0]
        rows = K.chunk_rows(tokens, vocab, h.element_size())
        r = bench_impl("fuser", fn, h, w, labels, ref)
    finally:
        K.LOGITS_BUDGET_BYTES = default
    e = r["errors"] or (None, None, None)
    ratio = None if r["ms"] is None or inductor_ms is None else r["ms"] / inductor_ms
    return (
        f"| {tokens}×{h.shape[1]}×{vocab} | fuser (budget {budget_mib} MiB: {-(-tokens // rows)} chunks of {rows}) | "
        f"{fmt(r['ms'], '.1f')} | {fmt(floor, '.1f')} | {fmt(None if r['extra'] is None else r['extra'] / MIB, '.0f')} "
        f"| {fmt(e[0], '.1e')} | {fmt(e[1], '.1e')} | {fmt(e[2], '.1e')} | {fmt(ratio, '.2f')} | {r.get('note', '')} |"
    )


def sweep_budget(impls, lines):
    from fuser.kernels import linear_cross_entropy as K

    tokens, hidden, vocab = SHAPES[0]
    gen = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    ref = reference(h, w, labels)
    default = K.LOGITS_BUDGET_BYTES
    try:
        for budget_mib in (128, 224, 512):
            K.LOGITS_BUDGET_BYTES = budget_mib * MIB
            rows = K.chunk_rows(tokens, vocab, 2)
            for name in [n for n in ("fuser", "fuser (fp32 dW acc)") if n in impls]:
                r = bench_impl(name, impls[name], h, w, labels, ref)
                e = r["errors"] or (None, None, None)
                extra = None if r["extra"] is None else r["extra"] / MIB
                acc = "bf16" if name == "fuser" else "fp32"
                lines.append(
                    f"| {tokens}×{hidden}×{vocab} | {budget_mib} | {rows} | {acc} | {fmt(r['ms'], '.1f')} | "
                    f"{fmt(extra, '.0f')} | {fmt(e[1], '.1e')} | {fmt(e[2], '.1e')} |"
                )
                print(lines[-1], flush=True)
    finally:
        K.LOGITS_BUDGET_BYTES = default


def tiny_model_step(lines):
    import transformers

    import fuser

    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    batch, seq = 4, 2048
    # fuser's defaults (FuserConfig().experimental.linear_cross_entropy): the weight's dtype accumulates dW
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    logits_bytes = batch * seq * cfg.vocab_size * (2 + 4)
    results = {}
    for mode in ("compile", "fuser"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
        compiled = torch.compile(model) if mode == "compile" else fuser.optimize(model)
        for _ in range(2):
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
            del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = compiled(input_ids=ids, labels=ids)
        loss = out.loss.item()
        logits_shape = None if out.logits is None else tuple(out.logits.shape)
        out.loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        counts = dict(fuser.backend().counts) if mode == "fuser" else {}
        results[mode] = peak
        lines.append(f"| {mode} | {peak / MIB:.0f} | {loss:.4f} | {logits_shape} | {counts} |")
        print(lines[-1], flush=True)
        del model, compiled, out
        torch.cuda.empty_cache()
    saved = results["compile"] - results["fuser"]
    lines.append("")
    lines.append(
        f"Peak saved by fuser: {saved / MIB:.0f} MiB; the logits it no longer keeps: {logits_bytes / MIB:.0f} MiB "
        f"(bf16 [{batch}·{seq}, {cfg.vocab_size}] and its fp32 upcast) → "
        f"{'meets' if saved >= logits_bytes else 'MISSES'} 'below by at least the logits'."
    )


def run(args) -> str:
    props = torch.cuda.get_device_properties(0)
    tflops = matmul_tflops()
    lines = [
        "# lm_head + cross-entropy, forward + backward (bf16)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {props.name}; measured bf16 matmul rate {tflops:.0f} TFLOP/s (8192³ torch.mm)",
        f"- torch {torch.__version__}, triton {version('triton')}, transformers {version('transformers')}, "
        f"liger-kernel {version('liger-kernel')}, cut-cross-entropy {version('cut-cross-entropy')}",
        f"- ms: median of 10 fwd+bwd calls (CUDA events){rounds_words(args.rounds)}; extra MiB: peak above the"
        " inputs, minus dh and dW (bf16);"
        " errors: ‖a − b‖/‖b‖ vs fp32 (TF32 off); floor: 6·T·H·V FLOPs at the measured matmul rate;"
        " / Inductor: ms over Inductor's ms in this run (the issue measured 48.0 / 41.8 / 98.6 ms)",
        "",
        "| T×H×V | impl | ms | floor ms | extra MiB | loss err | dh err | dW err | / Inductor | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    impls = make_impls(args.impls.split(",") if args.impls else None)

    def save():  # after every section, so a run cut short still leaves its tables
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    if not args.skip_shapes:
        bench_shapes(impls, tflops, lines, budgets=args.budgets, rounds=args.rounds)
        save()
    if args.only_shapes:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## Training step of a tiny Llama (vocab 128256, hidden 512, 2 layers, batch 4×2048, bf16)",
        "",
        "| mode | peak MiB above the model | loss | outputs.logits | fused |",
        "|---|---:|---:|---|---|",
    ]
    try:
        tiny_model_step(lines)
    except Exception as e:
        lines.append(f"failed: {type(e).__name__}: {e}")
        print(lines[-1], flush=True)
    save()
    if not args.skip_shapes:
        lines += ["", "## fuser's chunk budget and dW accumulator (first shape)", "",
                  "| T×H×V | logits budget MiB | rows/chunk | dW accumulator | ms | extra MiB | dh err | dW err |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        sweep_budget(impls, lines)
        save()
        lines += ["", "## Frozen weight (LoRA: no dW; floor 4·T·H·V)", "",
                  "| T×H×V | impl | ms | floor ms | extra MiB | loss err | dh err | dW err | / Inductor | note |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        bench_shapes(impls, tflops, lines, frozen=True, rounds=args.rounds)
        save()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-shapes", action="store_true", help="only the tiny-model training step")
    parser.add_argument("--only-shapes", action="store_true", help="only the first table (the three shapes)")
    parser.add_argument("--impls", default=None, help="comma-separated subset, e.g. 'inductor,fuser'")
    parser.add_argument(
        "--budgets", default="", help="comma-separated MiB: fuser again at each shape with this chunk budget"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="times each implementation is timed, alternated; the best round counts"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    if not torch.cuda.is_available():
        sys.exit("bench_linear_cross_entropy: needs a CUDA GPU")
    print(run(args))


if __name__ == "__main__":
    main()
