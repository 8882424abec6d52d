"""Tokens/s of a fine-tuning job as users run it: ``transformers.Trainer`` or TRL's ``SFTTrainer``, with no
compile, ``torch_compile=True``, Liger-Kernel, Unsloth, and ``fuser.optimize_`` side by side.

The job: a public checkpoint's shapes (``--model``, a key of benchmarks/jobs.py ``MODELS``; random weights built
on the GPU from the config, nothing downloaded; ``--layers`` cuts the depth), peft LoRA (jobs.py ``LORA`` over a
bf16 base, with peft's default fp32 adapters) or full fine-tuning (fp32 master weights), ``bf16=True``,
``optim="adamw_torch_fused"``, lr 1e-4 (LoRA) or 1e-5 (full), ``--batch`` rows of random token ids of fixed or
random lengths (``--lengths fixed:2048``, ``uniform:512-2048``), padded by the trainer's own collator to a
multiple of 64: ``DataCollatorForLanguageModeling(mlm=False)`` (labels -100 and attention_mask 0 at the pads)
for ``--trainer trainer``; for ``--trainer sft``, SFTTrainer's collator over a ``datasets.Dataset`` of
``input_ids``, with ``max_length`` the longest row and TRL's defaults otherwise (gradient checkpointing on, its
own loss). ``--packing`` packs each batch into one row instead, no pads, ``position_ids`` restarting at each row:
``DataCollatorWithFlattening`` for Trainer, ``SFTConfig(padding_free=True)`` for SFTTrainer.

Modes (``--modes``, comma-separated), each in its own process with fresh Inductor and Triton caches:

- ``none``: no compile;
- ``torch_compile``: ``TrainingArguments(torch_compile=True)``;
- ``liger``: ``TrainingArguments(use_liger_kernel=True)``;
- ``unsloth``: ``FastLanguageModel.from_pretrained`` over the same random weights saved to a local directory
  (``HF_HUB_OFFLINE=1``), ``FastLanguageModel.get_peft_model`` with the same LoRA recipe, the same trainer;
- ``fuser``: ``fuser.optimize_(model)`` and ``fuser.FuserCallback()``; ``--fuser-option NAME=VALUE`` sets a
  ``FuserConfig`` option (``experimental.causal_attention.runtime_check=true``).

Per mode: real (non-pad) tokens/s over the steps after the first ``--warmup`` (timed between device
synchronisations), its ratio to torch_compile's, peak memory (``torch.cuda.max_memory_allocated`` from the
trainer's start), the first step's time (compilation included), the first and last logged loss, and what fuser
fused and recompiled. A mode that fails, runs out of memory, times out or is not installed is a row that says so.
A markdown table (``--out``), one JSON line per mode, and every number (``--json``):

    python benchmarks/trainer_throughput.py --model llama3-8b --method lora --lengths fixed:2048 --out r.md
    python benchmarks/trainer_throughput.py --model gemma3-4b --lengths uniform:512-2048 --modes torch_compile,fuser
    python benchmarks/trainer_throughput.py --tiny --lengths uniform:40-120 --modes none,fuser --steps 3 --warmup 1

Where one device call cannot hold every mode, run them in groups and make one table of their ``--json`` files:

    python benchmarks/trainer_throughput.py --model llama3-8b --modes none,torch_compile --json a.json
    python benchmarks/trainer_throughput.py --combine a.json b.json --out r.md

On the GPU machine (no network, no Liger-Kernel, TRL, Unsloth or DeepSpeed): ``benchmarks/fetch_wheels.sh`` here
fetches their wheels into ``.whl/``, and ``benchmarks/gpu_trainer.sh`` there installs them and runs this script.

DeepSpeed (``--deepspeed``): every mode's trainer gets ``TrainingArguments(deepspeed=config)``, the ZeRO offload
config transformers documents (``trainer_throughput_mode.deepspeed_config``; the trainer fills each ``"auto"`` in),
in one process that names itself rank 0 of 1 (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` set where a launcher did not):

- ``zero2-offload``: ZeRO-2, the optimizer's state and fp32 master weights in pinned host memory
  (``offload_optimizer: {device: cpu, pin_memory: true}``);
- ``zero3-offload``: ZeRO-3 with the parameters offloaded too (``offload_param: {device: cpu, pin_memory: true}``).

``bf16: {enabled: auto}`` has DeepSpeed cast every parameter to bf16, the LoRA adapters too, and keep the fp32
master weights in its optimizer, so fuser's ops for peft's fp32 adapters (``lora_sum``, ``upcast_linear``) find
nothing to match. ``--deepspeed-optimizer``: ``cpu_adam`` puts AdamW in the config's ``optimizer`` section, so
DeepSpeed steps the offloaded weights with its C++ ``DeepSpeedCPUAdam``, as its offload tutorials have users do (the
trainer's ``optim`` is then unused; the op is built on first use with g++ and ninja, no CUDA compiler, here once
before the modes start); ``torch`` leaves that section out and sets ``zero_force_ds_cpu_optimizer: false``, so the
trainer's ``adamw_torch_fused`` steps the offloaded partitions on the CPU; ``auto`` (default) is ``cpu_adam`` where
its op builds, else ``torch``, said on stderr. The setup line names the config and what each mode's engine ran. The
model is built whole on the GPU and DeepSpeed partitions it (ZeRO-3: offloads it) as training starts, so peak memory
counts from the first step.

Under ZeRO-3, ``fuser.optimize_`` makes each decoder layer a ZeRO-3 leaf module, and DeepSpeed reduces a leaf's
gradients in a full backward hook on it, which PyTorch fires before the layer's backward where no input of the layer
needs a gradient: the first layer over a frozen embedding (LoRA), whose step then fails (``The size of tensor a (0)
must match the size of tensor b ...``; DeepSpeed's own ``set_z3_leaf_modules`` fails so without fuser).
``--input-require-grads`` calls ``model.enable_input_require_grads()`` in every mode, so that the embeddings' output
needs a gradient, and keeps that hook in fuser's traces (``ignore_input_require_grads=false``).

Llama-3-8B LoRA under DeepSpeed on one GPU: device calls with ``carry [".whl"]`` after ``fetch_wheels.sh``; at full
depth one mode a call, joined afterwards with ``--combine``; with ``--layers 8`` both modes in one call:

    NAME=z2_torch_compile bash benchmarks/gpu_trainer.sh --model llama3-8b --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 450 --deepspeed zero2-offload --modes torch_compile
    NAME=z2_fuser bash benchmarks/gpu_trainer.sh --model llama3-8b --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 450 --deepspeed zero2-offload --modes fuser
    NAME=z3_torch_compile bash benchmarks/gpu_trainer.sh --model llama3-8b --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 450 --deepspeed zero3-offload --input-require-grads --modes torch_compile
    NAME=z3_fuser bash benchmarks/gpu_trainer.sh --model llama3-8b --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 450 --deepspeed zero3-offload --input-require-grads --modes fuser
    python benchmarks/trainer_throughput.py --combine z2_torch_compile.json z2_fuser.json --out z2.md

    NAME=z2_l8 bash benchmarks/gpu_trainer.sh --model llama3-8b --layers 8 --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 240 --deepspeed zero2-offload --modes torch_compile,fuser
    NAME=z3_l8 bash benchmarks/gpu_trainer.sh --model llama3-8b --layers 8 --method lora --lengths fixed:2048 \
        --steps 8 --warmup 3 --timeout 240 --deepspeed zero3-offload --input-require-grads --modes torch_compile,fuser
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from jobs import MODELS, TINY_FIELDS
from train_step import run_child
from train_step_timing import device_name, last_error_line
from trainer_throughput_mode import (
    DEEPSPEED,
    DEEPSPEED_OPTIMIZERS,
    LEARNING_RATE,
    PAD_TO_MULTIPLE_OF,
    Lengths,
    deepspeed_config,
    run_mode,
)

if importlib.util.find_spec("fuser") is None:  # run from a checkout without `pip install -e .`
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

MODES = ("none", "torch_compile", "liger", "unsloth", "fuser")
VERSIONED = (
    "torch", "triton", "transformers", "peft", "accelerate", "datasets", "trl", "liger-kernel", "unsloth",
    "unsloth_zoo", "deepspeed",
)  # fmt: skip
# what makes two runs' rows one table (--combine)
SETUP_KEYS = ("model", "layers", "tiny", "method", "trainer", "lengths", "seed", "batch", "steps", "warmup")
SETUP_KEYS += ("gradient_checkpointing", "fuser_option", "deepspeed", "deepspeed_optimizer", "input_require_grads")
SETUP_KEYS += ("packing",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS), help="a key of jobs.MODELS")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the checkpoint's)")
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 512: a CPU smoke test")
    parser.add_argument("--method", choices=["lora", "full"], default="lora")
    parser.add_argument("--trainer", choices=["trainer", "sft"], default="trainer")
    parser.add_argument("--lengths", default="fixed:2048", help="fixed:N or uniform:LOW-HIGH tokens a row")
    parser.add_argument("--seed", type=int, default=0, help="weights, row lengths and token ids")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (per_device_train_batch_size)")
    parser.add_argument("--steps", type=int, default=20, help="max_steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s (default 5)")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="non-reentrant; default off for Trainer, TRL's default (on) for SFTTrainer; Unsloth's own when on",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="each batch's rows packed into one row, no pads: DataCollatorWithFlattening for Trainer, "
        "SFTConfig(padding_free=True) for SFTTrainer (position_ids restart at each row's first token)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated (default all)")
    parser.add_argument(
        "--fuser-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a FuserConfig option for the fuser mode, repeatable: experimental.causal_attention.runtime_check=true",
    )
    parser.add_argument("--deepspeed", choices=DEEPSPEED, help="run every mode under this DeepSpeed ZeRO config")
    parser.add_argument(
        "--deepspeed-optimizer",
        choices=("auto", *DEEPSPEED_OPTIMIZERS),
        default="auto",
        help="with --deepspeed: DeepSpeed's CPU Adam (cpu_adam) or the trainer's torch AdamW (torch) steps the "
        "offloaded partitions; auto (default): cpu_adam where its C++ op builds here, else torch",
    )
    parser.add_argument(
        "--input-require-grads",
        action="store_true",
        help="model.enable_input_require_grads() in every mode, and fuser keeps that hook "
        "(ignore_input_require_grads=false): what a frozen embedding under ZeRO-3 leaf layers needs",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed to each mode's process")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process (what each mode's process runs)")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="JSON", help="one table from earlier --json files")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if unknown := sorted(set(args.modes) - set(MODES)):
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    try:
        Lengths.parse(args.lengths)
    except ValueError as error:
        parser.error(str(error))
    if args.steps <= args.warmup or args.warmup < 0:
        parser.error("--steps must exceed --warmup (≥ 0): tokens/s counts the steps after the warm-up")
    return args


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    setup = {key: getattr(args, key) for key in SETUP_KEYS}
    setup["layers"] = args.layers or (TINY_FIELDS["num_hidden_layers"] if args.tiny else MODELS[args.model].layers)
    if args.trainer == "trainer" and args.gradient_checkpointing is None:
        setup["gradient_checkpointing"] = False  # Trainer's default; SFTTrainer's is its own (on)
    if not args.deepspeed:
        setup["deepspeed_optimizer"] = None
    return setup


def resolve_deepspeed_optimizer(args: argparse.Namespace) -> None:
    """Under ``--deepspeed``, build DeepSpeed's CPU Adam op here, once, before any mode starts (a JIT build with g++
    and ninja into torch's extensions cache, which every mode's process then loads), so that no mode's time holds
    it; ``--deepspeed-optimizer auto`` becomes ``cpu_adam``, or ``torch`` where the op does not build."""
    if not args.deepspeed or args.deepspeed_optimizer == "torch" or importlib.util.find_spec("deepspeed") is None:
        return
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as error:  # a missing compiler, ninja or header: whatever the build raises
        if args.deepspeed_optimizer == "cpu_adam":
            raise SystemExit(f"trainer_throughput: DeepSpeed's CPU Adam op did not build here: {error}") from error
        print(
            f"[deepspeed] DeepSpeed's CPU Adam op did not build here ({last_error_line(str(error))}): the trainer's "
            "torch optimizer steps the offloaded partitions instead (--deepspeed-optimizer torch)",
            file=sys.stderr,
        )
        args.deepspeed_optimizer = "torch"
    else:
        args.deepspeed_optimizer = "cpu_adam"


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    if commit:
        # a copy of the working tree (the GPU machine's) can carry changes its git HEAD does not have
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "src/fuser"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
        ).stdout.strip()
        found["fuser"] = f"commit {commit}" + (" + changes to src/fuser/ not in it" if changed else "")
    return found


def not_runnable(args: argparse.Namespace, mode: str) -> str | None:
    """Why ``mode`` cannot start here (a package it needs is not installed), or None."""
    if args.trainer == "sft" and importlib.util.find_spec("trl") is None:
        return "trl (for SFTTrainer)"
    if mode == "liger" and importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel"
    if args.deepspeed and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed"
    return None


def child_command(args: argparse.Namespace, mode: str, json_path: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--json", str(json_path)]
    cmd += ["--model", args.model, "--method", args.method, "--trainer", args.trainer, "--lengths", args.lengths]
    for flag in ("seed", "batch", "steps", "warmup", "layers"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.tiny:
        cmd.append("--tiny")
    if args.gradient_checkpointing is not None:
        cmd.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
    for option in args.fuser_option:
        cmd += ["--fuser-option", option]
    if args.deepspeed:
        cmd += ["--deepspeed", args.deepspeed, "--deepspeed-optimizer", args.deepspeed_optimizer]
    if args.input_require_grads:
        cmd.append("--input-require-grads")
    if args.packing:
        cmd.append("--packing")
    return cmd


def run_one(args: argparse.Namespace) -> int:
    """``--mode``: this process runs it and writes its record to ``--json``."""
    result: dict[str, Any] = {"mode": args.mode, "status": "error"}
    try:
        run_mode(args, result)
    except torch.OutOfMemoryError as error:
        result.update(status="OOM", error=last_error_line(str(error)))
    except (Exception, SystemExit) as error:  # SystemExit too (a script-style import failure): the row says so
        traceback.print_exc()
        result.update(status="error", error=last_error_line(f"{type(error).__name__}: {error}"))
    if torch.cuda.is_available():
        result.setdefault("peak_gib", torch.cuda.max_memory_allocated() / 2**30)
    if args.json:
        args.json.write_text(json.dumps(result))
    return 0 if result["status"] == "ok" else 1


def run_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="trainer_throughput_", ignore_cleanup_errors=True) as tmp:
        for mode in args.modes:
            if reason := not_runnable(args, mode):
                print(f"[{mode}] {reason}", file=sys.stderr)
                results[mode] = {"mode": mode, "status": "not installed", "error": reason}
                continue
            json_path = Path(tmp) / f"{mode}.json"
            env = dict(os.environ, HF_HUB_OFFLINE="1")  # nothing is downloaded; Unsloth would try
            env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / mode / "inductor")  # compiles as a first run does
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / mode / "triton")
            cmd = child_command(args, mode, json_path)
            print(f"[{mode}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
            rc, output = run_child(cmd, env, args.timeout)
            result = json.loads(json_path.read_text()) if json_path.exists() else {"mode": mode}
            if rc is None:
                result.update(status="timeout", error=f"killed after {args.timeout:g} s")
            elif result.get("status") not in ("ok", "OOM"):
                result.update(
                    status=result.get("status", "crashed"), error=result.get("error") or last_error_line(output)
                )
            results[mode] = result
    return results


def describe(setup: dict[str, Any], results: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The table's title and its setup line."""
    method = "LoRA r16 on every linear layer, bf16 base, fp32 adapters" if setup["method"] == "lora" else (
        "full fine-tune, fp32 master weights under bf16 autocast"
    )  # fmt: skip
    if setup.get("deepspeed"):  # DeepSpeed's bf16 casts the parameters; its optimizer holds the fp32 copies
        method = "LoRA r16 on every linear layer, bf16 base and adapters" if setup["method"] == "lora" else (
            "full fine-tune, bf16 weights"
        )  # fmt: skip
        method += ", fp32 master weights in DeepSpeed's optimizer"
    trainer = "TRL SFTTrainer" if setup["trainer"] == "sft" else "transformers.Trainer"
    model = f"{setup['model']}{' (--tiny)' if setup['tiny'] else ''} shapes, {setup['layers']} layers"
    title = f"Trainer throughput: {model}, {method}, {trainer}"
    if setup.get("deepspeed"):
        title += f", DeepSpeed {setup['deepspeed']}"
    lengths = Lengths.parse(setup["lengths"])
    collator = "SFTTrainer's collator" if setup["trainer"] == "sft" else "DataCollatorForLanguageModeling(mlm=False)"
    if setup.get("packing"):
        collator = "SFTTrainer's padding_free collator" if setup["trainer"] == "sft" else "DataCollatorWithFlattening"
    real = [sum(r["real_tokens"]) / sum(r["padded_tokens"]) for r in results.values() if r.get("padded_tokens")]
    padding = f"; real tokens {100 * real[0]:.1f}% of the padded batches" if real and real[0] < 1 else ""
    checkpointing = {True: "on (non-reentrant)", False: "off", None: "SFTTrainer's default"}[
        setup["gradient_checkpointing"]
    ]
    timed = setup["steps"] - setup["warmup"]
    batched = f"padded by {collator} to a multiple of {PAD_TO_MULTIPLE_OF}"
    if setup.get("packing"):
        batched = f"packed into one row a batch by {collator} (position_ids restart at each row, no pads)"
    text = (
        f"batch {setup['batch']} rows; {lengths.describe(setup['seed'])}, random token ids, {batched}{padding}; "
        "bf16=True, optim adamw_torch_fused, "
        f"lr {LEARNING_RATE[setup['method']]:.0e}; gradient checkpointing {checkpointing}; "
        f"{setup['steps']} steps, tokens/s (real tokens only) over the last {timed}; each mode in its own process "
        "with fresh Inductor and Triton caches"
    )
    if setup.get("deepspeed"):
        text += "; " + describe_deepspeed(setup, results)
    if setup["fuser_option"]:
        text += f"; fuser options {', '.join(setup['fuser_option'])}"
    if setup.get("input_require_grads"):
        text += (
            "; model.enable_input_require_grads() in every mode (the input embeddings' output requires a gradient), "
            "fuser keeping that hook (ignore_input_require_grads=false)"
        )
    return title, text


