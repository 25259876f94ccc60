"""examples/serve_grafts.py on a tiny random BERT: grafts of tasks with different numbers of classes served from one
base in mixed batches give each request its own graft's prediction, as the per-task mode does."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import finetune_like
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import example_utils  # noqa: E402
import serve_grafts  # noqa: E402

from peft_graft import GraftConfig  # noqa: E402

WORDS = ["good", "bad", "film", "what", "who", "free", "prize", "call", "the", "is", "a", "was"]
TASKS = {"sentiment": ["negative", "positive"], "question": ["DESC", "HUM", "LOC"]}


def make_assets(root: Path, base_labels: int = 3) -> tuple[str, list[str]]:
    """A base classifier with a head of ``base_labels`` classes (3: the largest task's, so it serves "__base__") and
    a graft per task of :data:`TASKS`."""
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    config = dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=24, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    base = BertForSequenceClassification(BertConfig(**config, num_labels=base_labels)).eval()
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    specs = []
    for seed, (task, labels) in enumerate(TASKS.items(), 1):
        torch.manual_seed(seed)
        pre = BertForSequenceClassification(BertConfig(**config, num_labels=len(labels))).eval()
        pre.bert.load_state_dict(base.bert.state_dict())
        finetuned = finetune_like(pre, scale=0.05, seed=seed)
        graft = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"], task_type="SEQ_CLS")
        out = root / task
        get_peft_model(pre, graft).save_pretrained(out)
        tokenizer.save_pretrained(out)
        example_utils.TaskSetup(label_names=labels).save(out)
        specs.append(f"{task}={out}")
    return str(base_dir), specs


def test_serving_mixed_batches_gives_each_request_its_grafts_prediction(tmp_path):
    base, specs = make_assets(tmp_path)
    texts = ["the film was good", "who is the prize", "what a bad film", "call free prize now", "the film is bad"]
    requests = [{"task": task, "text": text} for text in texts for task in (*TASKS, "__base__")]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    summaries, predictions = {}, {}
    for mode in ("mixed", "per_task"):
        out = tmp_path / mode
        argv = ["--model_name_or_path", base, "--requests", str(path), "--output_dir", str(out), "--batch_size", "4"]
        summaries[mode] = serve_grafts.main([*argv, *(f"--graft={spec}" for spec in specs), "--mode", mode])
        lines = (out / "predictions.jsonl").read_text().splitlines()
        predictions[mode] = [json.loads(line) for line in lines]
    mixed = predictions["mixed"]
    assert [p["index"] for p in mixed] == list(range(len(requests)))
    assert summaries["mixed"]["batches"] == 4 and summaries["per_task"]["batches"] == 6
    assert all(p["latency_ms"] > 0 for p in mixed) and summaries["mixed"]["throughput_requests_per_s"] > 0
    assert [p["prediction"] for p in mixed] == [p["prediction"] for p in predictions["per_task"]]
    tokenizer = BertTokenizerFast.from_pretrained(base)
    for task, labels in TASKS.items():  # each graft alone, on a base with its own head
        model = AutoModelForSequenceClassification.from_pretrained(
            base, num_labels=len(labels), ignore_mismatched_sizes=True
        )
        model = PeftModel.from_pretrained(model, str(tmp_path / task)).eval()
        with torch.no_grad():
            logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
        expected = [labels[i] for i in logits.argmax(-1).tolist()]
        assert [p["prediction"] for p in mixed if p["task"] == task] == expected
    base_model = AutoModelForSequenceClassification.from_pretrained(base).eval()  # its own trained head
    with torch.no_grad():
        expected = base_model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    assert [p["prediction"] for p in mixed if p["task"] == "__base__"] == expected


def test_base_requests_on_a_head_initialised_at_load_are_refused(tmp_path):
    """A base whose head has another size than the served one gets a new, random head at every load: "__base__"
    requests are refused naming the file and lines, and the grafts' requests still serve."""
    base, specs = make_assets(tmp_path, base_labels=2)
    path = tmp_path / "requests.jsonl"
    rows = [{"task": "sentiment", "text": "good film"}, {"task": "__base__", "text": "bad film"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model_name_or_path", base, "--requests", str(path), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"requests\.jsonl.*row\(s\) 1 .*file lines 2\).*'__base__'.*no trained head"):
        serve_grafts.main([*argv, *(f"--graft={spec}" for spec in specs)])
    path.write_text(json.dumps(rows[0]) + "\n")
    serve_grafts.main([*argv, *(f"--graft={spec}" for spec in specs)])
    assert json.loads((tmp_path / "out" / "predictions.jsonl").read_text())["prediction"] in TASKS["sentiment"]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[str, list[str], list[dict], list]:
    """The assets, a request list and its predictions served from a JSON lines file (the reference)."""
    root = tmp_path_factory.mktemp("serve")
    base, specs = make_assets(root)
    texts = ["the film was good", "who is the prize", "what a bad film", "call free prize now"]
    requests = [{"task": task, "text": text} for text in texts for task in (*TASKS, "__base__")]
    path = root / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return base, specs, requests, _serve(base, specs, path, root / "out")


def _serve(base: str, specs: list[str], requests: Path, out: Path) -> list:
    argv = ["--model_name_or_path", base, "--requests", str(requests), "--output_dir", str(out), "--batch_size", "4"]
    serve_grafts.main([*argv, *(f"--graft={spec}" for spec in specs)])
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def _request_file(folder: Path, requests: list[dict], kind: str) -> Path:
    frame = pd.DataFrame(requests).assign(user=range(len(requests)))  # an extra column is ignored
    path = folder / f"requests.{kind}"
    if kind == "csv":
        frame.to_csv(path, index=False)
    elif kind in ("tsv", "txt"):
        frame.to_csv(path, index=False, sep="\t")
    elif kind == "json":
        frame.to_json(path, orient="records")
    else:
        frame.to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["csv", "tsv", "txt", "json", "parquet"])
def test_every_documented_request_format_serves_as_json_lines(served, tmp_path, kind):
    """docs/serving.md and --help promise .jsonl, .csv and .tsv request files (and the readers take .txt, .json,
    .parquet): each gives the JSON lines file's predictions, with each request's 0-based row as its index."""
    base, specs, requests, expected = served
    predictions = _serve(base, specs, _request_file(tmp_path, requests, kind), tmp_path / "out")
    assert [p["index"] for p in predictions] == list(range(len(requests)))
    assert [(p["task"], p["text"]) for p in predictions] == [(p["task"], p["text"]) for p in expected]
    assert [p["prediction"] for p in predictions] == [p["prediction"] for p in expected]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('task,text\nsentiment,good\nquestion,\n', r"1 row\(s\) 1 \(0-based data rows; file lines 3\) have no text"),
        ('{"task": "sentiment", "text": "good"}\n{"task": "question", "text": null}\n',
         r"1 row\(s\) 1 \(0-based data rows; file lines 2\) have no text \(null or empty\): write the text"),
        ('task,text\n,good\nsentiment,bad\n', r"1 row\(s\) 0 \(0-based data rows; file lines 2\) have no task"),
        ('{"text": "good"}\n', r"need columns 'task' and 'text'; missing \['task'\]"),
        ('task,text\nsentiment,good\nspam,free prize\nspam,call\n',
         r"2 row\(s\) 1, 2 \(0-based data rows; file lines 3, 4\) ask for tasks \['spam'\] without a graft"),
        ("task,text\n", r"has no rows"),
        ('{"task": "sentiment", "text": ["good", "film"]}\n', r"1 row\(s\) 0 .* hold a list in column 'text'"),
        ('{"task": {"name": "sentiment"}, "text": "good"}\n', r"hold an object in column 'task'"),
    ],
)  # fmt: skip
def test_bad_requests_are_value_errors_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / ("requests.jsonl" if content.startswith("{") else "requests.csv")
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(path)))}.*{message}"):
        serve_grafts.read_requests(str(path), list(TASKS))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch_size", "0"], r"argument --batch_size: must be a positive integer, got 0"),
        (["--batch_size", "-1"], r"argument --batch_size: must be a positive integer, got -1"),
        (["--max_seq_length", "0"], r"argument --max_seq_length: must be a positive integer, got 0"),
        (["--graft", "outputs/trec"], r"argument --graft: expected TASK=FOLDER .*got 'outputs/trec'"),
        (["--graft", "trec="], r"argument --graft: expected TASK=FOLDER"),
        (["--graft", "__base__=x"], r"argument --graft: '__base__' names the pre-trained model"),
        (["--graft", "trec=a", "--graft", "trec=b"], r"argument --graft: task 'trec' is given more than once"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_naming_the_flag_before_anything_is_written(tmp_path, capsys, flags, message):
    """Each bad flag is argparse's error naming it (exit status 2), before the output folder or any file is made."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as error:
        serve_grafts.main(["--output_dir", str(out), "--requests", str(tmp_path / "requests.jsonl"), *flags])
    assert error.value.code == 2 and re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_a_max_seq_length_without_room_for_text_is_refused_before_anything_is_written(tmp_path):
    """BERT adds two special tokens to each text: ``--max_seq_length 2`` would not truncate at all."""
    base, specs = make_assets(tmp_path)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", base, "--output_dir", str(out), "--max_seq_length", "2"]
    with pytest.raises(ValueError, match=r"--max_seq_length 2 leaves no room for text.*2 special tokens.*at least 3"):
        serve_grafts.main([*argv, "--requests", str(tmp_path / "requests.jsonl"), *(f"--graft={s}" for s in specs)])
    assert not out.exists()
