"""How the costs of a mask step grow: against model size and against the search-space fraction.

    python benchmarks/bench_cost_growth.py            # llama-22m, -125m, -400m, -1b; fractions on llama-125m
    python benchmarks/bench_cost_growth.py --quick    # tiny models (0.4M-22M), to check the script
    python benchmarks/bench_cost_growth.py --plot-only  # redraw the figure and the tables from the JSON

Each model runs ``benchmarks/bench_mask_step.py --timing isolated``: plain SGD and every mask variant each in its own
process, one after the other (build, one warm-up step, ``--repeats`` timed steps, the median; peak RSS of the steps,
RSS after loading theta_pre, peak while creating the graft). The models are one Llama family that varies only in size
(``LLAMA_FAMILY`` in bench_models.py: vocabulary 32,000, tied embeddings, head size 64, grouped-query attention):

    llama-22m   hidden 384,  6 layers,  6 heads, 2 kv heads, MLP 1024:   21.7M parameters
    llama-125m  hidden 768,  12 layers, 12 heads, 4 kv heads, MLP 3072: 128.4M
    llama-400m  hidden 1024, 24 layers, 16 heads, 4 kv heads, MLP 4096: 397.7M
    llama-1b    hidden 2048, 16 layers, 32 heads, 8 kv heads, MLP 8192: 1038.7M (Llama-3.2-1B with 32,000 tokens)

all at the same batch (bench_models' ``LLAMA_BATCH``, 2 x 64 tokens; ``--batch`` changes it), with theta_ft =
theta_pre plus bench_models' structured perturbation, read from its cache. Against size: ``--size-search``
(default the search space ``0.01``; add ``none`` for the dense S where it fits). Against the fraction:
``--fraction-model`` (default llama-125m) at ``--fractions`` (default 1e-4 1e-3 1e-2 1e-1 and ``none``, the paper's
dense S). Variants estimated not to fit in the available memory are skipped (``--force`` runs them).

Writes ``<out>.json`` (every measurement) and ``<out>.png`` (four panels: step time and peak memory against size and
against the fraction), and prints the tables in Markdown. ``--out`` defaults to ``benchmarks/figures/cost_growth``
(figures of the examples live in ``examples/figures``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE / "bench_mask_step.py"
SIZES = ["llama-22m", "llama-125m", "llama-400m", "llama-1b"]
QUICK_SIZES = ["llama-0.4m", "llama-2m", "llama-6m", "llama-22m"]
FRACTIONS = ["1e-4", "1e-3", "1e-2", "1e-1", "none"]


def measure(args: argparse.Namespace, model: str, variants: list[str]) -> dict:
    """One run of bench_mask_step.py (its output goes to this one's); its JSON record."""
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "record.json"
        command = [sys.executable, str(BENCH), "--model", model, "--timing", "isolated", "--search", *variants]
        command += ["--repeats", str(args.repeats), "--threads", str(args.threads), "--device", args.device]
        command += ["--dtype", args.dtype, "--cache", args.cache, "--json", str(record)]
        command += ["--batch", args.batch] if args.batch else []
        command += ["--force"] if args.force else []
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
        return json.loads(record.read_text())


def rows_of(record: dict, variants: list[str]) -> list[dict]:
    """One row per mask variant: plain and mask step time, ratio, memory of both."""
    plain = record["results"]["plain"]
    parameters = record["parameters"] or plain.get("state", {}).get("parameters")
    rows = []
    for variant in variants:
        mask = record["results"].get(variant, {})
        base = variant.split(":")[0]
        candidates = mask.get("state", {}).get("candidates")
        if base == "none":
            fraction = None
        elif any(c in base for c in ".e"):
            fraction = float(base)
        else:  # search_entries
            fraction = candidates / parameters if candidates and parameters else None
        row = {
            "model": record["model"],
            "parameters": parameters,
            "variant": variant,
            "fraction": fraction,
            "plain_s": plain.get("median_s"),
            "mask_s": mask.get("median_s"),
            "ratio": mask.get("ratio"),
            "plain_peak_gb": plain.get("peak_gb"),
            "mask_peak_gb": mask.get("peak_gb"),
            "load_gb": mask.get("rss_after_load_gb", plain.get("rss_after_load_gb")),
            "mask_creation_peak_gb": mask.get("creation_peak_gb"),
            "candidates": candidates,
            "note": mask.get("skipped") or mask.get("error"),
        }
        rows.append(row)
    return rows


def markdown(rows: list[dict], unit: str) -> list[str]:
    def cell(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"| model | parameters | search | plain step | mask step | ratio | plain peak | mask peak | after load | "
        f"creation peak ({unit}) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        search = "dense S" if r["variant"] == "none" else r["variant"]
        if r["note"]:
            search += f" ({r['note']})"
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {search} | {cell(r['plain_s'], '.3f')} s | "
            f"{cell(r['mask_s'], '.3f')} s | {cell(r['ratio'], '.2f')}x | {cell(r['plain_peak_gb'], '.2f')} | "
            f"{cell(r['mask_peak_gb'], '.2f')} | {cell(r['load_gb'], '.2f')} | "
            f"{cell(r['mask_creation_peak_gb'], '.2f')} |"
        )
    return lines


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "GiB allocated (GPU)" if data["device"] == "cuda" else "GiB RSS"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    size_rows = [r for r in data["by_size"] if r["mask_s"] is not None]
    for variant in dict.fromkeys(r["variant"] for r in size_rows):
        mine = [r for r in size_rows if r["variant"] == variant]
        x = [r["parameters"] / 1e6 for r in mine]
        label = "dense S" if variant == "none" else f"search_fraction={variant}"
        axes[0, 0].plot(x, [r["mask_s"] for r in mine], "o-", label=f"mask, {label}")
        axes[0, 1].plot(x, [r["mask_peak_gb"] for r in mine], "o-", label=f"mask step peak, {label}")
        axes[0, 1].plot(x, [r["mask_creation_peak_gb"] for r in mine], "^:", label=f"creating the graft, {label}")
    plain = {r["model"]: r for r in data["by_size"] if r["plain_s"] is not None}.values()
    x = [r["parameters"] / 1e6 for r in plain]
    axes[0, 0].plot(x, [r["plain_s"] for r in plain], "s--", color="black", label="plain SGD")
    axes[0, 1].plot(x, [r["plain_peak_gb"] for r in plain], "s--", color="black", label="plain SGD step peak")
    axes[0, 1].plot(x, [r["load_gb"] for r in plain], "x:", color="grey", label="after loading theta_pre")
    for ax, ylabel in ((axes[0, 0], "step time (s)"), (axes[0, 1], f"memory ({unit})")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_title("against model size")
    axes[0, 1].set_title("against model size")

    frac_rows = [r for r in data["by_fraction"] if r["mask_s"] is not None]
    if frac_rows:
        model = frac_rows[0]["model"]
        capped = sorted((r for r in frac_rows if r["fraction"] is not None), key=lambda r: r["fraction"])
        dense = [r for r in frac_rows if r["fraction"] is None]
        dense_x = 10 ** math.ceil(math.log10(max([r["fraction"] for r in capped], default=0.1)) + 1)
        plain_row = frac_rows[0]
        for ax, key, plain_key, ylabel in (
            (axes[1, 0], "mask_s", "plain_s", "step time (s)"),
            (axes[1, 1], "mask_peak_gb", "plain_peak_gb", f"step peak ({unit})"),
        ):
            ax.plot([r["fraction"] for r in capped], [r[key] for r in capped], "o-", label="mask, search space")
            if dense:
                ax.plot([dense_x], [dense[0][key]], "D", color="tab:red", label="mask, dense S (paper)")
            ax.axhline(plain_row[plain_key], color="black", ls="--", label="plain SGD")
            if key == "mask_peak_gb":
                ax.plot([r["fraction"] for r in capped], [r["mask_creation_peak_gb"] for r in capped], "^:",
                        label="creating the graft")  # fmt: skip
                ax.axhline(plain_row["load_gb"], color="grey", ls=":", label="after loading theta_pre")
            ax.set_xscale("log")
            ticks = [r["fraction"] for r in capped] + ([dense_x] if dense else [])
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks[: len(capped)]] + (["dense"] if dense else []))
            ax.set_xlabel("search_fraction (share of the eligible entries S covers)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: against the search fraction")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(
        f"MaskTrainer step vs plain SGD step: {data['device']}, {data['dtype']}, {data['threads']} threads, "
        f"batch {data['batch']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", help=f"models of the size sweep (default {' '.join(SIZES)})")
    parser.add_argument("--size-search", nargs="+", default=["0.01"], help="mask variants of the size sweep")
    parser.add_argument("--fraction-model", help="model of the fraction sweep (default llama-125m)")
    parser.add_argument("--fractions", nargs="+", default=FRACTIONS, help="mask variants of the fraction sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", help="examples x tokens for every model, e.g. 2x64 (default: bench_mask_step's)")
    parser.add_argument("--cache", help="theta_ft checkpoints (default: bench_mask_step's)")
    parser.add_argument("--out", help="writes OUT.json and OUT.png (default benchmarks/figures/cost_growth; --quick: "
                        "cost_growth_quick in the temporary folder)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"tiny models ({' '.join(QUICK_SIZES)}), 2 repeats")
    parser.add_argument("--force", action="store_true", help="run variants estimated not to fit in memory")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT.png and the tables from OUT.json")
    args = parser.parse_args()
    default = HERE / "figures" / "cost_growth" if not args.quick else Path(tempfile.gettempdir()) / "cost_growth_quick"
    out = Path(args.out or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        data = json.loads(out.with_suffix(".json").read_text())
    else:
        sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
        fraction_model = args.fraction_model or ("llama-2m" if args.quick else "llama-125m")
        if args.quick and args.repeats == parser.get_default("repeats"):
            args.repeats = 2
        if args.cache is None:
            sys.path.insert(0, str(HERE))
            from bench_models import DEFAULT_CACHE

            args.cache = DEFAULT_CACHE
        start = time.perf_counter()
        data = {"device": args.device, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
                "by_size": [], "by_fraction": [], "records": []}  # fmt: skip
        models = list(dict.fromkeys([*sizes, fraction_model]))
        for model in models:
            variants = list(args.size_search) if model in sizes else []
            if model == fraction_model:
                variants = list(dict.fromkeys([*variants, *args.fractions]))
            record = measure(args, model, variants)
            data["records"].append(record)
            data["batch"] = "x".join(map(str, record["batch"]))
            if model in sizes:
                data["by_size"] += rows_of(record, args.size_search)
            if model == fraction_model:
                data["by_fraction"] += rows_of(record, args.fractions)
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))  # after each model: partial results
        data["total_s"] = time.perf_counter() - start
        data["load_average_end"] = os.getloadavg()
        out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    unit = "GiB allocated" if data["device"] == "cuda" else "GiB RSS"
    print("\nAgainst model size:\n" + "\n".join(markdown(data["by_size"], unit)))
    print("\nAgainst the search fraction:\n" + "\n".join(markdown(data["by_fraction"], unit)))
    plot(data, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    if "total_s" in data:
        print(f"total {data['total_s'] / 60:.1f} min, load average at the end {data['load_average_end']}")


if __name__ == "__main__":
    main()
