"""Mixed-graft batches (``model(**batch, adapter_names=[...])``) on a random RoBERTa-base-sized classifier
(125M parameters, built from ``RobertaConfig()``), batch 32 x 128, 2 threads.

Parts (current results: BENCHMARKS.md, "Serving and decoding"):

- ``design``: the two ways to apply 8 grafts to one batch, measured on RoBERTa-base's two Linear shapes (768 -> 768
  and 768 -> 3072) over 4,096 tokens, with grafts of 0.01%, 0.1% and 1% of the weight: (a) the base layer once per
  graft's examples with that graft's entries written in place (what the library does, bit-exact per example); (b) the
  base layer once for the whole batch plus each graft's sparse delta added to its examples' outputs
  (``y_i[:, rows] += x_i[:, cols] * dW[rows, cols]``, one gather and one ``index_add_`` per graft over flat indices).
  Ratios to the base layer, and (b)'s largest difference from (a).
- ``mixed``: 8 grafts of 0.01% (0.01% of every tensor, about 12,500 entries, each with its own classification head
  stored whole), example ``i`` asking for graft ``i % 8`` (spread over the batch; the exact mode and the
  ``"sparse_delta"`` mode, ``model.set_mixed_batch_mode``), one graft for the whole batch, and
  peft LoRA (r = 8 on query and value, 8 adapters, the shared head: peft's mixed batches refuse a RoBERTa head per
  adapter), each against the base model's forward on the same batch.
- ``scaling``: the mixed batch with 1, 8 and 32 distinct grafts of 0.01% (LoRA beside it with as many adapters), and
  with 8 grafts of 0.001%, 0.1% and 1%.
- ``memory`` (its own process): 1,000 grafts of 0.01% without heads (sparse entries only) loaded with
  ``load_adapter`` onto one base: peak RSS over the loaded base against the adapters' file sizes, load time per
  graft, then RSS after deleting all but one graft (``delete_adapter``; ``malloc_trim`` hands freed heap back).

Every mixed batch sets its mode (``set_mixed_batch_mode``) right before the call, so a figure measures the same thing
whatever the library's default mode is; ``default_mode`` reads that default. Every ratio is the median (and
quartiles) over rounds of the variant's time over the base's in the same round (and,
where LoRA runs in the rounds, of each graft variant's time over LoRA's: ``..._over_lora``); each round times the base
and every variant back to back, in an order rotated each round (``rounds``, ``paired_ratios``). The mixed and scaling
parts also record each call's median minor page faults (``..._faults``). Results are appended
to ``--out`` as JSON lines as each part finishes; a part already there is skipped (resumable).

Usage: ``python benchmarks/bench_mixed_batch.py [--parts design mixed scaling memory] [--repeats 5] [--out FILE]
[--cases 8:1e-4 32:1e-4] [--device cuda]`` (``--cases``: the scaling part's batches, ``grafts:fraction``;
``--device cuda``: the ``mixed`` and ``scaling`` parts on the GPU, each call timed between ``torch.cuda.synchronize()``
calls, the models built on the CPU and moved there).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import TINY_ROBERTA, make_pair, plain_copy, region_graft_config
from bench_timing import (
    fault_medians,
    load_average,
    peak_rss_mb,
    ratios,
    release_free_memory,
    reset_peak,
    rounds,
    rss_mb,
    wall_time,
)

import peft_graft  # noqa: F401  (registers the graft method)

BATCH, SEQ_LEN, GROUPS = 32, 128, 8
DEVICE = torch.device("cpu")  # --device: where the mixed and scaling parts run
SOURCES = 10  # distinct saved grafts behind the memory part's thousand


def batch(vocab_size: int, shape: tuple[int, int] = (BATCH, SEQ_LEN)) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab_size, shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def timer() -> functools.partial:
    """:func:`bench_timing.wall_time` on ``DEVICE`` (set by ``--device``), the timer of this script's rounds."""
    return functools.partial(wall_time, device=DEVICE)


def forward(model, inputs: dict, **kwargs):
    with torch.inference_mode():
        return model(**inputs, **kwargs).logits


def on_device(pre: torch.nn.Module, shape: tuple[int, int] = (BATCH, SEQ_LEN)) -> tuple[torch.nn.Module, dict]:
    """The base model (a plain copy of ``pre``) and the batch, on ``DEVICE``."""
    inputs = batch(pre.config.vocab_size, shape)
    return plain_copy(pre).to(DEVICE), {key: value.to(DEVICE) for key, value in inputs.items()}


