"""examples/run_pipeline.py's presets and their flags (no model is loaded: the command lines are refused first)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

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


def test_k_shot_sample_counts_a_label_spelled_several_ways_as_one_class(tmp_path):
    """`pos` and `pos `, `1` and `1.0` are one class each, as the scripts read them: one short class, not two."""
    rows = [("pos", 5), ("pos ", 3), ("neg", 30)]
    texts = [f"text {i}" for i in range(sum(n for _, n in rows))]
    labels = [label for label, n in rows for _ in range(n)]
    pool = tmp_path / "pool.csv"
    pd.DataFrame({"text": texts, "label": labels}).to_csv(pool, index=False)
    path, per_class = run_pipeline.k_shot_sample(str(pool), 20, seed=3, data_dir=tmp_path)
    assert per_class == {"neg": 20, "pos": 8}
    assert len(pd.read_csv(path, keep_default_na=False)) == 28  # all 8 of the short class, 20 of the other


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


def _checkpoint(folder: Path) -> Path:
    """A whole Trainer checkpoint's files (tiny): weights, optimizer, scheduler, RNG state, trainer_state.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(64)}, str(folder / "model.safetensors"))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({"state": 1}, folder / name)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": int(folder.name.split("-")[1])}))
    return folder


def test_a_checkpointed_step_resumes_from_its_last_checkpoint_and_cleans_up(tmp_path):
    step, out = _Step(), tmp_path / "finetuned"
    _checkpoint(out / "checkpoint-200")
    _checkpoint(out / "checkpoint-400")
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "1000"], checkpoints=True)
    argv = step.calls[0]
    assert argv[:2] == ["--max_steps", "1000"] and "--save_steps" in argv
    assert argv[argv.index("--resume_from_checkpoint") + 1] == str(out / "checkpoint-400")
    assert not list(out.glob("checkpoint-*"))  # done: the checkpoints go
    run_pipeline.resumable_step(step, str(out), ["--max_steps", "1000"], checkpoints=True)
    assert len(step.calls) == 1  # the mark holds the step's own arguments, not the resume flags


# ------------------------------------------------------------------------------------------ the small preset
def test_the_quick_preset_is_trec_at_smoke_size_with_one_learned_graft():
    """Issue 37: a first result in minutes (a fine-tune, a learned graft, the comparison table) on TREC, with the main
    run's settings but fewer steps and one graft size, and no extra sweep size to evaluate."""
    run, settings = _settings("--quick")
    assert run == "minilm_trec_quick" and settings["task"] == "trec" and settings["preset"] == "quick"
    main = _settings()[1]
    assert settings["fractions"] == (1e-4,) and settings["sweep_fractions"] == ()
    assert settings["ft_steps"] < main["ft_steps"] and settings["mask_steps"] < main["mask_steps"]
    assert settings["test_size"] < main["test_size"] and settings["dev_size"] < main["dev_size"]
    for key in ("k_shot", "max_seq_length", "ft_batch", "ft_lr", "mask_batch"):  # the main run's set-up, shorter
        assert settings[key] == main[key], key


# ------------------------------------------------------------------------------------------ your own files
WORDS = {"neg": ["bad", "dull", "awful", "flat"], "pos": ["good", "great", "fun", "lovely"]}
FILLER = ["the", "movie", "was", "very", "and", "it", "a", "plot"]


