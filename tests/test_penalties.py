"""MovementL1Penalty and MovementL1Trainer: the L1 penalty on |theta - theta_pre| (paper Figure 5)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from testing_utils import make_bert_cls
from transformers import TrainingArguments

from peft_graft import MovementL1Penalty, MovementL1Trainer


def test_penalty_value_and_gradient():
    model = torch.nn.Linear(3, 2)
    penalty = MovementL1Penalty(model, strength=0.5)
    assert penalty().item() == 0.0
    with torch.no_grad():
        model.weight[0, 0] += 2.0
        model.bias[1] -= 1.0
    value = penalty()
    assert value.item() == pytest.approx(0.5 * 3.0)
    value.backward()
    assert model.weight.grad[0, 0].item() == pytest.approx(0.5)
    assert model.bias.grad[1].item() == pytest.approx(-0.5)
    assert float(model.weight.grad.abs().sum()) == pytest.approx(0.5)


def test_penalty_only_trainable_or_named_parameters():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    assert MovementL1Penalty(model, 1.0).names == ["weight"]
    assert MovementL1Penalty(model, 1.0, parameters=["bias"]).names == ["bias"]
    with pytest.raises(ValueError, match="not parameters of the model"):
        MovementL1Penalty(model, 1.0, parameters=["nope"])


@pytest.mark.parametrize(
    ("strength", "error"),
    [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError)],
)
def test_penalty_bad_strength(strength, error):
    with pytest.raises(error, match="strength"):
        MovementL1Penalty(torch.nn.Linear(2, 2), strength)


def _train(tmp_path, movement_l1: float) -> tuple[torch.nn.Module, MovementL1Trainer]:
    torch.manual_seed(0)
    model = make_bert_cls()
    data = Dataset.from_dict(
        {"input_ids": torch.randint(3, 99, (16, 8)).tolist(), "labels": torch.randint(0, 3, (16,)).tolist()}
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
        optim="adamw_torch", report_to="none", logging_steps=1, use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = MovementL1Trainer(model=model, args=args, train_dataset=data, movement_l1=movement_l1)
    trainer.train()
    return model, trainer


def test_trainer_penalty_reduces_movement(tmp_path):
    plain, plain_trainer = _train(tmp_path / "plain", 0.0)
    assert plain_trainer.movement_penalty is None
    penalized, trainer = _train(tmp_path / "l1", 1.0)
    assert trainer.last_loss_terms["movement_l1"] > 0
    assert any("movement_l1" in entry for entry in trainer.state.log_history)
    torch.manual_seed(0)
    pre = make_bert_cls()
    movement = lambda m: sum((p - q).abs().sum() for p, q in zip(m.parameters(), pre.parameters(), strict=True))  # noqa: E731
    assert movement(penalized).item() < movement(plain).item()
