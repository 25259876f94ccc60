"""Tests of the functional calibration metrics and temperature scaling (hand-computed values + torchmetrics)."""

import math

import numpy as np
import pytest
import torch

from peft_graft.calibration.metrics import (
    DEFAULT_N_BINS,
    PROB_SUM_ATOL,
    accuracy,
    adaptive_calibration_error,
    agreement,
    brier_score,
    calibration_report,
    classwise_calibration_error,
    expected_calibration_error,
    f1_score,
    maximum_calibration_error,
    negative_log_likelihood,
    reliability_bins,
    to_probabilities,
)
from peft_graft.calibration.temperature import TemperatureScaler, fit_temperature

# conf 0.9 (right), 0.8 (wrong), 0.65 (right), 0.6 (right): 0.6 sits exactly on the edge 6/10 and, bins being
# left-closed [(m-1)/M, m/M), shares bin [0.6, 0.7) with 0.65.
PROBS = [[0.9, 0.1], [0.8, 0.2], [0.35, 0.65], [0.6, 0.4]]
LABELS = [0, 1, 1, 0]


def test_ece_hand_computed_with_left_closed_edge():
    # bins: [0.9,1): acc 1, conf .9 -> .1 ; [0.8,0.9): acc 0, conf .8 -> .8 ; [0.6,0.7): acc 1, conf .625 -> .375
    expected = 0.25 * 0.1 + 0.25 * 0.8 + 0.5 * 0.375
    assert expected_calibration_error(PROBS, LABELS) == pytest.approx(0.4125, abs=1e-12)
    assert expected == pytest.approx(0.4125)
    assert maximum_calibration_error(PROBS, LABELS) == pytest.approx(0.8, abs=1e-12)
    # M=2: everything in [0.5, 1]: acc .75, conf .7375
    assert expected_calibration_error(PROBS, LABELS, n_bins=2) == pytest.approx(0.0125, abs=1e-12)
    # M=1: a single bin [0, 1]
    assert expected_calibration_error(PROBS, LABELS, n_bins=1) == pytest.approx(0.0125, abs=1e-12)


def test_reliability_bins_statistics_and_empty_bins():
    probs = torch.tensor(PROBS, dtype=torch.float64)
    bins = reliability_bins(probs.max(1).values, torch.tensor([True, False, True, True]), n_bins=10)
    assert bins.edges.tolist() == pytest.approx([m / 10 for m in range(11)])
    assert bins.counts.tolist() == [0, 0, 0, 0, 0, 0, 2, 0, 1, 1]
    assert bins.confidence[6].item() == pytest.approx(0.625)
    assert bins.accuracy.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 1]
    assert bins.weights.sum().item() == pytest.approx(1.0)
    # empty bins contribute nothing to ECE and are ignored by MCE
    assert bins.expected_error() == pytest.approx(0.4125)
    assert bins.maximum_error() == pytest.approx(0.8)


def test_confidence_one_goes_to_last_bin_and_torchmetrics_edge_difference():
    from torchmetrics.functional.classification import multiclass_calibration_error

    probs = torch.tensor([[0.0, 1.0], [0.92, 0.08]])
    labels = torch.tensor([0, 0])  # conf 1.0 wrong, conf 0.92 right
    bins = reliability_bins(probs.max(1).values, probs.argmax(1).eq(labels), n_bins=10)
    assert bins.counts.tolist() == [0] * 9 + [2]
    # one bin [0.9, 1]: acc .5, conf .96
    assert expected_calibration_error(probs, labels, n_bins=10) == pytest.approx(0.46, abs=1e-7)
    # Edge-convention difference: torchmetrics bucketizes with right=True against linspace(0, 1, M+1) *including* 1.0
    # and never clamps, so a confidence of exactly 1.0 lands in an extra (M+1)-th bin [1, 1]: it gets
    # 0.5 * |0 - 1| + 0.5 * |1 - .92| = 0.54. Interior edges are left-closed in both, as in the paper.
    tm = multiclass_calibration_error(probs, labels, num_classes=2, n_bins=10, norm="l1").item()
    assert tm == pytest.approx(0.54, abs=1e-6)


