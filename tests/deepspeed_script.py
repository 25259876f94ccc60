"""Run by tests/test_deepspeed.py under torchrun (2 CPU processes, gloo, DeepSpeed's CPU accelerator): a graft
created or loaded on a model ZeRO-3 partitioned (loaded under ``zero.Init``) saves the graft one process saves from
the whole model; ContinualGrafter and RestrictTrainingCallback run under ZeRO-3; every entry point peft_graft does not
support under DeepSpeed refuses it at once with a ``ValueError`` naming the way out, and changes nothing.

Usage: torchrun --nproc_per_node 2 tests/deepspeed_script.py (in an empty folder). Writes rank<N>.txt: one line per
entry point, ``<entry point> refused: <message>`` (or ``... ran``), and ``<check>: <result>`` lines.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
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
    restrict_training,
)
from peft_graft.merging import merge_grafts
from peft_graft.sharding import write_entries

WEIGHTS = "adapter_model.safetensors"

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


def same_save(first: str, second: str) -> bool:
    """Whether two graft folders hold the same tensors, bit for bit, and the same config (but the base model's name:
    the models compared are built in memory or loaded from a folder)."""
    a, b = load_file(os.path.join(first, WEIGHTS)), load_file(os.path.join(second, WEIGHTS))
    configs = [json.loads(Path(folder, "adapter_config.json").read_text()) for folder in (first, second)]
    for config in configs:
        config.pop("base_model_name_or_path", None)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and configs[0] == configs[1]


def custom_loop_keeps(model: torch.nn.Module, region: Region, ids: torch.Tensor) -> bool:
    """A custom loop under ZeRO-3 (``deepspeed.initialize``, ``engine.backward``, ``engine.step()``; AdamW with weight
    decay, clipping, 2 steps of 2 micro-batches) restricted by ``restrict_training`` created after the engine: entries
    outside ``region`` bit-identical, some inside it moved (parameters gathered whole); a second restriction of the
    engine at the same time is refused."""
    before = {name: param.detach().clone().reshape(-1) for name, param in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    with restrict_training(engine.module, allowed=region):
        try:
            restrict_training(engine.module, frozen=region)
            return False
        except ValueError as error:
            if "another restriction already restricts this DeepSpeed engine's step" not in str(error):
                raise
        for micro in range(4):
            batch = ids[2 * micro : 2 * micro + 2]
            engine.backward(engine(input_ids=batch, labels=batch[:, 0] % 2).loss)
            engine.step()
    kept, moved = True, 0
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            changed = (param.detach().reshape(-1) != before[name]).nonzero().reshape(-1)
        kept = kept and bool(torch.isin(changed, region.get(name, torch.tensor([], dtype=torch.long))).all())
        moved += changed.numel()
    return kept and moved > 0


def write_after_engine_stopped(model: torch.nn.Module, region: Region) -> bool:
    """Entries written into the partitions after ``deepspeed.initialize`` (as a ContinualGrafter's start_task writes
    a head), which the engine's next step would overwrite from its fp32 copies: ``restrict_training`` is refused,
    naming the parameter, and the engine's step is left unrestricted."""
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    write_entries(dict(model.named_parameters())["classifier.dense.weight"], torch.arange(3), torch.full((3,), 7.0))
    try:
        restrict_training(engine.module, allowed=region)
    except ValueError as error:
        expected = "parameter 'classifier.dense.weight' was written since DeepSpeed built its engine"
        return expected in str(error) and not getattr(engine.optimizer, "_graft_restricted", False)
    return False


