"""Trainer integration: compute_metrics factory + CalibrationCallback (PNG files), on a tiny random BERT."""

import logging

import numpy as np
import pytest
import torch
from datasets import Dataset
from matplotlib.image import imread
from testing_utils import make_bert_cls
from transformers import BertForSequenceClassification, Trainer, TrainingArguments

from peft_graft.calibration.callbacks import (
    CalibrationCallback,
    CalibrationMetrics,
    _metric_prefix,
    make_compute_metrics,
)
from peft_graft.calibration.metrics import calibration_report, f1_score

NUM_LABELS = 3


def _dataset(n: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset.from_dict(
        {
            "input_ids": rng.integers(1, 99, size=(n, 8)).tolist(),
            "attention_mask": np.ones((n, 8), dtype=int).tolist(),
            "labels": rng.integers(0, NUM_LABELS, size=n).tolist(),
        }
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_bert_cls().eval()  # 3 labels


@pytest.fixture(scope="module")
def datasets_():
    return {"id": _dataset(20, 0), "ood": _dataset(12, 1)}


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_eval_batch_size=8, **kwargs
    )


def _logits(model, dataset: Dataset) -> np.ndarray:
    with torch.no_grad():
        ids = torch.tensor(dataset["input_ids"])
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()


def test_trainer_multi_eval_sets_metrics_and_pngs(model, datasets_, tmp_path, caplog):
    compute_metrics = make_compute_metrics(n_bins=5, f1_average="macro")
    callback = CalibrationCallback(compute_metrics, size_px=(320, 240), dpi=80)
    trainer = Trainer(model=model, args=_args(tmp_path), compute_metrics=compute_metrics, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="peft_graft.calibration.callbacks"):
        metrics = trainer.evaluate(eval_dataset=datasets_)

    for name, ds in datasets_.items():
        logits, labels = _logits(model, ds), np.array(ds["labels"])
        expected = calibration_report(logits, labels, n_bins=5)
        expected["f1"] = f1_score(logits, labels, average="macro")
        for key, value in expected.items():
            assert metrics[f"eval_{name}_{key}"] == pytest.approx(value, abs=1e-5), key

    assert [r["prefix"] for r in callback.history] == ["eval_id", "eval_ood"]
    calib_dir = tmp_path / "calibration"
    for record in callback.history:
        assert record["step"] == 0
        assert record["metrics"][f"{record['prefix']}_ece"] == metrics[f"{record['prefix']}_ece"]
        for kind, suffix in (("reliability_diagram", "reliability"), ("confidence_histogram", "confidence")):
            path = calib_dir / f"{record['prefix']}-step0-{suffix}.png"
            assert record[kind] == str(path)
            assert path.stat().st_size > 1000
            image = imread(path)
            assert image.shape[:2] == (240, 320)  # (height, width) in pixels, as asked
            assert image[..., :3].std() > 0.05  # not a blank canvas
    assert "Calibration at step 0: eval_id_accuracy=" in caplog.text

    # predict() goes through on_predict: prefix "test"
    trainer.predict(datasets_["id"])
    assert callback.history[-1]["prefix"] == "test"
    assert (calib_dir / "test-step0-reliability.png").exists()


def test_batch_eval_metrics_gives_same_values(model, datasets_, tmp_path):
    compute_metrics = make_compute_metrics(n_bins=5)
    plots_dir = tmp_path / "plots"
    callback = CalibrationCallback(compute_metrics, output_dir=plots_dir)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, batch_eval_metrics=True),
        compute_metrics=compute_metrics,
        callbacks=[callback],
    )
    metrics = trainer.evaluate(eval_dataset=datasets_["id"])  # 20 examples: batches of 8, 8, 4
    expected = calibration_report(_logits(model, datasets_["id"]), datasets_["id"]["labels"], n_bins=5)
    for key, value in expected.items():
        assert metrics[f"eval_{key}"] == pytest.approx(value, abs=1e-5)
    assert callback.history[0]["prefix"] == "eval"
    assert imread(plots_dir / "eval-step0-confidence.png").shape[:2] == (480, 480)  # default size


