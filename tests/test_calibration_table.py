"""Multi-model / multi-dataset table, matplotlib figures and the `evaluate` module."""

import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import imread

from peft_graft.calibration import EVALUATE_MODULE_PATH
from peft_graft.calibration.metrics import calibration_report, reliability_bins
from peft_graft.calibration.plots import confidence_histogram, reliability_diagram, save_figure
from peft_graft.calibration.table import CalibrationTable, calibration_table, print_table

FT = {
    "id": ([[0.9, 0.1], [0.8, 0.2], [0.35, 0.65], [0.6, 0.4]], [0, 1, 1, 0]),
    "ood": ([[0.7, 0.3], [0.3, 0.7]], [1, 0]),
}
GRAFT = {
    "id": ([[0.7, 0.3], [0.4, 0.6], [0.35, 0.65], [0.6, 0.4]], [0, 1, 1, 0]),
    "ood": ([[0.7, 0.3], [0.7, 0.3]], [1, 0]),
}
EXPECTED_MARKDOWN = """\
| model | dataset |   n | accuracy |    ece |    mce |  brier |    nll | agreement |
|-------|---------|----:|---------:|-------:|-------:|-------:|-------:|----------:|
| FT    | id      |   4 |   0.7500 | 0.4125 | 0.8000 | 0.4663 | 0.6641 |    1.0000 |
| FT    | ood     |   2 |   0.0000 | 0.7000 | 0.7000 | 0.9800 | 1.2040 |    1.0000 |
| graft | id      |   4 |   1.0000 | 0.3625 | 0.3833 | 0.2663 | 0.4523 |    0.7500 |
| graft | ood     |   2 |   0.5000 | 0.2000 | 0.2000 | 0.5800 | 0.7803 |    0.5000 |"""


def test_table_from_precomputed_predictions(capsys):
    table = calibration_table({"FT": FT, "graft": GRAFT}, reference="FT")
    assert table.columns == ["model", "dataset", "n", "accuracy", "ece", "mce", "brier", "nll", "agreement"]
    assert [(r["model"], r["dataset"]) for r in table] == [
        ("FT", "id"),
        ("FT", "ood"),
        ("graft", "id"),
        ("graft", "ood"),
    ]
    # graft/id: conf .7 (bin [.7,.8)) and .6, .65, .6 (bin [.6,.7)), all right: .25*.3 + .75*(1 - 37/60)
    row = table.row("graft", "id")
    assert row["ece"] == pytest.approx(0.25 * 0.3 + 0.75 * (1 - 0.6 - 0.05 / 3))
    assert row["agreement"] == 0.75  # argmax FT [0, 0, 1, 0] vs graft [0, 1, 1, 0]
    assert table.row("FT", "ood")["brier"] == pytest.approx(0.98)
    assert table.to_markdown() == EXPECTED_MARKDOWN
    assert str(table) == EXPECTED_MARKDOWN
    print_table(table)
    assert capsys.readouterr().out == EXPECTED_MARKDOWN + "\n"
    frame = table.to_pandas()
    assert list(frame.columns) == table.columns
    assert frame["ece"].tolist() == pytest.approx([r["ece"] for r in table])


def test_table_from_callables_and_dataset_labels():
    datasets = {"id": {"label": [0, 1, 1, 0], "x": FT["id"][0]}, "ood": {"label": [1, 0], "x": FT["ood"][0]}}
    table = calibration_table(
        {"logits_only": lambda ds: np.log(np.array(ds["x"])), "pair": lambda ds: (ds["x"], ds["label"])},
        datasets,
        metrics=["accuracy", "ece", "adaptive_ece", "classwise_ece"],
        n_bins=7,  # no value on an edge k/7, so the log/softmax round trip of "logits_only" cannot switch bins
    )
    assert table.columns == ["model", "dataset", "n", "accuracy", "ece", "adaptive_ece", "classwise_ece"]
    for row in table:
        expected = calibration_report(
            *FT[row["dataset"]], 7, metrics=["accuracy", "ece", "adaptive_ece", "classwise_ece"]
        )
        assert {k: row[k] for k in expected} == pytest.approx(expected)
    # a single source is named "model"
    single = calibration_table(lambda ds: ds["x"], {"id": datasets["id"]})
    assert [r["model"] for r in single] == ["model"]


