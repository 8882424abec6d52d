"""What each process of ``test_trainer_distributed.py`` runs, under ``torch.distributed.run -m`` (2 processes,
CPU, gloo): a real ``transformers.Trainer`` on the distributed tests' tiny Llama, once without fuser and once
after ``fuser.optimize_`` (the README's line); rank 0 saves each run's logged losses, the trainer's wrapper type,
fuser's fused counts and the trained parameters to the path given."""

from __future__ import annotations

import sys

import torch

from tests.integrations._distributed_worker import VOCAB, tiny_llama


def dataset():
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, VOCAB, (16,), generator=g).tolist()} for _ in range(16)]
    return datasets.Dataset.from_list([{**row, "labels": list(row["input_ids"])} for row in rows])


def train(with_fuser: bool, out_dir: str) -> dict:
    import torch._dynamo
    import transformers

    import fuser
    import fuser.dynamo_backend

    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()
    model = tiny_llama()
    config = fuser.FuserConfig(inner_compiler="aot_eager", strict=True)
    if with_fuser:
        fuser.optimize_(model, config)
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=3,
        optim="sgd",  # an update is lr × gradient: the gradients' tolerance holds for it (Adam amplifies noise)
        learning_rate=0.1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "wrapper": type(trainer.model_wrapped).__name__,
        "counts": dict(fuser.backend(config).counts) if with_fuser else {},
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "initial": {k: v.detach().clone() for k, v in tiny_llama().state_dict().items()},
    }


def main(out_path: str) -> None:
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    results = {"eager": train(False, out_path + ".eager"), "fuser": train(True, out_path + ".fuser")}
    if dist.get_rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