def _own_rows(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    labels = ["neg", "pos"] * (n // 2)
    texts = [f"the {rng.choice(FILLER)} was {rng.choice(WORDS[y])} and {rng.choice(WORDS[y])}" for y in labels]
    return pd.DataFrame({"review": texts, "stars": labels})


@pytest.fixture(scope="module")
def own_task(tmp_path_factory) -> dict[str, str]:
    """A tiny random BERT classifier folder, and a user's files with their own column names (review, stars)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    root = tmp_path_factory.mktemp("own_task")
    vocab = root / "vocab.txt"
    words = sorted({w for pool in WORDS.values() for w in pool} | set(FILLER))
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64)  # fmt: skip
    paths = {"model": str(root / "bert")}
    BertForSequenceClassification(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    for name, n, seed in (("train", 48, 0), ("dev", 16, 1), ("test", 12, 2)):
        paths[name] = str(root / f"{name}.csv")
        _own_rows(n, seed).to_csv(paths[name], index=False)
    return paths


def _own_flags(own_task, work, *extra: str) -> list[str]:
    """The README's own-file command with --quick, at smoke size (a few steps, 1% of a tiny model)."""
    return [
        "--train_file", own_task["train"], "--validation_file", own_task["dev"], "--test_file", own_task["test"],
        "--text_column", "review", "--label_column", "stars", "--model_name_or_path", own_task["model"], "--quick",
        "--ft_steps", "2", "--mask_steps", "10", "--mask_batch", "8", "--fractions", "0.01",
        "--work_dir", str(work / "work"), "--report_dir", str(work / "report"), *extra,
    ]  # fmt: skip


def _run(own_task) -> str:
    """The run name of the own-file command with --quick: the training file's folder, name and path digest."""
    return run_pipeline.own_run_name(own_task["train"]) + "_quick"


@pytest.fixture(scope="module")
def own_run(own_task, tmp_path_factory):
    work = tmp_path_factory.mktemp("own_run")
    return work, run_pipeline.main(_own_flags(own_task, work))


def test_your_own_files_run_end_to_end_with_the_main_runs_report(own_task, own_run):
    """Issue 37: fine-tune, a learned graft selected with the sign test on the validation file, temperature scaling on
    it, the comparison table, the figures, and every model's predictions lined up with the test file."""
    work, results = own_run
    report = work / "report"
    (evaluated,) = results["metrics"]
    k = results["grafts"][0]["num_entries"]
    rows = ["fine-tuned", "pre-trained + FT head", f"learned k={k}", f"top-k movement k={k}", f"random k={k}"]
    assert list(results["metrics"][evaluated]) == [name for row in rows for name in (row, row + " + TS")]
    assert evaluated == "test" and results["eval_sets"]["test"]["examples"] == 12
    assert results["temperature_scaling"]["dataset"] == own_task["dev"]
    summary = (report / "summary.md").read_text()
    assert f"Run `{_run(own_task)}`" in summary and run_pipeline.QUICK_NOTE in summary and "| fine-tuned |" in summary
    assert {"sweep_accuracy.png", "graft_locations.png", "predict_results.csv"} <= {p.name for p in report.iterdir()}
    predictions = pd.read_csv(report / "predict_results.csv")
    test = pd.read_csv(own_task["test"])
    assert predictions["index"].tolist() == list(range(len(test)))  # a row per test row, in file order
    assert predictions["label"].tolist() == test["stars"].tolist()
    assert set(rows) <= set(predictions.columns) and set(predictions["fine-tuned"]) <= {"neg", "pos"}
    graft = json.loads((work / "work" / _run(own_task) / "graft_0.01" / "graft_results.json").read_text())
    assert graft["evaluated_masks"] == 1 and 0 < graft["best_learned_p_value"] <= 1  # the sign test ran on dev
    assert 0 <= graft["iou_with_start"] <= 1 and graft["entries_changed_from_start"] >= 0
    assert results["grafts"][0]["iou_with_start"] == graft["iou_with_start"]  # in the report too


def test_your_own_fine_tune_skips_fine_tuning(own_task, own_run, tmp_path, monkeypatch):
    import run_finetune

    def refuse(argv):
        raise AssertionError("fine-tuning ran")

    monkeypatch.setattr(run_finetune, "main", refuse)
    finetuned = str(own_run[0] / "work" / _run(own_task) / "finetuned")
    results = run_pipeline.main(_own_flags(own_task, tmp_path, "--finetuned_model_name_or_path", finetuned))
    assert not (tmp_path / "work" / _run(own_task) / "finetuned").exists()
    assert "fine-tuning skipped" in (tmp_path / "report" / "summary.md").read_text()
    first = own_run[1]["metrics"]["test"]["fine-tuned"]
    assert results["metrics"]["test"]["fine-tuned"] == first  # the same fine-tune, evaluated alike


def test_without_a_test_file_the_summary_says_the_figures_are_optimistic(own_task, own_run, tmp_path):
    flags = _own_flags(own_task, tmp_path, "--finetuned_model_name_or_path",
                       str(own_run[0] / "work" / _run(own_task) / "finetuned"))  # fmt: skip
    at = flags.index("--test_file")
    del flags[at : at + 2]
    results = run_pipeline.main(flags)
    assert list(results["metrics"]) == ["validation"]
    assert "these figures are optimistic" in (tmp_path / "report" / "summary.md").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train_file", "{train}"], "--train_file needs --validation_file"),
        (["--train_file", "{train}", "--validation_file", "{dev}", "--task", "mr"], "drop --task mr"),
        (["--train_file", "{train}", "--validation_file", "{dev}", "--many_shot"], "drop --many_shot"),
        (["--test_file", "{test}"], "go with --train_file"),
        (["--model_name_or_path", "{model}"], "go with --train_file"),
        (["--train_file", "{train}", "--validation_file", "{dev}", "--label_column", "label"], "no column"),
        (
            ["--train_file", "{train}", "--validation_file", "{dev}", "--finetuned_model_name_or_path", "{model}"],
            "has no graft_example.json",
        ),
        (["--train_file", "{train}", "--validation_file", "{missing}"], "does not exist"),
        (
            ["--train_file", "{train}", "--validation_file", "{dev}", "--test_file", "{unknown_class}"],
            "are not among the training labels",
        ),
        (["--train_file", "{one_class}", "--validation_file", "{dev}"], "classification needs at least two"),
    ],
)
def test_own_file_mistakes_are_refused_before_any_work(own_task, tmp_path, capsys, flags, message):
    paths = {**own_task, "missing": str(tmp_path / "missing.csv")}
    for name, stars in (("unknown_class", "zzz"), ("one_class", None)):
        rows = pd.read_csv(own_task["train"])
        rows["stars"] = stars if stars is not None else rows["stars"].iloc[0]
        paths[name] = str(tmp_path / f"{name}.csv")
        rows.to_csv(paths[name], index=False)
    argv = [flag.format(**paths) for flag in flags]
    if "--label_column" not in argv:
        argv += ["--text_column", "review", "--label_column", "stars"]
    with pytest.raises(SystemExit):
        run_pipeline.main([*argv, "--work_dir", str(tmp_path / "work"), "--report_dir", str(tmp_path / "report")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists() and not (tmp_path / "report").exists()


def test_k_shot_sample_reads_your_label_column_and_keeps_every_column(tmp_path):
    pool = tmp_path / "pool.jsonl"
    pd.DataFrame({"review": [f"t{i}" for i in range(9)], "stars": ["a"] * 6 + ["b"] * 3}).to_json(
        pool, orient="records", lines=True
    )
    path, per_class = run_pipeline.k_shot_sample(str(pool), 4, seed=0, data_dir=tmp_path / "d", label_column="stars")
    assert per_class == {"a": 4, "b": 3}
    sample = pd.read_csv(path)
    assert list(sample.columns) == ["review", "stars"] and sample["stars"].value_counts().to_dict() == {"a": 4, "b": 3}


def test_a_step_on_edited_input_files_runs_again(tmp_path):
    """Your files' content keys a step done: the same command after editing the data (or re-training your
    fine-tune, a folder) runs the step again instead of keeping the earlier results."""
    data, model = tmp_path / "train.csv", tmp_path / "finetuned"
    data.write_text("text,label\na,0\nb,1\n")
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"1")
    step, out = _Step(), tmp_path / "graft"
    out.mkdir()
    for _ in range(2):
        run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data), str(model)))
    assert len(step.calls) == 1
    data.write_text("text,label\na,1\nb,0\n")  # labels fixed by hand
    run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data), str(model)))
    (model / "model.safetensors").write_bytes(b"2")  # fine-tuned again
    run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data), str(model)))
    assert len(step.calls) == 3


