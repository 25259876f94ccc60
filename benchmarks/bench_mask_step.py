"""Cost of one MaskTrainer step against one plain SGD fine-tuning step on the same model and batch.

    python benchmarks/bench_mask_step.py --model roberta-base-random   # 125M random classifier, batch 4 x 32
    python benchmarks/bench_mask_step.py --model all-MiniLM-L6-v2      # batch 32 x 64
    python benchmarks/bench_mask_step.py --model llama-1b-random --search 0.01 --repeats 3   # 1.24B causal LM, 2 x 64
    python benchmarks/bench_mask_step.py --model llama-1b-random --device cuda --dtype bfloat16 --search none 0.01

Timing (``--timing``): ``lockstep`` (the default for the two encoder models) builds plain SGD and every mask variant
each in its own process (one after the other) and, after a warm-up each, times ``--repeats`` pairs per variant: a plain
step and a variant step back to back, in turn first (plain first in even pairs), each process stepping when this one
tells it to. It prints the median step of each, and per variant the median and quartiles of the paired ratios (each
variant step over the plain step beside it), which a drifting or loaded host moves far less than a ratio of medians.
``alternate`` times the same pairs with every trainer in this process: there the trainers share glibc's heap, so which
step takes page faults for fresh memory depends on what the other trainers allocated and gave back (BENCHMARKS.md, "Page
faults" and "Lockstep processes"); in lockstep each trainer has the heap it would have alone. Each timed step's minor
page faults are counted and printed per variant, paired and in the memory processes. ``--clock cpu`` times the CPU time
of the main thread instead of the wall clock: with ``--threads 1`` the step runs on it, and other processes on the host
stop counting (they still share the caches). ``isolated`` (the default for the Llama models, which do not fit twice in
memory) runs each variant alone in its own process, one after the other: build, one warm-up step, then ``--repeats``
timed steps. The memory of each variant is measured in its own process: peak RSS of its steps (VmHWM reset through
``/proc/self/clear_refs`` once the trainer is built and ``malloc_trim`` has returned what creating it freed), the RSS
after loading the pre-trained model, and the peak while creating the trainer (``get_peft_model``; VmHWM reset after
loading). With ``--device cuda`` the memory is ``torch.cuda.max_memory_allocated`` (reset the same way) and the steps
are timed between ``torch.cuda.synchronize()`` calls.

``--search none 0.01 reference`` (the default; ``none 0.01`` for the Llama models) times the paper's dense S
(``none``), ``GraftConfig(search_fraction=0.01)`` (S on the top 1% movement entries plus gamma_base; an int is
``search_entries``) and ``reference``, the mask-training step of the paper's official code rewritten here
(:class:`ReferenceGraft`: three whole models, dense S, gamma_base and theta_ft - theta_pre in the weights' dtype,
gradient copies, parameters found by name in Python loops; its top-k gamma_base by numpy sort is set up once,
untimed), printed beside the mask variants as their step and peak over its own. All use the same batch and one
micro-batch per step (``mask_batch_size=None``, no gradient accumulation), ``sparsity=1e-4``. Suffixes change one
choice each, to measure it: ``:recompute`` rebuilds dense S's soft parameters in backward
(``MaskTrainingArguments(recompute_soft_parameters=True)``) and ``:keep`` keeps them (the default; at a commit before
that field, the rebuilding was the default and ``:keep`` turns it off), ``:no-rows`` turns off the embedding row path
(``GraftedRows``); and with a search space they force one path on every linear layer instead of the cheaper one for
the layer and batch (``LinearPattern.sparse_is_cheaper``): ``:sparse`` the sparse products (``SparseLinearDelta``),
``:copy`` the soft weight copy (``GraftedSearchSpace``); e.g. ``none:no-rows``, ``0.01:copy``.

``--profile`` prints, for one step of each variant after the warm-up, torch.profiler's operators by self CPU time
(share of the step and call counts) and the total operator calls: run it at another commit through a worktree
(``git worktree add /tmp/old <sha>``, then this script with ``PYTHONPATH=/tmp/old``) to see which operators a commit
added. ``--layers`` times one linear layer's forward and backward alone (CPU time, one thread, shapes and batches of
the encoder models): the base layer, and what the soft weight copy and the sparse products add to it, with the path
``LinearPattern.sparse_is_cheaper`` picks; ``SPARSE_LINEAR_COSTS`` in ``peft_graft/tuner/autograd.py`` was fitted to
this table.

Models. ``roberta-base-random`` (seeded random RoBERTa-base classifier) and ``all-MiniLM-L6-v2``: theta_ft is the
model with every entry moved by seeded noise, built in memory. The Llama models are ``LlamaForCausalLM`` with seeded
random weights (``torch.manual_seed(0)``, built in fp32 then cast to ``--dtype``), causal LM loss (labels = input_ids,
random token ids): ``llama-1b-random`` has the configuration of Llama-3.2-1B (1.24B parameters, vocabulary 128,256,
tied embeddings); ``llama-22m``, ``llama-125m``, ``llama-400m`` and ``llama-1b`` are one family that varies only in
size (vocabulary 32,000, head size 64, 4:1 or 3:1 grouped-query attention; see ``LLAMA_FAMILY``); ``llama-0.4m``,
``llama-2m`` and ``llama-6m`` are tiny members for quick checks. Their theta_ft is written once to ``--cache``
(``save_pretrained(max_shard_size="1GB")``, reused afterwards) by :func:`perturb_` and passed to ``GraftConfig`` as a
path, so no process holds it as a second model object; each process rebuilds theta_pre from the seed and checks it
against tensors recorded when theta_ft was made.

Bytes per parameter: after the warm-up step each variant's process measures the state its step keeps (weights,
gradients, optimizer state; for the mask, S, its gradient, the movement, the search-space indices and the buffers of
the soft tensors), and the report turns that into bytes per parameter and into what 7B and 70B models in bf16 would
need on one 80 GB GPU (:func:`bytes_per_parameter`, :func:`on_paper`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model
from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.tuner import autograd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import (
    DEFAULT_CACHE,
    DTYPES,
    FINGERPRINT_FILE,
    GIB,
    MODELS,
    Meter,
    available_gb,
    batch_for,
    check_pretrained,
    fine_tuned_like,
    finetuned_dir,
    load_pretrained,
    minor_faults,
    num_parameters,
    prepare_finetuned,
    ratio_quartiles,
    release_free_memory,
    rss_gb,
)

# The path rule of a linear layer's search space, to force one path (``:sparse``); absent before issue 38 (this script
# also runs against older commits through PYTHONPATH, see --profile).
LinearPattern = getattr(autograd, "LinearPattern", None)
SPARSE_IS_CHEAPER = getattr(LinearPattern, "sparse_is_cheaper", None)
SPARSITY = 1e-4


# ----------------------------------------------------------------------------------------------- trainers
def plain_trainer(model: torch.nn.Module, device: str = "cpu") -> Trainer:
    args = TrainingArguments(
        output_dir="/tmp/bench_plain", optim="sgd", learning_rate=1e-3, report_to=[], use_cpu=device == "cpu"
    )
    return Trainer(model=model, args=args)


def search_space(text: str) -> dict[str, float | int]:
    """``GraftConfig`` search-space fields of a variant: ``none`` (dense S), a fraction (float) or a count (int);
    ``reference`` (no ``GraftConfig``) has none."""
    text = text.split(":")[0]
    if text.lower() in ("none", REFERENCE):
        return {}
    return {"search_fraction": float(text)} if any(c in text for c in ".e") else {"search_entries": int(text)}


VARIANT_FLAGS = ("keep", "recompute", "no-rows", "sparse", "copy")


def use_variant(variant: str) -> None:
    """Set the layer switches for ``VALUE[:keep|:recompute][:no-rows][:sparse|:copy]`` (see the module docstring)."""
    flags = variant.split(":")[1:]
    if flags and variant.split(":")[0] == REFERENCE:
        raise ValueError(f"Variant {variant!r}: the reference step takes no suffixes.")
    unknown = set(flags) - set(VARIANT_FLAGS)
    if unknown or {"sparse", "copy"} <= set(flags) or {"keep", "recompute"} <= set(flags):
        raise ValueError(
            f"Variant {variant!r}: suffixes are one of :keep or :recompute, :no-rows and one of :sparse or :copy, got "
            f"{flags}."
        )
    if hasattr(graft_layer, "RECOMPUTE_SOFT_PARAMETERS"):  # a commit before the MaskTrainingArguments field
        graft_layer.RECOMPUTE_SOFT_PARAMETERS = "keep" not in flags
    graft_layer.GRAFT_EMBEDDING_ROWS = "no-rows" not in flags
    graft_layer.GRAFT_SPARSE_LINEAR = "copy" not in flags
    if SPARSE_IS_CHEAPER is not None:
        LinearPattern.sparse_is_cheaper = (lambda self, tokens: True) if "sparse" in flags else SPARSE_IS_CHEAPER


def mask_trainer(pre: torch.nn.Module, finetuned, variant: str, device: str = "cpu") -> MaskTrainer:
    """``finetuned``: a model object (encoders) or the path of a saved checkpoint (Llama models)."""
    heads = None if isinstance(pre, LlamaForCausalLM) else ["classifier"]
    config = GraftConfig(
        finetuned=finetuned, sparsity=SPARSITY, learn_region=True, modules_to_save=heads, **search_space(variant)
    )
    model = get_peft_model(pre, config)
    flags = variant.split(":")[1:]
    recompute = True if "recompute" in flags else False if "keep" in flags else None
    if "recompute_soft_parameters" in {f.name for f in dataclasses.fields(MaskTrainingArguments)}:
        extra = {"recompute_soft_parameters": recompute}
    else:  # a commit before the field: use_variant sets the module switch
        extra = {}
    args = MaskTrainingArguments(
        output_dir="/tmp/bench_mask", report_to=[], use_cpu=device == "cpu", mask_batch_size=None, **extra
    )
    trainer = MaskTrainer(model=model, args=args)
    assert trainer.args.gradient_accumulation_steps == 1  # one step = one micro-batch, as the plain step
    return trainer


# The paper's reference code (``--search reference``): its mask learning rate and sigmoid shift, the defaults of its
# run_graft_task.sh (lr=1e7) and Grafting.py (sigmoid_bias=10).
REFERENCE = "reference"
REFERENCE_LR = 1e7
SIGMOID_BIAS = 10.0


class ReferenceGraft:
    """The mask-training step of the paper's official code, written anew here to time it beside MaskTrainer.

    Mirrors ``graft_Trainer`` of ``src/graft_trainer.py`` in abhishekpanigrahi1996/Skill-Localization-by-grafting, set
    up as its ``Grafting.py`` does: three whole models (the working model, dropout off, every parameter requiring a
    gradient; theta_pre and theta_ft on the CPU) and, per trainable tensor, dense mask logits S in the weights' dtype
    (``create_binary_masks``: uniform in [0, 1), read through ``sigmoid(S - sigmoid_bias)``), theta_ft - theta_pre,
    and the base mask gamma_base (``create_basepatch``, ``highest_movement``: a running numpy sort of the magnitudes,
    tensor by tensor, keeping those above the k-th largest). That setup runs once, outside the step. :meth:`step` is
    one epoch of ``train_graft`` with one micro-batch: ``interpolate_model`` (per tensor, theta_pre, theta_ft and the
    model's tensor found by scanning ``named_parameters``, then ``gamma * (theta_ft - theta_pre)`` added, the
    difference made anew), forward and backward, a clone of the gradients (found by list membership of the names),
    ``zero_grad`` (under torch >= 2 it frees them; the reference's torch 1.6 zeroed them in place and kept them), the
    products with theta_ft - theta_pre, the learning-rate scaled mean over micro-batches, ``reset_model`` (theta_pre
    back, by the same scans) and the update of S by the chain rule through
    ``gamma = gamma_base + (1 - 2 gamma_base) sigmoid(S - sigmoid_bias)``.

    Knowingly different: the region is the other variants' (every tensor but the ``heads``, which hold theta_ft's
    values as with ``modules_to_save``; the shipped script also froze the embeddings and its prompt head), the loss is
    the model's own on the benchmark's batch (the reference's ``finetune`` path), the numpy sort reads bf16 weights as
    fp32 (numpy has no bf16), and the evaluation that ends each of the reference's epochs (the rounded mask on the
    training and validation sets, ``torch.save`` of S) is left out, as the other variants' steps evaluate nothing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pretrained: torch.nn.Module,
        finetuned: torch.nn.Module,
        heads: list[str] | None,
        sparsity: float = SPARSITY,
        device: str = "cpu",
    ) -> None:
        self.device = device
        self.model = model.to(device).eval().requires_grad_(True)
        self.pretrained = pretrained.to("cpu").eval().requires_grad_(False)
        self.finetuned = finetuned.to("cpu").eval().requires_grad_(False)
        heads = tuple(heads or ())
        self.names = [n for n, _ in self.model.named_parameters() if not any(f".{h}." in f".{n}" for h in heads)]
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name not in self.names:  # a head: theta_ft's, whole
                    param.copy_(self.finetuned.get_parameter(name))
            params = [self.find(self.model, name) for name in self.names]
            self.scores = [torch.rand_like(p) for p in params]
            self.directions = [self.find(self.finetuned, n) - self.find(self.pretrained, n) for n in self.names]
            self.base = self.top_movement(sparsity)
        self.grad: list[torch.Tensor] | None = None
        self.total_grad: list[torch.Tensor] | None = None

    @staticmethod
    def find(model: torch.nn.Module, name: str) -> torch.Tensor:
        """The parameter ``name`` of ``model``, by a scan of all its named parameters (the reference's look-up)."""
        found = None
        for other, param in model.named_parameters():
            if other == name:
                found = param
        return found

    def top_movement(self, sparsity: float) -> list[torch.Tensor]:
        """gamma_base: 1 where ``|theta_ft - theta_pre|`` exceeds the k-th largest magnitude (k = ``sparsity`` of the
        entries), found by sorting, tensor by tensor, its magnitudes with the best k so far (float64 numpy)."""
        k = int(sparsity * sum(s.numel() for s in self.scores))
        best = np.zeros(k)
        for direction in self.directions:
            values = np.concatenate([np.abs(direction.float().numpy().ravel()), best])
            best = -np.sort(-values)[:k]
        threshold = np.sort(best)[0]
        masks = []
        for direction, scores in zip(self.directions, self.scores, strict=True):
            mask = torch.zeros_like(scores)
            mask[(direction.abs() > threshold).to(mask.device)] = 1.0
            masks.append(mask)
        return masks

    def create_optimizer(self) -> None:
        """None: the reference updates S by hand."""

    def interpolate(self) -> None:
        """theta_pre + gamma * (theta_ft - theta_pre) into the working model (``interpolate_model``)."""
        for name, scores, base in zip(self.names, self.scores, self.base, strict=True):
            pre = self.find(self.pretrained, name).to(self.device)
            ft = self.find(self.finetuned, name).to(self.device)
            with torch.no_grad():
                for other, param in self.model.named_parameters():
                    if other == name:
                        param += (base + (1.0 - 2.0 * base) * torch.sigmoid(scores - SIGMOID_BIAS)) * (ft - pre)

    def reset(self) -> None:
        """theta_pre back into the working model (``reset_model``)."""
        for name in self.names:
            pre = self.find(self.pretrained, name).to(self.device)
            with torch.no_grad():
                for other, param in self.model.named_parameters():
                    if other == name:
                        param += pre - param

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One mask-training step of ``train_graft``: one epoch of one micro-batch, its evaluation left out."""
        self.total_grad = None  # an epoch starts with total_grad = []
        self.interpolate()
        loss = self.model(**batch).loss
        loss.backward()
        for name, param in self.model.named_parameters():
            if name in self.names and param.grad is None:
                raise RuntimeError(f"{name} got no gradient")
        self.grad = [p.grad.detach().clone() for n, p in self.model.named_parameters() if n in self.names]
        self.model.zero_grad()  # torch >= 2 frees the gradients; the reference's torch 1.6 zeroed them in place
        self.grad = [g * d.to(self.device) for g, d in zip(self.grad, self.directions, strict=True)]
        self.total_grad = [REFERENCE_LR * g for g in self.grad]  # the first (here the only) micro-batch
        self.total_grad = [g / 1.0 for g in self.total_grad]  # the mean over the epoch's micro-batches
        self.reset()
        with torch.no_grad():
            for scores, grad, base in zip(self.scores, self.total_grad, self.base, strict=True):
                shifted = scores - SIGMOID_BIAS  # d gamma / d S, its sigmoid computed twice as there
                scores -= (1.0 - 2.0 * base) * grad * torch.sigmoid(shifted) * (1.0 - torch.sigmoid(shifted))
        return loss.detach()


def reference_graft(pre: torch.nn.Module, finetuned, device: str = "cpu") -> ReferenceGraft:
    """The reference step on ``pre`` (its working model), a copy of it (theta_pre) and ``finetuned`` (a model object,
    or a checkpoint path loaded whole: the reference holds theta_ft as a model)."""
    if isinstance(finetuned, str):
        finetuned = type(pre).from_pretrained(finetuned, dtype=pre.dtype)
    heads = None if isinstance(pre, LlamaForCausalLM) else ["classifier"]
    return ReferenceGraft(pre, copy.deepcopy(pre), finetuned, heads, SPARSITY, device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]  # --clock


def step(trainer: Trainer | ReferenceGraft, batch: dict[str, torch.Tensor], meter: Meter, probe=None) -> float:
    """One training step (forward, backward, optimizer step, gradients released; the reference's whole step, which
    zeroes the gradients itself and keeps its buffers); ``probe(trainer)`` runs, untimed, after the optimizer step
    while the gradients still exist."""
    reference = isinstance(trainer, ReferenceGraft)
    if not reference:
        trainer.model.train()
    meter.sync()
    start = clock()
    if reference:
        trainer.step(batch)
    else:
        trainer.training_step(trainer.model, batch)
        trainer.optimizer.step()
    meter.sync()
    elapsed = clock() - start
    if probe is not None:
        probe(trainer)
    if reference:
        return elapsed
    start = clock()
    trainer.optimizer.zero_grad(set_to_none=True)
    return elapsed + clock() - start


def faulted_step(trainer: Trainer | ReferenceGraft, batch: dict[str, torch.Tensor], meter: Meter) -> tuple[float, int]:
    """:func:`step`, and the minor page faults this process took during it."""
    before = minor_faults()
    seconds = step(trainer, batch, meter)
    return seconds, minor_faults() - before


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def kept_state(trainer: Trainer | ReferenceGraft) -> dict[str, int]:
    """Bytes of the state a step keeps (measured on the objects, after the optimizer step, before ``zero_grad``).

    Plain: weights, gradients, optimizer state. Mask: the base weights (frozen), then per region learner (see
    ``peft_graft/tuner/learning.py``) S and its gradient, the movement, the int64 indices of the search space (and
    their per-tensor local copies), gamma_base, and the buffers of the soft tensors (``GraftedSearchSpace``'s
    ``BufferPool``, one per tensor holding part of the search space, in the tensor's dtype). Reference: the working
    model's weights and gradients (none: its ``zero_grad`` freed them), theta_pre and theta_ft, S, gamma_base and
    theta_ft - theta_pre, and the two gradient-sized lists it keeps until its next step.
    """
    params = {id(p): (n, p) for n, p in trainer.model.named_parameters()}
    if isinstance(trainer, ReferenceGraft):  # all in the weights' dtype

        def total(tensors) -> int:
            return sum(nbytes(t) for t in tensors or [])

        return {
            "parameters": sum(p.numel() for _, p in params.values()),
            "weights": total(p for _, p in params.values()),
            "reference": True,
            "model_copies": total(trainer.pretrained.parameters()) + total(trainer.finetuned.parameters()),
            "gradients": total(p.grad for _, p in params.values()),
            "mask_state": total(trainer.scores) + total(trainer.base) + total(trainer.directions),
            "step_buffers": total(trainer.grad) + total(trainer.total_grad),
        }
    if not isinstance(trainer, MaskTrainer):
        state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {
            "parameters": sum(p.numel() for _, p in params.values()),
            "weights": sum(nbytes(p) for _, p in params.values()),
            "gradients": sum(nbytes(p.grad) for _, p in params.values()),
            "optimizer_state": sum(nbytes(t) for t in state),
        }
    learners = list(trainer.region_learners().values())
    base = [p for n, p in params.values() if "graft_" not in n]
    out = {
        "parameters": sum(p.numel() for p in base),
        "weights": sum(nbytes(p) for p in base),
        "candidates": sum(learner.scores.numel() for learner in learners),
        "dense": all(learner.is_dense for learner in learners),
        "scores": 0,
        "score_gradients": 0,
        "movement": 0,
        "indices": 0,
        "soft_buffers": 0,
        "soft_buffer_entries": 0,
    }
    for learner in learners:
        out["scores"] += nbytes(learner.scores)
        out["score_gradients"] += nbytes(learner.scores.grad)
        out["movement"] += nbytes(learner.movement)
        parts = getattr(learner, "_parts", None) or []
        out["indices"] += nbytes(learner.search_indices) + nbytes(learner.base_region)
        out["indices"] += sum(nbytes(local) for _, (_, _, local) in parts)
        buffers = getattr(getattr(learner, "_pool", None), "buffers", {}).values()
        out["soft_buffers"] += sum(nbytes(b) for b in buffers)
        out["soft_buffer_entries"] += sum(b.numel() for b in buffers)
    return out


def build(name: str, variant: str, device: str, dtype: str, cache: str, meter: Meter):
    """theta_pre (checked), then the trainer of ``variant``; returns (trainer, batch, RSS after loading)."""
    pre = load_pretrained(name, DTYPES[dtype])
    finetuned = None
    if MODELS[name].llama is not None:
        finetuned = finetuned_dir(cache, name, dtype)
        check_pretrained(pre, finetuned)
        finetuned = str(finetuned)
    pre.to(device)
    loaded = meter.now()
    meter.reset()  # the next peak is that of creating the trainer (the graft: get_peft_model)
    batch = {k: v.to(device) for k, v in batch_for(pre, name).items()}
    use_variant(variant)
    if variant == "plain":
        trainer = plain_trainer(pre, device)
    elif variant == REFERENCE:
        trainer = reference_graft(pre, finetuned or fine_tuned_like(pre), device)
    else:  # theta_ft: a path (read by the library), or an object dropped once the graft exists
        trainer = mask_trainer(pre, finetuned or fine_tuned_like(pre), variant, device)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, batch, loaded


def run_variant(name: str, variant: str, repeats: int, device: str, dtype: str, cache: str) -> dict:
    """One variant alone in this process: build it, reset the peak, one warm-up step then ``repeats`` timed steps."""
    meter = Meter(device)
    start = time.perf_counter()
    trainer, batch, loaded = build(name, variant, device, dtype, cache, meter)
    built = time.perf_counter() - start
    creation_peak = meter.peak()
    release_free_memory()
    ready = meter.now()
    meter.reset()
    state = {}
    step(trainer, batch, meter, probe=lambda t: state.update(kept_state(t)))  # warm-up
    timed = [faulted_step(trainer, batch, meter) for _ in range(repeats)]
    times, faults = [seconds for seconds, _ in timed], [count for _, count in timed]
    peak = meter.peak()
    return {
        "variant": variant,
        "times_s": times,
        "median_s": statistics.median(times) if times else None,
        "faults_alone_per_step": statistics.median(faults) if faults else None,
        "build_s": built,
        "rss_after_load_gb": loaded,
        "creation_peak_gb": creation_peak,
        "rss_ready_gb": ready,
        "peak_gb": peak,
        "added_gb": peak - loaded,
        "host_peak_gb": rss_gb("VmHWM"),
        "state": state,
    }


def build_all(name: str, variants: list[str], device: str, dtype: str, cache: str):
    """Plain SGD and every mask variant's trainer in this process, each warmed up by one step; and the batch."""
    meter = Meter(device)
    pre = load_pretrained(name, DTYPES[dtype])
    finetuned = str(finetuned_dir(cache, name, dtype)) if MODELS[name].llama is not None else fine_tuned_like(pre)
    pre.to(device)
    batch = {k: v.to(device) for k, v in batch_for(pre, name).items()}
    trainers = {"plain": plain_trainer(copy.deepcopy(pre), device)}
    for variant in variants:
        if variant == REFERENCE:
            trainers[variant] = reference_graft(copy.deepcopy(pre), finetuned, device)
        else:
            trainers[variant] = mask_trainer(copy.deepcopy(pre), finetuned, variant, device)
    del finetuned, pre
    for key, trainer in trainers.items():
        use_variant(key)
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1
        step(trainer, batch, meter)  # warm-up
    return trainers, batch, meter


def time_all(name: str, repeats: int, variants: list[str], device: str, dtype: str, cache: str) -> tuple[dict, dict]:
    """Paired step times in this process (``--timing alternate``): see :func:`pair_steps`."""
    trainers, batch, meter = build_all(name, variants, device, dtype, cache)

    def timed(key: str) -> tuple[float, int]:
        use_variant(key)
        return faulted_step(trainers[key], batch, meter)

    return pair_steps(repeats, variants, timed)


def pair_steps(repeats: int, variants: list[str], timed: Callable[[str], tuple[float, int]]) -> tuple[dict, dict]:
    """Per variant, ``repeats`` pairs of a plain SGD step and a variant step back to back, in turn first; ``timed(key)``
    runs one step of trainer ``key`` and returns its seconds and minor page faults. Returns ``{variant: [(plain_s,
    variant_s), ...]}`` and the faults of the same steps, ``{variant: [(plain, variant), ...]}``."""
    pairs = {variant: [] for variant in variants}
    faults = {variant: [] for variant in variants}
    for i in range(repeats):
        for variant in variants:
            order = ("plain", variant) if i % 2 == 0 else (variant, "plain")
            steps = {key: timed(key) for key in order}
            pairs[variant].append((steps["plain"][0], steps[variant][0]))
            faults[variant].append((steps["plain"][1], steps[variant][1]))
    return pairs, faults


def lockstep_worker(args: argparse.Namespace, key: str, connection) -> None:
    """One trainer (``plain`` or a variant) in this process for ``--timing lockstep``: built and warmed up, then one
    timed step per ``True`` received, its seconds and minor page faults sent back; ``False`` ends it."""
    configure(args)
    meter = Meter(args.device)
    trainer, batch, _ = build(args.model, key, args.device, args.dtype, args.cache, meter)
    step(trainer, batch, meter)  # warm-up
    connection.send("ready")
    while connection.recv():
        connection.send(faulted_step(trainer, batch, meter))


def time_lockstep(args: argparse.Namespace) -> tuple[dict, dict]:
    """The pairs of :func:`pair_steps` with each trainer in its own process (``--timing lockstep``), stepped in turns
    from this one: paired in time as in one process, but each trainer has the heap it would have alone."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no heap or threads shared with this one
    connections, workers = {}, []
    try:
        for key in ["plain", *args.search]:  # built one at a time: their creation peaks do not add up
            parent, child = context.Pipe()
            worker = context.Process(target=lockstep_worker, args=(args, key, child), daemon=True)
            worker.start()
            child.close()  # the worker's end: a worker that dies makes recv() raise EOFError
            workers.append(worker)
            connections[key] = parent
            if parent.recv() != "ready":
                raise RuntimeError(f"the lockstep worker of {key!r} did not start")

        def timed(key: str) -> tuple[float, int]:
            connections[key].send(True)
            return connections[key].recv()

        return pair_steps(args.repeats, args.search, timed)
    finally:
        for connection in connections.values():
            with contextlib.suppress(BrokenPipeError, OSError):  # a worker that died
                connection.send(False)
        for worker in workers:
            worker.join()


def profile_steps(name: str, variants: list[str], device: str, dtype: str, cache: str, top: int = 25) -> dict:
    """torch.profiler's operators of one step per variant (after the warm-up): ``{variant: {"calls": total operator
    calls, "ops": [(name, calls, share of self CPU time), ...]}}``, printed as it goes."""
    from torch.profiler import ProfilerActivity, profile

    trainers, batch, meter = build_all(name, variants, device, dtype, cache)
    out = {}
    for key, trainer in trainers.items():
        use_variant(key)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(trainer, batch, meter)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) or 1
        ops = sorted(((e.key, e.count, e.self_cpu_time_total / total) for e in events), key=lambda r: -r[2])
        out[key] = {"calls": sum(e.count for e in events), "ops": ops}
        print(f"profile of one step, {key}: {out[key]['calls']} operator calls, {len(ops)} operators")
        for op, calls, share in ops[:top]:
            print(f"  {op[:60]:<60} {calls:>7} {100 * share:6.2f}%")
    return out


# ----------------------------------------------------------------------------------------------- one linear layer
LAYER_SHAPES = [(384, 384), (1536, 384), (384, 1536), (768, 768), (3072, 768), (768, 3072)]  # (out, in)
LAYER_TOKENS = [32, 128, 512, 2048]
LAYER_FRACTIONS = [0.002, 0.01, 0.05]


def layer_costs(out_features: int, in_features: int, tokens: int, fraction: float, repeats: int) -> dict[str, float]:
    """CPU seconds (best of ``repeats``) of one fp32 linear layer's forward and backward with a search space of
    ``fraction`` of its weight and bias: the frozen base layer (input gradient only), and what the soft weight copy
    (``GraftedSearchSpace``) and the sparse products (``SparseLinearDelta``) add to it."""
    from torch.nn import functional as F

    from peft_graft.parameter_layout import FlatIndexSpace

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    space = FlatIndexSpace(["weight", "bias"], [weight.numel(), bias.numel()])
    count = max(1, int(fraction * space.size))
    indices = torch.randperm(space.size, generator=generator)[:count].sort().values
    parts = dict((attr, (p.start, p.stop, local)) for attr, local, p in space.split(indices))
    scores = torch.zeros(count, requires_grad=True)
    movement, base = torch.randn(count, generator=generator) * 1e-3, torch.arange(0, count, 97)
    pattern = LinearPattern(parts.get("weight"), parts.get("bias"), out_features, in_features)
    x = torch.randn(tokens, in_features, generator=generator, requires_grad=True)
    grad = torch.randn(tokens, out_features, generator=generator)
    pool = autograd.BufferPool()

    def base_layer():
        F.linear(x, weight, bias).backward(grad)

    def soft_copy():
        tensors = {"weight": weight, "bias": bias}
        thetas = [tensors[attr] for attr in parts]
        soft = autograd.GraftedSearchSpace.apply(scores, movement, base, list(parts.values()), pool, *thetas)
        tensors.update(zip(parts, soft, strict=True))
        F.linear(x, tensors["weight"], tensors["bias"]).backward(grad)

    def sparse_products():
        delta = autograd.SparseLinearDelta.apply(x, scores, movement, base, pattern)
        (F.linear(x, weight, bias) + delta).backward(grad)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
            x.grad = scores.grad = None
        return min(times)

    costs = {"base": best(base_layer), "copy": best(soft_copy), "sparse": best(sparse_products)}
    costs["copy"] -= costs["base"]
    costs["sparse"] -= costs["base"]
    costs["rule_sparse"] = pattern.sparse_is_cheaper(tokens)
    return costs


def time_layers(repeats: int) -> list[dict]:
    """:func:`layer_costs` over the grid, printed with the path the rule picks and its cost over the cheaper one."""
    torch.set_num_threads(1)
    print("one fp32 linear layer, forward + backward, CPU ms (best of the repeats, one thread)")
    print(f"  {'out x in':>11} {'tokens':>6} {'share':>6} {'base':>9} {'+copy':>8} {'+sparse':>8}  rule    regret")
    rows = []
    for fraction in LAYER_FRACTIONS:
        for tokens in LAYER_TOKENS:
            for out_features, in_features in LAYER_SHAPES:
                costs = layer_costs(out_features, in_features, tokens, fraction, repeats)
                picked = costs["sparse"] if costs["rule_sparse"] else costs["copy"]
                cheaper = min(costs["sparse"], costs["copy"])
                regret = (picked - cheaper) / (costs["base"] + cheaper)
                row = {"out": out_features, "in": in_features, "tokens": tokens, "fraction": fraction, **costs}
                rows.append({**row, "regret": regret})
                print(
                    f"  {out_features:>5}x{in_features:<5} {tokens:>6} {fraction:>6.3f} {1e3 * costs['base']:>8.2f} "
                    f"{1e3 * costs['copy']:>+8.2f} {1e3 * costs['sparse']:>+8.2f}  "
                    f"{'sparse' if costs['rule_sparse'] else 'copy':<6} {100 * regret:>6.1f}%",
                    flush=True,
                )
    return rows


# ----------------------------------------------------------------------------------------------- bytes per parameter
def bytes_per_parameter(state: dict) -> dict[str, float]:
    """The kept state of one variant (:func:`kept_state`) per parameter of the model.

    ``*_share`` terms follow the weights' dtype (a gradient, an optimizer state or a soft-tensor buffer has the dtype
    of its tensor): they are given as a multiple of the weights' bytes. The others are fixed: S, its gradient and the
    movement are fp32, and the search-space indices int64, whatever the weights' dtype; dense, they are bytes per
    parameter; with a search space, bytes per candidate. The reference keeps everything in the weights' dtype: shares.
    """
    n, weights = state["parameters"], state["weights"]
    if state.get("reference"):
        terms = {"models": "model_copies", "gradient": "gradients", "mask": "mask_state", "step": "step_buffers"}
        return {"weight_bytes": weights / n, **{f"{k}_share": state[v] / weights for k, v in terms.items()}}
    if "candidates" not in state:
        return {
            "weight_bytes": weights / n,
            "gradient_share": state["gradients"] / weights,
            "optimizer_share": state["optimizer_state"] / weights,
        }
    fixed = state["scores"] + state["score_gradients"] + state["movement"] + state["indices"]
    out = {
        "weight_bytes": weights / n,
        "buffer_share": state["soft_buffers"] / weights,
        "candidate_fraction": state["candidates"] / n,
        "dense": state["dense"],
    }
    out["bytes_per_parameter" if state["dense"] else "bytes_per_candidate"] = fixed / max(state["candidates"], 1)
    return out


MODEL_SIZES = {"7B": 7e9, "70B": 70e9}
GPU_GIB = 80


def on_paper(measured: dict[str, dict], fractions: list[float], dtype_bytes: int = 2) -> list[str]:
    """What each mode keeps per parameter, and what 7B and 70B models in bf16 need of one 80 GB GPU.

    ``measured``: :func:`bytes_per_parameter` by variant (``plain``, ``none``, fractions, ``reference``: a row only when
    measured). Terms that follow the
    weights' dtype scale to ``dtype_bytes``; the fp32 and int64 ones stay. A variant not measured falls back on what
    the code keeps (gradient = weights; S, its gradient and the movement fp32; a candidate adds two int64 indices, its
    global and its per-tensor one; every tensor holds some candidate, so one buffer per tensor).
    """
    plain = measured.get("plain", {"gradient_share": 1.0, "optimizer_share": 0.0})
    dense = next((m for m in measured.values() if m.get("dense")), {"bytes_per_parameter": 12.0})
    capped = [m for m in measured.values() if "bytes_per_candidate" in m]
    per_candidate = statistics.median([m["bytes_per_candidate"] for m in capped]) if capped else 28.0
    share = max([m["buffer_share"] for m in capped], default=1.0)
    b = dtype_bytes
    rows = [
        ("weights alone", b, f"{b}"),
        ("plain SGD (no momentum)", b * (1 + plain["gradient_share"] + plain["optimizer_share"]),
         f"{b} + grad {b * plain['gradient_share']:g}"),
        ("plain AdamW (moments in bf16)", 4 * b, f"{b} + grad {b} + 2 moments {2 * b}"),
        ("plain AdamW, mixed precision", b + b + 12, f"{b} + grad {b} + fp32 master and 2 moments 12"),
        ("mask, dense S (paper)", b + dense["bytes_per_parameter"],
         f"{b} + S, grad S, movement {dense['bytes_per_parameter']:.0f}"),
    ]  # fmt: skip
    reference = measured.get(REFERENCE)
    if reference is not None:
        shares = {k[: -len("_share")]: v for k, v in reference.items() if k.endswith("_share")}
        rows.append((
            "reference code (paper)", b * (1 + sum(shares.values())),
            f"{b}x(1+" + "+".join(f"{k.replace('gradient', 'grad')} {v:.3g}" for k, v in shares.items()) + ")",
        ))  # fmt: skip
    for fraction in fractions:
        rows.append((
            f"mask, search_fraction={fraction:g}", b + b * share + fraction * per_candidate,
            f"{b} + buffers {b * share:.2f} + {per_candidate:.0f} B x {fraction:g}",
        ))  # fmt: skip
    lines = [
        f"On paper: bytes per parameter kept through a step with {b}-byte weights (activations and per-layer "
        "temporaries aside), and one 80 GB (80 GiB) GPU:",
        f"  {'mode':<33} {'B/param':>7}  {'= terms':<44}" + "".join(f" {s:>5} GiB {'fits':>4}" for s in MODEL_SIZES),
    ]
    for label, per_parameter, terms in rows:
        cells = ""
        for size in MODEL_SIZES.values():
            gib = per_parameter * size / GIB
            cells += f" {gib:>9.1f} {'yes' if gib <= GPU_GIB else 'no':>4}"
        lines.append(f"  {label:<33} {per_parameter:>7.2f}  {terms:<44}{cells}")
    source = "measured" if capped else "from the code (not measured in this run)"
    lines.append(
        f"  (per candidate {per_candidate:.1f} B and buffer share {share:.2f} of the weights: {source}; "
        f"dense: {dense['bytes_per_parameter']:.1f} B/param of fp32 state)"
    )
    return lines


# ----------------------------------------------------------------------------------------------- driver
def estimated_peak_gb(name: str, variant: str, dtype: str) -> float | None:
    """A rough upper estimate of a variant's peak (creation included) on CPU, to refuse what cannot fit."""
    n = num_parameters(name)
    if n is None:
        return None
    b = DTYPES[dtype].itemsize
    if variant == "plain":
        per_parameter = 2 * b
    elif variant == REFERENCE:  # three models, the gradients, S, gamma_base, the movement, two gradient-sized lists
        per_parameter = 10 * b
    elif search_space(variant):  # theta_pre, theta_ft read in fp32, the fp32 movement of every tensor
        per_parameter = b + 8
    else:  # and S, its gradient and the movement again, per module
        per_parameter = b + 16
    return 1.1 * n * per_parameter / GIB + 1.0


