"""run_baselines.py end to end on tiny random models and a pipeline-shaped run folder: every table it promises is
filled, surgical runs train what they say, and bad arguments are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_examples import _sentences, assets, finetune_args  # noqa: F401  (assets: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_baselines  # noqa: E402
import run_finetune  # noqa: E402

SMALL = ["--fisher_samples", "8", "--surgical_k", "1", "--graft_fractions", "0.001", "0.01", "--alphas", "0", "0.5",
         "1", "--lottery_densities", "0.0001", "0.5", "--eval_samples", "16", "--k_shot", "8", "--ft_steps", "2",
         "--ft_batch", "4", "--mask_steps", "2", "--mask_batch", "8", "--rank_every", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(assets, tmp_path_factory) -> Path:  # noqa: F811
    """What run_pipeline.py leaves: finetuned/ and data/<task>_{train,dev,test,ood}.csv (text, label)."""
    run = tmp_path_factory.mktemp("minilm_toy")
    run_finetune.main(finetune_args(assets, "classification", run / "finetuned", "--learning_rate", "0.5"))
    (run / "data").mkdir()
    for split, seed in (("train", 0), ("dev", 3), ("test", 1), ("ood", 2)):
        frame = _sentences(40 if split == "train" else 16, seed).rename(columns={"sentence": "text"})
        frame.to_csv(run / "data" / f"toy_{split}.csv", index=False)
    return run


def test_baselines_fill_every_table(assets, run_dir, tmp_path):  # noqa: F811
    results = run_baselines.main(["--run_dir", str(run_dir), "--model_name_or_path", assets["cls"],
                                  "--report_dir", str(tmp_path), *SMALL])  # fmt: skip
    assert sorted(results["fisher"]["ranking"]["empirical"]) == [0, 1]
    assert set(results["surgical"]) == {"full fine-tuning", "FIM top 1", "FIM bottom 1", "random 1"}
    top, bottom = results["surgical"]["FIM top 1"], results["surgical"]["FIM bottom 1"]
    # Surgical runs rank the blocks of theta_pre with the new (random) head, as the paper does before fine-tuning.
    ranking = sorted(top["fim_scores"], key=top["fim_scores"].get, reverse=True)
    assert top["layers"] == [int(ranking[0])] and bottom["layers"] == [int(ranking[-1])]
    full = results["surgical"]["full fine-tuning"]
    assert full["layers"] == "all" and full["trainable_parameters"] > top["trainable_parameters"] > 0
    assert set(results["rank_stability"]) == {"0", "1", "2"} and results["rank_stability"]["0"] == 1.0
    for row in results["grafts"].values():
        assert {"learned", "fisher", "random", "bias"} <= set(row) and 0.0 <= row["fisher_iou_with_learned"] <= 1.0
        assert 0.0 <= row["learned"]["ID accuracy"] <= 100.0 and "OOD ECE" in row["fisher"]
    # WiSE-FT's ends are theta_pre (+ its random new head) and theta_ft: alpha 1 is the fine-tuned model.
    assert results["wise"]["WiSE-FT"][1.0] == results["fine-tuned (pipeline)"]
    assert set(results["wise"]["WiSE-graft"]) == {0.0, 0.5, 1.0}
    assert set(results["lottery"]) == {0.0001, 0.5}  # 1 entry kept: all-zero logits are still logits
    summary = (tmp_path / "summary.md").read_text()
    for heading in ("FIM layer scores", "Surgical fine-tuning", "Grafts (Table 8", "WiSE-FT", "Lottery-ticket"):
        assert heading in summary
    for table in summary.split("\n\n"):  # every markdown table is well formed: as many cells as its header
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table
    reread = json.loads((tmp_path / "results.json").read_text())
    assert run_baselines.summary_markdown(reread, "x").split("\n")[1:] == summary.split("\n")[1:]
    assert (tmp_path / "fim_rank_stability.png").is_file() and (tmp_path / "wise_id_ood.png").is_file()
    assert json.loads((tmp_path / "results.json").read_text())["surgical"]["FIM top 1"]["layers"] == top["layers"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--alphas", "1.5"], "--alphas must be values in"), (["--surgical_k", "3"], "choose 1 to 2")],
)
def test_baselines_bad_input(assets, run_dir, tmp_path, extra, message, capsys):  # noqa: F811
    with pytest.raises((SystemExit, ValueError)) as error:
        run_baselines.main(["--run_dir", str(run_dir), "--model_name_or_path", assets["cls"],
                            "--report_dir", str(tmp_path), *SMALL, *extra])  # fmt: skip
    assert message in str(error.value) + capsys.readouterr().err


def test_baselines_refuse_a_folder_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_baselines.main(["--run_dir", str(tmp_path)])
    assert "pass the run folder of examples/run_pipeline.py" in capsys.readouterr().err


def test_baselines_refuse_a_run_without_its_data_splits(assets, run_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "finetuned").symlink_to(run_dir / "finetuned")
    with pytest.raises(SystemExit):
        run_baselines.main(["--run_dir", str(run), "--model_name_or_path", assets["cls"]])
    assert "lacks the ['train', 'dev', 'test'] split(s)" in capsys.readouterr().err
