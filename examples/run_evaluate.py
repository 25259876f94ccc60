#!/usr/bin/env python
"""Compare a fine-tuned model with its grafts and with baseline regions, in and out of distribution (paper Figure 2).

Every model gets the full :func:`peft_graft.calibration.calibration_report` (accuracy, ECE, MCE, adaptive and
class-wise ECE, Brier, NLL, agreement with the fine-tuned model) on every evaluation set:

* the fine-tuned model;
* the 0-entry graft: the pre-trained model with the fine-tuned classification head (prompt heads: the pre-trained
  model zero-shot);
* for every graft of ``--graft_dirs`` (a learned region of k entries): the learned graft, the graft of the top-k
  movement region and the graft of a random region of the same k (``--sweep_random_seed``);
* every model of ``--compare_models name=folder ...``: full models of the same task set-up, e.g. graft re-training
  (``run_finetune.py --retrain_region``) or BitFit (``--bitfit``), as rows after all the others, in the order given.
  Their entries are the trained entries outside the new head (``restricted_training.json``; "all (dense)" without
  it), as a graft's are its grafted entries outside the head it stores whole.

Each model's logits are computed once per set (and on ``--temperature_dataset``); the metrics, the temperature
scaling and the sweep points at the graft sizes all reuse them, and each model is freed once predicted.

``--temperature_dataset`` (read like the evaluation sets: ``--eval_split``, ``--text_column``, ``--label_column``,
``--max_eval_samples``) fits one temperature per model on that set (temperature scaling, Guo et al. 2017, the
post-hoc calibration baseline) and adds a "+ TS" row per model and set: the report of the scaled logits (same
accuracy, other ECE, Brier, NLL).

The region-size sweep (``--sweep``, on by default; ``--sweep false`` skips it and its figure) plots accuracy on the
first evaluation set (at most ``--sweep_max_samples`` examples) against region size: the learned regions, and the
top-k movement and random regions at the graft sizes and at ``--sweep_num_entries``.

Multi-class tasks work throughout (reliability diagrams are top-label). ``--f1`` reports binary F1 (of class 1,
MRPC/QQP style) and needs a 2-class task: it is a ValueError on a task with more classes.

Writes into ``--report_dir``:

* ``results.json``: ``metrics`` (evaluation set -> model name -> report), ``models`` (model name -> kind, entries,
  temperature; in table order), ``eval_sets``, ``grafts``, ``compare_models`` (name, folder, kind, trained entries;
  empty without ``--compare_models``), ``graft_stats`` (the first graft), ``pretrained_name``, ``max_seq_length``
  (``--max_seq_length``, default the fine-tune's),
  ``temperature_scaling`` (None without a temperature set), the sweep (``sweep``, ``sweep_references``,
  ``sweep_set``, ``sweep_examples``; absent with ``--sweep false``) and ``timings``;
* ``summary.md``: a table per evaluation set (model | entries | accuracy % | ECE % | MCE % | Brier | NLL | agreement
  with FT %; with ``--f1`` an F1 % column after accuracy), the fitted temperatures, the sweep table and the run
  times;
* ``reliability_<model>_<set>.png`` (``fine-tuned`` and ``graft``, the first graft, and with a temperature set
  ``fine-tuned_TS`` and ``graft_TS``; the set's name made shell-friendly: ``MR (in-dist)`` -> ``MR_in-dist``),
  ``graft_locations.png`` and ``sweep_accuracy.png``;
* with ``--do_predict``: ``predict_results.csv``, every model's predicted label on ``--test_file`` (columns ``index``,
  the example's position in the file, ``label``, then one per model).

Your own files (run_glue's flags): ``--validation_file`` and ``--test_file`` are evaluation sets named ``validation``
and ``test`` (CSV or JSON lines, columns as ``--text_column``/``--label_column``: 'text' or 'sentence', and 'label'),
beside or instead of ``--eval_datasets``.

Example::

    python examples/run_evaluate.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft \
        --graft_dirs outputs/graft --eval_datasets mr_test.csv amazon.csv --eval_names in-dist OOD \
        --temperature_dataset mr_dev.csv --report_dir reports/mr \
        --compare_models "graft re-training=outputs/retrain" "BitFit=outputs/bitfit"
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import example_utils as U  # examples/ is on sys.path when a script there runs
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from peft import PeftModel, get_peft_model
from transformers import HfArgumentParser

from peft_graft import GraftConfig
from peft_graft.calibration import calibration_report, f1_score, fit_temperature, reliability_diagram, save_figure

logger = logging.getLogger(__name__)

TS = " + TS"
"""Suffix of a temperature-scaled model's name."""
VALIDATION, TEST = "validation", "test"
"""The names of the ``--validation_file`` and ``--test_file`` evaluation sets."""
PREDICTIONS_FILE = "predict_results.csv"
"""Every model's predicted label on ``--test_file`` (``--do_predict``)."""
RESULT_FILES = ("results.json", "summary.md", PREDICTIONS_FILE, "reliability_*.png", "graft_locations.png",
                "sweep_accuracy.png")  # fmt: skip
