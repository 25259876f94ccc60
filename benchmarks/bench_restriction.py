"""Cost of a region-restricted training step (``peft_graft.restrict_training``) against a plain AdamW step.

Variants: ``plain``; ``frozen`` (never change a random region of ``--fraction`` of every tensor: continual learning);
``allowed`` (change only such a region: graft re-training). Time: all variants in one process after a warm-up,
``--repeats`` rounds of one step each, in an order rotated each round; each variant's median step and its paired ratio
to the plain step of the same round (median and quartiles). Memory: each variant in its own process (``--memory
VARIANT``), the peak RSS of the training steps beside the plain step's.

    python benchmarks/bench_restriction.py --model all-MiniLM-L6-v2      # batch 32 x 64
    python benchmarks/bench_restriction.py --model roberta-base-random   # 125M random classifier, batch 4 x 32

``--fused``: ``AdamW(fused=True)``, the optimizer a ``Trainer`` builds by default (``optim="adamw_torch_fused"``),
where the plain ``torch.optim.AdamW`` of a custom loop runs one kernel per operation and tensor on a CPU: there its
``sqrt`` (MKL) takes about 5x as long on zeros, and a sparse ``allowed`` region keeps nearly all of AdamW's state at
zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
from bench_models import MODELS, batch_for, load_pretrained, training_step
from bench_timing import paired_text, reset_peak, rounds, rss_gb, self_timed

from peft_graft import Region, restrict_training

VARIANTS = ("plain", "frozen", "allowed")


def region(model: torch.nn.Module, fraction: float) -> Region:
    generator = torch.Generator().manual_seed(0)
    return Region(
        {
            name: torch.randperm(p.numel(), generator=generator)[: max(1, round(fraction * p.numel()))]
            for name, p in model.named_parameters()
        }
    )


def setup(name: str, variant: str, fraction: float, fused: bool = False):
    model = load_pretrained(name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=fused)
    kwargs = {} if variant == "plain" else {variant: region(model, fraction)}
    restriction = restrict_training(model, **kwargs) if kwargs else None
    return model, optimizer, restriction


def time_all(name: str, repeats: int, fraction: float, fused: bool) -> dict[str, list[float]]:
    """Seconds of one step of each variant (``"plain"`` the baseline), ``repeats`` rotated rounds after a warm-up (which
    also makes the optimizer state)."""
    runs = {variant: setup(name, variant, fraction, fused) for variant in VARIANTS}
    batch = batch_for(runs["plain"][0], name)
    variants = {variant: lambda v=variant: training_step(*runs[v], batch) for variant in VARIANTS[1:]}
    times = rounds(variants, lambda: training_step(*runs["plain"], batch), repeats, timer=self_timed)
    return {"plain" if k == "base" else k: v for k, v in times.items()}


def memory(name: str, variant: str, fraction: float, steps: int, fused: bool) -> dict:
    run = setup(name, variant, fraction, fused)
    batch = batch_for(run[0], name)
    training_step(*run, batch)
    reset_peak()
    for _ in range(steps):
        training_step(*run, batch)
    restriction = run[2]
    return {"peak_gb": rss_gb("VmHWM"), "mask_bytes": restriction.extra_bytes if restriction else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="all-MiniLM-L6-v2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fraction", type=float, default=1e-3)
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True), a Trainer's default optimizer.")
    parser.add_argument("--memory", choices=VARIANTS, help="Measure one variant's memory (run by the parent).")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.memory:
        print(json.dumps(memory(args.model, args.memory, args.fraction, steps=3, fused=args.fused)))
        return
    times = time_all(args.model, args.repeats, args.fraction, args.fused)
    params = sum(p.numel() for p in load_pretrained(args.model).parameters())
    optimizer = "AdamW(fused=True)" if args.fused else "AdamW"
    print(f"{args.model}, region {args.fraction:g} of every tensor, {params / 1e6:.1f}M parameters, {optimizer}")
    print("| variant | step (median) | vs plain, paired (quartiles) | peak RSS | extra vs plain | "
          "mask bytes / parameter |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    peaks = {}
    for variant in VARIANTS:
        command = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--memory",
            variant,
            "--fraction",
            str(args.fraction),
            *(["--fused"] if args.fused else []),
        ]
        peaks[variant] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    for variant in VARIANTS:
        median, peak = statistics.median(times[variant]), peaks[variant]
        extra = (peak["peak_gb"] - peaks["plain"]["peak_gb"]) * 1024**3 / params
        ratio = paired_text(times[variant], times["plain"])
        print(
            f"| {variant} | {median * 1000:.0f} ms | {ratio} | {peak['peak_gb']:.2f} GB | "
            f"{extra:+.2f} B/param | {peak['mask_bytes'] / params:.2f} |"
        )


if __name__ == "__main__":
    main()
