"""What the example scripts share: their argument dataclasses, logging, the task set-up, data and model loading.

run_finetune.py, run_graft.py and run_evaluate.py import this module; they never import each other.

Every dataset argument is a local file (``.csv``, ``.tsv``, ``.json``, ``.jsonl``, ``.parquet``), a folder written by
``Dataset.save_to_disk``, or a Hub dataset id (``"glue"`` with ``dataset_config_name="sst2"``); every model argument is
a local folder or a Hub model id. Local files are read by :func:`read_frame` (no ``load_dataset("csv")`` cache side
effects); examples/README.md ("Your data files") says how each format, text and label is read.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import logging
import os
import re
import shlex
import shutil
import sys
import unicodedata
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import torch
import transformers
from datasets import Dataset, load_dataset, load_from_disk
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from peft_graft.prompting import LabelWordClassifier, label_word_ids

logger = logging.getLogger(__name__)

HEADS = ("classification", "mlm_prompt", "causal_prompt")
TABLE_SUFFIXES = {".csv": ",", ".tsv": "\t", ".txt": "\t"}
DATA_FILE_SUFFIXES = (*TABLE_SUFFIXES, ".json", ".jsonl", ".parquet")
# The text column read when --text_column is not given, in this order (run_glue's habit: 'sentence' or 'text').
TEXT_COLUMNS = ("text", "sentence")
# --preset: 'paper' is the paper's few-shot setting (appendix A.2), 'none' leaves the user's data and transformers'
# TrainingArguments as they are. Each script says what its presets set (PRESETS in run_finetune.py / run_graft.py).
PRESET_NAMES = ("paper", "none")
PAPER_K_SHOT = 16
PREDICTIONS_FILE = "predict_results.txt"
# Tab-separated text files are read as plain UTF-8 lines split at tabs: their texts may hold unbalanced '"' characters,
# which csv quoting would join across lines.
UNQUOTED_SUFFIXES = (".tsv", ".txt")
SETUP_FILE = "graft_example.json"
# Written beside a model trained by run_finetune.py --retrain_region / --bitfit: the method and its trained entries.
RESTRICTION_FILE = "restricted_training.json"
DEFAULT_TEMPLATES = {"mlm_prompt": "{sentence} It was {mask}.", "causal_prompt": "Review: {sentence} Sentiment:"}
# The heads AutoModelForSequenceClassification adds (BERT-like: classifier, decoder-only: score). A pre-trained
# checkpoint has none: fine-tuning trains it, and a graft stores theta_ft's head whole (modules_to_save).
CLASSIFICATION_HEADS = ("classifier", "score")


# ------------------------------------------------------------------------------------------------------- arguments
@dataclass
class ModelArguments:
    """The pre-trained model theta_pre."""

    model_name_or_path: str = field(metadata={"help": "Pre-trained model theta_pre: local folder or Hub id."})


@dataclass
class GraftModelArguments(ModelArguments):
    """theta_pre and the fine-tuned model theta_ft whose skill is grafted."""

    finetuned_model_name_or_path: str = field(
        metadata={"help": "Fine-tuned model theta_ft (run_finetune.py output): local folder or Hub id."}
    )


@dataclass
class TaskArguments:
    """How a model reads the task. run_graft.py takes them from the fine-tuned folder's set-up file when it has one."""

    head: str | None = field(
        default=None,
        metadata={"help": f"One of {HEADS}; default 'classification' (run_graft.py: the fine-tuned model's head)."},
    )
    template: str | None = field(
        default=None,
        metadata={"help": "Prompt template with {sentence} (and {mask} for mlm_prompt); default per head."},
    )
    label_words: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated label words in class order, each one token (spaces kept), e.g. ' bad, good'."
        },
    )

    def __post_init__(self) -> None:
        if self.head is not None:
            check_head(self.head)


@dataclass
class DatasetArguments:
    """How to read every dataset argument: the Hub config and the two columns."""

    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset config, e.g. 'sst2'."})
    text_column: str | None = field(
        default=None,
        metadata={"help": "Column with the text. Default: 'text', else 'sentence' (whichever the data has)."},
    )
    label_column: str = field(
        default="label", metadata={"help": "Column with the label (any values: class names are its sorted values)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate every evaluation set."})


@dataclass(kw_only=True)
class DataArguments(DatasetArguments):
    """The training data (k-shot sampled or whole), an optional validation set and an optional test set to predict.

    The training data is either your own file (``--train_file``, run_glue's flags) or any dataset argument
    (``--dataset_name_or_path``); ``--preset`` (see each script) says whether the paper's k-shot sample applies.
    """

    dataset_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Training data: local csv/tsv/json(l)/parquet, save_to_disk folder or Hub id ('glue'). Default "
            "preset: paper (k-shot sample). Give this or --train_file."
        },
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "Your own training data: a CSV or JSON lines file (.csv, .tsv, .json, .jsonl, .parquet) with a "
            "text column ('text' or 'sentence', or --text_column) and a label column ('label', or --label_column). "
            "Used whole unless --k_shot is given (default preset: none). Give this or --dataset_name_or_path."
        },
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "Your own validation file (columns as --train_file); evaluated after training."}
    )
    test_file: str | None = field(
        default=None,
        metadata={
            "help": "File to predict with --do_predict (columns as --train_file; the label column is optional): "
            f"writes {PREDICTIONS_FILE} (index and predicted label), and predict_results.json when it has labels."
        },
    )
    preset: str | None = field(
        default=None,
        metadata={
            "help": "'paper': the paper's few-shot settings (appendix A.2; the default with --dataset_name_or_path); "
            "'none': your data whole and transformers' defaults (the default with --train_file). Flags given "
            "explicitly win over the preset.",
            "choices": PRESET_NAMES,
        },
    )
    train_split: str = field(default="train", metadata={"help": "Split of a Hub/on-disk dataset to train on."})
    validation_dataset: str | None = field(default=None, metadata={"help": "Optional evaluation set (same forms)."})
    validation_split: str = field(default="validation", metadata={"help": "Split of validation_dataset."})
    k_shot: int | None = field(
        default=None,
        metadata={"help": "Training examples per class, sampled with --k_shot_seed (0: all of them). Default: the "
                  f"preset's (paper: {PAPER_K_SHOT}, none: all)."},
    )  # fmt: skip
    k_shot_seed: int = field(default=42, metadata={"help": "Seed of the k-shot sample."})
    max_seq_length: int = field(default=64, metadata={"help": "Maximum tokens per example (prompt included)."})

    def __post_init__(self) -> None:
        if (self.dataset_name_or_path is None) == (self.train_file is None):
            raise ValueError(
                "Give the training data once: --train_file (your own CSV or JSON lines file) or --dataset_name_or_path "
                f"(a file, save_to_disk folder or Hub id); got train_file={self.train_file!r}, "
                f"dataset_name_or_path={self.dataset_name_or_path!r}."
            )
        if self.validation_file is not None and self.validation_dataset is not None:
            raise ValueError("--validation_file and --validation_dataset both name the validation set: give one.")
        for name in ("train_file", "validation_file", "test_file"):
            check_data_file(getattr(self, name), f"--{name}")
        if self.preset is None:
            self.preset = "none" if self.train_file is not None else "paper"
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"--preset {self.preset!r}: use one of {PRESET_NAMES}.")
        if self.k_shot is None:
            self.k_shot = PAPER_K_SHOT if self.preset == "paper" else 0

    @property
    def training_data(self) -> str:
        return self.train_file or self.dataset_name_or_path

    @property
    def validation_data(self) -> str | None:
        return self.validation_file or self.validation_dataset


