"""``set_adapter`` between grafts with their own heads (issue 38): each graft layer writes only the ``requires_grad``
flags that change and the graft model finds its layers and heads once per set of adapters, with the state peft's own
``set_adapter`` leaves (every layer's and head's active adapter, every flag), also after adapters are added, deleted
or loaded and after flags were changed by hand."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from testing_utils import clone_model, input_ids, make_pair

from peft_graft import GraftConfig
from peft_graft.tuner.layer import GraftLayer

pytestmark = pytest.mark.usefixtures("one_thread")


def config(finetuned, task_type: str, **kwargs) -> GraftConfig:
    return GraftConfig(finetuned=finetuned, num_entries=300, task_type=task_type, **kwargs)  # SEQ_CLS: own head


def three_grafts(learning: str | None = None) -> PeftModel:
    """Grafts "x", "y", "z" of a tiny RoBERTa classifier, each with its own head; ``learning`` learns its region."""
    pre, finetuned, task_type = make_pair("roberta_cls")
    model = get_peft_model(clone_model(pre), config(finetuned, task_type), adapter_name="x")
    for seed, name in enumerate(("y", "z"), 1):
        other = make_pair("roberta_cls", seed=seed)[1]
        kwargs = {"learn_region": True} if name == learning else {"region": "random", "seed": seed}
        model.add_adapter(name, config(other, task_type, **kwargs))
    return model.eval()


def peft_set_adapter(model: PeftModel, names: str | list[str], inference_mode: bool) -> None:
    """The switch as it was: peft's ``BaseTunerLayer.set_adapter`` on every graft layer (packed adapters unpacked
    first, the values of an adapter learning its region frozen after), peft's on every head."""
    for module in model.modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            name = module.check_set_adapter(names)
            module.set_adapter(name if name in module._adapters else [], inference_mode=inference_mode)
        elif isinstance(module, GraftLayer):
            for name in [names] if isinstance(names, str) else names:
                if not inference_mode:
                    module.unpack(name)
            BaseTunerLayer.set_adapter(module, names, inference_mode=inference_mode)
            for name in module.graft_learning:
                if name in module.graft_values:
                    module.graft_values[name].requires_grad_(False)


def state(model: PeftModel) -> tuple[dict[str, bool], dict[str, list[str]]]:
    """Every parameter's ``requires_grad`` and every graft layer's and head's active adapters."""
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    active = {
        name: list(module.active_adapters)
        for name, module in model.named_modules()
        if isinstance(module, GraftLayer | AuxiliaryTrainingWrapper)
    }
    return flags, active


def logits(model: PeftModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids(4)).logits


def test_a_switch_leaves_every_flag_and_active_adapter_as_peft_set_adapter_does():
    model, reference = three_grafts(learning="z"), three_grafts(learning="z")
    steps = [("y", False), ("x", True), ("z", False), (["y"], False), ("z", True), ("x", False), ("y", True)]
    for step, (names, inference_mode) in enumerate(steps):
        if step == 3:  # flags changed by hand: a switch sets each graft tensor's again, whatever it was
            for m in (model, reference):
                m.requires_grad_(True)
        model.base_model.set_adapter(names, inference_mode=inference_mode)
        peft_set_adapter(reference, names, inference_mode)
        flags, active = state(model)
        assert (flags, active) == state(reference), (step, names, inference_mode)
        name = names if isinstance(names, str) else names[0]
        assert all(adapters == [name] for adapters in active.values()), step
        grafts = {n for n, flag in flags.items() if flag and ".graft_" in n}
        assert all(n.endswith(f".{name}") or f".{name}." in n for n in grafts), step  # the active graft's only
        assert bool(grafts) == (not inference_mode), step  # its values (or scores S, while learning) train


def test_a_switch_writes_only_the_flags_that_change(monkeypatch):
    model = three_grafts()
    model.set_adapter("x")
    values = {
        id(tensor): name
        for module in model.modules()
        if isinstance(module, GraftLayer)
        for name, tensor in module.graft_values.items()
    }
    written = []
    original = torch.Tensor.requires_grad_

    def spy(tensor: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        written.append(id(tensor))
        return original(tensor, requires_grad)

    monkeypatch.setattr(torch.Tensor, "requires_grad_", spy)
    model.set_adapter("y")
    flips = sorted(values[i] for i in written if i in values)
    holding = {name: sum(name == n for n in values.values()) for name in ("x", "y", "z")}
    assert holding["z"] > 0
    assert flips == ["x"] * holding["x"] + ["y"] * holding["y"]  # "z" stays frozen: not written
    written.clear()
    model.set_adapter("y")  # nothing changes: nothing written
    assert not [i for i in written if i in values]
    monkeypatch.undo()
    assert {values[id(p)] for n, p in model.named_parameters() if p.requires_grad and id(p) in values} == {"y"}


def test_a_switch_after_delete_and_load_reaches_the_loaded_grafts_layers_and_head(tmp_path):
    pre, finetuned, task_type = make_pair("roberta_cls")
    saving = get_peft_model(clone_model(pre), config(finetuned, task_type), adapter_name="x")
    for seed, name in enumerate(("y", "z"), 1):
        saving.add_adapter(name, config(make_pair("roberta_cls", seed=seed)[1], task_type, region="random", seed=seed))
    saving.save_pretrained(tmp_path)
    expected = {
        name: logits(PeftModel.from_pretrained(clone_model(pre), tmp_path / name, adapter_name=name).eval())
        for name in ("x", "y", "z")
    }

    model = PeftModel.from_pretrained(clone_model(pre), tmp_path / "x", adapter_name="x")
    model.load_adapter(tmp_path / "y", adapter_name="y")
    model.eval()
    for name in ("y", "x"):  # the layers and heads found, then kept
        model.set_adapter(name, inference_mode=True)
        assert torch.equal(logits(model), expected[name]), name
    model.delete_adapter("y")
    model.load_adapter(tmp_path / "z", adapter_name="y")  # the same names as before: another graft under "y"
    model.set_adapter("y", inference_mode=True)
    assert all(adapters == ["y"] for adapters in state(model)[1].values())
    assert torch.equal(logits(model), expected["z"])
    model.load_adapter(tmp_path / "y", adapter_name="w")
    for name, graft in (("w", "y"), ("x", "x"), ("y", "z")):
        model.set_adapter(name, inference_mode=True)
        assert all(adapters == [name] for adapters in state(model)[1].values()), name
        assert torch.equal(logits(model), expected[graft]), name
