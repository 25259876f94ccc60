"""Mask training run by tests/test_mask_trainer_ddp.py, in 1 process or under ``torchrun --nproc_per_node 2``.

Usage: python tests/ddp_mask_script.py OUTPUT_DIR [CANDIDATES]. Writes OUTPUT_DIR/checkpoint-2 (the sparse graft and
S) and OUTPUT_DIR/final (the hardened graft). SEARCH_FRACTION: ``GraftConfig.search_fraction`` (default: dense S).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from datasets import Dataset
from peft import get_peft_model
from testing_utils import VOCAB, clone_model, make_pair
from torch import nn

from peft_graft import GraftConfig, GraftLayer, MaskTrainer, MaskTrainingArguments


def main(output_dir: str, search_fraction: float | None) -> None:
    torch.set_num_threads(1)
    pre, finetuned, task_type = make_pair("roberta_cls")
    config = GraftConfig(
        finetuned=finetuned, region="empty", learn_region=True, task_type=task_type, search_fraction=search_fraction
    )
    model = get_peft_model(clone_model(pre), config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (16, 9), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": torch.randint(0, 2, (16,), generator=g).tolist()})
    args = MaskTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        mask_batch_size=16,  # 4 accumulation steps in 1 process, 2 per process in 2
        max_steps=2,
        learning_rate=1e9,
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = MaskTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert not any(isinstance(m, GraftLayer) and m.is_learning("default") for m in model.modules())
    trainer.save_model(os.path.join(output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"world_size={args.world_size} accumulation={args.gradient_accumulation_steps} {trainer.mask_report}")
    if torch.distributed.is_initialized():  # left to interpreter exit, gloo's threads sometimes abort the process
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