"""What a run writes into ``--report_dir``: an earlier run's are removed when a run starts."""
BASELINES = (("movement", "top-k movement"), ("random", "random"))
"""(GraftConfig region, model kind) of the baseline regions evaluated at every graft size."""
OWN_ROWS = re.compile(r"fine-tuned|pre-trained (\+ FT head|\(zero-shot\))|"
                      r"(learned|top-k movement|random) k=\d+( #\d+)?")  # fmt: skip
"""The names the script gives its own rows: a ``--compare_models`` name may not be one."""


@dataclass
class EvaluateArguments:
    """The grafts, the evaluation sets, temperature scaling, the sweep and the report."""

    graft_dirs: list[str] = field(
        metadata={
            "help": "Graft folders (run_graft.py), one learned region each; the first is the main graft (graft_stats, "
            "figures). Each is compared with the top-k movement and a random region of its size."
        }
    )
    eval_datasets: list[str] | None = field(
        default=None, metadata={"help": "Evaluation sets: local files/folders or Hub ids (or --validation_file)."}
    )
    validation_file: str | None = field(
        default=None,
        metadata={
            "help": "Your own evaluation file, named 'validation': CSV or JSON lines with a text column ('text' or "
            "'sentence', or --text_column) and a label column ('label', or --label_column)."
        },
    )
    test_file: str | None = field(
        default=None,
        metadata={"help": "Your own test file, named 'test' (columns as --validation_file); --do_predict predicts it."},
    )
    do_predict: bool = field(
        default=False,
        metadata={"help": "Write predict_results.csv: every model's predicted label on --test_file, in file order."},
    )
    max_seq_length: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per example (prompt included); default: the fine-tuned model's (graft_example.json)."
        },
    )
    eval_names: list[str] | None = field(default=None, metadata={"help": "A name per evaluation set."})
    eval_split: str = field(default="validation", metadata={"help": "Split of Hub/on-disk evaluation sets."})
    temperature_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Held-out set (read like the evaluation sets) to fit one temperature per model on: adds a "
            "temperature-scaled ('+ TS') row per model and evaluation set."
        },
    )
    f1: bool = field(default=False, metadata={"help": "Also report binary F1 (MRPC/QQP style); 2-class tasks only."})
    sweep: bool = field(
        default=True,
        metadata={"help": "Run the region-size sweep and draw sweep_accuracy.png ('--sweep false' skips both)."},
    )
    sweep_num_entries: list[int] | None = field(
        default=None, metadata={"help": "Extra region sizes for the top-k movement and random regions."}
    )
    sweep_max_samples: int | None = field(
        default=1000, metadata={"help": "Examples of the first evaluation set used by the sweep."}
    )
    sweep_random_seed: int = field(default=0, metadata={"help": "Seed of the random regions (baselines and sweep)."})
    compare_models: list[str] | None = field(
        default=None,
        metadata={
            "help": "Extra full models to evaluate beside the fine-tuned model and the grafts, as 'name=folder' (the "
            "name ends at the first '=') or a folder (named after it), e.g. 'graft re-training=outputs/retrain' "
            "'BitFit=outputs/bitfit' (run_finetune.py --retrain_region / --bitfit). Each folder needs the fine-tuned "
            "model's task set-up (graft_example.json); each gets a row (and a '+ TS' row) on every evaluation set, "
            "after the others."
        },
    )
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Prediction batch size."})
    report_dir: str = field(default="reports/graft", metadata={"help": "Where to write the report."})
    timings_json: str | None = field(default=None, metadata={"help": "JSON of stage run times to put in the summary."})


def sweep_model(pre: str, setup, tokenizer, finetuned, strategy: str, k: int, seed: int) -> torch.nn.Module:
    """The graft of the top-k movement (``"movement"``) or a random (``"random"``) region of exactly k entries."""
    config = GraftConfig(
        finetuned=finetuned,
        region=strategy,
        num_entries=k,
        seed=seed,
        modules_to_save=U.modules_to_save(setup),
    )
    return get_peft_model(U.load_model(pre, setup, tokenizer), config)


