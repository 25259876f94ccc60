"""MaskTrainer under DDP: 2 CPU processes (gloo) learn the same mask as 1 process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import TORCHRUN, run_command

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_mask_script.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("search_fraction", [None, 0.3], ids=["dense", "search_space"])
def test_two_processes_learn_the_same_mask_as_one(tmp_path, search_fraction):
    extra = [] if search_fraction is None else [str(search_fraction)]
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one"), *extra], tmp_path)
    double = run_command([*TORCHRUN, SCRIPT, str(tmp_path / "two"), *extra], tmp_path)
    assert "world_size=1 accumulation=4" in single and "world_size=2 accumulation=2" in double

    one = load_file(tmp_path / "one" / "checkpoint-2" / "graft_scores.safetensors")
    two = load_file(tmp_path / "two" / "checkpoint-2" / "graft_scores.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-4)
    assert any(bool((s > -10).any()) for s in one.values())  # S moved

    graft_one = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    graft_two = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert graft_one.keys() == graft_two.keys()
    for name in graft_one:
        assert torch.equal(graft_one[name], graft_two[name]), name
    assert sum(v.numel() for k, v in graft_one.items() if k.endswith("graft_values")) > 0


@pytest.mark.multiprocess
def test_two_processes_select_the_same_mask_with_the_sign_test(tmp_path, monkeypatch):
    """Each process sees the predictions of both (gathered), so both keep the same mask, the one 1 process keeps."""
    monkeypatch.setenv("SELECT", "1")
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)
    double = run_command([*TORCHRUN, SCRIPT, str(tmp_path / "two")], tmp_path)
    report = single.split("accumulation=4 ")[1].splitlines()[0]
    assert "'evaluated_masks': 2" in report and "best_learned_p_value" in report  # the sign test ran
    assert double.split("accumulation=2 ")[1].splitlines()[0] == report
    graft_one = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    graft_two = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert graft_one.keys() == graft_two.keys()
    assert all(torch.equal(graft_one[name], graft_two[name]) for name in graft_one)


@pytest.mark.multiprocess
def test_an_evaluation_before_training_is_refused_under_ddp(tmp_path, monkeypatch):
    """accelerate would mark the model prepared, and the Trainer would then train it without DDP."""
    monkeypatch.setenv("SELECT", "1")
    monkeypatch.setenv("EVALUATE_FIRST", "1")
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)  # one process: nothing to wrap
    assert "world_size=1" in single
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [*TORCHRUN, SCRIPT, str(tmp_path / "two")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "evaluated before its first training" in result.stderr