def check_data_file(path: str | None, flag: str) -> None:
    """A ``--train_file``-style argument must be an existing file of a readable kind."""
    if path is None:
        return
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path!r} does not exist: pass an existing CSV or JSON lines file.")
    if Path(path).suffix.lower() not in DATA_FILE_SUFFIXES:
        raise ValueError(f"{flag} {path!r}: unsupported suffix; use one of {', '.join(DATA_FILE_SUFFIXES)}.")


def preset_of(args: list[str] | None) -> str:
    """The ``--preset`` given in ``args`` (default ``sys.argv``), else 'none' with ``--train_file`` and 'paper'."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--preset", default=None)
    peek.add_argument("--train_file", default=None)
    known, _ = peek.parse_known_args(sys.argv[1:] if args is None else args)
    if known.preset is not None:
        return known.preset  # an unknown name is refused by the parser's choices
    return "none" if known.train_file is not None else "paper"


def parse_with_preset(parser: argparse.ArgumentParser, args: list[str] | None, presets: dict[str, dict]) -> tuple:
    """``parser.parse_args_into_dataclasses(args)`` with the defaults of the chosen preset (:func:`preset_of`).

    A preset only moves defaults: every flag given on the command line wins. Progress bars are off by default when
    stderr (where tqdm draws) is not a terminal, so a redirected log holds no carriage returns or cursor codes;
    ``--disable_tqdm false`` turns them on.
    """
    parser.set_defaults(disable_tqdm=not sys.stderr.isatty(), **presets.get(preset_of(args), {}))
    return parser.parse_args_into_dataclasses(args)


def describe_preset(preset: str, values: dict) -> str:
    """``"preset 'paper': k_shot=16, optim=sgd, ..."``, for the log."""
    return f"preset {preset!r}: " + ", ".join(f"{key}={value}" for key, value in values.items())


# ------------------------------------------------------------------------------------------------------- logging
def setup_logging(training_args: TrainingArguments | None, script_logger: logging.Logger) -> None:
    """run_glue.py's logging, with the example's own lines at INFO and transformers/datasets at WARNING by default.

    ``--log_level`` (``--log_level_replica`` on the other processes) sets all of them.
    """
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args is None:
        library_level, own_level = transformers.utils.logging.get_verbosity(), logging.INFO
    else:
        library_level = training_args.get_process_log_level()
        passive = training_args.should_log and training_args.log_level == "passive"
        own_level = logging.INFO if passive else library_level
    for name in (script_logger.name, __name__, "peft_graft"):
        logging.getLogger(name).setLevel(own_level)
    datasets.utils.logging.set_verbosity(library_level)
    transformers.utils.logging.set_verbosity(library_level)
    # transformers' own bars (e.g. "Writing model shards") follow --disable_tqdm: off in a redirected log by default.
    quiet = training_args.disable_tqdm if training_args is not None else not sys.stderr.isatty()
    (transformers.utils.logging.disable_progress_bar if quiet else transformers.utils.logging.enable_progress_bar)()
    # peft reads PreTrainedModel.is_gradient_checkpointing, which transformers 5 deprecates: nothing to act on here.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


class CompactLogCallback(TrainerCallback):
    """One log line per Trainer log record instead of the printed dict: the step and a few numbers.

    Training records show their numbers (loss, learning rate, ...); an evaluation shows the step and
    :attr:`EVAL_KEYS`; the end of training its run time and mean loss. The full records stay in
    ``trainer_state.json`` and the ``*_results.json`` files.
    """

    EVAL_KEYS = ("loss", "accuracy", "f1", "ece", "train_plus_eval_accuracy", "train_plus_eval_loss")
    SKIP_SUFFIXES = ("_runtime", "_per_second", "total_flos", "epoch")

    def __init__(self, script_logger: logging.Logger) -> None:
        self.logger = script_logger

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        step = f"step {state.global_step}/{state.max_steps}"
        runtime = next((key for key in logs if key.endswith("_runtime")), None)
        if "total_flos" in logs:  # the end of training
            self.logger.info("Training done: %d steps in %.1f s, mean training loss %s", state.global_step,
                             logs.get("train_runtime", 0.0), _number(logs.get("train_loss")))  # fmt: skip
        elif runtime is not None:  # an evaluation (prefix eval_, or train_ for MaskTrainer's training-set pass)
            prefix = runtime.removesuffix("_runtime") + "_"
            shown = {key: logs[prefix + key] for key in self.EVAL_KEYS if prefix + key in logs}
            on = "" if prefix == "eval_" else f" on {prefix.rstrip('_')}"
            self.logger.info("%s evaluation%s: %s", step, on, _numbers(shown))
        else:
            shown = {key.removeprefix("eval_"): value for key, value in logs.items()
                     if "train_plus_eval_" in key or not key.startswith("eval_")}  # fmt: skip
            skip = self.SKIP_SUFFIXES
            shown = {k: v for k, v in shown.items() if isinstance(v, (int, float)) and not k.endswith(skip)}
            if shown:  # (MaskTrainer's record of the evaluated mask's size alone stays in trainer_state.json)
                self.logger.info("%s: %s", step, _numbers(shown))


class _ProgressBar(ProgressCallback):
    """transformers' progress bar, without the log dicts it writes under the bar."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return


