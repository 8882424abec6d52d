"""Convergence: does a model trained through fuser follow the fp32 reference as closely as eager and Inductor do?

Every run trains a copy of the same initial weights on the same data, in the same order, with AdamW (``fused``),
for ``--steps`` steps:

    eager-fp32 (the reference), eager-bf16, inductor-bf16, fuser-bf16   (the default on CUDA, and with --preset)
    eager-fp32, eager-amp, inductor-amp, fuser-amp                      (the default with an autocast preset)
    eager-fp32, fuser-fp32                                              (the default on a CPU without --preset)

The ``*-amp`` runs train as ``transformers.Trainer(bf16=True)`` does: the forward and its loss inside
``torch.autocast(device, dtype=torch.bfloat16)``, the backward and AdamW outside it; LoRA on the bf16 base with
peft's fp32 adapters, a full fine-tune on fp32 weights (fp32 master weights and AdamW states, the forward's matmuls
in bf16). The fp32 reference is the same in every case: eager fp32, no autocast.

Further runs (``--runs``): ``inductor-fp32``; ``inductor-bf16-emulate`` (Inductor with
``torch._inductor.config.emulate_precision_casts = True``: it then rounds where eager rounds); and any fuser run
with options after a colon, ``:``-separated: ``patterns=rms_norm,swiglu`` (a ``FuserConfig(patterns=...)``
subset; ``patterns=-lora_sum,-rope`` is the default patterns without those, ``patterns=none`` none at all) and
``inner=aot_eager`` (the inner compiler of that run; default ``--fuser-inner-compiler``), e.g.
``--runs eager-fp32,inductor-bf16,fuser-bf16,fuser-bf16:patterns=-lora_sum:inner=aot_eager``.

Two kinds of model and data:

- default (as before): small random-weight models (``--models`` llama, qwen3, gemma; ``--layers``, ``--hidden``)
  on real English text that ships with Python (the help topics in ``pydoc_data/topics.py``), byte-tokenised
  (256 byte tokens + BOS, EOS, PAD; no downloads), each batch a new shuffled window;
- ``--preset NAME`` (issue 16): the widths of a public checkpoint (``llama3-8b``, ``qwen3-8b``, ``llama32-1b``;
  ``--layers`` of them, random init) or ``cpu-small`` / ``cpu-tiny`` (CPU-sized Llamas that show issue 16;
  cpu-tiny is the CI test's), and by default ``--data fixed``: one seeded batch of random tokens, repeated every
  step (the loss can only fall by learning that batch, so the drop measures how much of each update shows).
  The autocast presets ``llama3-8b-amp``, ``qwen3-8b-amp`` (LoRA), ``llama32-1b-amp`` (full fine-tune) and
  ``cpu-tiny-amp`` (the CI test's) are the same recipes with the ``*-amp`` runs; ``--lr`` overrides a preset's
  learning rate (the LoRA ones are run at 1e-5 and 2e-4), ``--runs`` its runs, ``--methods`` its method.

Each method (``--methods``): LoRA (peft, r 16, alpha 32, all linear layers, peft's init: B = 0, A the same seeded
values in every run; adapters in fp32 as peft keeps them under a bf16 base) or a full fine-tune (bf16 runs train the
bf16 weights themselves, as ``model.to(bf16)`` + AdamW does: no fp32 master copy, so small updates of large weights
round away in every bf16 run alike; ``*-amp`` runs keep fp32 weights). bf16 runs (and the ``*-amp`` runs' bf16 LoRA
base) are ``model.to(bfloat16)`` of the fp32 initial weights, and the fp32 reference (and a full fine-tune's fp32
weights under autocast) starts from those same bf16-rounded values. After each run the trained adapters (or weights)
are copied into the fp32 model and its loss on the first batch is computed in fp32 eager: the "fp32-evaluated" loss,
which shows what the run learned, apart from how it computed its own losses.

Per model and method the report has, per run: the loss drop over the run (first loss − last loss), its ratio to
the fp32 reference's drop, max over steps |loss − fp32 loss|, the fp32-evaluated loss and how much of fp32's
learning it shows; then the losses of the steps. The checks, with no fixed slack:

- fuser bf16 (issue 16): max |fuser − fp32| ≤ max |inductor − fp32|, and where Inductor's drop is within 10 % of
  fp32's, fuser's is too (needs ``inductor-bf16`` among the runs; fuser runs with options are reported against
  the same rule as diagnostics and do not decide PASS); the same rule holds ``fuser-amp`` to ``inductor-amp``;
- fuser fp32: at every step |fuser fp32 − eager fp32| ≤ 1e-4 · |eager fp32|.

    python benchmarks/convergence.py --out benchmarks/results/convergence.md [--models llama] [--methods lora]
    python benchmarks/convergence.py --device cpu --steps 20                      # fp32 runs, a few minutes
    python benchmarks/convergence.py --preset llama3-8b --layers 4 --out report.md     # issue 16's recipe (GPU)
    python benchmarks/convergence.py --preset llama3-8b-amp --lr 2e-4 --out report.md  # the same under autocast
    python benchmarks/convergence.py --preset cpu-tiny --device cpu --threads 1 --seeds 0,1,2 \\
        --runs eager-fp32,eager-bf16,inductor-bf16,fuser-bf16,fuser-bf16:patterns=-lora_sum,-swiglu
    python benchmarks/convergence.py --from-json llama.json qwen3.json --out report.md   # one report, one plot

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
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
from jobs import LORA, MODELS, PRESETS, model_config

if importlib.util.find_spec("fuser") is None:  # run from a checkout without `pip install -e .`
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

# byte-level tokens: 0..255 are bytes, then three specials
BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "gemma": "GemmaConfig"}
RUNS = {  # name: (how it runs, dtype, forward under bf16 autocast)
    "eager-fp32": ("eager", torch.float32, False),
    "eager-bf16": ("eager", torch.bfloat16, False),
    "inductor-bf16": ("inductor", torch.bfloat16, False),
    "fuser-bf16": ("fuser", torch.bfloat16, False),
    "inductor-fp32": ("inductor", torch.float32, False),
    "fuser-fp32": ("fuser", torch.float32, False),
    "inductor-bf16-emulate": ("inductor-emulate", torch.bfloat16, False),
    # as Trainer(bf16=True) trains: the forward and its loss under torch.autocast(bfloat16), the backward and AdamW
    # outside it; LoRA on the bf16 base (peft's fp32 adapters), a full fine-tune on fp32 weights (fp32 master
    # weights and AdamW states), so the dtype here is the LoRA base's
    "eager-amp": ("eager", torch.bfloat16, True),
    "inductor-amp": ("inductor", torch.bfloat16, True),
    "fuser-amp": ("fuser", torch.bfloat16, True),
}
REFERENCE = "eager-fp32"
DEFAULT_RUNS = {
    "cuda": ["eager-fp32", "eager-bf16", "inductor-bf16", "fuser-bf16"],
    "cpu": ["eager-fp32", "fuser-fp32"],
}
AUTOCAST_RUNS = ["eager-fp32", "eager-amp", "inductor-amp", "fuser-amp"]  # the default of an autocast preset
# the fuser runs issue 16's rule holds to, each against the Inductor run of the same precision
INDUCTOR_OF = {"fuser-bf16": "inductor-bf16", "fuser-amp": "inductor-amp"}
FP32_RTOL = 1e-4
DROP_RTOL = 0.1  # "fuser's drop within 10 % of fp32's wherever Inductor's is"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: a key of RUNS and, for fuser runs, options (``fuser-bf16:patterns=a,b:inner=aot_eager``)."""

    name: str
    base: str
    how: str
    dtype: torch.dtype
    patterns: tuple[str, ...] | None = None  # None: FuserConfig's default
    inner: str | None = None  # None: the caller's fuser_inner_compiler
    options: tuple[tuple[str, bool], ...] = ()  # (an option's dotted name, its value): ``set=`` options
    autocast: bool = False  # the forward and loss under torch.autocast(bfloat16)

    @property
    def diagnostic(self) -> bool:
        return self.name != self.base

    def weights_dtype(self, method: str) -> torch.dtype:
        """The dtype of the model's weights for ``method``: fp32 for a full fine-tune under autocast (fp32 master
        weights), else the run's dtype (under LoRA the frozen base's; the adapters stay fp32)."""
        return torch.float32 if self.autocast and method == "full" else self.dtype


