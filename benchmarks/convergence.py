"""Convergence: does a model trained through fuser follow the fp32 reference as closely as eager and Inductor do?

Small real models (default 4 layers, hidden 256) built from Llama, Qwen3 and Gemma configs train on real
English text that ships with Python (the help topics in ``pydoc_data/topics.py``), tokenised locally by bytes
(256 byte tokens + BOS, EOS, PAD; no downloads), for ``--steps`` steps with the same initial weights, the same
data in the same order and AdamW, in several runs:

    eager-fp32 (the reference), eager-bf16, inductor-bf16, fuser-bf16         (the default on CUDA)
    eager-fp32, fuser-fp32                                                    (the default on a CPU)

each as a full fine-tune and with LoRA (r 16, alpha 32, all linear layers). It writes a table of the losses
(every 10th step, and the largest |loss − reference| of each run), a PNG plot when matplotlib is installed,
and checks per model and method:

- with bf16 runs (issue 6): at every step |fuser bf16 − fp32| ≤ min(|eager bf16 − fp32|, |inductor bf16 − fp32|)
  + 1e-2 (1e-2: Liger-Kernel's own convergence tolerance);
- with fuser fp32: at every step |fuser fp32 − eager fp32| ≤ 1e-4 · |eager fp32|.

    python benchmarks/convergence.py --out benchmarks/results/convergence.md [--models llama] [--methods lora]
    python benchmarks/convergence.py --device cpu --steps 20                      # fp32 runs, a few minutes
    python benchmarks/convergence.py --from-json llama.json qwen3.json --out report.md   # one report, one plot

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import importlib.util
import json
import math
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

if importlib.util.find_spec("fuser") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# byte-level tokens: 0..255 are bytes, then three specials
BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "gemma": "GemmaConfig"}
RUNS = {  # name: (how it runs, dtype)
    "eager-fp32": ("eager", torch.float32),
    "eager-bf16": ("eager", torch.bfloat16),
    "inductor-bf16": ("inductor", torch.bfloat16),
    "fuser-bf16": ("fuser", torch.bfloat16),
    "inductor-fp32": ("inductor", torch.float32),
    "fuser-fp32": ("fuser", torch.float32),
}
REFERENCE = "eager-fp32"
DEFAULT_RUNS = {
    "cuda": ["eager-fp32", "eager-bf16", "inductor-bf16", "fuser-bf16"],
    "cpu": ["eager-fp32", "fuser-fp32"],
}
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
BF16_ATOL = 1e-2  # Liger-Kernel's convergence tolerance
FP32_RTOL = 1e-4


# ---------------------------------------------------------------------------------------------------------
# Data: English text from an installed package, byte-tokenised
# ---------------------------------------------------------------------------------------------------------


def english_documents() -> list[str]:
    """Python's help topics (``pydoc_data.topics``), in sorted order: about 450 KB of English prose and code."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:
        raise SystemExit(
            "convergence: this Python has no pydoc_data (the help topics of the standard library), which is the "
            "training text; install the full standard library (Debian: libpython3-stdlib)"
        ) from error
    return [topics[key] for key in sorted(topics)]


def token_stream(documents: list[str]) -> torch.Tensor:
    """BOS, the UTF-8 bytes of the document, EOS, for every document, as one int64 stream."""
    ids: list[int] = []
    for doc in documents:
        ids += [BOS, *doc.encode("utf-8"), EOS]
    return torch.tensor(ids, dtype=torch.int64)


