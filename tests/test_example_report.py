"""What run_evaluate.py's report shows: the sweep figure's reference lines, and what each graft's mask selection did
(issue 37)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_evaluate  # noqa: E402


def test_the_sweep_figure_shows_every_reference_line_and_point():
    """The main run's figure (its sweep, benchmarks/figures/main_trec_seed42.json): every region below the fine-tuned
    accuracy (93.9%), whose dashed line the y axis used to stop on (at 93.95), hidden by the frame."""
    sweep = {
        "learned": {2271: 0.786, 22714: 0.874},
        "top-k movement": {2271: 0.2355, 22714: 0.737, 227137: 0.906},
        "random": {2271: 0.2775, 22714: 0.277, 227137: 0.2715},
    }
    references = {"fine-tuned": 0.939, "pre-trained + FT head": 0.278}
    fig = run_evaluate.plot_sweep(sweep, references, "TREC")
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert low <= 23.55 - 1 and high >= 93.9 + 1  # the lowest point and the highest line, a point or more inside
    drawn = sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() in ("--", ":"))
    assert drawn == pytest.approx([27.8, 93.9])


def test_the_sweep_figure_keeps_a_margin_when_everything_is_equal():
    fig = run_evaluate.plot_sweep({"learned": {10: 0.5}}, {"fine-tuned": 0.5}, "flat")
    low, high = fig.axes[0].get_ylim()
    assert low < 50.0 < high


def test_the_report_says_how_far_each_learned_region_moved(tmp_path):
    saved = {"selected_step": 0, "evaluated_masks": 10, "best_learned_step": 30, "best_learned_p_value": 0.0123,
             "entries_changed_from_start": 1234, "iou_with_start": 0.456, "eval_accuracy": 0.7}  # fmt: skip
    (tmp_path / "graft_results.json").write_text(json.dumps(saved))
    graft = run_evaluate._selection_of(str(tmp_path))
    assert graft == {key: value for key, value in saved.items() if key != "eval_accuracy"}
    assert run_evaluate._selection_note(graft) == (
        ", the starting mask gamma_base kept (the best learned mask, of step 30, not significant: sign test p = 0.012 "
        "over 10 masks), 1,234 entries changed from gamma_base, IoU 0.46"
    )
    kept = {**graft, "selected_step": 30, "selection_p_value": 0.0012, "best_learned_p_value": 0.0012}
    assert run_evaluate._selection_note(kept) == (
        ", the mask of step 30 (sign test p = 0.0012 over 10 masks), 1,234 entries changed from gamma_base, IoU 0.46"
    )
    no_test = {"selected_step": 20, "entries_changed_from_start": 0, "iou_with_start": 1.0}
    assert run_evaluate._selection_note(no_test) == ", the mask of step 20, 0 entries changed from gamma_base, IoU 1.00"
