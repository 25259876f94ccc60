#!/usr/bin/env python
"""Merge fine-tunes of one model, fairly: four tasks, frozen heads of their own, every rule tuned on dev, offline.

The set-up (docs/merging.md says why):

* **Tasks**: movie-review sentiment (MR, 2 classes), TREC question type (6), SMS spam (2) and the CrowdFlower tweets'
  sentiment (3), all from packaged data; disjoint test, dev and training sets per task.
* **Heads**: each task's head is frozen and its own: the normalised mean-pooled embeddings of its class descriptions
  (:data:`DESCRIPTIONS`) under the pre-trained all-MiniLM-L6-v2, as CLIP's zero-shot heads; ``logits = scale * cos``
  with a fixed ``--logit_scale``. A task's logits are only its own classes. The body is mean-pooled as the packaged
  sentence model is: there is no pooler, and no head is ever in a graft or a merge.
* **Fine-tunes**: the body alone (embeddings frozen), SGD, lr 5e-2, batch 8, on up to ``train_size`` examples per
  task (the many-shot settings of ``run_pipeline.py`` with a stated budget of steps).
* **Regions per task**: the *full* graft (every entry fine-tuning moved: ``tau = theta_ft - theta_pre``, exact);
  Localize-and-Stitch's localization (:class:`~peft_graft.LocalizeStitch`, the reference settings on ``localize_k_shot``
  examples per class); the same learned outside the earlier tasks' regions (*disjoint*: regions that do not collide);
  and the grafting trainer (``MaskTrainer``, ``--fraction`` of the parameters, selected on dev).
* **Rules** (:func:`peft_graft.merging.merge_grafts`): stitch on each kind of region (and with a scale of its own),
  stitch_dataless, task arithmetic, TIES, DARE-TIES, DARE-linear, Consensus TA and Consensus TIES (each of TA, TIES and
  the Consensus rules also with LiNeS's per-layer scaling), WUDI (closed form, and the reference's Adam form) and
  RegMean (on each task's input Gram matrices over ``--regmean_examples`` unlabelled training inputs); every setting
  chosen on the dev sets (mean dev accuracy) over a grid widened while its winner lies on an edge it can move
  (``--max_widen`` times), never on test. Each kind's task vectors are stacked once (:class:`TaskVectorStack`) for all
  its merges; each merge's time is reported, and each task's task-vector norm per layer type.
* **Serve, don't merge**: each task's exact (full) graft, its L&S graft and its MaskTrainer graft (also MaskTrainer
  regions of ``--served_fractions``) served in mixed batches (``adapter_names``), with the forward cost of a mixed
  batch of each of ``--cost_batches`` sizes (in the ``"exact"`` and ``"sparse_delta"`` mixed batch modes) and of the
  best merged model against the base model's (paired ratios in one process).

Writes ``summary.md``, ``results.json`` and figures to ``--report_dir``; every fine-tune, region and score is saved in
``--work_dir`` as it lands, and a rerun skips what is done.

    python examples/run_merge.py            # the full run (docs/merging.md gives its time)
    python examples/run_merge.py --smoke    # a few steps of everything
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import logging
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import example_utils as U
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from real_tasks import ASSETS, TWEETS_ASSETS, ensure_assets, minilm_dir, prepare_data
from safetensors.torch import load_file, save_file
from three_tasks import Runner, Task
from torch import nn
from transformers import AutoModel, HfArgumentParser
from transformers.modeling_outputs import SequenceClassifierOutput

from peft_graft import GraftConfig, LocalizeStitch, Region
from peft_graft.analysis import overlap_matrix, plot_region_matrix
from peft_graft.calibration import calibration_report, save_figure
from peft_graft.input_statistics import input_grams
from peft_graft.merging import MergedGraft, TaskVectorStack, merge_grafts, task_vector_norms

logger = logging.getLogger("run_merge")

TASKS = ("mr", "trec", "sms", "tweets")
DESCRIPTIONS = {  # class name (as in the data, sorted) -> its description, embedded by the pre-trained body
    "mr": {"0": "a negative movie review", "1": "a positive movie review"},
    "trec": {
        "ABBR": "a question asking for an abbreviation or what it stands for",
        "DESC": "a question asking for a description, definition, manner or reason",
        "ENTY": "a question asking for a thing, an entity, an object or a term",
        "HUM": "a question asking for a person, a group or an organization",
        "LOC": "a question asking for a place, a city or a country",
        "NUM": "a question asking for a number, a date, a count or an amount",
    },
    "sms": {"0": "a personal text message between friends", "1": "a spam text message advertising a prize or offer"},
    "tweets": {"negative": "a negative tweet", "neutral": "a neutral tweet", "positive": "a positive tweet"},
}
FULL = dict(train_size=2000, max_seq_length=64, ft_steps=400, ft_batch=8, ft_lr=5e-2, test_size=500, dev_size=200,
            localize_k_shot=32, localize_batch=8, localize_steps=10, mask_steps=50, mask_batch=16,
            timing_repeats=15)  # fmt: skip
SMOKE = dict(train_size=24, max_seq_length=32, ft_steps=4, ft_batch=4, ft_lr=5e-2, test_size=24, dev_size=16,
             localize_k_shot=3, localize_batch=4, localize_steps=2, mask_steps=2, mask_batch=8,
             timing_repeats=2)  # fmt: skip
REGION_KINDS = ("ls", "disjoint", "learned")  # stitched: L&S regions, L&S outside earlier regions, MaskTrainer's


@dataclass
class MergeArguments:
    """What to fine-tune, localize and merge, and the grids."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The pre-trained sentence encoder (default: the packaged all-MiniLM-L6-v2)."}
    )
    tasks: list[str] = field(default_factory=lambda: list(TASKS), metadata={"help": f"Tasks, of {TASKS}."})
    logit_scale: float = field(default=20.0, metadata={"help": "Fixed scale of the frozen heads' cosine logits."})
    fraction: float = field(
        default=1e-2, metadata={"help": "Size of the MaskTrainer regions, a fraction of all parameters."}
    )
    cost_batches: list[int] = field(
        default_factory=lambda: [32, 256],
        metadata={"help": "Sizes of the mixed batches of test examples whose forward is timed against the base's."},
    )
    served_fractions: list[float] = field(
        default_factory=lambda: [0.001, 0.003],
        metadata={
            "help": "Sizes of further MaskTrainer regions per task, served in mixed batches only (accuracy "
            "against the forward's cost)."
        },
    )
    ls_sparsity: float = field(default=1e-5, metadata={"help": "L&S: start fraction (top of |tau|)."})
    ls_sigmoid_bias: float = field(default=5.0, metadata={"help": "L&S: |S| at the start."})
    ls_lr: float = field(default=1e7, metadata={"help": "L&S: step size on S."})
    ls_l1: float = field(default=10.0, metadata={"help": "L&S: strength of the sign-keeping term."})
    lambdas: list[float] = field(
        default_factory=lambda: [0.3, 0.5, 0.7, 1.0, 1.5], metadata={"help": "Grid of the global rules' scaling."}
    )
    densities: list[float] = field(
        default_factory=lambda: [0.1, 0.3, 0.6], metadata={"help": "Grid of TIES/DARE's density (fraction kept)."}
    )
    tall_lambdas: list[float] = field(
        default_factory=lambda: [0.2, 0.4, 0.6], metadata={"help": "Grid of Consensus's TALL-mask lambda."}
    )
    dataless_densities: list[float] = field(
        default_factory=lambda: [0.003, 0.01, 0.03, 0.1],
        metadata={"help": "Grid of stitch_dataless's density (each task's top of |tau|, of the moved entries)."},
    )
    consensus_k: int = field(default=2, metadata={"help": "Consensus: tasks whose TALL masks must hold an entry."})
    regmean_alphas: list[float] = field(
        default_factory=lambda: [0.5, 0.7, 0.9], metadata={"help": "Grid of RegMean's off-diagonal scale (<= 1)."}
    )
    regmean_examples: int = field(
        default=256, metadata={"help": "RegMean: unlabelled training inputs per task for its Gram matrices."}
    )
    lines_alphas: list[float] = field(
        default_factory=lambda: [0.5, 0.75, 1.0], metadata={"help": "Grid of LiNeS's alpha (the first block's scale)."}
    )
    lines_betas: list[float] = field(
        default_factory=lambda: [0.25, 0.5, 1.0], metadata={"help": "Grid of LiNeS's beta (added up to the last)."}
    )
    stitch_scales: list[float] = field(
        default_factory=lambda: [1.0, 1.5, 2.0], metadata={"help": "Grid of the scaled stitch's scale."}
    )
    max_widen: int = field(
        default=2, metadata={"help": "Times a grid axis is extended while its winner is on an edge."}
    )
    ft_steps: int | None = field(default=None, metadata={"help": "Fine-tuning steps (default: the preset's)."})
    train_size: int | None = field(default=None, metadata={"help": "Training examples per task (default: preset)."})
    threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (default: torch's)."})
    seed: int = field(default=42, metadata={"help": "Seed of the samples, training and DARE's drops."})
    smoke: bool = field(default=False, metadata={"help": "A few steps of everything."})
    work_dir: str = field(default="outputs/merge", metadata={"help": "Data, fine-tunes, grafts, cached scores."})
    report_dir: str = field(default="reports/merge", metadata={"help": "summary.md, results.json, figures."})


# ------------------------------------------------------------------------------------------ model and heads
class SentenceClassifier(nn.Module):
    """A sentence encoder with a frozen head: ``logits = scale * <normalize(mean_pool(body(x))), head_c>``.

    The head (one row per class) is a buffer, outside every graft; its loss covers only its own classes.
    """

    def __init__(self, body: nn.Module, num_labels: int, scale: float) -> None:
        super().__init__()
        self.body, self.config, self.scale = body, body.config, scale
        self.register_buffer("head", torch.zeros(num_labels, body.config.hidden_size), persistent=False)

    def embed(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9), dim=-1)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None) -> SequenceClassifierOutput:
        logits = self.scale * self.embed(input_ids, attention_mask, token_type_ids) @ self.head.T
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def pretrained(model_dir: str, scale: float) -> SentenceClassifier:
    """theta_pre: the encoder without a pooler (the sentence model mean-pools), embeddings frozen."""
    body = U.from_pretrained(AutoModel, model_dir, add_pooling_layer=False, dtype=torch.float32)
    model = SentenceClassifier(body, 1, scale)
    for param in body.embeddings.parameters():
        param.requires_grad_(False)
    return model.eval()