def compact_logs(trainer: Trainer, script_logger: logging.Logger) -> Trainer:
    """Replace the Trainer's printed log dicts (``PrinterCallback``, or those ``ProgressCallback`` writes) by
    :class:`CompactLogCallback` lines on ``script_logger``; the progress bar stays when tqdm is on."""
    handler = trainer.callback_handler
    if any(type(callback) is ProgressCallback for callback in handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(_ProgressBar())
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(CompactLogCallback(script_logger))
    return trainer


RESULT_KEYS = ("loss", "accuracy", "f1", "ece", "grafted_entries", "trainable_entries", "selected_step",
               "selection_p_value", "runtime")  # fmt: skip


def log_results(script_logger: logging.Logger, split: str, metrics: dict, output_dir: str | os.PathLike) -> None:
    """One line with the main numbers of ``metrics`` (all of them are in ``<split>_results.json``), instead of
    ``Trainer.log_metrics``' block."""
    shown = {k: v for k, v in metrics.items() if k.endswith(RESULT_KEYS) and isinstance(v, (int, float))}
    path = Path(output_dir, f"{split}_results.json")
    script_logger.info("%s results (all %d in %s): %s", split, len(metrics), path, _numbers(shown))


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _numbers(values: dict) -> str:
    return ", ".join(f"{key} {_number(value)}" for key, value in values.items())


# ------------------------------------------------------------------------------------------------------- files
SHELL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def shell_safe(name: str) -> str:
    """``name`` as a file-name part a shell takes unquoted: runs of other characters become ``_`` (``"MR (in-dist)"``
    -> ``"MR_in-dist"``)."""
    safe = SHELL_UNSAFE.sub("_", name).strip("_")
    return safe or "_"


def remove_checkpoints(output_dir: str | os.PathLike, script_logger: logging.Logger) -> list[str]:
    """Delete the ``checkpoint-N`` folders a Trainer wrote in ``output_dir`` (once the run has saved its result, they
    only served resuming); returns their names."""
    pattern = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-\d+")
    folders = sorted(p for p in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if pattern.fullmatch(p.name))
    size = sum(f.stat().st_size for folder in folders for f in folder.rglob("*") if f.is_file())
    for folder in folders:
        shutil.rmtree(folder)
    # and the save locks peft_graft left beside every checkpoint (".checkpoint-N.lock"), rotated ones included: no
    # other process writes this run's checkpoints
    lock = re.compile(rf"\.{PREFIX_CHECKPOINT_DIR}-\d+\.lock")
    for path in Path(output_dir).glob(f".{PREFIX_CHECKPOINT_DIR}-*.lock"):
        if lock.fullmatch(path.name) and not path.with_name(path.name[1:-5]).exists():
            path.unlink(missing_ok=True)
    if folders:
        script_logger.info("Removed %d checkpoint(s) of this run (%s, %.1f MB); --keep_checkpoints keeps them",
                           len(folders), ", ".join(f.name for f in folders), size / 2**20)  # fmt: skip
    return [folder.name for folder in folders]


# The result files the Trainer-based scripts write into their --output_dir (run_finetune.py and run_graft.py add their
# own): removed when a run starts there (clear_results), so that no earlier run's results survive beside a new model.
RESULT_FILES = (PREDICTIONS_FILE, "predict_results.json", "eval_results.json", "train_results.json", "all_results.json",
                "trainer_state.json")  # fmt: skip


def clear_results(folder: str | os.PathLike, patterns: tuple[str, ...], script_logger: logging.Logger) -> list[str]:
    """Remove the files of ``folder`` that match ``patterns`` (globs): an earlier run's results, before this run writes
    its own (transformers' Trainer writes into a non-empty output folder). The saved model is replaced when the run
    saves, and checkpoints stay (``--resume_from_checkpoint``). Returns the names removed, which are logged."""
    folder = Path(folder)
    stale = sorted({path for pattern in patterns for path in folder.glob(pattern) if path.is_file()})
    for path in stale:
        path.unlink()
    if stale:
        script_logger.info("Removed %d result file(s) of an earlier run in %s: %s", len(stale), folder,
                           ", ".join(path.name for path in stale))  # fmt: skip
    return [path.name for path in stale]


# ------------------------------------------------------------------------------------------------------- task set-up
@dataclass
class TaskSetup:
    """How a fine-tuned model reads its inputs; saved beside it as ``graft_example.json`` for the later scripts."""

    head: str = "classification"
    label_names: list[str] = field(default_factory=list)
    template: str | None = None
    label_words: list[str] | None = None
    max_seq_length: int = 64

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory, SETUP_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TaskSetup | None:
        """The set-up saved in ``directory``; None when there is none (another model, a Hub id)."""
        path = Path(directory, SETUP_FILE)
        return cls(**json.loads(path.read_text())) if path.is_file() else None

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def task_setup(
    task_args: TaskArguments, label_names: list[str], max_seq_length: int, saved: TaskSetup | None = None
) -> TaskSetup:
    """The set-up saved with the fine-tuned model (``saved``), else the one ``task_args`` describe."""
    if saved is not None:
        return dataclasses.replace(saved, max_seq_length=max_seq_length)
    head = task_args.head or "classification"
    check_head(head)
    label_words = parse_label_words(task_args.label_words)
    if head != "classification" and not label_words:
        raise ValueError(f"head={head!r} needs --label_words, one word per class of {label_names}.")
    template = task_args.template or DEFAULT_TEMPLATES.get(head)
    return TaskSetup(head, label_names, template, label_words, max_seq_length)


def parse_label_words(label_words: str | None) -> list[str] | None:
    """``"bad,good"`` -> ``["bad", "good"]``; spaces are kept: ``" bad, good"`` -> ``[" bad", " good"]``."""
    return None if label_words is None else label_words.split(",")


def check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"Unknown head={head!r}: use one of {HEADS}.")


def modules_to_save(setup: TaskSetup) -> list[str] | None:
    """A classification head is new: graft it whole, outside the budget (prompt heads reuse the LM head)."""
    return list(CLASSIFICATION_HEADS) if setup.head == "classification" else None


# ------------------------------------------------------------------------------------------------------- data
def load_splits(
    data_args: DataArguments, label_names: list[str] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame | None, list[str]]:
    """The training frame (k-shot sample, or whole), the optional evaluation frame and the class names (from the
    training labels)."""
    frame = read_table(
        data_args.training_data,
        data_args.train_split,
        data_args.dataset_config_name,
        data_args.text_column,
        data_args.label_column,
    )
    check_classes(frame, data_args.training_data, data_args.label_column)
    label_names = label_names or label_names_of(frame, data_args.training_data)
    train = encode_labels(frame, label_names, data_args.training_data)
    train = k_shot(train, data_args.k_shot or None, data_args.k_shot_seed, label_names)
    if data_args.k_shot:
        logger.info("Training set: %d examples (%s per class, seed %d)", len(train), data_args.k_shot,
                    data_args.k_shot_seed)  # fmt: skip
    else:
        logger.info("Training set: %d examples (all of %s)", len(train), data_args.training_data)
    evaluation = None
    if data_args.validation_data is not None:
        evaluation = read_table(
            data_args.validation_data,
            data_args.validation_split,
            data_args.dataset_config_name,
            data_args.text_column,
            data_args.label_column,
        )
        evaluation = encode_labels(evaluation, label_names, data_args.validation_data)
        if data_args.max_eval_samples is not None:
            evaluation = evaluation.iloc[: data_args.max_eval_samples]
    return train, evaluation, label_names


def check_classes(frame: pd.DataFrame, source: str, label_column: str) -> None:
    """A classification task needs at least two classes in its training data (and no labels that differ only in
    letter case: :func:`_classes`)."""
    names = _classes(frame, source)[0]
    if len(names) < 2:
        raise ValueError(
            f"Training data {source!r} has {len(names)} class(es) {names} in column {label_column!r}: classification "
            "needs at least two. Check --label_column and that the file holds examples of every class."
        )


def load_test(data_args: DataArguments, label_names: list[str], do_predict: bool) -> pd.DataFrame | None:
    """The ``--test_file`` frame (text, and label ids when the file has the label column: None on a row without a
    label); None without one. Its index is each row's 0-based data row in the file.

    ``--do_predict`` and ``--test_file`` go together, as in run_glue.
    """
    if data_args.test_file is None:
        if do_predict:
            raise ValueError("--do_predict needs --test_file: the file whose labels to predict.")
        return None
    if not do_predict:
        raise ValueError(f"--test_file {data_args.test_file!r} is read only to predict: add --do_predict.")
    frame = read_table(data_args.test_file, text_column=data_args.text_column, label_column=data_args.label_column,
                       label_required=False)  # fmt: skip
    if "label" not in frame:
        return frame
    return encode_labels(frame, label_names, data_args.test_file)


