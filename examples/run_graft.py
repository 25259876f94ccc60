#!/usr/bin/env python
"""Learn the grafting region of a fine-tuned model and save the sparse graft (paper section 2.3, Eq. 3-4).

Builds ``get_peft_model(pre, GraftConfig(finetuned=ft, sparsity=..., learn_region=True))`` from the pre-trained and
fine-tuned checkpoints, trains the region scores with :class:`peft_graft.MaskTrainer` (paper defaults: SGD,
learning rate 1e7, 100 steps, full batch up to 1024 examples) on the same k-shot training set as the fine-tuning,
and saves the hard sparse graft (loadable with ``PeftModel.from_pretrained(pre, output_dir)``).

The task set-up (head, template, label words, classes) is read from the fine-tuned folder (``graft_example.json``,
written by run_finetune.py); for other fine-tuned models give ``--head`` (and ``--template``/``--label_words``).
A new classification head is saved whole (``modules_to_save=["classifier"]``), outside the sparsity budget.

Example::

    python examples/run_graft.py --model_name_or_path <pre> --finetuned_model_name_or_path outputs/ft \
        --dataset_name_or_path mr_train.csv --k_shot 64 --sparsity 1e-4 --output_dir outputs/graft
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import utils_data as U  # examples/ is on sys.path when a script there runs
from peft import get_peft_model
from run_finetune import setup_logging
from transformers import DataCollatorWithPadding, HfArgumentParser, set_seed

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.calibration import make_compute_metrics

logger = logging.getLogger(__name__)


@dataclass
class GraftArguments:
    """The two checkpoints and the initial region gamma_base."""

    model_name_or_path: str = field(metadata={"help": "Pre-trained model theta_pre: local folder or Hub id."})
    finetuned_model_name_or_path: str = field(metadata={"help": "Fine-tuned model theta_ft: local folder or Hub id."})
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
    candidates: float | None = field(
        default=None,
        metadata={
            "help": "Learn S only on the top fraction (<= 1) or number (> 1) of entries by movement plus gamma_base "
            "(GraftConfig.candidates; not in the paper, cheaper). Default: S on every entry, as the paper."
        },
    )
    head: str | None = field(default=None, metadata={"help": "Head when the fine-tuned folder has no set-up file."})
    template: str | None = field(default=None, metadata={"help": "Prompt template (prompt heads, no set-up file)."})
    label_words: str | None = field(default=None, metadata={"help": "Label words (prompt heads, no set-up file)."})


def task_setup(directory: str, head: str | None, template: str | None, label_words: str | None, labels, length):
    """The set-up saved by run_finetune.py in ``directory``, or one built from the flags."""
    setup = U.TaskSetup.load(directory) if Path(directory).is_dir() else None
    if setup is None:
        head = head or "classification"
        U.check_head(head)
        setup = U.TaskSetup(head, labels, template or U.DEFAULT_TEMPLATES.get(head), U.parse_label_words(label_words))
    setup.max_seq_length = length
    return setup


def modules_to_save(setup: U.TaskSetup) -> list[str] | None:
    """A classification head is new: graft it whole, outside the budget (prompt heads reuse the LM head)."""
    return ["classifier", "score"] if setup.head == "classification" else None


def main(args: list[str] | None = None) -> dict[str, float]:
    """Parse ``args`` (default: ``sys.argv``), learn the region, save the graft, and return the metrics."""
    parser = HfArgumentParser((GraftArguments, U.DataArguments, MaskTrainingArguments))
    graft_args, data_args, training_args = parser.parse_args_into_dataclasses(args)
    if training_args.report_to in (None, "all") or training_args.report_to == ["all"]:
        training_args.report_to = []
    setup_logging(training_args)
    set_seed(training_args.seed)

    saved = U.TaskSetup.load(graft_args.finetuned_model_name_or_path) if Path(
        graft_args.finetuned_model_name_or_path
    ).is_dir() else None  # fmt: skip
    train_frame, eval_frame, label_names = U.load_splits(data_args, saved.label_names if saved else None)
    setup = task_setup(
        graft_args.finetuned_model_name_or_path,
        graft_args.head,
        graft_args.template,
        graft_args.label_words,
        label_names,
        data_args.max_seq_length,
    )
    tokenizer = U.load_tokenizer(graft_args.finetuned_model_name_or_path, setup.head)
    pre = U.load_model(graft_args.model_name_or_path, setup, tokenizer)
    finetuned = U.load_model(graft_args.finetuned_model_name_or_path, setup, tokenizer)
    config = GraftConfig(
        finetuned=finetuned,
        sparsity=graft_args.sparsity,
        num_entries=graft_args.base_num_entries,
        region=graft_args.region,
        seed=training_args.seed,
        learn_region=True,
        candidates=None if graft_args.candidates is None else _count_or_fraction(graft_args.candidates),
        modules_to_save=modules_to_save(setup),
    )
    model = get_peft_model(pre, config)
    del finetuned
    base_entries = model.graft_stats().num_entries
    logger.info("gamma_base: %d entries (%s)", base_entries, graft_args.region)
    if graft_args.keep_budget and training_args.num_entries is None and base_entries > 0:
        training_args.num_entries = base_entries

    train_dataset = U.tokenize(train_frame, tokenizer, setup)
    eval_dataset = None if eval_frame is None else U.by_length(U.tokenize(eval_frame, tokenizer, setup))
    trainer = MaskTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=make_compute_metrics() if eval_dataset is not None else None,
    )
    train_result = trainer.train()
    metrics = {**train_result.metrics, **trainer.mask_report}
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    setup.save(training_args.output_dir)
    stats = trainer.model.graft_stats()
    metrics.update(grafted_entries=stats.num_entries, sparsity=stats.sparsity)
    Path(training_args.output_dir, "graft_stats.md").write_text(stats.to_markdown() + "\n")
    logger.info("Saved the graft to %s\n%s", training_args.output_dir, stats.to_markdown())
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        metrics.update(eval_metrics)
    trainer.log_metrics("graft", metrics)
    Path(training_args.output_dir, "graft_results.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _count_or_fraction(value: float) -> float | int:
    """``GraftConfig.candidates`` takes a fraction (float) or a count (int): ``5000.0`` on the command line is 5000."""
    return int(value) if value > 1 and value == int(value) else value


if __name__ == "__main__":
    main()
