"""examples/run_evaluate.py end to end on a tiny random BERT: a 3-class and a binary task, every model's full
calibration row on every set, temperature scaling, the optional sweep and --f1."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_evaluate  # noqa: E402
import run_finetune  # noqa: E402
import run_graft  # noqa: E402

# Class c's sentences use the words of WORDS_OF[c]; the binary task uses the first two classes.
WORDS_OF = [
    ["bad", "dull", "boring", "awful", "flat", "tedious"],
    ["good", "great", "fun", "moving", "brilliant", "lovely"],
    ["okay", "average", "fine", "decent", "mixed", "plain"],
]
FILLER = ["the", "movie", "film", "was", "very", "plot", "and", "it", "a", "story", "is"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
# 20 AdamW steps with the embeddings trained: the tiny model learns the task (about 95% accuracy, underconfident).
FT_FAST = [
    "--max_steps", "20", "--per_device_train_batch_size", "8", "--optim", "adamw_torch", "--seed", "0",
    "--learning_rate", "1e-2", "--freeze_embeddings", "false", "--logging_steps", "10", "--use_cpu", "true",
]  # fmt: skip
GRAFT_FAST = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--learning_rate", "1e4", "--use_cpu", "true"]
GRAFT_SIZES = {"multi": (40, 200), "binary": (60,)}
REPORT_KEYS = {"accuracy", "ece", "mce", "brier", "nll", "agreement"}
HEADER = "| model | entries | accuracy % | ECE % | MCE % | Brier | NLL | agreement with FT % |"


def _sentences(n: int, num_classes: int, seed: int) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(seed)

    def pick(pool: list[str]) -> str:
        return pool[int(torch.randint(len(pool), (1,), generator=generator))]

    rows = []
    for i in range(n):
        words = WORDS_OF[i % num_classes]
        rows.append({"sentence": f"the {pick(FILLER)} was {pick(words)} and {pick(words)}", "label": i % num_classes})
    return pd.DataFrame(rows)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny headless BERT (a new classification head of any size loads on it) and csv files per task."""
    root = tmp_path_factory.mktemp("eval_assets")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + sorted({w for ws in WORDS_OF for w in ws} | set(FILLER))) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    torch.manual_seed(0)
    paths = {"pre": str(root / "pre")}
    BertModel(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **SMALL)).save_pretrained(paths["pre"])
    tokenizer.save_pretrained(paths["pre"])
    for task, num_classes in (("multi", 3), ("binary", 2)):
        for split, n, seed in (("train", 48, 0), ("test", 24, 1), ("ood", 15, 2), ("temp", 30, 3)):
            paths[f"{task}_{split}"] = str(root / f"{task}_{split}.csv")
            _sentences(n, num_classes, seed).to_csv(paths[f"{task}_{split}"], index=False)
    return paths


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory) -> dict[str, dict]:
    """Per task: the fine-tuned folder and one graft folder per size of GRAFT_SIZES (exact sizes)."""
    out = {}
    for task, sizes in GRAFT_SIZES.items():
        data = ["--dataset_name_or_path", assets[f"{task}_train"], "--text_column", "sentence", "--k_shot", "8"]
        ft = str(tmp_path_factory.mktemp(f"ft_{task}"))
        run_finetune.main(["--model_name_or_path", assets["pre"], "--head", "classification", *data,
                           "--output_dir", ft, *FT_FAST])  # fmt: skip
        grafts = []
        for k in sizes:
            grafts.append(str(tmp_path_factory.mktemp(f"graft_{task}_{k}")))
            run_graft.main(["--model_name_or_path", assets["pre"], "--finetuned_model_name_or_path", ft, *data,
                            "--base_num_entries", str(k), "--output_dir", grafts[-1], *GRAFT_FAST])  # fmt: skip
        out[task] = {"ft": ft, "grafts": grafts}
    return out


def evaluate_args(assets, trained, task: str, report_dir: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", assets["pre"], "--finetuned_model_name_or_path", trained[task]["ft"],
        "--graft_dirs", *trained[task]["grafts"], "--text_column", "sentence", "--report_dir", str(report_dir),
        "--per_device_eval_batch_size", "16", *extra,
    ]  # fmt: skip


def expected_models(sizes: tuple[int, ...], scaled: bool) -> list[str]:
    """Row names in table order: fine-tuned, 0 entries, then learned / top-k / random per size; '+ TS' after each."""
    names = ["fine-tuned", "pre-trained + FT head"]
    for k in sizes:
        names += [f"learned k={k}", f"top-k movement k={k}", f"random k={k}"]
    return [row for name in names for row in ([name, f"{name} + TS"] if scaled else [name])]