def predict_and_save(trainer: Trainer, frame: pd.DataFrame, tokenizer, setup: TaskSetup, output_dir: str) -> dict:
    """Predict every row of ``frame`` (:func:`load_test`) with ``trainer``; write run_glue's ``predict_results.txt``
    (index: the row's 0-based data row in the file, the predicted class name) and, for the rows with a label, the
    metrics to ``predict_results.json`` (``predict_scored_examples`` of ``predict_examples``)."""
    labelled = frame["label"].notna().to_numpy() if "label" in frame else np.zeros(len(frame), dtype=bool)
    unlabelled_rows = frame if labelled.all() else frame.drop(columns="label", errors="ignore")
    output = trainer.predict(tokenize(unlabelled_rows, tokenizer, setup), metric_key_prefix="predict")
    predictions = np.asarray(output.predictions).argmax(-1)
    path = write_predictions(Path(output_dir, PREDICTIONS_FILE), predictions, setup.label_names, frame.index)
    metrics = {}
    if labelled.any():
        if not labelled.all():  # score the rows that have a label
            output = trainer.predict(tokenize(frame[labelled], tokenizer, setup), metric_key_prefix="predict")
        metrics = {k: v for k, v in output.metrics.items() if isinstance(v, (int, float))}
        metrics.update(predict_examples=len(frame), predict_scored_examples=int(labelled.sum()))
        trainer.save_metrics("predict", metrics)
    logger.info("Predictions of %d examples written to %s (%d with a label scored)", len(predictions), path,
                int(labelled.sum()))  # fmt: skip
    return metrics


def write_predictions(path: str | os.PathLike, predictions, label_names: list[str], rows=None) -> Path:
    """run_glue's prediction file, tab-separated: a header ``index\tprediction``, then one record per example: its
    0-based data row in the input file (``rows``, default ``0..n-1``) and its predicted class name.

    A class name that holds a tab, a line break or a ``"`` is quoted as CSV quotes it (``"a<TAB>b"``, a ``"`` doubled),
    so that ``pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)`` or ``csv.reader(file, delimiter="\t")``
    reads one record per example whatever the class names hold. Written atomically."""
    rows = range(len(predictions)) if rows is None else rows
    buffer = io.StringIO()
    writer = csv.writer(buffer, delimiter="\t", lineterminator="\n")
    writer.writerow(["index", "prediction"])
    writer.writerows((row, label_names[int(p)]) for row, p in zip(rows, predictions, strict=True))
    return write_text_atomic(path, buffer.getvalue())


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it and ``os.replace``: a reader sees the old file or
    the new one, never a part."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return path


def _looks_like_path(name: str) -> bool:
    return os.sep in name or name.startswith(".") or Path(name).suffix.lower() in DATA_FILE_SUFFIXES


def read_table(
    name_or_path: str,
    split: str = "train",
    dataset_config_name: str | None = None,
    text_column: str | None = None,
    label_column: str = "label",
    label_required: bool = True,
) -> pd.DataFrame:
    """A dataset as a DataFrame with columns ``text`` and ``label`` (raw label values, not yet mapped to ids), one row
    per example of the data in order: the index is the example's 0-based data row (header excluded), which every
    prediction file writes as its ``index``.

    Nothing is dropped. Texts are read as written (``NA``, ``null`` and an empty text are texts; a number or
    true/false as :func:`cell_text` spells it); a missing text (a JSON ``null``, a missing parquet value) and a list or
    object in the text or label column are ``ValueError``s naming the rows. A label cell that is empty or one of
    :data:`MISSING_LABELS` is missing: a ``ValueError`` naming the rows when ``label_required``, else kept as None (a
    test row to predict; scored only where it has a label). ``text_column=None`` reads 'text', else 'sentence'.
    ``label_required=False``: a file without the label column gives a frame with ``text`` alone.
    """
    path = Path(name_or_path)
    if path.is_file():
        frame = read_frame(path)
    elif path.is_dir():
        data = load_from_disk(str(path))
        if hasattr(data, "keys") and split not in data:
            raise ValueError(
                f"Dataset folder {name_or_path!r} has no split {split!r}; its splits are {list(data)}: name one with "
                "the split flag (--train_split, --validation_split, --eval_split)."
            )
        frame = (data[split] if hasattr(data, "keys") else data).to_pandas()
    elif _looks_like_path(name_or_path):
        raise ValueError(f"Dataset path {name_or_path!r} does not exist: pass an existing file or folder, or a Hub id.")
    else:
        try:
            frame = load_dataset(name_or_path, dataset_config_name, split=split).to_pandas()
        except Exception as error:  # datasets raises many types for unknown or unreachable ids
            raise ValueError(
                f"Could not load dataset {name_or_path!r} (config {dataset_config_name!r}, split {split!r}): it is "
                f"neither a local file or folder nor a reachable Hub dataset ({type(error).__name__}: {error})."
            ) from error
    if frame.empty:
        raise ValueError(f"Dataset {name_or_path!r} has no rows: give a file or split with at least one example.")
    text_column = _text_column(frame, name_or_path, text_column, label_column)
    columns = [text_column] + ([label_column] if label_required or label_column in frame.columns else [])
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        flags = " and ".join(("--text_column" if c == text_column else "--label_column") for c in missing)
        raise ValueError(
            f"Dataset {name_or_path!r} has no column(s) {missing} ({flags}); its columns are {list(frame.columns)}."
            f"{_column_hint(path, list(frame.columns), missing)} Set {flags} to the column(s) that hold the text and "
            "the label (defaults: 'text' or 'sentence', and 'label')."
        )
    frame = frame[columns].rename(columns={text_column: "text", label_column: "label"}).reset_index(drop=True)
    for column, name in (("text", text_column), ("label", label_column)):
        if column in frame:
            check_cells(frame[column], name_or_path, name)
    no_text = frame["text"].isna().to_numpy()
    if no_text.any():
        raise ValueError(
            f"Dataset {name_or_path!r}: {describe_rows(name_or_path, np.flatnonzero(no_text))} have no text (null) in "
            f'column {text_column!r}: write the text (an empty text is "") or delete those rows.'
        )
    frame["text"] = frame["text"].map(cell_text).astype(object)
    if "label" in frame:
        unlabelled = frame["label"].map(is_missing_label).to_numpy(dtype=bool)
        if label_required and unlabelled.any():
            raise ValueError(
                f"Dataset {name_or_path!r}: {describe_rows(name_or_path, np.flatnonzero(unlabelled))} have no label in "
                f"column {label_column!r} (empty or one of {sorted(MISSING_LABELS - {''})}): every training and "
                "evaluation example needs one. Fill in those labels or delete the rows (a --test_file may leave "
                "labels out: its rows are predicted, and scored where they have a label)."
            )
        frame["label"] = frame["label"].astype(object).where(~unlabelled, None)
    return frame


def _text_column(frame: pd.DataFrame, source: str, text_column: str | None, label_column: str) -> str:
    """The text column: ``text_column``, else 'text' or 'sentence'; never the label column."""
    given = text_column is not None
    if text_column is None:
        text_column = next((c for c in TEXT_COLUMNS if c in frame.columns), TEXT_COLUMNS[0])
    if text_column == label_column:
        default = "" if given else " (by default)"
        raise ValueError(
            f"--text_column{default} and --label_column both name column {text_column!r} of {source!r}: the text and "
            f"the label must be two columns. Set --text_column and --label_column to two of its columns "
            f"{list(frame.columns)}."
        )
    return text_column


