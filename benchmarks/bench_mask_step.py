"""Cost of one MaskTrainer step against one plain SGD fine-tuning step on the same model and batch.

    python benchmarks/bench_mask_step.py --model roberta-base-random   # 125M random classifier, batch 4 x 32
    python benchmarks/bench_mask_step.py --model all-MiniLM-L6-v2      # batch 32 x 64
    python benchmarks/bench_mask_step.py --model llama-1b-random --search 0.01 --repeats 3   # 1.24B causal LM, 2 x 64
    python benchmarks/bench_mask_step.py --model llama-1b-random --device cuda --dtype bfloat16 --search none 0.01

This script is the driver (command line, report); the trainers are in ``mask_trainers.py``, the paper's step in
``mask_reference.py``, building and stepping them in ``mask_steps.py``, the kept state per parameter in
``mask_memory.py`` and the one-layer table in ``mask_layers.py``.

Timing (``--timing``): ``lockstep`` (the default for the two encoder models) builds plain SGD and every mask variant
each in its own process (one after the other) and, after a warm-up each, times ``--repeats`` pairs per variant: a plain
step and a variant step back to back, in turn first (plain first in even pairs), each process stepping when this one
tells it to. It prints the median step of each, and per variant the median and quartiles of the paired ratios (each
variant step over the plain step beside it), which a drifting or loaded host moves far less than a ratio of medians.
``alternate`` times the same pairs with every trainer in this process: there the trainers share glibc's heap, so which
step takes page faults for fresh memory depends on what the other trainers allocated and gave back (BENCHMARKS.md at
64e350c, "Page faults" and "Lockstep processes"); in lockstep each trainer has the heap it would have alone. Each timed
step's minor page faults are counted and printed per variant, paired and in the memory processes. ``--clock cpu`` times
the CPU time of the main thread instead of the wall clock: with ``--threads 1`` the step runs on it, and other processes
on the host stop counting (they still share the caches). ``isolated`` (the default for the Llama models, which do not
fit twice in memory) runs each variant alone in its own process, one after the other: build, one warm-up step, then
``--repeats`` timed steps. The memory of each variant is measured in its own process: peak RSS of its steps (VmHWM reset
through ``/proc/self/clear_refs`` once the trainer is built and ``malloc_trim`` has returned what creating it freed),
the RSS after loading the pre-trained model, and the peak while creating the trainer (``get_peft_model``; VmHWM reset
after loading). With ``--device cuda`` the memory is ``torch.cuda.max_memory_allocated`` (reset the same way) and the
steps are timed between ``torch.cuda.synchronize()`` calls.

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
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import (
    DEFAULT_CACHE,
    DTYPES,
    FINGERPRINT_FILE,
    MODELS,
    finetuned_dir,
    num_parameters,
    prepare_finetuned,
)
from bench_timing import available_gb, ratio_quartiles
from mask_layers import time_layers
from mask_memory import bytes_per_parameter, estimated_peak_gb, on_paper
from mask_steps import CLOCKS, configure, profile_steps, run_variant, time_all, time_lockstep
from mask_trainers import REFERENCE, SPARSE_IS_CHEAPER, search_space


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