@pytest.mark.parametrize("num_classes", [2, 3, 10])
@pytest.mark.parametrize("n_bins", [1, 5, 10, 15])
def test_matches_torchmetrics_on_random_inputs(num_classes, n_bins):
    from torchmetrics.functional.classification import multiclass_calibration_error

    gen = torch.Generator().manual_seed(num_classes * 100 + n_bins)
    logits = torch.randn(500, num_classes, generator=gen) * 2
    labels = torch.randint(0, num_classes, (500,), generator=gen)
    conf = torch.softmax(logits.double(), 1).max(1).values
    # continuous inputs: no confidence on (or within fp32 round-off of) a bin edge, nor at 1.0, where the two
    # conventions could differ (see test_confidence_one_goes_to_last_bin_and_torchmetrics_edge_difference)
    distance = (conf[:, None] - torch.arange(n_bins + 1.0, dtype=torch.float64)[None] / n_bins).abs()
    assert distance.min() > 1e-6
    for norm, fn in (("l1", expected_calibration_error), ("max", maximum_calibration_error)):
        expected = multiclass_calibration_error(logits, labels, num_classes, n_bins=n_bins, norm=norm).item()
        assert fn(logits, labels, n_bins=n_bins) == pytest.approx(expected, abs=1e-6)
        assert fn(logits.numpy(), labels.numpy(), n_bins=n_bins) == pytest.approx(expected, abs=1e-6)


def test_default_bins_match_torchmetrics_calibration_error_class():
    from torchmetrics import CalibrationError

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(200, 3, generator=gen) * 3
    labels = torch.randint(0, 3, (200,), generator=gen)
    metric = CalibrationError(task="multiclass", num_classes=3)  # its default n_bins is 15, like ours
    for start in range(0, 200, 64):  # accumulated over batches, as in an evaluation loop
        metric.update(logits[start : start + 64], labels[start : start + 64])
    assert DEFAULT_N_BINS == 15
    assert expected_calibration_error(logits, labels) == pytest.approx(metric.compute().item(), abs=1e-6)


def test_binary_one_dimensional_inputs():
    from torchmetrics.functional.classification import multiclass_calibration_error

    p = np.array([0.93, 0.17, 0.66, 0.44])  # P(y=1); no confidence on a bin edge (see the logit round trip below)
    two_col = np.stack([1 - p, p], axis=1)
    labels = np.array([1, 1, 1, 0])
    for fn in (expected_calibration_error, maximum_calibration_error, adaptive_calibration_error):
        assert fn(p, labels) == pytest.approx(fn(two_col, labels), abs=1e-12)
    assert brier_score(p, labels) == pytest.approx(brier_score(two_col, labels))
    # 1-D logits: sigmoid(z); "auto" reads values outside [0, 1] as logits
    z = np.log(p / (1 - p))
    assert expected_calibration_error(z, labels) == pytest.approx(expected_calibration_error(p, labels), abs=1e-12)
    assert negative_log_likelihood(np.array([math.log(3)]), [1]) == pytest.approx(-math.log(0.75))
    assert negative_log_likelihood(np.array([math.log(3)]), [0]) == pytest.approx(-math.log(0.25))
    # ambiguity: logits that all lie in [0, 1] are read as probabilities unless input_type="logits"
    z01 = np.array([0.5, 0.2])
    assert to_probabilities(z01)[:, 1].tolist() == pytest.approx([0.5, 0.2])
    assert to_probabilities(z01, input_type="logits")[:, 1].tolist() == pytest.approx(
        [1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-0.2))]
    )
    # torchmetrics' *binary* task is not top-label; its multiclass task on [1-p, p] is
    rng = np.random.default_rng(0)
    q = rng.uniform(size=300)
    y = rng.integers(0, 2, size=300)
    expected = multiclass_calibration_error(torch.tensor(np.stack([1 - q, q], 1)), torch.tensor(y), 2, n_bins=15)
    assert expected_calibration_error(q, y) == pytest.approx(expected.item(), abs=1e-6)


