"""DeepSpeed under 2 CPU processes (gloo, DeepSpeed's CPU accelerator), through the usual entry points (a Trainer's
``deepspeed`` argument, a model loaded under ZeRO-3's ``zero.Init``): graft creation and loading on a partitioned
model, merging a partitioned graft, MaskTrainer, a Trainer running a graft model, restricted training (ZeRO-3 and
ZeRO-2) and ContinualGrafter are refused at once with a ValueError naming the way out (FSDP2 or DDP), and leave the
model untouched. The runs are tests/deepspeed_script.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
from testing_utils import TORCHRUN, run_command

if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the torchrun processes use it
    pytest.skip("DeepSpeed is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_script.py")
ENTRY_POINTS = {
    "get_peft_model": "Creating or loading graft adapter 'default' cannot run under DeepSpeed ZeRO-3",
    "PeftModel.from_pretrained": "Creating or loading graft adapter 'default' cannot run under DeepSpeed ZeRO-3",
    "ContinualGrafter": "ContinualGrafter cannot run under DeepSpeed ZeRO-3",
    "merge_and_unload": "Merging a graft cannot run under DeepSpeed ZeRO-3",
    "merge_grafts": "merge_grafts() needs the model's tensors whole, but DeepSpeed ZeRO-3 shards them",
    "MaskTrainer": "MaskTrainer (TrainingArguments(deepspeed=...)) cannot run under DeepSpeed",
    "Trainer on a graft": "A graft model's forward cannot run under DeepSpeed ZeRO-3",
    "RestrictTrainingCallback": "Restricted training (TrainingRestriction, RestrictTrainingCallback) cannot run under "
    "DeepSpeed ZeRO-3",
    "RestrictTrainingCallback (ZeRO-2)": "Restricted training (TrainingRestriction, RestrictTrainingCallback) cannot "
    "run under DeepSpeed:",
}


@pytest.mark.multiprocess
def test_deepspeed_is_refused_at_every_entry_point_with_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_command([*TORCHRUN, SCRIPT], tmp_path)
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        results = dict(line.split(" refused: ", 1) if " refused: " in line else (line, "") for line in lines)
        assert results.pop("untouched: True") == ""  # the refused creation, loading and learner added nothing
        assert list(results) == list(ENTRY_POINTS)
        for entry_point, message in results.items():
            assert message.startswith(ENTRY_POINTS[entry_point]), (entry_point, message)
            if entry_point != "merge_grafts":  # which says how to merge instead
                assert "peft_graft does not support DeepSpeed (any ZeRO stage)" in message
                assert "Use FSDP2 (fully_shard" in message and "or DDP" in message
