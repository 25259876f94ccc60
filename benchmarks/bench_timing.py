"""How the benchmarks measure: time in rounds and paired ratios, memory of this process.

Time: :func:`rounds` times a baseline and its variants back to back, after a warm-up of each, in an order rotated
each round (:func:`rotated`); a figure is the median and quartiles of the per-round ratios of a variant's time over the
baseline's (:func:`paired_quartiles`): the load of a shared host drifts over a run, and a ratio of medians would carry
that drift. Memory: RSS and its peak from ``/proc/self`` on the CPU (reset through ``/proc/self/clear_refs``),
allocated memory on CUDA (:class:`Meter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch

GIB = 1024**3


# ----------------------------------------------------------------------------------------------- memory
def rss_gb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024**2
    raise RuntimeError(field)


def rss_mb() -> float:
    return 1024 * rss_gb()


def peak_rss_mb() -> float:
    return 1024 * rss_gb("VmHWM")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM, the peak RSS
        f.write("5")


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread): memory touched for the first time since the allocator
    got it from the system, e.g. a tensor over glibc's mmap threshold, or heap memory given back and taken again."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def release_free_memory() -> None:
    """Give memory that malloc holds but no longer uses back to the system, so that RSS shows what is held. Linux/glibc
    only; elsewhere nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    return float("inf")


class Meter:
    """Current and peak memory of this process on ``device``: RSS (GiB) on CPU, allocated CUDA memory on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def now(self) -> float:
        return torch.cuda.memory_allocated() / GIB if self.cuda else rss_gb()

    def peak(self) -> float:
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else rss_gb("VmHWM")

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


# ----------------------------------------------------------------------------------------------- time
def wall_time(function: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Wall time of one call; on CUDA the queued kernels are waited for before and after."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def timed(function: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of ``repeats`` calls in a row (no warm-up, nothing alternating: for figures without a baseline)."""
    return [wall_time(function) for _ in range(repeats)]


def self_timed(function: Callable[[], float]) -> float:
    """The timer of :func:`rounds` for calls that time themselves (and return their own seconds)."""
    return function()


def rotated(names: list[str], shift: int) -> list[str]:
    """``names`` rotated left by ``shift``: the order of a round's calls, one further on each round, so that no variant
    always runs furthest from its baseline while the host drifts."""
    shift %= len(names)
    return names[shift:] + names[:shift]


def rounds(
    variants: dict[str, Callable[[], object]],
    base: Callable[[], object],
    repeats: int,
    faults: dict | None = None,
    timer: Callable[[Callable[[], object]], float] = wall_time,
) -> dict[str, list[float]]:
    """``repeats`` rounds, each timing the base and every variant back to back (after one warm-up of each), in an
    order rotated by one each round: per name (``"base"`` and the variants), its times, round by round. ``timer(call)``
    times one call (:func:`wall_time` by default); ``faults``, if given, gets each call's minor page faults per name."""
    calls = {"base": base, **variants}
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for repeat in range(repeats):
        for name in rotated(list(calls), repeat):
            before = minor_faults()
            times[name].append(timer(calls[name]))
            if faults is not None:
                faults.setdefault(name, []).append(minor_faults() - before)
    return times


def ratio_quartiles(ratios: list[float]) -> list[float]:
    """The quartiles (low, median, high) of paired ratios (a single ratio: itself thrice)."""
    return list(ratios) * 3 if len(ratios) == 1 else statistics.quantiles(ratios, n=4)


def paired_quartiles(times: list[float], base_times: list[float]) -> list[float]:
    """The quartiles (low, median, high) of ``time / base time`` over pairs measured back to back."""
    return ratio_quartiles([t / b for t, b in zip(times, base_times, strict=True)])


def paired_ratios(name: str, times: list[float], base_times: list[float]) -> dict:
    """:func:`paired_quartiles` as JSON fields: ``name`` (the median) and ``{name}_quartiles``."""
    low, median, high = paired_quartiles(times, base_times)
    return {name: round(median, 3), f"{name}_quartiles": [round(low, 3), round(high, 3)]}


def paired_text(times: list[float], base_times: list[float]) -> str:
    """:func:`paired_quartiles` as a table cell: ``1.23x (1.10-1.31)``."""
    low, median, high = paired_quartiles(times, base_times)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def ratios(key: str, times: dict[str, list[float]]) -> dict:
    """Per variant of :func:`rounds`: its median time and its paired ratio to the base (median and quartiles); with
    LoRA in the rounds (``"lora"``), also each other variant's paired ratio to LoRA's call of the same round
    (``..._over_lora``): the comparison itself, rather than two ratios to the base that each carry the base's noise."""
    out = {f"{key}_base_ms": round(1e3 * statistics.median(times["base"]), 1)}
    lora = times.get("lora")
    for name, variant_times in times.items():
        if name != "base":
            out[f"{key}_{name}_ms"] = round(1e3 * statistics.median(variant_times), 1)
            out.update(paired_ratios(f"{key}_{name}_over_base", variant_times, times["base"]))
            if lora is not None and name != "lora":
                out.update(paired_ratios(f"{key}_{name}_over_lora", variant_times, lora))
    return out


def fault_medians(key: str, faults: dict[str, list[int]]) -> dict:
    """Median minor page faults per call of each name of :func:`rounds` (``{key}_{name}_faults``)."""
    return {f"{key}_{name}_faults": statistics.median(counts) for name, counts in faults.items()}
