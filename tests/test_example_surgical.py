"""Surgical fine-tuning (``run_finetune.py --surgical_layers``) on tiny random models: only the chosen transformer
blocks (and a new head) change, chosen by FIM score, its reverse, or at random; bad input is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_example_retrain import _check_only_allowed_changed, _head, _load
from test_examples import HEAD_ARGS, assets, finetune_args  # noqa: F401  (assets: a fixture)

from peft_graft.training import layer_region

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import example_utils as U  # noqa: E402
import run_finetune  # noqa: E402

LR = ["--learning_rate", "0.5"]


@pytest.mark.parametrize("head", ["classification", "mlm_prompt"])
def test_surgical_run_trains_only_the_top_fim_block_and_the_head(assets, tmp_path, head):  # noqa: F811
    run_finetune.main(finetune_args(assets, head, tmp_path, *LR, "--surgical_layers", "1"))
    record = json.loads(Path(tmp_path, U.RESTRICTION_FILE).read_text())
    scores = {int(i): v for i, v in record["fim_scores"].items()}
    assert record["selection"] == "fim" and record["method"] == "surgical (fim, 1 blocks)"
    assert record["layers"] == [max(scores, key=scores.get)] and sorted(scores) == [0, 1]
    assert record["fisher_samples"] == 16  # every one of the 2 x 8 k-shot examples (fewer than --fisher_samples)
    setup = U.TaskSetup.load(tmp_path)
    pre, trained = _load(assets[HEAD_ARGS[head][0]], setup), _load(str(tmp_path), setup)
    if head == "mlm_prompt":  # the LabelWordClassifier's names carry the prefix "lm."
        pre, trained = pre.lm, trained.lm
    head_tensors = _head(pre, head)
    allowed = layer_region(pre, record["layers"], also=[f"^{n}$" for n in head_tensors] or None)
    changed, where = _check_only_allowed_changed(pre, trained, allowed)
    assert changed > 0 and any(f".layer.{record['layers'][0]}." in n for n in where)
    assert head_tensors <= where
    assert record["trainable_entries"] == allowed.num_entries


def test_bottom_and_random_selections(assets, tmp_path):  # noqa: F811
    chosen = {}
    for selection in ("fim", "fim_bottom", "random"):
        out = tmp_path / selection
        run_finetune.main(finetune_args(assets, "classification", out, "--max_steps", "1", "--surgical_layers", "1",
                                        "--surgical_selection", selection))  # fmt: skip
        chosen[selection] = json.loads(Path(out, U.RESTRICTION_FILE).read_text())
    scores = chosen["fim"]["fim_scores"]
    assert chosen["fim_bottom"]["fim_scores"] == scores  # same data, same seed: the same scores
    assert chosen["fim_bottom"]["layers"] == [int(min(scores, key=scores.get))]
    assert chosen["fim"]["layers"] != chosen["fim_bottom"]["layers"]
    assert chosen["random"]["layers"][0] in (0, 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--surgical_layers", "3"], "the model has 2 transformer blocks; choose 1 to 2"),
        (["--surgical_layers", "0"], "the model has 2 transformer blocks"),
        (["--surgical_layers", "1", "--bitfit"], "mutually exclusive"),
    ],
)
def test_surgical_bad_input(assets, tmp_path, extra, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        run_finetune.main(finetune_args(assets, "classification", tmp_path / "out", *extra))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_fim_rank_every_records_the_ranking_during_training(assets, tmp_path):  # noqa: F811
    run_finetune.main(finetune_args(assets, "classification", tmp_path, "--fim_rank_every", "2"))  # 3 steps
    record = json.loads(Path(tmp_path, run_finetune.FIM_RANKS_FILE).read_text())
    assert sorted(record["history"], key=int) == ["0", "2"]
    assert all(sorted(scores) == ["0", "1"] for scores in record["history"].values())
    assert record["rank_correlation_with_step_0"]["0"] == 1.0


def test_fim_ranks_cover_every_block_in_a_surgical_run(assets, tmp_path):  # noqa: F811
    """The trained block is the only one with requires_grad, but the ranks score every block."""
    run_finetune.main(finetune_args(assets, "classification", tmp_path, "--surgical_layers", "1",
                                    "--fim_rank_every", "2"))  # fmt: skip
    record = json.loads(Path(tmp_path, run_finetune.FIM_RANKS_FILE).read_text())
    assert all(sorted(scores) == ["0", "1"] for scores in record["history"].values())