def _column_hint(path: Path, columns: list, missing: list[str]) -> str:
    """Why a column may be missing: the wrong delimiter for the suffix, or a name that differs in case or spaces."""
    names = [str(c) for c in columns]
    suffix = path.suffix.lower()
    if suffix == ".csv" and any("\t" in name for name in names):
        return " The header holds tabs: this looks tab-separated, name it .tsv."
    if suffix in UNQUOTED_SUFFIXES and len(names) == 1 and "," in names[0]:
        return " The header holds commas and no tab: this looks comma-separated, name it .csv."
    if len(names) == 1 and ";" in names[0]:
        return f" The header holds ';' and no {'tab' if suffix in UNQUOTED_SUFFIXES else 'comma'}: {SEMICOLONS}."
    near = [f"{name!r} for {want!r}" for want in missing for name in names
            if name != want and name.strip().casefold() == want.casefold()]  # fmt: skip
    return f" Close matches (case or surrounding spaces): {', '.join(near)}." if near else ""


# The types a text or label cell may hold: a string, a number, true/false (or missing: None, NaN).
SCALARS = (str, bool, int, float, Decimal, np.bool_, np.integer, np.floating)


def check_cells(column: pd.Series, source: str, name: str) -> None:
    """A text or label cell holding a list, an object or anything but a string, number or true/false is an error."""
    bad = column.map(lambda value: not (value is None or value is pd.NA or isinstance(value, SCALARS)))
    bad = bad.to_numpy(dtype=bool)
    if bad.any():
        kinds = sorted({_kind(value) for value in column[bad]})
        raise ValueError(
            f"Dataset {source!r}: {describe_rows(source, np.flatnonzero(bad))} hold {' and '.join(kinds)} in column "
            f"{name!r}: a text or a label is a string (a number or true/false is read as written). Write each as "
            'one string (e.g. "[1, 2]" in quotes), or point --text_column/--label_column at another column.'
        )


def _kind(value) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "a list"
    return f"a {type(value).__name__}"


def cell_text(value) -> str:
    """A text cell as text: a string as written; a number or true/false in its JSON spelling (``12``, ``1.5``, ``true``;
    a JSON file's numbers are read as spelled in the file, ``1.50`` stays ``1.50``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    return str(value)


# A label cell read as missing: empty, or one of pandas' usual spellings of a missing value. A text is always a text.
MISSING_LABELS = frozenset({"", "NA", "N/A", "n/a", "NaN", "nan", "null", "NULL", "None", "<NA>"})


def is_missing_label(value) -> bool:
    """Whether a label cell holds no label: None, NaN or a string of :data:`MISSING_LABELS` (spaces ignored)."""
    if isinstance(value, str):
        return value.strip() in MISSING_LABELS
    return value is None or (isinstance(value, (float, np.floating)) and np.isnan(value)) or value is pd.NA


def read_frame(path: str | os.PathLike) -> pd.DataFrame:
    """Every row and column of a local data file in file order, with a ``RangeIndex``: ``.csv`` (comma-separated,
    quoted as CSV), ``.tsv``/``.txt`` (tab-separated, one line a row, quotes taken literally), ``.json`` (one array of
    objects, an object of columns, or JSON lines), ``.jsonl`` (one object per line), ``.parquet``.

    Text files are UTF-8 (a byte-order mark is skipped). Table cells are read as strings, never turned into NaN
    (``NA``, ``null``, an empty cell stay text); JSON values keep their types, numbers as strings spelled as in the
    file (``null`` is None). An empty file, a header without rows, a header naming a column twice, a row with more or
    fewer fields than the header, a line that is not a JSON object and bytes that are not UTF-8 are each a
    ``ValueError`` naming the file and the line, and how to fix it.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix in TABLE_SUFFIXES:
            frame = _read_delimited(path)
        elif suffix in (".json", ".jsonl"):
            frame = _read_json(path)
        elif suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:
            raise ValueError(
                f"Dataset file {str(path)!r}: unsupported suffix {suffix!r}; use one of "
                f"{', '.join(DATA_FILE_SUFFIXES)}."
            )
    except UnicodeDecodeError as error:
        raise ValueError(_not_utf8(path)) from error
    if frame.empty:
        raise ValueError(
            f"{str(path)!r} has no rows (columns: {list(frame.columns)}): add one row per example after the header."
        )
    return frame.reset_index(drop=True)


def _records(path: Path):
    """``(first file line, fields)`` of every non-blank record of a ``.csv`` (CSV quoting: a quoted cell may span
    lines) or ``.tsv``/``.txt`` file (quotes taken literally: one line, one record), read as UTF-8 (a BOM skipped)."""
    suffix = path.suffix.lower()
    quoting = csv.QUOTE_NONE if suffix in UNQUOTED_SUFFIXES else csv.QUOTE_MINIMAL
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # a text may be longer than csv's 128 KiB default
    with open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, delimiter=TABLE_SUFFIXES[suffix], quoting=quoting)
        line = 1
        while True:
            try:
                record = next(reader, None)
            except csv.Error as error:
                raise ValueError(f"{str(path)!r}, line {reader.line_num}: {error}.") from error
            if record is None:
                return
            if record:
                yield line, record
            line = reader.line_num + 1


