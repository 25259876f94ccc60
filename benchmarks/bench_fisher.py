"""Cost of ``peft_graft.scores.fisher_diagonal`` against a plain forward and backward pass of one example.

Time: the median time per example of the empirical Fisher, of the model Fisher (exact expectation over the classes:
one backward pass per class) and of ``model(**example).loss.backward()``, all in one process after a warm-up, in
``--repeats`` rounds in an order rotated each round, with each variant's paired ratio to the plain pass of the same
round (median and quartiles).
Memory: each variant in its own process (``--memory VARIANT``): the peak RSS while it runs, beside the plain pass's.
The Fisher should cost one fp32 accumulator per parameter (4 bytes) on top of the plain pass, whatever N is.

    python benchmarks/bench_fisher.py --model all-MiniLM-L6-v2      # 22.7M parameters, sequences of 64 tokens
    python benchmarks/bench_fisher.py --model roberta-base-random   # 125M random classifier, sequences of 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from bench_models import MODELS, batch_for, load_pretrained
from bench_timing import paired_text, reset_peak, rounds, rss_gb, self_timed

from peft_graft.scores import fisher_diagonal

VARIANTS = ("plain", "empirical", "model")


def examples(model: torch.nn.Module, name: str, n: int) -> list[dict]:
    batch = batch_for(model, name)
    rows = [{k: v[i % v.shape[0]].tolist() for k, v in batch.items()} for i in range(n)]
    return [dict(row, labels=i % 2) for i, row in enumerate(rows)]


def run(model: torch.nn.Module, variant: str, data: list[dict]) -> float:
    """Seconds per example."""
    start = time.perf_counter()
    if variant == "plain":
        for row in data:
            inputs = {k: torch.tensor([v]) for k, v in row.items()}
            model(**inputs).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        fisher_diagonal(model, data, variant=variant, show_progress=False)
    return (time.perf_counter() - start) / len(data)


def memory(name: str, variant: str, n: int) -> dict:
    model = load_pretrained(name)
    data = examples(model, name, n)
    run(model, variant, data[:1])
    reset_peak()
    run(model, variant, data)
    return {"peak_gb": rss_gb("VmHWM")}


def time_all(name: str, n: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per example of each variant (``"plain"`` the baseline), ``repeats`` rotated rounds after a warm-up."""
    model = load_pretrained(name)
    data = examples(model, name, n)
    variants = {variant: lambda v=variant: run(model, v, data) for variant in VARIANTS[1:]}
    times = rounds(variants, lambda: run(model, "plain", data), repeats, timer=self_timed)
    return {"plain" if k == "base" else k: v for k, v in times.items()}


def memory_in_processes(name: str, n: int) -> dict[str, dict]:
    """:func:`memory` of each variant, each in its own process."""
    peaks = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--model", name, "--memory", variant, "--examples", str(n)]
        peaks[variant] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="all-MiniLM-L6-v2")
    parser.add_argument("--examples", type=int, default=16, help="Examples per timed run.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", choices=VARIANTS, help="Measure one variant's memory (run by the parent).")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.memory:
        print(json.dumps(memory(args.model, args.memory, args.examples)))
        return
    times = time_all(args.model, args.examples, args.repeats)
    model = load_pretrained(args.model)
    params = sum(p.numel() for p in model.parameters())
    peaks = memory_in_processes(args.model, 4)
    length = MODELS[args.model].batch[1]
    print(f"{args.model}, {params / 1e6:.1f}M parameters, 2 classes, {length} tokens per example")
    print("| variant | time per example (median) | vs plain, paired (quartiles) | peak RSS | extra vs plain |")
    print("| --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        extra = (peaks[variant]["peak_gb"] - peaks["plain"]["peak_gb"]) * 1024**3 / params
        ratio = paired_text(times[variant], times["plain"])
        print(f"| {variant} | {median * 1000:.0f} ms | {ratio} | {peaks[variant]['peak_gb']:.2f} GB | "
              f"{extra:+.2f} B/param |")  # fmt: skip


if __name__ == "__main__":
    main()
