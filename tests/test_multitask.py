"""Multi-task regions (paper section 5.1, Figure 8): overlap matrix, Eq. 5 relative gains, unions of regions, the
"purify" steps inside a union, and the heatmap."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imread
from peft import get_peft_model
from testing_utils import clone_model, input_ids, make_pair, sparse_region

from peft_graft import GraftConfig, Region
from peft_graft.analysis import (
    group_regions,
    overlap_matrix,
    plot_region_matrix,
    purify,
    relative_gain,
    relative_gain_matrix,
)
from peft_graft.calibration import save_figure


def region(**indices) -> Region:
    return Region({name.replace("_", "."): torch.tensor(idx) for name, idx in indices.items()})


# |a| = 4, |b| = 3, |c| = 2; a & b = 2 entries, b & c = 1, a & c = 0
REGIONS = {
    "sst2": region(w=[0, 1, 2, 3]),
    "cr": region(w=[2, 3], v=[0]),
    "mnli": region(v=[0, 1]),
}


# Overlap (Figure 8a)


def test_overlap_matrix_is_the_asymmetric_overlap():
    matrix = overlap_matrix(REGIONS)
    expected = torch.tensor(
        [[1, 2 / 3, 0], [2 / 4, 1, 1 / 2], [0, 1 / 3, 1]],
        dtype=torch.float64,
    )
    assert matrix.dtype == torch.float64
    assert torch.allclose(matrix, expected, rtol=0, atol=1e-15)
    assert matrix[0, 1] != matrix[1, 0]  # |a & b| / |b| != |a & b| / |a|
    for i, a in enumerate(REGIONS.values()):
        for j, b in enumerate(REGIONS.values()):
            assert matrix[i, j].item() == pytest.approx(a.overlap(b), abs=1e-15)


def test_overlap_matrix_follows_the_mapping_order():
    reordered = {name: REGIONS[name] for name in ("mnli", "sst2", "cr")}
    assert torch.equal(overlap_matrix(reordered), overlap_matrix(REGIONS)[[2, 0, 1]][:, [2, 0, 1]])
    assert overlap_matrix({"only": REGIONS["sst2"]}).tolist() == [[1.0]]


@pytest.mark.parametrize(
    ("regions", "error", "match"),
    [
        ({}, ValueError, "regions is empty"),
        ({"sst2": REGIONS["sst2"], "qqp": Region()}, ValueError, "task 'qqp' is empty"),
        ({"sst2": REGIONS["sst2"], "qqp": {"w": torch.tensor([0])}}, TypeError, "task 'qqp' must be a Region"),
        ([REGIONS["sst2"]], TypeError, "must be a mapping"),
    ],
)
def test_overlap_matrix_errors(regions, error, match):
    with pytest.raises(error, match=match):
        overlap_matrix(regions)


# Relative gain (Eq. 5)


def test_relative_gain_is_eq_5():
    assert relative_gain(0.8, 0.5, 0.9) == pytest.approx(0.75)
    assert relative_gain(0.9, 0.5, 0.9) == 1.0
    assert relative_gain(0.5, 0.5, 0.9) == 0.0
    assert relative_gain(0.4, 0.5, 0.9) == pytest.approx(-0.25)  # worse than pre-trained
    assert relative_gain(0.3, 0.5, 0.1) == pytest.approx(0.5)  # a score where lower is better works too
    assert relative_gain(torch.tensor(0.8), 0.5, 0.9) == pytest.approx(0.75)
    assert isinstance(relative_gain(1, 0, 2), float)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.7, 0.6, 0.6, "mrpc"), r"of task 'mrpc' is undefined: the full model's score equals the pre-trained one"),
        ((0.7, 0.6, 0.6), r"relative gain is undefined"),
        ((math.nan, 0.5, 0.9, "qqp"), r"of task 'qqp' needs finite real scores: grafted is nan"),
        ((0.7, 0.5, math.inf), r"full is inf"),
        ((0.7, "0.5", 0.9), r"pretrained is '0.5'"),
    ],
)
def test_relative_gain_errors(args, match):
    with pytest.raises(ValueError, match=match):
        relative_gain(*args)


# Unions of regions (Figure 8c)


def test_group_regions_are_unions():
    groups = group_regions(REGIONS, {"sentiment": ["sst2", "cr"], "all": ("sst2", "cr", "mnli"), "one": ["mnli"]})
    assert list(groups) == ["sentiment", "all", "one"]
    assert groups["sentiment"] == region(w=[0, 1, 2, 3], v=[0])
    assert groups["all"] == region(w=[0, 1, 2, 3], v=[0, 1])
    assert groups["one"] == REGIONS["mnli"]
    assert groups["sentiment"].overlap(REGIONS["cr"]) == 1.0  # a union holds each of its regions


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        ({"nli": ["mnli", "snli", "qnli"]}, ValueError, r"Group 'nli' names tasks with no region: \['snli', 'qnli'\]"),
        ({"sentiment": ["sst2"], "none": []}, ValueError, "Group 'none' is empty"),
        ({"sentiment": "sst2"}, TypeError, "Group 'sentiment' must be a sequence of task names"),
        ({}, ValueError, "groups must be a non-empty mapping"),
    ],
)
def test_group_regions_errors(groups, error, match):
    with pytest.raises(error, match=match):
        group_regions(REGIONS, groups)


# Relative gain matrix (Figure 8b-d)

PRETRAINED = {"sst2": 0.5, "cr": 0.5, "mnli": 0.33}
FULL = {"sst2": 0.9, "cr": 0.8, "mnli": 0.83}


def overlap_score(calls: list | None = None):
    """A fake evaluation: a region recovers the share of the full model's gain on ``task`` that it covers of the
    task's own region, so the gain matrix is the overlap matrix."""

    def score(graft: Region, task: str) -> float:
        if calls is not None:
            calls.append((graft, task))
        return PRETRAINED[task] + (FULL[task] - PRETRAINED[task]) * graft.overlap(REGIONS[task])

    return score