def parse_compare_models(specs: list[str] | None, ft_setup: U.TaskSetup) -> list[dict]:
    """``--compare_models`` as ``[{"name", "dir", "kind", "entries", ...}]``, checked before any model is loaded."""
    models = []
    for spec in specs or []:
        name, sep, directory = spec.partition("=")
        name, directory = (name.strip(), directory) if sep else (Path(spec).name, spec)
        if not name or not directory:
            raise ValueError(f"--compare_models {spec!r}: give 'name=folder' or a folder.")
        if OWN_ROWS.fullmatch(name) or name.endswith(TS):
            raise ValueError(f"--compare_models name {name!r} is the name of a row this script makes: rename it.")
        if name in {m["name"] for m in models}:
            raise ValueError(f"--compare_models names must be distinct: {name!r} is given twice.")
        if Path(directory, "adapter_config.json").is_file():
            raise ValueError(f"--compare_models {spec!r}: {directory!r} is an adapter: give a graft to --graft_dirs.")
        setup = U.TaskSetup.load(directory)
        if setup is None:
            raise ValueError(
                f"--compare_models {spec!r}: {directory!r} has no {U.SETUP_FILE}: compare models saved by "
                "examples/run_finetune.py."
            )
        if (setup.head, setup.label_names) != (ft_setup.head, ft_setup.label_names):
            raise ValueError(
                f"--compare_models {spec!r}: head={setup.head!r} with classes {setup.label_names}, but the fine-tuned "
                f"model has head={ft_setup.head!r} with classes {ft_setup.label_names}: compare models of one task."
            )
        record = Path(directory, U.RESTRICTION_FILE)
        trained = json.loads(record.read_text()) if record.is_file() else {}
        models.append({"name": name, "dir": str(directory), "kind": trained.get("method", "full model"),
                       "entries": trained.get("entries"), "head_entries": trained.get("head_entries"),
                       "graft": trained.get("graft")})  # fmt: skip
    return models


def free_memory() -> None:
    """Give a deleted model's accelerator memory back (host memory goes with its last reference)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def plot_sweep(sweep: dict[str, dict[int, float]], references: dict[str, float], title: str) -> Figure:
    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.add_subplot()
    styles = {"learned": ("tab:green", "o"), "top-k movement": ("tab:blue", "s"), "random": ("tab:gray", "^")}
    for name, points in sweep.items():
        sizes = sorted(points)
        color, marker = styles.get(name, ("black", "x"))
        ax.plot(sizes, [100 * points[s] for s in sizes], marker=marker, color=color, label=name)
    for (name, value), style in zip(references.items(), ("--", ":"), strict=False):
        ax.axhline(100 * value, linestyle=style, color="black", linewidth=1, label=name)
    drawn = [100 * v for points in sweep.values() for v in points.values()] + [100 * v for v in references.values()]
    if drawn:  # every point and every reference line inside the axes (a line above the points was cut off)
        pad = max(1.0, 0.05 * (max(drawn) - min(drawn)))
        ax.set_ylim(min(drawn) - pad, max(drawn) + pad)
    ax.set(xscale="log", xlabel="grafted entries (region size)", ylabel="accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_locations(per_layer: dict, per_module_type: dict, title: str) -> Figure:
    """Where the grafted entries sit: by layer and by module type (paper Figures 9-10)."""
    fig = Figure(figsize=(10, 4), dpi=120)
    left, right = fig.subplots(1, 2)
    layers = sorted(per_layer, key=lambda i: -1 if i is None else i)
    left.bar([("other" if i is None else str(i)) for i in layers], [per_layer[i] for i in layers], color="tab:green")
    left.set(xlabel="layer ('other': embeddings, pooler, head)", ylabel="grafted entries", title="by layer")
    kinds = sorted(per_module_type, key=per_module_type.get, reverse=True)
    right.barh(kinds[::-1], [per_module_type[k] for k in kinds[::-1]], color="tab:purple")
    right.set(xlabel="grafted entries", title="by module type")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return calibration_report(logits, labels, input_type="logits", metrics=["accuracy"])["accuracy"]


# ------------------------------------------------------------------------------------------------------- summary
def _percent(report: dict[str, float], key: str, digits: int = 1) -> str:
    return f"{100 * report[key]:.{digits}f}" if key in report else "-"


def _row(label: str, entries: str, report: dict[str, float], f1: bool) -> str:
    cells = [label, entries, _percent(report, "accuracy")]
    cells += [_percent(report, "f1")] if f1 else []
    cells += [_percent(report, "ece", 2), _percent(report, "mce"), f"{report['brier']:.4f}", f"{report['nll']:.4f}"]
    cells.append(_percent(report, "agreement"))
    return "| " + " | ".join(cells) + " |"


SELECTION_KEYS = ("selected_step", "selection_p_value", "evaluated_masks", "best_learned_step", "best_learned_p_value",
                  "entries_changed_from_start", "iou_with_start")  # fmt: skip
"""What ``graft_results.json`` says of the mask run_graft.py kept, copied into the report's ``grafts``."""


