"""Benchmarks of the graft method on a randomly initialised RoBERTa-base-sized classifier (about 125M parameters).

Figures (protocol and results in BENCHMARKS.md):

- ``topk``: time and added peak RSS of creating a graft of 12,500 entries (sparsity 1e-4) with ``get_peft_model``; the
  time of ``theta_ft - theta_pre`` of every tensor plus the exact global top-k (what the reference code's 3.4 s covers:
  the exactness pass, then the top-k's passes), and of the top-k alone (a strided sample computes the movement at its
  sampled entries only, then the pass over the entries above the sample's bound piece by piece as it reads). Runs in its
  own process; the added RSS is the peak during creation minus the RSS just before it (the peak is reset through
  ``/proc/self/clear_refs``).
- ``disk``: bytes per grafted entry of ``adapter_model.safetensors``, header excluded.
- ``switch``: ``set_adapter`` (unmerged inference) between two loaded grafts of 12,500 entries without heads, and
  among 8 loaded grafts of 0.01% of every tensor each with its own classification head (``modules_to_save``),
  timed call by call in turn: medians, quartiles and the paired ratio; then unmerge + set_adapter + merge (merged
  inference) between the two. ``--compare_with CHECKOUT`` times ``set_adapter`` against another checkout of the
  package instead (e.g. ``git worktree add /tmp/old <commit>``): a server process each, asked for rounds of
  switches in turn, the ratio of the rounds' medians.
- ``forward``: forward latency (batch 4 x 32, ``inference_mode``) against the base model's: an unmerged graft; two
  unmerged grafts served in turn (``set_adapter`` before each forward, timed with it); a merged graft. Each forward is
  timed right after one of the base model, and the figure is the median (and quartiles) of those pairs' ratios.

Usage: ``python benchmarks/bench_graft.py [--parts topk disk switch forward] [--repeats 15] [--compare_with DIR]
[--folder DIR]`` (``--folder``: where the switch part keeps its saved grafts, reused by later runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
from bench_models import make_pair, plain_copy, pretrained, region_graft_config
from bench_timing import paired_ratios, peak_rss_mb, reset_peak, rss_mb, timed
from transformers.utils import logging as hf_logging

import peft_graft  # registers the graft method
from peft_graft import GraftConfig
from peft_graft.regions import top_k_movement
from peft_graft.scores import compute_movement, eligible_tensors

NUM_ENTRIES = 12_500  # sparsity 1e-4 of the 125M parameters
HEAD_GRAFTS = 8  # the switch part's grafts with their own heads
BATCH, SEQ_LEN = 4, 32


def graft_config(finetuned, **kwargs) -> GraftConfig:
    kwargs = {"modules_to_save": ["classifier"], "task_type": "SEQ_CLS", **kwargs}
    return GraftConfig(finetuned=finetuned, num_entries=NUM_ENTRIES, **kwargs)


def part_topk(repeats: int) -> dict:
    from peft import get_peft_model

    from peft_graft.parameter_layout import build_layout

    pre, finetuned = make_pair()
    num_parameters = sum(p.numel() for p in pre.parameters())
    model_mb = num_parameters * 4 / 2**20
    before = rss_mb()
    reset_peak()
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


SWITCH_CASES = {
    "two_grafts": ["default", "b"],
    f"{HEAD_GRAFTS}_grafts_with_heads": [f"g{i}" for i in range(HEAD_GRAFTS)],
}
"""The switch part's sets of grafts, by case: their adapter names (see ``save_switch_grafts``)."""


def save_switch_grafts(folder: str, config=None) -> None:
    """Create the switch part's grafts and save each set under ``folder/<case>``: two grafts of 12,500 entries (top-k)
    without heads; 8 grafts of 0.01% of every tensor (``bench_models.region_graft_config``), each with its own
    classification head stored whole. ``config``: a smaller ``RobertaConfig`` than RoBERTa-base's."""
    from peft import get_peft_model

    pre, finetuned = make_pair(config=config)
    _, finetuned_b = make_pair(seed=7, config=config)
    model = get_peft_model(pre, graft_config(finetuned, modules_to_save=None))
    model.add_adapter("b", graft_config(finetuned_b, modules_to_save=None))
    model.save_pretrained(os.path.join(folder, "two_grafts"))
    del model, pre, finetuned_b
    names = SWITCH_CASES[f"{HEAD_GRAFTS}_grafts_with_heads"]
    first = region_graft_config(finetuned, 1e-4, seed=0)
    model = get_peft_model(pretrained(config=config), first, adapter_name=names[0])
    for seed, name in enumerate(names[1:], 1):
        model.add_adapter(name, region_graft_config(finetuned, 1e-4, seed=seed))
    model.save_pretrained(os.path.join(folder, f"{HEAD_GRAFTS}_grafts_with_heads"))


