"""Run by tests/test_restriction.py under torchrun (2 CPU processes, gloo), or in 1 process: a Trainer run with AdamW,
weight decay and clipping, restricted to stay out of a region; each process writes the final parameters (gathered
whole under FSDP2) and the frozen entries' check.

``FSDP=1``: under torchrun, the Trainer shards the model with FSDP2 (``fsdp_config``, one unit per BertLayer).
``DEEPSPEED=1``: under torchrun, the Trainer partitions the model with DeepSpeed ZeRO-3 (its ``deepspeed`` argument,
the Trainer's optimizer, DeepSpeed's gradient clipping; every tensor partitioned); with ``BF16=1`` too, in bf16 mixed
precision; with ``SUB_GROUPS=1`` too, DeepSpeed steps the partitions in several sub-groups (a small
``sub_group_size``), and each process writes OUTPUT_DIR/sub_groups<r>.txt (their number).
``ALLOWED=1``: also restrict training to a sparse allowed region (whole for the LayerNorms and the classifier), so that
both the copying path and the sparse path (weight decay by hand) run, and one tensor frozen whole.
"""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
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

from peft_graft import Region, RestrictTrainingCallback

SHARDING = (
    dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]})
    if os.environ.get("FSDP") == "1" and int(os.environ.get("WORLD_SIZE", "1")) > 1
    else {}
)


DEEPSPEED = os.environ.get("DEEPSPEED") in ("1", "accelerate") and int(os.environ.get("WORLD_SIZE", "1")) > 1
if DEEPSPEED:  # "accelerate": from an accelerate config file (accelerate launch), not the Trainer's argument
    SHARDING = {"deepspeed": ZERO3} if os.environ["DEEPSPEED"] == "1" else {}
    if os.environ.get("BF16") == "1":  # DeepSpeed's bf16 mixed precision: bf16 partitions, fp32 copies stepped
        SHARDING = {"deepspeed": {**ZERO3, "bf16": {"enabled": "auto"}}, "bf16": True}
    if os.environ.get("SUB_GROUPS") == "1":  # one optimizer step per sub-group of at least 2,000 partition entries
        SHARDING = {"deepspeed": {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "sub_group_size": 2000}}}


def whole(param: torch.Tensor) -> torch.Tensor:
    if hasattr(param, "ds_id"):  # partitioned by ZeRO-3: gathered
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone().reshape(-1)
    return (param.full_tensor() if type(param).__name__ == "DTensor" else param).detach().clone().reshape(-1)


def main(output_dir: str) -> None:
    torch.set_num_threads(1)
    if DEEPSPEED:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # on CPU (gloo), before the Trainer's DeepSpeed engine
    elif SHARDING:
        allow_fsdp_on_cpu()
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    for module in model.modules():  # no dropout: 1 and 2 processes then take the same steps
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    frozen = sparse_region(model, 0.05, seed=3)
    allowed = None
    if os.environ.get("ALLOWED") == "1":
        allowed = sparse_region(model, 0.1, seed=5)
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "classifier" in name:
                allowed = Region({**allowed, name: torch.arange(param.numel())})
        allowed = Region({n: i for n, i in allowed.items() if n != "bert.pooler.dense.bias"})  # frozen whole
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # a global batch of 8 examples per step on 1 or 2 processes
    dtype = torch.bfloat16 if SHARDING.get("bf16") else torch.float32  # DeepSpeed casts the model to bf16
    before = {n: p.detach().reshape(-1).to(dtype, copy=True) for n, p in model.named_parameters()}
    args = fast_args(
        Path(output_dir),
        max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=4 // world_size, learning_rate=0.05,
        weight_decay=0.1, max_grad_norm=0.5, **SHARDING,
    )  # fmt: skip
    callback = RestrictTrainingCallback(allowed=allowed, frozen=frozen)
    trainer = Trainer(model=model, args=args, train_dataset=cls_dataset(n=24), callbacks=[callback])
    trainer.train()
    sharded = any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") for p in model.parameters())
    after = {n: whole(p) for n, p in model.named_parameters()}
    kept = all(torch.equal(before[n][frozen[n]], after[n][frozen[n]]) for n in before)
    if allowed is not None:
        outside = {n: torch.ones(before[n].numel(), dtype=torch.bool) for n in before}
        for n in allowed:
            outside[n][allowed[n]] = False
        kept = kept and all(torch.equal(before[n][outside[n]], after[n][outside[n]]) for n in before)
    moved = sum(int((before[n] != after[n]).sum()) for n in before)
    rank = int(os.environ.get("RANK", 0))
    if DEEPSPEED and os.environ.get("SUB_GROUPS") == "1":
        with open(os.path.join(output_dir, f"sub_groups{rank}.txt"), "w") as handle:
            handle.write(str(len(trainer.model_wrapped.optimizer.fp16_groups)))
    save_file(after, os.path.join(output_dir, f"params{rank}.safetensors"))
    with open(os.path.join(output_dir, f"rank{rank}.txt"), "w") as handle:
        handle.write(f"world_size={args.world_size} kept={kept} moved={moved} sharded={sharded}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
