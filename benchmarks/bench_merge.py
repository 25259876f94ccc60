"""The merge phase with the task vectors stacked per merge (as before) against stacked once (:class:`TaskVectorStack`).

A dev grid of TIES merges (``examples/run_merge.py``'s: lambda x density) of the same full task grafts (every entry
moved) runs both ways in one process, alternating the two ways round by round; each round times the whole phase
(``--merges`` merges; the new way includes building its stack). Before timing, the two ways' merged entries are checked
equal.

    python benchmarks/bench_merge.py                                   # 4 tasks, a MiniLM-sized body (22M entries)
    python benchmarks/bench_merge.py --hidden 64 --layers 2 --rounds 1 # a smoke run
    python benchmarks/bench_merge.py --against 64e350c                 # this checkout's phase beside a commit's

Prints one JSON line: the sizes, per way the median (and quartiles) of the phase's seconds, and the median of the
paired ratios stacked-once / per-merge. With ``--against REV``, each round runs the phase in a fresh process of this
checkout and one of ``REV`` (a git worktree; stacked once where ``REV`` has a ``TaskVectorStack``), alternating which
goes first, and the ratio is this checkout's / ``REV``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from against import alternate
from peft import get_peft_model
from torch import nn

from peft_graft import GraftConfig
from peft_graft.merging import merge_grafts

try:
    from peft_graft.merging import TaskVectorStack
except ImportError:  # a commit before it (--against): the per-merge way only
    TaskVectorStack = None


class Body(nn.Module):
    """A stack of transformer-block-shaped linear layers and LayerNorms (MiniLM's sizes by default)."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(self.block(hidden) for _ in range(layers))

    @staticmethod
    def block(hidden: int) -> nn.ModuleDict:
        square = (hidden, hidden)
        shapes = {"query": square, "key": square, "value": square, "output": square,
                  "intermediate": (hidden, 4 * hidden), "down": (4 * hidden, hidden)}  # fmt: skip
        linears = {name: nn.Linear(*shape) for name, shape in shapes.items()}
        return nn.ModuleDict({**linears, "norm": nn.LayerNorm(hidden)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            x = block["norm"](x + block["down"](block["intermediate"](block["output"](block["value"](x)))))
        return x


def grafted(hidden: int, layers: int, tasks: int):
    torch.manual_seed(0)
    pre = Body(hidden, layers).eval()
    base = {k: v.clone() for k, v in pre.state_dict().items()}  # get_peft_model grafts pre in place
    model = None
    for t in range(tasks):
        finetuned = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
        config = GraftConfig(finetuned=finetuned, sparsity=1.0)
        if model is None:
            model = get_peft_model(pre, config, adapter_name=f"t{t}")
        else:
            model.add_adapter(f"t{t}", config)
    return model, [f"t{t}" for t in range(tasks)]


def settings(count: int) -> list[dict]:
    """``count`` TIES settings of run_merge.py's grid (lambda x density, density the inner axis), as it scores them."""
    grid = [(w, d) for w in (0.3, 0.5, 0.7, 1.0) for d in (0.1, 0.3, 0.6)]
    return [dict(weights=w, density=d) for w, d in grid[:count]]


def phase(model, names: list[str], grid: list[dict], stacked: bool) -> float:
    start = time.perf_counter()
    extra = {"stack": TaskVectorStack(model, names)} if stacked else {}  # no stack= before TaskVectorStack
    for i, options in enumerate(grid):
        merge_grafts(model, names, "ties", f"m{i}", **extra, **options)
        model.delete_adapter(f"m{i}")
    return time.perf_counter() - start


def against(args: argparse.Namespace) -> dict:
    """This checkout's phase beside ``args.against``'s, each round in two fresh processes, alternating the order."""
    sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--tasks", str(args.tasks),
             "--merges", str(args.merges)] + (["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
    outputs = alternate("bench_merge.py", [*sizes, "--phase-only"], args.against, args.rounds)
    times = {way: [out["phase_s"] for out in outs] for way, outs in outputs.items()}
    ratios = [new / old for new, old in zip(times["this"], times["against"], strict=True)]
    return {"against": args.against, **{f"{way}_s": t for way, t in times.items()},
            "ratio_median": statistics.median(ratios)}  # fmt: skip


def check_equal(model, names: list[str]) -> None:
    stack = TaskVectorStack(model, names)
    merge_grafts(model, names, "ties", "old", weights=0.7, density=0.3)
    merge_grafts(model, names, "ties", "new", weights=0.7, density=0.3, stack=stack)
    for layer in model.base_model.graft_layers().values():
        old, new = layer.entries("old"), layer.entries("new")
        if not (torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])):
            raise AssertionError("The merges differ: the stacked task vectors are not the per-merge ones.")
    model.delete_adapter("old")
    model.delete_adapter("new")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--merges", type=int, default=12, help="merges per phase (run_merge.py's TIES grid: 12)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--against", default=None, help="a git revision whose phase is timed beside this checkout's")
    parser.add_argument("--phase-only", action="store_true", help=argparse.SUPPRESS)  # one phase, for --against
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against:
        out = {**against(args), "threads": args.threads, "load": list(os.getloadavg())}
        print(json.dumps(out))
        return out
    model, names = grafted(args.hidden, args.layers, args.tasks)
    if args.phase_only:
        seconds = phase(model, names, settings(args.merges), stacked=TaskVectorStack is not None)
        print(json.dumps({"phase_s": seconds, "stacked": TaskVectorStack is not None}))
        return {"phase_s": seconds}
    check_equal(model, names)
    grid = settings(args.merges)
    times: dict[str, list[float]] = {"per_merge": [], "stacked_once": []}
    for r in range(args.rounds):
        order = ("per_merge", "stacked_once") if r % 2 == 0 else ("stacked_once", "per_merge")
        for way in order:
            times[way].append(phase(model, names, grid, stacked=way == "stacked_once"))
    ratios = [new / old for new, old in zip(times["stacked_once"], times["per_merge"], strict=True)]
    entries = sum(layer.num_stored for layer in model.base_model.graft_layers().values())
    out = {
        "entries": entries,
        "tasks": args.tasks,
        "merges_per_phase": len(grid),
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "load": list(os.getloadavg()),
        **{f"{way}_s": {"median": statistics.median(t), "min": min(t), "max": max(t)} for way, t in times.items()},
        "ratio_median": statistics.median(ratios),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
