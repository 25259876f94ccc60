"""Run-time scale of a graft (``set_scale``, ``get_scale``, ``scaled``): ``theta_pre + a * (theta_ft - theta_pre)``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from testing_utils import clone_model, input_ids, learning_graft, make_pair

from peft_graft import GraftConfig, GraftLayer
from peft_graft.scores import exact_delta


def logits(model, ids=None):
    with torch.no_grad():
        return model(input_ids=input_ids() if ids is None else ids).logits


def graft(arch: str = "roberta_mlm", **config):
    pre, finetuned, task_type = make_pair(arch)
    config = {"sparsity": 0.05, "task_type": task_type, **config}
    return pre, finetuned, get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, **config)).eval()


def scaled_reference(pre, finetuned, region, scale: float):
    """theta_pre with ``theta_pre + scale * delta`` (fp32, delta as the graft stores it) written on the region, and
    ``theta_pre + scale * (theta_ft - theta_pre)`` where no fp32 delta reproduces theta_ft."""
    model = clone_model(pre)
    ft = finetuned.state_dict()
    with torch.no_grad():
        for name, indices in region.items():
            param = model.get_parameter(name)
            w_pre, w_ft = param.detach().reshape(-1), ft[name].reshape(-1).to(param.dtype)
            delta, unreachable = exact_delta(w_pre, w_ft)
            value = w_pre.float() + scale * delta
            value = torch.where(unreachable, w_pre.float() + scale * (w_ft.float() - w_pre.float()), value)
            param.view(-1)[indices] = value[indices].to(param.dtype)
    return model


def base_tensors(model) -> dict[str, torch.Tensor]:
    """The stored base tensors of every graft layer, cloned."""
    return {
        f"{name}.{attr}": getattr(layer.base_layer, attr).detach().clone()
        for name, layer in model.base_model.graft_layers().items()
        for attr in layer.stored_attrs
    }


@pytest.mark.parametrize("scale", [0.5, 0.25, 2.0, -1.0])
def test_scaled_forward_and_merge_equal_theta_pre_plus_scale_times_delta(scale):
    pre, finetuned, model = graft()
    before = base_tensors(model)
    reference = scaled_reference(pre, finetuned, model.get_region(), scale)
    model.set_scale(scale)  # PeftModel forwards to GraftModel.set_scale
    assert model.get_scale() == scale
    assert torch.equal(logits(model), logits(reference))

    model.merge_adapter()
    for name, param in reference.named_parameters():
        module, _, attr = name.rpartition(".")
        layer = model.get_base_model().get_submodule(module)
        if isinstance(layer, GraftLayer) and attr in layer.stored_attrs:
            assert torch.equal(getattr(layer.base_layer, attr), param), name
    assert torch.equal(logits(model), logits(reference))
    model.unmerge_adapter()
    for name, value in base_tensors(model).items():
        assert torch.equal(value, before[name]), f"unmerge changed {name}"


def test_scale_one_is_bit_exact_theta_ft_and_scale_zero_is_the_base_model():
    pre, finetuned, model = graft()
    region = model.get_region()
    unscaled = logits(model)
    exact = scaled_reference(pre, finetuned, region, 1.0)
    assert torch.equal(unscaled, logits(exact))
    for name, indices in region.items():  # theta_ft itself on the region
        assert torch.equal(exact.get_parameter(name).view(-1)[indices], finetuned.get_parameter(name).view(-1)[indices])

    model.set_scale(0.0)
    assert torch.equal(logits(model), logits(pre))
    model.set_scale(0.7)
    model.set_scale(1)
    assert model.get_scale() == 1.0 and isinstance(model.get_scale(), float)
    assert torch.equal(logits(model), unscaled)


def test_exact_entries_scale_from_theta_ft_itself():
    """Entries fine-tuning shrank towards 0 are stored as theta_ft; scaled: theta_pre + a*(theta_ft - theta_pre)."""
    pre, finetuned, _ = make_pair("llama")
    with torch.no_grad():
        w_pre = pre.model.layers[0].mlp.up_proj.weight.view(-1)
        finetuned.model.layers[0].mlp.up_proj.weight.view(-1)[:50] = w_pre[:50] * 1e-3
    config = GraftConfig(finetuned=finetuned, sparsity=1.0, include_parameters=r"layers\.0\.mlp\.up_proj\.weight$")
    model = get_peft_model(clone_model(pre), config).eval()
    assert config.exact_entries, "the shrunk entries need theta_ft stored exactly"
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    w_ft = finetuned.model.layers[0].mlp.up_proj.weight.detach().view(-1)
    assert torch.equal(layer.effective_parameters(["default"])["weight"].view(-1), w_ft)
    model.set_scale(0.5)
    got = layer.effective_parameters(["default"])["weight"].view(-1)
    delta, unreachable = exact_delta(w_pre, w_ft)
    assert unreachable[:50].any()
    want = torch.where(unreachable, w_pre + 0.5 * (w_ft - w_pre), w_pre + 0.5 * delta)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["roberta_mlm", "gpt2"])
def test_tied_tensor_is_scaled_at_every_use(arch):
    pattern = r"(word_embeddings|wte)\.weight$"
    pre, finetuned, model = graft(arch, include_parameters=pattern)
    region = model.get_region()
    assert len(region) == 1
    model.set_scale(0.5)
    assert torch.equal(logits(model), logits(scaled_reference(pre, finetuned, region, 0.5)))
    half = logits(model)
    model.merge_adapter()
    assert torch.equal(logits(model), half)
    model.unmerge_adapter()
    with model.disable_adapter():
        assert torch.equal(logits(model), logits(pre))


def test_scaled_context_manager_restores_also_on_exception():
    _, _, model = graft()
    full = logits(model)
    model.set_scale(0.75)
    with model.scaled(0.5):
        assert model.get_scale() == 0.5
    assert model.get_scale() == 0.75
    with pytest.raises(RuntimeError, match="boom"), model.scaled(0.0):
        raise RuntimeError("boom")
    assert model.get_scale() == 0.75
    model.set_scale(1.0)
    assert torch.equal(logits(model), full)


def test_scale_is_per_adapter():
    pre, finetuned, model = graft()
    model.add_adapter("other", GraftConfig(finetuned=finetuned, num_entries=50, region="random", seed=2))
    model.set_scale(0.5, adapter_name="other")
    assert model.get_scale("other") == 0.5 and model.get_scale() == 1.0 and model.get_scale("default") == 1.0
    model.set_adapter("other")
    assert model.get_scale() == 0.5
    assert torch.equal(logits(model), logits(scaled_reference(pre, finetuned, model.get_region("other"), 0.5)))
    model.delete_adapter("other")
    assert all("other" not in layer.scaling for layer in model.base_model.graft_layers().values())


def test_scale_is_never_saved_and_a_loaded_graft_has_scale_one(tmp_path):
    pre, _, model = graft()
    full = logits(model)
    model.save_pretrained(tmp_path / "plain")
    model.set_scale(0.5)
    model.save_pretrained(tmp_path / "scaled")
    assert model.get_scale() == 0.5
    plain = load_file(tmp_path / "plain" / "adapter_model.safetensors")
    scaled = load_file(tmp_path / "scaled" / "adapter_model.safetensors")
    assert plain.keys() == scaled.keys()
    assert all(torch.equal(plain[k], scaled[k]) for k in plain)
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "scaled").eval()
    assert loaded.get_scale() == 1.0
    assert torch.equal(logits(loaded), full)


@pytest.mark.parametrize(
    ("scale", "error", "match"),
    [
        (math.nan, ValueError, "scale must be finite"),
        (math.inf, ValueError, "scale must be finite"),
        (-math.inf, ValueError, "scale must be finite"),
        ("0.5", TypeError, "scale must be a real number"),
        (None, TypeError, "scale must be a real number"),
        (True, TypeError, "scale must be a real number"),
        (torch.tensor(0.5), TypeError, "scale must be a real number"),
    ],
)
def test_bad_scale_values_are_refused(scale, error, match):
    _, _, model = graft()
    with pytest.raises(error, match=match):
        model.set_scale(scale)
    with pytest.raises(error, match=match), model.scaled(scale):
        pass
    layer = next(iter(model.base_model.graft_layers().values()))
    with pytest.raises(error, match=match):
        layer.set_scale("default", scale)
    assert model.get_scale() == 1.0


def test_set_scale_refused_for_unknown_merged_or_learning_adapter():
    _, _, model = graft()
    with pytest.raises(ValueError, match="No adapter named 'nope'"):
        model.set_scale(0.5, adapter_name="nope")
    with pytest.raises(ValueError, match="No adapter named 'nope'"):
        model.get_scale("nope")

    model.merge_adapter()
    with pytest.raises(ValueError, match="while it is merged: unmerge first"):
        model.set_scale(0.5)
    with pytest.raises(ValueError, match="unmerge first"), model.scaled(0.5):
        pass
    assert model.get_scale() == 1.0
    model.unmerge_adapter()
    model.set_scale(0.5)
    assert model.get_scale() == 0.5

    _, learning = learning_graft()
    with pytest.raises(ValueError, match="learning its region"):
        learning.set_scale(0.5)
    assert learning.get_scale() == 1.0
    learning.base_model.harden_region()
    learning.set_scale(0.5)
    assert learning.get_scale() == 0.5


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e39), (torch.float32, -1e39), (torch.float16, 1e8)])
def test_finite_scales_that_overflow_the_base_dtype_are_refused(dtype, scale):
    """A finite scale times a delta can exceed the base dtype's range: inf/NaN outputs, refused instead."""
    pre, finetuned, task_type = make_pair("roberta_mlm")
    base = clone_model(pre).to(dtype)
    model = get_peft_model(base, GraftConfig(finetuned=finetuned.to(dtype), sparsity=0.05, task_type=task_type))
    before = logits(model)
    with pytest.raises(ValueError, match=re.escape(f"scale={scale!r} makes adapter 'default'") + f".*overflow {dtype}"):
        model.set_scale(scale)
    assert model.get_scale() == 1.0 and torch.equal(logits(model), before)
