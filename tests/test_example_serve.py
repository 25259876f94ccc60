"""examples/serve_grafts.py on a tiny random BERT: grafts of tasks with different numbers of classes served from one
base in mixed batches give each request its own graft's prediction, as the per-task mode does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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


def make_assets(root: Path) -> tuple[str, list[str]]:
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    config = dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=24, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    base = BertForSequenceClassification(BertConfig(**config)).eval()
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
    assert [p["id"] for p in mixed] == list(range(len(requests)))
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
    assert {type(p["prediction"]) for p in mixed if p["task"] == "__base__"} == {int}
