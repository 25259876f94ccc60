#!/usr/bin/env python
"""Merge three fine-tunes of one model by stitching their grafts, against task arithmetic, TIES and DARE, offline.

The tasks and fine-tunes are ``run_continual.py``'s, from ``three_tasks.py`` (movie-review sentiment MR, TREC question
type, SMS spam, each fine-tuned on its own from all-MiniLM-L6-v2: SGD, lr 5e-2, batch 8, 200 steps, frozen embeddings,
one 6-way head shape with the same seeded initial head; a 2-class task reads its first two logits). Per task, two grafts
are saved in ``--work_dir`` (and reused by a second run): the *full* graft (every entry fine-tuning moved: the task
vector ``tau = theta_ft - theta_pre``) and the *learned* graft (``MaskTrainer``, ``--fraction`` of the parameters,
selected on the dev set), both with the task's head stored whole.

Every rule of :func:`peft_graft.merging.merge_grafts` then builds one merged body, evaluated with each task's own head
(accuracy, ECE on the test sets; normalized accuracy = merged / individual fine-tune):

* ``stitch`` (Localize-and-Stitch): the learned regions, overlaps averaged;
* ``stitch_dataless``: each task's top ``--fraction`` of ``|tau|``, overlaps averaged;
* ``task_arithmetic``, ``ties``, ``dare_ties``, ``dare_linear`` on the full task vectors, their scaling ``lambda``
  and density chosen on the dev sets (mean dev accuracy) over a grid that is reported whole; never on test.

Then the interference view of the stitched model: where the regions overlap (``overlap_matrix``) and what the
overlapping entries cost each task (test accuracy with and without them; relative gain, Eq. 5).

Writes ``summary.md``, ``results.json`` and ``merge_accuracy_vs_size.png`` to ``--report_dir``.

    python examples/run_merge.py                     # about 30 minutes on 2 CPU cores (24 of them cached after)
    python examples/run_merge.py --smoke             # a few steps of everything
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import example_utils as U
import torch
from peft import PeftModel, get_peft_model
from real_tasks import ASSETS, ensure_assets, minilm_dir
from three_tasks import DEFAULT, SMOKE, Runner, Task, load_tasks
from transformers import HfArgumentParser

from peft_graft import GraftConfig, Region
from peft_graft.analysis import overlap_matrix, plot_region_matrix, relative_gain
from peft_graft.calibration import save_figure
from peft_graft.merging import merge_grafts

logger = logging.getLogger("run_merge")


@dataclass
class MergeArguments:
    """What to merge and how to grid the global methods."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The pre-trained model (default: the packaged all-MiniLM-L6-v2)."}
    )
    fraction: float = field(
        default=1e-2,
        metadata={"help": "Size of the learned regions and of stitch_dataless's top-k, a fraction of all parameters."},
    )
    lambdas: list[float] = field(
        default_factory=lambda: [0.3, 0.5, 0.7, 1.0, 1.5], metadata={"help": "Grid of the global methods' scaling."}
    )
    densities: list[float] = field(
        default_factory=lambda: [0.1, 0.2, 0.5], metadata={"help": "Grid of TIES/DARE's density (fraction kept)."}
    )
    ft_steps: int | None = field(default=None, metadata={"help": "Fine-tuning steps (default: run_continual's 200)."})
    mask_steps: int | None = field(default=None, metadata={"help": "MaskTrainer steps (default: run_continual's 100)."})
    dev_size: int | None = field(
        default=None, metadata={"help": "Dev examples per task, for the mask selection and the grid (default 300)."}
    )
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)."})
    seed: int = field(default=42, metadata={"help": "Seed of the k-shot samples, training and DARE's drops."})
    smoke: bool = field(default=False, metadata={"help": "A few steps of everything."})
    prepare_only: bool = field(default=False, metadata={"help": "Only fine-tune and graft the tasks (cached)."})
    work_dir: str = field(default="outputs/merge", metadata={"help": "Data, fine-tunes' grafts and scratch files."})
    report_dir: str = field(default="reports/merge", metadata={"help": "summary.md, results.json, figure."})


