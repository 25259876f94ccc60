"""A graft model under real FSDP, 2 CPU processes (gloo): FSDP v1 is refused at forward, FSDP2's unmerged forward is
exact (also of an adapter loaded before sharding); merging, saving sharded graft tensors, loading an adapter and
merge_grafts under it are refused with the way out, and change nothing."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import TORCHRUN, run_command

SCRIPT = os.path.join(os.path.dirname(__file__), "fsdp_graft_script.py")


def results(kind: str, tmp_path) -> list[list[str]]:
    run_command([*TORCHRUN, SCRIPT, kind], tmp_path)
    return [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]


@pytest.mark.multiprocess
def test_fsdp_v1_is_refused_at_forward_and_merge(tmp_path):
    for forward, merge in results("fsdp1", tmp_path):
        assert forward.startswith("forward refused: A graft layer") and "runs under FSDP v1" in forward
        assert merge.startswith("merge refused: A graft layer") and "runs under FSDP v1" in merge


@pytest.mark.multiprocess
def test_fsdp2_forward_is_exact_and_what_needs_the_graft_whole_is_refused(tmp_path):
    for forward, merge, save, load, merge_grafts, adapters, loaded_forward in results("fsdp2", tmp_path):
        assert forward == "forward exact: True"
        assert merge.startswith("merge refused: A graft layer") and "is sharded by FSDP2 and cannot be merged" in merge
        assert save.startswith("save refused: save_pretrained() needs the model's tensors whole, but FSDP2 shards")
        assert ".graft_values." in save and "save the graft before sharding the model" in save
        assert load.startswith("load refused: load_adapter('third') needs the model's tensors whole, but FSDP2")
        assert "load every adapter before sharding the model" in load
        assert merge_grafts.startswith("merge_grafts refused: merge_grafts() needs the model's tensors whole")
        assert "merge the grafts in one process, on the whole model" in merge_grafts
        assert adapters == "adapters: ['default', 'other']"  # the refused load and merge left no adapter behind
        assert loaded_forward == "loaded before sharding, forward exact: True"
        assert not (tmp_path / "saved0").exists() and not (tmp_path / "saved1").exists()
    # The way out: the state gathered on every process and saved from rank 0 is the graft saved before sharding.
    before = load_file(tmp_path / "before" / "adapter_model.safetensors")
    gathered = load_file(tmp_path / "gathered" / "adapter_model.safetensors")
    assert before.keys() == gathered.keys() and any(name.endswith("graft_values") for name in before)
    assert all(torch.equal(before[name], gathered[name]) for name in before)