def adapter_folder(folder: str, case: str, name: str) -> str:
    """Where ``save_pretrained`` put adapter ``name`` of ``case`` ("default" at the top, the others in sub-folders)."""
    return os.path.join(folder, case, *([] if name == "default" else [name]))


@contextlib.contextmanager
def switch_grafts(folder: str | None, config=None) -> Iterator[str]:
    """A folder holding the switch part's saved grafts: ``folder`` (they are created there first unless every one is
    there already), or a temporary folder."""
    if folder is None:
        with tempfile.TemporaryDirectory() as temporary:
            save_switch_grafts(temporary, config)
            yield temporary
        return
    saved = [adapter_folder(folder, case, name) for case, names in SWITCH_CASES.items() for name in names]
    if not all(os.path.isfile(os.path.join(path, "adapter_config.json")) for path in saved):
        save_switch_grafts(folder)
    yield folder


def switch_cases(folder: str, config=None) -> dict:
    """The saved grafts of each case loaded onto a base model of their own (``load_adapter``, as for serving):
    ``(model, adapter names)`` by case."""
    from peft import PeftModel

    cases = {}
    for case, names in SWITCH_CASES.items():
        first = adapter_folder(folder, case, names[0])
        model = PeftModel.from_pretrained(pretrained(config=config), first, adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapter_folder(folder, case, name), adapter_name=name)
        cases[case] = (model, names)
    return cases


def switch_times(cases: dict, count: int) -> dict[str, list[float]]:
    """``count`` timed ``set_adapter`` calls per case, alternating between the cases call by call; each call switches
    its model to the next of its grafts in turn. A first round over every graft (unpacking loaded ones) is not timed."""
    times = {case: [] for case in cases}
    for step in range(-max(len(names) for _, names in cases.values()), count):
        for case, (model, names) in cases.items():
            start = time.perf_counter()
            model.set_adapter(names[step % len(names)])
            if step >= 0:
                times[case].append(time.perf_counter() - start)
    return times


def quartiles_ms(name: str, times: list[float]) -> dict:
    """The median and quartiles of ``times`` in ms."""
    quartiles = statistics.quantiles(times, n=4)
    return {
        f"{name}_ms": round(1e3 * quartiles[1], 4),
        f"{name}_ms_quartiles": [round(1e3 * q, 4) for q in quartiles[::2]],
    }


def part_switch(repeats: int, folder: str | None = None) -> dict:
    with switch_grafts(folder) as saved:
        cases = switch_cases(saved)
    times = switch_times(cases, repeats * 20)
    result = {
        "entries_per_graft": {case: model.get_region(names[1]).num_entries for case, (model, names) in cases.items()}
    }
    for case, case_times in times.items():
        result.update(quartiles_ms(f"{case}_set_adapter", case_times))
    heads = f"{HEAD_GRAFTS}_grafts_with_heads"
    result.update(paired_ratios(f"{heads}_over_two_grafts", times[heads], times["two_grafts"]))
    model, names = cases["two_grafts"]
    del cases
    model.set_adapter(names[0])
    model.merge_adapter()
    state = {"i": 0}

    def merged_switch():
        state["i"] ^= 1
        model.unmerge_adapter()
        model.set_adapter(names[state["i"]])
        model.merge_adapter()

    merged_switch()
    result["unmerge_set_merge_ms"] = round(1e3 * statistics.median(timed(merged_switch, repeats)), 3)
    return result


def switch_server(folder: str) -> None:
    """Child of ``--compare_with``: loads the switch cases saved in ``folder``, prints a ready line (the
    ``peft_graft`` it imported), then for each line ``N`` read from stdin prints the JSON of
    ``switch_times(cases, N)``."""
    cases = switch_cases(folder)
    print(json.dumps({"peft_graft": os.path.dirname(os.path.dirname(peft_graft.__file__))}), flush=True)
    for line in sys.stdin:
        print(json.dumps(switch_times(cases, int(line))), flush=True)


