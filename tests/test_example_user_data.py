"""What a new user meets in the examples (issue 27): their own CSV/JSON lines files with run_glue's flags
(--train_file, --validation_file, --test_file, --do_predict), the presets, checkpoints removed after a successful run,
compact redirected logs and shell-friendly file names. Tiny random BERTs, offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import example_utils as U  # noqa: E402
import run_evaluate  # noqa: E402
import run_finetune  # noqa: E402
import run_graft  # noqa: E402

POSITIVE = ["good", "great", "fun", "moving", "brilliant", "lovely"]
NEGATIVE = ["bad", "dull", "boring", "awful", "flat", "tedious"]
FILLER = ["the", "movie", "film", "was", "very", "plot", "and", "it", "a", "story", "is"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
FAST = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--use_cpu", "true", "--report_to", "none"]
GRAFT_FAST = [*FAST, "--learning_rate", "1e4", "--sparsity", "0.01"]
SHELL_FRIENDLY = re.compile(r"[A-Za-z0-9_.-]+")


def _rows(n: int, seed: int, text: str = "sentence", labels: tuple[str, str] = ("neg", "pos")) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(seed)

    def pick(pool: list[str]) -> str:
        return pool[int(torch.randint(len(pool), (1,), generator=generator))]

    rows = []
    for i in range(n):
        words = POSITIVE if i % 2 else NEGATIVE
        rows.append({text: f"the {pick(FILLER)} was {pick(words)} and {pick(words)}", "label": labels[i % 2]})
    return pd.DataFrame(rows)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny BERT classifier and a user's files: train/dev/test CSVs (column 'sentence', string labels), a JSON lines
    training file (column 'text'), a test CSV without labels and a CSV without a label column."""
    root = tmp_path_factory.mktemp("user_assets")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + sorted(set(POSITIVE + NEGATIVE + FILLER))) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    torch.manual_seed(0)
    paths = {"model": str(root / "model")}
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **SMALL)
    BertForSequenceClassification(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    for name, n, seed in (("train", 40, 0), ("dev", 12, 1), ("test", 10, 2)):
        paths[name] = str(root / f"{name}.csv")
        _rows(n, seed).to_csv(paths[name], index=False)
    paths["train_jsonl"] = str(root / "train.jsonl")
    _rows(20, 3, text="text").to_json(paths["train_jsonl"], orient="records", lines=True)
    paths["unlabeled"] = str(root / "unlabeled.csv")
    _rows(7, 4)[["sentence"]].to_csv(paths["unlabeled"], index=False)
    paths["bad_jsonl"] = str(root / "bad.jsonl")
    Path(paths["bad_jsonl"]).write_text('{"text": "a", "label": 1}\nnot json\n')
    paths["no_label"] = str(root / "no_label.csv")
    _rows(20, 5).rename(columns={"label": "sentiment"}).to_csv(paths["no_label"], index=False)
    return paths


def finetune(assets, out: Path, *extra: str) -> dict:
    return run_finetune.main(["--model_name_or_path", assets["model"], "--output_dir", str(out), *FAST, *extra])


@pytest.fixture(scope="module")
def finetuned(assets, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ft")
    finetune(assets, out, "--train_file", assets["train"], "--learning_rate", "1e-2")
    return str(out)


def graft(assets, finetuned: str, out: Path, *extra: str) -> dict:
    return run_graft.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
        "--output_dir", str(out), *GRAFT_FAST, *extra,
    ])  # fmt: skip


def _written(*folders: Path) -> tuple[list[Path], list[Path]]:
    """Every file and every empty folder under ``folders``."""
    files, empty = [], []
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                files.append(path)
            elif path.is_dir() and not any(path.iterdir()):
                empty.append(path)
    return files, empty


