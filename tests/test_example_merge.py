"""run_merge.py: the fair design (a frozen head of its own per task, losses over its own classes only, no head-like
module in any graft or merge) and the whole run end to end on a tiny random BERT and the packaged tasks (``--smoke``):
every rule tuned on dev only with its grid widened off an edge, the serving rows, the report, and a rerun that reuses
every saved result."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_examples import assets  # noqa: F401  (a fixture)
from transformers import AutoTokenizer, BertModel

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import run_merge  # noqa: E402

STACKS_BUILT: list[tuple[str, ...]] = []
RULES = ("stitch_dataless", "task_arithmetic", "ties", "dare_ties", "dare_linear", "consensus_ta", "consensus_ties",
         "wudi", "wudi_adam", "regmean", "task_arithmetic_lines", "ties_lines", "consensus_ta_lines",
         "consensus_ties_lines", "stitch_scaled_ls", "stitch_scaled_learned")  # fmt: skip


@pytest.fixture(scope="module")
def encoder(assets, tmp_path_factory):  # noqa: F811
    """A BERT body without a head, as all-MiniLM-L6-v2 is shipped."""
    folder = tmp_path_factory.mktemp("encoder")
    BertModel.from_pretrained(assets["cls"]).save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets["cls"]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def smoke(encoder, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    argv = ["--model_name_or_path", encoder, "--smoke", "--lambdas", "0.5", "1.0", "--densities", "0.5",
            "--tall_lambdas", "0.4", "--dataless_densities", "0.1", "0.5", "--max_widen", "1", "--ls_sparsity", "0.05",
            "--regmean_alphas", "0.9", "--regmean_examples", "8", "--lines_alphas", "1.0", "--lines_betas", "0.5",
            "--stitch_scales", "1.0", "1.5",
            "--work_dir", str(root / "work"), "--report_dir", str(root / "report")]  # fmt: skip
    original = run_merge.TaskVectorStack

    class Counted(original):  # records each stack run_merge builds (merge_grafts' own, per merge, are not counted)
        def __init__(self, model, grafts, exclude=None):
            STACKS_BUILT.append(tuple(grafts.values()))
            super().__init__(model, grafts, exclude)

    run_merge.TaskVectorStack = Counted
    try:
        return argv, root, run_merge.main(argv)
    finally:
        run_merge.TaskVectorStack = original


def test_each_task_has_its_own_frozen_head_and_a_loss_over_its_own_classes(encoder):
    tokenizer = AutoTokenizer.from_pretrained(encoder)
    pre = run_merge.pretrained(encoder, scale=20.0)
    assert not hasattr(pre.body, "pooler") or pre.body.pooler is None  # mean-pooled: no pooler to merge
    heads = {n: run_merge.task_head(pre, tokenizer, list(run_merge.DESCRIPTIONS[n].values())) for n in run_merge.TASKS}
    assert {n: h.shape[0] for n, h in heads.items()} == {"mr": 2, "trec": 6, "sms": 2, "tweets": 3}
    assert all(torch.allclose(h.norm(dim=-1), torch.ones(len(h))) for h in heads.values())
    assert not torch.equal(heads["mr"], heads["sms"])  # independent: each from its own class descriptions
    assert not any(p.requires_grad for p in pre.body.embeddings.parameters())
    assert "head" not in dict(pre.named_parameters()) and "head" not in pre.state_dict()  # never trained or grafted
    batch = tokenizer(["what is the capital of france", "a fine film"], padding=True, return_tensors="pt")
    run_merge.set_head(pre, heads["trec"])
    out = pre(**batch, labels=torch.tensor([4, 1]))
    assert out.logits.shape == (2, 6)
    expected = torch.nn.functional.cross_entropy(out.logits, torch.tensor([4, 1]))
    assert torch.allclose(out.loss, expected)
    run_merge.set_head(pre, heads["mr"])
    assert pre(**batch).logits.shape == (2, 2)  # a two-class task sees two logits, no other task's


def test_no_head_like_module_is_in_any_graft_or_merge(smoke):
    argv, root, results = smoke
    from peft_graft import Region

    pre = run_merge.pretrained(argv[1], scale=20.0)
    for task in run_merge.TASKS:
        for kind in ("full", *run_merge.REGION_KINDS):
            region = Region.from_pretrained(root / "work" / "tasks" / task / kind, pre)
            assert region.num_entries > 0
            assert all(".encoder.layer." in name for name in region), (task, kind)  # no pooler, head or embeddings
    for view in results["merge"]["regions"].values():
        assert not any("pooler" in t or "classifier" in t or "head" in t for t in view["shared_by_tensor"])


def test_run_merge_tunes_on_dev_serves_and_reports(smoke):
    argv, root, results = smoke
    merge = results["merge"]
    assert list(merge["test"]) == ["stitch_ls", "stitch_disjoint", "stitch_learned", *RULES]
    assert set(merge["tuned"]) == set(RULES)
    scores = json.loads((root / "work" / "merge_scores.json").read_text())["scores"]
    dev_labels = {label.removesuffix(" | dev") for label in scores if label.endswith(" | dev")}
    assert dev_labels == set(merge["grid_dev"])  # the grids never touched test
    for rule, chosen in merge["tuned"].items():
        assert chosen["label"] in merge["grid_dev"] and merge["test"][rule]["label"] == chosen["label"]
        assert set(chosen["tried"]) <= set(merge["grid_dev"])
        dev = {label: run_merge.mean_accuracy(merge["grid_dev"][label], run_merge.TASKS) for label in chosen["tried"]}
        best = max(dev, key=dev.get)
        assert run_merge.mean_accuracy(merge["grid_dev"][best], run_merge.TASKS) == chosen["dev"]
        assert merge["test"][rule]["merge_seconds"] > 0  # every row says how long its merge took
        for axis, values in chosen["axes"].items():  # widened once, off the edge its winner was on, or not at all
            dataless = rule == "stitch_dataless"
            given = {
                "weights": [0.5, 1.0],
                "density": [0.1, 0.5] if dataless else [0.5],
                "tall_lambda": [0.4],
                "regmean_alpha": [0.9],
                "lines_alpha": [1.0],
                "lines_beta": [0.5],
                "scale": [1.0, 1.5],
            }[axis]
            assert set(given) <= set(values) and len(values) <= len(given) + 1
            if axis in chosen["edges"]:
                assert chosen["options"][axis] in (min(values), max(values))
    for row in merge["test"].values():
        assert all(0.0 <= row[t]["accuracy"] <= 100.0 and row[t]["ece"] >= 0 for t in run_merge.TASKS)
        assert sum(row["trec"]["predicted"]) == 24 and len(row["trec"]["predicted"]) == 6
    own = merge["interference"]["own graft"]  # a "merge" of one task's L&S graft is that graft: the merge is scored
    for task in run_merge.TASKS:
        assert own[task]["accuracy"] == results["individual"][task]["ls"]["test"]["accuracy"]
        assert own[task]["ece"] == pytest.approx(results["individual"][task]["ls"]["test"]["ece"], abs=1e-3)
    disjoint = merge["regions"]["disjoint"]
    assert disjoint["shared_entries"] == 0  # regions that do not collide
    assert all(disjoint["overlap_matrix"][i][j] == (1.0 if i == j else 0.0) for i in range(4) for j in range(4))
    served = merge["serving"]
    for task in run_merge.TASKS:  # the exact grafts served mixed are the fine-tunes
        assert served["full"][task]["accuracy"] == results["individual"][task]["finetune"]["test"]["accuracy"]
        assert served["full"][task]["ece"] == pytest.approx(
            results["individual"][task]["finetune"]["test"]["ece"], abs=1e-3
        )
        assert served["ls"][task]["accuracy"] == results["individual"][task]["ls"]["test"]["accuracy"]
        assert served["learned"][task]["accuracy"] == results["individual"][task]["learned"]["test"]["accuracy"]
        assert served["learned"][task]["ece"] >= 0
    assert 0 < served["learned"]["bytes"] < served["full"]["bytes"]
    for kind, fraction in (("learned_0p001", 0.001), ("learned_0p003", 0.003)):  # --served_fractions: served only
        wanted = max(1, round(fraction * merge["num_params"]))
        assert all(results["individual"][t][kind]["entries"] == wanted for t in run_merge.TASKS)
        assert served[kind]["entries"] == 4 * wanted and served[kind]["bytes"] < served["learned"]["bytes"]
        assert all(served[kind][t]["accuracy"] == results["individual"][t][kind]["test"]["accuracy"]
                   for t in run_merge.TASKS)  # fmt: skip
    costs = served["forward_cost"]
    assert costs["merged_rule"] in RULES and set(costs) == {"merged_rule", "32", "256"}  # --cost_batches
    assert (costs["32"]["batch"], costs["256"]["batch"]) == (32, 96)  # 256 asked, the 96 test examples there are
    for cost in (costs["32"], costs["256"]):
        for kind in ("full", "ls", "learned", "learned_0p001", "learned_0p003"):
            for mode in ("exact", "sparse_delta"):
                assert cost[f"{kind} {mode}"]["median"] > 0
        assert cost["merged"]["median"] > 0 and cost["tokens"] > 0
    norms = merge["norms"]
    assert set(norms) == set(run_merge.TASKS) and all(n["total"] > 0 for n in norms.values())
    assert all(".encoder.layer." in kind or kind == "total" for kind in norms["mr"])
    for name in ("summary.md", "results.json", "merge_accuracy_vs_size.png", "merge_overlap_ls.png"):
        assert (root / "report" / name).is_file()
    summary = (root / "report" / "summary.md").read_text()
    assert "avg normalized acc" in summary and "served: each task's full graft" in summary and "Dev grid" in summary
    assert "sparse_delta" in summary and "Task-vector norms" in summary and "RegMean" in summary
    assert "MaskTrainer graft of 0.1% of the parameters" in summary and "MaskTrainer, 0.3% (entries)" in summary
    kinds = [stack[0].split("_", 1)[1] for stack in STACKS_BUILT]  # adapters "<task>_<kind>"
    assert sorted(kinds) == ["disjoint", "full", "learned", "ls"]  # each kind's task vectors stacked once
    again = run_merge.main(argv)  # everything saved: the same numbers, nothing recomputed
    assert again["merge"]["test"] == merge["test"] and again["individual"] == results["individual"]
    assert again["merge"]["serving"] == served


def test_a_grid_axis_widens_off_its_edge_within_its_bounds():
    assert run_merge.extend([0.3, 0.5, 1.5], 1.5, None) == [0.3, 0.5, 1.5, 2.25]  # lambda: beyond the top
    assert run_merge.extend([0.3, 0.5, 1.5], 0.3, None) == [0.15, 0.3, 0.5, 1.5]  # and below the bottom
    assert run_merge.extend([0.3, 0.5, 1.5], 0.5, None) is None  # an inner winner: nothing to widen
    assert run_merge.extend([0.1, 0.3, 0.6], 0.6, 1.0) == [0.1, 0.3, 0.6, 1.0]  # a density stops at 1
    assert run_merge.extend([0.1, 0.3, 0.6, 1.0], 1.0, 1.0) is None  # 1 is the axis' own edge


def test_cached_merge_scores_are_keyed_by_the_tasks_grids_and_consensus_k():
    """A rerun with other tasks, grids or Consensus k scores its merges afresh (the cache key changes); the tasks'
    own stages (fine-tunes, regions) keep their key."""
    run = SimpleNamespace(settings={"ft_steps": 400}, seed=42)
    args = run_merge.MergeArguments()
    tasks_key, merge_key = run_merge.run_key(run, args), run_merge.run_key(run, args, merging=True)
    for change in ({"consensus_k": 3}, {"tasks": ["mr", "trec"]}, {"lambdas": [0.5]}, {"densities": [0.2]}):
        other = dataclasses.replace(args, **change)
        assert run_merge.run_key(run, other, merging=True) != merge_key, change
        assert run_merge.run_key(run, other) == tasks_key, change


def test_bench_served_grafts_times_the_saved_grafts_mixed(smoke, encoder, tmp_path):
    """``benchmarks/bench_served_grafts.py`` on the smoke run's saved grafts: a positive ratio and base time per batch
    size; a folder without saved grafts, a kind not saved and a size of 0 are clear errors."""
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import bench_served_grafts

    root = smoke[1]
    common = ["--model_name_or_path", encoder, "--smoke", "--rounds", "1", "--sizes", "4", "8", "--threads", "1"]
    out = bench_served_grafts.main([*common, "--work_dir", str(root / "work")])
    assert set(out["sizes"]) == {"4", "8"} and out["kind"] == "learned" and out["mode"] == "exact"
    assert all(size["ratio"] > 0 and size["base_ms"] > 0 for size in out["sizes"].values())
    assert [out["sizes"][size]["examples"] for size in ("4", "8")] == [4, 8]
    with pytest.raises(ValueError, match=r"No saved grafts under .*empty.*run_merge\.py"):
        bench_served_grafts.main([*common, "--work_dir", str(tmp_path / "empty")])
    with pytest.raises(ValueError, match=r"No saved graft .*mr.*lerned: --kind is one of \[.*'learned'"):
        bench_served_grafts.main([*common, "--work_dir", str(root / "work"), "--kind", "lerned"])
    with pytest.raises(SystemExit):  # argparse's error: sizes of at least 1
        bench_served_grafts.main([*common, "--work_dir", str(root / "work"), "--sizes", "0"])