def offloaded_refusal(model: torch.nn.Module, region: Region) -> str:
    """The refusal of ``restrict_training`` on a ZeRO-3 engine with ``offload_optimizer`` (fp32 copies kept apart)."""
    config = {"train_micro_batch_size_per_gpu": 2, "zero_force_ds_cpu_optimizer": False}
    config["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    try:
        restrict_training(engine.module, allowed=region)
    except ValueError as error:
        return str(error)
    return "ran"


def main() -> None:
    torch.set_num_threads(1)
    pre, finetuned, task_type = make_pair("roberta_cls")
    if int(os.environ["RANK"]) == 0:
        pre.save_pretrained("pre")
        graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
        graft.save_pretrained("graft")
        PeftModel.from_pretrained(clone_model(pre), "graft").save_pretrained("graft_loaded")  # one process, whole
    deepspeed.init_distributed(dist_backend="gloo")  # on CPU, TrainingArguments leaves deepspeed.comm to zero.Init
    dist.barrier()
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, deepspeed=ZERO3, **COMMON)
    ids = torch.randint(3, VOCAB, (8, 9), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": [0, 1] * 4})
    lines = []

    # A model loaded after TrainingArguments(deepspeed=<ZeRO-3>) is partitioned by zero.Init as it loads.
    partitioned = RobertaForSequenceClassification.from_pretrained("pre")
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in partitioned.parameters())
    attempt(lines, "ContinualGrafter", lambda: ContinualGrafter(partitioned, heads=["classifier"]))  # gathers
    lines.append(f"untouched: {not any('graft_' in name for name, _ in partitioned.named_parameters())}")
    # Created and loaded (every process) on a partitioned model: saves what one process saves from the whole model.
    created = get_peft_model(partitioned, GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    still = all(hasattr(p, "ds_id") and p.numel() == 0 for n, p in created.named_parameters() if "base_layer" in n)
    if dist.get_rank() == 0:
        created.save_pretrained("created")
    loaded = PeftModel.from_pretrained(RobertaForSequenceClassification.from_pretrained("pre"), "graft")
    if dist.get_rank() == 0:
        loaded.save_pretrained("loaded")
    dist.barrier()
    lines.append(f"base still partitioned: {still}")
    lines.append(f"created saves bit-exact: {same_save('created', 'graft')}")
    lines.append(f"loaded saves bit-exact: {same_save('loaded', 'graft_loaded')}")
    graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    deepspeed.zero.Init(module=graft, config_dict_or_path=deepspeed_config())  # partitions a graft made whole
    attempt(lines, "merge_and_unload", graft.merge_and_unload)
    attempt(lines, "merge_grafts", lambda: merge_grafts(graft, ["default"], "task_arithmetic"))

    # A graft created on a whole model, then trained by a DeepSpeed Trainer.
    whole = clone_model(pre)
    mask_config = GraftConfig(finetuned=finetuned, region="empty", learn_region=True, task_type=task_type)
    learning = get_peft_model(whole, mask_config)
    mask_args = MaskTrainingArguments(
        output_dir="mask", per_device_train_batch_size=4, deepspeed=ZERO3, l1_penalty=1e-3, **COMMON
    )
    attempt(lines, "MaskTrainer (l1_penalty)", lambda: MaskTrainer(model=learning, args=mask_args, train_dataset=data))
    AcceleratorState._reset_state()  # accelerate allows one DeepSpeed Accelerator per process: start afresh
    best = dict(COMMON, save_strategy="steps", eval_strategy="steps", load_best_model_at_end=True)
    mask_args = MaskTrainingArguments(output_dir="mask", per_device_train_batch_size=4, deepspeed=ZERO3, **best)
    sets = dict(train_dataset=data, eval_dataset=data)
    attempt(lines, "MaskTrainer (load_best_model_at_end)", lambda: MaskTrainer(model=learning, args=mask_args, **sets))
    AcceleratorState._reset_state()
    mask_args = MaskTrainingArguments(output_dir="mask", per_device_train_batch_size=4, deepspeed=ZERO3, **COMMON)
    trainer = MaskTrainer(model=learning, args=mask_args, train_dataset=data)
    attempt(lines, "MaskTrainer (resuming)", lambda: trainer.train(resume_from_checkpoint="mask/checkpoint-1"))
    AcceleratorState._reset_state()
    pre_mlm, finetuned_mlm, mlm_task = make_pair("roberta_mlm")  # lm_head.decoder tied to the word embeddings
    mlm_config = GraftConfig(finetuned=finetuned_mlm, region="empty", learn_region=True, task_type=mlm_task)
    tied = get_peft_model(clone_model(pre_mlm), mlm_config)
    attempt(lines, "MaskTrainer (tied weights)", lambda: MaskTrainer(model=tied, args=mask_args, train_dataset=data))
    AcceleratorState._reset_state()
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
    lines.append(f"custom loop restricted: {custom_loop_keeps(clone_model(pre), region, ids)}")
    lines.append(f"RestrictTrainingCallback (offload_optimizer) refused: {offloaded_refusal(clone_model(pre), region)}")
    stopped = write_after_engine_stopped(clone_model(pre), region)
    lines.append(f"custom loop writing after deepspeed.initialize stopped: {stopped}")
    AcceleratorState._reset_state()
    zero2 = {**ZERO3, "zero_optimization": {"stage": 2}}  # nothing partitioned: refused as DeepSpeed runs
    args = TrainingArguments(output_dir="out2", per_device_train_batch_size=4, deepspeed=zero2, **COMMON)
    callback = RestrictTrainingCallback(allowed=region)
    restricted = Trainer(model=clone_model(pre), args=args, train_dataset=data, callbacks=[callback])
    attempt(lines, "RestrictTrainingCallback (ZeRO-2)", restricted.train)
    AcceleratorState._reset_state()
    mask_args = MaskTrainingArguments(output_dir="mask2", per_device_train_batch_size=4, deepspeed=zero2, **COMMON)
    mask_config = GraftConfig(finetuned=finetuned, region="empty", learn_region=True, task_type=task_type)
    learning = get_peft_model(clone_model(pre), mask_config)
    attempt(lines, "MaskTrainer (ZeRO-2)", lambda: MaskTrainer(model=learning, args=mask_args, train_dataset=data))
    attempt(lines, "ContinualGrafter (ZeRO-2)", lambda: ContinualGrafter(clone_model(pre), heads=["classifier"]))
    with open(f"rank{dist.get_rank()}.txt", "w") as handle:
        handle.write("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