def batches(stream: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` windows of ``seq`` tokens: the stream cut into windows, shuffled with
    ``seed`` (reshuffled each pass if the run needs more windows than the text has)."""
    windows = stream[: len(stream) // seq * seq].view(-1, seq)
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        epoch = list(range(len(windows)))
        rng.shuffle(epoch)
        order += epoch
    return [windows[order[i * batch : (i + 1) * batch]] for i in range(steps)]


# ---------------------------------------------------------------------------------------------------------
# Models and runs
# ---------------------------------------------------------------------------------------------------------


def build_model(arch: str, hidden: int, layers: int, seq: int, seed: int) -> torch.nn.Module:
    """A random-weight fp32 causal LM of ``transformers.<CONFIGS[arch]>`` at the given size, dropout off."""
    import transformers

    heads = max(2, hidden // 64)  # head_dim 64 at real sizes; at least 2 heads, so KV heads are grouped
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=max(seq, 256),
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def prepare(base: torch.nn.Module, method: str, dtype: torch.dtype, device: torch.device, seed: int):
    """A copy of ``base`` in ``dtype`` on ``device``: all parameters trainable, or frozen with LoRA on top."""
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    if method == "lora":
        import peft

        torch.manual_seed(seed + 1)  # the same LoRA A matrices in every run
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    return model


def train(
    base: torch.nn.Module,
    method: str,
    run: str,
    data: list[torch.Tensor],
    device: torch.device,
    lr: float,
    seed: int = 0,
    fuser_inner_compiler: str = "inductor",
) -> dict[str, Any]:
    """Train a copy of ``base`` on ``data`` in ``run`` (a key of RUNS); the loss of every step, and what fused."""
    how, dtype = RUNS[run]
    model = prepare(base, method, dtype, device, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
    torch._dynamo.reset()  # a fresh cache per run: no recompile limit carried over between runs
    backend = None
    if how == "inductor":
        step_model = torch.compile(model)
    elif how == "fuser":
        import fuser

        backend = fuser.backend(fuser.FuserConfig(inner_compiler=fuser_inner_compiler))
        counts_before = Counter(backend.counts)
        step_model = fuser.optimize(model, backend.config)
    else:
        step_model = model

    losses = []
    start = time.perf_counter()
    for ids in data:
        ids = ids.to(device)
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    result = {"losses": losses, "seconds": time.perf_counter() - start}
    if backend is not None:
        result["fuser_counts"] = dict(Counter(backend.counts) - counts_before)
    if not all(math.isfinite(x) for x in losses):
        result["error"] = "non-finite loss"
    return result


# ---------------------------------------------------------------------------------------------------------
# Checks and report
# ---------------------------------------------------------------------------------------------------------


def check(losses: dict[str, list[float]]) -> list[tuple[str, bool, str]]:
    """The checks the runs present allow: (name, passed, detail) each."""
    ref = losses.get(REFERENCE)
    verdicts = []
    if ref is None:
        return verdicts
    dist = {run: [abs(a - r) for a, r in zip(ls, ref, strict=True)] for run, ls in losses.items()}
    if all(run in losses for run in ("eager-bf16", "inductor-bf16", "fuser-bf16")):
        bound = [min(e, i) + BF16_ATOL for e, i in zip(dist["eager-bf16"], dist["inductor-bf16"], strict=True)]
        bad = [s for s, (d, b) in enumerate(zip(dist["fuser-bf16"], bound, strict=True)) if not d <= b]
        detail = (
            "at every step"
            if not bad
            else f"{len(bad)} step(s) over, first at step {bad[0]}: |fuser − fp32| {dist['fuser-bf16'][bad[0]]:.4f} "
            f"> {bound[bad[0]]:.4f}"
        )
        name = "|fuser bf16 − fp32| ≤ min(|eager bf16 − fp32|, |inductor bf16 − fp32|) + 1e-2"
        verdicts.append((name, not bad, detail))
    if "fuser-fp32" in losses:
        rel = [d / max(abs(r), 1e-30) for d, r in zip(dist["fuser-fp32"], ref, strict=True)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        ok = all(x <= FP32_RTOL for x in rel)
        verdicts.append(
            (f"|fuser fp32 − eager fp32| ≤ {FP32_RTOL:g} relative", ok, f"worst {rel[worst]:.1e} (step {worst})")
        )
    return verdicts


def versions() -> str:
    found = []
    for name in ("torch", "triton", "transformers", "peft"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found) + f", CUDA {torch.version.cuda}"


def loss_table(losses: dict[str, list[float]], every: int = 10) -> str:
    runs = list(losses)
    steps = len(next(iter(losses.values())))
    shown = sorted(set(range(0, steps, every)) | {steps - 1})
    lines = ["| step | " + " | ".join(runs) + " |", "|---:|" + "---:|" * len(runs)]
    lines += [f"| {s} | " + " | ".join(f"{losses[r][s]:.4f}" for r in runs) + " |" for s in shown]
    if REFERENCE in losses:
        ref = losses[REFERENCE]
        worst = [max(abs(a - b) for a, b in zip(losses[r], ref, strict=True)) for r in runs]
        lines.append("| max \\|Δ\\| vs fp32 | " + " | ".join(f"{w:.2e}" for w in worst) + " |")
    return "\n".join(lines)


def plot(all_losses: dict[str, dict[str, list[float]]], path: Path) -> str:
    """A PNG: per model and method, the losses (top) and |loss − fp32| (bottom). Returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    keys = list(all_losses)
    fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 7), squeeze=False)
    for col, key in enumerate(keys):
        losses = all_losses[key]
        ref = losses.get(REFERENCE)
        for run, ls in losses.items():
            color = f"C{list(RUNS).index(run)}"  # one colour per run in both panels
            axes[0][col].plot(ls, label=run, lw=1, color=color)
            if ref is not None and run != REFERENCE:
                axes[1][col].plot([abs(a - b) for a, b in zip(ls, ref, strict=True)], lw=1, color=color)
        axes[0][col].set_title(key)
        axes[0][col].set_ylabel("loss")
        axes[1][col].set_ylabel("|loss − eager fp32|")
        axes[1][col].set_yscale("symlog", linthresh=1e-4)
        axes[1][col].set_xlabel("step")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(CONFIGS), help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--methods", default="full,lora", help="comma-separated, of full, lora")
    parser.add_argument("--runs", help=f"comma-separated, of {list(RUNS)}; default: {DEFAULT_RUNS}")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, help="sequences per step (default 8 on CUDA, 4 on a CPU)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 256 on CUDA, 128 on a CPU)")
    parser.add_argument("--lr-full", type=float, default=3e-4, help="AdamW lr of the full fine-tune")
    parser.add_argument("--lr-lora", type=float, default=1e-3, help="AdamW lr of LoRA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuser-inner-compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--out", metavar="FILE.md", help="write the report here (the plot beside it, .png)")
    parser.add_argument("--json", metavar="FILE", help="write every loss as JSON")
    parser.add_argument("--from-json", nargs="+", metavar="JSON", help="train nothing: report (and plot) saved runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu")
    args.models = args.models.split(",")
    args.methods = args.methods.split(",")
    args.runs = args.runs.split(",") if args.runs else DEFAULT_RUNS["cuda" if device.type == "cuda" else "cpu"]
    for flag, given, known in (("models", args.models, CONFIGS), ("methods", args.methods, ("full", "lora"))):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"--{flag}: unknown {unknown}; choose from {sorted(known)}")
    if unknown := sorted(set(args.runs) - set(RUNS)):
        parser.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if REFERENCE not in args.runs:
        args.runs.insert(0, REFERENCE)
    if args.steps < 1:
        parser.error("--steps must be ≥ 1")
    args.batch = args.batch or (8 if device.type == "cuda" else 4)
    args.seq = args.seq or (256 if device.type == "cuda" else 128)
    return args


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Train every model × method × run of ``args``; the record that :func:`render` turns into the report."""
    device = torch.device(args.device)
    stream = token_stream(english_documents())
    data = batches(stream, args.steps, args.batch, args.seq, args.seed)
    print(f"text: {len(stream):,} byte tokens; {args.steps} steps of {args.batch}×{args.seq}", file=sys.stderr)
    header = [
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}",
        f"- versions: {versions()}",
        f"- setup: {args.layers} layers, hidden {args.hidden}, byte-level vocab {VOCAB}, random init (seed "
        f"{args.seed}); text: Python's pydoc_data help topics ({len(stream):,} tokens), windows of {args.seq} "
        f"shuffled with seed {args.seed}, batch {args.batch}; AdamW(fused) lr {args.lr_full:g} (full) / "
        f"{args.lr_lora:g} (LoRA r16, alpha 32, all linear); same weights and data order in every run",
    ]
    record: dict[str, Any] = {"header": header, "results": {}}
    for arch in args.models:
        base = build_model(arch, args.hidden, args.layers, args.seq, args.seed)
        for method in args.methods:
            key = f"{arch} {method}"
            runs: dict[str, Any] = {}
            for run in args.runs:
                print(f"[{key}] {run} ...", file=sys.stderr, flush=True)
                lr = args.lr_full if method == "full" else args.lr_lora
                runs[run] = train(base, method, run, data, device, lr, args.seed, args.fuser_inner_compiler)
                losses = runs[run]["losses"]
                print(f"[{key}] {run}: first {losses[0]:.4f}, last {losses[-1]:.4f}", file=sys.stderr, flush=True)
            record["results"][key] = runs
    return record


def render(records: list[dict[str, Any]], out: str | None) -> tuple[str, dict[str, bool]]:
    """The markdown report of one or more records (and, with ``out``, the plot beside it); PASS of each model."""
    report = ["# Convergence: fuser against eager fp32, eager bf16 and Inductor bf16", ""]
    all_losses: dict[str, dict[str, list[float]]] = {}
    passed: dict[str, bool] = {}
    for record in records:
        report += [*record["header"], ""]
        for key, runs in record["results"].items():
            losses = {run: out_["losses"] for run, out_ in runs.items()}
            all_losses[key] = losses
            verdicts = check(losses)
            ok = all(v for _, v, _ in verdicts) and not any("error" in out_ for out_ in runs.values())
            passed[key] = ok
            notes = [
                f"{run}: {out_['seconds']:.1f} s"
                + (f", fused {out_['fuser_counts']}" if out_.get("fuser_counts") is not None else "")
                + (f", {out_['error']}" if "error" in out_ else "")
                for run, out_ in runs.items()
            ]
            report.append(f"## {key}: {'PASS' if ok else 'FAIL'}\n")
            report += [f"- {name}: {'PASS' if v else 'FAIL'} ({detail})" for name, v, detail in verdicts]
            report += [] if verdicts else ["- no check: the runs given allow none"]
            report += ["- " + "; ".join(notes), "", loss_table(losses), ""]
    if out:
        report.append(plot(all_losses, Path(out).with_suffix(".png")))
    return "\n".join(report) + "\n", passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        records = [json.loads(Path(name).read_text()) for name in args.from_json]
    else:
        records = [run_all(args)]
        if args.json:
            Path(args.json).write_text(json.dumps(records[0], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text, passed = render(records, args.out)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    for key, ok in passed.items():
        print(f"{key}: {'PASS' if ok else 'FAIL'}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
