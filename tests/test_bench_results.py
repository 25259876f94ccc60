"""The claims table of BENCHMARKS.md is what ``benchmarks/run_all.py --render`` makes from the committed result files
(``benchmarks/results/*.json``); the claim registry is consistent; a claim that does not hold on a host is shown there,
not dropped."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import claims as C  # noqa: E402
import measures as MS  # noqa: E402
import render as R  # noqa: E402


def test_the_page_block_is_rendered_from_the_result_files():
    """Fails (no skip) while BENCHMARKS.md has no claims markers or its block is stale: run
    ``python benchmarks/run_all.py --render``."""
    block = R.page_block((ROOT / "BENCHMARKS.md").read_text(), "BENCHMARKS.md")
    assert block == R.render(R.load_results(R.RESULTS))


def test_the_registry_names_known_measurements_targets_and_source_files():
    C.check_registry(MS.MEASURES)
    assert len({claim.id for claim in C.CLAIMS}) == len(C.CLAIMS)
    for claim in C.CLAIMS:
        assert claim.tolerance >= 0 and claim.claimed > 0, claim.id
        path, _, section = claim.source.split(" ")[0].partition("#")
        if path.endswith(".md"):
            assert (ROOT / path).is_file(), claim.id
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            assert not section or section in slugs, (claim.id, section)
    default = C.by_id()["mixed.8.default_vs_lora"]
    assert (default.claimed, default.tolerance, default.target) == (1.02, 0.0, "at_most")


def test_verdicts_follow_the_target_and_tolerance():
    about, at_most = C.by_id()["mixed.8.exact"], C.by_id()["creation.llama_22m"]
    assert about.verdict(1.19) == "holds" and about.verdict(1.21) == "does not hold here"
    assert about.verdict(1.0) == "holds" and about.verdict(0.99) == "does not hold here"
    assert at_most.verdict(0.5) == "holds" and at_most.verdict(2.01) == "does not hold here"
    assert about.claimed_text() == "1.10x ± 0.1" and at_most.claimed_text() == "<= 2.00x"


def result(median: float, claim_id: str = "mixed.8.exact") -> dict:
    claims = {claim_id: {"median": median, "quartiles": [median - 0.01, median + 0.02], "n": 3}}
    return {"host": {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0", "gpu": None}, "commit": "a" * 40,
            "date": "2026-11-29 05:00 UTC", "size": "quick", "claims": claims, "load_before": "0.10 0.20 0.30",
            "load_after": "1.90 1.00 0.50", "wall_s": 540.0}  # fmt: skip


def test_render_shows_every_claim_and_each_host_also_where_a_claim_fails(tmp_path):
    (tmp_path / "fast.json").write_text(json.dumps(result(1.12)))
    (tmp_path / "slow.json").write_text(json.dumps(result(1.31)))
    failed = result(1.0)
    failed["claims"] = {"mixed.8.exact": {"error": "measurement mixed_8 failed"}}
    (tmp_path / "broken.json").write_text(json.dumps(failed))
    block = R.render(R.load_results(tmp_path))
    lines = block.splitlines()
    assert lines[0] == R.BEGIN and lines[-1] == R.END
    assert lines[3] == "| claim | baseline | claimed | `broken` | `fast` | `slow` |"
    row = next(line for line in lines if line.startswith("| `mixed.8.exact`"))
    assert row.endswith("| failed: measurement mixed_8 failed | 1.12x (1.11-1.14), holds | 1.31x (1.30-1.33), "
                        "does not hold here |")  # fmt: skip
    assert "1.10x ± 0.1 (BENCHMARKS.md#serving-and-decoding)" in row
    assert sum(line.startswith("| `") for line in lines) == len(C.CLAIMS)  # every claim has its row
    other = next(line for line in lines if line.startswith("| `packed.1000`"))
    assert other.endswith("| not measured | not measured | not measured |")
    host = next(line for line in lines if line.startswith("- `slow`"))
    assert "Test CPU, 2 cores, 2 torch threads, torch 2.13.0, no GPU; commit aaaaaaa, 2026-11-29 05:00 UTC" in host
    assert "load 0.10 0.20 0.30 before, 1.90 1.00 0.50 after; `--quick`, 9.0 min" in host


def test_update_page_replaces_the_block_only_and_refuses_a_page_without_markers(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "host.json").write_text(json.dumps(result(1.05)))
    page = tmp_path / "page.md"
    page.write_text(f"# Benchmarks\n\nbefore\n\n{R.BEGIN}\nold table\n{R.END}\n\nafter\n")
    R.update_page(page, tmp_path / "results")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n<!-- claims:begin -->") and text.endswith("-->\n\nafter\n")
    assert R.page_block(text) == R.render(R.load_results(tmp_path / "results"))
    R.update_page(page, tmp_path / "results")
    assert page.read_text() == text  # idempotent
    bare = tmp_path / "bare.md"
    bare.write_text("# Benchmarks\n")
    with pytest.raises(ValueError, match="claims:begin"):
        R.update_page(bare, tmp_path / "results")
    assert bare.read_text() == "# Benchmarks\n"  # unchanged


def test_a_file_that_is_not_a_result_is_refused_by_name(tmp_path):
    (tmp_path / "notes.json").write_text(json.dumps({"host": {}}))
    with pytest.raises(ValueError, match=r"notes\.json: not a run_all\.py result"):
        R.load_results(tmp_path)
    (tmp_path / "notes.json").write_text("{")
    with pytest.raises(ValueError, match=r"notes\.json: not JSON"):
        R.load_results(tmp_path)


def test_committed_results_hold_every_claim_of_their_run():
    """Each committed file has a result (or an error) for every claim of the registry it ran, with its verdict."""
    for label, data in R.load_results(R.RESULTS).items():
        for claim_id, measured in data["claims"].items():
            if "error" not in measured:
                claim = copy.copy(C.by_id().get(claim_id))
                assert claim is not None, f"{label}: claim {claim_id} is not in benchmarks/claims.py"
                assert measured["verdict"] in ("holds", "does not hold here"), (label, claim_id)


def test_render_command_refuses_a_page_without_markers_and_leaves_it(tmp_path):
    import subprocess

    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n")
    command = [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--render", "--page", str(page)]
    done = subprocess.run([*command, "--results", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "needs one <!-- claims:begin --> line" in done.stderr
    assert page.read_text() == "# Benchmarks\n"
    page.write_text(f"# Benchmarks\n{R.BEGIN}\n{R.END}\n")
    (tmp_path / "host.json").write_text(json.dumps(result(1.3)))
    done = subprocess.run([*command, "--results", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert R.page_block(page.read_text()) == R.render(R.load_results(tmp_path))