# ------------------------------------------------------------------------------------------------ parts
def add_deltas(out: torch.Tensor, x: torch.Tensor, groups: list[tuple[torch.Tensor, tuple]]) -> torch.Tensor:
    """Design (b): ``out`` (the base layer's output on ``x``) with each group's sparse delta added to its examples'
    rows, touching only the entries' elements (one gather of ``x`` and one ``index_add_`` into ``out`` per group, over
    flat indices)."""
    batch_size, in_features, out_features = x.shape[0], x.shape[-1], out.shape[-1]
    x_flat, out_flat = x.contiguous().view(-1), out.view(-1)
    length = x.numel() // (batch_size * in_features)
    positions = torch.arange(length)
    for examples, (rows, columns, delta) in groups:
        tokens = (examples[:, None] * length + positions).view(-1, 1)
        inputs = x_flat.take(tokens * in_features + columns)
        out_flat.index_add_(0, (tokens * out_features + rows).view(-1), (inputs * delta).view(-1))
    return out


def design_variants(layer: torch.nn.Linear, x: torch.Tensor, groups: list[torch.Tensor], grafts: list[tuple]):
    """The two designs for one Linear: ``(in place per group, base output plus sparse deltas)``."""
    weight = layer.weight.data.view(-1)

    def in_place():
        y = None
        for index, (flat, _, _, delta) in zip(groups, grafts, strict=True):
            original = weight.take(flat)
            weight.put_(flat, original + delta)
            try:
                part = layer(x.index_select(0, index))
            finally:
                weight.put_(flat, original)
            y = part.new_empty((x.shape[0], *part.shape[1:])) if y is None else y
            y.index_copy_(0, index, part)
        return y

    deltas = [(index, (rows, cols, delta)) for index, (_, rows, cols, delta) in zip(groups, grafts, strict=True)]

    def sparse_deltas():
        return add_deltas(layer(x), x, deltas)

    return in_place, sparse_deltas