def describe_deepspeed(setup: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    """The setup line's DeepSpeed part: the config the trainer got and what its engines ran."""
    config = json.dumps(deepspeed_config(setup["deepspeed"], setup["deepspeed_optimizer"]), separators=(",", ":"))
    ran = {
        f"ZeRO-{r['zero_stage']}, optimizer state on {r['offload_optimizer']}, parameters on "
        f"{'the device' if r['offload_param'] == 'none' else r['offload_param']}, {r['optimizer_class']} stepping"
        for r in results.values()
        if r.get("status") == "ok" and "zero_stage" in r
    }
    optimizer = (
        "the config's AdamW, DeepSpeed's CPU Adam (optim unused)"
        if setup["deepspeed_optimizer"] == "cpu_adam"
        else "the trainer's optim on the offloaded partitions (zero_force_ds_cpu_optimizer off)"
    )
    return (
        f"DeepSpeed {setup['deepspeed']}, one process (rank 0 of 1), config `{config}`; optimizer {optimizer}; "
        f"engines ran {'; '.join(sorted(ran)) or 'nothing'}; peak memory from the first step (after DeepSpeed "
        "partitioned and offloaded)"
    )


def report(record: dict[str, Any]) -> str:
    setup, results = record["setup"], record["modes"]
    title, setup_line = describe(setup, results)
    base = results.get("torch_compile", {})
    base_tps = base.get("tokens_per_s") if base.get("status") == "ok" else None
    rows = []
    for mode, r in results.items():
        if r.get("status") != "ok":
            rows.append([mode, f"{r.get('status', 'crashed')}: {r.get('error', '')}".replace("|", "/"), *[""] * 6])
            continue
        losses = r.get("losses") or []
        notes = []
        if r.get("fuser_counts") is not None:
            notes.append(", ".join(f"{k}={v}" for k, v in sorted(r["fuser_counts"].items())) or "nothing fused")
            notes.append(f"{r.get('fuser_recompiles', 0)} recompiles, {r.get('fuser_graph_breaks', 0)} graph breaks")
        rows.append([
            mode,
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base_tps:.2f}" if base_tps else "–",
            f"{r['peak_gib']:.1f}" if "peak_gib" in r else "–",
            f"{r['first_step_s']:.1f}",
            f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "–",
            "on" if r.get("gradient_checkpointing") else "off",
            "; ".join(notes),
        ])  # fmt: skip
    columns = ["mode", "real tokens/s", "÷ torch_compile", "peak GiB", "first step s", "loss first → last"]
    columns += ["checkpointing", "fused (fuser)"]
    align = ["---", "---:", "---:", "---:", "---:", "---", "---", "---"]
    table = [columns, align, *rows]
    version_line = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
    return (
        f"# {title}\n\n"
        f"- command: `{record['command']}`\n"
        f"- date: {record['date']}\n"
        f"- device: {record['device']}\n"
        f"- versions: {version_line}\n"
        f"- setup: {setup_line}\n\n" + "".join("| " + " | ".join(row) + " |\n" for row in table)
    )