def summary_tables(summary: str) -> dict[str, list[list[str]]]:
    """``### <set>`` heading -> the rows (cells) of the table under it, header first."""
    tables, current = {}, None
    for line in summary.splitlines():
        if line.startswith("### "):
            current = tables.setdefault(line[4:].split(" (")[0], [])
        elif current is not None and line.startswith("|") and "---" not in line:
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current is not None and current and not line.startswith("|"):
            current = None
    return tables


@pytest.fixture(scope="module")
def multiclass_run(assets, trained, tmp_path_factory):
    """3 classes, two graft sizes, a temperature set (also evaluated on, as 'calib'), the sweep with one extra size."""
    report_dir = tmp_path_factory.mktemp("report_multi")
    eval_sets = [assets["multi_test"], assets["multi_ood"], assets["multi_temp"]]
    results = run_evaluate.main(evaluate_args(
        assets, trained, "multi", report_dir, "--eval_datasets", *eval_sets, "--eval_names", "in-dist", "ood", "calib",
        "--temperature_dataset", assets["multi_temp"], "--sweep_num_entries", "10",
    ))  # fmt: skip
    return results, report_dir


def test_multiclass_every_model_has_the_full_row_on_every_set(multiclass_run):
    results, report_dir = multiclass_run
    assert json.loads((report_dir / "results.json").read_text()) == results
    assert list(results["models"]) == expected_models(GRAFT_SIZES["multi"], scaled=True)
    assert set(results["metrics"]) == {"in-dist", "ood", "calib"}
    for data, reports in results["metrics"].items():
        assert list(reports) == list(results["models"]), data
        for name, report in reports.items():
            assert set(report) >= REPORT_KEYS, (data, name)
            assert all(math.isfinite(report[key]) for key in REPORT_KEYS), (data, name)
            assert 0 <= report["accuracy"] <= 1 and 0 <= report["ece"] <= report["mce"] <= 1
            assert 0 <= report["agreement"] <= 1 and report["nll"] >= 0
        assert reports["fine-tuned"]["agreement"] == 1.0
    for name, info in results["models"].items():
        assert info["entries"] == (None if name.startswith("fine-tuned") else 0 if name.startswith("pre") else
                                   int(name.split("k=")[1].split()[0]))  # fmt: skip
    assert [g["num_entries"] for g in results["grafts"]] == list(GRAFT_SIZES["multi"])
    assert results["graft_stats"]["num_entries"] == GRAFT_SIZES["multi"][0]  # the first graft is the main one
    assert results["eval_sets"]["ood"]["examples"] == 15 and results["timings"]["evaluate"] > 0


def test_multiclass_temperature_scaling(multiclass_run):
    results, _ = multiclass_run
    scaling = results["temperature_scaling"]
    unscaled = [name for name in results["models"] if not name.endswith(" + TS")]
    assert scaling["examples"] == 30 and set(scaling["temperatures"]) == set(unscaled)
    for name in unscaled:
        temperature = scaling["temperatures"][name]
        assert temperature > 0 and results["models"][f"{name} + TS"]["temperature"] == temperature
        assert results["models"][f"{name} + TS"]["temperature_scaled"]
        assert not results["models"][name]["temperature_scaled"]
        assert scaling["nll_after"][name] <= scaling["nll_before"][name] + 1e-9
        for data, reports in results["metrics"].items():
            plain, scaled = reports[name], reports[f"{name} + TS"]
            assert scaled["accuracy"] == plain["accuracy"] and scaled["agreement"] == plain["agreement"], (data, name)
            assert 0 <= scaled["ece"] <= 1
        # 'calib' is the temperature set itself: the scaled rows there are the fitted optimum, at most the T = 1 NLL.
        calib = results["metrics"]["calib"]
        assert calib[f"{name} + TS"]["nll"] == pytest.approx(scaling["nll_after"][name], rel=1e-6, abs=1e-9)
        assert calib[name]["nll"] == pytest.approx(scaling["nll_before"][name], rel=1e-6, abs=1e-9)
    assert any(abs(t - 1) > 1e-3 for t in scaling["temperatures"].values())