def test_relative_gain_matrix_rows_are_regions_columns_are_tasks():
    calls = []
    gains = relative_gain_matrix(REGIONS, list(REGIONS), overlap_score(calls), PRETRAINED, FULL, disable_tqdm=True)
    assert gains.dtype == torch.float64 and gains.shape == (3, 3)
    assert torch.allclose(gains, overlap_matrix(REGIONS), rtol=0, atol=1e-12)
    assert [(list(REGIONS.values()).index(r), t) for r, t in calls] == [(i, t) for i in range(3) for t in REGIONS]


def test_relative_gain_matrix_of_groups_and_a_task_subset(capsys):
    groups = group_regions(REGIONS, {"sentiment": ["sst2", "cr"], "nli": ["mnli"]})
    gains = relative_gain_matrix(groups, ["mnli", "cr"], overlap_score(), PRETRAINED, FULL)  # with a progress bar
    assert torch.allclose(gains, torch.tensor([[1 / 2, 1.0], [1.0, 1 / 3]], dtype=torch.float64), atol=1e-12)
    assert "relative gain" in capsys.readouterr().err
    empty = relative_gain_matrix({"none": Region()}, ["sst2"], overlap_score(), PRETRAINED, FULL, disable_tqdm=True)
    assert empty.tolist() == [[0.0]]  # grafting nothing is theta_pre: no gain


@pytest.mark.parametrize(
    ("tasks", "pretrained", "full", "match"),
    [
        (["sst2", "qqp"], PRETRAINED, FULL, "No pretrained score for task 'qqp'"),
        (["sst2"], PRETRAINED, {"cr": 0.8}, "No full score for task 'sst2'"),
        (["cr"], PRETRAINED, {**FULL, "cr": 0.5}, "task 'cr' is undefined"),
        ([], PRETRAINED, FULL, "tasks must be a non-empty sequence"),
        ("sst2", PRETRAINED, FULL, "tasks must be a non-empty sequence"),
    ],
)
def test_relative_gain_matrix_checks_every_task_before_evaluating(tasks, pretrained, full, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        relative_gain_matrix(REGIONS, tasks, overlap_score(calls), pretrained, full, disable_tqdm=True)
    assert calls == []  # no (costly) evaluation ran


def test_relative_gain_matrix_names_the_region_of_a_bad_score():
    def score(graft: Region, task: str) -> float:
        return math.nan if graft is REGIONS["cr"] else 0.7

    with pytest.raises(ValueError, match=r"Region 'cr': .* of task 'sst2' needs finite real scores"):
        relative_gain_matrix(REGIONS, ["sst2"], score, PRETRAINED, FULL, disable_tqdm=True)


# Purify (Figure 8d)


def flat_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone().reshape(-1) for name, param in model.named_parameters()}


