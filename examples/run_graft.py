#!/usr/bin/env python
"""Learn the grafting region of a fine-tuned model and save the sparse graft (paper section 2.3, Eq. 3-4).

Builds ``get_peft_model(pre, GraftConfig(finetuned=ft, sparsity=..., learn_region=True))`` from the pre-trained and
fine-tuned checkpoints, trains the region scores with :class:`peft_graft.MaskTrainer` (paper defaults: SGD,
learning rate 1e7, 100 steps, full batch up to 1024 examples) on the same k-shot training set as the fine-tuning,
and saves the hard sparse graft (loadable with ``PeftModel.from_pretrained(pre, output_dir)``).

The task set-up (head, template, label words, classes) is read from the fine-tuned folder (``graft_example.json``,
written by run_finetune.py); for other fine-tuned models give ``--head`` (and ``--template``/``--label_words``).
A new classification head is saved whole (``modules_to_save=["classifier"]``), outside the sparsity budget.

Writes the graft, its tokenizer, ``graft_example.json``, ``graft_stats.md`` and ``graft_results.json`` (with
``all_results.json``) to ``--output_dir``; with ``--do_predict --test_file``, the graft's ``predict_results.txt``
(index and predicted label, as run_glue). ``--save_steps`` checkpoints hold the dense scores, for
``--resume_from_checkpoint``: the last one is kept while training (``--save_total_limit 1``) and removed once the graft
is saved, unless ``--keep_checkpoints``.

Presets (``--preset``) only choose the training set here, the mask training's defaults being the paper's: ``paper``
(the default with ``--dataset_name_or_path``) samples ``--k_shot 16`` examples per class, ``none`` (the default with
``--train_file``) uses the file whole. Learn the mask on the examples the model was fine-tuned on.

With a validation set the mask is selected among those evaluated (``--select_every``, gamma_base included) with a sign
test by default: a learned mask replaces gamma_base only if it is more accurate on the selection examples at level
``--selection_alpha`` (default 0.05, Bonferroni over the evaluated masks); ``--selection_alpha none`` turns the test
off (the best selection metric wins, the paper's selection). ``graft_results.json`` records how far the kept region
moved from gamma_base (``entries_changed_from_start``, ``iou_with_start``), the step kept (``selected_step``) and, with
the sign test, the best learned mask's p-value and step, kept or not (``best_learned_p_value``,
``best_learned_step``).

Example::

    python examples/run_graft.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft \
        --dataset_name_or_path mr_train.csv --k_shot 64 --sparsity 1e-4 --output_dir outputs/graft
    python examples/run_graft.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft_mine \
        --train_file train.csv --validation_file dev.csv --test_file test.csv --do_predict --output_dir outputs/g
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import example_utils as U  # examples/ is on sys.path when a script there runs
from peft import get_peft_model
from transformers import DataCollatorWithPadding, HfArgumentParser, IntervalStrategy, set_seed

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.calibration import make_compute_metrics
from peft_graft.parameter_layout import num_base_parameters

logger = logging.getLogger(__name__)
# --preset: 'paper' and 'none' differ in the training set only (DataArguments.k_shot); both keep one checkpoint.
PRESETS = {"paper": {"save_total_limit": 1}, "none": {"save_total_limit": 1}}
# The sign test's level when the mask is selected on a validation set by accuracy and --selection_alpha is not given.
SELECTION_ALPHA = 0.05
# What a run writes beside the graft: an earlier run's are removed when a run starts (U.clear_results).
RESULT_FILES = (*U.RESULT_FILES, "graft_results.json", "graft_stats.md")


@dataclass
class GraftArguments:
    """The initial region gamma_base and the budget of the learned region."""

    sparsity: float = field(
        default=1e-4,
        metadata={
            "help": "Size of the region as a fraction of the moved parameters (GraftConfig's sparsity); for a "
            "fraction of all parameters (the paper's sizes) use --fraction_of_parameters."
        },
    )
    fraction_of_parameters: float | None = field(
        default=None,
        metadata={
            "help": "Size of the region as a fraction of all parameters of the model (heads included), as the paper "
            "counts (1e-4: its 0.01 percent) and the reports' fraction_of_parameters. Overrides --sparsity."
        },
    )
    base_num_entries: int | None = field(
        default=None, metadata={"help": "Exact size of gamma_base (overrides --sparsity and --fraction_of_parameters)."}
    )
    region: str = field(
        default="movement",
        metadata={"help": "gamma_base: 'movement' (top-k |theta_ft - theta_pre|, paper), 'random' or 'empty'."},
    )
    keep_budget: bool = field(
        default=True,
        metadata={"help": "Keep exactly |gamma_base| entries after training (else round(gamma), the paper)."},
    )
    search_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Learn S only on this fraction of the entries (top movement) plus gamma_base (GraftConfig."
            "search_fraction; not in the paper, cheaper). Default: S on every entry, as the paper."
        },
    )
    search_entries: int | None = field(
        default=None, metadata={"help": "Learn S only on this many top-movement entries plus gamma_base."}
    )
    select_metric: str = field(
        default="accuracy",
        metadata={
            "help": "Metric summed over train + validation to select the mask: accuracy, or loss (lower is better)."
        },
    )
    exclude_parameters: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes of parameters never grafted (e.g. 'pooler', as the paper's reference code)."},
    )
    score_init_width: float = field(
        default=0.0,
        metadata={"help": "S starts uniform in [-10, -10 + width) (the reference code: 1); 0: constant -10."},
    )
    select_on: str = field(
        default="train+validation",
        metadata={
            "help": "Data the mask is selected on: 'train+validation' (summed, the paper) or 'validation' (only: "
            "unbiased when the k-shot training set, which S is fitted to, is balanced and the task is not)."
        },
    )
    keep_checkpoints: bool = field(
        default=False,
        metadata={"help": "Keep the checkpoint-N folders (dense scores S) once the graft is saved (default: removed)."},
    )
    select_every: int | None = field(
        default=10,
        metadata={
            "help": "With --validation_dataset: evaluate the mask on train + validation every N steps (and before "
            "the first) and keep the best by their summed accuracy, as the paper selects masks. 0 or None: keep the "
            "last mask. Ignored when --eval_strategy is set."
        },
    )

    def __post_init__(self) -> None:
        fraction = self.fraction_of_parameters
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"--fraction_of_parameters {fraction}: give a fraction in (0, 1], e.g. 1e-4 for 0.01%.")


def main(args: list[str] | None = None) -> dict[str, float]:
    """Parse ``args`` (default: ``sys.argv``), learn the region, save the graft, and return the metrics."""
    args, alpha_given = selection_alpha_flag(args)
    parser = HfArgumentParser(
        (U.GraftModelArguments, U.TaskArguments, U.DataArguments, GraftArguments, MaskTrainingArguments)
    )
    model_args, task_args, data_args, graft_args, training_args = U.parse_with_preset(parser, args, PRESETS)
    if training_args.report_to in (None, "all") or training_args.report_to == ["all"]:
        training_args.report_to = []
    U.setup_logging(training_args, logger)
    logger.info("Settings of the %s", U.describe_preset(data_args.preset, {"k_shot": data_args.k_shot or "all"}))
    set_seed(training_args.seed)

    # Load the data (classes in the fine-tuned model's order) and the two models.
    saved = U.TaskSetup.load(model_args.finetuned_model_name_or_path)
    train_frame, eval_frame, label_names = U.load_splits(data_args, saved.label_names if saved else None)
    test_frame = U.load_test(data_args, label_names, training_args.do_predict)
    setup = U.task_setup(task_args, label_names, data_args.max_seq_length, saved)
    tokenizer = U.load_tokenizer(model_args.finetuned_model_name_or_path, setup.head)
    pre = U.load_model(model_args.model_name_or_path, setup, tokenizer)
    finetuned = U.load_model(model_args.finetuned_model_name_or_path, setup, tokenizer)

    # The graft model: theta_pre + gamma * (theta_ft - theta_pre), gamma learned from gamma_base.
    num_entries = graft_args.base_num_entries
    if num_entries is None and graft_args.fraction_of_parameters is not None:
        num_entries = max(1, round(graft_args.fraction_of_parameters * num_base_parameters(pre)))
    config = GraftConfig(
        finetuned=finetuned,
        sparsity=graft_args.sparsity,
        num_entries=num_entries,
        region=graft_args.region,
        seed=training_args.seed,
        learn_region=True,
        search_fraction=graft_args.search_fraction,
        search_entries=graft_args.search_entries,
        score_init_width=graft_args.score_init_width,
        exclude_parameters=graft_args.exclude_parameters,
        modules_to_save=U.modules_to_save(setup),
    )
    model = get_peft_model(pre, config)
    del finetuned
    base_entries = model.graft_stats().num_entries
    logger.info("gamma_base: %d entries (%s)", base_entries, graft_args.region)
    if graft_args.keep_budget and training_args.num_entries is None and base_entries > 0:
        training_args.num_entries = base_entries

    # Preprocess.
    train_dataset = U.tokenize(train_frame, tokenizer, setup)
    eval_dataset = None if eval_frame is None else U.by_length(U.tokenize(eval_frame, tokenizer, setup))

    # Learn the region; with a validation set, keep the best mask by train + validation accuracy (gamma_base included).
    if eval_dataset is not None and graft_args.select_every and training_args.eval_strategy == "no":
        training_args.eval_strategy = IntervalStrategy.STEPS
        training_args.eval_steps = graft_args.select_every
        if graft_args.select_on not in ("train+validation", "validation"):
            raise ValueError(f"--select_on {graft_args.select_on!r}: use 'train+validation' or 'validation'.")
        on_train = graft_args.select_on == "train+validation"
        training_args.select_on_train = on_train
        training_args.metric_for_best_model = f"{'train_plus_eval_' if on_train else ''}{graft_args.select_metric}"
        training_args.greater_is_better = graft_args.select_metric not in ("loss", "nll", "ece", "brier")
    # Masks selected on a validation set by accuracy (here, or by your own --eval_strategy): the sign test by default.
    by_accuracy = str(training_args.metric_for_best_model).removeprefix("eval_").endswith("accuracy")
    selecting = eval_dataset is not None and training_args.eval_strategy != "no"
    if selecting and by_accuracy and not alpha_given:
        training_args.selection_alpha = SELECTION_ALPHA
    if selecting:
        logger.info("Mask selection by %s: %s", training_args.metric_for_best_model,
                    "the best value, no sign test" if training_args.selection_alpha is None else
                    f"sign test at level {training_args.selection_alpha} (--selection_alpha none: off)")  # fmt: skip
    labelled_sets = eval_dataset is not None or (test_frame is not None and "label" in test_frame)
    U.clear_results(training_args.output_dir, RESULT_FILES, logger)
    trainer = MaskTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=make_compute_metrics(input_type="logits") if labelled_sets else None,
    )
    U.compact_logs(trainer, logger)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save the hard sparse graft.
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    setup.save(training_args.output_dir)
    stats = trainer.model.graft_stats()
    Path(training_args.output_dir, "graft_stats.md").write_text(stats.to_markdown() + "\n")
    logger.info(
        "Saved the graft to %s: %d entries (%.4g%% of all parameters)", training_args.output_dir,
        stats.num_entries, 100 * stats.fraction_of_parameters,
    )  # fmt: skip
    metrics = {**train_result.metrics, **trainer.mask_report}
    metrics.update(grafted_entries=stats.num_entries, fraction_of_parameters=stats.fraction_of_parameters)

    # Evaluate the graft.
    if eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.save_metrics("graft", metrics)
    trainer.save_state()  # trainer_state.json: every logged record (the checkpoints holding it are removed)
    U.log_results(logger, "graft", metrics, training_args.output_dir)

    # Predict with the graft.
    if test_frame is not None:
        metrics.update(U.predict_and_save(trainer, test_frame, tokenizer, setup, training_args.output_dir))
    if not graft_args.keep_checkpoints:
        U.remove_checkpoints(training_args.output_dir, logger)
    return metrics


def selection_alpha_flag(args: list[str] | None) -> tuple[list[str], bool]:
    """``args`` (default ``sys.argv[1:]``) without a ``--selection_alpha none`` (the sign test off), and whether
    ``--selection_alpha`` was given."""
    argv = list(sys.argv[1:] if args is None else args)
    for i, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if name == "--selection_alpha":
            value = value if equals else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.lower() == "none":
                del argv[i : i + (1 if equals else 2)]
            return argv, True
    return argv, False


if __name__ == "__main__":
    main()