def test_checkpoints_of_a_step_on_other_inputs_are_not_resumed(tmp_path):
    """A fine-tune interrupted on the earlier data leaves checkpoints: a run on the edited data starts afresh."""
    data, out = tmp_path / "train.csv", tmp_path / "finetuned"
    data.write_text("text,label\na,0\nb,1\n")

    class Interrupted(_Step):
        def main(self, argv):
            super().main(argv)
            _checkpoint(out / "checkpoint-200")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pipeline.resumable_step(Interrupted(), str(out), ["--x"], checkpoints=True, inputs=(str(data),))
    step = _Step()
    run_pipeline.resumable_step(step, str(out), ["--x"], checkpoints=True, inputs=(str(data),))  # same data: resumed
    assert "--resume_from_checkpoint" in step.calls[0]
    (out / ".pipeline_done").unlink()
    _checkpoint(out / "checkpoint-200")
    data.write_text("text,label\na,1\nb,0\n")
    step = _Step()
    run_pipeline.resumable_step(step, str(out), ["--x"], checkpoints=True, inputs=(str(data),))
    assert "--resume_from_checkpoint" not in step.calls[0] and not (out / "checkpoint-200").exists()


def test_k_shot_sample_keeps_texts_that_look_missing(tmp_path):
    """A sample file holds each sampled text as written: ``NA``, ``null`` and empty texts are not turned into NaN."""
    pool = tmp_path / "pool.csv"
    texts = ["NA", "null", "", "None", "fine", "nan"]
    pd.DataFrame({"text": texts, "label": [0, 0, 0, 0, 1, 1]}).to_csv(pool, index=False)
    path, _ = run_pipeline.k_shot_sample(str(pool), 3, seed=0, data_dir=tmp_path / "d")
    sample = pd.read_csv(path, dtype=str, keep_default_na=False)
    assert set(sample.loc[sample["label"] == "1", "text"]) == {"fine", "nan"}  # the short class, whole
    negatives = sample.loc[sample["label"] == "0", "text"]
    assert len(negatives) == 3 and negatives.is_unique and set(negatives) <= {"NA", "null", "", "None"}