def test_table_errors(monkeypatch):
    with pytest.raises(ValueError, match="reference"):
        calibration_table({"FT": FT}, reference="graft")
    with pytest.raises(ValueError, match="datasets"):
        calibration_table({"FT": lambda ds: ds})
    with pytest.raises(ValueError, match="no dataset 'ood'"):
        calibration_table({"FT": {"id": FT["id"]}}, {"id": None, "ood": None})
    with pytest.raises(ValueError, match="label"):
        calibration_table({"FT": lambda ds: ds["x"]}, {"id": {"x": FT["id"][0]}})
    with pytest.raises(TypeError, match="must be a Trainer"):
        calibration_table({"FT": 3}, {"id": None})
    with pytest.raises(ValueError, match="unknown names"):
        calibration_table({"FT": FT}, metrics=["ece", "auroc"])
    with pytest.raises(ValueError, match="reference_preds"):
        calibration_table({"FT": FT, "short": {"id": ([[0.5, 0.5]], [0])}}, reference="FT", datasets={"id": None})
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not installed
    with pytest.raises(ImportError, match="pip install pandas"):
        CalibrationTable(columns=["model"]).to_pandas()


def test_reliability_diagram_bars_and_png_size(tmp_path):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(300, 4)) * 2
    labels = rng.integers(0, 4, size=300)
    fig = reliability_diagram(logits, labels, n_bins=10, title="FT", size_px=(400, 300), dpi=100)
    assert isinstance(fig.canvas, FigureCanvasAgg)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    bins = reliability_bins(probs.max(1), probs.argmax(1) == labels, n_bins=10)
    heights = [p.get_height() for p in fig.axes[0].patches[:10]]  # first bar series: per-bin accuracy
    assert heights == pytest.approx(bins.accuracy.tolist())
    assert f"ECE = {100 * bins.expected_error():.2f}%" in fig.axes[0].get_title()
    path = save_figure(fig, tmp_path / "sub" / "rel.png")
    image = imread(path)
    assert image.shape[:2] == (300, 400)
    hist = confidence_histogram(confidences=probs.max(1), n_bins=20, size_px=(256, 200), dpi=64)
    fractions = [p.get_height() for p in hist.axes[0].patches]
    assert sum(fractions) == pytest.approx(1.0)
    assert fractions == pytest.approx((np.histogram(probs.max(1), bins=20, range=(0, 1))[0] / 300).tolist())
    assert imread(save_figure(hist, tmp_path / "hist.png")).shape[:2] == (200, 256)


def test_plot_argument_errors():
    with pytest.raises(ValueError, match="correct"):
        reliability_diagram(confidences=[0.5, 0.7])
    with pytest.raises(ValueError, match="not both"):
        reliability_diagram([[0.5, 0.5]], [0], confidences=[0.5])
    with pytest.raises(ValueError, match="labels"):
        confidence_histogram([[0.5, 0.5]])
    with pytest.raises(ValueError, match="size_px"):
        confidence_histogram(confidences=[0.5], size_px=(10.5, 100))
    with pytest.raises(ValueError, match="n_bins"):
        reliability_diagram([[0.5, 0.5]], [0], n_bins=0)


METRIC_DIR = Path(EVALUATE_MODULE_PATH)


def test_evaluate_module_loads_offline(tmp_path, monkeypatch):
    import evaluate

    def no_network(*args, **kwargs):
        raise AssertionError("the evaluate module tried to open a network connection")

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")  # keep the repo tree clean
    before = sorted(p.name for p in METRIC_DIR.iterdir())

    metric = evaluate.load(str(METRIC_DIR), cache_dir=str(tmp_path / "cache"), keep_in_memory=True)
    # the example of the module's docstring
    assert metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0], metrics=["accuracy", "ece"]) == (
        pytest.approx({"accuracy": 0.5, "ece": 0.45})
    )
    probs, labels = FT["id"]
    result = metric.compute(predictions=probs, references=labels)
    assert result == pytest.approx(calibration_report(probs, labels))
    assert result["ece"] == pytest.approx(0.4125)
    assert metric.compute(predictions=probs, references=labels, n_bins=2, metrics=["ece"]) == pytest.approx(
        {"ece": 0.0125}
    )
    # 1-D binary positive-class probabilities, and batches
    assert metric.compute(predictions=[0.1, 0.8], references=[0, 0], metrics=["accuracy"]) == {"accuracy": 0.5}
    for start in (0, 2):
        metric.add_batch(predictions=probs[start : start + 2], references=labels[start : start + 2])
    assert metric.compute(metrics=["ece", "mce"]) == pytest.approx({"ece": 0.4125, "mce": 0.8})
    with pytest.raises(ValueError, match="outside the valid class range"):
        metric.compute(predictions=probs, references=[0, 1, 2, 0])
    assert sorted(p.name for p in METRIC_DIR.iterdir()) == before
    assert any((tmp_path / "modules").rglob("calibration.py"))
