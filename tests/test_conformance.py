"""Conformance matrix in the spirit of peft's ``tests/testing_common.py``: the peft habits (save/load, merge, unload,
disable, several adapters, delete, dtype autocast, state-dict helpers, ``inject_adapter_in_model``, Auto classes,
transformers' adapter API) on every kind of module a graft touches, each with a config built fresh and a config
reused (the config of an existing graft, applied to a new model with the graft's state dict, as peft users do)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from peft import (
    AutoPeftModel,
    AutoPeftModelForCausalLM,
    AutoPeftModelForSequenceClassification,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file
from testing_utils import finetune_like, input_ids, make_bert_cls, make_gpt2, make_llama
from torch import nn

from peft_graft import GraftConfig, GraftLayer, Region


class MLP(nn.Module):
    def __init__(self, norm: bool = False):
        super().__init__()
        self.lin0, self.lin1 = nn.Linear(10, 20), nn.Linear(20, 2)
        self.norm = nn.LayerNorm(20) if norm else nn.Identity()

    def forward(self, X):
        return self.lin1(self.norm(torch.relu(self.lin0(X))))


class EmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(50, 8), nn.Linear(8, 2)

    def forward(self, X):
        return self.lin(self.emb(X)).mean(1)


class ConvModel(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.conv, self.lin = (nn.Conv1d if dims == 1 else nn.Conv2d)(3, 4, 3), nn.Linear(4, 2)

    def forward(self, X):
        return self.lin(torch.relu(self.conv(X)).flatten(2).mean(-1))


class AttentionModel(nn.Module):
    """``nn.MultiheadAttention`` reads its projections directly: they are reported as not graftable, the rest is."""

    def __init__(self):
        super().__init__()
        self.mha, self.lin = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

    def forward(self, X):
        return self.lin(self.mha(X, X, X)[0].mean(1))


def _seeded(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def inputs():
        torch.manual_seed(3)
        return make()

    return inputs


def _logits(model: nn.Module, inputs: dict | torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


# name -> (factory, inputs, task_type, Auto class); the first six are plain torch modules, the last three transformers.
MODELS = {
    "mlp": (MLP, _seeded(lambda: torch.randn(4, 10)), None, None),
    "mlp_layernorm": (lambda: MLP(norm=True), _seeded(lambda: torch.randn(4, 10)), None, None),
    "embedding": (EmbeddingModel, _seeded(lambda: torch.randint(0, 50, (4, 6))), None, None),
    "conv1d": (lambda: ConvModel(1), _seeded(lambda: torch.randn(4, 3, 9)), None, None),
    "conv2d": (lambda: ConvModel(2), _seeded(lambda: torch.randn(4, 3, 7, 7)), None, None),
    "mha": (AttentionModel, _seeded(lambda: torch.randn(4, 5, 8)), None, None),
    "gpt2": (make_gpt2, lambda: {"input_ids": input_ids()}, "CAUSAL_LM", AutoPeftModelForCausalLM),
    "llama": (make_llama, lambda: {"input_ids": input_ids()}, "CAUSAL_LM", AutoPeftModelForCausalLM),
    "bert": (make_bert_cls, lambda: {"input_ids": input_ids()}, "SEQ_CLS", AutoPeftModelForSequenceClassification),
}
TRANSFORMERS_MODELS = ["gpt2", "llama", "bert"]
STYLES = ["fresh", "reused"]


@dataclass
class Case:
    """A pre-trained model, its fine-tuned copy, and a way to build their graft ``model()`` in the given style."""

    arch: str
    style: str
    pre: nn.Module
    finetuned: nn.Module
    inputs: Callable[[], dict | torch.Tensor]
    task_type: str | None

    def config(self, **kwargs) -> GraftConfig:
        return GraftConfig(finetuned=self.finetuned, sparsity=0.05, task_type=self.task_type, **kwargs)

    def base(self, dtype: torch.dtype | None = None) -> nn.Module:
        base = copy.deepcopy(self.pre)
        return base.to(dtype) if dtype else base

    def model(self, dtype: torch.dtype | None = None) -> PeftModel:
        built = get_peft_model(self.base(dtype), self.config())
        if self.style == "fresh":
            return built
        reused = get_peft_model(self.base(dtype), copy.deepcopy(built.peft_config["default"]))
        set_peft_model_state_dict(reused, get_peft_model_state_dict(built))
        return reused

    def grafted(self, model: PeftModel, adapter: str = "default") -> nn.Module:
        """The reference: theta_pre with theta_ft written at the graft's entries, and heads stored whole copied."""
        reference = copy.deepcopy(self.pre)
        params, tuned = dict(reference.named_parameters()), self.finetuned.state_dict()
        with torch.no_grad():
            for name, indices in model.base_model.get_region(adapter).items():
                params[name].view(-1)[indices] = tuned[name].view(-1)[indices].to(params[name].dtype)
            for name, param in params.items():
                if any(name.startswith(f"{head}.") for head in model.peft_config[adapter].modules_to_save or []):
                    param.copy_(tuned[name])
        return reference