def _read_delimited(path: Path) -> pd.DataFrame:
    """A ``.csv``/``.tsv``/``.txt`` file (:func:`_records`) as a frame of strings; the first record is the header."""
    records = _records(path)
    first = next(records, None)
    if first is None:
        raise ValueError(f"{str(path)!r} is empty: a data file needs a header line and one row per example.")
    header_line, header = first
    repeated = sorted({name for name in header if name and header.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{str(path)!r}: the header (line {header_line}) names column(s) {repeated} more than once: rename them so "
            "that every column has its own name."
        )
    rows = []
    for line, record in records:
        if len(record) != len(header):
            raise ValueError(_ragged(path, line, record, header_line, header))
        rows.append(record)
    names = [name or f"Unnamed: {i}" for i, name in enumerate(header)]  # pandas' name of a column without one
    return pd.DataFrame(rows, columns=names, dtype=object)


SEMICOLONS = "this looks semicolon-separated (a spreadsheet's CSV in some locales): save it with commas, or as .tsv"


def _ragged(path: Path, line: int, record: list[str], header_line: int, header: list[str]) -> str:
    """The error of a row with more or fewer fields than the header, with the likely cause."""
    suffix = path.suffix.lower()
    if suffix == ".csv" and any("\t" in field for field in [*header, *record]):
        hint = "this looks tab-separated: name it .tsv"
    elif suffix in UNQUOTED_SUFFIXES and len(header) == 1 and "," in header[0]:
        hint = "this looks comma-separated: name it .csv"
    elif len(header) == 1 and ";" in header[0]:
        hint = SEMICOLONS
    elif suffix == ".csv" and any("\n" in field or "\r" in field for field in record):
        end = line + sum(field.rstrip("\r\n").count("\n") for field in record)
        hint = (f'a \'"\' opens a quoted cell that runs on to line {end}: close the quote, or double a \'"\' inside a '
                'quoted text ("")')  # fmt: skip
    elif len(record) < len(header):
        hint = "write every row with one field per column (an empty label is an empty field: `my text,`)"
    elif suffix in UNQUOTED_SUFFIXES:
        hint = ("a tab inside a text splits its row in a .tsv/.txt file (quotes are taken literally there): remove "
                "the tab, or save the data as .csv, where a quoted cell may hold tabs")  # fmt: skip
    elif not any(record[len(header) :]):
        hint = "a delimiter at the end of the line? Remove it, or name the extra column in the header"
    else:
        hint = ('a text that holds a comma must be quoted ("a, b"), as pandas\' to_csv and spreadsheet programs '
                "write it")  # fmt: skip
    return (
        f"{str(path)!r}: line {line} has {len(record)} field(s) where the header (line {header_line}) has "
        f"{len(header)} {header[:8]}: {hint}."
    )


class _RepeatedKey(ValueError):
    """A JSON object that names a key twice (json keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise _RepeatedKey(repeated)
    return dict(pairs)


def _json_value(text: str):
    """``json.loads`` keeping every number as the string spelled in ``text`` and refusing repeated keys."""
    return json.loads(text, parse_int=str, parse_float=str, object_pairs_hook=_unique_keys)


def _read_json(path: Path) -> pd.DataFrame:
    """A ``.json`` file holding one JSON array of objects or one object (of columns, or a single example), or JSON
    lines (as ``load_dataset("json")`` reads both); a ``.jsonl`` file, JSON lines. Values keep their JSON types,
    numbers as the strings spelled in the file (``12``, ``1.50``)."""
    text = path.read_bytes().decode("utf-8-sig")
    if not text.strip():
        raise ValueError(f"{str(path)!r} is empty: a data file needs one JSON object per example.")
    if path.suffix.lower() == ".json":
        try:
            document = _json_value(text)
        except _RepeatedKey as error:
            raise ValueError(f"{str(path)!r}: an object names key(s) {error.args[0]} twice: keep one.") from error
        except json.JSONDecodeError:
            document = None  # JSON lines, read below
        if isinstance(document, list):
            return _json_records(path, document)
        if isinstance(document, dict):
            return _json_object(path, document)
    return _json_lines(path, text)


def _json_lines(path: Path, text: str) -> pd.DataFrame:
    """One JSON object per non-blank line (lines end at ``\\n``; a ``\\r`` before it is whitespace)."""
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{str(path)!r} is neither JSON lines (an object per line) nor one JSON table: line {number}"
        try:
            record = _json_value(line)
        except _RepeatedKey as error:
            repeated = f"{str(path)!r}, line {number}: the object names key(s) {error.args[0]} twice: keep one."
            raise ValueError(repeated) from error
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}, column {error.colno}: {error.msg}.") from error
        if not isinstance(record, dict):
            whole = " (a file holding one JSON array is read as .json)" if isinstance(record, list) else ""
            raise ValueError(f"{where} holds {_json_kind(record)}, not an object{whole}.")
        rows.append(record)
    return pd.DataFrame(rows, dtype=object)


def _json_kind(value) -> str:
    return "an array" if isinstance(value, list) else "a string" if isinstance(value, str) else f"{value!r}"


def _json_records(path: Path, document: list) -> pd.DataFrame:
    """A JSON array: one object per example."""
    wrong = [i for i, record in enumerate(document) if not isinstance(record, dict)]
    if wrong:
        raise ValueError(
            f"{str(path)!r}: element(s) {wrong[:10]} of the JSON array are not objects: write one object per example "
            '({"text": ..., "label": ...}).'
        )
    return pd.DataFrame(document, dtype=object)


def _json_object(path: Path, document: dict) -> pd.DataFrame:
    """A JSON object: columns (``{"text": [...], "label": [...]}`` or pandas' ``{"text": {"0": ...}, ...}``), else one
    example."""
    values = list(document.values())
    if values and all(isinstance(value, list) for value in values):
        lengths = {key: len(value) for key, value in document.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{str(path)!r}: its columns have different lengths {lengths}: give each one per example.")
        return pd.DataFrame(document, dtype=object)
    if values and all(isinstance(value, dict) for value in values):
        return pd.DataFrame(document, dtype=object)
    return pd.DataFrame([document], dtype=object)


def _not_utf8(path: Path) -> str:
    """Where the first byte that is not UTF-8 sits in ``path``, and the fix."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return (
            f"{str(path)!r} is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8. Re-save it as UTF-8, "
            "e.g. `iconv -f utf-16 -t utf-8 in.csv > out.csv`, or as 'CSV UTF-8' in a spreadsheet program."
        )
    try:
        data.decode("utf-8")
        where = ""
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        where = f": byte 0x{data[error.start]:02x} at line {line}, column {column} (byte offset {error.start})"
    return (
        f"{str(path)!r} is not UTF-8 text{where}. Re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 in.csv > "
        "out.csv` or pandas' `to_csv(..., encoding='utf-8')`."
    )


def line_numbers(path: str | os.PathLike) -> list[int] | None:
    """The 1-based file line on which each 0-based data row of a local csv/tsv/jsonl file starts (the header and
    blank lines are not rows; a quoted CSV cell may span lines); None for files without lines (parquet, a JSON
    document, a folder, a Hub id)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file() or suffix not in (*TABLE_SUFFIXES, ".json", ".jsonl"):
        return None
    if suffix in TABLE_SUFFIXES:
        return [line for line, _ in _records(path)][1:]
    text = path.read_bytes().decode("utf-8-sig")
    if suffix == ".json":
        try:
            _json_value(text)
            return None  # one JSON document (an array or an object of columns): rows are not lines
        except ValueError:
            pass  # JSON lines
    return [number for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def describe_rows(name_or_path: str | os.PathLike | None, rows, limit: int = 10) -> str:
    """``"rows 0, 3 (0-based data rows, the index of prediction files; file lines 2, 5)"`` for error messages."""
    rows = [int(row) for row in rows]
    more = f", ... ({len(rows) - limit} more)" if len(rows) > limit else ""
    text = f"{len(rows)} row(s) {', '.join(map(str, rows[:limit]))}{more} (0-based data rows"
    lines = None if name_or_path is None else line_numbers(name_or_path)
    if lines is not None:
        shown = [str(lines[row]) if row < len(lines) else "?" for row in rows[:limit]]
        text += f"; file lines {', '.join(shown)}{more}"
    return text + ")"


def read_tab_separated(path: str | os.PathLike, **kwargs) -> pd.DataFrame:
    """A UTF-8 tab-separated file with a header line, quotes taken literally (one line, one row); ``kwargs`` go to
    ``pd.read_csv``."""
    return pd.read_csv(path, sep="\t", encoding="utf-8-sig", quoting=csv.QUOTE_NONE, **kwargs)


# ------------------------------------------------------------------------------------------------------- labels
# A label spelled as a decimal number (1, 1.0, 01, +1, 1e3, .5): labels that spell one number name one class.
NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def label_text(value) -> str:
    """A raw label as its class name when the data write it one way: a string without its surrounding whitespace
    (Unicode NFC); a number or true/false as :func:`label_key` writes it."""
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value.strip())
    return label_key(value)


def label_key(value) -> str:
    """The class a raw label names. Labels with one key are one class: the same text but for surrounding whitespace
    (and Unicode normalization: NFC), or the same number however spelled (``1``, ``1.0``, ``01``, `` 1``, the integer
    1 and the float 1.0 of a JSON or parquet file: ``"1"``; ``0.50`` and ``.5``: ``"0.5"``); true/false (JSON,
    parquet) is ``"true"``/``"false"``. Labels that differ in letter case are different keys (and refused together
    in a training file: :func:`label_names_of`)."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return _number_text(Decimal(repr(float(value))))
    if isinstance(value, Decimal):
        return _number_text(value)
    text = label_text(value)
    return _number_text(Decimal(text)) if NUMBER.fullmatch(text) else text


def _number_text(number: Decimal) -> str:
    """A number's one spelling: an integer without a decimal point (``1``), else the shortest decimal (``0.5``)."""
    if not number.is_finite():
        return str(number)
    if number.is_zero():
        return "0"
    if abs(number.adjusted()) > 40:  # 1e999999: no million-digit integer
        return str(number.normalize())
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def label_names_of(frame: pd.DataFrame, source: str | None = None) -> list[str]:
    """Class names in id order (:func:`_classes`); a class read from several spellings is logged as a warning."""
    names, variants = _classes(frame, source)
    if variants:
        logger.warning(
            "%s: labels written several ways are read as one class each (surrounding spaces dropped, numbers compared "
            "by value): %s", source or "Labels",
            "; ".join(f"class {name!r} from {', '.join(spellings)}" for name, spellings in variants.items()),
        )  # fmt: skip
    return names


def _classes(frame: pd.DataFrame, source: str | None) -> tuple[list[str], dict[str, list[str]]]:
    """The class names of the labelled rows in id order, and for each class read from several spellings, those.

    A class is a :func:`label_key`; its name is its one spelling (:func:`label_text`: ``"01"`` stays ``"01"``), or the
    key when the data spell it several ways (``"1"`` for ``1``, ``1.0`` and ``01``). Ids: sorted by number when every
    class is a number (``"2"`` before ``"10"``), else by name. Two labels that differ only in letter case are a
    ``ValueError`` naming them, their rows (of ``source``) and the fix: one class written two ways, or two classes?"""
    labels = frame["label"][~frame["label"].map(is_missing_label).to_numpy(dtype=bool)]
    keys, spellings = labels.map(label_key), labels.map(label_text)
    raw = labels.map(lambda value: repr(value) if isinstance(value, str) else label_key(value))
    spelled: dict[str, set[str]] = {}
    written: dict[str, set[str]] = {}
    for key, spelling, as_written in zip(keys, spellings, raw, strict=True):
        spelled.setdefault(key, set()).add(spelling)
        written.setdefault(key, set()).add(as_written)
    name_of = {key: next(iter(names)) if len(names) == 1 else key for key, names in spelled.items()}
    _refuse_case_variants(name_of, keys, source)
    numeric = all(NUMBER.fullmatch(key) for key in name_of)
    order = sorted(name_of, key=Decimal) if numeric else sorted(name_of, key=name_of.get)
    variants = {name_of[key]: sorted(written[key])[:5] for key in order if len(written[key]) > 1}
    return [name_of[key] for key in order], variants


def _refuse_case_variants(name_of: dict[str, str], keys: pd.Series, source: str | None) -> None:
    groups: dict[str, list[str]] = {}
    for key in name_of:
        groups.setdefault(key.casefold(), []).append(key)
    clash = next((sorted(group) for group in groups.values() if len(group) > 1), None)
    if clash is None:
        return
    where = ", ".join(f"{name_of[key]!r} in {describe_rows(source, keys.index[keys == key])}" for key in clash)
    raise ValueError(
        f"{f'Dataset {source!r}: ' if source else ''}the labels {where} differ only in letter case: one class written "
        f"two ways, or {len(clash)} classes? Write each class one way (e.g. every {name_of[clash[1]]!r} as "
        f"{name_of[clash[0]]!r}), or give different classes names that differ in more than letter case."
    )


def encode_labels(frame: pd.DataFrame, label_names: list[str], source: str | None = None) -> pd.DataFrame:
    """Map raw labels to ids ``0..C-1`` by ``label_names``, each label by its class (:func:`label_key`: ``" 1.0"``
    is class ``"1"``); a label that is not a class is an error naming its rows (of ``source``, the file read). Rows
    without a label (a test file's) keep None."""
    index: dict[str, int] = {}
    for i, name in enumerate(label_names):
        first = index.setdefault(label_key(name), i)
        if first != i:
            raise ValueError(
                f"The class names {label_names} name one class twice, {label_names[first]!r} and {name!r} (labels are "
                "read without surrounding spaces, numbers by value): fine-tune again on the training file, whose "
                "labels are now read as one class."
            )
    labelled = ~frame["label"].map(is_missing_label).to_numpy(dtype=bool)
    keys = frame["label"].map(lambda value: None if is_missing_label(value) else label_key(value))
    unknown = labelled & ~keys.isin(list(index)).to_numpy()
    if unknown.any():
        where = f"Dataset {source!r}: {describe_rows(source, np.flatnonzero(unknown))}" if source else "Rows"
        values = sorted({label_text(value) for value in frame["label"][unknown]})
        near = [f"{value!r} differs from class {name!r} only in letter case" for value in values[:5]
                for name in label_names if value.casefold() == name.casefold()]  # fmt: skip
        raise ValueError(
            f"{where} have labels {values[:5]} that are not among the training labels {label_names}"
            f"{' (' + '; '.join(near) + ')' if near else ''}: fix those labels, or give --label_column the column that "
            "holds the classes."
        )
    ids = keys.map(index)
    return frame.assign(label=ids.astype(int) if labelled.all() else ids.astype(object).where(labelled, None))


def k_shot(frame: pd.DataFrame, k: int | None, seed: int, label_names: list[str] | None = None) -> pd.DataFrame:
    """``k`` examples of every class, sampled with ``seed`` (all examples when ``k`` is None); a class with fewer is an
    error naming it (by ``label_names``, else its id) and its count."""
    if k is None:
        return frame.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    if k < 1:
        raise ValueError(f"k_shot must be >= 1, got {k}.")
    counts = frame["label"].value_counts()
    short = {label_names[c] if label_names else str(c): int(n) for c, n in counts.items() if n < k}
    if short:
        raise ValueError(f"k_shot={k} exceeds the number of examples of class(es) {short}: lower --k_shot.")
    parts = [group.sample(n=k, random_state=seed) for _, group in frame.groupby("label", sort=True)]
    return pd.concat(parts).sample(frac=1.0, random_state=seed).reset_index(drop=True)


def prompt_text(tokenizer: PreTrainedTokenizerBase, text: str, setup: TaskSetup) -> str:
    """The prompt of one example: the template with the sentence, truncated so that the prompt fits."""
    template = setup.template
    mask = tokenizer.mask_token or ""
    overhead = len(tokenizer(template.format(sentence="", mask=mask))["input_ids"])
    budget = max(1, setup.max_seq_length - overhead)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:budget]
    return template.format(sentence=tokenizer.decode(ids).strip(), mask=mask)


