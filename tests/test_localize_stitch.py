"""LocalizeStitch (Localize-and-Stitch's localizer): its start (top of |tau| at +-sigmoid_bias over the eligible
tensors only), one full-batch step against a hand computation, the floating region size, exclusions, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from testing_utils import finetune_like, make_bert_cls
from torch import nn

from peft_graft import LocalizeStitch, Region


class Tiny(nn.Module):
    """loss = sum(w * x) + 0.5 * sum(b ** 2) + sum(head * x[:2]): gradients known by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([nn.Module(), nn.Module()])
        self.encoder.layer[0].w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
        self.encoder.layer[1].b = nn.Parameter(torch.tensor([0.3, -0.1]))
        self.head = nn.Parameter(torch.tensor([2.0, 2.0]))

    def forward(self, x: torch.Tensor):
        loss = (self.encoder.layer[0].w * x).sum() + 0.5 * (self.encoder.layer[1].b ** 2).sum()
        return type("Out", (), {"loss": loss + (self.head * x[:2]).sum()})()


FINETUNED = {
    "encoder.layer.0.w": torch.tensor([1.5, -2.0, 0.4]),  # tau = (0.5, 0, -0.1)
    "encoder.layer.1.b": torch.tensor([0.1, 0.7]),  # tau = (-0.2, 0.8)
    "head": torch.tensor([9.0, 9.0]),  # never eligible
}


def test_start_is_the_top_of_tau_at_plus_minus_bias():
    model = Tiny()
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.4, sigmoid_bias=3.0)  # int(0.4 * 5) = 2 entries
    assert set(localizer.params) == {"encoder.layer.0.w", "encoder.layer.1.b"}  # the head is not eligible
    assert torch.equal(localizer.scores["encoder.layer.0.w"], torch.tensor([3.0, -3.0, -3.0]))
    assert torch.equal(localizer.scores["encoder.layer.1.b"], torch.tensor([-3.0, 3.0]))
    assert localizer.region() == Region({"encoder.layer.0.w": [0], "encoder.layer.1.b": [1]})


def test_one_step_equals_the_hand_computation():
    model = Tiny()
    lr, l1, bias = 0.5, 0.2, 1.0
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.2, sigmoid_bias=bias, learning_rate=lr, l1_strength=l1)
    # |tau| = 0.5, 0, 0.1 (w) and 0.2, 0.8 (b): int(0.2 * 5) = 1 entry starts in the region, b[1]
    s_w, s_b = torch.tensor([-bias, -bias, -bias]), torch.tensor([-bias, bias])
    assert torch.equal(localizer.scores["encoder.layer.0.w"], s_w)
    assert torch.equal(localizer.scores["encoder.layer.1.b"], s_b)
    batches = [{"x": torch.tensor([1.0, 2.0, -1.0])}, {"x": torch.tensor([0.5, 0.0, 3.0])}]
    loss = localizer.step(batches)

    tau_w, tau_b = torch.tensor([0.5, 0.0, -0.1]), torch.tensor([-0.2, 0.8])
    pre_b = torch.tensor([0.3, -0.1])
    b_interp = pre_b + torch.sigmoid(s_b) * tau_b  # the model is evaluated here (not rounded)
    grad_w = torch.tensor([1.5, 2.0, 2.0])  # summed over the two batches' losses
    grad_b = 2 * b_interp

    def update(s, grad, tau):
        slope = torch.sigmoid(s) * (1 - torch.sigmoid(s))
        return s - lr * grad * tau * slope + l1 * torch.where(s > 0, slope, -slope)

    torch.testing.assert_close(localizer.scores["encoder.layer.0.w"], update(s_w, grad_w, tau_w))
    torch.testing.assert_close(localizer.scores["encoder.layer.1.b"], update(s_b, grad_b, tau_b))
    w_interp = torch.tensor([1.0, -2.0, 0.5]) + torch.sigmoid(s_w) * tau_w
    expected_loss = [float((w_interp * b["x"]).sum() + 0.5 * (b_interp**2).sum() + (2.0 * b["x"][:2]).sum())
                     for b in batches]  # fmt: skip
    assert math.isclose(loss, sum(expected_loss) / 2, rel_tol=1e-6)
    # theta_pre is back, the head untouched, no gradient left behind, requires_grad as it was
    assert torch.equal(model.encoder.layer[0].w.detach(), torch.tensor([1.0, -2.0, 0.5]))
    assert torch.equal(model.encoder.layer[1].b.detach(), pre_b)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_the_sign_keeping_term_pushes_scores_away_from_zero_and_the_size_floats():
    model = Tiny()
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.2, sigmoid_bias=0.5, learning_rate=0.0, l1_strength=1.0)
    before = {n: s.clone() for n, s in localizer.scores.items()}
    localizer.step([{"x": torch.ones(3)}])
    for name, scores in localizer.scores.items():
        assert torch.all(scores.abs() > before[name].abs()) and torch.equal(scores.sign(), before[name].sign())
    # a strong task gradient moves entries into the region: the size is not fixed
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.2, sigmoid_bias=0.5, learning_rate=50.0, l1_strength=0.0)
    history = localizer.train([{"x": torch.tensor([-1.0, 0.0, 1.0])}], steps=2)
    assert history[-1][1] > 1 and localizer.region()["encoder.layer.0.w"].tolist() == [0, 2]


