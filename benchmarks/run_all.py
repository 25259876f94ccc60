"""Re-measure every performance claim of the README and the guides on this host, and table the results.

    python benchmarks/run_all.py --quick --out benchmarks/results/HOST.json   # at most about 10 minutes on 2 cores
    python benchmarks/run_all.py --out benchmarks/results/HOST.json           # the scripts' usual repeats
    python benchmarks/run_all.py --render      # the claims table of BENCHMARKS.md from benchmarks/results/*.json
    python benchmarks/run_all.py --smoke       # tiny models, one round: checks the wiring, measures nothing

Each claim of ``claims.py`` names a measurement of ``measures.py`` (which calls the benchmark scripts' own functions)
and one of its figures. Each measurement runs in its own process, with 2 torch threads: the variant and its baseline
side by side in that process (or each in its own process, stepped in turns, for the mask step), alternating, after a
warm-up; a figure is the median and quartiles of its per-round ratios. The run prints each claim's claimed and
measured values, the tolerance and a verdict (holds / does not hold here), and ``--out`` writes one JSON file: the
host (CPU model, cores, torch, GPU if any), the commit, the date, the load average before and after, each
measurement's set-up and seconds, and each claim's result. ``--quick`` runs fewer rounds of the same shapes; a claim
whose shapes would not fit is itself about smaller ones (the creation claim is about llama-22m). ``--only ID...``
runs the measurements of some claims. Nothing is timed on a GPU: the claims are CPU figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_timing import load_average, ratio_quartiles  # noqa: E402
from claims import CLAIMS, check_registry, value_text  # noqa: E402
from measures import MEASURES, SIZES  # noqa: E402
from render import PAGE, RESULTS, update_page  # noqa: E402

THREADS = 2


def host() -> dict:
    """CPU model, cores, versions and GPU of this host."""
    import peft
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": platform.python_version(), "gpu": gpu}  # fmt: skip


def commit() -> tuple[str, bool]:
    """The checkout's commit and whether it has uncommitted changes (``"unknown"`` outside git)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def measure_here(name: str, size: str) -> dict:
    """One measurement in this process (``--measure``), with the run's threads and quiet transformers."""
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(THREADS)
    hf_logging.set_verbosity_error()
    return MEASURES[name](size)


def measure_in_process(name: str, size: str) -> dict:
    """One measurement in its own process: its set-up and figures, seconds and load; or its error."""
    load_before, start = load_average(), time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", name, "--size", size]
    done = subprocess.run(command, capture_output=True, text=True)
    out = {"seconds": round(time.perf_counter() - start, 1), "load_before": load_before, "load_after": load_average()}
    if done.returncode != 0:
        return {**out, "error": f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return {**out, **json.loads(done.stdout.strip().splitlines()[-1])}


def claim_results(measurements: dict[str, dict]) -> dict[str, dict]:
    """Each claim's median and quartiles from its measurement's figure, and its verdict; an error where there is
    none."""
    out = {}
    for claim in CLAIMS:
        measured = measurements.get(claim.measure)
        if measured is None:
            continue
        if "error" in measured:
            out[claim.id] = {"error": f"measurement {claim.measure} failed"}
            continue
        values = measured["figures"].get(claim.figure)
        if not values:
            out[claim.id] = {"error": f"measurement {claim.measure} has no figure {claim.figure!r}"}
            continue
        low, median, high = ratio_quartiles(values)
        out[claim.id] = {"median": round(median, 4), "quartiles": [round(low, 4), round(high, 4)], "n": len(values),
                         "claimed": claim.claimed, "tolerance": claim.tolerance, "target": claim.target,
                         "unit": claim.unit, "verdict": claim.verdict(median)}  # fmt: skip
    return out


def report_line(claim_id: str, result: dict) -> str:
    claim = next(c for c in CLAIMS if c.id == claim_id)
    if "error" in result:
        return f"  {claim_id:<32} claimed {claim.claimed_text():<20} {result['error']}"
    low, high = result["quartiles"]
    measured = f"{value_text(result['median'], claim.unit)} ({low:.3g}-{high:.3g}, {result['n']} values)"
    return f"  {claim_id:<32} claimed {claim.claimed_text():<20} measured {measured:<32} {result['verdict']}"


def write_json(path: Path, record: dict) -> None:
    """``record`` to ``path`` atomically (a temporary file in the same folder, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(record, handle, indent=1)
        handle.write("\n")
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, path)


def selected(only: list[str] | None) -> list[str]:
    """The measurements the claims ``only`` (all when ``None``) need, in the registry's order."""
    ids = {claim.id for claim in CLAIMS}
    unknown = sorted(set(only or []) - ids)
    if unknown:
        raise ValueError(
            f"--only: unknown claim ids {unknown}; the ids are those of benchmarks/claims.py: {sorted(ids)}"
        )
    names = [claim.measure for claim in CLAIMS if only is None or claim.id in only]
    return list(dict.fromkeys(names))


def run(size: str, only: list[str] | None, out: Path | None) -> dict:
    names = selected(only)
    sha, dirty = commit()
    record = {"format": 1, "size": size, "host": host(), "commit": sha, "dirty": dirty, "threads": THREADS,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "load_before": load_average()}  # fmt: skip
    about = record["host"]
    changes = " (uncommitted changes)" if dirty else ""
    print(f"{about['cpu']}, {about['cores']} cores, torch {about['torch']}, commit {sha[:7]}{changes}, load "
          f"{record['load_before']}; --{size}", flush=True)  # fmt: skip
    start, measurements = time.perf_counter(), {}
    for name in names:
        measurements[name] = measure_in_process(name, size)
        status = "failed" if "error" in measurements[name] else "done"
        print(f"{name}: {status} in {measurements[name]['seconds']:.0f} s", flush=True)
        if "error" in measurements[name]:
            print(measurements[name]["error"][-1500:], file=sys.stderr)
    record.update(wall_s=round(time.perf_counter() - start, 1), load_after=load_average())
    record["measurements"] = measurements
    record["claims"] = claim_results(measurements)
    print(f"\nclaims ({record['wall_s'] / 60:.1f} min, load {record['load_after']} at the end):")
    for claim_id, result in record["claims"].items():
        print(report_line(claim_id, result))
    if out is not None:
        write_json(out, record)
        print(f"written to {out}")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer rounds, the same shapes (about 10 min on 2 cores)")
    size.add_argument("--smoke", action="store_true", help="tiny models, one round; never written to results/")
    size.add_argument("--render", action="store_true", help="write the claims table into BENCHMARKS.md")
    parser.add_argument("--out", type=Path, help="write the run's JSON here, e.g. benchmarks/results/HOST.json")
    parser.add_argument("--only", nargs="+", metavar="ID", help="only the measurements of these claims")
    parser.add_argument("--page", type=Path, help="--render: the page (default BENCHMARKS.md)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="--render: the folder of result files")
    parser.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=SIZES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_registry(MEASURES)
    if args.measure:
        print(json.dumps(measure_here(args.measure, args.size)))
        return
    if args.render:
        try:
            update_page(args.page or PAGE, args.results)
        except ValueError as error:  # no markers, or a file that is not a result: the page is left as it was
            parser.error(str(error))
        print(f"claims table written from {args.results}")
        return
    if args.smoke and args.out is not None and RESULTS in args.out.resolve().parents:
        parser.error(f"--smoke measures nothing: its JSON is not a result, write it outside {RESULTS}.")
    try:
        selected(args.only)
    except ValueError as error:
        parser.error(str(error))
    run("smoke" if args.smoke else "quick" if args.quick else "full", args.only, args.out)


if __name__ == "__main__":
    main()