def test_batched_metrics_read_the_whole_set_once_and_forget_a_failed_evaluation():
    """With batch_eval_metrics: a batch of binary logits inside [0, 1] is not read as probabilities when the rest
    of the set says logits; a failed evaluation's batches do not leak into the next one."""
    logits, labels = np.array([3.0, -2.0, 0.2, 0.9]), np.array([1, 0, 1, 1])
    metrics = make_compute_metrics(metrics=["ece", "nll"])
    assert metrics((logits[:2], labels[:2]), compute_result=False) == {}
    assert metrics((logits[2:], labels[2:]), compute_result=True) == metrics((logits, labels))

    metrics = make_compute_metrics(metrics=["accuracy"])
    class_zero = np.array([[2.0, 0.0], [2.0, 0.0]])
    metrics((class_zero, np.array([1, 1])), compute_result=False)
    with pytest.raises(ValueError, match="outside the valid class range"):
        metrics((class_zero, np.array([0, 7])), compute_result=True)
    assert metrics((class_zero, np.array([0, 0])), compute_result=True) == {"accuracy": 1.0}


def test_an_evaluation_that_raises_leaves_no_batches_behind(model, datasets_, tmp_path, monkeypatch):
    compute_metrics = make_compute_metrics(n_bins=5)
    trainer = Trainer(model=model, args=_args(tmp_path, batch_eval_metrics=True), compute_metrics=compute_metrics)
    calls = []

    def fail_on_the_second_batch(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return original(*args, **kwargs)

    original = trainer.prediction_step
    monkeypatch.setattr(trainer, "prediction_step", fail_on_the_second_batch)
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.evaluate(eval_dataset=datasets_["id"])
    assert compute_metrics._batches == []
    monkeypatch.undo()
    metrics = trainer.evaluate(eval_dataset=datasets_["id"])
    expected = calibration_report(_logits(model, datasets_["id"]), datasets_["id"]["labels"], n_bins=5)
    assert metrics["eval_ece"] == pytest.approx(expected["ece"], abs=1e-5)


def test_compute_metrics_direct_call_and_errors():
    compute_metrics = make_compute_metrics(n_bins=2, metrics=["accuracy", "ece"], f1_average="binary")
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.35, 0.65], [0.6, 0.4]])
    out = compute_metrics((probs, np.array([0, 1, 1, 0])))
    assert out == pytest.approx({"accuracy": 0.75, "f1": 2 / 3, "ece": 0.0125})
    snapshot = compute_metrics.pop_last()
    assert snapshot.confidences.tolist() == pytest.approx([0.9, 0.8, 0.65, 0.6])
    assert snapshot.correct.tolist() == [True, False, True, True]
    assert compute_metrics.last is None
    # tuple predictions (logits, hidden states) -> logits are used
    out = compute_metrics(((probs, np.zeros((4, 3, 2))), np.array([0, 1, 1, 0])))
    assert out["accuracy"] == 0.75
    with pytest.raises(TypeError, match="preprocess_logits_for_metrics"):
        compute_metrics((np.array([0, 1, 1, 0]), np.array([0, 1, 1, 0])))
    with pytest.raises(ValueError, match="Length mismatch"):
        compute_metrics((probs, np.array([0, 1])))
    with pytest.raises(ValueError, match="n_bins"):
        make_compute_metrics(n_bins=0)
    with pytest.raises(ValueError, match="unknown names"):
        make_compute_metrics(metrics=["ece", "auroc"])
    with pytest.raises(ValueError, match="f1_average"):
        CalibrationMetrics(f1_average="micro")
    with pytest.raises(TypeError, match="make_compute_metrics"):
        CalibrationCallback(compute_metrics=lambda p: {})