def tokenize(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, setup: TaskSetup) -> Dataset:
    """A tokenized ``Dataset`` (input_ids, attention_mask[, token_type_ids], labels), sorted by nothing; without
    ``labels`` when ``frame`` has no label column (a test set to predict)."""
    if setup.head == "classification":
        texts = frame["text"].astype(str).tolist()
        encoded = tokenizer(texts, truncation=True, max_length=setup.max_seq_length)
    else:
        texts = [prompt_text(tokenizer, t, setup) for t in frame["text"].astype(str)]
        encoded = tokenizer(texts, truncation=False)
    columns = {key: list(values) for key, values in encoded.items()}
    if "label" in frame:
        columns["labels"] = frame["label"].astype(int).tolist()
    return Dataset.from_dict(columns)


def by_length(dataset: Dataset) -> Dataset:
    """The dataset sorted by length (less padding when predicting; order does not matter for the metrics)."""
    return dataset.select(length_order(dataset).tolist())


def length_order(dataset: Dataset) -> np.ndarray:
    """The positions of ``dataset``'s examples, shortest first (stable): :func:`by_length`'s order."""
    return np.argsort([len(ids) for ids in dataset["input_ids"]], kind="stable")


# ------------------------------------------------------------------------------------------------------- models
def load_tokenizer(name_or_path: str, head: str) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as error:
        raise ValueError(f"Could not load a tokenizer from {name_or_path!r}: not a local model folder nor a reachable "
                         f"Hub model ({type(error).__name__}: {error}).") from error  # fmt: skip
    if head == "causal_prompt":
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
    if head == "mlm_prompt" and tokenizer.mask_token is None:
        raise ValueError(f"head='mlm_prompt' needs a tokenizer with a mask token; {name_or_path!r} has none.")
    return tokenizer


