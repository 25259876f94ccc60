#!/usr/bin/env python
"""Fine-tune a model for text classification, the first step of skill localization by grafting.

Three heads (``--head``):

* ``classification``: a linear head on the pooled [CLS] representation (``AutoModelForSequenceClassification``).
* ``mlm_prompt``: prompt-based fine-tuning of a masked LM (LM-BFF without demonstrations, the paper's main setting):
  ``--template "{sentence} It was {mask}." --label_words " terrible, great"``.
* ``causal_prompt``: prompt-based fine-tuning of a causal LM scoring label words at the last prompt token (the paper's
  GPT-2 setting, appendix B.5): ``--template "Review: {sentence} Sentiment:" --label_words " negative, positive"``.

Three restricted variants (paper Tables 1 and 3, and surgical fine-tuning), each through
:class:`peft_graft.RestrictTrainingCallback` on the same trainer, so that every other entry stays bit-identical to the
pre-trained model:

* ``--retrain_region <graft folder>`` (graft re-training): start from ``--model_name_or_path`` (theta_pre) and train
  only the entries of that graft's region, plus a new classification head whole (the graft stores it whole too).
* ``--bitfit`` (BitFit, Ben Zaken et al. 2022): train only the bias tensors, plus a new classification head whole.
* ``--surgical_layers k`` (surgical fine-tuning, Lodha et al. 2023): train only k transformer blocks, plus a new
  classification head whole. ``--surgical_selection fim`` (default) takes the k blocks of highest FIM score (the
  empirical Fisher diagonal of the pre-trained model on ``--fisher_samples`` training examples, summed per block as
  Frobenius norms); ``fim_bottom`` the k lowest; ``random`` k seeded random blocks. Tensors outside also get
  ``requires_grad=False``, so backward stops below the lowest trained block.

Prompt heads have no new head: the LM head is the pre-trained one (frozen by default, as in the paper), so only the
region or the biases train. ``--freeze_embeddings`` / ``--freeze_lm_head`` still apply on top.

Presets (``--preset``; flags given explicitly win):

* ``paper`` (appendix A.2; the default with ``--dataset_name_or_path``): ``--k_shot 16`` examples per class sampled
  with ``--k_shot_seed``, SGD (``--optim sgd``, lr 1e-2, weight decay 1e-4, constant schedule, batch 8) with frozen
  embeddings (and frozen LM head for prompt-based heads), and ``16 x n x min(k, 512)`` steps when ``--max_steps`` is
  not given (``--paper_steps``).
* ``none`` (the default with ``--train_file``, your own CSV or JSON lines file): the whole training file and
  ``TrainingArguments``' own defaults (AdamW, lr 5e-5, linear schedule, 3 epochs), nothing frozen.

With AdamW, ``--movement_l1 1e-3`` adds the paper's L1 penalty on ``|theta - theta_pre|`` (Figure 5), from
:class:`peft_graft.MovementL1Trainer`.

Writes the model, its tokenizer and ``graft_example.json`` (the task set-up run_graft.py and run_evaluate.py read) to
``--output_dir``, with ``train_results.json`` (and ``eval_results.json``) and ``all_results.json``; a restricted run
also writes ``restricted_training.json`` (the method and its trained-entry counts, which run_evaluate.py reports).
``--do_predict --test_file`` writes ``predict_results.txt`` (index and predicted label, as run_glue). Checkpoints
(``--save_strategy steps``) serve resuming and are removed once the model is saved, unless ``--keep_checkpoints``.

Example (offline, packaged assets)::

    python examples/run_finetune.py --model_name_or_path <minilm dir> --dataset_name_or_path mr_train.csv \
        --k_shot 64 --output_dir outputs/ft
    python examples/run_finetune.py --model_name_or_path <minilm dir> --train_file train.csv \
        --validation_file dev.csv --test_file test.csv --do_predict --output_dir outputs/ft_mine
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import example_utils as U  # examples/ is on sys.path when a script there runs
import torch
from transformers import DataCollatorWithPadding, HfArgumentParser, TrainingArguments, set_seed

from peft_graft import MovementL1Trainer, Region, RestrictTrainingCallback
from peft_graft.analysis import rank_stability
from peft_graft.calibration import make_compute_metrics
from peft_graft.scores import fim_layer_scores, fisher_diagonal, top_layers
from peft_graft.training import LayerRankCallback, freeze_outside, layer_region

logger = logging.getLogger(__name__)
SURGICAL_SELECTIONS = ("fim", "fim_bottom", "random")
FIM_RANKS_FILE = "fim_ranks.json"
# What a run writes beside the model: an earlier run's are removed when a run starts (U.clear_results).
RESULT_FILES = (*U.RESULT_FILES, U.RESTRICTION_FILE, FIM_RANKS_FILE)
# --preset: the defaults each one gives (k_shot is DataArguments'); 'paper' is FinetuneTrainingArguments' own defaults.
_TRANSFORMERS_DEFAULTS = {f.name: f.default for f in fields(TrainingArguments)}
PRESETS = {
    "paper": dict(optim="sgd", learning_rate=1e-2, weight_decay=1e-4, lr_scheduler_type="constant",
                  paper_steps=True, freeze_embeddings=True, freeze_lm_head=True),
    "none": dict(**{key: _TRANSFORMERS_DEFAULTS[key] for key in ("optim", "learning_rate", "weight_decay",
                                                                  "lr_scheduler_type")},
                 paper_steps=False, freeze_embeddings=False, freeze_lm_head=False),
}  # fmt: skip


@dataclass
class FinetuneTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with the paper's SGD defaults (appendix A.2), plus what is frozen and the L1 penalty."""

    output_dir: str | None = field(default="outputs/finetune", metadata={"help": "Where to save the model."})
    optim: str = field(default="sgd", metadata={"help": "Optimizer: 'sgd' (paper) or 'adamw_torch'."})
    learning_rate: float = field(default=1e-2, metadata={"help": "Paper grid for SGD: 1e-2, 5e-3, 1e-3."})
    weight_decay: float = field(default=1e-4, metadata={"help": "Paper: 1e-4."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Paper grid: 2, 4, 8."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=20, metadata={"help": "Log every N steps."})
    save_strategy: str = field(default="no", metadata={"help": "The final model is always saved."})
    save_total_limit: int | None = field(
        default=1, metadata={"help": "Checkpoints kept on disk while training (the last ones; resuming needs one)."}
    )
    keep_checkpoints: bool = field(
        default=False, metadata={"help": "Keep the checkpoint-N folders once the model is saved (default: removed)."}
    )
    report_to: str = field(default="none", metadata={"help": "Integrations to report to."})
    paper_steps: bool = field(
        default=True, metadata={"help": "Without --max_steps: 16 x n x min(k, 512) steps (appendix A.2)."}
    )
    freeze_embeddings: bool = field(default=True, metadata={"help": "Freeze the input embeddings (paper, SGD)."})
    freeze_lm_head: bool = field(default=True, metadata={"help": "Freeze the LM head of prompt-based heads (paper)."})
    movement_l1: float = field(
        default=0.0, metadata={"help": "L1 penalty strength on |theta - theta_pre| (paper: 1e-3 with AdamW)."}
    )
    retrain_region: str | None = field(
        default=None,
        metadata={
            "help": "Graft re-training (paper Table 1): a saved graft folder (run_graft.py output). Starting from "
            "--model_name_or_path (theta_pre), train only the entries of that graft's region, plus a new "
            "classification head whole (stored whole in the graft too); every other entry stays bit-identical "
            "(peft_graft.RestrictTrainingCallback). Not with --bitfit."
        },
    )
    bitfit: bool = field(
        default=False,
        metadata={
            "help": "BitFit (paper Table 1): train only the bias tensors, plus a new classification head whole; every "
            "other entry stays bit-identical (peft_graft.RestrictTrainingCallback). Not with --retrain_region."
        },
    )
    surgical_layers: int | None = field(
        default=None,
        metadata={
            "help": "Surgical fine-tuning (Lodha et al. 2023): train only this many transformer blocks, chosen by "
            "--surgical_selection, plus a new classification head whole; every other entry stays bit-identical."
        },
    )
    surgical_selection: str = field(
        default="fim",
        metadata={
            "help": "Which blocks --surgical_layers trains: 'fim' (highest FIM score), 'fim_bottom' (lowest) or "
            "'random' (seeded by --seed).",
            "choices": SURGICAL_SELECTIONS,
        },
    )
    fisher_samples: int = field(
        default=128, metadata={"help": "Training examples for the FIM scores (at most all of them)."}
    )
    fim_rank_every: int | None = field(
        default=None,
        metadata={
            "help": "Record the FIM layer scores before training and every N steps (peft_graft.training."
            "LayerRankCallback, --fisher_samples examples) into fim_ranks.json, with the rank correlation to step 0."
        },
    )


@dataclass
class Restriction:
    """What a restricted run may train: ``allowed`` (given to the callback) and the part of it that is the head."""

    method: str
    allowed: Region
    head: Region
    graft: str | None = None
    details: dict = field(default_factory=dict)  # recorded in restricted_training.json (e.g. the surgical layers)

    def trainable(self, model: torch.nn.Module) -> tuple[int, int]:
        """(entries of ``allowed`` outside the head, entries of the head) in tensors that require gradients."""
        training = {name for name, param in model.named_parameters() if param.requires_grad}
        inside = {name: idx for name, idx in self.allowed.items() if name in training}
        head = sum(int(idx.numel()) for name, idx in self.head.items() if name in training)
        return sum(int(idx.numel()) for idx in inside.values()) - head, head


def head_region(model: torch.nn.Module, setup: U.TaskSetup) -> Region:
    """Every entry of the task's new head: the classification head (``classifier``/``score``, what a graft stores
    whole as ``modules_to_save``); none for prompt heads, which score label words with the pre-trained LM head."""
    if U.modules_to_save(setup) is None:
        return Region()
    heads = U.CLASSIFICATION_HEADS
    return Region({n: torch.arange(p.numel()) for n, p in model.named_parameters() if n.split(".")[0] in heads})


def bias_region(model: torch.nn.Module) -> Region:
    """Every entry of every bias tensor (BitFit's trainable set)."""
    return Region({n: torch.arange(p.numel()) for n, p in model.named_parameters() if n.split(".")[-1] == "bias"})


def surgical_restriction(
    training_args: FinetuneTrainingArguments, model: torch.nn.Module, head: Region, train_dataset
) -> Restriction:
    """The ``--surgical_layers`` blocks (by FIM score of the pre-trained model, or seeded random), plus the head."""
    k, selection = training_args.surgical_layers, training_args.surgical_selection
    if selection not in SURGICAL_SELECTIONS:
        raise ValueError(f"--surgical_selection {selection!r}: use one of {SURGICAL_SELECTIONS}.")
    num_samples = min(training_args.fisher_samples, len(train_dataset))
    fisher = fisher_diagonal(model, train_dataset, num_samples=num_samples, seed=training_args.seed)
    scores = fim_layer_scores(fisher)
    if not 1 <= k <= len(scores):
        raise ValueError(f"--surgical_layers {k}: the model has {len(scores)} transformer blocks; choose 1 to "
                         f"{len(scores)}.")  # fmt: skip
    if selection == "random":
        generator = torch.Generator().manual_seed(training_args.seed)
        layers = sorted(torch.tensor(list(scores))[torch.randperm(len(scores), generator=generator)[:k]].tolist())
    else:
        ranked = top_layers(scores, k) if selection == "fim" else top_layers({i: -v for i, v in scores.items()}, k)
        layers = sorted(ranked)
    logger.info("FIM scores of the blocks (%d examples): %s; training blocks %s (%s)", num_samples,
                {i: f"{v:.3g}" for i, v in scores.items()}, layers, selection)  # fmt: skip
    details = {"layers": layers, "selection": selection, "fim_scores": scores, "fisher_samples": num_samples}
    return Restriction(f"surgical ({selection}, {k} blocks)", layer_region(model, layers) | head, head, None, details)


def restriction_for(
    training_args: FinetuneTrainingArguments, model: torch.nn.Module, setup: U.TaskSetup, train_dataset
) -> Restriction | None:
    """The region a ``--retrain_region``, ``--bitfit`` or ``--surgical_layers`` run may train (None: an ordinary
    fine-tuning run)."""
    chosen = [training_args.retrain_region is not None, training_args.bitfit, training_args.surgical_layers is not None]
    if sum(chosen) > 1:
        raise ValueError(
            "--retrain_region (graft re-training), --bitfit and --surgical_layers are mutually exclusive: each names "
            "what may train."
        )
    if not any(chosen):
        return None
    head = head_region(model, setup)
    if training_args.surgical_layers is not None:
        return surgical_restriction(training_args, model, head, train_dataset)
    if training_args.bitfit:
        return Restriction("BitFit", bias_region(model) | head, head)
    graft = training_args.retrain_region
    saved = U.TaskSetup.load(graft)
    if saved is not None and (saved.head, saved.label_names) != (setup.head, setup.label_names):
        raise ValueError(
            f"--retrain_region {graft!r} is a graft for head={saved.head!r} with classes {saved.label_names}, but this "
            f"run has head={setup.head!r} with classes {setup.label_names}: re-train a graft of the same task set-up."
        )
    region = Region.from_pretrained(graft, model)  # a ValueError when the folder is not a graft of this model
    return Restriction("graft re-training", region | head, head, graft)


def paper_max_steps(num_labels: int, k: int | None) -> int:
    """``16 x n x k`` steps for k-shot training with n labels, capped at ``k = 512`` (appendix A.2)."""
    return 16 * num_labels * min(k if k is not None else 512, 512)


def main(args: list[str] | None = None) -> dict[str, float]:
    """Parse ``args`` (default: ``sys.argv``), fine-tune, save the model, and return the train/eval metrics."""
    parser = HfArgumentParser((U.ModelArguments, U.TaskArguments, U.DataArguments, FinetuneTrainingArguments))
    model_args, task_args, data_args, training_args = U.parse_with_preset(parser, args, PRESETS)
    U.setup_logging(training_args, logger)
    optim = getattr(training_args.optim, "value", training_args.optim)
    logger.info("Settings of the %s", U.describe_preset(data_args.preset, {
        "k_shot": data_args.k_shot or "all", "optim": optim, "learning_rate": training_args.learning_rate,
        "freeze_embeddings": training_args.freeze_embeddings,
    }))  # fmt: skip
    set_seed(training_args.seed)

    # Load the data and the model.
    train_frame, eval_frame, label_names = U.load_splits(data_args)
    test_frame = U.load_test(data_args, label_names, training_args.do_predict)
    setup = U.task_setup(task_args, label_names, data_args.max_seq_length)
    tokenizer = U.load_tokenizer(model_args.model_name_or_path, setup.head)
    model = U.load_model(model_args.model_name_or_path, setup, tokenizer)
    frozen = U.freeze(model, training_args.freeze_embeddings, training_args.freeze_lm_head)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("Frozen: %d tensors; trainable parameters: %d", len(frozen), trainable)

    # Preprocess.
    train_dataset = U.tokenize(train_frame, tokenizer, setup)
    eval_dataset = None if eval_frame is None else U.by_length(U.tokenize(eval_frame, tokenizer, setup))

    restriction = restriction_for(training_args, model, setup, train_dataset)
    callbacks, body, head = [], trainable, 0
    if restriction is not None:
        body, head = restriction.trainable(model)
        ignored = restriction.allowed.num_entries - body - head
        if body + head == 0:
            raise ValueError(
                f"{restriction.method} would train nothing: the model has no trainable entry in its region "
                f"({restriction.allowed.num_entries} entries, all in frozen tensors or none at all)."
            )
        if ignored:  # expected for BitFit (the frozen embeddings' LayerNorm bias), not for a graft's region
            level = logging.INFO if training_args.bitfit else logging.WARNING
            logger.log(level, "%s: %d allowed entries lie in frozen tensors (--freeze_embeddings/--freeze_lm_head) "
                       "and stay at theta_pre", restriction.method, ignored)  # fmt: skip
        logger.info(
            "%s: trainable entries %d (%d outside the head, head %d, in %d tensors); every other of the %d entries "
            "stays bit-identical", restriction.method, body + head, body, head, len(restriction.allowed),
            sum(p.numel() for p in model.parameters()),
        )  # fmt: skip
        callbacks.append(RestrictTrainingCallback(allowed=restriction.allowed))
        if training_args.surgical_layers is not None:  # whole blocks: backward need not reach the frozen ones
            freeze_outside(model, restriction.allowed)
    ranks = None
    if training_args.fim_rank_every is not None:
        num_samples = min(training_args.fisher_samples, len(train_dataset))
        ranks = LayerRankCallback(train_dataset, training_args.fim_rank_every, num_samples, seed=training_args.seed)
        callbacks.append(ranks)

    # Train.
    if training_args.max_steps <= 0 and training_args.paper_steps:
        training_args.max_steps = paper_max_steps(setup.num_labels, data_args.k_shot or None)
        logger.info("max_steps = 16 x n x min(k, 512) = %d (appendix A.2)", training_args.max_steps)
    labelled_sets = eval_dataset is not None or (test_frame is not None and "label" in test_frame)
    U.clear_results(training_args.output_dir, RESULT_FILES, logger)
    trainer = MovementL1Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=make_compute_metrics(input_type="logits") if labelled_sets else None,
        movement_l1=training_args.movement_l1,
        callbacks=callbacks,
    )
    U.compact_logs(trainer, logger)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save.
    U.inner_model(model).save_pretrained(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    setup.save(training_args.output_dir)
    record = Path(training_args.output_dir, U.RESTRICTION_FILE)
    if restriction is not None:
        record.write_text(json.dumps({"method": restriction.method, "graft": restriction.graft, "entries": body,
                                      "head_entries": head, "trainable_entries": body + head,
                                      **restriction.details}, indent=2))  # fmt: skip
    if ranks is not None:
        history = {
            step: {str(layer): score for layer, score in scores.items()} for step, scores in ranks.history.items()
        }
        Path(training_args.output_dir, FIM_RANKS_FILE).write_text(json.dumps(
            {"history": history, "rank_correlation_with_step_0": rank_stability(ranks.history)}, indent=2))  # fmt: skip
    logger.info("Saved the fine-tuned model to %s", training_args.output_dir)
    metrics = dict(train_result.metrics, trainable_entries=body + head)
    trainer.save_metrics("train", metrics)
    trainer.save_state()  # trainer_state.json: every logged record (the checkpoints holding it may be removed)
    U.log_results(logger, "train", metrics, training_args.output_dir)

    # Evaluate.
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        trainer.save_metrics("eval", eval_metrics)
        U.log_results(logger, "eval", eval_metrics, training_args.output_dir)
        metrics.update(eval_metrics)

    # Predict.
    if test_frame is not None:
        metrics.update(U.predict_and_save(trainer, test_frame, tokenizer, setup, training_args.output_dir))
    if not training_args.keep_checkpoints:
        U.remove_checkpoints(training_args.output_dir, logger)
    return metrics


if __name__ == "__main__":
    main()