def test_numpy_torch_list_inputs_agree():
    expected = expected_calibration_error(PROBS, LABELS)
    assert expected_calibration_error(np.array(PROBS), np.array(LABELS)) == expected
    assert expected_calibration_error(torch.tensor(PROBS, dtype=torch.float64), torch.tensor(LABELS)) == expected
    # fp32 inputs are binned by their exact value: float32(0.9) < 0.9 lands in [0.8, 0.9), so use off-edge values
    off_edge = [[0.93, 0.07], [0.84, 0.16], [0.35, 0.65], [0.62, 0.38]]
    expected = expected_calibration_error(off_edge, LABELS)
    assert expected == pytest.approx(0.25 * 0.07 + 0.25 * 0.84 + 0.5 * (1 - 0.635))
    for dtype in (np.float32, np.float16):
        assert expected_calibration_error(np.array(off_edge, dtype=dtype), LABELS) == pytest.approx(expected, abs=1e-3)
    assert expected_calibration_error(torch.tensor(off_edge), torch.tensor(LABELS)) == pytest.approx(expected)
    assert expected_calibration_error(torch.tensor(off_edge, dtype=torch.bfloat16), LABELS) == pytest.approx(
        expected, abs=1e-2
    )
    logits = torch.log(torch.tensor(off_edge, dtype=torch.float64)) + 5.0  # logits (values outside [0, 1])
    assert expected_calibration_error(logits, LABELS) == pytest.approx(expected, abs=1e-12)


def test_all_correct_all_wrong_and_one_class():
    confident = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert expected_calibration_error(confident, [0, 1]) == 0.0
    assert maximum_calibration_error(confident, [0, 1]) == 0.0
    assert brier_score(confident, [0, 1]) == 0.0
    assert accuracy(confident, [0, 1]) == 1.0
    probs = [[0.7, 0.3], [0.3, 0.7]]
    assert expected_calibration_error(probs, [0, 1]) == pytest.approx(0.3)  # all correct at conf .7
    assert expected_calibration_error(probs, [1, 0]) == pytest.approx(0.7)  # all wrong at conf .7
    assert maximum_calibration_error(probs, [1, 0]) == pytest.approx(0.7)
    assert accuracy(probs, [1, 0]) == 0.0
    # only one class present in the labels
    three = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]
    # class-2 labels: correct only for the last (conf .6); bins [.5,.6): {.5 wrong}, [.6,.7): {.6 right, .6 wrong}
    assert expected_calibration_error(three, [2, 2, 2]) == pytest.approx((0.5 + 2 * 0.1) / 3)
    assert accuracy(three, [2, 2, 2]) == pytest.approx(1 / 3)
    # one example
    assert expected_calibration_error([[0.2, 0.8]], [1]) == pytest.approx(0.2)


def test_adaptive_ece_hand_computed():
    probs = [[0.55, 0.45], [0.4, 0.6], [0.7, 0.3], [0.05, 0.95]]
    labels = [1, 1, 0, 1]  # conf .55 wrong, .6 right, .7 right, .95 right
    # equal-mass M=2: {.55, .6}: acc .5 conf .575 ; {.7, .95}: acc 1 conf .825
    assert adaptive_calibration_error(probs, labels, n_bins=2) == pytest.approx(0.5 * 0.075 + 0.5 * 0.175)
    assert expected_calibration_error(probs, labels, n_bins=2) == pytest.approx(0.05)
    # with n <= M every example has its own bin: ACE = mean |correct - conf|
    assert adaptive_calibration_error(probs, labels, n_bins=10) == pytest.approx((0.55 + 0.4 + 0.3 + 0.05) / 4)
    bins = reliability_bins([0.1, 0.2, 0.3, 0.4, 0.5], [1, 1, 1, 1, 1], n_bins=2, strategy="quantile")
    assert bins.counts.tolist() == [3, 2]
    assert bins.edges.tolist() == pytest.approx([0.0, 0.35, 1.0])


def test_classwise_ece_hand_computed():
    # class 0: p0=[.5,.1], y==0 -> [1,0]: bins [0,.5):{.1 vs 0} [.5,1]:{.5 vs 1} -> .5*.1+.5*.5 = .3
    # class 1: p1=[.3,.6], never the label -> .5*.3+.5*.6 = .45 ; class 2: p2=[.2,.3], y==2 -> [0,1] -> |.5-.25|=.25
    probs = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]
    assert classwise_calibration_error(probs, [0, 2], n_bins=2) == pytest.approx((0.3 + 0.45 + 0.25) / 3)
    assert classwise_calibration_error([[0.8, 0.2], [0.3, 0.7]], [0, 0], n_bins=2) == pytest.approx(0.45)