def test_a_model_that_is_neither_a_folder_nor_a_reachable_hub_id_is_refused_before_any_work(own_task, tmp_path):
    flags = _own_flags(own_task, tmp_path)
    flags[flags.index("--model_name_or_path") + 1] = "no-such-user/no-such-model"
    with pytest.raises(ValueError, match="'no-such-user/no-such-model' is not a folder, and the Hub model"):
        run_pipeline.main(flags)  # offline here (HF_HUB_OFFLINE=1)
    assert not (tmp_path / "work").exists()


def test_a_model_folder_without_safetensors_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors file"):
        run_pipeline._num_parameters(str(tmp_path))


# ------------------------------------------------------------------------------------------ runs that survive kills
def test_a_rerun_resumes_only_from_a_whole_checkpoint(tmp_path, caplog):
    """Issue 60: a kill while the Trainer writes a checkpoint leaves a folder with part of its files (or a cut one);
    the rerun resumes from the newest whole checkpoint, and removes the cut ones of its own folder, each logged."""
    step, out = _Step(), tmp_path / "finetuned"
    _checkpoint(out / "checkpoint-200")
    with open(_checkpoint(out / "checkpoint-400") / "model.safetensors", "r+b") as handle:
        handle.truncate(100)  # weights cut
    (_checkpoint(out / "checkpoint-600") / "trainer_state.json").write_text('{"global_st')  # the last file cut
    (_checkpoint(out / "checkpoint-800") / "optimizer.pt").unlink()  # killed between two files
    run_pipeline.resumable_step(step, str(out), ["--x"], checkpoints=True)
    argv = step.calls[0]
    assert argv[argv.index("--resume_from_checkpoint") + 1] == str(out / "checkpoint-200")
    for n, problem in ((400, "model.safetensors is cut"), (600, "trainer_state.json is cut"), (800, "no optimizer.pt")):
        assert f"Removing {out / f'checkpoint-{n}'}: not a whole checkpoint ({problem}" in caplog.text


def test_a_rerun_without_a_whole_checkpoint_starts_over(tmp_path):
    step, out = _Step(), tmp_path / "finetuned"
    (_checkpoint(out / "checkpoint-200") / "rng_state.pth").write_bytes(b"PK\x03\x04 cut")
    run_pipeline.resumable_step(step, str(out), ["--x"], checkpoints=True)
    assert "--resume_from_checkpoint" not in step.calls[0] and not (out / "checkpoint-200").exists()


