"""Graft re-training (``run_finetune.py --retrain_region``) and BitFit (``--bitfit``), paper Tables 1 and 3, on tiny
random models: only the region (or the biases) and the new head change, every other entry stays bit-identical to
the pre-trained model; ``run_evaluate.py --compare_models`` reports them beside the fine-tuned model and the grafts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_example_evaluate import expected_models, summary_tables
from test_examples import HEAD_ARGS, assets, finetune_args, graft_args  # noqa: F401  (assets: a fixture)

from peft_graft import Region
from peft_graft.calibration import calibration_report

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import example_utils as U  # noqa: E402
import run_evaluate  # noqa: E402
import run_finetune  # noqa: E402
import run_graft  # noqa: E402

HEADS = ("classification", "mlm_prompt")
LR = ["--learning_rate", "0.5"]


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory) -> dict[str, dict[str, str]]:  # noqa: F811
    """Per head: the fine-tuned folder, its graft, the graft re-trained from theta_pre, and (classification) BitFit."""
    out: dict[str, dict[str, str]] = {}
    for head in HEADS:
        runs = {name: str(tmp_path_factory.mktemp(f"{name}_{head}")) for name in ("ft", "graft", "retrain")}
        run_finetune.main(finetune_args(assets, head, Path(runs["ft"]), *LR))
        run_graft.main(graft_args(assets, {head: runs["ft"]}, head, Path(runs["graft"])))
        run_finetune.main(finetune_args(assets, head, Path(runs["retrain"]), *LR, "--retrain_region", runs["graft"]))
        out[head] = runs
    out["classification"]["bitfit"] = str(tmp_path_factory.mktemp("bitfit_classification"))
    run_finetune.main(finetune_args(assets, "classification", Path(out["classification"]["bitfit"]), *LR, "--bitfit"))
    return out


def _load(path: str, setup: U.TaskSetup) -> torch.nn.Module:
    return U.load_model(path, setup, U.load_tokenizer(path, setup.head))


def _head(model: torch.nn.Module, head: str) -> set[str]:
    """The tensors of the new classification head (none for prompt heads)."""
    heads = U.CLASSIFICATION_HEADS if head == "classification" else ()
    return {name for name, _ in model.named_parameters() if name.split(".")[0] in heads}


def _check_only_allowed_changed(pre, trained, allowed: Region) -> tuple[int, set[str]]:
    """Every entry outside ``allowed`` is bit-identical; returns (changed entries, tensors with a change)."""
    pre_state, state = dict(pre.named_parameters()), dict(trained.named_parameters())
    assert pre_state.keys() == state.keys()
    changed, where = 0, set()
    for name, value in state.items():
        inside = torch.zeros(value.numel(), dtype=torch.bool)
        if name in allowed:
            inside[allowed[name]] = True
        before, after = pre_state[name].detach().reshape(-1), value.detach().reshape(-1)
        assert torch.equal(after[~inside], before[~inside]), f"{name}: an entry outside the allowed set changed"
        moved = int((after[inside] != before[inside]).sum())
        changed += moved
        where |= {name} if moved else set()
    return changed, where


@pytest.mark.parametrize("head", HEADS)
def test_retrain_region_changes_only_the_region_and_the_head(assets, trained, head):  # noqa: F811
    runs = trained[head]
    setup = U.TaskSetup.load(runs["ft"])
    pre, retrained = _load(assets[HEAD_ARGS[head][0]], setup), _load(runs["retrain"], setup)
    region = Region.from_pretrained(runs["graft"], pre)
    head_tensors = _head(pre, head)
    assert region.num_entries > 0 and not set(region) & head_tensors  # the graft stores the head whole, outside
    whole_head = Region({name: torch.arange(pre.get_parameter(name).numel()) for name in head_tensors})
    changed, where = _check_only_allowed_changed(pre, retrained, region | whole_head)
    assert changed > 0 and where - head_tensors, "no entry of the region changed"
    assert head_tensors <= where  # the new head is trained whole
    # The saved folder is what run_graft / run_evaluate read, plus the record of what was trained.
    assert U.TaskSetup.load(runs["retrain"]) == U.TaskSetup.load(runs["ft"])
    record = json.loads(Path(runs["retrain"], U.RESTRICTION_FILE).read_text())
    head_entries = whole_head.num_entries
    assert record == {"method": "graft re-training", "graft": runs["graft"], "entries": region.num_entries,
                      "head_entries": head_entries, "trainable_entries": region.num_entries + head_entries}  # fmt: skip
    results = json.loads(Path(runs["retrain"], "train_results.json").read_text())
    assert results["trainable_entries"] == region.num_entries + head_entries


def test_bitfit_changes_only_biases_and_the_head(assets, trained):  # noqa: F811
    setup = U.TaskSetup.load(trained["classification"]["ft"])
    pre, bitfit = _load(assets["cls"], setup), _load(trained["classification"]["bitfit"], setup)
    head_tensors = _head(pre, "classification")
    allowed = {name for name, _ in pre.named_parameters() if name.endswith(".bias")} | head_tensors
    # Frozen embeddings (paper default) stay frozen: their LayerNorm bias does not train.
    trainable = {name for name in allowed if "embeddings" not in name}
    _, where = _check_only_allowed_changed(
        pre, bitfit, Region({name: torch.arange(pre.get_parameter(name).numel()) for name in trainable})
    )
    assert where - head_tensors and all(name.endswith(".bias") for name in where - head_tensors)
    assert head_tensors <= where
    record = json.loads(Path(trained["classification"]["bitfit"], U.RESTRICTION_FILE).read_text())
    sizes = {name: pre.get_parameter(name).numel() for name in trainable}
    assert record["method"] == "BitFit" and record["graft"] is None
    assert record["head_entries"] == sum(sizes[name] for name in head_tensors)
    assert record["trainable_entries"] == sum(sizes.values())


def test_an_unrestricted_run_into_the_folder_drops_the_record(assets, tmp_path):  # noqa: F811
    args = finetune_args(assets, "classification", tmp_path, "--max_steps", "1")
    run_finetune.main([*args, "--bitfit"])
    assert (tmp_path / U.RESTRICTION_FILE).is_file()
    metrics = run_finetune.main(args)
    assert not (tmp_path / U.RESTRICTION_FILE).exists()
    pre = _load(assets["cls"], U.TaskSetup.load(tmp_path))
    embeddings = sum(p.numel() for n, p in pre.named_parameters() if "embeddings" in n)
    assert metrics["trainable_entries"] == sum(p.numel() for p in pre.parameters()) - embeddings


def test_retrain_region_and_bitfit_are_mutually_exclusive(assets, trained, tmp_path):  # noqa: F811
    args = finetune_args(assets, "classification", tmp_path / "out")
    with pytest.raises(ValueError, match="mutually exclusive"):
        run_finetune.main([*args, "--retrain_region", trained["classification"]["graft"], "--bitfit"])
    assert not (tmp_path / "out").exists()


def test_retrain_region_refuses_another_task_or_a_non_graft(assets, trained, tmp_path):  # noqa: F811
    args = finetune_args(assets, "classification", tmp_path)
    with pytest.raises(ValueError, match="graft for head='mlm_prompt'"):
        run_finetune.main([*args, "--retrain_region", trained["mlm_prompt"]["graft"]])
    with pytest.raises(ValueError, match="is not a saved graft"):
        run_finetune.main([*args, "--retrain_region", trained["classification"]["ft"]])


def test_bitfit_on_a_model_without_biases_is_an_error(assets, tmp_path):  # noqa: F811
    """The tiny Llama has no bias tensor and its LM head is frozen: BitFit would train nothing."""
    with pytest.raises(ValueError, match="BitFit would train nothing"):
        run_finetune.main(finetune_args(assets, "causal_prompt", tmp_path, "--bitfit"))


# ---------------------------------------------------------------------------------------------------------- evaluate
@pytest.fixture(scope="module")
def compared(assets, trained, tmp_path_factory):  # noqa: F811
    """run_evaluate.py on the classification runs, with the re-trained and BitFit models and temperature scaling."""
    runs = trained["classification"]
    report_dir = tmp_path_factory.mktemp("report_compare")
    results = run_evaluate.main([
        "--model_name_or_path", assets["cls"], "--finetuned_model_name_or_path", runs["ft"],
        "--graft_dirs", runs["graft"], "--eval_datasets", assets["test"], assets["ood"],
        "--eval_names", "in-dist", "ood", "--text_column", "sentence", "--temperature_dataset", assets["train"],
        "--sweep", "false", "--report_dir", str(report_dir),
        "--compare_models", f"graft re-training={runs['retrain']}", f"BitFit={runs['bitfit']}",
    ])  # fmt: skip
    return results, report_dir


def _logits(model: torch.nn.Module, path: str, setup: U.TaskSetup, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The model's logits on every example of ``path``, one example at a time (no padding), and the labels."""
    frame = U.encode_labels(U.read_table(path, text_column="sentence"), setup.label_names)
    data = U.tokenize(frame, tokenizer, setup)
    model.eval()
    with torch.no_grad():
        logits = [
            model(**{key: torch.tensor([row[key]]) for key in row if key != "labels"}).logits[0].double().numpy()
            for row in data
        ]
    return np.stack(logits), np.asarray(data["labels"])