def test_excluded_entries_never_join_the_region():
    model = Tiny()
    excluded = Region({"encoder.layer.1.b": [1], "encoder.layer.0.w": [0]})
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.2, sigmoid_bias=0.5, learning_rate=50.0, exclude=excluded)
    assert localizer.region() == Region({"encoder.layer.1.b": [0]})  # the top |tau| outside the excluded entries
    localizer.train([{"x": torch.tensor([-1.0, 0.0, 1.0])}], steps=3)
    assert localizer.region().num_entries >= 1 and not (localizer.region() & excluded).num_entries


def test_on_a_tiny_bert_only_encoder_layers_are_eligible():
    torch.manual_seed(0)
    pre = make_bert_cls().eval()
    finetuned = finetune_like(pre, scale=0.01, seed=1)
    localizer = LocalizeStitch(pre, finetuned, sparsity=1e-2)
    assert localizer.params and all(".encoder.layer." in f".{name}" for name in localizer.params)
    assert not any("pooler" in n or "classifier" in n or "embeddings" in n for n in localizer.region())
    assert localizer.region().num_entries == int(1e-2 * localizer.num_eligible)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(sparsity=1.5), ValueError, "sparsity must be a fraction in"),
        (dict(learning_rate=-1.0), ValueError, "learning_rate must be a finite number >= 0"),
        (dict(l1_strength=float("nan")), ValueError, "l1_strength must be a finite number >= 0"),
        (dict(include="nothing_matches"), ValueError, "No parameter of the model matches include='nothing_matches'"),
        (dict(exclude={"a": [0]}), TypeError, "exclude must be a Region"),
        (dict(exclude=Region({"encoder.layer.1.b": [5]})), ValueError, "exclude holds entry 5 of 'encoder.layer.1.b'"),
    ],
)
def test_bad_input_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        LocalizeStitch(Tiny(), FINETUNED, **kwargs)


def test_a_finetune_of_another_model_is_refused():
    with pytest.raises(ValueError, match=r"finetuned has no tensor 'encoder\.layer\.1\.b'"):
        LocalizeStitch(Tiny(), {"encoder.layer.0.w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"finetuned's 'encoder.layer.0.w' has shape \(2,\), the model's \(3,\)"):
        LocalizeStitch(Tiny(), {**FINETUNED, "encoder.layer.0.w": torch.zeros(2)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_finetune_is_refused_naming_the_tensor(bad):
    """One NaN or inf in the fine-tune made every score NaN and the region empty, with no error."""
    finetuned = {**FINETUNED, "encoder.layer.1.b": torch.tensor([0.1, bad])}
    with pytest.raises(ValueError, match=r"finetuned's 'encoder.layer.1.b' holds 1 NaN or inf entries \(e.g. flat "
                                         r"index 1: .*\): a region cannot be learned"):  # fmt: skip
        LocalizeStitch(Tiny(), finetuned)


def test_a_non_finite_loss_is_refused_and_the_scores_kept():
    model = Tiny()
    localizer = LocalizeStitch(model, FINETUNED, sparsity=0.4, sigmoid_bias=1.0, learning_rate=0.5)
    before = {name: scores.clone() for name, scores in localizer.scores.items()}
    batches = [{"x": torch.ones(3)}, {"x": torch.tensor([1.0, float("nan"), 0.0])}]
    with pytest.raises(ValueError, match=r"The loss of batch 1 is nan: the scores S are left as they were"):
        localizer.step(batches)
    assert all(torch.equal(localizer.scores[name], before[name]) for name in before)
    assert torch.equal(model.encoder.layer[0].w.detach(), torch.tensor([1.0, -2.0, 0.5]))  # theta_pre is back
    assert all(p.grad is None for p in model.parameters())
    localizer.step(batches[:1])  # a finite pass still steps
    assert localizer.region().num_entries >= 1


def test_a_finetune_equal_to_the_model_or_an_exclude_covering_everything_is_refused():
    model = Tiny()
    same = {name: p.detach().clone() for name, p in model.named_parameters()}
    equal = r"finetuned equals the model on every eligible entry outside exclude \(tau = theta_ft - theta_pre is 0\)"
    with pytest.raises(ValueError, match=rf"{equal}: there is nothing to localize"):
        LocalizeStitch(model, same)
    everything = Region({"encoder.layer.0.w": [0, 1, 2], "encoder.layer.1.b": [0, 1]})
    with pytest.raises(ValueError, match=r"exclude covers all 5 eligible entries: no entry could join the region"):
        LocalizeStitch(model, FINETUNED, exclude=everything)
    moved_only = Region({"encoder.layer.0.w": [0, 2], "encoder.layer.1.b": [0, 1]})  # w[1] did not move
    with pytest.raises(ValueError, match=r"nothing to localize"):
        LocalizeStitch(model, FINETUNED, exclude=moved_only)