def test_a_stale_mark_is_removed_before_the_step_runs(tmp_path):
    """Issue 60: a step run again for edited data and killed after writing its result, before its mark, must not
    leave the old mark beside the new result: once the data are reverted, the step runs again."""
    data, out = tmp_path / "train.csv", tmp_path / "graft"
    out.mkdir()

    class Step(_Step):  # writes its result (the data it read); killed before returning when asked to
        kill = False

        def main(self, argv):
            super().main(argv)
            (out / "result.txt").write_text(data.read_text())
            if self.kill:
                raise KeyboardInterrupt

    step = Step()
    data.write_text("text,label\na,0\n")
    run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data),))
    data.write_text("text,label\na,1\n")  # edited, run again, killed after the result
    step.kill = True
    with pytest.raises(KeyboardInterrupt):
        run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data),))
    assert not (out / run_pipeline.MARK).exists()
    data.write_text("text,label\na,0\n")  # reverted: the result on disk is not of these data
    step.kill = False
    run_pipeline.resumable_step(step, str(out), ["--x"], inputs=(str(data),))
    assert len(step.calls) == 3 and (out / "result.txt").read_text() == data.read_text()
    assert json.loads((out / run_pipeline.MARK).read_text())["inputs"] == {
        str(data): run_pipeline.content_digest(str(data))
    }
    assert not list(out.glob(".*.partial"))  # the mark written atomically


def test_a_model_folder_digest_ignores_marks_and_subfolders_but_not_weights(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"1")
    before = run_pipeline.content_digest(str(model))
    (model / run_pipeline.MARK).write_text("{}")
    (model / "checkpoint-2").mkdir()
    (model / "checkpoint-2" / "optimizer.pt").write_bytes(b"x")
    assert run_pipeline.content_digest(str(model)) == before
    (model / "model.safetensors").write_bytes(b"2")  # re-saved with other weights under the same path
    assert run_pipeline.content_digest(str(model)) != before


def _spy(monkeypatch, *scripts) -> list[str]:
    """The names of ``scripts`` whose ``main`` is called, in call order (each still runs)."""
    calls = []
    for script in scripts:
        main = script.main

        def spied(argv, main=main, name=script.__name__):
            calls.append(name)
            return main(argv)

        monkeypatch.setattr(script, "main", spied)
    return calls


def test_a_new_test_file_runs_only_the_evaluation(own_task, own_run, tmp_path, monkeypatch):
    """Issue 60: each step is keyed by its own inputs: another test file is predicted without fine-tuning or grafting
    again (their marks do not hold the test file)."""
    import run_evaluate
    import run_finetune
    import run_graft

    calls = _spy(monkeypatch, run_finetune, run_graft, run_evaluate)
    other = tmp_path / "other_test.csv"
    _own_rows(6, 9).to_csv(other, index=False)
    flags = _own_flags(own_task, own_run[0])
    flags[flags.index("--test_file") + 1] = str(other)
    flags[flags.index("--report_dir") + 1] = str(tmp_path / "report")
    results = run_pipeline.main(flags)
    assert calls == ["run_evaluate"] and results["eval_sets"]["test"]["examples"] == 6
    mark = json.loads((own_run[0] / "work" / _run(own_task) / "finetuned" / run_pipeline.MARK).read_text())
    assert set(mark["inputs"]) == {own_task["train"], own_task["model"]}  # the training file and the model


def test_a_model_re_saved_under_the_same_path_is_not_a_step_done(own_task, own_run, tmp_path, monkeypatch):
    """Issue 60: the model folders' content keys the steps: a pre-trained model re-saved with other weights under the
    same path is grafted again, not skipped as done."""
    import run_graft
    from transformers import BertForSequenceClassification

    model = tmp_path / "bert"
    shutil.copytree(own_task["model"], model)
    finetuned = str(own_run[0] / "work" / _run(own_task) / "finetuned")
    flags = _own_flags(own_task, tmp_path, "--finetuned_model_name_or_path", finetuned)
    flags[flags.index("--model_name_or_path") + 1] = str(model)
    first = run_pipeline.main(flags)
    calls = _spy(monkeypatch, run_graft)
    assert run_pipeline.main(flags)["metrics"] == first["metrics"] and calls == []  # done: skipped
    torch.manual_seed(1)
    config = BertForSequenceClassification.from_pretrained(model).config
    BertForSequenceClassification(config).save_pretrained(model)  # other weights, same path
    again = run_pipeline.main(flags)
    assert calls == ["run_graft"]
    assert again["metrics"]["test"]["pre-trained + FT head"] != first["metrics"]["test"]["pre-trained + FT head"]


