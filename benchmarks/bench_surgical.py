"""Step time of surgical fine-tuning (only some transformer blocks train) against full fine-tuning.

The set-up of ``examples/run_finetune.py``: frozen embeddings, SGD, the new classification head trained; a batch of
8 sequences of 64 tokens. Each variant trains the head plus the named blocks, through ``freeze_outside`` (backward
stops below the lowest trained block) and ``restrict_training`` (the guarantee that nothing else changes), as
``run_finetune.py --surgical_layers`` does. All variants in one process after a warm-up, ``--repeats`` rounds of one
step each in an order rotated each round; each variant's median step and its paired ratio to the full step of the same
round (median and quartiles).

    python benchmarks/bench_surgical.py --model all-MiniLM-L6-v2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_models import MODELS, load_pretrained, training_step
from bench_timing import paired_text, rounds, self_timed

from peft_graft import restrict_training
from peft_graft.training import freeze_outside, layer_region

VARIANTS = {"full": None, "top 1": [5], "top 2": [4, 5], "top 3": [3, 4, 5], "bottom 1": [0], "bottom 3": [0, 1, 2]}


def setup(name: str, blocks: list[int] | None):
    model = load_pretrained(name).train()
    for param in model.get_input_embeddings().parameters():
        param.requires_grad_(False)
    for module_name, module in model.named_modules():
        if module_name.endswith("embeddings"):
            module.requires_grad_(False)
    restriction = None
    if blocks is not None:
        region = layer_region(model, blocks, also=r"^classifier\.")
        freeze_outside(model, region)
        restriction = restrict_training(model, allowed=region)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-2, weight_decay=1e-4)
    return model, optimizer, restriction, sum(p.numel() for p in trainable)


def time_all(name: str, repeats: int, shape: tuple[int, int] = (8, 64)) -> tuple[dict[str, list[float]], dict]:
    """Seconds of one step of each variant (``"full"`` the baseline), ``repeats`` rotated rounds after a warm-up; and
    the runs (model, optimizer, restriction, trainable parameters) by variant."""
    torch.manual_seed(0)
    runs = {variant: setup(name, blocks) for variant, blocks in VARIANTS.items()}
    model = runs["full"][0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, shape, generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, shape[:1])}
    variants = {variant: lambda v=variant: training_step(*runs[v][:3], batch) for variant in list(VARIANTS)[1:]}
    times = rounds(variants, lambda: training_step(*runs["full"][:3], batch), repeats, timer=self_timed)
    return {"full" if k == "base" else k: v for k, v in times.items()}, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="all-MiniLM-L6-v2")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times, runs = time_all(args.model, args.repeats)
    print(f"{args.model}, batch 8 x 64, SGD, frozen embeddings; median of {args.repeats} steps")
    print("| variant | blocks | trainable parameters | step (median) | vs full, paired (quartiles) |")
    print("| --- | --- | --- | --- | --- |")
    for variant, blocks in VARIANTS.items():
        median = statistics.median(times[variant])
        trainable = runs[variant][3]
        ratio = paired_text(times[variant], times["full"])
        print(f"| {variant} | {blocks or 'all'} | {trainable:,} | {median * 1000:.0f} ms | {ratio} |")


if __name__ == "__main__":
    main()