def part_design(repeats: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ_LEN, 768)
    groups = [torch.arange(g, BATCH, GROUPS) for g in range(GROUPS)]  # spread over the batch
    out = {}
    for features in (768, 3072):
        layer = torch.nn.Linear(768, features)
        for fraction in (1e-4, 1e-3, 1e-2):
            count = max(1, round(fraction * layer.weight.numel()))
            grafts = []
            for _ in range(GROUPS):
                flat = torch.randperm(layer.weight.numel())[:count].sort().values
                grafts.append((flat, flat // 768, flat % 768, 1e-2 * torch.randn(count)))
            in_place, sparse_deltas = design_variants(layer, x, groups, grafts)
            key = f"linear_768x{features}_{fraction:.2%}"
            with torch.inference_mode():
                variants = {"in_place": in_place, "sparse_deltas": sparse_deltas}
                times = rounds(variants, lambda: layer(x), repeats, timer=timer())  # noqa: B023
                out.update(ratios(key, times))
                out[f"{key}_sparse_deltas_max_abs_difference"] = float((sparse_deltas() - in_place()).abs().max())
    return out


def graft_model(pre, finetuned, distinct: int, fraction: float):
    from peft import get_peft_model

    model = get_peft_model(pre, region_graft_config(finetuned, fraction, seed=0), adapter_name="g0").eval()
    for g in range(1, distinct):
        model.add_adapter(f"g{g}", region_graft_config(finetuned, fraction, seed=g))
    return model.to(DEVICE)


def lora_model(base, distinct: int):
    from peft import LoraConfig, get_peft_model

    config = dict(r=8, lora_alpha=16, target_modules=["query", "value"], init_lora_weights=False)
    lora = get_peft_model(plain_copy(base), LoraConfig(**config), adapter_name="g0").eval()
    for g in range(1, distinct):
        lora.add_adapter(f"g{g}", LoraConfig(**config))
    return lora.to(DEVICE)


MODES = ("exact", "sparse_delta")
"""The mixed-batch modes timed (``model.set_mixed_batch_mode``), each set before every call: a figure means the same
whatever the library's default mode is."""


def mixed_variants(model, lora, inputs: dict, distinct: int, modes: tuple[str, ...] = MODES, single: bool = True):
    """The graft model's mixed batch in each of ``modes`` (``graft`` for the exact mode, ``graft_sparse_delta``), one
    graft for the whole batch (with 8 grafts, unless ``single`` is false), and LoRA's mixed batch."""
    names = [f"g{i % distinct}" for i in range(len(inputs["input_ids"]))]

    def mixed(mode: str):
        def run():
            model.set_mixed_batch_mode(mode)
            return forward(model, inputs, adapter_names=names)

        return run

    variants = {mode_variant(mode): mixed(mode) for mode in modes}
    if distinct == GROUPS and single:
        variants["graft_single"] = lambda: forward(model, inputs)
    if lora is not None:
        variants["lora"] = lambda: forward(lora, inputs, adapter_names=names)
    return variants


def default_mode() -> str:
    """The mode a graft model's mixed batches run in when none was set, read off a fresh graft model of a tiny
    RoBERTa as a mixed batch reads it: the tuner's ``mixed_batch_mode`` where set, else ``DEFAULT_MIXED_BATCH_MODE``
    of ``peft_graft/tuner/mixed_batch.py``."""
    from peft import get_peft_model
    from transformers import RobertaConfig

    from peft_graft.tuner.mixed_batch import DEFAULT_MIXED_BATCH_MODE

    pre, finetuned = make_pair(config=RobertaConfig(**TINY_ROBERTA))
    model = get_peft_model(pre, region_graft_config(finetuned, 1e-2, seed=0))
    return model.base_model.__dict__.get("mixed_batch_mode", DEFAULT_MIXED_BATCH_MODE)


def mode_variant(mode: str) -> str:
    """The name of the mixed batch in ``mode`` among the variants of :func:`rounds`."""
    return "graft" if mode == "exact" else f"graft_{mode}"


def time_mixed(distinct: int, fraction: float, repeats: int, config=None, shape=(BATCH, SEQ_LEN), modes=MODES,
               lora: bool = True, single: bool = True, faults: dict | None = None) -> tuple[dict, int]:  # fmt: skip
    """The rounds of ``distinct`` grafts of ``fraction`` of every tensor in mixed batches of ``shape`` (and LoRA with
    as many adapters unless ``lora`` is false; one graft for the whole batch unless ``single`` is false) against the
    base forward, on a fresh RoBERTa-base-sized model (or one of
    ``config``); and the entries of a graft."""
    pre, finetuned = make_pair(config=config)
    base, inputs = on_device(pre, shape)
    model = graft_model(pre, finetuned, distinct, fraction)
    del finetuned
    adapters = lora_model(base, distinct) if lora else None
    variants = mixed_variants(model, adapters, inputs, distinct, modes, single)
    times = rounds(variants, lambda: forward(base, inputs), repeats, faults, timer=timer())
    return times, model.get_region("g0").num_entries


def part_mixed(repeats: int) -> dict:
    """8 grafts of 0.01% and 8 LoRA adapters in mixed batches, timed round by round against one base forward."""
    faults = {}
    times, entries = time_mixed(GROUPS, 1e-4, repeats, faults=faults)
    result = {"entries_per_graft": entries}
    result.update(ratios("mixed_8", times))
    result.update(fault_medians("mixed_8", faults))
    return result


SCALING_CASES = ("1:1e-4", "8:1e-4", "32:1e-4", "8:1e-5", "8:1e-3", "8:1e-2")
"""The scaling part's mixed batches, ``grafts:fraction`` (``--cases``)."""


def part_scaling(repeats: int, cases: list[str] = SCALING_CASES) -> dict:
    """1, 8 and 32 distinct grafts of 0.01% (and 8 of 0.001%, 0.1%, 1%), or ``cases``, beside LoRA with as many
    adapters (at 0.01%), each against the base forward in the same rounds."""
    pre, finetuned = make_pair()
    base, inputs = on_device(pre)
    result = {}
    for distinct, fraction in ((int(c.split(":")[0]), float(c.split(":")[1])) for c in cases):
        model = graft_model(plain_copy(pre), finetuned, distinct, fraction)
        lora = lora_model(base, distinct) if fraction == 1e-4 else None
        faults = {}
        variants = mixed_variants(model, lora, inputs, distinct)
        times = rounds(variants, lambda: forward(base, inputs), repeats, faults, timer=timer())
        result.update(ratios(f"{distinct}_grafts_{fraction:.3%}", times))
        result.update(fault_medians(f"{distinct}_grafts_{fraction:.3%}", faults))
        del model, lora
    return result


def part_memory(count: int = 1000, config=None) -> dict:
    """``count`` grafts of 0.01% without heads loaded onto one base (RoBERTa-base-sized, or of ``config``)."""
    from peft import PeftModel, get_peft_model

    pre, finetuned = make_pair(config=config)
    with tempfile.TemporaryDirectory() as folder:
        maker = get_peft_model(pre, region_graft_config(finetuned, 1e-4, seed=0, heads=False), adapter_name="s0")
        for s in range(1, SOURCES):  # different grafts, each loaded count / SOURCES times under its own names
            maker.add_adapter(f"s{s}", region_graft_config(finetuned, 1e-4, seed=s, heads=False))
        maker.save_pretrained(folder)
        sources = [os.path.join(folder, f"s{s}") for s in range(SOURCES)]
        pre = maker.unload()
        del maker, finetuned
        file_bytes = [os.path.getsize(os.path.join(source, "adapter_model.safetensors")) for source in sources]
        model = PeftModel.from_pretrained(pre, sources[0], adapter_name="g0").eval()
        release_free_memory()
        before = rss_mb()
        reset_peak()
        start = time.perf_counter()
        for g in range(1, count):
            model.load_adapter(sources[g % SOURCES], adapter_name=f"g{g}")
        load_s = time.perf_counter() - start
        loaded_files_mb = sum(file_bytes[g % SOURCES] for g in range(1, count)) / 2**20
        peak_mb, after_mb = peak_rss_mb() - before, rss_mb() - before
        names = [f"g{(i * 37) % count}" for i in range(BATCH)]
        ids = torch.randint(3, pre.config.vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(0))
        model.set_mixed_batch_mode("exact")  # whatever the default
        with torch.inference_mode():
            model(input_ids=ids, adapter_names=names)  # serving a mixed batch from the thousand
        served_mb = rss_mb() - before
        start = time.perf_counter()
        for g in range(1, count):
            model.delete_adapter(f"g{g}")
        delete_s = time.perf_counter() - start
        release_free_memory()
        return {
            "grafts": count,
            "entries_per_graft": model.get_region("g0").num_entries,
            "file_bytes_per_graft": statistics.median(file_bytes),
            "files_mb": round(loaded_files_mb, 1),
            "peak_rss_over_base_mb": round(peak_mb, 1),
            "peak_over_files": round(peak_mb / loaded_files_mb, 2),
            "rss_over_base_after_loading_mb": round(after_mb, 1),
            "rss_over_base_after_a_mixed_forward_mb": round(served_mb, 1),
            "load_ms_per_graft": round(1e3 * load_s / (count - 1), 1),
            "delete_ms_per_graft": round(1e3 * delete_s / (count - 1), 2),
            "rss_over_base_after_deleting_mb": round(rss_mb() - before, 1),
        }


PARTS = {"design": part_design, "mixed": part_mixed, "scaling": part_scaling, "memory": part_memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grafts", type=int, default=1000, help="for the memory part")
    parser.add_argument("--cases", nargs="+", default=list(SCALING_CASES), help="the scaling part's grafts:fraction")
    parser.add_argument("--out", default="bench_mixed_batch.jsonl")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="for the mixed and scaling parts")
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(2 if DEVICE.type == "cpu" else min(8, os.cpu_count() or 1))  # on a GPU: building only
    hf_logging.set_verbosity_error()
    if args.child:
        part = PARTS[args.child]
        arguments = {"memory": (args.grafts,), "scaling": (args.repeats, args.cases)}.get(args.child, (args.repeats,))
        print(json.dumps(part(*arguments)))
        return
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as handle:
            done = {json.loads(line)["part"] for line in handle if line.strip()}
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, batch {BATCH} x {SEQ_LEN}")
    for name in args.parts:
        if name in done:
            print(f"{name}: already in {args.out}")
            continue
        load_before = load_average()
        command = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--repeats",
            str(args.repeats),
            "--grafts",
            str(args.grafts),
            "--device",
            args.device,
            "--cases",
            *args.cases,
        ]
        child = subprocess.run(command, capture_output=True, text=True)  # its own process: its own peak RSS
        if child.returncode:
            sys.exit(f"part {name} failed:\n{child.stderr[-5000:]}")
        output = child.stdout
        record = {"part": name, "device": args.device, "load_before": load_before, "load_after": load_average()}
        record.update(json.loads(output.strip().splitlines()[-1]))
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(name, json.dumps(record, indent=2), flush=True)


if __name__ == "__main__":
    main()