def test_a_fine_tune_of_another_base_model_is_refused_before_any_step(own_task, own_run, tmp_path):
    """Issue 60: a --finetuned_model_name_or_path of another architecture would run to the end with meaningless
    grafts: refused at once, naming both flags."""
    from transformers import BertConfig, BertForSequenceClassification

    other = tmp_path / "other_ft"
    config = BertConfig.from_pretrained(own_task["model"])
    config.intermediate_size = 41
    BertForSequenceClassification(config).save_pretrained(other)
    shutil.copy(Path(own_run[0] / "work" / _run(own_task) / "finetuned" / "graft_example.json"), other)
    flags = _own_flags(own_task, tmp_path, "--finetuned_model_name_or_path", str(other))
    with pytest.raises(ValueError, match=r"is not a fine-tune of --model_name_or_path .*intermediate_size 41 against"):
        run_pipeline.main(flags)
    assert not (tmp_path / "work" / _run(own_task) / "graft_0.01").exists()
    config.intermediate_size = 37
    config.num_hidden_layers = 1  # fewer layers (a config key the check reads), and tensors missing
    BertForSequenceClassification(config).save_pretrained(other)
    with pytest.raises(ValueError, match="num_hidden_layers 1 against 2"):
        run_pipeline.main(flags)


def test_check_same_architecture_compares_tensor_names_and_shapes(tmp_path):
    """Beyond the config: a tensor of another shape under the same name, or a model with few of the base's names."""
    from safetensors.torch import save_file

    base, ft = tmp_path / "base", tmp_path / "ft"
    base.mkdir(), ft.mkdir()
    save_file({"layer.weight": torch.zeros(4, 4), "layer.bias": torch.zeros(4)}, str(base / "model.safetensors"))
    save_file({"body.layer.weight": torch.zeros(4, 4), "body.layer.bias": torch.zeros(4),
               "classifier.weight": torch.zeros(2, 4)}, str(ft / "model.safetensors"))  # fmt: skip
    run_pipeline.check_same_architecture(str(base), str(ft))  # a body under a prefix and a new head: fine
    save_file({"body.layer.weight": torch.zeros(4, 5)}, str(ft / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) of other shapes, e.g. layer.weight \[4, 5\] against \[4, 4\]"):
        run_pipeline.check_same_architecture(str(base), str(ft))
    save_file({f"other.{i}": torch.zeros(1) for i in range(5)}, str(ft / "model.safetensors"))
    with pytest.raises(ValueError, match="only 0 of its 5 tensors are named as the base model's"):
        run_pipeline.check_same_architecture(str(base), str(ft))


def test_a_test_file_without_labels_is_predicted_row_by_row(own_task, own_run, tmp_path):
    """Issue 60: labels are optional in the test file: a file without a label column gets every row predicted
    (predict_results.csv), the validation file is evaluated, and the summary says so."""
    unlabelled = tmp_path / "unlabelled.csv"
    _own_rows(6, 7)[["review"]].to_csv(unlabelled, index=False)
    finetuned = str(own_run[0] / "work" / _run(own_task) / "finetuned")
    flags = _own_flags(own_task, tmp_path, "--finetuned_model_name_or_path", finetuned)
    flags[flags.index("--test_file") + 1] = str(unlabelled)
    results = run_pipeline.main(flags)
    assert list(results["metrics"]) == ["validation"]
    predictions = pd.read_csv(tmp_path / "report" / "predict_results.csv", keep_default_na=False, dtype=str)
    assert predictions["index"].tolist() == [str(i) for i in range(6)] and set(predictions["label"]) == {""}
    assert set(predictions["fine-tuned"]) <= {"neg", "pos"}
    assert (
        "The test file has no labels: every row of it is predicted" in (tmp_path / "report" / "summary.md").read_text()
    )


def test_two_tasks_whose_training_files_share_a_name_get_their_own_folders(own_task, own_run, tmp_path, capsys):
    """Issue 60: runs for different data never share folders by accident: the default names hold the training file's
    folder and a digest of its path, and a folder written for other data is refused, naming the flag."""
    other = tmp_path / "task_b" / "train.csv"
    other.parent.mkdir()
    shutil.copy(own_task["train"], other)
    names = {run_pipeline.own_run_name(path) for path in (own_task["train"], str(other))}
    assert len(names) == 2 and all(name.startswith("own_") and "_train_" in name for name in names)
    assert run_pipeline.own_run_name(str(other)).startswith("own_task_b_train_")
    flags = _own_flags(own_task, tmp_path)
    flags[flags.index("--train_file") + 1] = str(other)
    flags[flags.index("--report_dir") + 1] = str(own_run[0] / "report")  # the first task's report folder
    with pytest.raises(SystemExit):
        run_pipeline.main(flags)
    error = capsys.readouterr().err
    assert f"--report_dir: {own_run[0] / 'report'} holds a run on {Path(own_task['train']).resolve()}" in error
    assert "Give another --report_dir" in error and not (tmp_path / "work").exists()
    assert (own_run[0] / "report" / "summary.md").is_file()


def test_max_seq_length_is_a_flag_passed_to_every_step_and_reported(own_task, own_run, tmp_path, capsys):
    """Issue 60: --max_seq_length (default the preset's 64), the same in every step, recorded with the fine-tune,
    the graft and the report, with how many texts it cut and how many tokens they lost."""
    from transformers import AutoTokenizer

    with pytest.raises(SystemExit):
        run_pipeline.main(["--help"])
    assert "--max_seq_length" in capsys.readouterr().out
    results, run = own_run[1], own_run[0] / "work" / _run(own_task)
    assert results["max_seq_length"] == 64 and results["truncation"]["max_seq_length"] == 64
    assert results["truncation"]["default"] == 64
    for folder in ("finetuned", "graft_0.01"):
        assert json.loads((run / folder / "graft_example.json").read_text())["max_seq_length"] == 64

    flags = _own_flags(own_task, tmp_path, "--max_seq_length", "6")
    short = run_pipeline.main(flags)
    run = tmp_path / "work" / _run(own_task)
    for folder in ("finetuned", "graft_0.01"):
        assert json.loads((run / folder / "graft_example.json").read_text())["max_seq_length"] == 6
    assert short["max_seq_length"] == 6
    tokenizer = AutoTokenizer.from_pretrained(own_task["model"])
    for name, path in (("train", own_task["train"]), ("dev", own_task["dev"]), ("test", own_task["test"])):
        lengths = [len(ids) for ids in tokenizer(pd.read_csv(path)["review"].tolist())["input_ids"]]
        expected = {
            "texts": sum(n > 6 for n in lengths),
            "of": len(lengths),
            "tokens_lost": sum(max(0, n - 6) for n in lengths),
        }
        assert short["truncation"]["truncated"][name] == expected and expected["texts"] > 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    train = short["truncation"]["truncated"]["train"]
    assert (
        f"cut to max_seq_length 6 tokens (--max_seq_length; the default is 64): train {train['texts']} of 48" in summary
    )
    assert (
        "cut to max_seq_length 64 tokens (the default): train 0 of 48 texts"
        in (own_run[0] / "report" / "summary.md").read_text()
    )
    with pytest.raises(ValueError, match="--max_seq_length 65 is more than the 64 positions"):
        run_pipeline.main(_own_flags(own_task, tmp_path / "long", "--max_seq_length", "65"))


def test_an_interrupted_gguf_conversion_is_not_taken_for_done(tmp_path, monkeypatch):
    """The --causal runs' dequantized model folder is renamed into place once whole: a conversion interrupted while
    saving (here: in the tokenizer's save, after the weights) leaves no model folder, and the rerun converts again."""
    import example_utils as U
    from transformers import GPT2Config, GPT2LMHeadModel

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    config = GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8)
    monkeypatch.setattr(U.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: GPT2LMHeadModel(config))

    class Tokenizer:
        fail = True

        def save_pretrained(self, folder):
            if Tokenizer.fail:
                raise KeyboardInterrupt  # killed here
            Path(folder, "tokenizer.json").write_text("{}")

    monkeypatch.setattr(U.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    out = tmp_path / "smollm"
    with pytest.raises(KeyboardInterrupt):
        U.gguf_to_safetensors(gguf, out)
    assert not out.exists()
    Tokenizer.fail = False
    assert U.gguf_to_safetensors(gguf, out) == str(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".*.partial"))
