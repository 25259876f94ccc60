"""selection_alpha: a learned mask replaces gamma_base only when a sign test finds it more accurate."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import get_peft_model
from test_mask_trainer import Probe, _probe_task, planted_flipped_trainer
from testing_utils import fast_args

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.training.mask_selection import (
    SignificantSelection,
    per_example_correct,
    region_change,
    sign_test_p_value,
)


# ------------------------------------------------------------------------------------------ the statistics
@pytest.mark.parametrize("wins,losses", [(0, 0), (10, 0), (0, 10), (5, 5), (30, 15), (3, 40), (120, 80)])
def test_sign_test_p_value_is_the_exact_binomial_tail(wins, losses):
    n = wins + losses
    expected = 1.0 if n == 0 else sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n
    assert sign_test_p_value(wins, losses) == pytest.approx(expected, rel=1e-9)


def test_per_example_correct_reads_logits_ids_and_output_tuples():
    labels = np.array([0, 2, 1, 1])
    logits = np.array([[3.0, 0, 0], [0, 0, 1], [0, 2, 0], [5, 0, 0]])
    assert per_example_correct(logits, labels).tolist() == [True, True, True, False]
    assert per_example_correct((logits, np.zeros((4, 7))), labels).tolist() == [True, True, True, False]
    assert per_example_correct(np.array([0, 1, 1, 1]), labels).tolist() == [True, False, True, True]


@pytest.mark.parametrize(
    "predictions,labels,message",
    [
        (None, np.array([0, 1]), "no predictions"),
        (np.zeros((2, 5, 7)), np.zeros((2, 5), dtype=int), "one label per example"),
        (np.array([0.3, -0.2]), np.array([0, 1]), "class logits"),
        (np.zeros((3, 2)), np.array([0, 1]), "class logits"),
    ],
)
def test_per_example_correct_refuses_what_it_cannot_compare(predictions, labels, message):
    with pytest.raises(ValueError, match=message):
        per_example_correct(predictions, labels)


def _entries(tag: int):
    return {"fc": (torch.tensor([tag]), torch.tensor([float(tag)]))}


def test_significant_selection_keeps_the_start_unless_a_mask_beats_it_beyond_chance():
    start = np.array([True] * 50 + [False] * 50)
    small_gain = start.copy()
    small_gain[50:54] = True  # 4 more right, 0 lost: p = 1/16
    large_gain = start.copy()
    large_gain[50:70] = True  # 20 more right: p = 2**-20
    selection = SignificantSelection(alpha=0.05, greater_is_better=True)
    selection.offer(0.50, 0, start, _entries(0))
    selection.offer(0.54, 10, small_gain, _entries(1))
    assert selection.choice().step == 0  # best by accuracy, but not beyond chance: the start stays
    selection.offer(0.70, 20, large_gain, _entries(2))
    chosen = selection.choice()
    assert chosen.step == 20 and chosen.entries["fc"][0].tolist() == [2]
    assert chosen.p_value == pytest.approx(2.0**-20)


def test_bonferroni_counts_every_learned_mask_evaluated():
    start = np.array([False] * 40)
    gain = start.copy()
    gain[:6] = True  # p = 1/64, below 0.05 alone
    selection = SignificantSelection(alpha=0.05, greater_is_better=True)
    selection.offer(0.0, 0, start, _entries(0))
    selection.offer(0.15, 1, gain, _entries(1))
    assert selection.choice().step == 1  # one mask: 1/64 <= 0.05
    for step in range(2, 5):  # three more, no better than the start: m = 4, 4/64 > 0.05
        selection.offer(0.0, step, start, _entries(step))
    assert selection.choice().step == 0


def test_among_significant_masks_the_best_metric_wins_and_ties_keep_the_earlier():
    start = np.zeros(64, dtype=bool)
    selection = SignificantSelection(alpha=0.05, greater_is_better=True)
    selection.offer(0.0, 0, start, _entries(0))
    for step, right in [(1, 30), (2, 40), (3, 40)]:
        correct = start.copy()
        correct[:right] = True
        selection.offer(right / 64, step, correct, _entries(step))
    assert selection.choice().step == 2


def test_significant_selection_refuses_a_changed_selection_set():
    selection = SignificantSelection(alpha=0.05, greater_is_better=True)
    selection.offer(0.5, 0, np.zeros(10, dtype=bool), _entries(0))
    with pytest.raises(ValueError, match="same examples"):
        selection.offer(0.5, 1, np.zeros(12, dtype=bool), _entries(1))


# ------------------------------------------------------------------------------------------ MaskTrainer
class TwoClassProbe(Probe):
    """The planted probe of test_mask_trainer with two class logits ``[0, w.x + b]`` (argmax = its sign)."""

    def forward(self, x, labels=None):
        out = super().forward(x, labels)
        logit = out["logits"]
        return {"loss": out["loss"], "logits": torch.stack([torch.zeros_like(logit), logit], -1)}


def _two_class_task():
    pre, finetuned, x, labels = _probe_task()
    two_pre, two_ft = TwoClassProbe(64), TwoClassProbe(64)
    two_pre.load_state_dict(pre.state_dict())
    two_ft.load_state_dict(finetuned.state_dict())
    return two_pre, two_ft, x, labels


def _accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def _planted_run(tmp_path, selection_alpha):
    """gamma_base is the planted region that solves the task. Mask training on flipped labels moves away from it,
    and the selection set is three examples whose labels are noise (flipped too): there the learned masks win 3-0,
    on held-out data they lose."""
    task = _two_class_task()
    x, labels = task[2], task[3]
    noisy_dev = Dataset.from_dict({"x": x[:3].tolist(), "labels": (1 - labels[:3]).tolist()})
    held_out = Dataset.from_dict({"x": x[3:].tolist(), "labels": labels[3:].tolist()})
    trainer, start = planted_flipped_trainer(tmp_path, task, noisy_dev, _accuracy, selection_alpha=selection_alpha)
    model = trainer.model
    start_accuracy = trainer.evaluate(held_out)["eval_accuracy"]
    trainer.train()
    return model.get_region() == start, trainer, start_accuracy, trainer.evaluate(held_out)["eval_accuracy"]


def test_a_noisy_win_on_few_examples_does_not_replace_gamma_base(tmp_path):
    kept_start, plain, before, after = _planted_run(tmp_path / "plain", selection_alpha=None)
    assert not kept_start and plain.mask_report["selected_step"] > 0 and after < before  # the failure
    kept_start, trainer, before, after = _planted_run(tmp_path / "guarded", selection_alpha=0.05)
    assert kept_start and after == before
    report = trainer.mask_report
    assert report["selected_step"] == 0 and report["evaluated_masks"] == 4
    # gamma_base is the reference, never tested: no p-value of its own (issue 37: it was reported as 1.0); the best
    # learned mask, rejected, keeps its p-value and the step it came from, the one the paper's selection keeps (right
    # on 1 of the 3 noisy examples where gamma_base is right on none: 1 win, 0 losses, p = 1/2)
    assert "selection_p_value" not in report
    assert report["best_learned_p_value"] == 0.5 and report["best_learned_step"] == plain.mask_report["selected_step"]
    assert report["entries_changed_from_start"] == 0 and report["iou_with_start"] == 1.0


def test_a_significantly_better_mask_is_kept(tmp_path):
    pre, finetuned, x, labels = _two_class_task()
    model = get_peft_model(copy.deepcopy(pre), GraftConfig(finetuned=finetuned, num_entries=4, learn_region=True))
    data = Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})
    args = fast_args(
        tmp_path, per_device_train_batch_size=512, max_steps=10, learning_rate=1e4, num_entries=4,
        remove_unused_columns=False, eval_strategy="steps", eval_steps=2, metric_for_best_model="accuracy",
        selection_alpha=0.01,
    )  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=_accuracy)
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    report = trainer.mask_report
    assert report["selected_step"] > 0 and report["selection_p_value"] * report["evaluated_masks"] <= 0.01
    assert report["best_learned_step"] == report["selected_step"]  # the kept mask is the best learned one here
    assert report["best_learned_p_value"] == report["selection_p_value"]
    assert trainer.evaluate()["eval_accuracy"] > before and model.get_region().num_entries == 4


def test_train_plus_eval_selection_tests_both_sets_together(tmp_path):
    pre, finetuned, x, labels = _two_class_task()
    model = get_peft_model(copy.deepcopy(pre), GraftConfig(finetuned=finetuned, num_entries=4, learn_region=True))
    train = Dataset.from_dict({"x": x[:256].tolist(), "labels": labels[:256].tolist()})
    dev = Dataset.from_dict({"x": x[256:].tolist(), "labels": labels[256:].tolist()})
    args = fast_args(
        tmp_path, per_device_train_batch_size=256, max_steps=6, learning_rate=1e4, num_entries=4,
        remove_unused_columns=False, eval_strategy="steps", eval_steps=3, select_on_train=True,
        metric_for_best_model="train_plus_eval_accuracy", selection_alpha=0.05,
    )  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev, compute_metrics=_accuracy)
    trainer.train()
    assert trainer.mask_report["selected_step"] > 0 and trainer.mask_report["evaluated_masks"] == 2


def test_resumed_runs_compare_with_gamma_base_too(tmp_path):
    task = _two_class_task()
    correct = Dataset.from_dict({"x": task[2].tolist(), "labels": task[3].tolist()})

    def run(output_dir, max_steps, resume=None):
        trainer, start = planted_flipped_trainer(
            output_dir, task, correct, _accuracy, max_steps=max_steps, save_strategy="steps", save_steps=2
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model.get_region(), start, trainer

    run(tmp_path / "a", 2)
    region, start, trainer = run(tmp_path / "b", 4, resume=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert trainer.mask_report["selected_step"] == 0 and region == start


@pytest.mark.parametrize(
    "fields,error,message",
    [
        (dict(selection_alpha=0.0), ValueError, "level in"),
        (dict(selection_alpha=1.5), ValueError, "level in"),
        (dict(selection_alpha=True), ValueError, "level in"),
    ],
)
def test_selection_alpha_is_validated(tmp_path, fields, error, message):
    with pytest.raises(error, match=message):
        MaskTrainingArguments(output_dir=str(tmp_path), **fields)


@pytest.mark.parametrize(
    "fields,with_dev,message",
    [
        (dict(metric_for_best_model="loss", greater_is_better=False), True, "sign test on per-example accuracy"),
        (dict(metric_for_best_model="f1"), True, "sign test on per-example accuracy"),
        (dict(metric_for_best_model="accuracy", greater_is_better=False), True, "sign test on per-example accuracy"),
        (dict(), True, "sign test on per-example accuracy"),
        (dict(metric_for_best_model="accuracy", keep_best_mask=False), True, "masks evaluated during training"),
        (dict(metric_for_best_model="accuracy"), False, "eval_dataset"),  # the Trainer's own check
        (dict(metric_for_best_model="accuracy", eval_strategy="no"), True, "masks evaluated during training"),
    ],
)
def test_selection_alpha_needs_evaluations_by_accuracy(tmp_path, fields, with_dev, message):
    pre, finetuned, _, _ = _two_class_task()
    model = get_peft_model(copy.deepcopy(pre), GraftConfig(finetuned=finetuned, num_entries=4, learn_region=True))
    data = Dataset.from_dict({"x": [[0.0] * 64], "labels": [0]})
    args = fast_args(tmp_path, **{"eval_strategy": "steps", "eval_steps": 1, **fields, "selection_alpha": 0.05})
    with pytest.raises(ValueError, match=message):
        MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data if with_dev else None)


# ------------------------------------------------------------------------------------------ how far the region moved
def test_the_report_says_how_far_the_kept_region_moved_from_gamma_base(tmp_path):
    """entries_changed_from_start is the symmetric difference with gamma_base, iou_with_start their IoU (issue 37)."""
    task = _two_class_task()
    dev = Dataset.from_dict({"x": task[2][:3].tolist(), "labels": (1 - task[3][:3]).tolist()})
    trainer, start = planted_flipped_trainer(tmp_path, task, dev, _accuracy)
    trainer.train()
    region = trainer.model.get_region()
    common, union = (start & region).num_entries, (start | region).num_entries
    report = trainer.mask_report
    assert report["entries_changed_from_start"] == union - common > 0
    assert report["iou_with_start"] == pytest.approx(common / union) and report["iou_with_start"] < 1.0


def test_region_change_counts_entries_over_modules():
    entries = lambda *idx: (torch.tensor(idx, dtype=torch.long), torch.ones(len(idx)))  # noqa: E731
    start = {"a": entries(0, 1, 2), "b": entries(5)}
    kept = {"a": entries(1, 2, 3), "c": entries(7, 8)}
    # a: {0, 1, 2} vs {1, 2, 3}; b: {5} vs {}; c: {} vs {7, 8}: 2 shared, 7 in the union
    assert region_change(start, kept) == {"entries_changed_from_start": 5, "iou_with_start": 2 / 7}
    assert region_change({}, {}) == {"entries_changed_from_start": 0, "iou_with_start": 1.0}


def test_the_best_learned_mask_is_recorded_whether_it_passes_or_not():
    """The best learned mask by the selection metric (ties: the earlier), with its own p-value, passing or not."""
    selection = SignificantSelection(alpha=0.05, greater_is_better=True)
    reference = np.zeros(10, dtype=bool)
    selection.offer(0.0, 0, reference, {})
    selection.offer(0.3, 10, np.r_[np.ones(3, bool), np.zeros(7, bool)], {})  # 3-0: p = 1/8
    selection.offer(0.3, 20, np.r_[np.zeros(7, bool), np.ones(3, bool)], {})  # a tie: the earlier stays
    selection.offer(0.2, 30, np.r_[np.ones(2, bool), np.zeros(8, bool)], {})
    best = selection.best_learned
    assert best.step == 10 and best.p_value == pytest.approx(0.125) and selection.choice() is selection.start