def subprocess_run(args: argparse.Namespace, variant: str, repeats: int) -> dict:
    command = [sys.executable, __file__, "--model", args.model, "--run", variant, "--repeats", str(repeats)]
    command += ["--device", args.device, "--dtype", args.dtype, "--cache", args.cache, "--threads", str(args.threads)]
    command += ["--batch", "x".join(map(str, MODELS[args.model].batch))]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        killed = " (killed: out of memory?)" if done.returncode == -9 else ""
        return {"variant": variant, "error": f"exit status {done.returncode}{killed}"}
    return json.loads(done.stdout.splitlines()[-1])


def prepare_in_subprocess(args: argparse.Namespace) -> None:
    folder = finetuned_dir(args.cache, args.model, args.dtype)
    if MODELS[args.model].llama is None or (folder / FINGERPRINT_FILE).is_file():
        return
    start = time.perf_counter()
    command = [sys.executable, __file__, "--model", args.model, "--prepare", "--dtype", args.dtype]
    subprocess.run([*command, "--cache", args.cache, "--threads", str(args.threads)], check=True)
    print(f"theta_ft written to {folder} in {time.perf_counter() - start:.0f} s", flush=True)


def fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def paired_times(results: dict[str, dict], pairs: dict[str, list[tuple[float, float]]], faults: dict) -> None:
    """Put the paired steps of :func:`time_all` into ``results``: each variant's times, median and paired ratios
    (median and quartiles), and its median minor page faults per step; plain SGD's times are all its steps."""
    plain = [p for variant_pairs in pairs.values() for p, _ in variant_pairs]
    plain_faults = [p for variant_faults in faults.values() for p, _ in variant_faults]
    results["plain"].update({
        "times_s": plain, "median_s": statistics.median(plain), "faults_per_step": statistics.median(plain_faults),
    })  # fmt: skip
    for variant, variant_pairs in pairs.items():
        times = [v for _, v in variant_pairs]
        ratios = [v / p for p, v in variant_pairs]
        low, median, high = ratio_quartiles(ratios)
        results[variant].update({
            "times_s": times, "median_s": statistics.median(times), "pairs_s": variant_pairs,
            "paired_ratios": ratios, "paired_ratio": median, "paired_ratio_quartiles": [low, high],
            "faults_per_step": statistics.median(v for _, v in faults[variant]),
        })  # fmt: skip