def parse_run(spec: str | RunSpec) -> RunSpec:
    """A RunSpec from ``name[:option=value]...``; options only on fuser runs: ``patterns=``, ``inner=`` and
    ``set=name=true|false`` (a boolean option by its dotted name, e.g.
    ``set=experimental.gated_mlp.backward_in_place=false``)."""
    if isinstance(spec, RunSpec):
        return spec
    base, *options = spec.split(":")
    if base not in RUNS:
        raise ValueError(f"unknown run {base!r}; choose from {list(RUNS)}")
    how, dtype, autocast = RUNS[base]
    patterns = inner = None
    settings: list[tuple[str, bool]] = []
    for option in options:
        key, sep, value = option.partition("=")
        if how != "fuser" or not sep or key not in ("patterns", "inner", "set"):
            raise ValueError(
                f"run {spec!r}: unknown option {option!r} (fuser runs take patterns=..., inner=... and set=...)"
            )
        if key == "set":
            path, sep, flag = value.partition("=")
            if not (sep and path) or flag not in ("true", "false"):
                raise ValueError(f"run {spec!r}: set takes name=true|false, got {value!r}")
            settings.append((path, flag == "true"))
        elif key == "inner":
            if value not in ("inductor", "aot_eager", "eager"):
                raise ValueError(f"run {spec!r}: inner must be inductor, aot_eager or eager")
            inner = value
        else:
            patterns = parse_patterns(value)
    return RunSpec(spec, base, how, dtype, patterns, inner, tuple(settings), autocast)


