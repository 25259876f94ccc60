"""Run by tests/test_continual.py in 1 process, or under torchrun (2 CPU processes, gloo) with ``FSDP=1``: the Trainer
then shards the model with FSDP2 (``fsdp_config``); with ``DEEPSPEED=1`` it partitions the model with DeepSpeed ZeRO-3
(its ``deepspeed`` argument, the Trainer's optimizer, DeepSpeed's clipping; every tensor partitioned). A
ContinualGrafter learns two tasks with a head under RestrictTrainingCallback (AdamW, weight decay, clipping, a global
batch of 8, no dropout); rank 0 saves the learner to OUTPUT_DIR/learner, each process writes OUTPUT_DIR/rank<r>.txt."""

import os
import sys
from pathlib import Path

import torch
from testing_utils import (
    ZERO3,
    allow_fsdp_on_cpu,
    clone_model,
    cls_dataset,
    exit_rank,
    fast_args,
    make_pair,
    sparse_region,
)
from transformers import Trainer

from peft_graft import ContinualGrafter, Region, RestrictTrainingCallback

FSDP = os.environ.get("FSDP") == "1" and int(os.environ.get("WORLD_SIZE", "1")) > 1
DEEPSPEED = os.environ.get("DEEPSPEED") == "1" and int(os.environ.get("WORLD_SIZE", "1")) > 1


def sharding(first_task: bool) -> dict:
    """The Trainer's FSDP2 settings: the first task's Trainer shards the model, one unit per BertLayer; later tasks
    train the model already sharded (NO_WRAP: accelerate would look the layer class up by name, and FSDP2 renamed it
    FSDPBertLayer). Under ZeRO-3 the first task's Trainer partitions the model; later ones train it partitioned."""
    if DEEPSPEED:
        return {"deepspeed": ZERO3}
    if not FSDP:
        return {}
    wrap = {"transformer_layer_cls_to_wrap": ["BertLayer"]} if first_task else {"auto_wrap_policy": "NO_WRAP"}
    return dict(fsdp=True, fsdp_config={"version": 2, **wrap})


def body_region(model, fraction: float, seed: int) -> Region:
    region = sparse_region(model, fraction, seed)
    return Region({n: idx for n, idx in region.items() if not n.startswith("classifier")})


def resumes_partitioned(learner: ContinualGrafter, folder: str) -> bool:
    """Whether the saved learner, resumed on theta_pre partitioned by ZeRO-3 (every process writing its partitions),
    holds the trained model bit for bit (parameters gathered whole)."""
    import deepspeed

    torch.distributed.barrier()  # rank 0 saved the learner
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": ZERO3["zero_optimization"]}
    pretrained = clone_model(make_pair("bert_cls")[0])
    deepspeed.zero.Init(module=pretrained, config_dict_or_path=config)
    resumed = ContinualGrafter.from_pretrained(folder, pretrained)
    trained, same = dict(learner.model.named_parameters()), True
    for name, param in resumed.model.named_parameters():
        with deepspeed.zero.GatheredParameters([param, trained[name]]):
            same = same and torch.equal(param, trained[name])
    return same and resumed.task_names == learner.task_names


def main(output_dir: str) -> None:
    torch.set_num_threads(1)
    if FSDP:
        allow_fsdp_on_cpu()
    if DEEPSPEED:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU (gloo), before the Trainer's DeepSpeed engine
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    model = clone_model(make_pair("bert_cls")[0])
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    learner = ContinualGrafter(model, heads=["classifier"])
    regions = [body_region(model, 0.1, seed=seed) for seed in range(2)]  # drawn on the whole model
    for seed, name in enumerate(("first", "second")):
        args = fast_args(
            Path(output_dir), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=4 // world_size,
            learning_rate=0.05, weight_decay=0.1, max_grad_norm=0.5, **sharding(first_task=seed == 0),
        )  # fmt: skip
        with learner.task(name, regions[seed]) as allowed:
            callback = RestrictTrainingCallback(allowed=allowed)
            data = cls_dataset(n=16, seed=seed)
            Trainer(model=learner.model, args=args, train_dataset=data, callbacks=[callback]).train()
    sharded = any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") for p in model.parameters())
    try:
        learner.to_peft_model()
        whole = "built"
    except ValueError as error:
        refused = "which FSDP2 shards" in str(error) or "which DeepSpeed ZeRO-3 partitions" in str(error)
        whole = "refused" if refused else str(error)
    if rank == 0:
        learner.save_pretrained(os.path.join(output_dir, "learner"))
    report = f"sharded={sharded} tasks={','.join(learner.task_names)} to_peft_model={whole}"
    if DEEPSPEED:
        report += f" resumed_partitioned={resumes_partitioned(learner, os.path.join(output_dir, 'learner'))}"
    with open(os.path.join(output_dir, f"rank{rank}.txt"), "w") as handle:
        handle.write(report)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
