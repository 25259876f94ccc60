"""The measurements behind the claims of ``claims.py``, each a function of the run's size that calls the benchmark
scripts' own functions and returns its figures: per figure, the values of its rounds (a variant's time over its
baseline's in the same round, or one value where a figure is a single measurement, as a peak in its own process).

Sizes: ``full`` (the scripts' usual repeats), ``quick`` (fewer repeats, the same shapes), ``smoke`` (tiny models, one
round: checks the wiring, measures nothing). ``run_all.py`` runs each measurement in its own process.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

from bench_timing import GIB

SIZES = ("full", "quick", "smoke")
# The models and the package are imported by each measurement, in its own process: run_all.py --render needs neither.


def per_size(size: str, full, quick, smoke):
    """The value of a setting for the run's ``size``."""
    return {"full": full, "quick": quick, "smoke": smoke}[size]


def over(times: dict[str, list[float]], name: str, base: str = "base") -> list[float]:
    """Per round, the time of ``name`` over the time of ``base`` in the same round."""
    return [t / b for t, b in zip(times[name], times[base], strict=True)]


def tiny_roberta():
    from bench_models import TINY_ROBERTA
    from transformers import RobertaConfig

    return RobertaConfig(**TINY_ROBERTA)


# ----------------------------------------------------------------------------------------------- training
def mask_step(model: str) -> Callable[[str], dict]:
    """MaskTrainer steps (dense S, ``search_fraction=0.01``) paired with plain SGD steps, each trainer in its own
    process (``bench_mask_step.py``'s lockstep timing); the peak RSS of each process through its steps, over plain
    SGD's."""

    def measure(size: str) -> dict:
        from bench_models import DEFAULT_CACHE
        from mask_steps import time_lockstep

        name = per_size(size, model, model, "tiny-random")
        args = argparse.Namespace(model=name, search=["none", "0.01"], repeats=per_size(size, 21, 5, 1),
                                  device="cpu", dtype="float32", cache=DEFAULT_CACHE, threads=2, clock="wall",
                                  batch=None)  # fmt: skip
        memory = {}
        pairs, _ = time_lockstep(args, memory)
        figures = {v: [step / plain for plain, step in pairs[v]] for v in args.search}
        peaks = {v: memory[v]["peak_gb"] for v in ["plain", *args.search]}
        figures.update({f"{v}_peak": [peaks[v] / peaks["plain"]] for v in args.search})
        return {"setup": {"model": name, "pairs": args.repeats, "peak_gib": peaks}, "figures": figures}

    return measure


def restriction(model: str) -> Callable[[str], dict]:
    """``restrict_training`` steps (a region of 0.1% of every tensor, frozen or the only one allowed) against plain
    steps with ``AdamW(fused=True)`` (``bench_restriction.py --fused``)."""

    def measure(size: str) -> dict:
        from bench_restriction import time_all

        name = per_size(size, model, model, "tiny-random")
        repeats = per_size(size, 21, 5, 1)
        times = time_all(name, repeats, 1e-3, fused=True)
        figures = {v: over(times, v, "plain") for v in ("frozen", "allowed")}
        return {"setup": {"model": name, "rounds": repeats, "fraction": 1e-3, "optimizer": "AdamW(fused=True)"},
                "figures": figures}  # fmt: skip

    return measure


def fisher(size: str) -> dict:
    """``fisher_diagonal`` per example against a plain forward and backward pass (``bench_fisher.py``), and the peak
    RSS each adds, in its own process, per parameter."""
    from bench_fisher import memory_in_processes, time_all
    from bench_models import load_pretrained

    name = per_size(size, "minilm-random", "minilm-random", "tiny-random")
    examples, repeats = per_size(size, (16, 7), (8, 3), (2, 1))
    times = time_all(name, examples, repeats)
    peaks = memory_in_processes(name, 4)
    parameters = sum(p.numel() for p in load_pretrained(name).parameters())
    extra = (peaks["empirical"]["peak_gb"] - peaks["plain"]["peak_gb"]) * GIB / parameters
    figures = {"empirical": over(times, "empirical", "plain"), "model": over(times, "model", "plain")}
    figures["empirical_bytes_per_parameter"] = [extra]
    return {"setup": {"model": name, "examples": examples, "rounds": repeats}, "figures": figures}


def surgical(size: str) -> dict:
    """Steps training the top or bottom blocks against full fine-tuning steps (``bench_surgical.py``)."""
    from bench_surgical import VARIANTS, time_all

    name = per_size(size, "minilm-random", "minilm-random", "tiny-random")
    repeats = per_size(size, 7, 3, 1)
    times, _ = time_all(name, repeats)
    figures = {v.replace(" ", ""): over(times, v, "full") for v in VARIANTS if v != "full"}
    return {"setup": {"model": name, "rounds": repeats, "batch": [8, 64]}, "figures": figures}


def creation(size: str) -> dict:
    """Creating a graft with a learnable region on a search space against the top-k graft (``bench_creation.py``)."""
    from bench_creation import measure
    from bench_models import DEFAULT_CACHE, num_parameters

    name = per_size(size, "llama-22m", "llama-22m", "llama-0.4m")
    rounds = per_size(size, 5, 3, 2)
    with tempfile.TemporaryDirectory() as temporary:
        row = measure(name, rounds, temporary if size == "smoke" else DEFAULT_CACHE)
    times = row["times_s"]
    figures = {"learnable": [a / b for a, b in zip(times["learnable"], times["topk"], strict=True)]}
    return {"setup": {"model": name, "parameters": num_parameters(name), "rounds": rounds}, "figures": figures}