def _make_case(arch: str, style: str) -> Case:
    factory, inputs, task_type, _ = MODELS[arch]
    torch.manual_seed(0)
    pre = factory().eval()
    return Case(arch, style, pre, finetune_like(pre), inputs, task_type)


@pytest.fixture(params=[(arch, style) for arch in MODELS for style in STYLES], ids="-".join)
def case(request) -> Case:
    return _make_case(*request.param)


@pytest.fixture(params=[(arch, style) for arch in TRANSFORMERS_MODELS for style in STYLES], ids="-".join)
def hf_case(request) -> Case:
    return _make_case(*request.param)


def _graft_layers(model: nn.Module) -> list[GraftLayer]:
    return [m for m in model.modules() if isinstance(m, GraftLayer)]


def _base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's parameters by their original names; graft tensors and heads stored whole (their effect is
    checked through the logits) left out."""
    out = {}
    for name, param in model.named_parameters():
        if "graft_" in name or "modules_to_save" in name or "original_module" in name:
            continue
        out[name.removeprefix("base_model.model.").replace("base_layer.", "")] = param
    return {k: v.detach().clone() for k, v in out.items()}


def _graft_or_head(key: str, model: PeftModel) -> bool:
    """Whether a saved key is a graft tensor or a parameter of a head stored whole (modules_to_save)."""
    heads = model.peft_config["default"].modules_to_save or []
    return "graft_" in key or any(f".{head}." in f".{key}" for head in heads)


def test_forward_is_the_grafted_model(case):
    model = case.model()
    region = model.base_model.get_region("default")
    assert region.num_entries >= 1 and _graft_layers(model)
    assert torch.equal(_logits(model, case.inputs()), _logits(case.grafted(model), case.inputs()))
    assert not torch.equal(_logits(model, case.inputs()), _logits(case.pre, case.inputs()))


def test_save_and_load_round_trip(case, tmp_path):
    model = case.model()
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "adapter_model.safetensors")
    assert all(_graft_or_head(key, model) for key in stored)
    loaded = PeftModel.from_pretrained(case.base(), tmp_path)
    assert torch.equal(_logits(loaded, case.inputs()), _logits(model, case.inputs()))
    assert Region.from_pretrained(tmp_path, case.base()) == model.base_model.get_region("default")


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unmerge_are_exact(case, safe_merge):
    model = case.model()
    expected = _logits(model, case.inputs())
    model.merge_adapter(safe_merge=safe_merge)
    reference, merged = _base_weights(case.grafted(model)), _base_weights(model)
    assert merged and all(torch.equal(weight, reference[name]) for name, weight in merged.items())
    assert torch.equal(_logits(model, case.inputs()), expected)
    model.unmerge_adapter()
    pre = _base_weights(case.pre)
    assert all(torch.equal(weight, pre[name]) for name, weight in _base_weights(model).items())
    assert torch.equal(_logits(model, case.inputs()), expected)


def test_merge_and_unload_and_unload_give_plain_models(case):
    model = case.model()
    expected, reference = _logits(model, case.inputs()), case.grafted(model)
    merged = model.merge_and_unload()
    assert not _graft_layers(merged)
    assert torch.equal(_logits(merged, case.inputs()), expected)
    assert torch.equal(_logits(merged, case.inputs()), _logits(reference, case.inputs()))
    model = case.model()
    heads = model.peft_config["default"].modules_to_save or []
    unloaded = model.unload()  # peft keeps the trained copy of a head stored whole
    assert not _graft_layers(unloaded)
    pre = _base_weights(case.pre)
    body = {name: w for name, w in _base_weights(unloaded).items() if not name.startswith(tuple(heads))}
    assert body and all(torch.equal(weight, pre[name]) for name, weight in body.items())


def test_disabled_adapter_is_the_pre_trained_model(case):
    model = case.model()
    with model.disable_adapter():
        assert torch.equal(_logits(model, case.inputs()), _logits(case.pre, case.inputs()))
    assert torch.equal(_logits(model, case.inputs()), _logits(case.grafted(model), case.inputs()))


def test_several_adapters_switch_save_selected_and_delete(case, tmp_path):
    model = case.model()
    model.add_adapter("other", case.config(region="random", seed=1))
    first, other = case.grafted(model), case.grafted(model, "other")
    model.set_adapter("other")
    assert torch.equal(_logits(model, case.inputs()), _logits(other, case.inputs()))
    model.save_pretrained(tmp_path, selected_adapters=["other"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "other",
    ]  # peft: a non-default adapter in its folder
    loaded = PeftModel.from_pretrained(case.base(), tmp_path / "other")
    assert torch.equal(_logits(loaded, case.inputs()), _logits(other, case.inputs()))
    model.set_adapter("default")
    assert torch.equal(_logits(model, case.inputs()), _logits(first, case.inputs()))
    model.delete_adapter("other")
    assert list(model.peft_config) == ["default"]
    assert not any(".other" in key for key in model.state_dict())
    assert torch.equal(_logits(model, case.inputs()), _logits(first, case.inputs()))
    with pytest.raises(ValueError, match="is the only adapter"):
        model.delete_adapter("default")


def test_a_config_object_builds_one_graft(case):
    model = case.model()
    config = model.peft_config["default"]
    with pytest.raises(ValueError, match="already describes adapter 'default'"):
        model.add_adapter("again", config)
    assert list(model.peft_config) == ["default"]
    elsewhere = get_peft_model(case.base(), config)  # a created config, and no weights loaded into it
    with pytest.raises(ValueError, match="has no entries"):
        _logits(elsewhere, case.inputs())
    with pytest.raises(ValueError, match="has no entries"):
        get_peft_model_state_dict(elsewhere)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_base_keeps_fp32_graft_values_and_merges_to_theta_ft(case, dtype):
    model = case.model(dtype)
    assert all(v.dtype == torch.float32 for layer in _graft_layers(model) for v in layer.graft_values.values())
    inputs = case.inputs()
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        inputs = inputs.to(dtype)
    assert torch.isfinite(_logits(model, inputs).float()).all()
    tuned = {k: v.to(dtype) for k, v in case.finetuned.state_dict().items()}
    region = model.base_model.get_region("default")
    merged = _base_weights(model.merge_and_unload())
    for name, indices in region.items():
        assert torch.equal(merged[name].view(-1)[indices], tuned[name].view(-1)[indices]), name


def test_state_dict_helpers_hold_only_the_sparse_graft(case):
    model = case.model()
    state = get_peft_model_state_dict(model)
    graft = {k: v for k, v in state.items() if "graft_" in k}
    assert graft and all(_graft_or_head(key, model) for key in state)
    entries = model.base_model.get_region("default").num_entries
    assert sum(v.numel() for k, v in graft.items() if "graft_values" in k) == entries
    target = get_peft_model(case.base(), copy.deepcopy(model.peft_config["default"]))
    set_peft_model_state_dict(target, state)
    assert torch.equal(_logits(target, case.inputs()), _logits(model, case.inputs()))
    other_layout = get_peft_model(case.base(), case.config(num_entries=entries + 1))
    with pytest.raises(ValueError, match="config and weights do not match"):
        set_peft_model_state_dict(other_layout, state)


def test_inject_adapter_in_model_grafts_a_plain_module(case):
    """Without a PeftModel there is no task head stored whole: the graft equals a PeftModel's without task_type."""
    untyped = dataclasses.replace(case, task_type=None)
    injected = inject_adapter_in_model(untyped.config(), case.base())
    assert _graft_layers(injected) and not isinstance(injected, PeftModel)
    assert torch.equal(_logits(injected, case.inputs()), _logits(untyped.model(), case.inputs()))


