"""examples/run_pipeline.py's presets and their flags (no model is loaded: the command lines are refused first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_pipeline  # noqa: E402


@pytest.mark.parametrize(
    "flags", [["--causal", "--paper_size"], ["--causal", "--causal_smoke"], ["--causal_smoke", "--paper_size"]]
)
def test_presets_are_mutually_exclusive(flags, capsys):
    with pytest.raises(SystemExit):
        run_pipeline.main(flags)
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--causal", "--causal_smoke"])
def test_causal_presets_are_mr_only(flag, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_pipeline.main([flag, "--task", "trec", "--work_dir", str(tmp_path)])
    assert f"{flag} scores the label words of MR sentiment" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def test_causal_preset_sizes():
    """The real-size causal run: every setting of the smoke run, a sized OOD set, masks selected (every 10 steps) more
    than once."""
    causal, smoke = run_pipeline.CAUSAL, run_pipeline.SMOKE
    assert causal.keys() == smoke.keys() and "ood_size" in causal
    assert causal["mask_steps"] >= 20
    assert causal["sweep_samples"] <= causal["test_size"]
    for key in ("k_shot", "ft_steps", "mask_steps", "test_size", "dev_size", "ood_size"):
        assert causal[key] > smoke[key]


@pytest.mark.parametrize("value", ["0", "1.5", "often"])
def test_a_bad_selection_level_is_refused_before_any_work(value, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_pipeline.main(["--selection_alpha", value, "--work_dir", str(tmp_path)])
    assert "not a level in (0, 1) or 'none'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_selection_level_none_is_the_papers_best_dev_selection():
    assert run_pipeline._level_or_none("none") is None and run_pipeline._level_or_none("0.05") == 0.05