def combine(paths: list[Path]) -> dict[str, Any]:
    records = [json.loads(p.read_text()) for p in paths]
    first = records[0]

    def setup(record: dict[str, Any]) -> dict[str, Any]:  # keys added since a file was written read as None
        return {key: record["setup"].get(key) for key in SETUP_KEYS} | record["setup"]

    for path, record in zip(paths[1:], records[1:], strict=True):
        if setup(record) != setup(first):
            raise SystemExit(f"trainer_throughput: {path} ran another setup than {paths[0]}: {record['setup']}")
    modes = {mode: r for record in records for mode, r in record["modes"].items()}
    return {
        **first,
        "command": "; ".join(dict.fromkeys(r["command"] for r in records)),
        "date": ", ".join(dict.fromkeys(r["date"] for r in records)),
        "device": ", ".join(dict.fromkeys(r["device"] for r in records)),
        "modes": {m: modes[m] for m in MODES if m in modes},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.mode or args.deepspeed_optimizer == "auto":  # a mode's process gets the parent's choice
        resolve_deepspeed_optimizer(args)
    if args.mode:
        return run_one(args)
    if args.combine:
        record = combine(args.combine)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        record = {
            "command": shlex.join(
                ["python", "benchmarks/trainer_throughput.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device_name(device),
            "versions": versions(),
            "setup": setup_of(args),
            "modes": run_all(args),
        }
    text = report(record)
    print(text)
    for result in record["modes"].values():
        print(json.dumps({k: v for k, v in result.items() if k not in ("real_tokens", "padded_tokens")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0 if all(r.get("status") in ("ok", "not installed") for r in record["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