# ---------------------------------------------------------------------------------------------------- your own data
def test_train_file_is_used_whole_with_transformers_defaults(assets, finetuned, caplog):
    """--train_file: preset 'none' (all 40 rows, AdamW, nothing frozen), string labels as class names, the 'sentence'
    column found without --text_column."""
    setup = U.TaskSetup.load(finetuned)
    assert setup.label_names == ["neg", "pos"]
    args = U.parse_with_preset(
        run_finetune.HfArgumentParser(
            (U.ModelArguments, U.TaskArguments, U.DataArguments, run_finetune.FinetuneTrainingArguments)
        ),
        ["--model_name_or_path", assets["model"], "--train_file", assets["train"]],
        run_finetune.PRESETS,
    )
    data_args, training_args = args[2], args[3]
    assert data_args.preset == "none" and data_args.k_shot == 0
    assert training_args.optim.value.startswith("adamw") and training_args.learning_rate == 5e-5
    assert not training_args.freeze_embeddings and not training_args.paper_steps
    train, _, _ = U.load_splits(data_args)
    assert len(train) == 40
    moved = load_file(Path(finetuned, "model.safetensors"))
    pre = load_file(Path(assets["model"], "model.safetensors"))
    name = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(moved[name], pre[name])  # nothing frozen under the 'none' preset


def test_paper_preset_and_k_shot_on_a_train_file(assets, tmp_path):
    parser = run_finetune.HfArgumentParser(
        (U.ModelArguments, U.TaskArguments, U.DataArguments, run_finetune.FinetuneTrainingArguments)
    )
    base = ["--model_name_or_path", assets["model"], "--train_file", assets["train"]]
    _, _, data_args, training_args = U.parse_with_preset(parser, [*base, "--preset", "paper"], run_finetune.PRESETS)
    assert data_args.k_shot == 16 and training_args.optim.value == "sgd" and training_args.freeze_embeddings
    assert len(U.load_splits(data_args)[0]) == 32
    parser = run_finetune.HfArgumentParser(
        (U.ModelArguments, U.TaskArguments, U.DataArguments, run_finetune.FinetuneTrainingArguments)
    )
    _, _, data_args, training_args = U.parse_with_preset(
        parser, [*base, "--k_shot", "4", "--learning_rate", "0.1"], run_finetune.PRESETS
    )
    assert data_args.preset == "none" and len(U.load_splits(data_args)[0]) == 8 and training_args.learning_rate == 0.1
    # The existing path keeps the paper's defaults.
    paper = U.DataArguments(dataset_name_or_path=assets["train"])
    assert paper.preset == "paper" and paper.k_shot == 16


def test_json_lines_train_file_and_validation_file(assets, tmp_path):
    metrics = finetune(assets, tmp_path, "--train_file", assets["train_jsonl"], "--validation_file", assets["dev"])
    assert {"eval_accuracy", "eval_ece"} <= set(metrics)
    assert json.loads((tmp_path / "eval_results.json").read_text())["eval_accuracy"] == metrics["eval_accuracy"]


@pytest.mark.parametrize("labelled", [True, False])
def test_finetune_do_predict_writes_run_glue_predictions(assets, tmp_path, labelled):
    test = assets["test" if labelled else "unlabeled"]
    metrics = finetune(assets, tmp_path, "--train_file", assets["train"], "--test_file", test, "--do_predict")
    lines = (tmp_path / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 1 + len(pd.read_csv(test))
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(len(lines) - 1)]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"neg", "pos"}
    assert (tmp_path / "predict_results.json").is_file() == labelled
    assert ("predict_accuracy" in metrics) == labelled


def test_graft_with_user_files_predicts_with_the_graft(assets, finetuned, tmp_path):
    metrics = graft(
        assets, finetuned, tmp_path, "--train_file", assets["train"], "--validation_file", assets["dev"],
        "--test_file", assets["test"], "--do_predict",
    )  # fmt: skip
    assert metrics["grafted_entries"] > 0 and "predict_accuracy" in metrics and "eval_accuracy" in metrics
    lines = (tmp_path / "predict_results.txt").read_text().splitlines()
    assert len(lines) == 11 and lines[0] == "index\tprediction"