def test_multiclass_report_files_sweep_and_summary(multiclass_run):
    results, report_dir = multiclass_run
    sweep = results["sweep"]
    assert set(sweep["learned"]) == {"40", "200"}
    assert set(sweep["top-k movement"]) == set(sweep["random"]) == {"10", "40", "200"}
    # The sweep's graft sizes reuse the full evaluation (the sweep sample is the whole first set here).
    assert results["sweep_examples"] == 24
    assert sweep["random"]["40"] == results["metrics"]["in-dist"]["random k=40"]["accuracy"]
    for name in ("summary.md", "results.json", "sweep_accuracy.png", "graft_locations.png",
                 "reliability_fine-tuned_in-dist.png", "reliability_graft_ood.png", "reliability_graft_TS_ood.png",
                 "reliability_fine-tuned_TS_calib.png"):  # fmt: skip
        assert (report_dir / name).stat().st_size > 0, name

    summary = (report_dir / "summary.md").read_text()
    assert summary == run_evaluate.summary_markdown(json.loads((report_dir / "results.json").read_text()))
    tables = summary_tables(summary)
    assert list(tables) == ["in-dist", "ood", "calib"]
    per_size = ["learned", "learned + TS", "top-k movement", "top-k movement + TS", "random", "random + TS"]
    for rows in tables.values():
        assert "| " + " | ".join(rows[0]) + " |" == HEADER
        assert [row[0] for row in rows[1:]] == [
            "fine-tuned", "fine-tuned + TS", "pre-trained + FT head", "pre-trained + FT head + TS", *per_size,
            *per_size,
        ]  # fmt: skip
        assert [row[1] for row in rows[1:]] == ["all (dense)"] * 2 + ["0"] * 2 + ["40"] * 6 + ["200"] * 6
        assert all(len(row) == len(rows[0]) and "-" not in row[2:] for row in rows[1:])
    assert "Region-size sweep" in summary and "| stage | run time (s) |" in summary
    assert "| model | temperature | NLL before | NLL after |" in summary


def test_binary_without_sweep_with_f1(assets, trained, tmp_path):
    results = run_evaluate.main(evaluate_args(
        assets, trained, "binary", tmp_path, "--eval_datasets", assets["binary_test"], assets["binary_ood"],
        "--sweep", "false", "--f1", "true",
    ))  # fmt: skip
    assert list(results["models"]) == expected_models(GRAFT_SIZES["binary"], scaled=False)
    assert results["temperature_scaling"] is None
    for data in ("binary_test", "binary_ood"):
        for name in results["models"]:
            report = results["metrics"][data][name]
            assert REPORT_KEYS | {"f1"} <= set(report) and 0 <= report["f1"] <= 1, (data, name)
    assert not {"sweep", "sweep_references", "sweep_set", "sweep_examples"} & set(results)
    assert not (tmp_path / "sweep_accuracy.png").exists()
    assert (tmp_path / "reliability_graft_binary_ood.png").stat().st_size > 0
    assert not list(tmp_path.glob("reliability_*_TS_*.png"))
    summary = (tmp_path / "summary.md").read_text()
    assert "Region-size sweep" not in summary and "+ TS" not in summary
    tables = summary_tables(summary)
    assert list(tables) == ["binary_test", "binary_ood"]
    assert tables["binary_ood"][0][:4] == ["model", "entries", "accuracy %", "F1 %"]
    assert [row[0] for row in tables["binary_ood"][1:]] == [
        "fine-tuned", "pre-trained + FT head", "learned", "top-k movement", "random",
    ]  # fmt: skip


def test_f1_on_a_multiclass_task_is_an_error(assets, trained, tmp_path):
    """--f1 is binary F1 (of class 1): on 3 classes it raises before any model is loaded, and writes nothing."""
    args = evaluate_args(assets, trained, "multi", tmp_path / "report", "--eval_datasets", assets["multi_test"],
                         "--f1", "true")  # fmt: skip
    with pytest.raises(ValueError, match=r"--f1 reports binary F1.*3 classes"):
        run_evaluate.main(args)
    assert not (tmp_path / "report").exists()


def test_summary_says_which_mask_each_graft_kept(tmp_path):
    (tmp_path / "graft_results.json").write_text(
        json.dumps({"selected_step": 20, "selection_p_value": 0.0031, "evaluated_masks": 10, "eval_accuracy": 0.7})
    )
    selection = run_evaluate._selection_of(str(tmp_path))
    assert selection == {"selected_step": 20, "selection_p_value": 0.0031, "evaluated_masks": 10}
    assert run_evaluate._selection_note(selection) == ", the mask of step 20 (sign test p = 0.0031 over 10 masks)"
    kept = {"selected_step": 0, "selection_p_value": 1.0, "evaluated_masks": 10}
    assert run_evaluate._selection_note(kept) == ", the starting mask gamma_base kept"
    assert run_evaluate._selection_of(str(tmp_path / "missing")) == {} and run_evaluate._selection_note({}) == ""
