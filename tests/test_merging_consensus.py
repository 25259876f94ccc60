"""Consensus merging (TALL masks, Wang et al., ICML 2024) in merge_grafts: the merged entries equal the formula on
hand-built task vectors, for task arithmetic and TIES; bad consensus options are refused, the model unchanged."""

from __future__ import annotations

import pytest
import torch
from peft.utils import merge_utils
from test_merging import TASKS, folders, loaded, pre, state, task_vectors  # noqa: F401  (fixtures)

from peft_graft.merging import MERGE_RULES, merge_grafts


def consensus_mask(taus: torch.Tensor, k: int, tall_lambda: float) -> torch.Tensor:
    total = taus.sum(0)
    votes = torch.zeros(taus.shape[1], dtype=torch.int64)
    for tau in taus:
        votes += (tau.abs() > tall_lambda * (total - tau).abs()).long()
    return votes >= k


@pytest.mark.parametrize(("k", "tall_lambda"), [(2, 1.0), (1, 1.5), (3, 0.2)])
def test_consensus_ta_drops_entries_fewer_than_k_tasks_hold(pre, folders, k, tall_lambda):  # noqa: F811
    model = loaded(pre, folders, "full")
    merged = merge_grafts(model, list(TASKS), "consensus_ta", weights=0.4, consensus_k=k, tall_lambda=tall_lambda)
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    keep = consensus_mask(taus, k, tall_lambda)
    assert 0 < int(keep.sum()) < keep.numel()  # the mask matters on these task vectors
    torch.testing.assert_close(result, torch.where(keep, 0.4 * taus.sum(0), 0.0), rtol=1e-4, atol=1e-8)
    masked = [torch.where(keep, tau, 0.0) for tau in taus]
    assert torch.equal(result, merge_utils.task_arithmetic(masked, torch.full((3,), 0.4)))
    assert merged.num_entries == int((result != 0).sum())
    assert merged.options["consensus_k"] == k and merged.options["tall_lambda"] == tall_lambda


def test_consensus_ties_is_ties_on_the_masked_task_vectors(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "full")
    merge_grafts(model, list(TASKS), "consensus_ties", weights=1.5, density=0.2)
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    keep = consensus_mask(taus, 2, 1.0)
    masked = [torch.where(keep, tau, 0.0) for tau in taus]
    assert torch.equal(result, merge_utils.ties(masked, torch.full((3,), 1.5), 0.2, "total"))
    assert not result[~keep].any()
    plain = merge_grafts(model, list(TASKS), "ties", adapter_name="ties", weights=1.5, density=0.2)
    assert plain.num_entries > int((result != 0).sum())  # TIES alone keeps entries the consensus dropped


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(rule="consensus_ta", consensus_k=4), r"consensus_k must be an int in \[1, 3\]"),
        (dict(rule="consensus_ta", consensus_k=0), r"consensus_k must be an int in \[1, 3\]"),
        (dict(rule="consensus_ta", tall_lambda=-1.0), "tall_lambda must be a finite number >= 0"),
        (dict(rule="consensus_ta", tall_lambda=float("nan")), "tall_lambda must be a finite number >= 0"),
        (dict(rule="consensus_ties"), r"needs density in \(0, 1\]"),
        (dict(rule="ties", density=0.5, consensus_k=3), "takes no consensus_k/tall_lambda"),
    ],
)
def test_bad_consensus_options_are_refused(pre, folders, options, match):  # noqa: F811
    model = loaded(pre, folders, "full")
    before = state(model)
    with pytest.raises(ValueError, match=match):
        merge_grafts(model, list(TASKS), **options)
    assert state(model) == before


def test_consensus_rules_are_listed():
    assert {"consensus_ta", "consensus_ties"} <= set(MERGE_RULES)