def task_grafts(run: Runner, tasks: dict[str, Task], pre, num_entries: int) -> dict[str, dict]:
    """Per task: the individual fine-tune's scores, its full graft (``work/grafts/<task>/full``) and its learned graft
    (``.../learned``), each saved as it lands and reused when the settings match."""
    key = json.dumps({**run.settings, "seed": run.seed, "num_entries": num_entries}, sort_keys=True)
    out = {}
    for name, task in tasks.items():
        folder = run.work / "grafts" / name
        record = folder / "scores.json"
        if record.is_file() and json.loads(record.read_text())["key"] == key:
            out[name] = json.loads(record.read_text())["scores"]
            logger.info("%s: reusing the fine-tune's grafts in %s", name, folder)
            continue
        start = time.perf_counter()
        finetuned = run.finetune(copy.deepcopy(pre), task.train, run.settings["ft_steps"])
        scores = {"fine-tuned": run.score(finetuned, task), "fine-tuned dev": run.score(finetuned, task, task.dev)}
        full = get_peft_model(
            copy.deepcopy(pre), GraftConfig(finetuned=finetuned, sparsity=1.0, modules_to_save=["classifier"])
        )
        full.save_pretrained(folder / "full")
        del full
        learned = run.learn_region(pre, finetuned, task, num_entries, empty_start=False)
        scores["learned graft"] = run.score(learned, task)
        learned.save_pretrained(folder / "learned")
        scores["minutes"] = (time.perf_counter() - start) / 60
        record.write_text(json.dumps({"key": key, "scores": scores}))
        out[name] = scores
        logger.info("%s: %s", name, scores)
        del finetuned, learned
    return out


GLOBAL_RULES = ("task_arithmetic", "ties", "dare_ties", "dare_linear")


def grid(args: MergeArguments) -> list[tuple[str, dict]]:
    """The global methods' settings tried on the dev sets: lambda for task arithmetic, lambda x density for the rest."""
    out = [("task_arithmetic", {"weights": lam}) for lam in args.lambdas]
    for rule in GLOBAL_RULES[1:]:
        out += [
            (rule, {"weights": lam, "density": d, "seed": args.seed}) for d in args.densities for lam in args.lambdas
        ]
    return out


class Evaluator:
    """Scores merged bodies with each task's head, caching every result in ``work/merge_scores.json`` as it lands."""

    def __init__(self, run: Runner, tasks: dict[str, Task], model: PeftModel, key: str) -> None:
        self.run, self.tasks, self.model = run, tasks, model
        self.path = run.work / "merge_scores.json"
        cached = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.cache = cached.get("scores", {}) if cached.get("key") == key else {}
        self.key = key

    def __call__(self, label: str, split: str, build) -> dict:
        """``build()`` adds the merged adapter and returns its MergedGraft; scores on ``split`` ("dev"/"test")."""
        cache_key = f"{label} | {split}"
        if cache_key not in self.cache:
            merged = build()
            scores = {"entries": merged.num_entries, "bytes": merged.nbytes["total"]}
            for name in merged.tasks:
                task = self.tasks[name]
                merged.use_task(name)
                scores[name] = self.run.score(self.model, task, task.dev if split == "dev" else None)
            self.model.delete_adapter(merged.adapter_name)
            self.cache[cache_key] = scores
            self.path.write_text(json.dumps({"key": self.key, "scores": self.cache}))
            logger.info("%s on %s: %s", label, split, scores)
        return self.cache[cache_key]


def label_of(rule: str, options: dict) -> str:
    shown = {k: v for k, v in options.items() if k in ("weights", "density")}
    return rule + ("" if not shown else " " + " ".join(f"{k}={v:g}" for k, v in shown.items()))


