"""MaskTrainer under DeepSpeed ZeRO-3: 2 CPU processes (gloo, DeepSpeed's CPU accelerator), every tensor partitioned
(S included), learn the same S and save the same graft as 1 process on the same global batch, whether the graft was
created on the whole model or on a model loaded partitioned (``zero.Init``). The runs are tests/ddp_mask_script.py
with DEEPSPEED=1 (the Trainer's ``deepspeed`` argument), or DEEPSPEED=accelerate under ``accelerate launch`` with
examples/accelerate_deepspeed_zero3.yaml."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import TORCHRUN, run_command

if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the torchrun processes use it
    pytest.skip("DeepSpeed is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_mask_script.py")
REFUSAL = "evaluation after hardening refused: A graft model's forward cannot run under DeepSpeed ZeRO-3 once"


ZERO3_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_deepspeed_zero3.yaml")


def check_same_learning(one, two) -> None:
    """S of the checkpoint to fp32 rounding (gathered from the partitions), the checkpoint's and the final graft bit
    for bit."""
    scores_one = load_file(one / "checkpoint-2" / "graft_scores.safetensors")
    scores_two = load_file(two / "checkpoint-2" / "graft_scores.safetensors")
    assert scores_one.keys() == scores_two.keys()
    for name in scores_one:
        torch.testing.assert_close(scores_one[name], scores_two[name], rtol=1e-5, atol=1e-4)
    assert any(bool((s > -10).any()) for s in scores_one.values())  # S moved
    for folder in ("checkpoint-2", "final"):
        graft_one = load_file(one / folder / "adapter_model.safetensors")
        graft_two = load_file(two / folder / "adapter_model.safetensors")
        assert graft_one.keys() == graft_two.keys()
        for name in graft_one:
            assert torch.equal(graft_one[name], graft_two[name]), (folder, name)
        assert sum(v.numel() for k, v in graft_one.items() if k.endswith("graft_values")) > 0
        # the head stored whole (modules_to_save) was gathered from its partitions, not saved as ZeRO-3's placeholders
        heads = [v for k, v in graft_two.items() if "classifier" in k]
        assert heads and all(v.numel() > 0 for v in heads)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "search_fraction, zero_inits", [(None, ("0",)), (0.3, ("0", "1"))], ids=["dense", "search_space"]
)
def test_two_processes_under_zero3_learn_the_same_mask_as_one(tmp_path, monkeypatch, search_fraction, zero_inits):
    extra = [] if search_fraction is None else [str(search_fraction)]
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one"), *extra], tmp_path)
    assert "partitioned=False\nworld_size=1 accumulation=4 sharded=False" in single
    report = single.split("sharded=False ")[1].splitlines()[0]
    monkeypatch.setenv("DEEPSPEED", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for zero_init in zero_inits:  # the graft created on the whole model; on the model loaded partitioned
        monkeypatch.setenv("ZERO_INIT", zero_init)
        double = run_command([*TORCHRUN, SCRIPT, str(tmp_path / f"two{zero_init}"), *extra], tmp_path)
        assert "partitioned=True\nworld_size=2 accumulation=2 sharded=False" in double  # ZeRO-3 partitioned it
        assert double.split("sharded=False ")[1].splitlines()[0] == report
        assert REFUSAL in double
        check_same_learning(tmp_path / "one", tmp_path / f"two{zero_init}")


@pytest.mark.multiprocess
def test_two_processes_under_zero3_select_the_same_mask_with_the_sign_test(tmp_path, monkeypatch):
    """Evaluation during training under ZeRO-3 (the starting mask and every step, with selection_alpha): the same
    selection report and kept graft as one process."""
    monkeypatch.setenv("SELECT", "1")
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)
    monkeypatch.setenv("DEEPSPEED", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    double = run_command([*TORCHRUN, SCRIPT, str(tmp_path / "two")], tmp_path)
    report = single.split("accumulation=4 sharded=False ")[1].splitlines()[0]
    assert "'evaluated_masks': 2" in report and "best_learned_p_value" in report  # the sign test ran
    assert "partitioned=True" in double and double.split("accumulation=2 sharded=False ")[1].splitlines()[0] == report
    graft_one = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    graft_two = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert graft_one.keys() == graft_two.keys()
    assert all(torch.equal(graft_one[name], graft_two[name]) for name in graft_one)


@pytest.mark.multiprocess
def test_two_processes_under_an_accelerate_zero3_config_learn_the_same_mask_as_one(tmp_path, monkeypatch):
    """``accelerate launch`` with examples/accelerate_deepspeed_zero3.yaml (no ``deepspeed`` argument; ZeRO-3 keeps the
    small tensors gathered between steps): the same report, S and grafts as one process."""
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)
    report = single.split("sharded=False ")[1].splitlines()[0]
    monkeypatch.setenv("DEEPSPEED", "accelerate")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3_CONFIG, "--num_processes", "2"]
    launch += ["--gradient_accumulation_steps", "2", "--gradient_clipping", "0"]  # as the script's arguments
    double = run_command([*launch, SCRIPT, str(tmp_path / "two")], tmp_path)
    assert "partitioned=True\nworld_size=2 accumulation=2 sharded=False" in double
    assert double.split("sharded=False ")[1].splitlines()[0] == report
    assert REFUSAL in double
    check_same_learning(tmp_path / "one", tmp_path / "two")