def test_evaluate_with_user_files_and_predictions(assets, finetuned, tmp_path):
    graft_dir = tmp_path / "graft"
    graft(assets, finetuned, graft_dir, "--train_file", assets["train"])
    report = tmp_path / "report"
    results = run_evaluate.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
        "--graft_dirs", str(graft_dir), "--validation_file", assets["dev"], "--test_file", assets["test"],
        "--do_predict", "--sweep", "false", "--report_dir", str(report),
    ])  # fmt: skip
    assert list(results["metrics"]) == ["validation", "test"]
    predictions = pd.read_csv(report / "predict_results.csv")
    test = pd.read_csv(assets["test"])
    assert predictions["index"].tolist() == list(range(len(test)))
    assert predictions["label"].tolist() == test["label"].tolist()  # file order, class names
    assert {"fine-tuned", results["grafts"][0]["name"]} <= set(predictions.columns)
    accuracy = (predictions["fine-tuned"] == predictions["label"]).mean()
    assert accuracy == pytest.approx(results["metrics"]["test"]["fine-tuned"]["accuracy"])


@pytest.mark.parametrize("script", [run_finetune, run_graft, run_evaluate], ids=lambda m: m.__name__)
def test_help_prints_and_names_the_region_size_flags(script, capsys):
    """--help formats every flag's help (argparse fails on a bare '%' in one) and exits 0."""
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    if script is run_graft:
        text = " ".join(capsys.readouterr().out.split())
        assert "--fraction_of_parameters" in text and "--sparsity" in text


def test_help_names_the_columns_read(capsys):
    with pytest.raises(SystemExit):
        run_finetune.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--train_file" in text and "--test_file" in text and "--preset" in text and "--keep_checkpoints" in text
    assert "'text' or 'sentence'" in text and "('label', or --label_column)" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train_file", "{no_label}"], r"no column\(s\) \['label'\].*--label_column"),
        (["--train_file", "{train}", "--dataset_name_or_path", "{train}"], "Give the training data once"),
        ([], "Give the training data once"),
        (["--train_file", "{train}", "--do_predict"], "--do_predict needs --test_file"),
        (["--train_file", "{train}", "--test_file", "{test}"], "add --do_predict"),
        (["--train_file", "missing.csv"], "--train_file 'missing.csv' does not exist"),
        (["--train_file", "{model}/config.json", "--label_column", "x"], "no column"),
        (["--train_file", "{bad_jsonl}"], "is neither JSON lines"),
        (["--train_file", "{model}/model.safetensors"], "--train_file .*unsupported suffix"),
        (["--train_file", "{train}", "--validation_file", "{dev}", "--validation_dataset", "{dev}"], "give one"),
    ],
)
def test_bad_user_files_name_the_argument(assets, tmp_path, extra, message):
    extra = [value.format(**assets) for value in extra]
    with pytest.raises(ValueError, match=message):
        finetune(assets, tmp_path, *extra)


def test_evaluate_refuses_names_that_collide_as_file_names(assets, finetuned, tmp_path):
    with pytest.raises(ValueError, match="give the same file names"):
        run_evaluate.main([
            "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
            "--graft_dirs", str(tmp_path), "--eval_datasets", assets["dev"], assets["test"],
            "--eval_names", "MR (dev)", "MR dev", "--report_dir", str(tmp_path / "report"),
        ])  # fmt: skip
    with pytest.raises(ValueError, match="--do_predict needs --test_file"):
        run_evaluate.main([
            "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
            "--graft_dirs", str(tmp_path), "--validation_file", assets["dev"], "--do_predict",
        ])  # fmt: skip


# ---------------------------------------------------------------------------------------------------- clean-up
def test_graft_removes_its_checkpoints_unless_kept(assets, finetuned, tmp_path):
    steps = ["--max_steps", "4", "--save_steps", "1", "--train_file", assets["train"]]
    graft(assets, finetuned, tmp_path / "default", *steps)
    assert not list((tmp_path / "default").glob("checkpoint-*"))
    assert not list((tmp_path / "default").glob(".checkpoint-*.lock"))  # nor their save locks
    assert (tmp_path / "default" / "adapter_model.safetensors").is_file()
    graft(assets, finetuned, tmp_path / "kept", *steps, "--keep_checkpoints")
    kept = sorted(p.name for p in (tmp_path / "kept").glob("checkpoint-*"))
    assert kept == ["checkpoint-4"]  # save_total_limit 1 while training: the last one


