"""The three packaged tasks (MR, TREC, SMS spam) on all-MiniLM-L6-v2 with one 6-way head shape, and the fine-tuning,
mask learning and scoring both ``run_continual.py`` and ``run_merge.py`` run on them.

Every model is fine-tuned as the main command does (SGD, lr 5e-2, batch 8, 200 steps, frozen embeddings, k examples per
class); a 2-class task reads the first two logits of the shared head shape (``Task.offset`` places a task's classes in
a multi-task head).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import example_utils as U
import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from peft import get_peft_model
from real_tasks import TASK_MAX_K_SHOT, prepare_data
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    set_seed,
)

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.calibration import calibration_report

logger = logging.getLogger(__name__)

TASKS = ("mr", "trec", "sms")
DEFAULT = dict(k_shot=64, max_seq_length=64, ft_steps=200, ft_batch=8, ft_lr=5e-2, mask_steps=100, mask_batch=16,
               test_size=500, dev_size=300, mt_steps=600, purify_steps=10, purify_batch=16)  # fmt: skip
SMOKE = dict(k_shot=4, max_seq_length=32, ft_steps=4, ft_batch=4, ft_lr=5e-2, mask_steps=2, mask_batch=8,
             test_size=32, dev_size=32, mt_steps=4, purify_steps=2, purify_batch=4)  # fmt: skip


@dataclass
class Task:
    name: str
    num_labels: int
    train: Dataset
    dev: Dataset
    test: Dataset
    offset: int = 0  # first slot of the task's classes in the multi-task head


def load_tasks(work: Path, settings: dict, seed: int, tokenizer) -> dict[str, Task]:
    tasks, offset = {}, 0
    for name in TASKS:
        paths = prepare_data(name, work / "data", settings["test_size"], settings["dev_size"], None)
        frames = {split: pd.read_csv(paths[split]) for split in ("train", "dev", "test")}
        labels = U.label_names_of(frames["train"])
        setup = U.TaskSetup("classification", labels, max_seq_length=settings["max_seq_length"])
        k = min(settings["k_shot"], TASK_MAX_K_SHOT.get(name, settings["k_shot"]))
        frames = {split: U.encode_labels(frame, labels) for split, frame in frames.items()}
        frames["train"] = U.k_shot(frames["train"], k, seed)
        data = {split: U.tokenize(frame, tokenizer, setup) for split, frame in frames.items()}
        tasks[name] = Task(
            name, len(labels), data["train"], U.by_length(data["dev"]), U.by_length(data["test"]), offset
        )
        offset += len(labels)
        logger.info("%s: %d classes, k = %d per class, %d test examples", name, len(labels), k, len(data["test"]))
    return tasks


def offset_labels(dataset: Dataset, offset: int) -> Dataset:
    return dataset.map(lambda row: {"labels": row["labels"] + offset}) if offset else dataset


class Runner:
    """Fine-tuning, mask learning and prediction with one tokenizer and one set of settings."""

    def __init__(self, model_dir: str, tokenizer, settings: dict, work: Path, seed: int) -> None:
        self.model_dir, self.tokenizer, self.settings, self.work, self.seed = model_dir, tokenizer, settings, work, seed
        self.collator = DataCollatorWithPadding(tokenizer)

    def pretrained(self, num_labels: int) -> torch.nn.Module:
        """theta_pre with a new head (seeded: every call gives the same head), embeddings frozen (paper, SGD)."""
        set_seed(self.seed)
        auto = AutoModelForSequenceClassification
        heads = U.CLASSIFICATION_HEADS
        model = U.from_pretrained(auto, self.model_dir, new_modules=heads, num_labels=num_labels, dtype=torch.float32)
        U.freeze(model, embeddings=True, lm_head=False)
        return model

    def finetune(self, model, dataset: Dataset, steps: int, callbacks=(), lr: float | None = None) -> torch.nn.Module:
        s = self.settings
        args = TrainingArguments(
            output_dir=str(self.work / "trainer"), max_steps=steps, per_device_train_batch_size=s["ft_batch"],
            learning_rate=s["ft_lr"] if lr is None else lr, optim="sgd", weight_decay=1e-4,
            lr_scheduler_type="constant", save_strategy="no", report_to="none", logging_steps=100, seed=self.seed,
            disable_tqdm=True, dataloader_pin_memory=False,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=dataset, data_collator=self.collator,
                callbacks=list(callbacks)).train()  # fmt: skip
        return model.eval()

    def logits(self, model, dataset: Dataset, task: Task) -> np.ndarray:
        """The task's logits (its slots of the head) on ``dataset``."""
        model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(dataset), 64):
                batch = self.collator(dataset.select(range(start, min(start + 64, len(dataset)))).to_list())
                batch.pop("labels")
                out.append(model(**batch).logits[:, task.offset : task.offset + task.num_labels])
        return torch.cat(out).numpy()

    def score(self, model, task: Task, dataset: Dataset | None = None) -> dict[str, float]:
        dataset = task.test if dataset is None else dataset
        report = calibration_report(self.logits(model, dataset, task), np.asarray(dataset["labels"]),
                                    input_type="logits", metrics=["accuracy", "ece"])  # fmt: skip
        return {"accuracy": 100 * report["accuracy"], "ece": 100 * report["ece"]}

    def learn_region(
        self, pre, finetuned, task: Task, num_entries: int, empty_start: bool, modules_to_save=("classifier",)
    ) -> torch.nn.Module:
        """``MaskTrainer`` on ``task``: from top-k movement selected on the dev set, or from ``gamma_base = 0``; the
        head (``modules_to_save``) stored whole, or none (a frozen head, outside the graft)."""
        s = self.settings
        config = GraftConfig(finetuned=finetuned, num_entries=num_entries, learn_region=True,
                             region="empty" if empty_start else "movement",
                             modules_to_save=list(modules_to_save) or None)  # fmt: skip
        graft = get_peft_model(copy.deepcopy(pre), config)
        selection = {} if empty_start else dict(eval_strategy="steps", eval_steps=max(1, s["mask_steps"] // 4),
                                                metric_for_best_model="accuracy")  # fmt: skip
        args = MaskTrainingArguments(
            output_dir=str(self.work / "mask"), max_steps=s["mask_steps"], mask_batch_size=s["mask_batch"],
            per_device_train_batch_size=s["mask_batch"], per_device_eval_batch_size=64, num_entries=num_entries,
            save_strategy="no", report_to="none", logging_steps=100, seed=self.seed, disable_tqdm=True,
            dataloader_pin_memory=False, **selection,
        )  # fmt: skip

        def accuracy(prediction) -> dict[str, float]:
            logits = prediction.predictions[:, task.offset : task.offset + task.num_labels]
            return {"accuracy": float((logits.argmax(-1) == prediction.label_ids - task.offset).mean())}

        trainer = MaskTrainer(
            model=graft, args=args, train_dataset=offset_labels(task.train, task.offset),
            eval_dataset=None if empty_start else offset_labels(task.dev, task.offset), data_collator=self.collator,
            compute_metrics=None if empty_start else accuracy,
        )  # fmt: skip
        trainer.train()
        return trainer.model.eval()
