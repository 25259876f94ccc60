"""Benchmarks of the graft method on a randomly initialised RoBERTa-base-sized classifier (about 125M parameters).

Figures (protocol and results in BENCHMARKS.md):

- ``topk``: time and added peak RSS of creating a graft of 12,500 entries (sparsity 1e-4) with ``get_peft_model``;
  the time of ``theta_ft - theta_pre`` of every tensor plus the exact global top-k (what the reference code's 3.4 s
  covers: the exactness pass, then the top-k's passes), and of the top-k alone (its two passes compute the movement
  piece by piece as they read it). Runs in its own process; the added RSS is the
  peak during creation minus the RSS just before it (the peak is reset through ``/proc/self/clear_refs``).
- ``disk``: bytes per grafted entry of ``adapter_model.safetensors``, header excluded.
- ``switch``: switching between two loaded grafts of 12,500 entries: ``set_adapter`` (unmerged inference) and
  unmerge + merge (merged inference).
- ``forward``: forward latency (batch 4 x 32, ``inference_mode``) against the base model's: an unmerged graft; two
  unmerged grafts served in turn (``set_adapter`` before each forward, timed with it); a merged graft. Each forward is
  timed right after one of the base model, and the figure is the median (and quartiles) of those pairs' ratios.

Usage: ``python benchmarks/bench_graft.py [--parts topk disk switch forward] [--repeats 15]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import RobertaConfig, RobertaForSequenceClassification
from transformers.utils import logging as hf_logging

import peft_graft  # noqa: F401  (registers the graft method)
from peft_graft import GraftConfig
from peft_graft.regions import top_k_movement
from peft_graft.scores import compute_movement, eligible_tensors

NUM_ENTRIES = 12_500  # sparsity 1e-4 of the 125M parameters
BATCH, SEQ_LEN = 4, 32


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def make_pair(seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A random RoBERTa-base-sized classifier and a "fine-tuned" state dict: every entry moved by noise."""
    torch.manual_seed(seed)
    pre = RobertaForSequenceClassification(RobertaConfig(num_labels=2)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    finetuned = {}
    for name, tensor in pre.state_dict().items():
        finetuned[name] = (
            tensor + 1e-3 * torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() else tensor
        )
    return pre, finetuned


def graft_config(finetuned, **kwargs) -> GraftConfig:
    kwargs = {"modules_to_save": ["classifier"], "task_type": "SEQ_CLS", **kwargs}
    return GraftConfig(finetuned=finetuned, num_entries=NUM_ENTRIES, **kwargs)


def timed(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def part_topk(repeats: int) -> dict:
    from peft import get_peft_model

    from peft_graft.parameter_layout import build_layout

    pre, finetuned = make_pair()
    num_parameters = sum(p.numel() for p in pre.parameters())
    model_mb = num_parameters * 4 / 2**20
    before = rss_mb()
    reset_peak_rss()
    start = time.perf_counter()
    model = get_peft_model(pre, graft_config(finetuned))
    create_s = time.perf_counter() - start
    added_mb = peak_rss_mb() - before
    entries = model.get_region().num_entries

    layout = build_layout(pre)
    config = graft_config(finetuned)
    movement = compute_movement(
        finetuned,
        layout,
        eligible_tensors(layout, config.include_parameters, config.exclude_parameters, config.modules_to_save),
        only_moved=True,
    )
    k = config.budget(sum(movement.numel(name) for name in movement))
    top_k_movement(movement, k)  # warm-up
    topk_s = statistics.median(timed(lambda: top_k_movement(movement, k), repeats))

    def movement_and_top_k():
        top_k_movement(
            compute_movement(
                finetuned,
                layout,
                eligible_tensors(layout, config.include_parameters, config.exclude_parameters, config.modules_to_save),
                only_moved=True,
            ),
            k,
        )

    movement_and_top_k_s = statistics.median(timed(movement_and_top_k, repeats))
    return {
        "num_parameters": num_parameters,
        "model_fp32_mb": round(model_mb, 1),
        "entries": entries,
        "create_graft_s": round(create_s, 3),
        "create_added_peak_rss_mb": round(added_mb, 1),
        "create_added_peak_rss_in_fp32_copies": round(added_mb / model_mb, 2),
        "global_top_k_s": round(topk_s, 3),
        "movement_and_global_top_k_s": round(movement_and_top_k_s, 3),
    }


def part_disk() -> dict:
    from peft import get_peft_model

    pre, finetuned = make_pair()
    # No head stored whole (as for a prompt-based graft): the file holds the sparse entries alone.
    model = get_peft_model(pre, graft_config(finetuned, modules_to_save=None, task_type=None))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        path = os.path.join(folder, "adapter_model.safetensors")
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            header = 8 + int.from_bytes(handle.read(8), "little")
    entries = model.get_region().num_entries
    return {
        "entries": entries,
        "file_bytes": size,
        "header_bytes": header,
        "bytes_per_entry_without_header": round((size - header) / entries, 3),
    }


def part_switch(repeats: int) -> dict:
    from peft import get_peft_model

    pre, finetuned_a = make_pair()
    _, finetuned_b = make_pair(seed=7)
    model = get_peft_model(pre, graft_config(finetuned_a, modules_to_save=None))
    with tempfile.TemporaryDirectory() as folder:
        other = graft_config(finetuned_b, modules_to_save=None)
        model.add_adapter("b", other)
        model.save_pretrained(folder)  # both adapters, then reload "b" as a loaded graft
        model.delete_adapter("b")
        model.load_adapter(os.path.join(folder, "b"), adapter_name="b")
    names = ["default", "b"]
    state = {"i": 0}

    def set_adapter():
        state["i"] ^= 1
        model.set_adapter(names[state["i"]])

    set_adapter()
    set_s = timed(set_adapter, repeats * 20)
    model.set_adapter("default")
    model.merge_adapter()

    def merged_switch():
        state["i"] ^= 1
        model.unmerge_adapter()
        model.set_adapter(names[state["i"]])
        model.merge_adapter()

    merged_switch()
    merged_s = timed(merged_switch, repeats)
    return {
        "entries_per_graft": model.get_region("b").num_entries,
        "set_adapter_ms": round(1e3 * statistics.median(set_s), 4),
        "unmerge_set_merge_ms": round(1e3 * statistics.median(merged_s), 3),
    }


def part_forward(repeats: int) -> dict:
    from peft import get_peft_model

    pre, finetuned = make_pair()
    _, finetuned_b = make_pair(seed=7)
    base = RobertaForSequenceClassification(pre.config).eval()
    base.load_state_dict(pre.state_dict())
    model = get_peft_model(pre, graft_config(finetuned)).eval()
    model.add_adapter("b", graft_config(finetuned_b))
    ids = torch.randint(3, pre.config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    names, state = ["default", "b"], {"i": 0}

    def forward(m):
        with torch.inference_mode():
            m(input_ids=ids)

    def switch_and_forward():  # serving two grafts in turn: set_adapter before every batch
        state["i"] ^= 1
        model.set_adapter(names[state["i"]])
        forward(model)

    plain, unmerged, switching = [], [], []
    switch_and_forward()
    switch_and_forward()
    forward(base)
    for _ in range(repeats):  # alternate: base, unmerged graft, base, switching graft
        plain.extend(timed(lambda: forward(base), 1))
        unmerged.extend(timed(lambda: forward(model), 1))
        plain.extend(timed(lambda: forward(base), 1))
        switching.extend(timed(switch_and_forward, 1))
    model.set_adapter("default")
    model.merge_adapter()
    forward(model)
    plain_merged, merged = [], []
    for _ in range(repeats):
        plain_merged.extend(timed(lambda: forward(base), 1))
        merged.extend(timed(lambda: forward(model), 1))
    return {
        "base_forward_ms": round(1e3 * statistics.median(plain), 2),
        "unmerged_graft_forward_ms": round(1e3 * statistics.median(unmerged), 2),
        "switching_graft_forward_ms": round(1e3 * statistics.median(switching), 2),
        "merged_graft_forward_ms": round(1e3 * statistics.median(merged), 2),
        **paired_ratios("unmerged_over_base", unmerged, plain[0::2]),
        **paired_ratios("switching_over_base", switching, plain[1::2]),
        **paired_ratios("merged_over_base", merged, plain_merged),
    }


def paired_ratios(name: str, times: list[float], base_times: list[float]) -> dict:
    """The median and quartiles of ``time / base time`` over pairs measured back to back: the load of the machine
    drifts over a run (base forwards of 150 to 210 ms), and a ratio of medians would carry that drift."""
    quartiles = statistics.quantiles([t / b for t, b in zip(times, base_times, strict=True)], n=4)
    return {name: round(quartiles[1], 3), f"{name}_quartiles": [round(quartiles[0], 3), round(quartiles[2], 3)]}


PARTS = {"topk": part_topk, "disk": part_disk, "switch": part_switch, "forward": part_forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    if args.child:
        part = PARTS[args.child]
        result = part() if args.child == "disk" else part(args.repeats)
        print(json.dumps(result))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {NUM_ENTRIES} grafted entries")
    for name in args.parts:  # each part in its own process, so peak memory is its own
        command = [sys.executable, __file__, "--child", name, "--repeats", str(args.repeats)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(name, json.dumps(json.loads(output.strip().splitlines()[-1]), indent=2))


if __name__ == "__main__":
    main()
