"""DeepSpeed under 2 CPU processes (gloo, DeepSpeed's CPU accelerator), through the usual entry points (a Trainer's
``deepspeed`` argument, a model loaded under ZeRO-3's ``zero.Init``): a graft created or loaded on a partitioned model
saves bit for bit what one process saves from the whole model, and leaves the model partitioned; a ContinualGrafter is
created on a partitioned model, and restricted training runs under ZeRO-3 (a Trainer, and a custom loop stepping the
engine); merging a partitioned graft, MaskTrainer with what it does not support under ZeRO-3 (l1_penalty, resuming,
load_best_model_at_end, tied weights) or under ZeRO-2, a Trainer running a graft model outside MaskTrainer, restricted
training under ZeRO-2 or with offload_optimizer, and ContinualGrafter under ZeRO-2 are refused at once with a
ValueError naming the way out (FSDP2 or DDP), and leave the model untouched. The runs are tests/deepspeed_script.py;
MaskTrainer under ZeRO-3 is tests/test_mask_trainer_zero3.py, restricted training and continual learning under ZeRO-3
tests/test_restriction.py and tests/test_continual.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
from testing_utils import TORCHRUN, run_command

if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the torchrun processes use it
    pytest.skip("DeepSpeed is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_script.py")
MASK_TRAINER = "MaskTrainer (TrainingArguments(deepspeed=...) or an accelerate config with DeepSpeed)"
ENTRY_POINTS = {
    "merge_and_unload": "Merging a graft cannot run under DeepSpeed ZeRO-3",
    "merge_grafts": "merge_grafts() needs the model's tensors whole, but DeepSpeed ZeRO-3 shards them",
    "MaskTrainer (l1_penalty)": f"{MASK_TRAINER} under DeepSpeed ZeRO-3: l1_penalty reads S outside the graft layers'",
    "MaskTrainer (load_best_model_at_end)": f"{MASK_TRAINER} under DeepSpeed ZeRO-3: load_best_model_at_end reloads "
    "S into a partitioned parameter",
    "MaskTrainer (resuming)": "Resuming mask training (mask/checkpoint-1) under DeepSpeed ZeRO-3 would write S into a "
    "partitioned parameter",
    "MaskTrainer (tied weights)": f"{MASK_TRAINER} under DeepSpeed ZeRO-3: a graft layer applies the entries of a tied "
    "tensor",
    "Trainer on a graft": "A graft model's forward outside MaskTrainer cannot run under DeepSpeed ZeRO-3: under ZeRO-3 "
    "peft_graft runs a graft model's forward only while MaskTrainer learns a region",
    "RestrictTrainingCallback (offload_optimizer)": "Restricted training (TrainingRestriction, "
    "RestrictTrainingCallback) cannot run under DeepSpeed ZeRO-3 with offload_optimizer",
    "RestrictTrainingCallback (ZeRO-2)": "Restricted training (TrainingRestriction, RestrictTrainingCallback) cannot "
    "run under DeepSpeed ZeRO-2: peft_graft restricts training under DeepSpeed only at ZeRO-3",
    "MaskTrainer (ZeRO-2)": f"{MASK_TRAINER} cannot run under DeepSpeed ZeRO-2",
    "ContinualGrafter (ZeRO-2)": "ContinualGrafter cannot run under DeepSpeed ZeRO-2: a continual learner trains each "
    "task under a training restriction, which peft_graft runs under DeepSpeed only at ZeRO-3",
}
CHECKS = ["untouched: True", "base still partitioned: True", "created saves bit-exact: True"]
# run under ZeRO-3 (trained as one process in test_restriction.py and test_continual.py)
CHECKS += ["loaded saves bit-exact: True", "ContinualGrafter ran", "RestrictTrainingCallback ran"]
CHECKS.append("custom loop restricted: True")  # deepspeed.initialize, engine.step() under restrict_training
CHECKS.append("custom loop writing after deepspeed.initialize stopped: True")  # the fp32 copies would undo it


@pytest.mark.multiprocess
def test_deepspeed_zero3_creation_and_loading_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_command([*TORCHRUN, SCRIPT], tmp_path)
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        results = dict(line.split(" refused: ", 1) if " refused: " in line else (line, "") for line in lines)
        for check in CHECKS:  # the refused learner added nothing; creation and loading saved the whole model's graft
            assert results.pop(check) == "", check
        assert list(results) == list(ENTRY_POINTS)
        for entry_point, message in results.items():
            assert message.startswith(ENTRY_POINTS[entry_point]), (entry_point, message)
            if entry_point != "merge_grafts":  # which says how to merge instead
                assert "FSDP2" in message and "DDP" in message, (entry_point, message)
            if entry_point in ("MaskTrainer (ZeRO-2)", "merge_and_unload"):
                assert "peft_graft supports DeepSpeed only at ZeRO-3" in message
