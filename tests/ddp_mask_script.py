"""Mask training run by tests/test_mask_trainer_ddp.py, in 1 process or under ``torchrun --nproc_per_node 2``.

Usage: python tests/ddp_mask_script.py OUTPUT_DIR [CANDIDATES]. Writes OUTPUT_DIR/checkpoint-2 (the sparse graft and
S) and OUTPUT_DIR/final (the hardened graft). SEARCH_FRACTION: ``GraftConfig.search_fraction`` (default: dense S).
With the environment variable ``SELECT=1`` every step is evaluated on the training examples and the mask is selected
with ``selection_alpha`` (the predictions are gathered from both processes); ``EVALUATE_FIRST=1`` evaluates before
training (refused under DDP). ``FSDP=1``: under torchrun, shard the model with FSDP2 through the Trainer's
``fsdp_config``; ``FSDP=accelerate``: under ``accelerate launch`` with an FSDP2 config file. ``SAVE_STEPS``: the
checkpoint interval (default 2); ``RESUME``: a checkpoint to resume from. ``DEEPSPEED=1``: under torchrun, partition
the model with DeepSpeed ZeRO-3 through the Trainer's ``deepspeed`` argument (every tensor partitioned, S included);
with ``ZERO_INIT=1`` too, the graft is created on the pre-trained model loaded partitioned (``zero.Init``).
``DEEPSPEED=accelerate``: under ``accelerate launch`` with a DeepSpeed ZeRO-3 config file (no ``deepspeed`` argument).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from datasets import Dataset
from peft import get_peft_model
from testing_utils import VOCAB, ZERO3, allow_fsdp_on_cpu, clone_model, exit_rank, make_pair
from torch import nn
from transformers import RobertaForSequenceClassification

from peft_graft import GraftConfig, GraftLayer, MaskTrainer, MaskTrainingArguments


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


SELECTION = (
    dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="accuracy", selection_alpha=0.5)
    if os.environ.get("SELECT") == "1"
    else {}
)
EVALUATION = {"compute_metrics": accuracy}
# FSDP=1 under torchrun: the Trainer shards the model with FSDP2, one unit per RobertaLayer, as users configure it.
SHARDING = (
    dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["RobertaLayer"]})
    if os.environ.get("FSDP") == "1" and int(os.environ.get("WORLD_SIZE", "1")) > 1
    else {}
)
DEEPSPEED = os.environ.get("DEEPSPEED") in ("1", "accelerate") and int(os.environ.get("WORLD_SIZE", "1")) > 1
ZERO_INIT = DEEPSPEED and os.environ.get("ZERO_INIT") == "1"  # the graft created on a model loaded partitioned


def main(output_dir: str, search_fraction: float | None) -> None:
    torch.set_num_threads(1)
    if SHARDING or os.environ.get("FSDP") == "accelerate":  # "accelerate": FSDP2 from an accelerate config file
        allow_fsdp_on_cpu()
    if DEEPSPEED:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU (gloo), before the Trainer's DeepSpeed engine
    pre, finetuned, task_type = make_pair("roberta_cls")
    # With selection the sign test may keep the starting region: a non-empty one, so that the kept graft can be saved
    # (a graft without entries cannot be: peft loads no adapter that targets no module).
    start = dict(region="movement", num_entries=24) if SELECTION else dict(region="empty")
    config = GraftConfig(
        finetuned=finetuned, **start, learn_region=True, task_type=task_type, search_fraction=search_fraction
    )
    model = None if ZERO_INIT else get_peft_model(clone_model(pre), config)
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
        save_steps=int(os.environ.get("SAVE_STEPS", "2")),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
        **SELECTION,
        **SHARDING,
        **({"deepspeed": ZERO3} if DEEPSPEED and os.environ["DEEPSPEED"] == "1" else {}),
    )
    if ZERO_INIT:  # loaded after TrainingArguments(deepspeed=<ZeRO-3>): partitioned by zero.Init as it loads
        if int(os.environ["RANK"]) == 0:
            pre.save_pretrained(os.path.join(output_dir, "pre"))
        torch.distributed.barrier()
        partitioned = RobertaForSequenceClassification.from_pretrained(os.path.join(output_dir, "pre"))
        model = get_peft_model(partitioned, config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    evaluation = {"eval_dataset": data, **EVALUATION} if SELECTION else {}
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, **evaluation)
    if os.environ.get("EVALUATE_FIRST") == "1":
        trainer.evaluate(data)
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") or None)
    assert not any(isinstance(m, GraftLayer) and m.is_learning("default") for m in model.modules())
    trainer.save_model(os.path.join(output_dir, "final"))
    if DEEPSPEED:  # the hardened region is not partitioned: a forward under the engine is refused, naming the way out
        try:
            trainer.evaluate(data)
        except ValueError as error:
            print(f"evaluation after hardening refused: {error}")
    if trainer.is_world_process_zero():
        accumulation = trainer.args.gradient_accumulation_steps
        sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
        print(f"partitioned={any(hasattr(p, 'ds_id') for p in model.parameters())}")  # by DeepSpeed ZeRO-3
        print(f"world_size={args.world_size} accumulation={accumulation} sharded={sharded} {trainer.mask_report}")
    if torch.distributed.is_initialized():  # left to interpreter exit, gloo's threads sometimes abort the process
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
    exit_rank()