def test_graft_resumed_in_its_own_folder_cleans_up_to_the_same_graft(assets, finetuned, tmp_path):
    """A run killed after its checkpoint (here: kept) resumes into the same folder, ends with the uninterrupted
    run's graft, and leaves no checkpoint."""
    steps = ["--max_steps", "4", "--save_steps", "2", "--save_total_limit", "2", "--train_file", assets["train"]]
    whole = tmp_path / "whole"
    graft(assets, finetuned, whole, *steps, "--keep_checkpoints")
    checkpoint = whole / "checkpoint-2"
    expected = load_file(whole / "adapter_model.safetensors")
    (whole / "adapter_model.safetensors").unlink()
    graft(assets, finetuned, whole, *steps, "--resume_from_checkpoint", str(checkpoint))
    assert not list(whole.glob("checkpoint-*"))
    resumed = load_file(whole / "adapter_model.safetensors")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_files_an_example_run_writes_are_shell_friendly_and_no_folder_is_empty(assets, finetuned, tmp_path):
    graft_dir, report = tmp_path / "graft", tmp_path / "report"
    graft(assets, finetuned, graft_dir, "--train_file", assets["train"], "--validation_file", assets["dev"],
          "--select_every", "1", "--save_steps", "1", "--test_file", assets["test"], "--do_predict")  # fmt: skip
    run_evaluate.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
        "--graft_dirs", str(graft_dir), "--eval_datasets", assets["dev"], assets["test"],
        "--eval_names", "MR (in-dist)", "Amazon (OOD)", "--temperature_dataset", assets["dev"],
        "--sweep_num_entries", "5", "--report_dir", str(report),
    ])  # fmt: skip
    files, empty = _written(Path(finetuned), graft_dir, report)
    assert not empty
    assert [path for path in files if not SHELL_FRIENDLY.fullmatch(path.name)] == []
    assert (report / "reliability_graft_MR_in-dist.png").is_file()
    assert (report / "reliability_fine-tuned_TS_Amazon_OOD.png").is_file()
    assert not (report / "tmp").exists() and not list(graft_dir.glob("checkpoint-*"))


# ---------------------------------------------------------------------------------------------------- logs
def test_a_redirected_run_logs_compact_lines_and_writes_its_metrics(assets, finetuned, tmp_path):
    """A script run with stdout and stderr in a file: no raw evaluation dicts, no carriage returns or cursor codes,
    one line per evaluation with its step, and the full metrics in the Trainer's files."""
    out, log = tmp_path / "graft", tmp_path / "run.log"
    command = [
        sys.executable, str(EXAMPLES / "run_graft.py"), "--model_name_or_path", assets["model"],
        "--finetuned_model_name_or_path", finetuned, "--train_file", assets["train"], "--validation_file",
        assets["dev"], "--select_every", "2", "--select_on", "train+validation", "--logging_steps", "1",
        "--save_steps", "2", "--output_dir", str(out), *GRAFT_FAST, "--max_steps", "4",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=True, timeout=600)
    text = log.read_text()
    assert "{'eval_" not in text and "{'loss'" not in text and "*****" not in text
    assert "\r" not in text and "\x1b[" not in text
    evaluations = [line for line in text.splitlines() if " evaluation: " in line]
    assert [re.search(r"step (\d+)/4 evaluation", line).group(1) for line in evaluations] == ["0", "2", "4", "4"]
    assert all("accuracy" in line for line in evaluations)
    assert re.search(r"step 3/4: loss [\d.e-]+, .*grafted_entries", text)
    assert "graft results (all" in text
    results = json.loads((out / "graft_results.json").read_text())
    assert "eval_accuracy" in results and "eval_train_plus_eval_accuracy" in results
    assert json.loads((out / "all_results.json").read_text())["grafted_entries"] == results["grafted_entries"]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "eval_accuracy" in entry] == [0, 2, 4, 4]
    assert not list(out.glob("checkpoint-*"))


def test_a_redirected_fine_tune_shows_no_progress_bars(assets, tmp_path):
    """transformers' own bars (saving a model writes "Writing model shards") follow --disable_tqdm too."""
    log = tmp_path / "run.log"
    command = [
        sys.executable, str(EXAMPLES / "run_finetune.py"), "--model_name_or_path", assets["model"],
        "--train_file", assets["train"], "--output_dir", str(tmp_path / "ft"), *FAST,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=True, timeout=600)
    text = log.read_text()
    assert "Saved the fine-tuned model" in text
    assert "\r" not in text and "Writing model shards" not in text
