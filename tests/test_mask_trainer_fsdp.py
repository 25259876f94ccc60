"""MaskTrainer under FSDP2 through the Trainer's ``fsdp_config``: 2 CPU processes (gloo) shard the frozen model and
learn the same S, mask and graft as 1 process on the same global batch; their checkpoints resume under FSDP2 and in
one process, also under ``accelerate launch`` with examples/accelerate_fsdp2_mask.yaml. The runs are
tests/ddp_mask_script.py with ``FSDP=1`` (or ``accelerate``)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from peft.utils.other import ModulesToSaveWrapper
from safetensors.torch import load_file
from testing_utils import TORCHRUN, cls_dataset, fast_args, learning_graft, run_command

from peft_graft import GraftLayer, MaskTrainer

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_mask_script.py")
ACCELERATE_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_fsdp2_mask.yaml")


def assert_same_scores(one, two) -> None:
    """S equal to fp32 rounding (the processes sum their gradients in another order)."""
    one, two = load_file(one / "graft_scores.safetensors"), load_file(two / "graft_scores.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-4)
    assert any(bool((s > -10).any()) for s in one.values())  # S moved


def assert_same_graft(one, two) -> None:
    one, two = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name
    assert sum(v.numel() for k, v in one.items() if k.endswith("graft_values")) > 0


@pytest.mark.multiprocess
def test_fsdp2_learns_the_mask_of_one_process_and_its_checkpoints_resume_anywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("SAVE_STEPS", "1")
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)
    monkeypatch.setenv("FSDP", "1")
    sharded = run_command([*TORCHRUN, SCRIPT, str(tmp_path / "two")], tmp_path)
    assert "world_size=1 accumulation=4 sharded=False" in single
    assert "world_size=2 accumulation=2 sharded=True" in sharded  # the Trainer's FSDP2 sharded the model
    assert single.splitlines()[-1].split("False ")[1] == sharded.splitlines()[-1].split("True ")[1]  # mask report
    for step in ("checkpoint-1", "checkpoint-2"):
        assert_same_scores(tmp_path / "one" / step, tmp_path / "two" / step)
        assert_same_graft(tmp_path / "one" / step, tmp_path / "two" / step)  # each checkpoint: its hard mask
    assert_same_graft(tmp_path / "one" / "final", tmp_path / "two" / "final")

    # The FSDP2 checkpoint holds S whole: FSDP2 (started by accelerate launch with the example config file) and one
    # process resume from it to the same end.
    monkeypatch.setenv("RESUME", str(tmp_path / "two" / "checkpoint-1"))
    monkeypatch.setenv("FSDP", "accelerate")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ACCELERATE_CONFIG]
    launch += ["--num_processes", "2", "--fsdp_transformer_layer_cls_to_wrap", "RobertaLayer"]
    assert "sharded=True" in run_command([*launch, SCRIPT, str(tmp_path / "two_resumed")], tmp_path)
    monkeypatch.delenv("FSDP")
    run_command([sys.executable, SCRIPT, str(tmp_path / "one_resumed")], tmp_path)
    for resumed in ("two_resumed", "one_resumed"):
        assert_same_scores(tmp_path / "one" / "checkpoint-2", tmp_path / resumed / "checkpoint-2")
        assert_same_graft(tmp_path / "one" / "final", tmp_path / resumed / "final")


@pytest.mark.multiprocess
def test_fsdp2_selects_the_mask_of_one_process_on_a_search_space(tmp_path, monkeypatch):
    """keep_best_mask with selection_alpha: the hard masks evaluated under FSDP2, the predictions gathered from both
    processes, the sign test and the kept graft are those of one process."""
    monkeypatch.setenv("SELECT", "1")
    single = run_command([sys.executable, SCRIPT, str(tmp_path / "one"), "0.3"], tmp_path)
    monkeypatch.setenv("FSDP", "1")
    sharded = run_command([*TORCHRUN, SCRIPT, str(tmp_path / "two"), "0.3"], tmp_path)
    report = single.split("sharded=False ")[1].splitlines()[0]
    assert "'evaluated_masks': 2" in report and "best_learned_p_value" in report  # the sign test ran
    assert sharded.split("sharded=True ")[1].splitlines()[0] == report
    graft_one = load_file(tmp_path / "one" / "final" / "adapter_model.safetensors")
    graft_two = load_file(tmp_path / "two" / "final" / "adapter_model.safetensors")
    assert graft_one.keys() == graft_two.keys()
    assert all(torch.equal(graft_one[name], graft_two[name]) for name in graft_one)


def test_other_sharding_engines_are_refused_and_fsdp2_ignores_the_graft_state(tmp_path):
    """What MaskTrainer decides once the Trainer's accelerator knows the engine (an accelerate config file sets it
    without any training argument): FSDP v1, DeepSpeed ZeRO-1/2 and cpu_ram_efficient_loading are clear errors; FSDP2 is
    handed the graft's own modules (S, hard regions, heads stored whole) as ignored: it shards the frozen model only."""
    _, model = learning_graft()
    trainer = MaskTrainer(model=model, args=fast_args(tmp_path), train_dataset=cls_dataset())
    assert trainer._sharded is False
    trainer.is_deepspeed_enabled = True  # ZeRO-3 runs (tests/test_mask_trainer_zero3.py), other stages are refused
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    with pytest.raises(ValueError, match="cannot run under DeepSpeed ZeRO-2"):
        trainer._prepare_deepspeed()
    trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled = False, True
    plugin = SimpleNamespace(fsdp_version=1, cpu_ram_efficient_loading=False, ignored_modules=None)
    trainer.accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(ValueError, match="does not support FSDP v1"):
        trainer._prepare_sharding()
    plugin.fsdp_version, plugin.cpu_ram_efficient_loading = 2, True
    with pytest.raises(ValueError, match="cpu_ram_efficient_loading"):
        trainer._prepare_sharding()
    plugin.cpu_ram_efficient_loading = False
    assert trainer._prepare_sharding() is True
    trainer._sharded = True
    trainer._set_soft_parameter_recomputation()  # recompute_soft_parameters=None: on under FSDP2
    assert all(layer.recompute_soft_parameters for layer in model.base_model.graft_layers().values())
    ignored = {id(p) for module in plugin.ignored_modules for p in module.parameters()}
    for name, param in model.named_parameters():
        graft_state = "graft_" in name or ".modules_to_save." in name
        assert (id(param) in ignored) == graft_state, name
    assert any(isinstance(m, ModulesToSaveWrapper) for m in model.modules())  # the head stored whole is among them
    assert all(m.learner("default").scores.requires_grad for m in model.modules() if isinstance(m, GraftLayer))
