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


# ---------------------------------------------------------------------------------------------------- no row lost
# A test file as a careless user writes it: an empty text, a missing label, texts that pandas reads as missing.
AWKWARD_TEST = "sentence,label\nthe film was good,pos\n,neg\nthe plot was dull,\nNA,pos\nnull,neg\nNone,pos\n"
AWKWARD_TEXTS = ["the film was good", "", "the plot was dull", "NA", "null", "None"]


def _awkward_test(tmp_path) -> str:
    path = tmp_path / "awkward_test.csv"
    path.write_text(AWKWARD_TEST)
    return str(path)


def test_graft_predicts_every_test_row_with_its_index(assets, finetuned, tmp_path):
    """Every row of the test file gets a prediction line with its 0-based data row, in file order; the row without a
    label is predicted and not scored."""
    test = _awkward_test(tmp_path)
    out = tmp_path / "graft"
    metrics = graft(assets, finetuned, out, "--train_file", assets["train"], "--test_file", test, "--do_predict")
    lines = (out / "predict_results.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction"
    assert [line.split("\t")[0] for line in lines[1:]] == ["0", "1", "2", "3", "4", "5"]
    assert metrics["predict_examples"] == 6 and metrics["predict_scored_examples"] == 5
    saved = json.loads((out / "predict_results.json").read_text())
    assert saved["predict_scored_examples"] == 5 and "predict_accuracy" in saved
    # The predictions are those of the texts as written ('NA' is a text), each on its own row.
    frame = U.read_table(test, label_required=False)
    assert frame["text"].tolist() == AWKWARD_TEXTS and frame.index.tolist() == list(range(6))
    assert frame["label"].isna().tolist() == [False, False, True, False, False, False]


def test_evaluate_predicts_every_test_row_and_scores_the_labelled_ones(assets, finetuned, tmp_path):
    graft_dir = tmp_path / "graft"
    graft(assets, finetuned, graft_dir, "--train_file", assets["train"])
    test, report = _awkward_test(tmp_path), tmp_path / "report"
    results = run_evaluate.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
        "--graft_dirs", str(graft_dir), "--test_file", test, "--do_predict", "--sweep", "false",
        "--report_dir", str(report),
    ])  # fmt: skip
    predictions = pd.read_csv(report / "predict_results.csv", keep_default_na=False, dtype=str)
    assert predictions["index"].tolist() == ["0", "1", "2", "3", "4", "5"]
    assert predictions["label"].tolist() == ["pos", "neg", "", "pos", "neg", "pos"]
    assert results["eval_sets"]["test"]["examples"] == 5  # scored: the rows with a label
    scored = predictions[predictions["label"] != ""]
    accuracy = (scored["fine-tuned"] == scored["label"]).mean()
    assert accuracy == pytest.approx(results["metrics"]["test"]["fine-tuned"]["accuracy"])


def test_evaluate_predicts_a_test_file_without_labels(assets, finetuned, tmp_path):
    graft_dir = tmp_path / "graft"
    graft(assets, finetuned, graft_dir, "--train_file", assets["train"])
    report = tmp_path / "report"
    results = run_evaluate.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
        "--graft_dirs", str(graft_dir), "--validation_file", assets["dev"], "--test_file", assets["unlabeled"],
        "--do_predict", "--sweep", "false", "--report_dir", str(report),
    ])  # fmt: skip
    assert list(results["metrics"]) == ["validation"]
    predictions = pd.read_csv(report / "predict_results.csv", keep_default_na=False, dtype=str)
    assert predictions["index"].tolist() == [str(i) for i in range(7)] and set(predictions["label"]) == {""}
    assert set(predictions["fine-tuned"]) <= {"neg", "pos"}


def _write(path: Path, rows: list[dict], kind: str) -> str:
    """``rows`` as a file of ``kind``: csv, tsv, jsonl, json (one array), parquet, or a save_to_disk folder."""
    frame = pd.DataFrame(rows)
    target = path / ("data" if kind == "disk" else f"data.{kind}")
    if kind == "csv":
        frame.to_csv(target, index=False)
    elif kind == "tsv":
        frame.to_csv(target, index=False, sep="\t")
    elif kind == "jsonl":
        frame.to_json(target, orient="records", lines=True)
    elif kind == "json":
        frame.to_json(target, orient="records")
    elif kind == "parquet":
        frame.to_parquet(target)
    else:
        from datasets import Dataset

        Dataset.from_pandas(frame).save_to_disk(str(target))
    return str(target)