def load_grafts(pre, work: Path, tasks: dict[str, Task]) -> PeftModel:
    """Every task's full and learned graft in one model: adapters ``<task>_full`` and ``<task>_learned``."""
    model = None
    for name in tasks:
        for kind in ("full", "learned"):
            folder = str(work / "grafts" / name / kind)
            if model is None:
                model = PeftModel.from_pretrained(copy.deepcopy(pre), folder, adapter_name=f"{name}_{kind}")
            else:
                model.load_adapter(folder, f"{name}_{kind}")
    return model.eval()


def merge_all(args: MergeArguments, run: Runner, tasks: dict[str, Task], pre, key: str) -> dict:
    model = load_grafts(pre, run.work, tasks)
    evaluate = Evaluator(run, tasks, model, key)
    full = {name: f"{name}_full" for name in tasks}
    learned = {name: f"{name}_learned" for name in tasks}
    union = Region()
    for name in full.values():
        union = union | model.base_model.get_region(name)
    num_params = sum(p.numel() for p in pre.parameters())
    budget = sum(model.base_model.get_region(name).num_entries for name in learned.values()) / len(learned)
    dataless_density = budget / union.num_entries  # the learned regions' mean size, of the moved entries

    def build(rule: str, sources: dict, **options):
        return functools.partial(merge_grafts, model, sources, rule, **options)

    grid_scores = {}
    for rule, options in grid(args):
        grid_scores[label_of(rule, options)] = evaluate(label_of(rule, options), "dev", build(rule, full, **options))
    chosen = {}
    for rule in GLOBAL_RULES:  # the best mean dev accuracy of each rule
        candidates = [(label, options) for r, options in grid(args) if r == rule for label in [label_of(r, options)]]
        label, options = max(candidates, key=lambda c: mean_accuracy(grid_scores[c[0]], tasks))
        chosen[rule] = (label, build(rule, full, **options))
    chosen = {
        "stitch": ("stitch", build("stitch", learned)),
        "stitch_dataless": (
            label_of("stitch_dataless", {"density": dataless_density}),
            build("stitch_dataless", full, density=dataless_density),
        ),
        **chosen,
    }
    test = {rule: {"label": label, **evaluate(label, "test", make)} for rule, (label, make) in chosen.items()}
    return {
        "grid_dev": grid_scores,
        "test": test,
        "num_params": num_params,
        "moved_entries": union.num_entries,
        "dataless_density": dataless_density,
        "interference": interference(run, tasks, model, pre, evaluate),
    }


def mean_accuracy(scores: dict, tasks) -> float:
    return sum(scores[name]["accuracy"] for name in tasks) / len(tasks)


