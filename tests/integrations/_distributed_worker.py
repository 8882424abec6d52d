"""What each process of tests/integrations/test_distributed.py runs (spawned: importable by name): two gloo
processes on CPU, or with ``backend="nccl"`` one process per GPU (fp32 on CUDA, fuser's inner compiler Inductor).

Every scenario trains the same tiny Llama a few steps twice in the same two processes, on per-rank different
batches: once through fuser, once without it (eager), wrapped the same way (DDP, or FSDP2's ``fully_shard`` per
decoder layer and then the root). Rank 0 saves what the parent test compares: each rank's step losses, the
final parameters (FSDP2: gathered with ``full_tensor()``), the initial ones, fuser's fused counts and the number
of graphs it compiled.
"""

from __future__ import annotations

import os
import traceback
import warnings

import torch
import torch.distributed as dist

STEPS, SEQ, BSZ, VOCAB = 3, 16, 2, 256


def tiny_llama(tied: bool = False) -> torch.nn.Module:
    """The same random-weight 2-layer Llama in every process (fixed seed), fp32, norm weights randomised."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.train()


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def batches(rank: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """This rank's batches: different on every rank (so DDP's and FSDP2's gradient averaging matters)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BSZ, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def fresh_compile_state() -> None:
    """A clean Dynamo cache and fresh fuser backends, so each run's counts are its own."""
    import torch._dynamo

    import fuser.dynamo_backend

    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole (an FSDP2 DTensor gathered with ``full_tensor()``); collective on FSDP2."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().clone()
    return out


def build(scenario: str, device: torch.device) -> torch.nn.Module:
    model = tiny_llama(tied="tied" in scenario)
    if "lora" in scenario:
        model = with_lora(model)
    return model.to(device)


def layers_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def wrap(scenario: str, model: torch.nn.Module, config) -> torch.nn.Module:
    """``model`` wrapped for ``scenario`` and compiled through fuser with ``config`` (``None``: eager)."""
    import fuser

    if scenario.startswith("ddp"):
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        if "buckets" in scenario:
            # several gradient buckets, as any model over 25 MB has: Dynamo's DDPOptimizer then splits the graph
            # at the bucket borders and fuser compiles each piece (the first bucket's cap, 1 MB, is a constant)
            dist._DEFAULT_FIRST_BUCKET_BYTES = 50_000
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=0.05)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        # the documented route: compile the DDP-wrapped module
        return ddp if config is None else fuser.optimize(ddp, config)
    from torch.distributed.fsdp import fully_shard

    for layer in layers_of(model):
        fully_shard(layer)
    fully_shard(model)
    if config is None:
        return model
    if "per_block" in scenario:
        for layer in layers_of(model):
            layer.compile(backend=fuser.backend(config))
        return model
    return fuser.optimize(model, config)


def train(scenario: str, config, device: torch.device) -> dict:
    """``STEPS`` SGD steps of ``scenario`` on this rank's batches: its losses, final parameters, fused counts."""
    import fuser

    fresh_compile_state()
    first_bucket = dist._DEFAULT_FIRST_BUCKET_BYTES  # DDP and DDPOptimizer read it (wrap may change it)
    try:
        model = build(scenario, device)
        run = wrap(scenario, model, config)
        # SGD: a parameter's update is the learning rate times its gradient sum, so the gradients' tolerance
        # applies to the updates as it is (Adam divides by a running gradient norm, which amplifies noise)
        optimizer = torch.optim.SGD([p for p in run.parameters() if p.requires_grad], lr=1.0)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for data in batches(dist.get_rank(), device):
                loss = run(**data).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach().item())
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket
    backend = fuser.backend(config) if config is not None else None
    counts = dict(backend.counts) if backend else {}
    return {
        "losses": losses,
        "params": full_params(model),
        "counts": counts,
        "graphs": len(backend.results) if backend else 0,
        # fuser's own warnings (the DDP-bucket one), each message once
        "warnings": sorted({str(w.message) for w in caught if str(w.message).startswith("fuser:")}),
    }


def main(rank: int, world: int, port: int, scenarios: list[str], out_path: str, backend: str = "gloo") -> None:
    """One process of the group: every scenario in turn; rank 0 saves the results to ``out_path``. ``gloo``: CPU,
    fuser through aot_eager (the same fused ops, CPU-fast); ``nccl``: this rank's GPU, fuser through Inductor."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers

    import fuser

    transformers.logging.set_verbosity_error()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
    inner = "inductor" if backend == "nccl" else "aot_eager"
    config = fuser.FuserConfig(strict=True, inner_compiler=inner)
    results: dict = {}
    for scenario in scenarios:
        result: dict = {}
        try:
            result["initial"] = full_params(build(scenario, device))
            result["fuser"] = train(scenario, config, device)
            result["eager"] = train(scenario, None, device)
        except Exception:  # the parent test shows it
            result["error"] = traceback.format_exc()
        gathered = [None] * world if rank == 0 else None
        losses = {k: result[k]["losses"] for k in ("fuser", "eager") if k in result}
        dist.gather_object({"losses": losses, "error": result.get("error")}, gathered, dst=0)
        result["per_rank"] = gathered
        results[scenario] = result
    if rank == 0:
        torch.save(_to_cpu(results), out_path)
    dist.destroy_process_group()


def _to_cpu(value):
    """``value`` (nested dicts and lists of results) with every tensor moved to the CPU, for the parent to load."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