def _saved_with_base(case: Case, tmp_path) -> tuple[PeftModel, str]:
    """The graft saved with ``base_model_name_or_path`` pointing at a saved copy of the pre-trained model."""
    case.pre.save_pretrained(tmp_path / "base")
    model = case.model()
    model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "graft")
    return model, str(tmp_path / "graft")


@pytest.mark.parametrize("typed", [True, False], ids=["task-class", "AutoPeftModel"])
def test_auto_classes_load_the_graft(hf_case, tmp_path, typed):
    """The task's Auto class for a graft with a task_type, ``AutoPeftModel`` for one without (peft's rule)."""
    case = hf_case if typed else dataclasses.replace(hf_case, task_type=None)
    model, folder = _saved_with_base(case, tmp_path)
    loaded = (MODELS[case.arch][3] if typed else AutoPeftModel).from_pretrained(folder).eval()
    assert torch.equal(_logits(loaded, case.inputs()), _logits(model, case.inputs()))


def test_transformers_adapter_api(hf_case, tmp_path):
    model, folder = _saved_with_base(hf_case, tmp_path)
    expected, pre = _logits(model, hf_case.inputs()), _logits(hf_case.pre, hf_case.inputs())
    native = hf_case.base()
    native.load_adapter(folder)
    assert torch.equal(_logits(native, hf_case.inputs()), expected)
    native.disable_adapters()
    assert torch.equal(_logits(native, hf_case.inputs()), pre)
    native.enable_adapters()
    assert torch.equal(_logits(native, hf_case.inputs()), expected)
    saved = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(model).items()}
    adapter_state = native.get_adapter_state_dict()
    assert set(adapter_state) == set(saved) and all(torch.equal(adapter_state[k], saved[k]) for k in saved)
    # transformers activates an adapter in every modules_to_save wrapper: the second adapter stores the same heads.
    heads = model.peft_config["default"].modules_to_save
    native.add_adapter(hf_case.config(region="random", seed=1, modules_to_save=heads), adapter_name="other")
    native.set_adapter("other")
    assert not torch.equal(_logits(native, hf_case.inputs()), expected)
    native.set_adapter("default")
    native.delete_adapter("other")
    assert list(native.peft_config) == ["default"]
    assert torch.equal(_logits(native, hf_case.inputs()), expected)
