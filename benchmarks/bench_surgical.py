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
from bench_models import MODELS, load_pretrained, paired_text, rotated
from bench_restriction import step

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="all-MiniLM-L6-v2")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    runs = {variant: setup(args.model, blocks) for variant, blocks in VARIANTS.items()}
    model = runs["full"][0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (8, 64), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (8,))}
    times = {variant: [] for variant in runs}
    for model, optimizer, restriction, _ in runs.values():
        step(model, optimizer, restriction, batch)  # warm-up
    for repeat in range(args.repeats):
        for variant in rotated(list(runs), repeat):
            model, optimizer, restriction, _ = runs[variant]
            times[variant].append(step(model, optimizer, restriction, batch))
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