def changed(before: dict, after: dict, name: str) -> torch.Tensor:
    """Flat indices of ``name`` whose bits changed."""
    return (before[name].view(torch.int32) != after[name].view(torch.int32)).nonzero().reshape(-1)


def task_batches(num_tasks: int = 2, per_task: int = 1) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Sequence classification batches (3 labels) for the tiny BERT, per task."""
    return {
        f"task{t}": [
            {"input_ids": (ids := input_ids(batch=4, seed=10 * t + b)), "labels": ids[:, 0] % 3}
            for b in range(per_task)
        ]
        for t in range(num_tasks)
    }


def assert_clean(model: torch.nn.Module, flags: dict[str, bool]) -> None:
    """No hook left, no gradient left, every ``requires_grad`` as before."""
    for name, param in model.named_parameters():
        assert not param._post_accumulate_grad_hooks, name
        assert param.grad is None, name
        assert param.requires_grad == flags[name], name


def test_purify_changes_only_the_region_and_lowers_the_joint_loss():
    model = clone_model(make_pair("bert_cls")[0])
    allowed = sparse_region(model, 0.3, seed=1)
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    before = flat_state(model)
    losses = purify(model, allowed, task_batches(), steps=5, learning_rate=0.5)
    after = flat_state(model)
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] and losses == sorted(losses, reverse=True)  # the same batches every step
    moved = 0
    for name in before:
        diff = changed(before, after, name)
        if name in allowed:
            assert bool(torch.isin(diff, allowed[name]).all()), name
        else:
            assert torch.equal(before[name], after[name]), name
        moved += diff.numel()
    assert moved > 0.5 * allowed.num_entries
    assert_clean(model, flags)


def test_purify_joint_loss_is_the_sum_of_the_task_losses():
    model = clone_model(make_pair("bert_cls")[0])
    batches = task_batches(num_tasks=3)
    with torch.no_grad():
        expected = sum(float(model(**b[0]).loss) for b in batches.values())
    losses = purify(model, sparse_region(model, 0.1, seed=2), batches, steps=1)  # default SGD, lr 1e-2
    assert losses == [pytest.approx(expected, rel=1e-6)]


class Recorder(torch.nn.Module):
    """A linear regression that records which batch it sees (its ``x[0, 0]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> SimpleNamespace:
        self.seen.append(float(x[0, 0]))
        out = self.linear(x)
        return SimpleNamespace(loss=None if y is None else torch.nn.functional.mse_loss(out, y))


def batch(tag: float, target: float = 1.0) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([[tag, 1.0, 2.0]]), "y": torch.tensor([[target]])}


def test_purify_cycles_each_task_and_takes_your_optimizer():
    model = Recorder()
    one_shot = iter([batch(10.0), batch(11.0)])  # an iterator: its batches are remembered
    data = {"a": [batch(1.0), batch(2.0), batch(3.0)], "b": one_shot}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=0.1)
    bias = model.linear.bias.detach().clone()
    losses = purify(model, Region({"linear.weight": torch.tensor([1, 2])}), data, steps=4, optimizer=optimizer)
    assert len(losses) == 4
    assert model.seen == [1.0, 10.0, 2.0, 11.0, 3.0, 10.0, 1.0, 11.0]
    assert torch.equal(model.linear.bias, bias)  # not in the region: untouched despite weight decay and momentum


