"""Creating a graft whose region is learned on a search space against creating the same graft by top-k.

    python benchmarks/bench_creation.py                  # llama-22m, -125m, -400m; 5 rounds each
    python benchmarks/bench_creation.py --quick          # llama-0.4m and -2m, 2 rounds: checks the script

Per model of bench_models' Llama family (theta_ft = theta_pre plus its structured perturbation, read from its cache as
a path, as a user's fine-tuned checkpoint is), ``get_peft_model`` on a fresh copy of theta_pre with

- top-k: ``GraftConfig(finetuned=PATH, sparsity=SPARSITY)``, the hard region of the largest movements;
- learnable: the same with ``learn_region=True, search_fraction=SEARCH_FRACTION``: the same ``gamma_base``, the
  search space of the top ``SEARCH_FRACTION`` movements and the scores S on it.

One warm-up creation of each (which checks that the learnable graft's ``gamma_base`` is the top-k graft's region),
then ``--rounds`` rounds of one creation of each back to back, the order alternating between rounds, in this one
process (the copy of theta_pre each creation starts from is made before its clock starts). Printed per model: the
median time of each and the median (quartiles) of the per-round ratio learnable / top-k, which the machine's load
drifting over a run does not move as it moves a ratio of medians. ``--json`` writes every time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_models import DEFAULT_CACHE, check_pretrained, load_pretrained, prepare_finetuned  # noqa: E402
from bench_timing import paired_ratios  # noqa: E402
from peft import get_peft_model  # noqa: E402

from peft_graft import GraftConfig, Region  # noqa: E402

SIZES = ["llama-22m", "llama-125m", "llama-400m"]
QUICK_SIZES = ["llama-0.4m", "llama-2m"]
SPARSITY = 1e-4
SEARCH_FRACTION = 0.01
VARIANTS = {
    "topk": {},
    "learnable": {"learn_region": True, "search_fraction": SEARCH_FRACTION},
}


def create_once(pre: torch.nn.Module, finetuned: str, variant: str) -> tuple[float, Region]:
    """Seconds of one ``get_peft_model`` of ``variant`` on a fresh copy of ``pre`` (the copy is not timed), and the
    graft's region (``gamma_base`` for the learnable one: S starts there)."""
    base = copy.deepcopy(pre)
    gc.collect()
    config = GraftConfig(finetuned=finetuned, sparsity=SPARSITY, task_type="CAUSAL_LM", **VARIANTS[variant])
    start = time.perf_counter()
    model = get_peft_model(base, config)
    elapsed = time.perf_counter() - start
    region = model.get_region()
    del model, base
    gc.collect()
    return elapsed, region


def measure(name: str, rounds: int, cache: str) -> dict:
    """Alternating rounds of both creations on model ``name``; their times and the paired ratios."""
    finetuned = prepare_finetuned(name, "float32", cache)
    pre = load_pretrained(name)
    check_pretrained(pre, finetuned)
    parameters = sum(p.numel() for p in pre.parameters())
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    # Warm-up (first-call costs: imports, regex caches, the page cache of theta_ft), and the check that both are the
    # same graft: the learnable one's gamma_base is the top-k region.
    regions = {variant: create_once(pre, str(finetuned), variant)[1] for variant in VARIANTS}
    if regions["learnable"] != regions["topk"]:
        raise RuntimeError(f"{name}: the learnable graft's gamma_base is not the top-k graft's region.")
    for round_ in range(rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            times[variant].append(create_once(pre, str(finetuned), variant)[0])
        print(f"{name} round {round_ + 1}/{rounds}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in VARIANTS))
    return {
        "model": name,
        "parameters": parameters,
        "times_s": times,
        **{f"{variant}_median_s": statistics.median(times[variant]) for variant in VARIANTS},
        **paired_ratios("learnable_over_topk", times["learnable"], times["topk"]),
    }


def markdown(rows: list[dict]) -> list[str]:
    lines = [
        f"| model | parameters | top-k creation | learnable creation (search_fraction={SEARCH_FRACTION}) | "
        "learnable / top-k (quartiles) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        low, high = r["learnable_over_topk_quartiles"]
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['topk_median_s']:.2f} s | "
            f"{r['learnable_median_s']:.2f} s | {r['learnable_over_topk']:.2f}x ({low:.2f}-{high:.2f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", help=f"models (default {' '.join(SIZES)})")
    parser.add_argument("--rounds", type=int, help="timed rounds per model (default 5; --quick: 2)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="folder of the Llama models' theta_ft checkpoints")
    parser.add_argument("--json", help="write every time and ratio to this file")
    parser.add_argument("--quick", action="store_true", help=f"tiny models ({' '.join(QUICK_SIZES)}), 2 rounds")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 2:
        parser.error("--rounds must be at least 2 (the quartiles of the ratios need two pairs).")
    hf_logging.set_verbosity_error()
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    rows = [measure(name, rounds, args.cache) for name in sizes]
    print(f"\ntorch threads {torch.get_num_threads()}, load average {os.getloadavg()}\n")
    print("\n".join(markdown(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
