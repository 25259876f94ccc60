"""Building and stepping the mask-step benchmark's trainers: one variant alone in a process (``run_variant``), every
trainer in this process (``time_all``, ``profile_steps``), or each in its own process stepped in turns from this one
(``time_lockstep``); the pairs of a plain step and a variant step (``pair_steps``)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch
from bench_models import DTYPES, MODELS, batch_for, check_pretrained, fine_tuned_like, finetuned_dir, load_pretrained
from bench_timing import Meter, minor_faults, release_free_memory, rss_gb
from mask_memory import kept_state
from mask_reference import ReferenceGraft, reference_graft
from mask_trainers import REFERENCE, mask_trainer, plain_trainer, use_variant
from transformers import Trainer
from transformers.utils import logging as hf_logging

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
    timed step per ``True`` received, its seconds and minor page faults sent back; ``False`` ends it, answered with
    the peak memory of its steps (reset once the trainer is built, as :func:`run_variant` does) and the memory after
    loading the model."""
    configure(args)
    meter = Meter(args.device)
    trainer, batch, loaded = build(args.model, key, args.device, args.dtype, args.cache, meter)
    release_free_memory()
    meter.reset()
    step(trainer, batch, meter)  # warm-up
    connection.send("ready")
    while connection.recv():
        connection.send(faulted_step(trainer, batch, meter))
    connection.send({"peak_gb": meter.peak(), "rss_after_load_gb": loaded})


def time_lockstep(args: argparse.Namespace, memory: dict | None = None) -> tuple[dict, dict]:
    """The pairs of :func:`pair_steps` with each trainer in its own process (``--timing lockstep``), stepped in turns
    from this one: paired in time as in one process, but each trainer has the heap it would have alone. ``memory``, if
    given, gets each trainer's peak memory through its steps and its memory after loading, by key."""
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
        for key, connection in connections.items():
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):  # a worker that died
                connection.send(False)
                answer = connection.recv()
                if memory is not None:
                    memory[key] = answer
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


def configure(args: argparse.Namespace) -> None:
    """This process's torch threads, clock and batch as the command line sets them (also in lockstep workers)."""
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    if args.batch:
        size, length = (int(x) for x in args.batch.lower().split("x"))
        MODELS[args.model] = dataclasses.replace(MODELS[args.model], batch=(size, length))
    hf_logging.set_verbosity_error()