def test_purify_on_a_graft_model_uses_plain_names_and_leaves_graft_tensors():
    """Region names are the plain model's: a body tensor (its base_layer) and the head stored whole (its trained
    copy); the graft's own tensors and every other entry stay bit-identical."""
    pre, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20, task_type="SEQ_CLS"))
    model.eval()
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    body = "bert.encoder.layer.0.output.dense.weight"
    allowed = Region({body: torch.arange(0, 37 * 32, 3), "classifier.weight": torch.arange(3 * 32)})
    allowed = allowed - model.base_model.get_region()  # the base under grafted entries is checked at use
    stored = {
        body: f"base_model.model.{body.replace('.weight', '.base_layer.weight')}",
        "classifier.weight": "base_model.model.classifier.modules_to_save.default.weight",
    }
    before = flat_state(model)
    losses = purify(model, allowed, task_batches(), steps=3, learning_rate=0.5)
    after = flat_state(model)
    assert losses[-1] < losses[0]
    for plain, name in stored.items():
        assert changed(before, after, name).numel() > 0.5 * allowed[plain].numel(), name
        assert bool(torch.isin(changed(before, after, name), allowed[plain]).all()), name
    for name in set(before) - set(stored.values()):
        assert torch.equal(before[name], after[name]), name  # graft values and the original head included
    assert_clean(model, flags)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": 0}, ValueError, r"steps must be an integer >= 1, got 0"),
        ({"steps": 2.5}, ValueError, r"steps must be an integer >= 1"),
        ({"region": Region()}, ValueError, "region is empty"),
        ({"region": {"linear.weight": torch.tensor([0])}}, TypeError, "region must be a Region"),
        ({"task_batches": {}}, ValueError, "task_batches must be a non-empty mapping"),
        ({"learning_rate": 0.0}, ValueError, "learning_rate must be finite and > 0"),
        ({"region": Region({"nope.weight": torch.tensor([0])})}, ValueError, "names tensors the model does not have"),
        ({"task_batches": {"a": [batch(1.0)], "b": []}}, ValueError, "Task 'b' has no batches"),
        ({"task_batches": {"a": [{"x": batch(1.0)["x"]}]}}, ValueError, r"Task 'a': the model returned no loss"),
        (
            {"task_batches": {"a": [batch(1.0)], "b": [batch(2.0), batch(3.0, target=math.nan)]}},
            ValueError,
            r"Non-finite loss of task 'b' at purify step 2 of 3",
        ),
    ],
)
def test_purify_errors_change_nothing_more_and_clean_up(kwargs, error, match):
    model = Recorder()
    model.linear.bias.requires_grad_(False)
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    arguments = {"region": Region({"linear.weight": torch.tensor([0, 1])}), "task_batches": {"a": [batch(1.0)]}}
    arguments = {**arguments, "steps": 3, **kwargs}
    if "Non-finite" in match:  # step 1 runs, step 2 fails before it changes anything
        reference = Recorder()
        reference.load_state_dict(model.state_dict())
        purify(reference, arguments["region"], {"a": [batch(1.0)], "b": [batch(2.0)]}, steps=1)
    with pytest.raises(error, match=match):
        purify(model, **arguments)
    if "Non-finite" in match:
        assert torch.equal(model.linear.weight, reference.linear.weight)
    assert_clean(model, flags)


# Heatmap


def test_plot_region_matrix_labels_values_and_png(tmp_path):
    names = list(REGIONS)
    fig = plot_region_matrix(overlap_matrix(REGIONS), names, names, "Overlap", size_px=(400, 300), dpi=100)
    assert isinstance(fig, Figure) and isinstance(fig.canvas, FigureCanvasAgg)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == names
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    assert ax.get_title() == "Overlap"
    assert len(fig.axes) == 2  # the heatmap and its colorbar
    cells = [t.get_text() for t in ax.texts]
    assert cells == ["1.00", "0.67", "0.00", "0.50", "1.00", "0.50", "0.00", "0.33", "1.00"]
    path = save_figure(fig, tmp_path / "figs" / "overlap.png")
    assert imread(path).shape[:2] == (300, 400)


def test_plot_region_matrix_of_groups_against_tasks(tmp_path):
    gains = [[0.81, -0.02], [0.1, 0.77], [0.5, 0.5]]
    fig = plot_region_matrix(gains, ["sentiment", "nli", "both"], ["sst2", "mnli"], None, value_format=".0%")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["sst2", "mnli"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["sentiment", "nli", "both"]
    assert ax.texts[0].get_text() == "81%" and ax.texts[1].get_text() == "-2%"
    assert imread(save_figure(fig, tmp_path / "gains.png")).ndim == 3


@pytest.mark.parametrize(
    ("matrix", "rows", "cols", "match"),
    [
        (torch.zeros(2, 3), ["a", "b"], ["a", "b"], r"shape \(2, 3\) but 2 row names and 2 column names"),
        (torch.zeros(3), ["a", "b", "c"], ["a"], r"shape \(3,\)"),
        (torch.zeros(0, 0), [], [], "at least one row and one column"),
    ],
)
def test_plot_region_matrix_errors(matrix, rows, cols, match):
    with pytest.raises(ValueError, match=match):
        plot_region_matrix(matrix, rows, cols, "t")
