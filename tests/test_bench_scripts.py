"""The benchmarks' models and the mask-step benchmark on a tiny random Llama: theta_ft's structured perturbation,
the rebuilt theta_pre check, one variant measured in process, the bytes-per-parameter accounting, and the cost-growth
tables and figure."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_cost_growth as G  # noqa: E402
import bench_fsdp_memory as F  # noqa: E402
import bench_models as M  # noqa: E402
import bench_timing as T  # noqa: E402
import mask_memory as MM  # noqa: E402
import mask_steps as S  # noqa: E402
import mask_trainers as MT  # noqa: E402

TINY = "llama-0.4m"
SWITCHES = ("GRAFT_EMBEDDING_ROWS", "GRAFT_SPARSE_LINEAR")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_theta_ft_is_theta_pre_plus_a_structured_update():
    pre, ft = M.load_pretrained(TINY), M.load_pretrained(TINY)
    assert all(torch.equal(a, b) for a, b in zip(pre.parameters(), ft.parameters(), strict=True))  # seeded
    M.perturb_(ft)
    for (name, before), after in zip(pre.named_parameters(), ft.parameters(), strict=True):
        update = (after - before).detach().double()
        if name.endswith("embed_tokens.weight"):
            moved_rows = int(update.abs().sum(1).ne(0).sum())
            assert moved_rows == round(M.EMBEDDING_ROWS * before.shape[0])
        elif before.ndim == 2:
            values = torch.linalg.svdvals(update)  # rank RANK up to the fp32 rounding of theta_pre + update
            assert values[M.RANK - 1] > 0.1 * values[0] and values[M.RANK] < 1e-3 * values[0]
        else:
            assert bool(update.ne(0).all())
        ratio = float(update.pow(2).mean().sqrt() / before.detach().double().pow(2).mean().sqrt())
        if not name.endswith("embed_tokens.weight"):
            assert M.RELATIVE_SIZE / 2 * 0.99 <= ratio <= M.RELATIVE_SIZE * 2 * 1.01


def test_rebuilt_theta_pre_is_checked_against_the_cache(tmp_path):
    folder = M.prepare_finetuned(TINY, "float32", str(tmp_path))
    assert (folder / M.FINGERPRINT_FILE).is_file() and (folder / "config.json").is_file()
    M.check_pretrained(M.load_pretrained(TINY), folder)
    other = M.load_pretrained(TINY)
    M.perturb_(other, seed=5)
    with pytest.raises(RuntimeError, match="differs"):
        M.check_pretrained(other, folder)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_one_variant_in_process_and_its_bytes_per_parameter(tmp_path, monkeypatch):
    for owner, name in [(MT.LinearPattern, "sparse_is_cheaper"), *((MT.graft_layer, s) for s in SWITCHES)]:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # the variants set them: restored after the test
    M.prepare_finetuned(TINY, "float32", str(tmp_path))
    plain = S.run_variant(TINY, "plain", 1, "cpu", "float32", str(tmp_path))
    mask = S.run_variant(TINY, "0.01:sparse", 1, "cpu", "float32", str(tmp_path))  # (its tiny layers: copy cheaper)
    dense = S.run_variant(TINY, "none", 1, "cpu", "float32", str(tmp_path))
    for result in (plain, mask, dense):
        assert len(result["times_s"]) == 1 and result["peak_gb"] > 0
    figures = {v: MM.bytes_per_parameter(r["state"]) for v, r in (("plain", plain), ("0.01", mask), ("none", dense))}
    assert figures["plain"] == {"weight_bytes": 4.0, "gradient_share": 1.0, "optimizer_share": 0.0}
    n = plain["state"]["parameters"]
    assert mask["state"]["parameters"] == dense["state"]["parameters"] == n
    # S, its gradient, the movement (fp32) and two int64 indices per candidate; a few gamma_base positions more
    assert 28 <= figures["0.01"]["bytes_per_candidate"] < 29
    assert figures["0.01"]["buffer_share"] < 0.01  # CPU: linear layers use sparse products, only norms are copied
    assert abs(figures["0.01"]["candidate_fraction"] - 0.01) < 0.002
    assert figures["none"]["dense"] and 12 <= figures["none"]["bytes_per_parameter"] < 12.01
    lines = "\n".join(MM.on_paper(figures, [0.01]))
    assert "mask, dense S (paper)               14.00" in lines and "7B GiB" in lines and "70B GiB" in lines


def test_pairs_alternate_which_step_comes_first():
    calls = []
    pairs, faults = S.pair_steps(3, ["none", "0.01"], lambda key: calls.append(key) or (len(calls), 10 * len(calls)))
    rounds = [["plain", "none", "plain", "0.01"], ["none", "plain", "0.01", "plain"]]  # plain first in even rounds
    assert calls == [*rounds[0], *rounds[1], *rounds[0]]
    assert pairs["none"] == [(1, 2), (6, 5), (9, 10)] and pairs["0.01"] == [(3, 4), (8, 7), (11, 12)]
    assert faults["none"] == [(10, 20), (60, 50), (90, 100)]


def test_rounds_rotate_and_ratios_are_taken_per_pair():
    orders = [T.rotated(["base", "a", "b"], shift) for shift in range(4)]
    assert orders == [["base", "a", "b"], ["a", "b", "base"], ["b", "base", "a"], ["base", "a", "b"]]
    # ratios per pair, not of the medians (18 / 1 here): slow rounds move both times of a pair
    times, base = [2.0, 2.0, 18.0, 18.0, 18.0], [1.0, 1.0, 9.0, 9.0, 1.0]
    assert T.paired_ratios("a", times, base) == {"a": 2.0, "a_quartiles": [2.0, 10.0]}
    assert T.paired_text(times[:4], base[:4]) == "2.00x (2.00-2.00)"
    with pytest.raises(ValueError):  # unpaired lists are refused, not cut short
        T.paired_quartiles(times, base[:3])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_lockstep_steps_each_trainer_in_its_own_process(tmp_path, monkeypatch):
    M.prepare_finetuned(TINY, "float32", str(tmp_path))
    args = argparse.Namespace(model=TINY, search=["none"], repeats=2, device="cpu", dtype="float32",
                              cache=str(tmp_path), threads=1, clock="wall", batch=None)  # fmt: skip
    steps = []
    monkeypatch.setattr(S, "faulted_step", lambda *a: steps.append(a))  # this process's: never called
    pairs, faults = S.time_lockstep(args)
    assert not steps
    assert len(pairs["none"]) == len(faults["none"]) == 2
    assert all(seconds > 0 for pair in pairs["none"] for seconds in pair)
    assert all(isinstance(count, int) and count >= 0 for pair in faults["none"] for count in pair)


def test_cost_growth_tables_and_figure(tmp_path):
    def record(model, parameters, variants):
        def result(median, peak):
            return {"median_s": median, "peak_gb": peak, "rss_after_load_gb": 0.5, "creation_peak_gb": 0.7}

        results = {"plain": result(1.0, 1.0)}
        for i, variant in enumerate(variants):
            results[variant] = {**result(1.1 + i / 10, 1.1), "ratio": 1.1 + i / 10, "state": {"candidates": 10}}
        return {"model": model, "parameters": parameters, "batch": [2, 64], "results": results}

    fractions = ["1e-4", "1e-2", "none"]
    data = {"device": "cpu", "dtype": "float32", "threads": 2, "batch": "2x64", "by_fraction": []}
    data["by_size"] = [row for m, n in (("a", 2e7), ("b", 1e8)) for row in G.rows_of(record(m, n, ["0.01"]), ["0.01"])]
    data["by_fraction"] = G.rows_of(record("b", 1e8, fractions), fractions)
    assert [r["fraction"] for r in data["by_fraction"]] == [1e-4, 1e-2, None]
    table = G.markdown(data["by_fraction"], "GiB RSS")
    assert table[2].startswith("| b | 100.0M | 1e-4 | 1.000 s | 1.100 s | 1.10x |") and "dense S" in table[-1]
    G.plot(data, tmp_path / "growth.png")
    assert (tmp_path / "growth.png").stat().st_size > 10_000


def test_fsdp_memory_summary_projects_per_gpu_bytes_from_the_measured_state():
    """2 B/param of bf16 weights divided among 8 GPUs under FSDP2 (whole under DDP), plus the graft's state per
    parameter as measured (kept whole on every process)."""
    rank = {"parameters": 1000, "rss_after_load_gb": 1.0, "rss_prepared_gb": 0.8, "step_peak_gb": 1.5, "step_s": 2.0}
    results = {"variants": {}}
    for variant, graft_bytes in (("fsdp-mask-0.01", 200), ("ddp-mask-0.01", 200), ("fsdp-plain", 0)):
        ranks = [{**rank, "kept_bytes": {"graft_state": graft_bytes}}, {**rank, "kept_bytes": {"graft_state": 100}}]
        results["variants"][variant] = {"ranks": ranks}
    fsdp, ddp, plain = F.summary(results)
    assert "step peak 1.50 GiB (+0.50)" in fsdp and "graft state 0.20 B/param" in fsdp
    assert f"70B {70e9 * (2 / 8 + 0.2) / 2**30:.1f} GiB" in fsdp and f"8B {8e9 * (2 + 0.2) / 2**30:.1f} GiB" in ddp
    assert "on 8 GPUs" not in plain


def local_imports(path: Path, names: set[str]) -> set[str]:
    """The modules of ``benchmarks/`` that the file at ``path`` imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found & names