def test_evaluate_reports_the_compared_models(assets, trained, compared):  # noqa: F811
    results, report_dir = compared
    runs = trained["classification"]
    rows = ["graft re-training", "graft re-training + TS", "BitFit", "BitFit + TS"]
    k = results["grafts"][0]["num_entries"]
    assert list(results["models"]) == expected_models((k,), scaled=True) + rows
    assert json.loads((report_dir / "results.json").read_text()) == results
    setup = U.TaskSetup.load(runs["ft"])
    tokenizer = U.load_tokenizer(runs["ft"], setup.head)
    for name, key in (("graft re-training", "retrain"), ("BitFit", "bitfit")):
        record = json.loads(Path(runs[key], U.RESTRICTION_FILE).read_text())
        info = results["models"][name]
        assert info["kind"] == record["method"] and info["entries"] == record["entries"] > 0
        assert info["label"] == name and not info["temperature_scaled"]
        temperature = results["models"][f"{name} + TS"]["temperature"]
        assert temperature == results["temperature_scaling"]["temperatures"][name] > 0
        model = U.load_model(runs[key], setup, tokenizer)
        for data, path in (("in-dist", assets["test"]), ("ood", assets["ood"])):
            logits, labels = _logits(model, path, setup, tokenizer)
            expected = calibration_report(logits, labels, input_type="logits")
            scaled = calibration_report(logits / temperature, labels, input_type="logits")
            plain, ts = results["metrics"][data][name], results["metrics"][data][f"{name} + TS"]
            assert plain["accuracy"] == expected["accuracy"] and ts["accuracy"] == expected["accuracy"]
            assert plain["ece"] == pytest.approx(expected["ece"], abs=1e-6), (name, data)
            assert ts["ece"] == pytest.approx(scaled["ece"], abs=1e-6), (name, data)
            assert plain["nll"] == pytest.approx(expected["nll"], rel=1e-5)
    assert [m["name"] for m in results["compare_models"]] == ["graft re-training", "BitFit"]

    summary = (report_dir / "summary.md").read_text()
    assert summary == run_evaluate.summary_markdown(results)
    assert "Compared models: graft re-training (graft re-training" in summary
    for table in summary_tables(summary).values():
        labels = [row[0] for row in table[1:]]
        assert labels[-4:] == rows and labels[:-4] == [name.replace(f" k={k}", "") for name in expected_models(
            (k,), scaled=True)]  # fmt: skip
        entries = {row[0]: row[1] for row in table[1:]}
        assert entries["BitFit"] == f"{results['models']['BitFit']['entries']:,}"


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["fine-tuned={ft}"], "name of a row this script makes"),
        (["pre-trained + FT head={ft}"], "name of a row this script makes"),
        (["x + TS={ft}"], "name of a row this script makes"),
        (["={ft}"], "give 'name=folder'"),
        (["a={bitfit}", "a={retrain}"], "given twice"),
        (["graft={graft}"], "is an adapter"),
        (["prompt={mlm}"], "head='mlm_prompt'"),
        (["nothing={missing}"], "has no graft_example.json"),
    ],
)
def test_evaluate_refuses_bad_compare_models(assets, trained, tmp_path, specs, message):  # noqa: F811
    """Checked before any model is loaded: nothing is written."""
    runs = trained["classification"]
    folders = {**runs, "mlm": trained["mlm_prompt"]["ft"], "missing": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        run_evaluate.main([
            "--model_name_or_path", assets["cls"], "--finetuned_model_name_or_path", runs["ft"],
            "--graft_dirs", runs["graft"], "--eval_datasets", assets["test"], "--text_column", "sentence",
            "--sweep", "false", "--report_dir", str(tmp_path / "report"),
            "--compare_models", *(spec.format(**folders) for spec in specs),
        ])  # fmt: skip
    assert not (tmp_path / "report").exists()
