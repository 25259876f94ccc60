"""Serve several grafts from one base model, batching requests of different tasks together (``adapter_names``).

Reads a file of ``(task, text)`` requests (``.jsonl`` with ``task`` and ``text`` fields, or ``.csv``/``.tsv`` with
those columns), cuts it into batches in arrival order (tasks mixed), runs each batch once with one graft per request
(``model(**batch, adapter_names=[task, ...])``; ``"__base__"`` asks for the pre-trained model), and writes one JSON
line per request: the predicted class, the batch it ran in and its latency (the wall time of its batch: tokenizing
and the forward), plus a summary with the throughput. ``--mode per_task`` serves the same requests one task at a time
(``set_adapter`` and a batch per task), for comparison.

The grafts (``--graft TASK=FOLDER``) are folders saved by ``examples/run_graft.py``, e.g. the main command's and the
other tasks' (the same pre-trained MiniLM under all three)::

    python examples/run_pipeline.py --task mr       # outputs/pipeline/minilm_mr/graft_0.0001
    python examples/run_pipeline.py                 # outputs/pipeline/minilm_trec/graft_0.0001
    python examples/run_pipeline.py --task sms      # outputs/pipeline/minilm_sms/graft_0.0001
    python examples/serve_grafts.py --requests requests.jsonl --output_dir outputs/serving \\
        --graft mr=outputs/pipeline/minilm_mr/graft_0.0001 --graft trec=outputs/pipeline/minilm_trec/graft_0.0001 \\
        --graft sms=outputs/pipeline/minilm_sms/graft_0.0001

Without ``--graft`` it builds small demo grafts itself, offline, from the packaged MiniLM (a few fine-tuning steps per
task, then a top-k-movement graft of 0.01% with the task's head stored whole: quick, not the paper's learned
regions); without ``--requests`` it draws requests from the packaged MR, TREC and SMS data.

Request files: ``.jsonl`` (or ``.json``), ``.csv``, ``.tsv``/``.txt`` (tab-separated) or ``.parquet``, with ``task``
and ``text`` columns (other columns are ignored); every request needs a task that names a graft (or ``__base__``) and a
non-empty text, else a ``ValueError`` names the file and the lines. ``predictions.jsonl`` gives each request's
``index``: its 0-based data row in the file (header excluded), as the other scripts' prediction files. Bad flags (a
``--batch_size`` or ``--max_seq_length`` below 1, or without room for text beside the tokenizer's special tokens, a
``--graft`` without ``TASK=``, a task given twice) are refused before anything is written.

Tasks with different numbers of classes share one base: :func:`peft_graft.serving.load_grafts` pads every head to the
largest with rows that never win (weight 0, bias the lowest finite value of the head's dtype).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import example_utils as U
import pandas as pd
import torch
from peft import PeftModel, get_peft_model
from real_tasks import ASSETS, ensure_assets, minilm_dir, task_frame
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from peft_graft import GraftConfig
from peft_graft.serving import load_grafts as load_padded_grafts

logger = logging.getLogger(__name__)

BASE = "__base__"  # the task name that asks for the pre-trained model
DEMO_TASKS = ("mr", "trec", "sms")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, checked before anything is read or written (argparse's error, naming the flag, otherwise)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--graft", action="append", default=[], type=_graft_spec, metavar="TASK=FOLDER", help="A graft to serve."
    )
    parser.add_argument("--model_name_or_path", default=None, help="The pre-trained base (default: packaged MiniLM).")
    parser.add_argument(
        "--requests", default=None, help="A .jsonl/.json/.csv/.tsv/.txt/.parquet file with task and text columns."
    )
    parser.add_argument("--output_dir", default="outputs/serving")
    parser.add_argument("--batch_size", type=_positive_int, default=32)
    parser.add_argument("--max_seq_length", type=_positive_int, default=64, help="Tokens per text, at most.")
    parser.add_argument("--mode", choices=("mixed", "per_task"), default="mixed")
    parser.add_argument(
        "--num_requests", type=_positive_int, default=256, help="Demo requests drawn when --requests is absent."
    )
    parser.add_argument("--demo_steps", type=_positive_int, default=30, help="Fine-tuning steps per demo graft.")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch threads (default: torch's).")
    args = parser.parse_args(argv)
    tasks = [task for task, _ in args.graft]
    repeated = sorted({task for task in tasks if tasks.count(task) > 1})
    if repeated:
        parser.error(f"argument --graft: task {repeated[0]!r} is given more than once; give each task one graft.")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _graft_spec(text: str) -> tuple[str, str]:
    """``TASK=FOLDER`` as ``(task, folder)``."""
    task, sign, folder = text.partition("=")
    if not sign or not task.strip() or not folder.strip():
        raise argparse.ArgumentTypeError(f"expected TASK=FOLDER (e.g. trec=outputs/trec/graft), got {text!r}")
    if task == BASE:
        raise argparse.ArgumentTypeError(f"{BASE!r} names the pre-trained model and cannot name a graft: {text!r}")
    return task, folder


# ------------------------------------------------------------------------------------------------ demo grafts
def build_demo_grafts(base: str, folder: Path, steps: int) -> dict[str, str]:
    """A small graft per packaged task: ``steps`` AdamW steps of MiniLM with a new head on the task's first examples,
    then the top 0.01% entries by movement, the head stored whole. Saved under ``folder/TASK``."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    grafts = {}
    for task in DEMO_TASKS:
        frame = task_frame(task).sample(frac=1.0, random_state=0).reset_index(drop=True).iloc[:512]
        label_names = sorted(frame["label"].unique().tolist())
        labels = torch.tensor([label_names.index(label) for label in frame["label"]])
        torch.manual_seed(0)
        pre = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(label_names))
        finetuned = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(label_names))
        finetuned.load_state_dict(pre.state_dict())
        optimizer = torch.optim.AdamW(finetuned.parameters(), lr=5e-5)
        finetuned.train()
        for step in range(steps):
            rows = [(step * 16 + i) % len(frame) for i in range(16)]
            inputs = tokenizer(frame["text"].iloc[rows].tolist(), padding=True, truncation=True, max_length=64,
                               return_tensors="pt")  # fmt: skip
            loss = finetuned(**inputs, labels=labels[rows]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        config = GraftConfig(finetuned=finetuned.eval(), sparsity=1e-4, modules_to_save=["classifier"],
                             task_type="SEQ_CLS")  # fmt: skip
        out = folder / task
        get_peft_model(pre, config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        U.TaskSetup(label_names=[str(name) for name in label_names]).save(out)
        grafts[task] = str(out)
        logger.info("Demo graft %s: %d fine-tuning steps, last loss %.3f, saved in %s", task, steps, loss.item(), out)
    return grafts


def demo_requests(tasks: list[str], count: int, path: Path) -> str:
    """``count`` requests drawn in turn from the tasks' data (texts the demo grafts were not fine-tuned on)."""
    frames = {task: task_frame(task).sample(frac=1.0, random_state=0).reset_index(drop=True) for task in tasks}
    rows = [{"task": tasks[i % len(tasks)], "text": frames[tasks[i % len(tasks)]]["text"].iloc[-1 - i // len(tasks)]}
            for i in range(count)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ------------------------------------------------------------------------------------------------ serving
def read_requests(path: str, tasks: list[str]) -> pd.DataFrame:
    """The ``task`` and ``text`` of every request of ``path``, in file order (index: the 0-based data row); a request
    without a text, without a task or for a task not in ``tasks`` (nor ``__base__``) is a ``ValueError`` naming the
    file and its lines."""
    U.check_data_file(path, "--requests")
    frame = U.read_frame(path)
    missing = {"task", "text"} - set(frame.columns)
    if missing:
        raise ValueError(
            f"{path!r}: the requests need columns 'task' and 'text'; missing {sorted(missing)} (columns: "
            f"{list(frame.columns)})."
        )
    frame = frame[["task", "text"]]
    for column in frame.columns:  # a list or an object (JSON) is no text nor task name: refused, never its repr
        U.check_cells(frame[column], path, column)
    empty = frame.isna() | frame.map(lambda value: isinstance(value, str) and not value.strip())
    for column, fix in (("text", "write the text"), ("task", f"name one of {sorted(tasks)} or {BASE!r}")):
        if empty[column].any():
            rows = U.describe_rows(path, empty.index[empty[column]])
            raise ValueError(f"{path!r}: {rows} have no {column} (null or empty): {fix}, or delete those requests.")
    frame = frame.map(U.cell_text)  # a JSON number or true/false as spelled in the file
    unknown = ~frame["task"].isin([*tasks, BASE])
    if unknown.any():
        raise ValueError(
            f"{path!r}: {U.describe_rows(path, frame.index[unknown])} ask for tasks "
            f"{sorted(set(frame['task'][unknown]))[:5]} without a graft; grafts: {sorted(tasks)} (and {BASE!r} for "
            "the pre-trained model). Add --graft TASK=FOLDER or fix the task names."
        )
    return frame


def load_grafts(base: str, grafts: dict[str, str]) -> tuple[PeftModel, dict[str, list[str]], list[str]]:
    """One base with every graft loaded under its task's name, heads padded to the largest number of classes
    (:func:`peft_graft.serving.load_grafts`); the class names per task; the base head's tensors that were initialised
    at random at this load (none when its checkpoint has a trained head of the served size)."""
    setups = {}
    for task, folder in grafts.items():
        setup = U.TaskSetup.load(folder)
        if setup is None or setup.head != "classification":
            raise ValueError(f"--graft {task}={folder}: not a classification graft saved by examples/run_graft.py.")
        setups[task] = setup.label_names
    num_labels = max(len(names) for names in setups.values())
    # Every graft stores its head whole; the base's own head serves "__base__" requests only.
    model, info = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=num_labels, ignore_mismatched_sizes=True, output_loading_info=True
    )
    new_head = sorted({*info["missing_keys"], *(key for key, *_ in info["mismatched_keys"])})
    return load_padded_grafts(model, grafts).eval(), setups, new_head


def batches(requests: pd.DataFrame, batch_size: int, mode: str) -> list[list[int]]:
    """Request numbers per batch: in arrival order, tasks mixed (sorted by task within a batch, so that each graft's
    examples are contiguous and the layers take views of the batch rather than copies); or per task (``per_task``)."""
    if mode == "mixed":
        tasks = requests["task"].tolist()
        starts = range(0, len(requests), batch_size)
        return [sorted(range(i, min(i + batch_size, len(requests))), key=lambda row: tasks[row]) for i in starts]
    out = []
    for _, group in requests.groupby("task", sort=False):
        rows = group.index.tolist()
        out.extend(rows[i : i + batch_size] for i in range(0, len(rows), batch_size))
    return out


def check_max_length(max_length: int, tokenizer) -> None:
    """``--max_seq_length`` must leave room for a token of text beside the tokenizer's special tokens: below that the
    tokenizer does not truncate at all."""
    special = tokenizer.num_special_tokens_to_add()
    if max_length <= special:
        raise ValueError(
            f"--max_seq_length {max_length} leaves no room for text: the tokenizer adds {special} special tokens to "
            f"each text; use at least {special + 1}."
        )


def check_base_requests(requests: pd.DataFrame, path: str, new_head: list[str], base: str) -> None:
    """``__base__`` requests need a base whose checkpoint holds a trained head of the served size: a head initialised
    at random at load (``new_head``: its tensors) would answer at random, differently at every load."""
    asked = requests.index[requests["task"] == BASE]
    if new_head and len(asked):
        raise ValueError(
            f"{path!r}: {U.describe_rows(path, asked)} ask for {BASE!r}, but the base {base!r} has no trained head of "
            f"this size (initialised at random at load: {new_head[:4]}), so its answers would be random. Drop "
            "those requests, or serve a base whose checkpoint has a trained classification head with as many classes "
            "as the largest graft's."
        )


def serve(model, tokenizer, setups, requests: pd.DataFrame, batch_size: int, max_length: int, mode: str) -> list:
    """Each request's prediction, batch and latency; ``requests`` as :func:`read_requests` checked them."""
    results = [None] * len(requests)
    start = time.perf_counter()
    for number, rows in enumerate(batches(requests, batch_size, mode)):
        batch_start = time.perf_counter()
        tasks = requests["task"].iloc[rows].tolist()
        inputs = tokenizer(requests["text"].iloc[rows].tolist(), padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt")  # fmt: skip
        with torch.inference_mode():
            if mode == "mixed":
                logits = model(**inputs, adapter_names=tasks).logits
            elif tasks[0] == BASE:
                with model.disable_adapter():
                    logits = model(**inputs).logits
            else:
                model.set_adapter(tasks[0], inference_mode=True)  # keeps a loaded graft packed
                logits = model(**inputs).logits
        done = time.perf_counter()
        for row, task, scores in zip(rows, tasks, logits, strict=True):
            names = setups.get(task)
            label = int(scores[: len(names)].argmax()) if names else int(scores.argmax())
            results[row] = {
                "index": int(requests.index[row]),
                "task": task,
                "text": requests["text"].iloc[row],
                "prediction": names[label] if names else label,
                "batch": number,
                "latency_ms": round(1e3 * (done - batch_start), 2),
                "completed_ms": round(1e3 * (done - start), 2),
            }
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    U.setup_logging(None, logger)
    if args.threads:
        torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    if args.model_name_or_path is None or not args.graft or args.requests is None:
        ensure_assets(ASSETS)
    base = args.model_name_or_path or minilm_dir()
    grafts = dict(args.graft)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(grafts.values()), base))  # the demo grafts save the base's
    check_max_length(args.max_seq_length, tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not grafts:
        grafts = build_demo_grafts(base, output_dir / "demo_grafts", args.demo_steps)
    requests_path = args.requests or demo_requests(list(grafts), args.num_requests, output_dir / "requests.jsonl")
    requests = read_requests(requests_path, list(grafts))
    start = time.perf_counter()
    model, setups, new_head = load_grafts(base, grafts)
    load_s = time.perf_counter() - start
    check_base_requests(requests, requests_path, new_head, base)
    serve(model, tokenizer, setups, requests.iloc[: args.batch_size], args.batch_size, args.max_seq_length, args.mode)
    start = time.perf_counter()  # timed after one warm-up batch
    results = serve(model, tokenizer, setups, requests, args.batch_size, args.max_seq_length, args.mode)
    total_s = time.perf_counter() - start
    U.write_text_atomic(output_dir / "predictions.jsonl", "".join(json.dumps(result) + "\n" for result in results))
    latencies = [result["latency_ms"] for result in results]
    summary = {
        "mode": args.mode,
        "grafts": sorted(grafts),
        "requests": len(results),
        "batch_size": args.batch_size,
        "batches": len({result["batch"] for result in results}),
        "load_grafts_s": round(load_s, 2),
        "total_s": round(total_s, 3),
        "throughput_requests_per_s": round(len(results) / total_s, 1),
        "latency_ms_median": round(statistics.median(latencies), 1),
        "latency_ms_max": round(max(latencies), 1),
        "torch_threads": torch.get_num_threads(),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("Served %d requests: %s", len(results), json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
