"""Run by tests/test_fsdp.py under torchrun (2 CPU processes, gloo): a graft model sharded by FSDP v1 or FSDP2."""

import sys

import torch
import torch.distributed as dist
from peft import get_peft_model
from testing_utils import clone_model, exit_rank, input_ids, make_pair

import peft_graft  # noqa: F401  (registers the graft method)
from peft_graft import GraftConfig
from peft_graft.merging import merge_grafts


def attempt(lines: list[str], what: str, action) -> None:
    """Run ``action``; a line saying its result or the ``ValueError`` it raised."""
    try:
        lines.append(f"{what}: {action()}")
    except ValueError as error:
        lines.append(f"{what} refused: {error}")


def main(kind: str) -> None:
    dist.init_process_group("gloo")
    lines = []
    pre, finetuned, task_type = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type)
    model = get_peft_model(clone_model(pre), config).eval()
    with torch.no_grad():
        expected = model(input_ids=input_ids()).logits
    if kind == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import fully_shard

        # A second graft, saved and loaded before sharding (as docs/fsdp.md says to): its forward is exact under FSDP2.
        other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.1, task_type=task_type))
        with torch.no_grad():
            expected_other = other.eval()(input_ids=input_ids()).logits
        if dist.get_rank() == 0:
            other.save_pretrained("other")
            model.save_pretrained("before")  # the graft saved whole, to compare with its save under FSDP2
        dist.barrier()
        model.load_adapter("other", "other")
        for layer in model.base_model.model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids()).logits
        lines.append(f"forward exact: {torch.equal(logits, expected)}")
    except ValueError as error:
        lines.append(f"forward refused: {error}")
    try:
        (model.module if kind == "fsdp1" else model).merge_adapter()
        lines.append("merged")
    except ValueError as error:
        lines.append(f"merge refused: {error}")
    if kind == "fsdp2":  # what needs the graft whole is refused clearly, and changes nothing
        attempt(lines, "save", lambda: model.save_pretrained(f"saved{dist.get_rank()}"))
        # The way out the refusal names, on the graft alone: its state gathered on every process, saved from rank 0.
        alone = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
        for layer in alone.base_model.model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(alone)
        state = get_model_state_dict(alone, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            alone.save_pretrained("gathered", state_dict=state)
        attempt(lines, "load", lambda: model.load_adapter("other", "third"))
        attempt(lines, "merge_grafts", lambda: merge_grafts(model, ["default", "other"], "task_arithmetic"))
        lines.append(f"adapters: {sorted(model.peft_config)}")
        model.set_adapter("other")
        with torch.no_grad():
            logits = model(input_ids=input_ids()).logits
        lines.append(f"loaded before sharding, forward exact: {torch.equal(logits, expected_other)}")
    with open(f"rank{dist.get_rank()}.txt", "w") as handle:  # one file per process: printed lines interleave
        handle.write("\n".join(lines))
    dist.barrier()  # no rank tears gloo down while the other still runs: that aborted a rank now and then
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_rank()
