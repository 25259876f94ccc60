"""examples/run_pipeline.py's presets and their flags (no model is loaded: the command lines are refused first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_pipeline  # noqa: E402


@pytest.mark.parametrize(
    "flags",
    [
        ["--causal", "--paper_size"],
        ["--causal", "--causal_smoke"],
        ["--causal_smoke", "--paper_size"],
        ["--many_shot", "--paper_size"],
        ["--many_shot", "--causal"],
        ["--few_shot", "--many_shot"],
        ["--few_shot", "--causal"],
    ],
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


@pytest.mark.parametrize("flag", ["--k_shot", "--ft_steps", "--mask_steps", "--mask_batch"])
def test_a_count_below_one_is_refused_before_any_work(flag, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_pipeline.main([flag, "0", "--work_dir", str(tmp_path)])
    assert "must be a positive integer, got 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_many_shot_preset_is_the_papers_shot_count_with_stated_budgets():
    many = run_pipeline.MANY_SHOT
    assert many["k_shot"] == 4096 and many["mask_steps"] == 100  # the paper's 4096-shot setting, 100 mask steps
    assert many["fractions"] == (1e-5, 1e-4, 1e-3, 1e-2)  # Figure 2: 0.001% ... 1%
    assert many["ft_steps"] < 16 * 2 * 512  # the stated budget, below the paper's 16 x n x min(k, 512)


def _settings(*flags: str) -> tuple[str, dict]:
    """What ``run_pipeline.main(flags)`` would run, from its own parser (stopped before any work)."""
    seen, original = {}, run_pipeline.run_settings

    def stop(args):
        seen["run"] = original(args)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_pipeline, "run_settings", stop)
        with pytest.raises(SystemExit):
            run_pipeline.main(list(flags))
    return seen["run"]


def test_the_main_run_is_the_many_shot_set_up_on_trec_at_two_sizes():
    """Issue 25, item 6: the main command fine-tunes on all of TREC (where fine-tuning beats the 0-entry model by far)
    with the many-shot settings, at the sizes where the learned region and top-k movement differ most."""
    run, settings = _settings()
    assert run == "minilm_trec" and settings["task"] == "trec" and settings["preset"] == "main"
    many = run_pipeline.MANY_SHOT
    assert {k: v for k, v in settings.items() if k in many and k != "fractions"} == {
        k: v for k, v in many.items() if k != "fractions"
    }
    assert settings["fractions"] == (1e-4, 1e-3) and set(settings["fractions"]) < set(many["fractions"])
    assert settings["all_data"]  # every question of a class with fewer than 4096, fine-tuning resumable
    assert _settings("--task", "mr")[0] == "minilm_mr"


@pytest.mark.parametrize(
    ("flags", "run", "k_shot"),
    [
        (["--few_shot"], "minilm_mr_few_shot", 64),  # the earlier main run, as its figures were measured
        (["--few_shot", "--task", "trec"], "minilm_trec_few_shot", 32),  # TREC's smallest class has 40
        (["--many_shot"], "minilm_mr_many_shot", 4096),
        (["--many_shot", "--task", "sms", "--seed", "1"], "minilm_sms_many_shot_seed1", 4096),
        (["--causal"], "smollm2_mr_causal", 16),
        (["--causal", "--k_shot", "512"], "smollm2_mr_causal_k512", 512),
        (["--paper_size"], "minilm_mr_paper_size", 512),
    ],
)
def test_every_other_set_up_is_one_flag_away(flags, run, k_shot):
    name, settings = _settings(*flags)
    assert name == run and settings["k_shot"] == k_shot
    assert settings["all_data"] == (flags[0] == "--many_shot")


def _pool(tmp_path, counts: dict[int, int]) -> str:
    rows = [(f"text {label} {i}", label) for label, count in counts.items() for i in range(count)]
    path = tmp_path / "pool.csv"
    pd.DataFrame(rows, columns=["text", "label"]).to_csv(path, index=False)
    return str(path)


def test_k_shot_sample_takes_all_of_a_short_class(tmp_path):
    pool = _pool(tmp_path, {0: 50, 1: 7, 2: 30})
    path, per_class = run_pipeline.k_shot_sample(pool, 20, seed=3, data_dir=tmp_path)
    assert per_class == {"0": 20, "1": 7, "2": 20}
    sample = pd.read_csv(path)
    assert sample["label"].value_counts().sort_index().to_dict() == {0: 20, 1: 7, 2: 20}
    assert sample["text"].is_unique and set(sample["text"]) <= set(pd.read_csv(pool)["text"])
    again, _ = run_pipeline.k_shot_sample(pool, 20, seed=3, data_dir=tmp_path)
    assert pd.read_csv(again).equals(sample)  # seeded


def test_k_shot_sample_leaves_full_classes_to_the_scripts(tmp_path):
    """No short class: no file, the scripts draw the sample with --k_shot as the presets' figures were measured."""
    path, per_class = run_pipeline.k_shot_sample(_pool(tmp_path, {0: 50, 1: 40}), 20, seed=3, data_dir=tmp_path)
    assert path is None and per_class == {"0": 20, "1": 20}


class _Step:
    __name__ = "run_step_stub"

    def __init__(self):
        self.calls = []

    def main(self, argv):
        self.calls.append(argv)


def test_a_step_done_with_the_same_arguments_is_skipped(tmp_path):
    step, out = _Step(), tmp_path / "graft"
    out.mkdir()
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "10"])
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "10"])  # resumed: done already
    assert step.calls == [["--max_steps", "10"]]
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "20"])  # other arguments: run again
    assert step.calls == [["--max_steps", "10"], ["--max_steps", "20"]]


def test_a_step_that_raises_leaves_no_mark(tmp_path):
    class Failing(_Step):
        def main(self, argv):
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_pipeline.resumable_step(Failing(), str(tmp_path), ["--x"])
    assert not (tmp_path / ".pipeline_done").exists()


def test_k_shot_0_trains_on_the_whole_file(tmp_path):
    """How the pipeline hands the scripts a sample file with a short class: ``--k_shot 0`` takes every row."""
    import example_utils as U

    pool = _pool(tmp_path, {0: 9, 1: 4})
    train, _, labels = U.load_splits(U.DataArguments(dataset_name_or_path=pool, k_shot=0))
    assert len(train) == 13 and len(labels) == 2
    with pytest.raises(ValueError, match="exceeds the number of examples"):
        U.load_splits(U.DataArguments(dataset_name_or_path=pool, k_shot=5))


def test_a_checkpointed_step_resumes_from_its_last_checkpoint_and_cleans_up(tmp_path):
    step, out = _Step(), tmp_path / "finetuned"
    (out / "checkpoint-200").mkdir(parents=True)
    (out / "checkpoint-400").mkdir()
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "1000"], checkpoints=True)
    argv = step.calls[0]
    assert argv[:2] == ["--max_steps", "1000"] and "--save_steps" in argv
    assert argv[argv.index("--resume_from_checkpoint") + 1] == str(out / "checkpoint-400")
    assert not list(out.glob("checkpoint-*"))  # done: the checkpoints go
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "1000"], checkpoints=True)
    assert len(step.calls) == 1  # the mark holds the step's own arguments, not the resume flags