def _selection_of(graft_dir: str) -> dict:
    """Which evaluated mask run_graft.py kept (``graft_results.json``): step, the sign test's p-value and number of
    masks, the best learned mask's step and p-value (kept or not), and how far the kept region moved from gamma_base."""
    path = Path(graft_dir, "graft_results.json")
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    return {key: saved[key] for key in SELECTION_KEYS if key in saved}


def _selection_note(graft: dict) -> str:
    notes = []
    step = graft.get("selected_step")
    if step is not None:
        note = "the starting mask gamma_base kept" if step == 0 else f"the mask of step {step}"
        if "selection_p_value" in graft and step:
            note += f" (sign test p = {graft['selection_p_value']:.2g} over {graft['evaluated_masks']} masks)"
        elif step == 0 and "best_learned_p_value" in graft:
            note += (f" (the best learned mask, of step {graft['best_learned_step']}, not significant: sign test p = "
                     f"{graft['best_learned_p_value']:.2g} over {graft['evaluated_masks']} masks)")  # fmt: skip
        notes.append(note)
    if "entries_changed_from_start" in graft:
        notes.append(f"{graft['entries_changed_from_start']:,} entries changed from gamma_base, IoU "
                     f"{graft['iou_with_start']:.2f}")  # fmt: skip
    return "".join(f", {note}" for note in notes)