# File lines of data row 2 (0-based): header on line 1 for tables, none for JSON lines; no lines for the others.
LINE_OF_ROW_2 = {"csv": "4", "tsv": "4", "jsonl": "3", "json": None, "parquet": None, "disk": None}


@pytest.mark.parametrize("kind", list(LINE_OF_ROW_2))
def test_every_reader_refuses_a_training_row_without_a_label_and_names_it(tmp_path, kind):
    rows = [{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}, {"text": "fine", "label": None},
            {"text": "NA", "label": "pos"}]  # fmt: skip
    path = _write(tmp_path, rows, kind)
    line = LINE_OF_ROW_2[kind]
    where = r"1 row\(s\) 2 \(0-based data rows" + (rf"; file lines {line}\)" if line else r"\)")
    with pytest.raises(ValueError, match=rf"{re.escape(repr(path))}: {where} have no label in column 'label'.*Fill in"):
        U.read_table(path)
    # A test file may leave a label out: the row is kept, in place, with the others.
    frame = U.read_table(path, label_required=False)
    assert frame["text"].tolist() == ["good", "bad", "fine", "NA"] and frame["label"].isna().tolist()[2]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_every_reader_refuses_a_null_text_and_names_its_row(tmp_path, kind):
    rows = [{"text": "good", "label": "pos"}, {"text": None, "label": "neg"}]
    path = _write(tmp_path, rows, kind)
    with pytest.raises(ValueError, match=r"1 row\(s\) 1 \(0-based data rows.* have no text \(null\) in column 'text'"):
        U.read_table(path, label_required=False)


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "json", "parquet", "disk"])
def test_every_reader_keeps_texts_that_look_missing(tmp_path, kind):
    """'NA', 'null', 'None', 'nan' and '' are texts; labels keep their class names ('1', not '1.0')."""
    texts = ["NA", "null", "None", "nan", "", "N/A"]
    rows = [{"text": text, "label": i % 2} for i, text in enumerate(texts)]
    frame = U.read_table(_write(tmp_path, rows, kind))
    assert frame["text"].tolist() == texts
    assert U.label_names_of(frame) == ["0", "1"]
    assert U.encode_labels(frame, ["0", "1"])["label"].tolist() == [0, 1, 0, 1, 0, 1]


def test_a_missing_split_of_a_saved_dataset_is_named(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits are \['train'\]: name one"):
        U.read_table(str(tmp_path / "d"), split="validation")


def test_a_csv_file_with_a_multi_line_cell_gives_file_lines(tmp_path):
    path = tmp_path / "multi.csv"
    path.write_text('text,label\n"two\nlines",pos\n\nok,\n')
    with pytest.raises(ValueError, match=r"1 row\(s\) 1 \(0-based data rows; file lines 5\)"):
        U.read_table(str(path))


def test_a_validation_label_that_is_no_class_names_the_file_and_rows(assets, tmp_path):
    path = tmp_path / "dev.csv"
    path.write_text("sentence,label\nthe film was good,pos\nthe plot was dull,negative\n")
    message = r"dev.csv': 1 row\(s\) 1 \(0-based data rows; file lines 3\) have labels \['negative'\] that"
    with pytest.raises(ValueError, match=message):
        finetune(assets, tmp_path / "ft", "--train_file", assets["train"], "--validation_file", str(path))


def test_numeric_class_names_sort_by_number(tmp_path):
    path = tmp_path / "ten.csv"
    pd.DataFrame({"text": [f"t{i}" for i in range(11)], "label": list(range(11))}).to_csv(path, index=False)
    assert U.label_names_of(U.read_table(str(path))) == [str(i) for i in range(11)]


def test_a_training_file_with_one_class_is_refused(assets, tmp_path):
    path = tmp_path / "one_class.csv"
    _rows(10, 0)[lambda f: f["label"] == "pos"].to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"one_class.csv' has 1 class\(es\) \['pos'\] in column 'label'.*at least two"):
        finetune(assets, tmp_path / "ft", "--train_file", str(path))
    assert not (tmp_path / "ft" / "model.safetensors").exists()


