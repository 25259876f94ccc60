"""The refusals of DeepSpeed ZeRO-3 in one process, without DeepSpeed: parameters marked as ZeRO-3 marks them
(``ds_id``) stand for a partitioned model. tests/test_deepspeed.py checks the same under real DeepSpeed, and that
creating and loading a graft on a partitioned model work."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from testing_utils import clone_model, input_ids, make_pair

from peft_graft import GraftConfig, Region, restrict_training
from peft_graft.merging import merge_grafts


def partition(model: torch.nn.Module) -> torch.nn.Module:
    for number, param in enumerate(model.parameters()):
        param.ds_id = number  # what ZeRO-3 sets on every parameter it partitions
    return model


def test_a_restriction_of_a_partitioned_model_without_its_engine_is_refused():
    pre, _, _ = make_pair("bert_cls")
    model = partition(clone_model(pre))
    region = Region({"classifier.weight": torch.arange(3)})
    with pytest.raises(ValueError, match=r"RestrictTrainingCallback\) under DeepSpeed ZeRO-3 restricts the step"):
        restrict_training(model, allowed=region)  # before DeepSpeed built its engine
    assert all(not param._post_accumulate_grad_hooks for param in model.parameters())


def test_a_restriction_of_trainable_parameters_outside_the_engines_optimizer_is_refused():
    """A parameter that requires gradients but that the engine's optimizer does not hold (no ``_z3_optimizer``) is
    named, not taken for a missing engine."""
    pre, _, _ = make_pair("bert_cls")
    model = partition(clone_model(pre))
    engine_optimizer = object()
    for name, param in model.named_parameters():
        if not name.startswith("classifier"):
            param._z3_optimizer = engine_optimizer  # what ZeRO-3's optimizer sets on the parameters it steps
    region = Region({"classifier.weight": torch.arange(3)})
    match = r"\['classifier.weight', 'classifier.bias'\] require gradients but are not in the DeepSpeed engine's"
    with pytest.raises(ValueError, match=match):
        restrict_training(model, allowed=region)
    assert all(not param._post_accumulate_grad_hooks for param in model.parameters())


def test_a_graft_partitioned_outside_mask_trainer_refuses_forward_and_merging():
    pre, finetuned, task_type = make_pair("bert_cls")
    graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    before = {name: param.detach().clone() for name, param in graft.named_parameters()}
    partition(graft)
    with pytest.raises(
        ValueError, match="A graft model's forward outside MaskTrainer cannot run under DeepSpeed ZeRO-3"
    ):
        graft(input_ids=input_ids())  # MaskTrainer registers the layers' tensors with ZeRO-3: not here
    with pytest.raises(ValueError, match="Merging a graft cannot run under DeepSpeed ZeRO-3"):
        graft.merge_and_unload()
    with pytest.raises(ValueError, match="merge_grafts\\(\\) needs the model's tensors whole, but DeepSpeed ZeRO-3"):
        merge_grafts(graft, ["default"], "task_arithmetic")
    assert all(torch.equal(param, before[name]) for name, param in graft.named_parameters())
    assert list(graft.peft_config) == ["default"]
