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
``all_results.json``) to ``--output_dir``. ``--save_steps`` checkpoints hold the scores, for
``--resume_from_checkpoint``.

Example::

    python examples/run_graft.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft \
        --dataset_name_or_path mr_train.csv --k_shot 64 --sparsity 1e-4 --output_dir outputs/graft
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import example_utils as U  # examples/ is on sys.path when a script there runs
from peft import get_peft_model
from transformers import DataCollatorWithPadding, HfArgumentParser, IntervalStrategy, set_seed

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.calibration import make_compute_metrics

logger = logging.getLogger(__name__)


@dataclass
class GraftArguments:
    """The initial region gamma_base and the budget of the learned region."""

    sparsity: float = field(
        default=1e-4, metadata={"help": "Size of the region as a fraction of the moved parameters (paper: 1e-4)."}
    )
    base_num_entries: int | None = field(default=None, metadata={"help": "Exact size of gamma_base (over sparsity)."})
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
    select_every: int | None = field(
        default=10,
        metadata={
            "help": "With --validation_dataset: evaluate the mask on train + validation every N steps (and before "
            "the first) and keep the best by their summed accuracy, as the paper selects masks. 0 or None: keep the "
            "last mask. Ignored when --eval_strategy is set."
        },
    )


def main(args: list[str] | None = None) -> dict[str, float]:
    """Parse ``args`` (default: ``sys.argv``), learn the region, save the graft, and return the metrics."""
    parser = HfArgumentParser(
        (U.GraftModelArguments, U.TaskArguments, U.DataArguments, GraftArguments, MaskTrainingArguments)
    )
    model_args, task_args, data_args, graft_args, training_args = parser.parse_args_into_dataclasses(args)
    if training_args.report_to in (None, "all") or training_args.report_to == ["all"]:
        training_args.report_to = []
    U.setup_logging(training_args, logger)
    set_seed(training_args.seed)

    # Load the data (classes in the fine-tuned model's order) and the two models.
    saved = U.TaskSetup.load(model_args.finetuned_model_name_or_path)
    train_frame, eval_frame, label_names = U.load_splits(data_args, saved.label_names if saved else None)
    setup = U.task_setup(task_args, label_names, data_args.max_seq_length, saved)
    tokenizer = U.load_tokenizer(model_args.finetuned_model_name_or_path, setup.head)
    pre = U.load_model(model_args.model_name_or_path, setup, tokenizer)
    finetuned = U.load_model(model_args.finetuned_model_name_or_path, setup, tokenizer)

    # The graft model: theta_pre + gamma * (theta_ft - theta_pre), gamma learned from gamma_base.
    config = GraftConfig(
        finetuned=finetuned,
        sparsity=graft_args.sparsity,
        num_entries=graft_args.base_num_entries,
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
    trainer = MaskTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=make_compute_metrics() if eval_dataset is not None else None,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save the hard sparse graft.
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    setup.save(training_args.output_dir)
    stats = trainer.model.graft_stats()
    Path(training_args.output_dir, "graft_stats.md").write_text(stats.to_markdown() + "\n")
    logger.info(
        "Saved the graft to %s: %d entries (sparsity %.4g%%)", training_args.output_dir, stats.num_entries,
        100 * stats.sparsity,
    )  # fmt: skip
    metrics = {**train_result.metrics, **trainer.mask_report}
    metrics.update(grafted_entries=stats.num_entries, sparsity=stats.sparsity)

    # Evaluate the graft.
    if eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.log_metrics("graft", metrics)
    trainer.save_metrics("graft", metrics)
    return metrics


if __name__ == "__main__":
    main()
