"""run_merge.py end to end on a tiny random BERT and the packaged tasks (a few steps): every rule is merged and scored
with each task's head, the global methods' grid is scored on dev only, the interference view and the figures are
written, and a second run reuses every cached result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_examples import assets  # noqa: F401  (a fixture)
from transformers import AutoTokenizer, BertModel

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_merge  # noqa: E402


def test_run_merge_fills_the_table_and_the_interference_view(assets, tmp_path):  # noqa: F811
    encoder = tmp_path / "encoder"  # a BERT body without a head, as all-MiniLM-L6-v2 is shipped
    BertModel.from_pretrained(assets["cls"]).save_pretrained(encoder)
    AutoTokenizer.from_pretrained(assets["cls"]).save_pretrained(encoder)
    argv = ["--model_name_or_path", str(encoder), "--smoke", "--lambdas", "0.5", "1.0", "--densities", "0.5",
            "--work_dir", str(tmp_path / "work"), "--report_dir", str(tmp_path / "report")]  # fmt: skip
    results = run_merge.main(argv)
    merge = results["merge"]
    assert list(merge["test"]) == ["stitch", "stitch_dataless", *run_merge.GLOBAL_RULES]
    assert len(merge["grid_dev"]) == 2 + 3 * 2  # lambda for task arithmetic, lambda x density for the others
    scores = json.loads((tmp_path / "work" / "merge_scores.json").read_text())["scores"]
    grid_labels = {label.rsplit(" | ", 1)[0] for label in scores if label.endswith("| dev")}
    assert grid_labels == set(merge["grid_dev"])  # the grid never touched test
    for rule, row in merge["test"].items():
        assert row["label"] in merge["grid_dev"] or rule.startswith("stitch")
        assert all(0.0 <= row[task]["accuracy"] <= 100.0 for task in ("mr", "trec", "sms"))
        assert 0 < row["entries"] <= merge["moved_entries"] and row["bytes"] > 8 * row["entries"]
    stitched = merge["test"]["stitch"]["entries"]
    assert stitched <= sum(merge["interference"]["region_entries"].values())
    view = merge["interference"]
    assert set(view["accuracy"]) == {"own graft", "own graft without overlap", "stitched", "stitched without overlap"}
    assert [row[i] for i, row in enumerate(view["overlap_matrix"])] == [1.0, 1.0, 1.0]
    for name in ("summary.md", "results.json", "merge_accuracy_vs_size.png", "merge_overlap.png"):
        assert (tmp_path / "report" / name).is_file()
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "avg normalized acc" in summary and "Interference of the stitched model" in summary
    again = run_merge.main(argv)  # everything cached: the same numbers
    assert again["merge"]["test"] == merge["test"]
