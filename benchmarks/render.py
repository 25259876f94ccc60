"""The claims table of BENCHMARKS.md, made from the committed result files of ``run_all.py``
(``benchmarks/results/*.json``): one row per claim of ``claims.py`` (claim, baseline, claimed), one column per host file
(measured median with quartiles, and whether the claim holds there), then each host's line. The block between
``<!-- claims:begin -->`` and ``<!-- claims:end -->`` is replaced as a whole; nothing else on the page changes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from claims import CLAIMS, Claim, value_text

BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
RESULTS = Path(__file__).resolve().parent / "results"
PAGE = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
REQUIRED = ("host", "commit", "date", "size", "claims")


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """The result files of ``folder`` by host label (the file's stem), sorted; ``ValueError`` naming a file that is
    not a result of ``run_all.py``."""
    results = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not JSON ({error}); re-run run_all.py --out {path} or remove it.") from error
        missing = [key for key in REQUIRED if not isinstance(data, dict) or key not in data]
        if missing:
            raise ValueError(f"{path}: not a run_all.py result (missing {', '.join(missing)}); remove it or re-run.")
        results[path.stem] = data
    return results


def cell(claim: Claim, measured: dict | None) -> str:
    """One host's cell of a claim: ``1.07x (1.03-1.10), holds``; an error or a claim not measured, said so."""
    if measured is None:
        return "not measured"
    if "error" in measured:
        return "failed: " + measured["error"].splitlines()[0][:80].replace("|", "/")
    low, high = measured["quartiles"]
    return f"{value_text(measured['median'], claim.unit)} ({low:.2f}-{high:.2f}), {claim.verdict(measured['median'])}"


def host_line(label: str, data: dict) -> str:
    host = data["host"]
    gpu = host.get("gpu") or "no GPU"
    dirty = " (uncommitted changes)" if data.get("dirty") else ""
    minutes = f", {data['wall_s'] / 60:.1f} min" if "wall_s" in data else ""
    return (
        f"- `{label}`: {host.get('cpu', '?')}, {host.get('cores', '?')} cores, {data.get('threads', 2)} torch threads, "
        f"torch {host.get('torch', '?')}, {gpu}; commit {data['commit'][:7]}{dirty}, {data['date']}, load "
        f"{data.get('load_before', '?')} before, {data.get('load_after', '?')} after; `--{data['size']}`{minutes}"
    )


def render(results: dict[str, dict]) -> str:
    """The markdown block, markers included."""
    hosts = list(results)
    lines = [
        BEGIN,
        "<!-- made by `python benchmarks/run_all.py --render` from benchmarks/results/*.json: do not edit -->",
        "",
        "| " + " | ".join(["claim", "baseline", "claimed", *(f"`{h}`" for h in hosts)]) + " |",
        "|" + " --- |" * (3 + len(hosts)),
    ]
    for claim in CLAIMS:
        cells = [cell(claim, results[h]["claims"].get(claim.id)) for h in hosts]
        row = [f"`{claim.id}`: {claim.what}", claim.baseline, f"{claim.claimed_text()} ({claim.source})", *cells]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Each column is one result file of `benchmarks/results/`, made on its host by "
              "`python benchmarks/run_all.py --quick --out benchmarks/results/HOST.json` (without `--quick`: more "
              "rounds); the same command re-measures every claim on yours. Hosts:", ""]  # fmt: skip
    lines += [host_line(h, results[h]) for h in hosts] or ["- none yet."]
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, block: str, where: str = "the page") -> str:
    """``text`` with its claims block replaced by ``block``; ``ValueError`` if the markers are not there once each."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where} needs one {BEGIN} line followed by one {END} line, where the claims table goes.")
    return text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]


def page_block(text: str, where: str = "the page") -> str:
    """The claims block of a page, markers included; ``ValueError`` if the markers are not there once each."""
    replace_block(text, "", where)  # checks the markers
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def update_page(page: Path = PAGE, folder: Path = RESULTS) -> None:
    """Write the table of ``folder``'s result files into ``page`` (atomically)."""
    page = Path(page)
    text = replace_block(page.read_text(), render(load_results(folder)), str(page))
    with tempfile.NamedTemporaryFile("w", dir=page.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.chmod(handle.name, page.stat().st_mode & 0o777)
    os.replace(handle.name, page)