def report(args: argparse.Namespace, results: dict[str, dict], pairs: dict | None, faults: dict | None) -> dict:
    """Print the side-by-side table, the targets, each mask variant against the reference step and the on-paper
    accounting; return the JSON record."""
    unit = "GiB allocated on the GPU" if args.device == "cuda" else "GiB RSS"
    plain = results["plain"]
    if pairs is not None:
        paired_times(results, pairs, faults)
    how = {
        "lockstep": f"{args.repeats} pairs (plain, variant) alternating, each trainer in its own process",
        "alternate": f"{args.repeats} pairs (plain, variant) alternating in one process",
        "isolated": f"median of {args.repeats} after a warm-up, each variant in its own process",
    }[args.timing]
    print(f"step time ({args.clock} clock): {how}; memory: each variant alone ({unit})")
    header = f"{'load':>6} {'creation':>8} {'ready':>6} {'peak':>6} {'+load':>6}"
    print(f"  {'variant':<22} {'step':>8} {'ratio':>6}  {header}  steps")
    for variant, result in results.items():
        label = {"plain": "plain SGD", REFERENCE: "reference code"}.get(variant, f"mask search={variant}")
        if "error" in result or "skipped" in result:
            print(f"  {label:<22} {result.get('error') or result.get('skipped')}")
            continue
        ratio = result["median_s"] / plain["median_s"] if "median_s" in plain else float("nan")
        result["ratio"] = ratio
        print(
            f"  {label:<22} {result['median_s']:>7.3f}s {ratio:>5.2f}x  {result['rss_after_load_gb']:>6.2f} "
            f"{result['creation_peak_gb']:>8.2f} {result['rss_ready_gb']:>6.2f} {result['peak_gb']:>6.2f} "
            f"{result['added_gb']:>+6.2f}  {fmt(result['times_s'])}"
        )
    for variant, result in results.items():
        if "paired_ratio" in result:
            low, high = result["paired_ratio_quartiles"]
            print(
                f"  paired ratio, search={variant}: median {result['paired_ratio']:.3f} (quartiles {low:.3f}-"
                f"{high:.3f}) over {len(result['paired_ratios'])} pairs: {fmt(result['paired_ratios'])}"
            )
    for key, where in (("faults_per_step", "paired"), ("faults_alone_per_step", "in the memory processes")):
        counts = [f"{variant} {result[key]:.0f}" for variant, result in results.items() if result.get(key) is not None]
        if counts:
            print(f"  minor page faults per step {where} (median): {', '.join(counts)}")
    if "median_s" in plain:
        for variant, result in results.items():
            if variant not in ("plain", REFERENCE) and "ratio" in result:
                ratio = result.get("paired_ratio", result["ratio"])
                target = 1.0 if search_space(variant) else 1.2
                time_ok = "met" if ratio <= target else "missed"
                memory_ok = "met" if result["peak_gb"] <= plain["peak_gb"] else "missed"
                print(
                    f"  targets, search={variant}: step {ratio:.2f}x <= {target}x {time_ok}; peak "
                    f"{result['peak_gb']:.2f} <= plain {plain['peak_gb']:.2f} {unit} {memory_ok}"
                )
        reference = results.get(REFERENCE, {})
        if "ratio" in reference and len(results) > 2:  # paired ratios over the reference's, peaks over its peak
            base = reference.get("paired_ratio", reference["ratio"])
            cells = [
                f"search={v} step {r.get('paired_ratio', r['ratio']) / base:.3f}x, "
                f"peak {r['peak_gb'] / reference['peak_gb']:.2f}x"
                for v, r in results.items()
                if v not in ("plain", REFERENCE) and "ratio" in r
            ]
            print(
                f"  against the reference step ({base:.2f}x plain, peak {reference['peak_gb']:.2f} {unit}): "
                + "; ".join(cells)
            )
    measured = {v: bytes_per_parameter(r["state"]) for v, r in results.items() if r.get("state")}
    for variant, figures in measured.items():
        print(f"  kept per parameter, {variant}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    fractions = sorted({float(v.split(":")[0]) for v in args.search if search_space(v).get("search_fraction")})
    for line in on_paper(measured, fractions or [0.01, 0.001]):
        print(line)
    return {
        "model": args.model,
        "parameters": num_parameters(args.model),
        "batch": MODELS[args.model].batch,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "timing": args.timing,
        "clock": args.clock,
        "repeats": args.repeats,
        "results": results,
        "per_parameter": measured,
    }


def configure(args: argparse.Namespace) -> None:
    """This process's torch threads, clock and batch as the command line sets them (also in lockstep workers)."""
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    if args.batch:
        size, length = (int(x) for x in args.batch.lower().split("x"))
        MODELS[args.model] = dataclasses.replace(MODELS[args.model], batch=(size, length))
    hf_logging.set_verbosity_error()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="roberta-base-random")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--search",
        nargs="+",
        help="mask variants: none (dense S), a search fraction or count, with suffixes (see above), reference (the "
        "paper's code); default: none 0.01 reference, and none 0.01 for the Llama models",
    )
    parser.add_argument("--timing", choices=["auto", "lockstep", "alternate", "isolated"], default="auto",
                        help="auto: lockstep for the encoder models, isolated for the Llama models")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--cache", default=DEFAULT_CACHE, help="folder of the Llama models' theta_ft checkpoints")
    parser.add_argument("--batch", help="examples x tokens, e.g. 2x64, instead of the model's default")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed; cpu: the main thread's CPU time (--threads 1: the step's)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="print each variant's operators in one step, no timing")
    parser.add_argument("--layers", action="store_true", help="time one linear layer's two search-space paths")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--force", action="store_true", help="run variants estimated not to fit in MemAvailable")
    parser.add_argument("--run", help="measure one variant in this process: plain or a search variant (internal)")
    parser.add_argument("--prepare", action="store_true", help="write theta_ft to the cache (internal)")
    args = parser.parse_args()
    if args.search is None:
        args.search = ["none", "0.01"] + ([REFERENCE] if MODELS[args.model].llama is None else [])
    if args.timing == "auto":
        args.timing = "isolated" if MODELS[args.model].llama is not None else "lockstep"
    configure(args)
    if args.prepare:
        prepare_finetuned(args.model, args.dtype, args.cache)
        return
    if args.run:
        print(json.dumps(run_variant(args.model, args.run, args.repeats, args.device, args.dtype, args.cache)))
        return
    if args.layers:
        if SPARSE_IS_CHEAPER is None:
            sys.exit("--layers needs the code of issue 38 or later (LinearPattern.sparse_is_cheaper)")
        rows = time_layers(args.repeats)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    size, length = MODELS[args.model].batch
    isolated = args.timing == "isolated"
    count = num_parameters(args.model)
    print(
        f"model={args.model}{f' ({count / 1e6:.1f}M parameters)' if count else ''} batch={size}x{length} "
        f"device={args.device} dtype={args.dtype} threads={args.threads} torch={torch.__version__} "
        f"load={os.getloadavg()}",
        flush=True,
    )
    prepare_in_subprocess(args)
    if args.profile:
        record = profile_steps(args.model, args.search, args.device, args.dtype, args.cache)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1))
        return
    pairs = faults = None
    if args.timing == "lockstep":
        pairs, faults = time_lockstep(args)
    elif args.timing == "alternate":
        pairs, faults = time_all(args.model, args.repeats, args.search, args.device, args.dtype, args.cache)
    results = {}
    for variant in ["plain", *args.search]:
        estimate = estimated_peak_gb(args.model, variant, args.dtype) if args.device == "cpu" else None
        if estimate is not None and estimate > available_gb() and not args.force:
            results[variant] = {"variant": variant, "skipped": f"skipped: needs about {estimate:.1f} GiB, "
                                f"{available_gb():.1f} GiB available (--force runs it)"}  # fmt: skip
            continue
        about = f", estimated peak <= {estimate:.1f} GiB" if estimate is not None else ""
        print(f"running {variant} in its own process{about} ...", flush=True)
        # Alternating: the memory process runs the 3 steps the earlier --memory mode did (warm-up + 2).
        results[variant] = subprocess_run(args, variant, args.repeats if isolated else 2)
    record = report(args, results, pairs, faults)
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