def test_brier_nll_agreement_f1_hand_computed():
    probs = [[0.9, 0.1], [0.2, 0.8]]
    assert brier_score(probs, [0, 0]) == pytest.approx((0.02 + 1.28) / 2)
    assert negative_log_likelihood(probs, [0, 0]) == pytest.approx(-(math.log(0.9) + math.log(0.2)) / 2)
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert negative_log_likelihood(logits, [1]) == pytest.approx(-math.log(0.75))
    assert negative_log_likelihood([[1.0, 0.0]], [1]) == pytest.approx(-math.log(1e-12))  # clamped, finite
    a = [[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]]
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # one-hot probabilities: argmax 0, 1, 1
    assert agreement(a, b) == pytest.approx(2 / 3)
    assert agreement(a, np.array([0, 1, 1])) == pytest.approx(2 / 3)  # integer class predictions
    assert agreement(a, a) == 1.0
    # f1: preds [0, 1, 0], labels [0, 1, 1]: class 1: tp 1, fp 0, fn 1 -> 2/3 ; class 0: tp 1, fp 1, fn 0 -> 2/3
    assert f1_score(a, [0, 1, 1], average="binary") == pytest.approx(2 / 3)
    assert f1_score(a, [0, 1, 1], average="macro") == pytest.approx(2 / 3)
    assert f1_score(a, [0, 0, 0], average="binary") == 0.0


def test_calibration_report_matches_individual_functions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, generator=gen)
    labels = torch.randint(0, 4, (64,), generator=gen)
    ref = torch.randn(64, 4, generator=gen)
    report = calibration_report(logits, labels, n_bins=7, reference_preds=ref)
    assert report == pytest.approx(
        {
            "accuracy": accuracy(logits, labels),
            "ece": expected_calibration_error(logits, labels, 7),
            "mce": maximum_calibration_error(logits, labels, 7),
            "adaptive_ece": adaptive_calibration_error(logits, labels, 7),
            "classwise_ece": classwise_calibration_error(logits, labels, 7),
            "brier": brier_score(logits, labels),
            "nll": negative_log_likelihood(logits, labels),
            "agreement": agreement(logits, ref),
        }
    )
    assert list(calibration_report(logits, labels, metrics=["nll", "ece"])) == ["nll", "ece"]
    assert report["nll"] == pytest.approx(torch.nn.functional.cross_entropy(logits.double(), labels).item())