def summary_markdown(results: dict) -> str:
    """A table per evaluation set (every model, in ``results["models"]`` order), the fitted temperatures, the sweep
    table (when the sweep ran) and the run times."""
    models, metrics = results["models"], results["metrics"]
    f1 = any("f1" in report for reports in metrics.values() for report in reports.values())
    header = ["model", "entries", "accuracy %", *(["F1 %"] if f1 else []), "ECE %", "MCE %", "Brier", "NLL",
              "agreement with FT %"]  # fmt: skip
    lines = []
    for data, reports in metrics.items():
        examples = results.get("eval_sets", {}).get(data, {}).get("examples")
        lines += [f"### {data}" + (f" ({examples:,} examples)" if examples else ""), ""]
        lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for name, info in models.items():
            if name in reports:
                entries = "all (dense)" if info["entries"] is None else f"{info['entries']:,}"
                lines.append(_row(info.get("label", name), entries, reports[name], f1))
        lines.append("")
    stats = results["graft_stats"]
    total = stats.get("total_parameters") or stats["num_parameters"]
    grafts = ", ".join(f"{g['num_entries']:,} entries ({100 * g['fraction_of_parameters']:.4f}%, {Path(g['dir']).name}"
                       f"{_selection_note(g)})" for g in results.get("grafts", []))  # fmt: skip
    lines += [
        f"Learned grafts: {grafts}. % = grafted entries / all {total:,} parameters (heads included); stored "
        f"whole in each graft (new classification head): {stats['modules_to_save_parameters']:,} parameters. "
        "Top-k movement and random: regions of the same size. Agreement: same prediction as the fine-tuned model.",
        "",
    ]
    compared = results.get("compare_models")
    if compared:
        described = []
        for model in compared:
            trained = "every entry" if model["entries"] is None else f"{model['entries']:,} entries"
            trained += f" + the head whole ({model['head_entries']:,})" if model.get("head_entries") else ""
            described.append(f"{model['name']} ({model['kind']}, {Path(model['dir']).name}: {trained} trained)")
        lines += [
            "Compared models: " + "; ".join(described) + ". Their entries column: trained entries outside the head.",
            "",
        ]
    scaling = results.get("temperature_scaling")
    if scaling:
        lines += [
            f"Temperature scaling (+ TS): one temperature per model, fitted on {scaling['dataset']} "
            f"({scaling['examples']:,} examples) by NLL; accuracy and agreement are unchanged.",
            "",
            "| model | temperature | NLL before | NLL after |",
            "| --- | --- | --- | --- |",
        ]
        for name, temperature in scaling["temperatures"].items():
            label = models.get(name, {}).get("label", name)
            entries = models.get(name, {}).get("entries")
            label += "" if entries in (None, 0) else f" ({entries:,})"
            lines.append(f"| {label} | {temperature:.3f} | {scaling['nll_before'][name]:.4f} | "
                         f"{scaling['nll_after'][name]:.4f} |")  # fmt: skip
        lines.append("")
    sweep = results.get("sweep")
    if sweep:
        sizes = sorted({int(k) for points in sweep.values() for k in points})
        lines += [
            f"Region-size sweep on {results['sweep_set']} ({results['sweep_examples']} examples), accuracy %:",
            "",
            "| region | " + " | ".join(f"{k:,}" for k in sizes) + " |",
            "| --- | " + " | ".join("---" for _ in sizes) + " |",
        ]
        for name, points in sweep.items():
            cells = [f"{100 * points[str(k)]:.1f}" if str(k) in points else "-" for k in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if results.get("timings"):
        lines += ["| stage | run time (s) |", "| --- | --- |"]
        lines += [f"| {stage} | {seconds:.0f} |" for stage, seconds in results["timings"].items()]
    return "\n".join(lines).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------------------- main
def main(args: list[str] | None = None) -> dict:
    """Parse ``args`` (default: ``sys.argv``), evaluate, write the report, and return the results."""
    parser = HfArgumentParser((U.GraftModelArguments, U.DatasetArguments, EvaluateArguments))
    model_args, dataset_args, eval_args = parser.parse_args_into_dataclasses(args)
    U.setup_logging(None, logger)
    start = time.perf_counter()
    eval_paths, names = evaluation_sets(eval_args)
    report_dir = Path(eval_args.report_dir)

    # The task set-up saved by run_finetune.py and the data.
    pre, ft = model_args.model_name_or_path, model_args.finetuned_model_name_or_path
    setup = U.TaskSetup.load(ft)
    if setup is None:
        raise ValueError(f"{ft!r} has no {U.SETUP_FILE}: evaluate a model fine-tuned with examples/run_finetune.py.")
    if eval_args.f1 and setup.num_labels != 2:
        raise ValueError(
            f"--f1 reports binary F1 (of class 1) and needs a 2-class task, but {ft!r} has {setup.num_labels} "
            f"classes {setup.label_names}. Drop --f1: accuracy and the calibration metrics cover any number of classes."
        )
    if eval_args.max_seq_length is not None:
        setup = dataclasses.replace(setup, max_seq_length=eval_args.max_seq_length)
    pretrained_name = "pre-trained + FT head" if setup.head == "classification" else "pre-trained (zero-shot)"
    compared = parse_compare_models(eval_args.compare_models, setup)
    report_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = U.load_tokenizer(ft, setup.head)

    rows_of: dict[str, np.ndarray] = {}  # evaluation set -> each example's 0-based data row in its file (sorted)
    unlabelled: list = []  # the --test_file rows without a label: predicted (predict_results.csv), not scored

    def load_set(path: str, name: str | None = None):
        frame = U.read_table(
            path,
            eval_args.eval_split,
            dataset_args.dataset_config_name,
            dataset_args.text_column,
            dataset_args.label_column,
            label_required=name != TEST,
        )
        frame = U.encode_labels(frame.assign(label=frame.get("label")), setup.label_names, path)
        if dataset_args.max_eval_samples is not None:
            frame = frame.sample(frac=1.0, random_state=0).iloc[: dataset_args.max_eval_samples]
        if name == TEST and frame["label"].isna().any():
            rows = frame[frame["label"].isna()].drop(columns="label")
            dataset = U.tokenize(rows, tokenizer, setup)
            unlabelled[:] = [rows.index.to_numpy(), dataset]
            frame = frame[frame["label"].notna()]
            if frame.empty:  # nothing to score: only predicted
                rows_of[name] = frame.index.to_numpy()
                return None
        dataset = U.tokenize(frame, tokenizer, setup)
        order = U.length_order(dataset)
        if name is not None:
            rows_of[name] = frame.index.to_numpy()[order]
        return dataset.select(order.tolist())

    datasets = {name: load_set(path, name) for name, path in zip(names, eval_paths, strict=True)}
    if unlabelled:
        logger.info("%s: %d rows without a label are predicted, not scored", eval_args.test_file, len(unlabelled[0]))
    if TEST in datasets and datasets[TEST] is None:  # a test file without labels: only predicted
        del datasets[TEST]
        eval_paths, names = eval_paths[:-1], names[:-1]
        if not names:
            raise ValueError(
                f"--test_file {eval_args.test_file!r} has no labelled row and nothing else is evaluated: give "
                "--validation_file or --eval_datasets (a file with labels) beside it."
            )
    for name, dataset in datasets.items():
        logger.info("Evaluation set %s: %d examples", name, len(dataset))
    temperature_data = None
    if eval_args.temperature_dataset is not None:
        temperature_data = load_set(eval_args.temperature_dataset)
        logger.info("Temperature set %s: %d examples", eval_args.temperature_dataset, len(temperature_data))
    labels = {data: np.asarray(dataset["labels"]) for data, dataset in datasets.items()}
    U.clear_results(report_dir, RESULT_FILES, logger)

    # The sweep's examples: a sample of the first evaluation set (its cached logits serve the sweep at graft sizes).
    sweep_set = names[0]
    picked = np.arange(len(datasets[sweep_set]))
    if eval_args.sweep_max_samples is not None and len(picked) > eval_args.sweep_max_samples:
        picked = np.sort(np.random.default_rng(0).choice(len(picked), eval_args.sweep_max_samples, replace=False))
    sweep_labels = labels[sweep_set][picked]

    # Every model's logits, once per set: fine-tuned, 0 entries, each learned graft, the baselines at each graft size.
    predict = U.Predictor(tokenizer, eval_args.per_device_eval_batch_size, str(report_dir / "tmp"))
    logits: dict[str, dict[str, np.ndarray]] = {data: {} for data in datasets}
    temperature_logits: dict[str, np.ndarray] = {}
    models: dict[str, dict] = {}  # model name -> label (the summary's model column), kind, entries

    unlabelled_logits: dict[str, np.ndarray] = {}

    def predict_all(name: str, model: torch.nn.Module, kind: str, entries: int | None, label: str = "") -> None:
        for data, dataset in datasets.items():
            logits[data][name] = predict(model, dataset)
        if unlabelled:
            unlabelled_logits[name] = predict(model, unlabelled[1])
        if temperature_data is not None:
            temperature_logits[name] = predict(model, temperature_data)
        models[name] = {"label": label or kind, "kind": kind, "entries": entries, "temperature_scaled": False}
        accuracy = {d: round(100 * _accuracy(logits[d][name], labels[d]), 1) for d in datasets}
        logger.info("%s: accuracy %% %s", name, accuracy)

    finetuned = U.load_model(ft, setup, tokenizer)
    predict_all("fine-tuned", finetuned, "fine-tuned", None)
    model = U.pretrained_with_head(pre, setup, tokenizer, finetuned)
    predict_all(pretrained_name, model, pretrained_name, 0)
    del model
    free_memory()

    grafts, main_stats = [], None
    for directory in eval_args.graft_dirs:
        model = PeftModel.from_pretrained(U.load_model(pre, setup, tokenizer), directory)
        stats = model.graft_stats()
        main_stats = stats if main_stats is None else main_stats
        k = stats.num_entries
        name, label = f"learned k={k}", "learned"
        if name in models:  # two grafts of one size: tell them apart by position in --graft_dirs
            name, label = f"{name} #{len(grafts) + 1}", f"learned #{len(grafts) + 1}"
        predict_all(name, model, "learned", k, label)
        grafts.append({"name": name, "dir": str(directory), "num_entries": k,
                       "fraction_of_parameters": stats.fraction_of_parameters, **_selection_of(directory)})  # fmt: skip
        del model
        free_memory()
    graft_sizes = sorted({g["num_entries"] for g in grafts})
    for k in graft_sizes:
        for strategy, kind in BASELINES:
            model = sweep_model(pre, setup, tokenizer, finetuned, strategy, k, eval_args.sweep_random_seed)
            predict_all(f"{kind} k={k}", model, kind, k)
            del model
            free_memory()
    for other in compared:  # full models of the same task (graft re-training, BitFit, ...)
        model = U.load_model(other["dir"], setup, tokenizer)
        predict_all(other["name"], model, other["kind"], other["entries"], other["name"])
        del model
        free_memory()

    # The sweep: graft sizes from the cached logits, the extra sizes on the sweep sample only.
    sweep: dict[str, dict[str, float]] = {}
    references: dict[str, float] = {}
    if eval_args.sweep:
        sweep_data = datasets[sweep_set].select(picked.tolist())

        def sweep_accuracy(name: str) -> float:
            return _accuracy(logits[sweep_set][name][picked], sweep_labels)

        sweep = {"learned": {}, "top-k movement": {}, "random": {}}
        for graft in grafts:
            sweep["learned"][str(graft["num_entries"])] = sweep_accuracy(graft["name"])
        for k in sorted(set(eval_args.sweep_num_entries or []) | set(graft_sizes)):
            for strategy, kind in BASELINES:
                if k in graft_sizes:
                    sweep[kind][str(k)] = sweep_accuracy(f"{kind} k={k}")
                    continue
                model = sweep_model(pre, setup, tokenizer, finetuned, strategy, k, eval_args.sweep_random_seed)
                sweep[kind][str(k)] = _accuracy(predict(model, sweep_data), sweep_labels)
                del model
                free_memory()
            logger.info("Sweep at %d entries: %s", k, {n: p.get(str(k)) for n, p in sweep.items()})
        references = {"fine-tuned": sweep_accuracy("fine-tuned"), pretrained_name: sweep_accuracy(pretrained_name)}
        sweep_fig = plot_sweep({n: {int(k): v for k, v in p.items()} for n, p in sweep.items() if p}, references,
                               f"Accuracy against region size ({sweep_set})")  # fmt: skip
        save_figure(sweep_fig, report_dir / "sweep_accuracy.png")
    del finetuned
    free_memory()

    # Temperature scaling: one temperature per model, fitted on the temperature set's logits.
    scalers = {}
    if temperature_data is not None:
        temperature_labels = np.asarray(temperature_data["labels"])
        for name, values in temperature_logits.items():
            scalers[name] = fit_temperature(values, temperature_labels, input_type="logits")

    # The rows, in table order: fine-tuned, 0 entries, then per graft size the learned, top-k and random regions,
    # then the compared models, each followed by its temperature-scaled row.
    order = ["fine-tuned", pretrained_name]
    for k in graft_sizes:
        order += [g["name"] for g in grafts if g["num_entries"] == k] + [f"{kind} k={k}" for _, kind in BASELINES]
    order += [other["name"] for other in compared]
    rows: dict[str, tuple[str, dict]] = {}  # row name -> (model name, row description)
    for name in order:
        rows[name] = (name, models[name])
        if name in scalers:
            rows[name + TS] = (name, {**models[name], "label": models[name]["label"] + TS, "temperature_scaled": True,
                                      "temperature": scalers[name].temperature})  # fmt: skip

    def report(values: np.ndarray, data: str) -> dict[str, float]:
        out = calibration_report(values, labels[data], input_type="logits", reference_preds=logits[data]["fine-tuned"])
        if eval_args.f1:
            out["f1"] = f1_score(values, labels[data], "binary", input_type="logits")
        return out

    metrics: dict[str, dict[str, dict[str, float]]] = {}
    for data in datasets:
        metrics[data] = {}
        for row, (name, info) in rows.items():
            values = logits[data][name]
            metrics[data][row] = report(
                scalers[name].scale_logits(values) if info["temperature_scaled"] else values, data
            )
        figures = {"fine-tuned": logits[data]["fine-tuned"], "graft": logits[data][grafts[0]["name"]]}
        if scalers:
            figures["fine-tuned_TS"] = scalers["fine-tuned"].scale_logits(figures["fine-tuned"])
            figures["graft_TS"] = scalers[grafts[0]["name"]].scale_logits(figures["graft"])
        for name, values in figures.items():
            title = f"{name.replace('_TS', TS)}, {data}"
            fig = reliability_diagram(values, labels[data], input_type="logits", title=title)
            save_figure(fig, report_dir / f"reliability_{name}_{U.shell_safe(data)}.png")

    location_fig = plot_locations(main_stats.per_layer, main_stats.per_module_type,
                                  f"Where the {main_stats.num_entries:,} grafted entries sit")  # fmt: skip
    save_figure(location_fig, report_dir / "graft_locations.png")

    timings = json.loads(Path(eval_args.timings_json).read_text()) if eval_args.timings_json else {}
    timings["evaluate"] = time.perf_counter() - start
    results = {
        "metrics": metrics,
        "models": {row: info for row, (_, info) in rows.items()},
        "eval_sets": {
            name: {"path": path, "examples": len(datasets[name])} for name, path in zip(names, eval_paths, strict=True)
        },
        "grafts": grafts,
        "compare_models": compared,
        "graft_stats": {
            "num_entries": main_stats.num_entries,
            "num_parameters": main_stats.num_parameters,
            "total_parameters": main_stats.total_parameters,
            "fraction_of_parameters": main_stats.fraction_of_parameters,
            "modules_to_save_parameters": main_stats.modules_to_save_parameters,
            "per_layer": {str(k): v for k, v in main_stats.per_layer.items()},
            "per_module_type": main_stats.per_module_type,
        },
        "pretrained_name": pretrained_name,
        "max_seq_length": setup.max_seq_length,
        "temperature_scaling": None,
    }
    if scalers:
        results["temperature_scaling"] = {
            "dataset": eval_args.temperature_dataset,
            "examples": len(temperature_data),
            "temperatures": {name: scalers[name].temperature for name in order},
            "nll_before": {name: scalers[name].nll_before for name in order},
            "nll_after": {name: scalers[name].nll_after for name in order},
        }
    if eval_args.sweep:
        results.update(sweep=sweep, sweep_references=references, sweep_set=sweep_set, sweep_examples=len(picked))
    results["timings"] = timings
    (report_dir / "results.json").write_text(json.dumps(results, indent=2))
    (report_dir / "summary.md").write_text(summary_markdown(results))
    if eval_args.do_predict:
        test_logits, test_rows, test_labels = logits.get(TEST, {}), rows_of[TEST], labels.get(TEST, np.zeros(0, int))
        if unlabelled:  # the rows without a label: label -1 (an empty cell)
            test_logits = {name: np.concatenate([test_logits[name], unlabelled_logits[name]])
                           if name in test_logits else unlabelled_logits[name] for name in order}  # fmt: skip
            test_rows = np.concatenate([test_rows, unlabelled[0]])
            test_labels = np.concatenate([test_labels, np.full(len(unlabelled[0]), -1)])
        path = write_predictions(report_dir / PREDICTIONS_FILE, test_logits, order, test_rows, setup.label_names,
                                 test_labels)  # fmt: skip
        logger.info("Predictions of %d models on %s written to %s", len(order), eval_args.test_file, path)
    logger.info("Report written to %s", report_dir)
    return results


def evaluation_sets(eval_args: EvaluateArguments) -> tuple[list[str], list[str]]:
    """The evaluation sets' paths and names: ``--eval_datasets`` (named by ``--eval_names`` or their stems), then
    ``--validation_file`` and ``--test_file``; checked before any model is loaded."""
    paths = list(eval_args.eval_datasets or [])
    names = eval_args.eval_names or [Path(d).stem for d in paths]
    if len(names) != len(paths):
        raise ValueError(f"eval_names has {len(names)} names for {len(paths)} eval_datasets.")
    for flag, name in (("validation_file", VALIDATION), ("test_file", TEST)):
        path = getattr(eval_args, flag)
        U.check_data_file(path, f"--{flag}")
        if path is not None:
            paths.append(path)
            names.append(name)
    if not paths:
        raise ValueError("Nothing to evaluate: give --eval_datasets, --validation_file or --test_file.")
    if eval_args.do_predict and eval_args.test_file is None:
        raise ValueError("--do_predict needs --test_file: the file whose labels to predict.")
    if len(set(names)) != len(names):
        raise ValueError(f"eval_names must be distinct (with 'validation'/'test' for the files), got {names}.")
    safe = [U.shell_safe(name) for name in names]
    if len(set(safe)) != len(safe):
        raise ValueError(
            f"eval_names {names} give the same file names {safe} (figure names keep letters, digits, '_', '-', '.'): "
            "choose names that differ in those."
        )
    return paths, names


def write_predictions(path: Path, logits: dict[str, np.ndarray], models: list[str], rows: np.ndarray,
                      label_names: list[str], labels: np.ndarray) -> Path:  # fmt: skip
    """``predict_results.csv``: per example of the set, in file order, its ``index`` (0-based data row in the file), its
    label (empty where the file has none: ``labels`` -1) and each model's predicted label (the class names)."""
    names = np.asarray([*label_names, ""], dtype=object)  # label -1: no label
    ordered = np.argsort(rows, kind="stable")
    columns = {"index": rows[ordered], "label": names[labels[ordered]]}
    columns.update({model: names[logits[model].argmax(-1)[ordered]] for model in models})
    return U.write_text_atomic(path, pd.DataFrame(columns).to_csv(index=False))


if __name__ == "__main__":
    main()