def parse_patterns(value: str) -> tuple[str, ...]:
    """``a,b`` (or ``a+b``): exactly those; ``-a,-b``: the default patterns without those; ``none``: none."""
    import fuser
    from fuser.patterns import PATTERNS

    names = [n for n in value.replace("+", ",").split(",") if n and n != "none"]
    removed = [n[1:] for n in names if n.startswith("-")]
    added = [n for n in names if not n.startswith("-")]
    if removed and added:
        raise ValueError(f"patterns={value}: either names or -names, not both")
    if unknown := sorted(set(removed + added) - set(PATTERNS)):
        raise ValueError(f"patterns={value}: unknown {unknown}; known: {sorted(PATTERNS)}")
    if removed:
        return tuple(n for n in fuser.DEFAULT_PATTERNS if n not in removed)
    return tuple(added)


def split_runs(text: str) -> list[str]:
    """``--runs``, comma-separated; a piece that is not a run name continues the previous run's options, so
    ``fuser-bf16:patterns=rms_norm,swiglu,eager-bf16`` is two runs."""
    runs: list[str] = []
    for piece in text.split(","):
        if runs and piece.split(":")[0] not in RUNS:
            runs[-1] += "," + piece
        else:
            runs.append(piece)
    return [r for r in runs if r]


# ---------------------------------------------------------------------------------------------------------
# Data: English text from an installed package, byte-tokenised; or one batch of random tokens
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


