"""Run by tests/test_restriction.py under torchrun (2 CPU processes, gloo): a Trainer run restricted to stay out of a
region; each process writes its final parameters and the frozen entries' check."""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from testing_utils import clone_model, cls_dataset, fast_args, make_pair, sparse_region
from transformers import Trainer

from peft_graft import RestrictTrainingCallback


def main(output_dir: str) -> None:
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    frozen = sparse_region(model, 0.05, seed=3)
    before = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    args = fast_args(
        Path(output_dir),
        max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=0.05,
        weight_decay=0.1, max_grad_norm=0.5,
    )  # fmt: skip
    Trainer(
        model=model, args=args, train_dataset=cls_dataset(n=24), callbacks=[RestrictTrainingCallback(frozen=frozen)]
    ).train()
    after = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    kept = all(torch.equal(before[n][frozen[n]], after[n][frozen[n]]) for n in before)
    moved = sum(int((before[n] != after[n]).sum()) for n in before)
    rank = int(os.environ.get("RANK", 0))
    save_file(after, os.path.join(output_dir, f"params{rank}.safetensors"))
    with open(os.path.join(output_dir, f"rank{rank}.txt"), "w") as handle:
        handle.write(f"world_size={args.world_size} kept={kept} moved={moved}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
