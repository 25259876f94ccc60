#!/usr/bin/env python
"""Compare a fine-tuned model with its graft(s), in and out of distribution, and sweep region sizes (paper Figure 2).

For each evaluation set: accuracy (and F1), ECE and the other calibration metrics of
:func:`peft_graft.calibration.calibration_report` for the fine-tuned model, the graft and the pre-trained model (with
the fine-tuned head, for a classification head), plus the graft's agreement with the fine-tuned model. The sweep
evaluates, at the size of every given graft (and at ``--sweep_num_entries``), the learned region, the top-k movement
region and a random region. Writes ``results.json``, ``summary.md`` and PNG figures into ``--report_dir``.

Example::

    python examples/run_evaluate.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft \
        --graft_dirs outputs/graft --eval_datasets mr_test.csv amazon.csv --eval_names in-dist OOD \
        --report_dir reports/mr
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import example_utils as U  # examples/ is on sys.path when a script there runs
import numpy as np
import torch
from matplotlib.figure import Figure
from peft import PeftModel, get_peft_model
from transformers import DataCollatorWithPadding, HfArgumentParser, Trainer, TrainingArguments

from peft_graft import GraftConfig
from peft_graft.calibration import calibration_report, f1_score, reliability_diagram, save_figure

logger = logging.getLogger(__name__)


@dataclass
class EvaluateArguments:
    """The grafts, the evaluation sets, the sweep and the report."""

    graft_dirs: list[str] = field(
        metadata={"help": "Graft folders (run_graft.py); the first is the main graft, all are sweep points."}
    )
    eval_datasets: list[str] = field(metadata={"help": "Evaluation sets: local files/folders or Hub ids."})
    eval_names: list[str] | None = field(default=None, metadata={"help": "A name per evaluation set."})
    eval_split: str = field(default="validation", metadata={"help": "Split of Hub/on-disk evaluation sets."})
    f1: bool = field(default=False, metadata={"help": "Also report binary F1 (MRPC/QQP style)."})
    sweep_num_entries: list[int] | None = field(
        default=None, metadata={"help": "Extra region sizes for the top-k movement and random regions."}
    )
    sweep_max_samples: int | None = field(
        default=1000, metadata={"help": "Examples of the first evaluation set used by the sweep."}
    )
    sweep_random_seed: int = field(default=0, metadata={"help": "Seed of the random regions."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Prediction batch size."})
    report_dir: str = field(default="reports/graft", metadata={"help": "Where to write the report."})
    timings_json: str | None = field(default=None, metadata={"help": "JSON of stage run times to put in the summary."})


class Predictor:
    """Logits of models on tokenized datasets, through ``Trainer.predict``."""

    def __init__(self, tokenizer, batch_size: int, work_dir: str) -> None:
        self.collator = DataCollatorWithPadding(tokenizer)
        self.args = TrainingArguments(
            output_dir=work_dir,
            per_device_eval_batch_size=batch_size,
            report_to="none",
            disable_tqdm=True,
            dataloader_pin_memory=False,
        )

    def __call__(self, model: torch.nn.Module, dataset) -> np.ndarray:
        model.eval()
        trainer = Trainer(model=model, args=self.args, data_collator=self.collator)
        return np.asarray(trainer.predict(dataset).predictions, dtype=np.float64)


def pretrained_with_head(pre: str, setup: U.TaskSetup, tokenizer, finetuned) -> torch.nn.Module:
    """theta_pre, with the fine-tuned classification head for a classification head (the 0-entry graft)."""
    model = U.load_model(pre, setup, tokenizer)
    if setup.head == "classification":
        heads = U.CLASSIFICATION_HEADS
        head_state = {k: v for k, v in finetuned.state_dict().items() if k.split(".")[0] in heads}
        model.load_state_dict(head_state, strict=False)
    return model


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


def _row(name: str, data: str, report: dict[str, float], entries: str, sparsity: str) -> str:
    agreement = f"{100 * report['agreement']:.1f}" if "agreement" in report else "-"
    return (
        f"| {name} | {data} | {100 * report['accuracy']:.1f} | {100 * report['ece']:.1f} | {100 * report['brier']:.1f} "
        f"| {report['nll']:.3f} | {agreement} | {entries} | {sparsity} |"
    )


def summary_markdown(results: dict) -> str:
    """The summary table (FT vs graft vs pre-trained, per evaluation set), the sweep table and the run times."""
    lines = [
        "| model | eval set | accuracy % | ECE % | Brier % | NLL | agreement with FT % | grafted entries | sparsity |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    stats = results["graft_stats"]
    for data, models in results["metrics"].items():
        lines.append(_row("fine-tuned", data, models["fine-tuned"], "all (dense)", "100%"))
        lines.append(
            _row("graft", data, models["graft"], f"{stats['num_entries']:,}", f"{100 * stats['sparsity']:.4f}%")
        )
        lines.append(_row(results["pretrained_name"], data, models["pretrained"], "0", "0%"))
    lines += ["", f"Stored whole in the graft (new classification head): {stats['modules_to_save_parameters']:,} "
              f"parameters. Sparsity = grafted entries / all {stats['num_parameters']:,} parameters.", ""]  # fmt: skip
    sweep = results["sweep"]
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
    if results.get("timings"):
        lines += ["", "| stage | run time (s) |", "| --- | --- |"]
        lines += [f"| {stage} | {seconds:.0f} |" for stage, seconds in results["timings"].items()]
    return "\n".join(lines) + "\n"


def main(args: list[str] | None = None) -> dict:
    """Parse ``args`` (default: ``sys.argv``), evaluate, write the report, and return the results."""
    parser = HfArgumentParser((U.GraftModelArguments, U.DatasetArguments, EvaluateArguments))
    model_args, dataset_args, eval_args = parser.parse_args_into_dataclasses(args)
    U.setup_logging(None, logger)
    start = time.perf_counter()
    names = eval_args.eval_names or [Path(d).stem for d in eval_args.eval_datasets]
    if len(names) != len(eval_args.eval_datasets):
        raise ValueError(f"eval_names has {len(names)} names for {len(eval_args.eval_datasets)} eval_datasets.")
    report_dir = Path(eval_args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)

    # The task set-up saved by run_finetune.py, the evaluation sets, and the three models.
    pre, ft = model_args.model_name_or_path, model_args.finetuned_model_name_or_path
    setup = U.TaskSetup.load(ft)
    if setup is None:
        raise ValueError(f"{ft!r} has no {U.SETUP_FILE}: evaluate a model fine-tuned with examples/run_finetune.py.")
    tokenizer = U.load_tokenizer(ft, setup.head)
    datasets = {}
    for name, path in zip(names, eval_args.eval_datasets, strict=True):
        frame = U.read_table(
            path,
            eval_args.eval_split,
            dataset_args.dataset_config_name,
            dataset_args.text_column,
            dataset_args.label_column,
        )
        frame = U.encode_labels(frame, setup.label_names)
        if dataset_args.max_eval_samples is not None:
            frame = frame.sample(frac=1.0, random_state=0).iloc[: dataset_args.max_eval_samples]
        datasets[name] = U.by_length(U.tokenize(frame, tokenizer, setup))
        logger.info("Evaluation set %s: %d examples", name, len(datasets[name]))

    predict = Predictor(tokenizer, eval_args.per_device_eval_batch_size, str(report_dir / "tmp"))
    finetuned = U.load_model(ft, setup, tokenizer)
    pretrained = pretrained_with_head(pre, setup, tokenizer, finetuned)
    graft = PeftModel.from_pretrained(U.load_model(pre, setup, tokenizer), eval_args.graft_dirs[0])
    stats = graft.graft_stats()
    models = {"fine-tuned": finetuned, "graft": graft, "pretrained": pretrained}

    metrics, logits = {}, {}
    for data, dataset in datasets.items():
        labels = np.asarray(dataset["labels"])
        logits[data] = {name: predict(model, dataset) for name, model in models.items()}
        metrics[data] = {}
        for name in models:
            reference = None if name == "fine-tuned" else logits[data]["fine-tuned"]
            report = calibration_report(logits[data][name], labels, input_type="logits", reference_preds=reference)
            if eval_args.f1:
                report["f1"] = f1_score(logits[data][name], labels, "binary", input_type="logits")
            metrics[data][name] = report
        for name in ("fine-tuned", "graft"):
            fig = reliability_diagram(logits[data][name], labels, input_type="logits", title=f"{name}, {data}")
            save_figure(fig, report_dir / f"reliability_{name}_{data}.png")

    # Sweep (paper Figure 2): learned regions vs top-k movement and random regions of the same sizes.
    sweep_set = names[0]
    sweep_data = datasets[sweep_set]
    if eval_args.sweep_max_samples is not None and len(sweep_data) > eval_args.sweep_max_samples:
        picked = np.random.default_rng(0).choice(len(sweep_data), eval_args.sweep_max_samples, replace=False)
        sweep_data = sweep_data.select(sorted(picked.tolist()))
    sweep_labels = np.asarray(sweep_data["labels"])

    def accuracy(model: torch.nn.Module) -> float:
        return calibration_report(predict(model, sweep_data), sweep_labels, input_type="logits")["accuracy"]

    sweep: dict[str, dict[str, float]] = {"learned": {}, "top-k movement": {}, "random": {}}
    sizes = set(eval_args.sweep_num_entries or [])
    for directory in eval_args.graft_dirs:
        model = PeftModel.from_pretrained(U.load_model(pre, setup, tokenizer), directory)
        k = model.graft_stats().num_entries
        sweep["learned"][str(k)] = accuracy(model)
        sizes.add(k)
    for k in sorted(sizes):
        for strategy, name in (("movement", "top-k movement"), ("random", "random")):
            model = sweep_model(pre, setup, tokenizer, finetuned, strategy, k, eval_args.sweep_random_seed)
            sweep[name][str(k)] = accuracy(model)
        logger.info("Sweep at %d entries: %s", k, {n: p.get(str(k)) for n, p in sweep.items()})

    references = {"fine-tuned": accuracy(finetuned), "pre-trained" + (" + FT head" if setup.head ==
                  "classification" else ""): accuracy(pretrained)}  # fmt: skip
    sweep_fig = plot_sweep({n: {int(k): v for k, v in p.items()} for n, p in sweep.items() if p}, references,
                           f"Accuracy against region size ({sweep_set})")  # fmt: skip
    save_figure(sweep_fig, report_dir / "sweep_accuracy.png")
    location_fig = plot_locations(stats.per_layer, stats.per_module_type,
                                  f"Where the {stats.num_entries:,} grafted entries sit")  # fmt: skip
    save_figure(location_fig, report_dir / "graft_locations.png")

    timings = json.loads(Path(eval_args.timings_json).read_text()) if eval_args.timings_json else {}
    timings["evaluate"] = time.perf_counter() - start
    results = {
        "metrics": metrics,
        "graft_stats": {
            "num_entries": stats.num_entries,
            "num_parameters": stats.num_parameters,
            "sparsity": stats.sparsity,
            "modules_to_save_parameters": stats.modules_to_save_parameters,
            "per_layer": {str(k): v for k, v in stats.per_layer.items()},
            "per_module_type": stats.per_module_type,
        },
        "pretrained_name": "pre-trained + FT head" if setup.head == "classification" else "pre-trained (zero-shot)",
        "sweep": sweep,
        "sweep_references": references,
        "sweep_set": sweep_set,
        "sweep_examples": len(sweep_data),
        "timings": timings,
    }
    (report_dir / "results.json").write_text(json.dumps(results, indent=2))
    (report_dir / "summary.md").write_text(summary_markdown(results))
    logger.info("Report written to %s", report_dir)
    return results


if __name__ == "__main__":
    main()
