"""The exact-budget trim keeps the entries learning ranked highest (paper Eq. 4), not those module order picks."""

from __future__ import annotations

import copy
import logging

import torch
from datasets import Dataset
from peft import get_peft_model
from test_mask_trainer import _probe_task
from testing_utils import cls_dataset, fast_args, learning_graft

from peft_graft import GraftConfig, MaskTrainer


def _learners(model) -> dict:
    return model.base_model.region_learners()


def _kept(model) -> dict[str, set[int]]:
    return {
        module: set(layer.entries("default")[0].tolist()) for module, layer in model.base_model.graft_layers().items()
    }


def test_trim_ranks_by_the_scores_where_sigmoid_saturates():
    """At the paper's learning rates S reaches thousands; sigmoid(S) is 1.0 in fp32 from S = 16.7 on, so ranking gamma
    ties every learned entry and the earliest module won. The trim must rank by S (and by -S inside gamma_base)."""
    _, model = learning_graft(region="movement", num_entries=20)
    learners = _learners(model)
    names = list(learners)
    first = names[0]
    last = next(m for m in reversed(names[1:]) if learners[m].base_region.numel() and learners[m].moved().sum() > 3)
    moved_first, moved_last = (learners[m].moved().nonzero().reshape(-1) for m in (first, last))
    with torch.no_grad():
        for learner in learners.values():  # gamma near 0 everywhere: outside gamma_base S << 0, inside S >> 0
            learner.scores.fill_(-30.0)
            learner.scores[learner.base_region] = 30.0
        outside_base = [int(p) for p in moved_last if not bool((learners[last].base_region == p).any())]
        inside_base = learners[last].base_region[learners[last].moved()[learners[last].base_region]]
        learners[first].scores[moved_first[0]] = 50.0  # gamma = 1.0 in fp32, but the lowest score of the four
        learners[last].scores[outside_base[0]] = 100.0
        learners[last].scores[outside_base[1]] = 300.0
        learners[last].scores[inside_base[0]] = -200.0  # gamma = sigmoid(200) = 1.0: ranks by -S = 200
        gammas = {m: learner.gamma() for m, learner in learners.items()}
    assert float(gammas[first][moved_first[0]]) == float(gammas[last][outside_base[0]]) == 1.0  # the old ranking tied

    expected = {int(outside_base[0]), int(outside_base[1]), int(inside_base[0])}
    assert model.base_model.harden_region(num_entries=3) == 3
    kept = _kept(model)
    assert kept[last] == expected
    assert all(not entries for module, entries in kept.items() if module != last)


def test_a_run_that_moves_entries_keeps_the_learned_ones_and_warns_when_the_trim_discards_most(tmp_path, caplog):
    """The probe's fine-tuning planted 4 entries that solve the task among larger noise: learning from top-k movement
    at a large learning rate moves many entries past 0.5, and a budget of 2 keeps the 2 of largest score, which are
    learned (outside gamma_base), not the first ones in module order."""
    budget = 2
    pre, finetuned, x, labels = _probe_task()
    data = Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})
    config = GraftConfig(finetuned=finetuned, num_entries=4, region="movement", learn_region=True)
    model = get_peft_model(copy.deepcopy(pre), config)
    args = fast_args(
        tmp_path,
        per_device_train_batch_size=512,
        max_steps=4,
        learning_rate=1e6,
        remove_unused_columns=False,
        num_entries=budget,
    )
    trainer = MaskTrainer(model=model, args=args, train_dataset=data)
    learners = _learners(model)
    starting = {m: set(learner.flat_indices(learner.base_region).tolist()) for m, learner in learners.items()}
    final_keys = {}
    harden = model.base_model.harden_region

    def keep_keys_then_harden(*a, **kw):  # hardening releases the learners: read their scores first
        final_keys.update({m: learner.gamma_order().clone() for m, learner in learners.items()})
        return harden(*a, **kw)

    model.base_model.harden_region = keep_keys_then_harden
    with caplog.at_level(logging.INFO, logger="peft_graft.training.mask"):
        trainer.train()

    kept = _kept(model)
    assert sum(len(entries) for entries in kept.values()) == budget
    lowest_kept = torch.topk(torch.cat(list(final_keys.values())), budget).values[-1]
    for module, entries in kept.items():  # every kept entry is among the largest scores
        assert all(float(final_keys[module][i]) >= lowest_kept for i in entries)
    assert any(entries - starting[m] for m, entries in kept.items()), "no learned entry was kept"

    rounded = trainer.mask_report["grafted_entries_rounded"]
    assert rounded > 3 * budget
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "round(gamma) holds" in r.message]
    assert len(warnings) == 1 and f"{rounded} entries" in warnings[0].message


def test_a_trim_within_the_budget_is_an_info_line(tmp_path, caplog):
    _, model = learning_graft(region="movement", num_entries=20)
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=1, learning_rate=1e-9, num_entries=20)
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16))
    with caplog.at_level(logging.INFO, logger="peft_graft.training.mask"):
        trainer.train()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("Grafted entries: 20 by round(gamma), 20 kept." in r.message for r in caplog.records)