def fixed_batch(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """One ``batch`` × ``seq`` batch of uniformly random token ids below ``vocab``, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator, dtype=torch.int64)


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


def build_preset(name: str, layers: int | None, seed: int) -> torch.nn.Module:
    """A random-weight fp32 causal LM of preset ``name`` with ``layers`` layers (default: the preset's)."""
    import transformers

    preset = PRESETS[name]
    config = model_config(
        preset.model, num_hidden_layers=layers or preset.layers, use_cache=False, attn_implementation="sdpa"
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def round_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Round ``model``'s floating-point parameters to ``dtype`` and back, in place (buffers untouched): an fp32
    model that starts from exactly the weights ``model.to(dtype)`` has."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype))
    return model


def prepare(base: torch.nn.Module, method: str, dtype: torch.dtype, device: torch.device, seed: int):
    """A copy of ``base`` in ``dtype`` on ``device``: all parameters trainable, or frozen with LoRA on top
    (fp32 adapters, as peft keeps them under a half-precision base; B = 0; A the same values in every run)."""
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    if method == "lora":
        import peft

        torch.manual_seed(seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
        # peft draws A in fp32, then casts it to the base dtype and back: redraw it so every dtype gets the same A
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    values = torch.empty(p.shape, dtype=torch.float32)
                    torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
                    p.copy_(values)
    model.train()
    return model


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``model`` (LoRA adapters, or every weight), by name, copied to the CPU."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def evaluate_fp32(
    base: torch.nn.Module,
    method: str,
    state: dict[str, torch.Tensor],
    ids: torch.Tensor,
    device: torch.device,
    seed: int = 0,
) -> float:
    """The fp32 eager loss on ``ids`` of ``base`` with the trained parameters ``state`` copied in (cast to fp32)."""
    model = prepare(base, method, torch.float32, device, seed)
    params = dict(model.named_parameters())
    if missing := sorted(set(state) - set(params)):
        raise KeyError(f"trained parameters the fp32 model lacks: {missing[:3]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
        model.eval()
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss.item()
    del model
    return loss


def train(
    base: torch.nn.Module,
    method: str,
    run: str | RunSpec,
    data: list[torch.Tensor],
    device: torch.device,
    lr: float,
    seed: int = 0,
    fuser_inner_compiler: str = "inductor",
    evaluate: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train a copy of ``base`` on ``data`` in ``run`` (a key of RUNS, or one with fuser options); the loss of
    every step, and what fused. With ``evaluate`` (a batch), also the fp32-evaluated loss of the trained model."""
    spec = parse_run(run)
    model = prepare(base, method, spec.weights_dtype(method), device, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
    torch._dynamo.reset()  # a fresh cache per run: no recompile limit carried over between runs
    backend = None
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    # *-amp runs: each forward (and its loss) in a fresh autocast context, as Trainer's compute_loss runs it
    forward_context = contextlib.nullcontext
    if spec.autocast:
        forward_context = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    if spec.how in ("inductor", "inductor-emulate"):
        step_model = torch.compile(model)
        if spec.how == "inductor-emulate":
            inductor_config = importlib.import_module("torch._inductor.config")
            context = inductor_config.patch(emulate_precision_casts=True)
    elif spec.how == "fuser":
        import fuser

        config = fuser.FuserConfig.from_options(
            {"patterns": spec.patterns, "inner_compiler": spec.inner or fuser_inner_compiler, **dict(spec.options)}
        )
        backend = fuser.backend(config)
        counts_before, variants_before = Counter(backend.counts), fused_variants(backend)
        step_model = fuser.optimize(model, backend.config)
    else:
        step_model = model

    losses = []
    step_seconds = []
    with context:
        for ids in data:
            start = time.perf_counter()
            ids = ids.to(device)
            with forward_context():
                loss = step_model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step_seconds.append(time.perf_counter() - start)
    result: dict[str, Any] = {"losses": losses, "seconds": sum(step_seconds), "first_step_seconds": step_seconds[0]}
    if backend is not None:
        result["fuser_counts"] = dict(Counter(backend.counts) - counts_before)
        result["fuser_variants"] = dict(fused_variants(backend) - variants_before)
        result["fuser_config"] = {"patterns": spec.patterns, "inner_compiler": backend.config.inner_compiler}
    if not all(math.isfinite(x) for x in losses):
        result["error"] = "non-finite loss"
    if evaluate is not None:
        state = trained_state(model)
        del step_model, model, optimizer, params
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["fp32_eval_loss"] = evaluate_fp32(base, method, state, evaluate, device, seed)
    return result


def fused_variants(backend: Any) -> Counter[str]:
    """``pattern (variant)`` → matches, over every graph ``backend`` compiled so far (``lora_sum (peft autocast)``
    says the LoRA sums fused were autocast's)."""
    return Counter(f"{m.pattern} ({m.variant})" for result in backend.results for m in result.matches)


# ---------------------------------------------------------------------------------------------------------
# Checks and report
# ---------------------------------------------------------------------------------------------------------


def summary(losses: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per run: ``drop`` (first − last loss), ``ratio`` (drop ÷ the reference's drop; nan without a reference
    or when it did not move) and ``max_diff`` (max over steps |loss − reference loss|)."""
    ref = losses.get(REFERENCE)
    out = {}
    for run, ls in losses.items():
        drop = ls[0] - ls[-1]
        row = {"drop": drop, "ratio": math.nan, "max_diff": math.nan}
        if ref is not None:
            ref_drop = ref[0] - ref[-1]
            row["ratio"] = drop / ref_drop if ref_drop != 0 else math.nan
            row["max_diff"] = max(abs(a - r) for a, r in zip(ls, ref, strict=True))
        out[run] = row
    return out


def inductor_of(run: str) -> str | None:
    """The Inductor run fuser run ``run`` is held to (``fuser-amp:patterns=...`` → ``inductor-amp``), or None."""
    return INDUCTOR_OF.get(run.split(":")[0])


def bf16_verdict(s: dict[str, dict[str, float]], run: str) -> tuple[bool, str]:
    """Issue 16's rule for fuser run ``run`` against the Inductor run of its precision (``inductor-bf16`` or
    ``inductor-amp``; both in ``s``, from :func:`summary`)."""
    fz, ind = s[run], s[inductor_of(run)]
    ok_diff = fz["max_diff"] <= ind["max_diff"]
    detail = f"max |Δ| {fz['max_diff']:.2e} vs Inductor's {ind['max_diff']:.2e}"
    if abs(ind["ratio"] - 1) <= DROP_RTOL:
        ok_drop = abs(fz["ratio"] - 1) <= DROP_RTOL
        detail += f"; drop {fz['ratio']:.2f} of fp32's (Inductor {ind['ratio']:.2f}: must be within {DROP_RTOL:.0%})"
    else:
        ok_drop = True
        detail += f"; drop {fz['ratio']:.2f} of fp32's (Inductor's {ind['ratio']:.2f} is not within {DROP_RTOL:.0%})"
    return ok_diff and ok_drop, detail


def check(losses: dict[str, list[float]]) -> list[tuple[str, bool, str]]:
    """The checks the runs present allow, the ones that decide PASS: (name, passed, detail) each."""
    ref = losses.get(REFERENCE)
    verdicts = []
    if ref is None:
        return verdicts
    for fuser_run, inductor_run in INDUCTOR_OF.items():
        if fuser_run in losses and inductor_run in losses:
            ok, detail = bf16_verdict(summary(losses), fuser_run)
            precision = "bf16 autocast" if parse_run(fuser_run).autocast else "bf16"
            name = (
                f"max |fuser {precision} − fp32| ≤ max |inductor {precision} − fp32|, and fuser's drop within 10 % "
                "of fp32's where Inductor's is"
            )
            verdicts.append((name, ok, detail))
    if "fuser-fp32" in losses:
        rel = [abs(a - r) / max(abs(r), 1e-30) for a, r in zip(losses["fuser-fp32"], ref, strict=True)]
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
    lines = ["| step | " + " | ".join(f"`{r}`" for r in runs) + " |", "|---:|" + "---:|" * len(runs)]
    lines += [f"| {s} | " + " | ".join(f"{losses[r][s]:.5f}" for r in runs) + " |" for s in shown]
    if REFERENCE in losses:
        ref = losses[REFERENCE]
        worst = [max(abs(a - b) for a, b in zip(losses[r], ref, strict=True)) for r in runs]
        lines.append("| max \\|Δ\\| vs fp32 | " + " | ".join(f"{w:.2e}" for w in worst) + " |")
    return "\n".join(lines)


def _num(x: float, spec: str) -> str:
    return "–" if math.isnan(x) else format(x, spec)


def run_table(runs: dict[str, dict[str, Any]]) -> str:
    """One row per run: first and last loss, drop, drop ÷ fp32's, max |Δ|, fp32-evaluated loss, rule, time."""
    losses = {run: out["losses"] for run, out in runs.items()}
    s = summary(losses)
    ref_first = losses[REFERENCE][0] if REFERENCE in losses else math.nan
    ref_eval = runs.get(REFERENCE, {}).get("fp32_eval_loss", math.nan)
    lines = [
        "| run | first loss | last loss | drop | drop ÷ fp32's | max \\|Δ\\| vs fp32 | fp32-evaluated loss after "
        "| learned ÷ fp32's (fp32-evaluated) | issue-16 rule | s (1st step) | fused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for run, out in runs.items():
        row = s[run]
        ev = out.get("fp32_eval_loss", math.nan)
        learned = (ref_first - ev) / (ref_first - ref_eval) if ref_first != ref_eval else math.nan
        rule = ""
        if REFERENCE in losses and inductor_of(run) in losses:
            ok, _ = bf16_verdict(s, run)
            rule = ("PASS" if ok else "FAIL") + (" (diagnostic)" if run not in INDUCTOR_OF else "")
        fused = ", ".join(f"{k} {v}" for k, v in sorted(out.get("fuser_counts", {}).items()))
        first_step = out.get("first_step_seconds", math.nan)
        lines.append(
            f"| `{run}` | {out['losses'][0]:.5f} | {out['losses'][-1]:.5f} | {row['drop']:.5f} | {row['ratio']:.3f} "
            f"| {row['max_diff']:.2e} | {_num(ev, '.5f')} | {_num(learned, '.3f')} | {rule} | {out['seconds']:.1f} "
            f"({_num(first_step, '.1f')}) | {fused} |"
        )
    return "\n".join(lines)


def seeds_table(results: dict[str, dict[str, Any]]) -> str:
    """Drop ÷ fp32's drop of every run, one column per result key (e.g. one per seed), with min and max."""
    keys = list(results)
    runs = list(dict.fromkeys(run for key in keys for run in results[key]))
    ratios = {
        key: summary({run: out["losses"] for run, out in results[key].items()}) for key in keys if len(results[key])
    }
    lines = [
        "| run | " + " | ".join(keys) + " | min | max |",
        "|---|" + "---:|" * (len(keys) + 2),
    ]
    for run in runs:
        vals = [ratios[k][run]["ratio"] if run in ratios[k] else math.nan for k in keys]
        finite = [v for v in vals if math.isfinite(v)]
        lo, hi = (min(finite), max(finite)) if finite else (math.nan, math.nan)
        lines.append(f"| `{run}` | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {lo:.3f} | {hi:.3f} |")
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
    names = list(dict.fromkeys(run for losses in all_losses.values() for run in losses))
    fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 7), squeeze=False)
    for col, key in enumerate(keys):
        losses = all_losses[key]
        ref = losses.get(REFERENCE)
        for run, ls in losses.items():
            color = f"C{names.index(run) % 10}"  # one colour per run in both panels
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
# Command line
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=list(PRESETS), help="a real model's widths (default data: fixed)")
    parser.add_argument("--models", help=f"without --preset: comma-separated, of {sorted(CONFIGS)} (default all)")
    parser.add_argument(
        "--methods", help="comma-separated, of full, lora (default: full,lora; with --preset, the preset's)"
    )
    parser.add_argument(
        "--runs",
        help=f"comma-separated, of {list(RUNS)}, fuser ones optionally with :patterns=a,b (or -a,-b) and "
        f":inner=aot_eager; default: {DEFAULT_RUNS} (the cuda list with --preset; {AUTOCAST_RUNS} with an "
        "autocast preset, *-amp)",
    )
    parser.add_argument("--data", choices=["text", "fixed"], help="text (default) or fixed (default with --preset)")
    parser.add_argument("--steps", type=int, help="default 100; with --preset, the preset's")
    parser.add_argument("--layers", type=int, help="default 4; with --preset, the preset's")
    parser.add_argument("--hidden", type=int, default=256, help="without --preset")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8 on CUDA, 4 on a CPU; or the preset's)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 256 on CUDA, 128 on a CPU; or preset's)")
    parser.add_argument("--lr", type=float, help="AdamW lr of every method (overrides --lr-full and --lr-lora)")
    # the rates people fine-tune with (issue 16): larger ones hide bf16's loss of small updates
    parser.add_argument("--lr-full", type=float, default=1e-5, help="AdamW lr of the full fine-tune (default 1e-5)")
    parser.add_argument("--lr-lora", type=float, default=2e-4, help="AdamW lr of LoRA (default 2e-4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", help="comma-separated seeds, one set of runs each (overrides --seed)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU runs on a busy machine: 1)")
    parser.add_argument("--fuser-inner-compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--out", metavar="FILE.md", help="write the report here (the plot beside it, .png)")
    parser.add_argument("--json", metavar="FILE", help="write every loss as JSON")
    parser.add_argument("--from-json", nargs="+", metavar="JSON", help="train nothing: report (and plot) saved runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu")
    preset = PRESETS.get(args.preset)
    if preset and args.models:
        parser.error("--models and --preset exclude each other")
    args.models = [args.preset] if preset else (args.models or ",".join(CONFIGS)).split(",")
    args.methods = (args.methods or (preset.method if preset else "full,lora")).split(",")
    if preset and preset.autocast:
        default_runs = AUTOCAST_RUNS
    else:
        default_runs = DEFAULT_RUNS["cuda" if device.type == "cuda" or preset else "cpu"]
    args.runs = split_runs(args.runs) if args.runs else list(default_runs)
    if not preset and (unknown := sorted(set(args.models) - set(CONFIGS))):
        parser.error(f"--models: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if unknown := sorted(set(args.methods) - {"full", "lora"}):
        parser.error(f"--methods: unknown {unknown}; choose from ['full', 'lora']")
    for run in args.runs:
        try:
            parse_run(run)
        except ValueError as error:
            parser.error(f"--runs: {error}")
    if len(set(args.runs)) != len(args.runs):
        parser.error("--runs: a run given twice")
    if REFERENCE not in args.runs:
        args.runs.insert(0, REFERENCE)
    args.data = args.data or ("fixed" if preset else "text")
    args.steps = args.steps or (preset.steps if preset else 100)
    args.layers = args.layers or (preset.layers if preset else 4)
    args.batch = args.batch or (preset.batch if preset else 8 if device.type == "cuda" else 4)
    args.seq = args.seq or (preset.seq if preset else 256 if device.type == "cuda" else 128)
    if args.lr is not None:
        args.lr_full = args.lr_lora = args.lr
    elif preset:
        args.lr_full = args.lr_lora = preset.lr
    args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.steps < 1:
        parser.error("--steps must be ≥ 1")
    return args


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Train every model × method × seed × run of ``args``; the record that :func:`render` turns into the report."""
    device = torch.device(args.device)
    specs = [parse_run(run) for run in args.runs]
    round_init = any(s.dtype != torch.float32 for s in specs)
    autocast_about = (
        "; amp runs: forward and loss under torch.autocast(bfloat16), LoRA on the bf16 base with fp32 adapters, "
        "full fine-tunes on fp32 weights"
        if any(s.autocast for s in specs)
        else ""
    )
    lrs = f"AdamW(fused) lr {args.lr_full:g} (full) / {args.lr_lora:g} (LoRA r16, alpha 32, all linear, B = 0)"
    if args.preset:
        preset, model = PRESETS[args.preset], MODELS[PRESETS[args.preset].model]
        model_about = f"preset {args.preset} ({preset.about}; {model.model_type} {model.fields}), {args.layers} layers"
        vocab = model.fields["vocab_size"]
    else:
        model_about = f"{args.layers} layers, hidden {args.hidden}, byte-level vocab {VOCAB}"
        vocab = VOCAB
    if args.data == "text":
        stream = token_stream(english_documents())
        data_about = (
            f"text: Python's pydoc_data help topics ({len(stream):,} tokens), windows of {args.seq} shuffled with "
            f"the seed, batch {args.batch}"
        )
    else:
        data_about = f"data: one batch of {args.batch}×{args.seq} random tokens (from the seed), repeated every step"
    print(f"{args.steps} steps of {args.batch}×{args.seq} ({args.data})", file=sys.stderr)
    header = [
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
        + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""),
        f"- versions: {versions()}",
        f"- setup: {model_about}, random init (seeds {','.join(map(str, args.seeds))}); {data_about}; {args.steps} "
        f"steps; {lrs}; bf16 runs: model.to(bfloat16), fp32 LoRA adapters{autocast_about}; "
        + ("the fp32 reference starts from the bf16-rounded weights; " if round_init else "")
        + f"fuser inner compiler {args.fuser_inner_compiler} unless a run says otherwise; same weights and data "
        "order in every run; fp32-evaluated: the trained adapters/weights in the fp32 model, loss on the first batch",
    ]
    record: dict[str, Any] = {"header": header, "results": {}}
    for arch in args.models:
        for seed in args.seeds:
            if args.preset:
                base = build_preset(args.preset, args.layers, seed)
            else:
                base = build_model(arch, args.hidden, args.layers, args.seq, seed)
            if round_init:
                round_parameters(base, torch.bfloat16)
            if args.data == "text":
                data = batches(stream, args.steps, args.batch, args.seq, seed)
            else:
                data = [fixed_batch(vocab, args.batch, args.seq, seed)] * args.steps
            for method in args.methods:
                key = f"{arch} {method}" + (f" seed {seed}" if len(args.seeds) > 1 else "")
                runs: dict[str, Any] = {}
                record["results"][key] = runs
                for spec in specs:
                    print(f"[{key}] {spec.name} ...", file=sys.stderr, flush=True)
                    lr = args.lr_full if method == "full" else args.lr_lora
                    runs[spec.name] = out = train(
                        base, method, spec, data, device, lr, seed, args.fuser_inner_compiler, evaluate=data[0]
                    )
                    losses = out["losses"]
                    print(
                        f"[{key}] {spec.name}: first {losses[0]:.5f}, last {losses[-1]:.5f}, drop "
                        f"{losses[0] - losses[-1]:.5f}, fp32-evaluated {out['fp32_eval_loss']:.5f}, "
                        f"{out['seconds']:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    if args.json:  # after every run, so a run cut short still leaves the ones before it
                        Path(args.json).write_text(json.dumps(record, indent=1))
            del base
    return record


def render(records: list[dict[str, Any]], out: str | None) -> tuple[str, dict[str, bool]]:
    """The markdown report of one or more records (and, with ``out``, the plot beside it); PASS of each model."""
    report = ["# Convergence: fuser against eager fp32, eager bf16 and Inductor bf16", ""]
    all_losses: dict[str, dict[str, list[float]]] = {}
    passed: dict[str, bool] = {}
    for record in records:
        report += [*record["header"], ""]
        if len(record["results"]) > 1 and all(REFERENCE in runs for runs in record["results"].values()):
            report += ["Loss drop ÷ fp32's loss drop:", "", seeds_table(record["results"]), ""]
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
            status = ("PASS" if ok else "FAIL") if verdicts or not ok else "no check"
            report.append(f"## {key}: {status}\n")
            report += [f"- {name}: {'PASS' if v else 'FAIL'} ({detail})" for name, v, detail in verdicts]
            report += [] if verdicts else ["- no check: the runs given allow none"]
            if REFERENCE in runs:
                report += ["", run_table(runs), ""]
            else:
                report += ["- " + "; ".join(notes), ""]
            steps = len(next(iter(losses.values())))
            report += [loss_table(losses, every=1 if steps <= 20 else 10), ""]
    if out:
        report.append(plot(all_losses, Path(out).with_suffix(".png")))
    return "\n".join(report) + "\n", passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