def test_negative_rows_with_empty_texts_still_train_both_classes(assets, tmp_path):
    """The case that used to train a one-class regression head: the negative rows' texts are empty."""
    frame = _rows(16, 0)
    frame.loc[frame["label"] == "neg", "sentence"] = ""
    path = tmp_path / "empty_negatives.csv"
    frame.to_csv(path, index=False)
    out = tmp_path / "ft"
    finetune(assets, out, "--train_file", str(path))
    assert U.TaskSetup.load(out).label_names == ["neg", "pos"]
    assert load_file(out / "model.safetensors")["classifier.weight"].shape[0] == 2  # not a 1-output regression head


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("empty.csv", b"", r"'.*empty.csv' is empty: a data file needs a header line"),
        ("empty.jsonl", b"", r"'.*empty.jsonl' is empty"),
        ("blank.csv", b"\n\n", r"'.*blank.csv' is empty"),
        ("header.csv", b"sentence,label\n", r"'.*header.csv' has no rows \(columns: \['sentence', 'label'\]\)"),
        ("header.tsv", b"sentence\tlabel\n", r"'.*header.tsv' has no rows"),
        ("latin1.csv", b"sentence,label\nfine,pos\ncaf\xe9 noir,neg\n",
         r"'.*latin1.csv' is not UTF-8 text: byte 0xe9 at line 3, column 4 .*Re-save it as UTF-8"),
        ("latin1.jsonl", b'{"sentence": "ok", "label": "pos"}\n{"sentence": "caf\xe9", "label": "neg"}\n',
         r"'.*latin1.jsonl' is not UTF-8 text: byte 0xe9 at line 2, column 18"),
        ("latin1.tsv", b"sentence\tlabel\ncaf\xe9\tneg\n", r"latin1.tsv' is not UTF-8 text: byte 0xe9 at line 2"),
    ],
)  # fmt: skip
def test_empty_header_only_and_non_utf8_files_are_value_errors_naming_the_file(assets, tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        finetune(assets, tmp_path / "ft", "--train_file", str(path))


# ---------------------------------------------------------------------------------------------------- a later run
def test_a_later_run_into_the_same_folders_leaves_no_earlier_result(assets, finetuned, tmp_path):
    """run_finetune, run_graft and run_evaluate remove the result files of an earlier run in their folder before
    writing their own: a run without --do_predict leaves no earlier predictions beside the new model."""
    ft = tmp_path / "ft"
    finetune(assets, ft, "--train_file", assets["train"], "--validation_file", assets["dev"], "--test_file",
             assets["test"], "--do_predict")  # fmt: skip
    assert {"predict_results.txt", "predict_results.json", "eval_results.json"} <= {p.name for p in ft.iterdir()}
    finetune(assets, ft, "--train_file", assets["train"])
    names = {p.name for p in ft.iterdir()}
    assert not {"predict_results.txt", "predict_results.json", "eval_results.json"} & names
    assert "model.safetensors" in names and "train_results.json" in names

    out = tmp_path / "graft"
    graft(assets, finetuned, out, "--train_file", assets["train"], "--validation_file", assets["dev"],
          "--test_file", assets["test"], "--do_predict")  # fmt: skip
    assert (out / "predict_results.txt").is_file() and "eval_accuracy" in json.loads(
        (out / "graft_results.json").read_text())  # fmt: skip
    graft(assets, finetuned, out, "--train_file", assets["train"])
    assert not (out / "predict_results.txt").exists() and not (out / "predict_results.json").exists()
    assert not (out / "eval_results.json").exists()
    assert "eval_accuracy" not in json.loads((out / "graft_results.json").read_text())
    assert (out / "adapter_model.safetensors").is_file()

    report = tmp_path / "report"
    common = ["--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", finetuned,
              "--graft_dirs", str(out), "--report_dir", str(report)]  # fmt: skip
    run_evaluate.main([*common, "--eval_datasets", assets["dev"], "--eval_names", "old", "--test_file",
                       assets["test"], "--do_predict"])  # fmt: skip
    assert (report / "predict_results.csv").is_file() and (report / "reliability_graft_old.png").is_file()
    run_evaluate.main([*common, "--eval_datasets", assets["dev"], "--eval_names", "new", "--sweep", "false"])
    names = {p.name for p in report.iterdir()}
    assert "predict_results.csv" not in names and "sweep_accuracy.png" not in names
    assert "reliability_graft_old.png" not in names and "reliability_graft_new.png" in names


# ---------------------------------------------------------------------------------------------------- class names
# Class names that break a line-per-record file unless quoted: a line break, a tab, a quote (issue 60).
AWKWARD_CLASSES = ("bad\nreview", 'good\t"review"')


def _awkward_class_files(tmp_path: Path) -> tuple[str, str]:
    train, test = tmp_path / "awkward_train.csv", tmp_path / "awkward_test.csv"
    _rows(16, 0, labels=AWKWARD_CLASSES).to_csv(train, index=False)
    _rows(4, 1, labels=AWKWARD_CLASSES).to_csv(test, index=False)
    return str(train), str(test)


def test_predict_results_txt_round_trips_class_names_with_line_breaks_and_tabs(assets, tmp_path):
    """One record per test row whatever the class names hold (quoted as CSV quotes them): 4 rows, not 9 lines' worth."""
    train, test = _awkward_class_files(tmp_path)
    out = tmp_path / "ft"
    finetune(assets, out, "--train_file", train, "--test_file", test, "--do_predict")
    assert U.TaskSetup.load(out).label_names == sorted(AWKWARD_CLASSES)
    read = pd.read_csv(out / "predict_results.txt", sep="\t", dtype=str, keep_default_na=False)
    assert list(read.columns) == ["index", "prediction"]
    assert read["index"].tolist() == ["0", "1", "2", "3"] and set(read["prediction"]) <= set(AWKWARD_CLASSES)


def test_predict_results_csv_round_trips_class_names_with_line_breaks_and_tabs(assets, tmp_path):
    train, test = _awkward_class_files(tmp_path)
    ft, graft_dir, report = tmp_path / "ft", tmp_path / "graft", tmp_path / "report"
    finetune(assets, ft, "--train_file", train)
    graft(assets, str(ft), graft_dir, "--train_file", train)
    run_evaluate.main([
        "--model_name_or_path", assets["model"], "--finetuned_model_name_or_path", str(ft),
        "--graft_dirs", str(graft_dir), "--test_file", test, "--do_predict", "--sweep", "false",
        "--report_dir", str(report),
    ])  # fmt: skip
    predictions = pd.read_csv(report / "predict_results.csv", dtype=str, keep_default_na=False)
    assert predictions["index"].tolist() == ["0", "1", "2", "3"]
    assert predictions["label"].tolist() == pd.read_csv(test)["label"].tolist()
    assert set(predictions["fine-tuned"]) <= set(AWKWARD_CLASSES)


def test_a_hostile_training_file_keeps_every_row_and_class(assets, tmp_path):
    """Windows line endings, a byte-order mark, blank lines, quoted line breaks, texts that look missing and labels
    written several ways: every row is read, in order, each under the class its label means."""
    lines = ["sentence,label", '"the film\r\nwas good", 1', "", "NA,2", '"",1.0', "null,02", "the plot was dull,2.0 ",
             "None,01", "brilliant and fun,+1"]  # fmt: skip
    path = tmp_path / "hostile.csv"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8") + b"\r\n")
    out = tmp_path / "ft"
    finetune(assets, out, "--train_file", str(path))
    assert U.TaskSetup.load(out).label_names == ["1", "2"]
    frame = U.read_table(str(path))
    assert frame["text"].tolist() == ["the film\r\nwas good", "NA", "", "null", "the plot was dull", "None",
                                      "brilliant and fun"]  # fmt: skip
    assert U.encode_labels(frame, ["1", "2"])["label"].tolist() == [0, 1, 0, 1, 1, 0, 0]
    assert U.line_numbers(str(path)) == [2, 5, 6, 7, 8, 9, 10]
