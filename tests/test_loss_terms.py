"""Loss terms count once per optimizer step, whatever the gradient accumulation and the Trainer's loss scaling."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from torch import nn
from torch.nn import functional as F
from transformers import TrainingArguments

from peft_graft import LossTermsTrainer


class WithProbe(nn.Module):
    """A classifier plus a ``probe`` parameter that only a loss term sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.probe = nn.Parameter(torch.zeros(3))

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return {"loss": None if labels is None else F.cross_entropy(logits, labels), "logits": logits}


class ProbeSum:
    name = "probe_sum"

    def __init__(self, model: WithProbe) -> None:
        self.model = model

    def __call__(self) -> torch.Tensor:
        return self.model.probe.sum()


@pytest.mark.parametrize("scaled", [False, True], ids=["trainer_divides", "compute_loss_func"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_a_loss_term_counts_once_per_optimizer_step(tmp_path, scaled, accumulation):
    torch.manual_seed(0)
    model = WithProbe()
    data = Dataset.from_dict({"x": torch.randn(8, 4).tolist(), "labels": torch.randint(0, 2, (8,)).tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
    )  # fmt: skip
    loss_func = (
        (lambda outputs, labels, num_items_in_batch=None: F.cross_entropy(outputs["logits"], labels))
        if scaled
        else None
    )
    trainer = LossTermsTrainer(
        model=model, args=args, train_dataset=data, loss_terms=[ProbeSum(model)], compute_loss_func=loss_func
    )
    trainer.train()
    # d(probe.sum())/d(probe) = 1 per step: two SGD steps of learning rate 1 move each entry by exactly -2.
    assert torch.equal(model.probe.detach(), torch.full((3,), -2.0))
    assert trainer.last_loss_terms["probe_sum"] == pytest.approx(-3.0)
    assert any("probe_sum" in entry for entry in trainer.state.log_history)


def test_loss_terms_must_be_named_callables(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="loss_terms"):
        LossTermsTrainer(model=WithProbe(), args=args, loss_terms=[lambda: torch.tensor(0.0)])