def test_benchmarks_have_no_import_cycle_and_no_script_imports_another():
    """benchmarks/ is laid out like the package: helpers (no ``__main__``) shared by scripts, no import circle, no
    script importing a script (only ``measures.py``, the claims' measurements, reuses the scripts' functions), and no
    file much over 400 lines."""
    files = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {name: local_imports(path, set(files)) for name, path in files.items()}
    scripts = {name for name, path in files.items() if "__main__" in path.read_text()}
    assert {"bench_mask_step", "bench_graft", "bench_mixed_batch", "run_all"} <= scripts
    assert not {"bench_models", "bench_timing", "measures", "claims", "render"} & scripts
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", f"import cycle: {' -> '.join([*path, other])}"
            if other not in state:
                visit(other, [*path, other])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    for name in scripts:
        assert not graph[name] & scripts, f"{name} imports the scripts {graph[name] & scripts}"
    for name, path in files.items():
        assert len(path.read_text().splitlines()) <= 420, f"{name}.py has grown past 420 lines: split it by concern"


def run_all(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    command = [sys.executable, str(BENCHMARKS / "run_all.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_run_all_smoke_measures_the_claims_end_to_end_and_writes_their_json(tmp_path):
    """``--smoke`` (tiny models, one round) through the mixed-batch measurement: each of its claims gets a median,
    quartiles and a verdict, the run its host, commit, date and load; the default mode is recorded."""
    ids = ["mixed.8.exact", "mixed.8.default_vs_lora"]
    done = run_all("--smoke", "--only", *ids, "--out", str(tmp_path / "smoke.json"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "smoke.json").read_text())
    assert record["size"] == "smoke" and record["threads"] == 2 and set(record["measurements"]) == {"mixed_8"}
    assert {"cpu", "cores", "torch", "gpu"} <= set(record["host"]) and record["commit"] and record["date"]
    assert record["measurements"]["mixed_8"]["setup"]["default_mode"] in ("exact", "sparse_delta")
    claims = record["claims"]
    assert {"mixed.8.exact", "mixed.8.sparse_delta", "mixed.8.sparse_delta_vs_lora", "mixed.8.default_vs_lora"} == set(
        claims
    )  # the claims of the measurement run
    for result in claims.values():
        assert result["n"] == 1 and result["verdict"] in ("holds", "does not hold here")
        assert result["quartiles"][0] <= result["median"] <= result["quartiles"][1]
    assert "mixed.8.default_vs_lora" in done.stdout and "claimed <= 1.02x" in done.stdout


def test_run_all_refuses_a_smoke_result_in_results_and_unknown_claims(tmp_path):
    done = run_all("--smoke", "--out", str(BENCHMARKS / "results" / "smoke.json"), cwd=tmp_path)
    assert done.returncode == 2 and "measures nothing" in done.stderr
    assert not (BENCHMARKS / "results" / "smoke.json").exists()
    done = run_all("--smoke", "--only", "no.such.claim", cwd=tmp_path)
    assert done.returncode == 2 and "unknown claim ids ['no.such.claim']" in done.stderr