# ----------------------------------------------------------------------------------------------- serving
def mixed(distinct: int, modes: tuple[str, ...]) -> Callable[[str], dict]:
    """``distinct`` grafts of 0.01% of every tensor in mixed batches of 32 x 128 (in each of ``modes``, set before
    every call) and peft LoRA's mixed batch with as many adapters, against the base forward
    (``bench_mixed_batch.py``). ``default_over_lora``: the library's default mode over LoRA's call, round by round."""

    def measure(size: str) -> dict:
        import bench_mixed_batch as X

        config, shape = per_size(size, (None, (32, 128)), (None, (32, 128)), (tiny_roberta(), (4, 8)))
        repeats = per_size(size, 11, 3, 1) if distinct <= 8 else per_size(size, 7, 2, 1)
        times, entries = X.time_mixed(distinct, 1e-4, repeats, config, shape, modes, single=False)
        figures = {}
        for mode in modes:
            variant = X.mode_variant(mode)
            figures[f"{mode}_over_base"] = over(times, variant)
            figures[f"{mode}_over_lora"] = over(times, variant, "lora")
        figures["lora_over_base"] = over(times, "lora")
        default = X.default_mode()
        if default in modes:
            figures["default_over_lora"] = over(times, X.mode_variant(default), "lora")
        setup = {"grafts": distinct, "entries_per_graft": entries, "batch": list(shape), "rounds": repeats}
        return {"setup": {**setup, "default_mode": default}, "figures": figures}

    return measure


def decode(size: str) -> dict:
    """``generate`` with 8 mixed grafts against the base and peft LoRA's mixed batch: the median decode step of each
    call (``bench_generate.py``)."""
    from bench_generate import SMOLLM2_135M, time_generate

    tiny = {**SMOLLM2_135M, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 99}  # fmt: skip
    shapes, prompt, tokens = per_size(size, (SMOLLM2_135M, 64, 16), (SMOLLM2_135M, 64, 16), (tiny, 8, 3))
    repeats = per_size(size, 5, 2, 1)
    _, steps, same = time_generate(repeats, tokens, shapes, prompt, ("base", "graft_sparse_delta", "lora"))
    figures = {f"graft_sparse_delta_over_{b}": over(steps, "graft_sparse_delta", b) for b in ("base", "lora")}
    figures["lora_over_base"] = over(steps, "lora")
    setup = {"layers": shapes["num_hidden_layers"], "prompts": 8, "prompt_length": prompt, "new_tokens": tokens}
    return {"setup": {**setup, "rounds": repeats, "sparse_delta_same_tokens": same}, "figures": figures}


def switch(size: str) -> dict:
    """``set_adapter`` among 8 loaded grafts of 0.01%, each with its own head, call by call in turn with two grafts
    without heads (``bench_graft.py``'s switch part): ms per call."""
    import bench_graft as G

    config = per_size(size, None, None, tiny_roberta())
    calls = per_size(size, 300, 100, 2)
    with G.switch_grafts(None, config) as saved:
        cases = G.switch_cases(saved, config)
    times = G.switch_times(cases, calls)
    heads = f"{G.HEAD_GRAFTS}_grafts_with_heads"
    figures = {"ms": [1e3 * t for t in times[heads]], "two_grafts_ms": [1e3 * t for t in times["two_grafts"]]}
    return {"setup": {"calls": calls}, "figures": figures}


def forward_graft(size: str) -> dict:
    """Unmerged forwards of a graft of 12,500 entries, and of two grafts served in turn, each right after a base
    forward, batch 4 x 32 (``bench_graft.py``'s forward part)."""
    from bench_graft import forward_times

    repeats = per_size(size, 40, 15, 1)
    times = forward_times(repeats, per_size(size, None, None, tiny_roberta()))
    figures = {v: over(times, v, f"{v}_base") for v in ("unmerged", "switching", "merged")}
    return {"setup": {"entries": 12_500, "batch": [4, 32], "rounds": repeats}, "figures": figures}


def packed(size: str) -> dict:
    """1,000 grafts of 0.01% without heads loaded onto one RoBERTa-base-sized base: peak RSS over their files
    (``bench_mixed_batch.py``'s memory part)."""
    from bench_mixed_batch import part_memory

    count, config = per_size(size, (1000, None), (1000, None), (20, tiny_roberta()))
    result = part_memory(count, config)
    setup = {k: result[k] for k in ("grafts", "entries_per_graft", "files_mb", "load_ms_per_graft")}
    return {"setup": setup, "figures": {"peak_over_files": [result["peak_over_files"]]}}


MEASURES: dict[str, Callable[[str], dict]] = {
    "mask_step_roberta": mask_step("roberta-base-random"),
    "mask_step_minilm": mask_step("minilm-random"),
    "restriction_roberta": restriction("roberta-base-random"),
    "fisher_minilm": fisher,
    "surgical_minilm": surgical,
    "creation_llama": creation,
    "mixed_8": mixed(8, ("exact", "sparse_delta")),
    "mixed_32": mixed(32, ("sparse_delta",)),
    "decode_8": decode,
    "forward_graft": forward_graft,
    "switch_8": switch,
    "packed_1000": packed,
}