def load_model(name_or_path: str, setup: TaskSetup, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """The model for ``setup.head``: a sequence classifier, or an LM wrapped in a :class:`LabelWordClassifier`."""
    check_head(setup.head)
    try:
        AutoConfig.from_pretrained(name_or_path)
    except Exception as error:
        raise ValueError(f"Could not load model {name_or_path!r}: not a local model folder nor a reachable Hub model "
                         f"({type(error).__name__}: {error}).") from error  # fmt: skip
    if setup.head == "classification":
        return from_pretrained(
            AutoModelForSequenceClassification,
            name_or_path,
            new_modules=CLASSIFICATION_HEADS,
            num_labels=setup.num_labels,
            dtype=torch.float32,
        )
    auto = AutoModelForMaskedLM if setup.head == "mlm_prompt" else AutoModelForCausalLM
    try:
        lm = from_pretrained(auto, name_or_path, dtype=torch.float32)
    except ValueError as error:
        kind = "masked-LM" if setup.head == "mlm_prompt" else "causal-LM"
        raise ValueError(f"{name_or_path!r} has no {kind} architecture for head={setup.head!r}: {error}") from error
    ids = label_word_ids(tokenizer, setup.label_words or [])
    if len(ids) != setup.num_labels:
        raise ValueError(
            f"label_words {setup.label_words} give {len(ids)} words for {setup.num_labels} classes "
            f"{setup.label_names}: give one word per class, in class order."
        )
    head = "mlm" if setup.head == "mlm_prompt" else "causal"
    return LabelWordClassifier(lm, ids, head, tokenizer.mask_token_id)


def from_pretrained(auto_class, name_or_path: str, new_modules: tuple[str, ...] = (), **kwargs) -> torch.nn.Module:
    """``auto_class.from_pretrained``, reporting only what the example does not expect.

    transformers logs a load report of missing and unexpected weights; a classification head (``new_modules``) is
    missing from every pre-trained checkpoint by design, so the report is replaced by: a warning naming the other
    missing weights (newly initialized), and an INFO line naming the checkpoint weights the model does not use (another
    task's head). Shape mismatches and conversion errors still raise. A local folder loads without a progress bar.
    """
    with _quiet_loading(local=Path(name_or_path).is_dir()):
        model, info = auto_class.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    name = type(model).__name__
    missing = sorted(key for key in info["missing_keys"] if key.split(".")[0] not in new_modules)
    if missing:
        logger.warning(
            "%s from %s: %d weights missing from the checkpoint were newly initialized: %s",
            name, name_or_path, len(missing), _some(missing),
        )  # fmt: skip
    if info["unexpected_keys"]:
        unused = sorted(info["unexpected_keys"])
        logger.info("%s from %s: %d checkpoint weights not used: %s", name, name_or_path, len(unused), _some(unused))
    return model


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextmanager
def _quiet_loading(local: bool):
    """Drop transformers' load report (``from_pretrained`` reports instead) and a local folder's progress bar."""
    report_logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    report_logger.addFilter(drop)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    if local:
        transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        report_logger.removeFilter(drop)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _some(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


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
        work_dir = Path(self.args.output_dir)
        existed = work_dir.exists()
        trainer = Trainer(model=model, args=self.args, data_collator=self.collator)
        logits = np.asarray(trainer.predict(dataset).predictions, dtype=np.float64)
        if not existed and work_dir.is_dir() and not any(work_dir.iterdir()):  # the Trainer's empty output_dir
            work_dir.rmdir()
        return logits


def pretrained_with_head(pre: str, setup: TaskSetup, tokenizer, finetuned) -> torch.nn.Module:
    """theta_pre, with the fine-tuned classification head for a classification head (the 0-entry graft; the
    start of WiSE-FT)."""
    model = load_model(pre, setup, tokenizer)
    if setup.head == "classification":
        heads = CLASSIFICATION_HEADS
        head_state = {k: v for k, v in finetuned.state_dict().items() if k.split(".")[0] in heads}
        model.load_state_dict(head_state, strict=False)
    return model


def run_step(script, argv: list[str], script_logger: logging.Logger):
    """``script.main(argv)`` of another example script, logged as the equivalent command line (for orchestrators)."""
    script_logger.info("python examples/%s.py %s", script.__name__, shlex.join(argv))
    return script.main(argv)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``PreTrainedModel`` to save: the LM inside a :class:`LabelWordClassifier`, else the model itself."""
    return model.lm if isinstance(model, LabelWordClassifier) else model


def freeze(model: torch.nn.Module, embeddings: bool, lm_head: bool) -> list[str]:
    """Freeze the input embeddings and/or the LM head (paper defaults with SGD); returns the frozen names."""
    base = inner_model(model)
    frozen = set()
    if embeddings:
        frozen |= {id(p) for p in base.get_input_embeddings().parameters()}
        for name, module in base.named_modules():
            if name.endswith("embeddings") or name.endswith("embed_tokens"):
                frozen |= {id(p) for p in module.parameters()}
    if lm_head and isinstance(model, LabelWordClassifier) and base.get_output_embeddings() is not None:
        frozen |= {id(p) for p in base.get_output_embeddings().parameters()}
        for name, module in base.named_modules():
            if name in ("lm_head", "cls") or name.startswith("lm_head.") or name.startswith("cls."):
                frozen |= {id(p) for p in module.parameters()}
    names = []
    for name, param in model.named_parameters():
        if id(param) in frozen:
            param.requires_grad_(False)
            names.append(name)
    return names


def gguf_to_safetensors(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Dequantize a GGUF causal LM once and save it (with its tokenizer) as a safetensors model folder.

    ``save_pretrained`` refuses a GGUF-loaded model, so the state dict is copied into a fresh model first. The folder
    is written beside ``out_dir`` and renamed into place once whole: a run killed while saving leaves no folder that a
    rerun would take for done.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return str(out_dir)
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {str(gguf_path)!r} does not exist.")
    logger.info("Dequantizing %s (about 30 s) into %s", gguf_path, out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the values are dequantized fp32 now: drop the GGUF marker
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    for folder in (partial, out_dir):  # an interrupted earlier save (no config.json in out_dir): done again
        if folder.exists():
            logger.info("Removing %s, left by an interrupted conversion", folder)
            shutil.rmtree(folder)
    fresh.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(partial)
    os.replace(partial, out_dir)
    return str(out_dir)
