"""Four tasks' grafts served in one mixed batch of their test examples, against the base model's forward.

The grafts ``examples/run_merge.py`` learned and saved (``--work_dir``, by default ``outputs/merge``: run it first) on
the packaged MiniLM, ``--kind learned`` the ``MaskTrainer`` 1% regions; the first mixed batch of each ``--sizes``
(the tasks in turn, as run_merge serves them), in the ``--mode`` mixed-batch mode. Each round times a base forward and
the mixed forward back to back (``bench_timing.rounds``); the figure is the median (and quartiles) of the paired
ratios.

    python benchmarks/bench_served_grafts.py                      # this checkout, 32 and 256 examples
    python benchmarks/bench_served_grafts.py --against 3d6c1bb    # this checkout beside a commit, fresh processes

Prints one JSON line: per size, the median ratio (and the base forward's median ms). With ``--against REV``, each of
``--processes`` rounds runs the measurement in a fresh process of this checkout's code and one of ``REV``'s,
alternating which goes first (``against.py``), and prints both ways' ratios per size.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from against import alternate
from bench_timing import paired_ratios, rounds

import peft_graft

EXAMPLES = Path(peft_graft.__file__).resolve().parent.parent / "examples"  # the code's own (with --against, REV's)


def base(model, batch: dict) -> None:
    """The pre-trained model's forward (adapters disabled)."""
    with model.disable_adapter():
        model(**batch)


def measure(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import example_utils
    import run_merge
    from three_tasks import Runner

    work = Path(args.work_dir)
    if not (work / "tasks").is_dir():
        raise ValueError(f"No saved grafts under {work / 'tasks'}: run `python examples/run_merge.py` first.")
    names = args.tasks or list(run_merge.TASKS)
    missing = [str(work / "tasks" / n / args.kind) for n in names if not (work / "tasks" / n / args.kind).is_dir()]
    if missing:
        kinds = sorted({p.name for p in (work / "tasks").glob("*/*") if p.is_dir()})
        raise ValueError(f"No saved graft {missing[0]}: --kind is one of {kinds}, --tasks of run_merge's --tasks.")
    settings = dict(run_merge.SMOKE if args.smoke else run_merge.FULL)  # as run_merge saved the data
    model_dir = args.model_name_or_path or run_merge.minilm_dir()
    tokenizer = example_utils.load_tokenizer(model_dir, "classification")
    tasks = run_merge.load_tasks(names, work, settings, args.seed, tokenizer)
    runner = Runner(model_dir, tokenizer, settings, work, args.seed)
    pre = run_merge.pretrained(model_dir, run_merge.MergeArguments.logit_scale)
    heads = [run_merge.task_head(pre, tokenizer, [run_merge.DESCRIPTIONS[n][c] for c in t.labels]) for n, t in
             tasks.items()]  # fmt: skip
    model = run_merge.load_grafts(pre, work, list(tasks), [args.kind])
    run_merge.set_head(model, torch.cat(heads))
    model.set_mixed_batch_mode(args.mode)
    order = run_merge.mixed_order(tasks)
    out = {}
    for size in args.sizes:
        adapters = {n: f"{n}_{args.kind}" for n in tasks}
        _, batch, served = next(run_merge.mixed_batches(runner, tasks, order, adapters, size))
        with torch.no_grad():
            mixed = functools.partial(model, **batch, adapter_names=served)
            times = rounds({"mixed": mixed}, functools.partial(base, model, batch), args.rounds)
        out[str(size)] = {**paired_ratios("ratio", times["mixed"], times["base"]),
                          "base_ms": 1e3 * statistics.median(times["base"]), "examples": len(served),
                          "tokens": batch["input_ids"].shape[1]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default="outputs/merge")
    parser.add_argument("--tasks", nargs="+", default=None, help="as given to run_merge.py (default: its four)")
    parser.add_argument("--kind", default="learned", help="the saved grafts: learned, learned_0p001, ls, full...")
    parser.add_argument("--mode", default="exact", choices=["exact", "sparse_delta"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model_name_or_path", default=None, help="as given to run_merge.py (default: MiniLM)")
    parser.add_argument("--smoke", action="store_true", help="grafts of `run_merge.py --smoke`")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=3, help="with --against: rounds of fresh processes")
    parser.add_argument("--against", default=None, help="a git revision whose code is timed beside this checkout's")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.rounds < 1 or args.processes < 1 or args.threads < 1:
        parser.error("--sizes, --rounds, --processes and --threads must be at least 1.")
    torch.set_num_threads(args.threads)
    if args.against:
        forwarded = ["--work_dir", str(Path(args.work_dir).resolve()), "--kind", args.kind, "--mode", args.mode,
                     "--sizes", *map(str, args.sizes), "--rounds", str(args.rounds), "--seed", str(args.seed),
                     "--threads", str(args.threads)] + (["--smoke"] if args.smoke else []) + (
                     ["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []) + (
                     ["--tasks", *args.tasks] if args.tasks else [])  # fmt: skip
        outputs = alternate("bench_served_grafts.py", forwarded, args.against, args.processes)
        out = {"against": args.against, **{way: [o["sizes"] for o in outs] for way, outs in outputs.items()}}
    else:
        out = {"sizes": measure(args), "kind": args.kind, "mode": args.mode}
    out.update(threads=args.threads, load=list(os.getloadavg()))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
