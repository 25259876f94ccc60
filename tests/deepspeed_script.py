"""Run by tests/test_deepspeed.py under torchrun (2 CPU processes, gloo, DeepSpeed's CPU accelerator): every entry
point of peft_graft refuses DeepSpeed ZeRO-3 (and restricted training ZeRO-2) at once with a ``ValueError`` naming
the way out, and changes nothing.

Usage: torchrun --nproc_per_node 2 tests/deepspeed_script.py (in an empty folder). Writes rank<N>.txt: one line per
entry point, ``<entry point> refused: <message>`` (or ``... ran``, which the test fails on).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import PeftModel, get_peft_model
from testing_utils import VOCAB, clone_model, exit_rank, make_pair
from transformers import RobertaForSequenceClassification, Trainer, TrainingArguments
from transformers.integrations import deepspeed_config

from peft_graft import (
    ContinualGrafter,
    GraftConfig,
    MaskTrainer,
    MaskTrainingArguments,
    Region,
    RestrictTrainingCallback,
)
from peft_graft.merging import merge_grafts

ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # tiny tensors partitioned too
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
}
COMMON = dict(use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, max_steps=1, seed=0)


def attempt(lines: list[str], what: str, action) -> None:
    try:
        action()
        lines.append(f"{what} ran")
    except ValueError as error:
        lines.append(f"{what} refused: {error}")


def main() -> None:
    torch.set_num_threads(1)
    pre, finetuned, task_type = make_pair("roberta_cls")
    if int(os.environ["RANK"]) == 0:
        pre.save_pretrained("pre")
        graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
        graft.save_pretrained("graft")
    deepspeed.init_distributed(dist_backend="gloo")  # on CPU, TrainingArguments leaves deepspeed.comm to zero.Init
    dist.barrier()
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, deepspeed=ZERO3, **COMMON)
    ids = torch.randint(3, VOCAB, (8, 9), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": [0, 1] * 4})
    lines = []

    # A model loaded after TrainingArguments(deepspeed=<ZeRO-3>) is partitioned by zero.Init as it loads.
    partitioned = RobertaForSequenceClassification.from_pretrained("pre")
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in partitioned.parameters())
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type)
    attempt(lines, "get_peft_model", lambda: get_peft_model(partitioned, config))
    attempt(lines, "PeftModel.from_pretrained", lambda: PeftModel.from_pretrained(partitioned, "graft"))
    attempt(lines, "ContinualGrafter", lambda: ContinualGrafter(partitioned, heads=["classifier"]))
    lines.append(f"untouched: {not any('graft_' in name for name, _ in partitioned.named_parameters())}")
    graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    deepspeed.zero.Init(module=graft, config_dict_or_path=deepspeed_config())  # partitions a graft made whole
    attempt(lines, "merge_and_unload", graft.merge_and_unload)
    attempt(lines, "merge_grafts", lambda: merge_grafts(graft, ["default"], "task_arithmetic"))

    # A graft created on a whole model, then trained by a DeepSpeed Trainer.
    whole = clone_model(pre)
    mask_config = GraftConfig(finetuned=finetuned, region="empty", learn_region=True, task_type=task_type)
    learning = get_peft_model(whole, mask_config)
    mask_args = MaskTrainingArguments(output_dir="mask", per_device_train_batch_size=4, deepspeed=ZERO3, **COMMON)
    attempt(lines, "MaskTrainer", lambda: MaskTrainer(model=learning, args=mask_args, train_dataset=data))
    graft = PeftModel.from_pretrained(clone_model(pre), "graft", is_trainable=True)
    attempt(lines, "Trainer on a graft", lambda: Trainer(model=graft, args=args, train_dataset=data).train())
    AcceleratorState._reset_state()  # accelerate allows one DeepSpeed Accelerator per process: start afresh
    region = Region({"classifier.dense.weight": torch.arange(10)})
    restricted = Trainer(
        model=clone_model(pre),
        args=args,
        train_dataset=data,
        callbacks=[RestrictTrainingCallback(allowed=region)],
    )
    attempt(lines, "RestrictTrainingCallback", restricted.train)
    AcceleratorState._reset_state()
    zero2 = {**ZERO3, "zero_optimization": {"stage": 2}}  # nothing partitioned: refused as DeepSpeed runs
    args = TrainingArguments(output_dir="out2", per_device_train_batch_size=4, deepspeed=zero2, **COMMON)
    callback = RestrictTrainingCallback(allowed=region)
    restricted = Trainer(model=clone_model(pre), args=args, train_dataset=data, callbacks=[callback])
    attempt(lines, "RestrictTrainingCallback (ZeRO-2)", restricted.train)
    with open(f"rank{dist.get_rank()}.txt", "w") as handle:
        handle.write("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