def task_head(pre: SentenceClassifier, tokenizer, descriptions: list[str]) -> torch.Tensor:
    """The normalised embeddings of the class descriptions under theta_pre, one row per class."""
    batch = tokenizer(descriptions, padding=True, return_tensors="pt")
    with torch.no_grad():
        return pre.embed(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")).clone()


def set_head(model: nn.Module, head: torch.Tensor) -> None:
    """Give ``model`` (a SentenceClassifier, plain or under peft) the task head ``head``."""
    classifier = model.get_base_model() if isinstance(model, PeftModel) else model
    classifier.head = head


# ------------------------------------------------------------------------------------------ data
def load_tasks(names: list[str], work: Path, settings: dict, seed: int, tokenizer) -> dict[str, Task]:
    """Per task: test and dev sets drawn like the data, up to ``train_size`` shuffled training examples from the rest,
    and the L&S localization set (``localize_k_shot`` per class of the training examples) as ``Task.localize``."""
    tasks = {}
    for name in names:
        if name not in DESCRIPTIONS:
            raise ValueError(f"Unknown task {name!r}: use one of {TASKS}.")
        paths = prepare_data(name, work / "data", settings["test_size"], settings["dev_size"], None)
        frames = {split: pd.read_csv(paths[split]) for split in ("train", "dev", "test")}
        labels = U.label_names_of(frames["train"])
        if labels != sorted(DESCRIPTIONS[name]):
            raise ValueError(
                f"Task {name!r}: classes {labels} in the data, descriptions for {sorted(DESCRIPTIONS[name])}."
            )
        frames = {split: U.encode_labels(frame, labels) for split, frame in frames.items()}
        frames["train"] = frames["train"].sample(frac=1.0, random_state=seed).iloc[: settings["train_size"]]
        k = min(settings["localize_k_shot"], int(frames["train"]["label"].value_counts().min()))
        frames["localize"] = U.k_shot(frames["train"], k, seed)
        setup = U.TaskSetup("classification", labels, max_seq_length=settings["max_seq_length"])
        data = {split: U.tokenize(frame, tokenizer, setup) for split, frame in frames.items()}
        task = Task(name, len(labels), data["train"], U.by_length(data["dev"]), U.by_length(data["test"]))
        task.labels, task.localize = labels, data["localize"]
        tasks[name] = task
        logger.info("%s: %d classes, %s examples", name, len(labels), {s: len(d) for s, d in data.items()})
    return tasks


# ------------------------------------------------------------------------------------------ per task, cached
class Stage:
    """A unit of work saved as it lands: ``<folder>/<name>.json`` holds its key and results once done."""

    def __init__(self, folder: Path, name: str, key: str) -> None:
        self.folder, self.marker, self.key = folder, folder / f"{name}.json", key

    def done(self) -> dict | None:
        if self.marker.is_file():
            record = json.loads(self.marker.read_text())
            if record.get("key") == self.key:
                return record["results"]
        return None

    def finish(self, results: dict) -> dict:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(self.marker, json.dumps({"key": self.key, "results": results}))
        return results


def atomic_write(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def prepare_task(run: Runner, args: MergeArguments, name: str, task: Task, pre, heads, exclude: Region) -> dict:
    """Fine-tune, graft and localize one task; each stage saved in ``work/tasks/<name>/`` and skipped when done."""
    folder, key = run.work / "tasks" / name, run_key(run, args)
    out = {}
    stage = Stage(folder, "finetune", key)
    out["finetune"] = stage.done()
    if out["finetune"] is None:
        start = time.perf_counter()
        model = copy.deepcopy(pre)
        set_head(model, heads[name])
        model.train()
        run.finetune(model, task.train, run.settings["ft_steps"])
        trained = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        folder.mkdir(parents=True, exist_ok=True)
        save_file(trained, str(folder / "finetuned.tmp"))
        os.replace(folder / "finetuned.tmp", folder / "finetuned.safetensors")
        get_peft_model(copy.deepcopy(pre), GraftConfig(finetuned=model.state_dict(), sparsity=1.0)).save_pretrained(
            folder / "full"
        )
        results = {"test": run.score(model, task), "dev": run.score(model, task, task.dev)}
        out["finetune"] = stage.finish({**results, "minutes": (time.perf_counter() - start) / 60})
        logger.info("%s fine-tuned: %s", name, out["finetune"])
    finetuned = {**pre.state_dict(), **load_file(str(folder / "finetuned.safetensors"))}
    for kind, region_exclude in (("ls", None), ("disjoint", exclude)):
        stage = Stage(folder, kind, key + (json.dumps(sorted_region(exclude)) if kind == "disjoint" else ""))
        out[kind] = stage.done()
        if out[kind] is None:
            out[kind] = stage.finish(
                localize(run, args, task, pre, heads[name], finetuned, region_exclude, folder / kind)
            )
            logger.info("%s %s region: %s", name, kind, out[kind])
    for kind, fraction in (("learned", args.fraction), *((sized(f), f) for f in args.served_fractions)):
        stage = Stage(folder, kind, key if kind == "learned" else f"{key} | fraction {fraction!r}")
        out[kind] = stage.done()
        if out[kind] is None:
            start = time.perf_counter()
            model = copy.deepcopy(pre)
            set_head(model, heads[name])
            num_entries = max(1, round(fraction * sum(p.numel() for p in pre.parameters())))
            graft = run.learn_region(model, finetuned, task, num_entries, empty_start=False, modules_to_save=())
            graft.save_pretrained(folder / kind)
            results = {"test": run.score(graft, task), "entries": graft.base_model.get_region("default").num_entries}
            out[kind] = stage.finish({**results, "minutes": (time.perf_counter() - start) / 60})
            logger.info("%s MaskTrainer region (%s): %s", name, kind, out[kind])
    return out


def sized(fraction: float) -> str:
    """The kind of a further MaskTrainer region of ``fraction`` (``--served_fractions``): ``learned_0p001`` (an adapter
    name holds no '.')."""
    return f"learned_{fraction:g}".replace(".", "p")


def size_of(kind: str) -> float:
    """The percentage of the parameters a :func:`sized` kind's regions hold."""
    return 100 * float(kind.removeprefix("learned_").replace("p", "."))


def served_kinds(args: MergeArguments) -> list[str]:
    """Every kind of task graft served in mixed batches: :data:`SERVED`, then each further MaskTrainer size."""
    return [*SERVED, *(sized(f) for f in args.served_fractions)]


def sorted_region(region: Region) -> dict:
    return {name: [int(indices.numel()), int(indices.sum())] for name, indices in sorted(region.items())}


def localize(run: Runner, args, task: Task, pre, head, finetuned: dict, exclude: Region | None, folder: Path) -> dict:
    """L&S's localization on the task's localization set, saved as a graft (the task's tau on the region)."""
    start = time.perf_counter()
    model = copy.deepcopy(pre)
    set_head(model, head)
    localizer = LocalizeStitch(model, finetuned, sparsity=args.ls_sparsity, sigmoid_bias=args.ls_sigmoid_bias,
                               learning_rate=args.ls_lr, l1_strength=args.ls_l1, exclude=exclude)  # fmt: skip
    size = run.settings["localize_batch"]
    data = task.localize
    batches = [
        run.collator(data.select(range(i, min(i + size, len(data)))).to_list()) for i in range(0, len(data), size)
    ]
    history = [list(step) for step in localizer.train(batches, run.settings["localize_steps"])]  # (loss, size)
    region = localizer.region()
    if not region.num_entries:
        raise ValueError(f"{task.name}: the L&S region is empty after {len(history)} steps; lower --ls_l1.")
    graft = get_peft_model(model, GraftConfig(finetuned=finetuned, region="given", given_region=region))
    graft.save_pretrained(folder)
    return {"test": run.score(graft, task), "entries": region.num_entries, "history": history,
            "minutes": (time.perf_counter() - start) / 60}  # fmt: skip


def run_key(run: Runner, args: MergeArguments, merging: bool = False) -> str:
    """What a task's cached stages depend on; with ``merging``, also what the cached merge scores depend on (the
    tasks merged, the grids, Consensus's k): a rerun with other values scores afresh."""
    fields = ("logit_scale", "fraction", "ls_sparsity", "ls_sigmoid_bias", "ls_lr", "ls_l1", "model_name_or_path")
    if merging:
        fields += (
            "tasks",
            "lambdas",
            "densities",
            "tall_lambdas",
            "dataless_densities",
            "consensus_k",
            "max_widen",
            "regmean_alphas",
            "regmean_examples",
            "lines_alphas",
            "lines_betas",
            "stitch_scales",
        )
    return json.dumps({**run.settings, "seed": run.seed, **{f: getattr(args, f) for f in fields}}, sort_keys=True)


# ------------------------------------------------------------------------------------------ merging
class Evaluator:
    """Scores merged bodies with each task's head, caching every result in ``work/merge_scores.json`` as it lands."""

    def __init__(self, run: Runner, tasks: dict[str, Task], model: PeftModel, heads: dict, key: str) -> None:
        self.run, self.tasks, self.model, self.heads, self.key = run, tasks, model, heads, key
        self.path = run.work / "merge_scores.json"
        cached = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.cache = cached.get("scores", {}) if cached.get("key") == key else {}

    def __call__(self, label: str, split: str, build) -> dict:
        """``build()`` adds the merged adapter and returns its MergedGraft; scored on ``split`` ("dev"/"test")."""
        cache_key = f"{label} | {split}"
        if cache_key not in self.cache:
            start = time.perf_counter()
            merged = build()
            seconds = time.perf_counter() - start
            self.model.set_adapter(merged.adapter_name)  # merge_grafts adds the adapter; it scores only when active
            scores = {"entries": merged.num_entries, "bytes": merged.nbytes["total"], "merge_seconds": seconds}
            for name in merged.tasks:
                scores[name] = self.score(name, split)
            self.model.delete_adapter(merged.adapter_name)
            self.store(cache_key, scores)
            logger.info("%s on %s: %s", label, split, short(scores))
        return self.cache[cache_key]

    def score(self, name: str, split: str) -> dict:
        """The active adapter(s) with task ``name``'s head: accuracy, ECE and the predicted-class counts."""
        task = self.tasks[name]
        data = task.dev if split == "dev" else task.test
        set_head(self.model, self.heads[name])
        logits = self.run.logits(self.model, data, task)
        report = calibration_report(logits, np.asarray(data["labels"]), input_type="logits",
                                    metrics=["accuracy", "ece"])  # fmt: skip
        predicted = np.bincount(logits.argmax(-1), minlength=task.num_labels).tolist()
        return {"accuracy": 100 * report["accuracy"], "ece": 100 * report["ece"], "predicted": predicted}

    def store(self, cache_key: str, scores: dict) -> None:
        self.cache[cache_key] = scores
        atomic_write(self.path, json.dumps({"key": self.key, "scores": self.cache}))


def short(scores: dict) -> dict:
    return {k: (round(v["accuracy"], 1) if isinstance(v, dict) else v) for k, v in scores.items()}


def label_of(rule: str, options: dict) -> str:
    shown = {k: v for k, v in options.items() if k not in ("seed", "consensus_k", "kind")}
    kind = f" ({options['kind']})" if "kind" in options else ""
    return rule + kind + "".join(f" {k}={v:g}" for k, v in shown.items())


def mean_accuracy(scores: dict, names) -> float:
    return sum(scores[name]["accuracy"] for name in names) / len(names)


def extend(values: list[float], best: float, upper: float | None) -> list[float] | None:
    """One more value beyond ``best`` when it is the grid's smallest or largest (and the axis can move there)."""
    values = sorted(values)
    if best == values[-1] and (upper is None or best < upper):
        new = best * 1.5 if upper is None else min(upper, best * 2)
        return [*values, round(new, 4)]
    if best == values[0] and len(values) > 1:
        return [round(best / 2, 4), *values]
    return None


def tune(evaluate, build, rule: str, axes: dict[str, list[float]], fixed: dict, names, max_widen: int) -> dict:
    """The best setting of ``rule`` on dev over ``axes`` (name -> values), each axis widened up to ``max_widen`` times
    while the winner is on its edge; returns the winner, its label, the axes tried and the edges it still lies on."""
    uppers = {"weights": None, "density": 1.0, "tall_lambda": 1.0,  # above 1 two TALL masks rarely agree on an entry
              "regmean_alpha": 1.0, "lines_alpha": None, "lines_beta": None, "scale": None}  # fmt: skip
    axes = {axis: sorted(values) for axis, values in axes.items()}
    widened, tried = dict.fromkeys(axes, 0), []
    while True:
        settings = [dict(zip(axes, combo, strict=True)) for combo in _product(list(axes.values()))]
        scored = []
        for setting in settings:
            options = {**fixed, **setting}
            label = label_of(rule, options)
            scored.append((mean_accuracy(evaluate(label, "dev", build(rule, **options)), names), label, setting))
        tried += [label for _, label, _ in scored if label not in tried]
        best_accuracy, best_label, best = max(scored, key=lambda item: item[0])
        grown = False
        for axis, values in axes.items():
            more = extend(values, best[axis], uppers[axis]) if widened[axis] < max_widen else None
            if more is not None:
                axes[axis], widened[axis], grown = more, widened[axis] + 1, True
        if not grown:
            edges = [a for a, v in axes.items() if len(v) > 1 and best[a] in (min(v), max(v))]
            return {"rule": rule, "options": {**fixed, **best}, "label": best_label, "dev": best_accuracy,
                    "axes": axes, "edges": edges, "tried": tried}  # fmt: skip


def _product(lists: list[list[float]]) -> list[tuple]:
    out = [()]
    for values in lists:
        out = [(*combo, value) for combo in out for value in values]
    return out


def load_grafts(pre, work: Path, names: list[str], kinds: list[str]) -> PeftModel:
    """Every task's grafts in one model: adapters ``<task>_<kind>`` for each kind."""
    model = None
    for name in names:
        for kind in kinds:
            folder = str(work / "tasks" / name / kind)
            if model is None:
                model = PeftModel.from_pretrained(copy.deepcopy(pre), folder, adapter_name=f"{name}_{kind}")
            else:
                model.load_adapter(folder, f"{name}_{kind}")
    return model.eval()


def merge_all(args: MergeArguments, run: Runner, tasks: dict[str, Task], pre, heads, key: str) -> dict:
    names = list(tasks)
    kinds = list(dict.fromkeys(("full", *REGION_KINDS, *served_kinds(args))))
    model = load_grafts(pre, run.work, names, kinds)
    evaluate = Evaluator(run, tasks, model, heads, key)
    sources = {kind: {n: f"{n}_{kind}" for n in names} for kind in kinds}
    stacks = Stacks(model, sources)
    grams = functools.cache(lambda: regmean_grams(run, args, tasks, model, heads, sources["full"]))

    def build(rule: str, kind: str = "full", **options):
        """A merge of ``kind``'s grafts by ``rule``, run when called (scores are cached: most merges never run)."""
        if "lines_alpha" in options:
            options["lines"] = (options.pop("lines_alpha"), options.pop("lines_beta"))

        def merge() -> MergedGraft:
            extra = {"grams": grams()} if rule == "regmean" else {}  # the Gram matrices cost forwards: only if needed
            return merge_grafts(model, sources[kind], rule, stack=stacks(kind), **options, **extra)

        return merge

    full = functools.partial(build, kind="full")
    seed = {"seed": args.seed}
    lambdas, densities, w = list(args.lambdas), list(args.densities), args.max_widen
    tuned = {
        "stitch_dataless": tune(evaluate, full, "stitch_dataless", {"density": args.dataless_densities}, {}, names, w),
        "task_arithmetic": tune(evaluate, full, "task_arithmetic", {"weights": lambdas}, {}, names, w),
        "ties": tune(evaluate, full, "ties", {"weights": lambdas, "density": densities}, {}, names, w),
        "dare_ties": tune(evaluate, full, "dare_ties", {"weights": lambdas, "density": densities}, seed, names, w),
        "dare_linear": tune(evaluate, full, "dare_linear", {"weights": lambdas, "density": densities}, seed, names, w),
    }
    consensus = {"consensus_k": args.consensus_k}
    tuned["consensus_ta"] = tune(evaluate, full, "consensus_ta", {"weights": lambdas, "tall_lambda": args.tall_lambdas},
                                 consensus, names, w)  # fmt: skip
    ties_density = {"density": tuned["ties"]["options"]["density"], **consensus}  # TIES's own trim, then the grid
    grid = {"weights": lambdas, "tall_lambda": args.tall_lambdas}
    tuned["consensus_ties"] = tune(evaluate, full, "consensus_ties", grid, ties_density, names, w)
    tuned["wudi"] = tune(evaluate, full, "wudi", {}, {}, names, w)  # data-free, no setting
    tuned["wudi_adam"] = tune(evaluate, full, "wudi_adam", {}, {}, names, w)  # the reference's 400 Adam steps
    tuned["regmean"] = tune(evaluate, full, "regmean", {"regmean_alpha": args.regmean_alphas}, {}, names, w)
    lines = {"lines_alpha": args.lines_alphas, "lines_beta": args.lines_betas}
    for rule in ("task_arithmetic", "ties", "consensus_ta", "consensus_ties"):  # LiNeS on each rule's chosen setting
        tuned[f"{rule}_lines"] = tune(evaluate, full, rule, lines, tuned[rule]["options"], names, w)
    for kind in ("ls", "learned"):
        tuned[f"stitch_scaled_{kind}"] = tune(evaluate, build, "stitch", {"scale": args.stitch_scales}, {"kind": kind},
                                              names, w)  # fmt: skip
    test = {}
    for kind in REGION_KINDS:
        test[f"stitch_{kind}"] = {
            "label": f"stitch ({kind})",
            **evaluate(f"stitch {kind}", "test", build("stitch", kind)),
        }
    for name, chosen in tuned.items():
        rule = chosen["rule"]
        test[name] = {"label": chosen["label"], **evaluate(chosen["label"], "test", build(rule, **chosen["options"]))}
    best = max(tuned, key=lambda name: tuned[name]["dev"])  # the best merge on dev, for the serving comparison
    best_build = build(tuned[best]["rule"], **tuned[best]["options"])
    norms = evaluate.cache.get("task vector norms")
    if norms is None:
        norms = task_vector_norms(model, stack=stacks("full"))
        evaluate.store("task vector norms", norms)
    return {
        "tuned": tuned,
        "grid_dev": {k.removesuffix(" | dev"): v for k, v in evaluate.cache.items() if k.endswith(" | dev")},
        "test": test,
        "norms": norms,
        "num_params": sum(p.numel() for p in pre.parameters()),
        "moved_entries": union(model, sources["full"].values()).num_entries,
        "regions": region_view(model, sources, names),
        "interference": interference(evaluate, model, sources["ls"], names),
        "serving": serving(run, args, tasks, model, heads, evaluate, sources, best_build, best),
    }


class Stacks:
    """Each kind's task vectors stacked once (:class:`TaskVectorStack`) for all its merges; built when first asked for,
    and again only if its grafts changed since (the merge would refuse a stale stack)."""

    def __init__(self, model: PeftModel, sources: dict[str, dict[str, str]]) -> None:
        self.model, self.sources, self.built = model, sources, {}

    def __call__(self, kind: str) -> TaskVectorStack:
        stack = self.built.get(kind)
        if stack is not None:
            try:
                stack.check(self.model, self.sources[kind], None)
            except ValueError:
                stack = None
        if stack is None:
            stack = self.built[kind] = TaskVectorStack(self.model, self.sources[kind])
        return stack


def regmean_grams(run: Runner, args, tasks: dict[str, Task], model: PeftModel, heads, adapters: dict) -> dict:
    """Per task: the Gram matrices of each linear layer's inputs under the task's full graft (its fine-tune), over the
    first ``--regmean_examples`` of its training inputs (labels unused)."""
    out = {}
    for name, task in tasks.items():
        model.set_adapter(adapters[name])
        set_head(model, heads[name])
        data = task.train.select(range(min(args.regmean_examples, len(task.train))))
        batches = []
        for start in range(0, len(data), 32):
            batch = run.collator(data.select(range(start, min(start + 32, len(data)))).to_list())
            batch.pop("labels", None)
            batches.append(batch)
        out[name] = input_grams(model, batches, max_examples=args.regmean_examples)
    return out


def union(model: PeftModel, adapters) -> Region:
    out = Region()
    for adapter in adapters:
        out = out | model.base_model.get_region(adapter)
    return out


def region_view(model: PeftModel, sources: dict, names: list[str]) -> dict:
    """Per region kind: sizes, pairwise overlap |g_i & g_j| / |g_j|, entries in two regions or more, and where those
    lie (by tensor kind, layer numbers dropped)."""
    out = {}
    for kind in REGION_KINDS:
        regions = {n: model.base_model.get_region(sources[kind][n]) for n in names}
        shared = Region()
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                shared = shared | (regions[first] & regions[second])
        by_tensor = {}
        for tensor, indices in shared.items():
            kind_of_tensor = re.sub(r"\.\d+\.", ".N.", tensor)
            by_tensor[kind_of_tensor] = by_tensor.get(kind_of_tensor, 0) + len(indices)
        out[kind] = {"entries": {n: r.num_entries for n, r in regions.items()}, "overlap_matrix":
                     overlap_matrix(regions).tolist(), "shared_entries": shared.num_entries,
                     "shared_by_tensor": dict(sorted(by_tensor.items(), key=lambda kv: -kv[1]))}  # fmt: skip
    return out


def interference(evaluate: Evaluator, model: PeftModel, ls: dict[str, str], names: list[str]) -> dict:
    """Test accuracy of each task's own L&S graft and of the stitched L&S model, with and without the entries two
    regions or more share."""
    overlap = Region()
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            overlap = overlap | (model.base_model.get_region(ls[first]) & model.base_model.get_region(ls[second]))
    out = {"overlap_entries": overlap.num_entries}
    for row in ("own graft", "own graft without overlap", "stitched", "stitched without overlap"):
        exclude = overlap if "without" in row else None
        if exclude is not None and not overlap.num_entries:
            continue  # nothing to drop: the same as the row above
        out[row] = {}
        for name in names:
            sources = {name: ls[name]} if row.startswith("own") else ls
            label = f"interference: {row}" + (f" ({name})" if row.startswith("own") else "")
            scores = evaluate(label, "test", functools.partial(merge_grafts, model, sources, "stitch", exclude=exclude))
            out[row][name] = scores[name]
    return out


# ------------------------------------------------------------------------------------------ serving
SERVED = ("full", "ls", "learned")  # each task's exact graft, its L&S graft, its MaskTrainer 1% graft
MODES = ("exact", "sparse_delta")  # model.set_mixed_batch_mode


def serving(run: Runner, args, tasks: dict[str, Task], model: PeftModel, heads, evaluate, sources, build_best, best):
    """Each kind of task graft served in mixed batches (one graft per example, its head's logits only): accuracy, ECE,
    storage; and the forward cost of a mixed batch of each kind in each mixed-batch mode and of the best merged model,
    at each of ``--cost_batches`` sizes, each a median of paired ratios against the base model's forward on the same
    batch, in one process (:func:`forward_cost`)."""
    names, kinds = list(tasks), served_kinds(args)
    out = {}
    for kind in kinds:
        cached = evaluate.cache.get(f"served {kind} | test")
        if cached is None:
            cached = serve_mixed(run, tasks, model, heads, {n: sources[kind][n] for n in names})
            cached["entries"] = sum(model.base_model.get_region(a).num_entries for a in sources[kind].values())
            cached["bytes"] = sum(MergedGraft(model, a, "served", {}).nbytes["body"] for a in sources[kind].values())
            evaluate.store(f"served {kind} | test", cached)
        out[kind] = cached
    cached = evaluate.cache.get("forward cost")
    sizes = [str(size) for size in args.cost_batches]
    if cached is None or any(
        size not in cached or f"{kind} exact" not in cached[size] for size in sizes for kind in kinds
    ):  # every size and kind timed in one process
        merged = build_best()
        try:
            cached = {size: forward_cost(run, tasks, model, heads, sources, kinds, merged.adapter_name,
                                         run.settings["timing_repeats"], int(size)) for size in sizes}  # fmt: skip
        finally:
            model.set_mixed_batch_mode("exact")
            model.delete_adapter(merged.adapter_name)
        cached["merged_rule"] = best
        evaluate.store("forward cost", cached)
    out["forward_cost"] = {"merged_rule": cached["merged_rule"], **{size: cached[size] for size in sizes}}
    return out


def mixed_order(tasks: dict[str, Task]) -> list[tuple[str, int]]:
    """Every test example of every task, the tasks interleaved (round robin)."""
    longest = max(len(task.test) for task in tasks.values())
    return [(n, i) for i in range(longest) for n, task in tasks.items() if i < len(task.test)]


def mixed_batches(run: Runner, tasks, order, adapters: dict[str, str], size: int = 32):
    for start in range(0, len(order), size):
        part = order[start : start + size]
        batch = run.collator([tasks[n].test[i] for n, i in part])
        batch.pop("labels")
        yield part, batch, [adapters[n] for n, _ in part]


def serve_mixed(run: Runner, tasks: dict[str, Task], model: PeftModel, heads, adapters: dict[str, str]) -> dict:
    names = list(tasks)
    slices, offset = {}, 0
    for name in names:
        slices[name] = slice(offset, offset + tasks[name].num_labels)
        offset += tasks[name].num_labels
    set_head(model, torch.cat([heads[n] for n in names]))  # every task's head side by side; each row reads its own
    logits = {n: [None] * len(tasks[n].test) for n in names}
    model.eval()
    model.set_mixed_batch_mode("exact")  # the served rows: each example's graft layers bit for bit its graft alone
    with torch.no_grad():
        for part, batch, adapter_names in mixed_batches(run, tasks, mixed_order(tasks), adapters):
            out = model(**batch, adapter_names=adapter_names).logits
            for row, (name, i) in enumerate(part):
                logits[name][i] = out[row, slices[name]].numpy()
    scores = {}
    for name in names:
        values, labels = np.stack(logits[name]), np.asarray(tasks[name].test["labels"])
        report = calibration_report(values, labels, input_type="logits", metrics=["accuracy", "ece"])
        predicted = np.bincount(values.argmax(-1), minlength=tasks[name].num_labels).tolist()
        scores[name] = {"accuracy": 100 * report["accuracy"], "ece": 100 * report["ece"], "predicted": predicted}
    return scores


def forward_cost(run: Runner, tasks, model: PeftModel, heads, sources: dict, kinds, merged: str, repeats: int,
                 size: int) -> dict:  # fmt: skip
    """Median (and quartiles) over ``repeats`` rounds of time(x) / time(base) on the first mixed batch of ``size`` test
    examples, each x timed right after a base forward: each of ``kinds``' grafts served mixed (``adapter_names``) in
    each of :data:`MODES`, and the adapter ``merged`` (the best merged body) active, unmerged."""
    order = mixed_order(tasks)
    _, batch, _ = next(mixed_batches(run, tasks, order, sources["full"], size))
    adapters = {kind: next(mixed_batches(run, tasks, order, sources[kind], size))[2] for kind in kinds}
    set_head(model, torch.cat([heads[n] for n in tasks]))
    variants = [f"{kind} {mode}" for kind in kinds for mode in MODES] + ["merged"]
    timings = {name: [] for name in ("base", *variants)}

    def timed(name: str) -> None:
        if name == "merged":
            model.set_adapter(merged)
        elif name != "base":
            model.set_mixed_batch_mode(name.split(" ")[1])
        start = time.perf_counter()
        if name == "base":
            with model.disable_adapter():
                model(**batch)
        elif name == "merged":
            model(**batch)
        else:
            model(**batch, adapter_names=adapters[name.split(" ")[0]])
        timings[name].append(time.perf_counter() - start)

    with torch.no_grad():
        timed("base")  # a warm-up; each block below warms up its own variants
        timings["base"].clear()
        base = {}  # per variant: the base forwards timed right before it
        # kind after kind, its modes alternating: the "sparse_delta" mode keeps a layer's joined grafts while batches
        # bring the same ones, as a server's do; interleaving the kinds would time their joins instead
        for block in [[f"{kind} {mode}" for mode in MODES] for kind in kinds] + [["merged"]]:
            for name in block:
                timed(name)  # a warm-up for the block's grafts
            for _ in range(repeats):
                for name in block:
                    timed("base")
                    base.setdefault(name, []).append(timings["base"][-1])
                    timed(name)
    out = {"batch": len(adapters["full"]), "tokens": batch["input_ids"].shape[1],
           "base_ms": 1e3 * statistics.median(timings["base"]), "load": list(os.getloadavg())}  # fmt: skip
    for name in variants:
        ratios = [t / b for t, b in zip(timings[name][1:], base[name], strict=True)]
        out[name] = {"median": statistics.median(ratios), "quartiles": np.quantile(ratios, [0.25, 0.75]).tolist()}
    return out


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(MergeArguments).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])  # fmt: skip
    start = time.perf_counter()
    ensure_assets({**ASSETS, **TWEETS_ASSETS})
    settings = dict(SMOKE if args.smoke else FULL)
    for name in ("ft_steps", "train_size"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, report_dir = Path(args.work_dir), Path(args.report_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_name_or_path or minilm_dir()
    tokenizer = U.load_tokenizer(model_dir, "classification")
    tasks = load_tasks(args.tasks, work, settings, args.seed, tokenizer)
    run = Runner(model_dir, tokenizer, settings, work, args.seed)
    torch.manual_seed(args.seed)
    pre = pretrained(model_dir, args.logit_scale)
    heads = {n: task_head(pre, tokenizer, [DESCRIPTIONS[n][c] for c in task.labels]) for n, task in tasks.items()}
    results = {"settings": settings, "args": {k: v for k, v in vars(args).items()}, "individual": {}, "zero_shot": {}}
    for name, task in tasks.items():  # theta_pre with each task's frozen head
        set_head(pre, heads[name])
        results["zero_shot"][name] = run.score(pre, task)
    exclude = Region()  # the earlier tasks' disjoint regions
    for name, task in tasks.items():
        results["individual"][name] = prepare_task(run, args, name, task, pre, heads, exclude)
        exclude = exclude | Region.from_pretrained(work / "tasks" / name / "disjoint", pre)
    results["minutes_prepare"] = (time.perf_counter() - start) / 60
    results["merge"] = merge_all(args, run, tasks, pre, heads, run_key(run, args, merging=True))
    results["minutes"] = (time.perf_counter() - start) / 60
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = summary_markdown(results, list(tasks))
    atomic_write(report_dir / "summary.md", summary)
    atomic_write(report_dir / "results.json", json.dumps(results, indent=2))
    save_figures(results, report_dir)
    print(summary)
    return results


PRETTY = {
    "stitch_ls": "stitch, L&S regions",
    "stitch_disjoint": "stitch, disjoint L&S regions",
    "stitch_learned": "stitch, MaskTrainer regions",
    "stitch_dataless": "stitch_dataless (top-k |tau|)",
    "task_arithmetic": "task arithmetic",
    "ties": "TIES",
    "dare_ties": "DARE-TIES",
    "dare_linear": "DARE-linear",
    "consensus_ta": "Consensus TA",
    "consensus_ties": "Consensus TIES",
    "wudi": "WUDI (closed form)",
    "wudi_adam": "WUDI (reference's 400 Adam steps)",
    "regmean": "RegMean",
    "task_arithmetic_lines": "task arithmetic + LiNeS",
    "ties_lines": "TIES + LiNeS",
    "consensus_ta_lines": "Consensus TA + LiNeS",
    "consensus_ties_lines": "Consensus TIES + LiNeS",
    "stitch_scaled_ls": "stitch with a scale, L&S regions",
    "stitch_scaled_learned": "stitch with a scale, MaskTrainer regions",
}


SERVED_TITLES = {
    "full": "served: each task's full graft, mixed batches",
    "ls": "served: each task's L&S graft, mixed batches",
    "learned": "served: each task's MaskTrainer graft, mixed batches",
}


def served_titles(serving: dict) -> dict[str, str]:
    """The report's title of each kind served in ``serving`` (a run's results), in their order."""
    titles = {}
    for kind in serving:
        if kind in SERVED_TITLES:
            titles[kind] = SERVED_TITLES[kind]
        elif kind.startswith("learned_"):
            titles[kind] = (
                f"served: each task's MaskTrainer graft of {size_of(kind):g}% of the parameters, mixed batches"
            )
    return titles


def seconds(row: dict) -> str:
    return f"{row['merge_seconds']:.1f}" if "merge_seconds" in row else "-"


def ratio(cost: dict) -> str:
    return f"{cost['median']:.3f}x ({cost['quartiles'][0]:.3f}-{cost['quartiles'][1]:.3f})"


def normalized_accuracy(row: dict, individual: dict, names: list[str]) -> float:
    return sum(row[n]["accuracy"] / individual[n]["finetune"]["test"]["accuracy"] for n in names) / len(names)


def cells(row: dict, names: list[str]) -> str:
    return " | ".join(f"{row[n]['accuracy']:.1f} / {row[n]['ece']:.1f}" for n in names)


def summary_markdown(results: dict, names: list[str]) -> str:
    merge, individual = results["merge"], results["individual"]
    params = merge["num_params"]
    lines = [
        "## Test accuracy % / ECE % per task (each task's frozen head)",
        "",
        "| model | setting (dev-chosen) | " + " | ".join(names) + " | avg normalized acc | entries changed (% of "
        "params) | storage | merge s |",
        "|---" * (len(names) + 6) + "|",
    ]
    fine_tunes = {n: individual[n]["finetune"]["test"] for n in names}
    moved = merge["moved_entries"]
    lines.append(f"| pre-trained body (zero-shot heads) | - | {cells(results['zero_shot'], names)} | "
                 f"{normalized_accuracy(results['zero_shot'], individual, names):.3f} | 0 | - | - |")  # fmt: skip
    lines.append(f"| individual fine-tunes ({len(names)} models) | - | {cells(fine_tunes, names)} | 1.000 | "
                 f"{moved:,} in all ({100 * moved / params:.1f}%) | {len(names)} models | - |")  # fmt: skip
    titles = served_titles(merge["serving"])
    for kind, title in titles.items():
        row = merge["serving"][kind]
        lines.append(f"| {title} | - | {cells(row, names)} | {normalized_accuracy(row, individual, names):.3f} | "
                     f"{row['entries']:,} in all ({100 * row['entries'] / params:.2f}%) | "
                     f"{row['bytes'] / 2**20:.1f} MiB | - |")  # fmt: skip
    for rule, row in merge["test"].items():
        chosen = merge["tuned"].get(rule)
        setting = re.sub(r"^\(\w+\) ?", "", row["label"].removeprefix(chosen["rule"]).strip()) if chosen else "-"
        edge = merge["tuned"].get(rule, {}).get("edges")
        setting += f" (at the grid's edge: {', '.join(edge)})" if edge else ""
        lines.append(f"| {PRETTY[rule]} | {setting or '-'} | {cells(row, names)} | "
                     f"{normalized_accuracy(row, individual, names):.3f} | {row['entries']:,} "
                     f"({100 * row['entries'] / params:.2f}%) | {row['bytes'] / 2**20:.1f} MiB | "
                     f"{seconds(row)} |")  # fmt: skip
    costs = merge["serving"]["forward_cost"]
    sizes = [costs[size] for size in costs if size != "merged_rule"]
    shapes = [f"{c['batch']} x {c['tokens']}" for c in sizes]
    lines += [
        "",
        "Forward cost of the first mixed batch of test examples against the base model's forward on it (median of "
        "paired ratios, quartiles), per batch (examples x tokens; base "
        + ", ".join(f"{c['base_ms']:.1f} ms at load {c['load'][0]:.1f}" for c in sizes)
        + "):",
        "",
        "| forward | " + " | ".join(f"exact, {s} | sparse_delta, {s}" for s in shapes) + " |",
        "|---" * (1 + 2 * len(sizes)) + "|",
    ]
    for kind, title in titles.items():
        lines.append(f"| {title.removeprefix('served: ')} | "
                     + " | ".join(f"{ratio(c[f'{kind} exact'])} | {ratio(c[f'{kind} sparse_delta'])}" for c in sizes)
                     + " |")  # fmt: skip
    lines += [
        f"| the best merged body on dev ({costs['merged_rule']}, unmerged) | "
        + " | ".join(f"{ratio(c['merged'])} | -" for c in sizes)
        + " |",
        "",
        "## Task-vector norms (L2) per task and layer type",
        "",
        "WUDI weighs each task by 1 / ||tau_t||^2 per matrix: norms that differ much between tasks are its known "
        "failure.",
        "",
    ]
    kinds = [k for k in merge["norms"][names[0]] if k != "total"]
    lines += ["| layer type | " + " | ".join(names) + " | max / min |", "|---" * (len(names) + 2) + "|"]
    for kind in ["total", *kinds]:
        values = [merge["norms"][n][kind] for n in names]
        spread = max(values) / min(values) if min(values) > 0 else float("inf")
        lines.append(f"| {kind} | " + " | ".join(f"{v:.4g}" for v in values) + f" | {spread:.2f} |")
    extra = [k for k in individual[names[0]] if k.startswith("learned_")]  # --served_fractions' regions
    lines += [
        "",
        "## Per task: the fine-tune and its regions (test accuracy %)",
        "",
        "| task | fine-tune | L&S region (entries) | disjoint L&S region (entries) | MaskTrainer region (entries) | "
        + "".join(f"MaskTrainer, {size_of(k):g}% (entries) | " for k in extra),
        "|---" * (5 + len(extra)) + "|",
    ]
    for n in names:
        one = individual[n]
        lines.append(f"| {n} | {one['finetune']['test']['accuracy']:.1f} | "
                     + " | ".join(f"{one[k]['test']['accuracy']:.1f} ({one[k]['entries']:,})"
                                  for k in (*REGION_KINDS, *extra))
                     + " |")  # fmt: skip
    lines += ["", "## Regions: overlap |g_i & g_j| / |g_j| and where the shared entries lie", ""]
    for kind, view in merge["regions"].items():
        lines.append(f"**{kind}**: {view['shared_entries']:,} entries lie in two regions or more; top tensors: "
                     + ", ".join(f"{t} {c:,}" for t, c in list(view["shared_by_tensor"].items())[:4]))  # fmt: skip
        lines += ["", "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {n} | " + " | ".join(f"{v:.3f}" for v in row) + " |"
                  for n, row in zip(names, view["overlap_matrix"], strict=True)]  # fmt: skip
        lines.append("")
    view = merge["interference"]
    lines += ["## Interference of the stitched L&S regions (test accuracy %)", "",
              "| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for row, scores in view.items():
        if isinstance(scores, dict):
            lines.append(f"| {row} | " + " | ".join(f"{scores[n]['accuracy']:.1f}" for n in names) + " |")
    lines += ["", "## Predicted classes on test (counts per class, in class order)", "",
              "| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for rule, row in merge["test"].items():
        lines.append(f"| {PRETTY[rule]} | " + " | ".join(str(row[n]["predicted"]) for n in names) + " |")
    lines += ["", "## Dev grid (mean dev accuracy %)", "", "| setting | mean | " + " | ".join(names) + " |",
              "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for label, scores in merge["grid_dev"].items():
        per_task = " | ".join(f"{scores[n]['accuracy']:.1f}" for n in names)
        lines.append(f"| {label} | {mean_accuracy(scores, names):.1f} | {per_task} |")
    lines.append("")
    return "\n".join(lines)


def save_figures(results: dict, report_dir: Path) -> None:
    """Normalized accuracy against entries changed (one point per row), and the regions' overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from peft_graft.calibration.plots import _new_figure

    merge, names = results["merge"], list(results["individual"])
    figure = _new_figure((680, 440), 100)
    ax = figure.add_subplot()
    markers = itertools.cycle("oPsD^vX*<>ph")
    rows = {**{PRETTY[r]: row for r, row in merge["test"].items()},
            **{title.replace("each task's ", "").removesuffix(", mixed batches"): merge["serving"][kind]
               for kind, title in served_titles(merge["serving"]).items()}}  # fmt: skip
    for title, row in rows.items():
        x = max(100 * row["entries"] / merge["num_params"], 1e-4)
        y = normalized_accuracy(row, results["individual"], names)
        ax.scatter([x], [y], s=45, marker=next(markers), label=title.split(" (")[0], alpha=0.85)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize="x-small", loc="best")
    ax.set_xlabel("parameters changed (% of all, log scale)")
    ax.set_ylabel("average normalized accuracy (/ fine-tuned)")
    ax.set_title("Merging " + ", ".join(names) + " fine-tunes of MiniLM", fontsize="medium")
    ax.grid(alpha=0.3)
    save_figure(figure, report_dir / "merge_accuracy_vs_size.png")
    for kind, view in merge["regions"].items():
        figure = plot_region_matrix(view["overlap_matrix"], names, names, f"Overlap of the {kind} regions")
        save_figure(figure, report_dir / f"merge_overlap_{kind}.png")


if __name__ == "__main__":
    main()