def test_metric_prefix_from_names():
    metrics = {"eval_ood_adaptive_ece": 0.2, "eval_ood_ece": 0.1, "eval_ood_accuracy": 0.5, "eval_ood_loss": 1.0}
    assert _metric_prefix(metrics, ["ece", "accuracy"]) == "eval_ood"
    assert _metric_prefix(metrics, ["ece", "adaptive_ece"]) == "eval_ood"
    assert _metric_prefix(metrics, ["ece"]) == "eval_ood"  # not "eval_ood_adaptive"
    assert _metric_prefix(metrics, ["ece", "nll"]) is None


def test_callback_skips_evaluations_it_cannot_match(tmp_path, caplog):
    from transformers import TrainerControl, TrainerState

    compute_metrics = make_compute_metrics(metrics=["ece"])
    callback = CalibrationCallback(compute_metrics, output_dir=tmp_path)
    args, state, control = _args(tmp_path), TrainerState(), TrainerControl()
    callback.on_evaluate(args, state, control, metrics={"eval_loss": 1.0})  # compute_metrics did not run
    compute_metrics((np.array([[0.9, 0.1]]), np.array([0])))
    with caplog.at_level(logging.WARNING, logger="peft_graft.calibration.callbacks"):
        callback.on_evaluate(args, state, control, metrics={"eval_loss": 1.0})  # ... or its keys are missing
    assert "lack ['ece']" in caplog.text
    assert callback.history == [] and not list(tmp_path.iterdir())
    assert compute_metrics.last is None  # consumed: a later evaluation cannot pick up a stale snapshot


def test_calibration_table_from_trainers(model, datasets_, tmp_path):
    from peft_graft.calibration.metrics import agreement
    from peft_graft.calibration.table import calibration_table

    torch.manual_seed(1)
    other = BertForSequenceClassification(model.config).eval()
    trainers = {
        name: Trainer(model=m, args=_args(tmp_path / name), compute_metrics=make_compute_metrics())
        for name, m in (("FT", model), ("graft", other))
    }
    table = calibration_table(trainers, datasets_, reference="FT")
    assert [(r["model"], r["dataset"], r["n"]) for r in table] == [
        ("FT", "id", 20),
        ("FT", "ood", 12),
        ("graft", "id", 20),
        ("graft", "ood", 12),
    ]
    for row in table:
        logits = _logits(model if row["model"] == "FT" else other, datasets_[row["dataset"]])
        expected = calibration_report(logits, datasets_[row["dataset"]]["labels"], metrics=table.columns[3:-1])
        assert {k: row[k] for k in expected} == pytest.approx(expected, abs=1e-5)
        assert row["agreement"] == agreement(logits, _logits(model, datasets_[row["dataset"]]))
    assert table.row("FT", "ood")["agreement"] == 1.0


def test_callback_with_mask_trainer(datasets_, tmp_path):
    from peft import get_peft_model
    from testing_utils import clone_model, make_pair

    from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments

    pre, finetuned, task_type = make_pair("bert_cls")  # 3 labels, like datasets_
    graft = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20, learn_region=True, task_type=task_type)
    )
    compute_metrics = make_compute_metrics(n_bins=5)
    callback = CalibrationCallback(compute_metrics, size_px=(160, 120), dpi=40)
    args = MaskTrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
    )
    trainer = MaskTrainer(
        model=graft,
        args=args,
        train_dataset=datasets_["id"],
        eval_dataset=datasets_,
        compute_metrics=compute_metrics,
        callbacks=[callback],
    )
    trainer.train()
    assert [(r["step"], r["prefix"]) for r in callback.history] == [
        (1, "eval_id"),
        (1, "eval_ood"),
        (2, "eval_id"),
        (2, "eval_ood"),
    ]
    for record in callback.history:
        assert 0.0 <= record["metrics"][f"{record['prefix']}_ece"] <= 1.0
        assert imread(record["reliability_diagram"]).shape[:2] == (120, 160)
        assert imread(record["confidence_histogram"]).shape[:2] == (120, 160)