def test_probability_sum_tolerance():
    fp32 = torch.softmax(torch.randn(100, 50) * 4, dim=1).float()
    expected_calibration_error(fp32, torch.zeros(100, dtype=torch.long), input_type="probs")  # accepted
    nearly = [[0.5 + PROB_SUM_ATOL / 2, 0.5]]
    assert expected_calibration_error(nearly, [0]) == pytest.approx(0.5 - PROB_SUM_ATOL / 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"preds": [[0.9, 0.1], [0.2, 0.8]], "labels": [0]}, ValueError, "Length mismatch"),
        ({"preds": [[0.9, float("nan")]], "labels": [0]}, ValueError, "NaN or infinite"),
        ({"preds": [[0.0, float("inf")]], "labels": [0]}, ValueError, "NaN or infinite"),
        ({"preds": [float("-inf")], "labels": [0]}, ValueError, "NaN or infinite"),
        ({"preds": [[0.6, 0.3]], "labels": [0]}, ValueError, "do not sum to 1"),
        ({"preds": [[0.6, 0.3]], "labels": [0], "input_type": "probs"}, ValueError, "do not sum to 1"),
        ({"preds": [[0.6, 0.6]], "labels": [0]}, ValueError, "input_type='logits'"),
        ({"preds": [[1.5, -0.5]], "labels": [0], "input_type": "probs"}, ValueError, "outside \\[0, 1\\]"),
        ({"preds": [[0.9, 0.1]], "labels": [2]}, ValueError, "outside the valid class range"),
        ({"preds": [[0.9, 0.1]], "labels": [-1]}, ValueError, "outside the valid class range"),
        ({"preds": [0.9], "labels": [2]}, ValueError, "outside the valid class range"),
        ({"preds": [[0.9, 0.1]], "labels": [0.0]}, TypeError, "integer class indices"),
        ({"preds": [[0.9, 0.1]], "labels": [0], "n_bins": 0}, ValueError, "n_bins"),
        ({"preds": [[0.9, 0.1]], "labels": [0], "n_bins": -3}, ValueError, "n_bins"),
        ({"preds": [[0.9, 0.1]], "labels": [0], "n_bins": 2.5}, ValueError, "n_bins"),
        ({"preds": [[0.9, 0.1]], "labels": [0], "input_type": "logit"}, ValueError, "input_type"),
        ({"preds": np.zeros((2, 2, 2)), "labels": [0, 1]}, ValueError, "shape"),
        ({"preds": np.zeros((2, 1)), "labels": [0, 1]}, ValueError, "at least 2 columns"),
        ({"preds": np.zeros((0, 2)), "labels": []}, ValueError, "empty"),
        ({"preds": "0.9", "labels": [0]}, TypeError, "preds"),
        ({"preds": np.array([0, 2, 1]), "labels": [0, 2, 1]}, TypeError, "class ids"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        expected_calibration_error(**kwargs)


def test_bad_inputs_other_functions():
    with pytest.raises(ValueError, match="n_bins"):
        maximum_calibration_error(PROBS, LABELS, n_bins=0)
    with pytest.raises(ValueError, match="n_bins"):
        adaptive_calibration_error(PROBS, LABELS, n_bins=0)
    with pytest.raises(ValueError, match="n_bins"):
        classwise_calibration_error(PROBS, LABELS, n_bins=0)
    with pytest.raises(ValueError, match="Length mismatch"):
        brier_score(PROBS, LABELS[:3])
    with pytest.raises(ValueError, match="NaN"):
        negative_log_likelihood([[0.0, float("nan")]], [0])
    with pytest.raises(ValueError, match="outside the valid class range"):
        negative_log_likelihood(PROBS, [0, 1, 2, 0])
    with pytest.raises(ValueError, match="Length mismatch"):
        agreement(PROBS, PROBS[:2])
    with pytest.raises(ValueError, match="reference_preds"):
        calibration_report(PROBS, LABELS, reference_preds=PROBS[:2])
    with pytest.raises(ValueError, match="unknown names"):
        calibration_report(PROBS, LABELS, metrics=["ece", "auroc"])
    with pytest.raises(ValueError, match="average"):
        f1_score(PROBS, LABELS, average="weighted")
    with pytest.raises(ValueError, match="strategy"):
        reliability_bins([0.5], [1], strategy="kmeans")


def test_temperature_scaling_recovers_temperature():
    gen = torch.Generator().manual_seed(0)
    true_logits = torch.randn(1500, 4, generator=gen) * 2
    labels = torch.multinomial(torch.softmax(true_logits, 1), 1, generator=gen).squeeze(1)
    overconfident = 3.0 * true_logits
    scaler = fit_temperature(overconfident, labels)
    assert scaler.temperature == pytest.approx(3.0, rel=0.1)
    # T is a stationary point of the held-out NLL, and improves it
    t = scaler.temperature
    nll = negative_log_likelihood(overconfident / t, labels)
    assert nll == pytest.approx(scaler.nll_after)
    assert nll <= negative_log_likelihood(overconfident / (t * 1.02), labels)
    assert nll <= negative_log_likelihood(overconfident / (t / 1.02), labels)
    assert scaler.nll_after < scaler.nll_before == pytest.approx(negative_log_likelihood(overconfident, labels))
    assert expected_calibration_error(scaler.scale_logits(overconfident), labels) < expected_calibration_error(
        overconfident, labels
    )
    # apply keeps the container type; calibrate returns probabilities
    as_np = scaler.scale_logits(overconfident.numpy())
    assert isinstance(as_np, np.ndarray) and as_np.dtype == np.float32
    np.testing.assert_allclose(as_np, overconfident.numpy() / t, rtol=1e-6)
    probs = scaler.calibrate(overconfident)
    torch.testing.assert_close(probs, torch.softmax(overconfident.double() / t, 1))
    # probabilities in: softmax(log p / T) == softmax(logits / T)
    np.testing.assert_allclose(scaler.calibrate(torch.softmax(overconfident.double(), 1)), probs, atol=1e-9)


def test_temperature_binary_and_validation():
    z = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    y = torch.tensor([1, 0, 0, 1, 1, 1])
    one_d = fit_temperature(z, y)
    two_d = fit_temperature(torch.stack([torch.zeros_like(z), z], 1), y)
    assert one_d.temperature == pytest.approx(two_d.temperature, rel=1e-5)
    assert TemperatureScaler(2.0).calibrate(np.array([2.0]))[0, 1] == pytest.approx(1 / (1 + math.exp(-1.0)))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            TemperatureScaler(bad)
    with pytest.raises(ValueError, match="Length mismatch"):
        fit_temperature(z, y[:3])
    with pytest.raises(ValueError, match="max_iter"):
        fit_temperature(z, y, max_iter=0)