def interference(run: Runner, tasks: dict[str, Task], model: PeftModel, pre, evaluate: Evaluator) -> dict:
    """Where the learned regions overlap, and each task's test accuracy with and without the overlapping entries:
    its own graft, and the stitched model (relative gain, Eq. 5: the share of fine-tuning's gain over theta_pre with
    the task's head that it keeps)."""
    regions = {name: model.base_model.get_region(f"{name}_learned") for name in tasks}
    names = list(regions)
    overlap = Region()
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            overlap = overlap | (regions[first] & regions[second])
    learned = {name: f"{name}_learned" for name in tasks}
    accuracy = {}
    for row in ("own graft", "own graft without overlap", "stitched", "stitched without overlap"):
        exclude = overlap if "without" in row else None
        accuracy[row] = {}
        for name in tasks:
            own = row.startswith("own")
            sources = {name: learned[name]} if own else learned
            label = f"interference: {row}" + (f" ({name})" if own else "")
            scores = evaluate(label, "test", functools.partial(merge_grafts, model, sources, "stitch", exclude=exclude))
            accuracy[row][name] = scores[name]["accuracy"]
    pretrained = {}
    for name, task in tasks.items():  # theta_pre with the task's own head
        body = copy.deepcopy(pre)
        body.classifier.load_state_dict(model.base_model.model.classifier.modules_to_save[learned[name]].state_dict())
        pretrained[name] = run.score(body, task)["accuracy"]
    full = json.loads((run.work / "merge_individual.json").read_text())
    fine_tuned = {name: full[name]["fine-tuned"]["accuracy"] for name in tasks}
    gains = {  # Eq. 5 is undefined where fine-tuning gained nothing over theta_pre with the head
        row: {n: relative_gain(acc[n], pretrained[n], fine_tuned[n], n) if fine_tuned[n] != pretrained[n] else None
              for n in tasks}
        for row, acc in accuracy.items()
    }  # fmt: skip
    return {
        "overlap_matrix": overlap_matrix(regions).tolist(),
        "tasks": names,
        "overlap_entries": overlap.num_entries,
        "region_entries": {name: region.num_entries for name, region in regions.items()},
        "accuracy": accuracy,
        "pretrained_with_head": pretrained,
        "relative_gain": gains,
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(MergeArguments).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        level=logging.INFO,
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    start = time.perf_counter()
    ensure_assets(ASSETS)
    settings = dict(SMOKE if args.smoke else DEFAULT)
    for name in ("ft_steps", "mask_steps", "dev_size"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, report_dir = Path(args.work_dir), Path(args.report_dir)
    model_dir = args.model_name_or_path or minilm_dir()
    tokenizer = U.load_tokenizer(model_dir, "classification")
    tasks = load_tasks(work, settings, args.seed, tokenizer)
    tasks = {name: dataclasses.replace(task, offset=0) for name, task in tasks.items()}  # one head shape
    run = Runner(model_dir, tokenizer, settings, work, args.seed)
    pre = run.pretrained(max(task.num_labels for task in tasks.values()))
    num_entries = max(1, round(args.fraction * sum(p.numel() for p in pre.parameters())))
    results = {"settings": settings, "fraction": args.fraction, "num_entries": num_entries, "seed": args.seed}
    results["individual"] = task_grafts(run, tasks, pre, num_entries)
    results["minutes_prepare"] = (time.perf_counter() - start) / 60
    if args.prepare_only:
        return results
    report_dir.mkdir(parents=True, exist_ok=True)
    (work / "merge_individual.json").write_text(json.dumps(results["individual"]))
    key = json.dumps({**settings, "seed": args.seed, "num_entries": num_entries}, sort_keys=True)
    results["merge"] = merge_all(args, run, tasks, pre, key)
    results["minutes"] = (time.perf_counter() - start) / 60
    summary = summary_markdown(results, list(tasks))
    (report_dir / "summary.md").write_text(summary)
    (report_dir / "results.json").write_text(json.dumps(results, indent=2))
    save_figures(results, report_dir)
    print(summary)
    return results


PRETTY = {
    "stitch": "stitch (learned regions, L&S)",
    "stitch_dataless": "stitch_dataless (top-k |tau|)",
    "task_arithmetic": "task arithmetic",
    "ties": "TIES",
    "dare_ties": "DARE-TIES",
    "dare_linear": "DARE-linear",
}


def summary_markdown(results: dict, names: list[str]) -> str:
    merge, individual = results["merge"], results["individual"]
    header = "| method | setting (dev-chosen) | " + " | ".join(f"{n} acc / ECE" for n in names)
    lines = [
        "## Merged models, test accuracy % / ECE % with each task's head",
        "",
        header + " | avg normalized acc | entries changed (% of params) | storage |",
        "|---" * (len(names) + 5) + "|",
    ]
    fts = [individual[n]["fine-tuned"] for n in names]
    cells = " | ".join(f"{s['accuracy']:.1f} / {s['ece']:.1f}" for s in fts)
    moved = merge["moved_entries"]
    lines.append(
        f"| individual fine-tunes (3 models) | - | {cells} | 1.000 | {moved:,} each "
        f"({100 * moved / merge['num_params']:.1f}%) | 3 full models |"
    )
    for rule, row in merge["test"].items():
        cells = " | ".join(f"{row[n]['accuracy']:.1f} / {row[n]['ece']:.1f}" for n in names)
        normalized = normalized_accuracy(row, individual, names)
        setting = row["label"].removeprefix(rule).strip() or "-"
        lines.append(
            f"| {PRETTY[rule]} | {setting} | {cells} | {normalized:.3f} | {row['entries']:,} "
            f"({100 * row['entries'] / merge['num_params']:.2f}%) | {row['bytes'] / 2**20:.1f} MiB |"
        )
    lines += [
        "",
        "Dev grid of the global methods (mean dev accuracy %, each task's head):",
        "",
        "| rule | setting | mean dev acc | " + " | ".join(names) + " |",
        "|---" * (len(names) + 3) + "|",
    ]
    for label, scores in merge["grid_dev"].items():
        rule, _, setting = label.partition(" ")
        per_task = " | ".join(f"{scores[n]['accuracy']:.1f}" for n in names)
        lines.append(f"| {rule} | {setting} | {mean_accuracy(scores, names):.1f} | {per_task} |")
    view = merge["interference"]
    lines += [
        "",
        "## Interference of the stitched model",
        "",
        "Learned regions: "
        + ", ".join(f"{n} {k:,}" for n, k in view["region_entries"].items())
        + f" entries; {view['overlap_entries']:,} entries lie in two regions or more. "
        "Overlap |g_i & g_j| / |g_j|:",
        "",
        "| | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    lines += [
        f"| {row} | " + " | ".join(f"{v:.3f}" for v in values) + " |"
        for row, values in zip(view["tasks"], view["overlap_matrix"], strict=True)
    ]
    lines += [
        "",
        "Test accuracy % (relative gain, Eq. 5, over theta_pre with the task's head: "
        + ", ".join(f"{n} {view['pretrained_with_head'][n]:.1f}" for n in names)
        + "):",
        "",
        "| model | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for row, accuracy in view["accuracy"].items():
        gains = view["relative_gain"][row]
        cells = [f"{accuracy[n]:.1f}" + (f" ({gains[n]:.2f})" if gains[n] is not None else "") for n in names]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def normalized_accuracy(row: dict, individual: dict, names: list[str]) -> float:
    return sum(row[n]["accuracy"] / individual[n]["fine-tuned"]["accuracy"] for n in names) / len(names)


def save_figures(results: dict, report_dir: Path) -> None:
    """Normalized accuracy vs fraction of parameters changed (one point per rule), and the regions' overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from peft_graft.calibration.plots import _new_figure

    merge, names = results["merge"], list(results["individual"])
    figure = _new_figure((640, 420), 100)
    ax = figure.add_subplot()
    markers = iter("oPsD^vX*")
    for rule, row in merge["test"].items():
        x = 100 * row["entries"] / merge["num_params"]
        y = normalized_accuracy(row, results["individual"], names)
        ax.scatter([x], [y], s=45, marker=next(markers), label=PRETTY[rule].split(" (")[0], alpha=0.85)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 1, 10, not 10^0, 10^1
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize="small", loc="best")
    ax.set_xlabel("parameters changed by the merged body (% of all, log scale)")
    ax.set_ylabel("average normalized accuracy (merged / fine-tuned)")
    ax.set_title("Merging MR, TREC, SMS fine-tunes of MiniLM", fontsize="medium")
    ax.grid(alpha=0.3)
    save_figure(figure, report_dir / "merge_accuracy_vs_size.png")
    view = merge["interference"]
    heatmap = plot_region_matrix(view["overlap_matrix"], view["tasks"], view["tasks"], "Overlap |g_i & g_j| / |g_j|")
    save_figure(heatmap, report_dir / "merge_overlap.png")


if __name__ == "__main__":
    main()