def compare_switch(checkout: str, repeats: int, folder: str | None = None, rounds: int = 20) -> dict:
    """``set_adapter`` with this checkout's ``peft_graft`` against ``checkout``'s (e.g. ``git worktree add /tmp/old
    <commit>``): one server process each (``switch_server``) on the same saved grafts, asked in turn for
    ``20 * repeats`` switches per round, which of them goes first alternating; the ratio of the two rounds' medians,
    per case, over ``rounds`` rounds."""
    roots = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "other": os.path.abspath(checkout)}
    command = [sys.executable, __file__, "--child", "switch_server", "--folder"]
    with switch_grafts(folder) as saved:  # created by this checkout, loaded by both
        servers = {  # PYTHONPATH: ahead of the installed (editable) package
            label: subprocess.Popen(
                [*command, saved],
                env={**os.environ, "PYTHONPATH": root},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for label, root in roots.items()
        }
        try:
            result = {
                f"{label}_peft_graft": json.loads(s.stdout.readline())["peft_graft"] for label, s in servers.items()
            }
            medians = {label: {} for label in servers}
            for round_ in range(rounds):
                for label in ("this", "other") if round_ % 2 else ("other", "this"):
                    servers[label].stdin.write(f"{20 * repeats}\n")
                    servers[label].stdin.flush()
                    for case, times in json.loads(servers[label].stdout.readline()).items():
                        medians[label].setdefault(case, []).append(statistics.median(times))
        finally:
            for server in servers.values():
                server.stdin.close()
                server.wait()
    for case in SWITCH_CASES:
        result.update(quartiles_ms(f"{case}_set_adapter_this", medians["this"][case]))
        result.update(quartiles_ms(f"{case}_set_adapter_other", medians["other"][case]))
        result.update(paired_ratios(f"{case}_this_over_other", medians["this"][case], medians["other"][case]))
    return result


def forward_times(repeats: int, config=None) -> dict[str, list[float]]:
    """Seconds of forwards (batch 4 x 32, ``inference_mode``) of an unmerged graft, of two grafts served in turn
    (``set_adapter`` before each forward, timed with it) and of a merged graft, each right after one of the base model:
    ``{variant: times, f"{variant}_base": the base's times beside them}``. RoBERTa-base-sized unless ``config``."""
    from peft import get_peft_model

    pre, finetuned = make_pair(config=config)
    _, finetuned_b = make_pair(seed=7, config=config)
    base = plain_copy(pre)
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

    times = {key: [] for key in ("unmerged", "unmerged_base", "switching", "switching_base", "merged", "merged_base")}
    switch_and_forward()
    switch_and_forward()
    forward(base)
    for _ in range(repeats):  # alternate: base, unmerged graft, base, switching graft
        times["unmerged_base"].extend(timed(lambda: forward(base), 1))
        times["unmerged"].extend(timed(lambda: forward(model), 1))
        times["switching_base"].extend(timed(lambda: forward(base), 1))
        times["switching"].extend(timed(switch_and_forward, 1))
    model.set_adapter("default")
    model.merge_adapter()
    forward(model)
    for _ in range(repeats):
        times["merged_base"].extend(timed(lambda: forward(base), 1))
        times["merged"].extend(timed(lambda: forward(model), 1))
    return times


def part_forward(repeats: int) -> dict:
    times = forward_times(repeats)
    return {
        "base_forward_ms": round(1e3 * statistics.median(times["unmerged_base"] + times["switching_base"]), 2),
        **{f"{v}_graft_forward_ms": round(1e3 * statistics.median(times[v]), 2) for v in ("unmerged", "switching")},
        "merged_graft_forward_ms": round(1e3 * statistics.median(times["merged"]), 2),
        **paired_ratios("unmerged_over_base", times["unmerged"], times["unmerged_base"]),
        **paired_ratios("switching_over_base", times["switching"], times["switching_base"]),
        **paired_ratios("merged_over_base", times["merged"], times["merged_base"]),
    }


PARTS = {"topk": part_topk, "disk": part_disk, "switch": part_switch, "forward": part_forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compare_with", metavar="CHECKOUT", help="switch part only: time against this checkout")
    parser.add_argument("--child", choices=[*PARTS, "switch_server"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help="switch part: keep its saved grafts here (reused when present)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    if args.child == "switch_server":
        switch_server(args.folder)
        return
    if args.child:
        part = PARTS[args.child]
        arguments = {"disk": (), "switch": (args.repeats, args.folder)}.get(args.child, (args.repeats,))
        result = part(*arguments)
        print(json.dumps(result))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {NUM_ENTRIES} grafted entries")
    if args.compare_with:
        print("switch", json.dumps(compare_switch(args.compare_with, args.repeats, args.folder), indent=2))
        return
    for name in args.parts:  # each part in its own process, so peak memory is its own
        command = [sys.executable, __file__, "--child", name, "--repeats", str(args.repeats)]
        command += ["--folder", args.folder] if args.folder else []
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(name, json.dumps(json.loads(output.strip().splitlines()[-1]), indent=2))


if __name__ == "__main__":
    main()
