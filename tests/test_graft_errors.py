"""Bad input to the graft method: each gives a clear error naming what is wrong, and nothing is lost."""

from __future__ import annotations

import json
import random
import re
import shutil
from unittest.mock import patch

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from peft.utils.other import AuxiliaryTrainingWrapper
from safetensors.torch import load_file, save_file
from testing_utils import clone_model, input_ids, make_bert_cls, make_pair

from peft_graft import GraftConfig, GraftLayer, Region

VALUE = "bert.encoder.layer.0.attention.self.value.weight"


@pytest.fixture(scope="module")
def pair():
    return make_pair("bert_cls")


def graft(pre, finetuned, **kwargs):
    return get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, task_type="SEQ_CLS", **kwargs))


# The two ways to load a saved graft onto a model: peft's, and transformers' adapter API (which copies the file into
# the layers itself, bypassing peft's load checks).
LOADERS = {
    "peft": lambda pre, path: PeftModel.from_pretrained(clone_model(pre), path),
    "transformers": lambda pre, path: clone_model(pre).load_adapter(path),
}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sparsity": 0.0}, ValueError, r"sparsity must lie in \(0, 1\], got 0"),
        ({"sparsity": 1.5}, ValueError, r"sparsity must lie in \(0, 1\], got 1.5"),
        ({"sparsity": -1e-4}, ValueError, "sparsity must lie in"),
        ({"sparsity": float("nan")}, ValueError, "sparsity must lie in"),
        ({"sparsity": "1e-4"}, TypeError, "sparsity must be a float"),
        ({"num_entries": 0}, ValueError, "num_entries must be at least 1"),
        ({"num_entries": 2.5}, TypeError, "num_entries must be an int"),
        ({"region": "largest"}, ValueError, "Unknown region strategy region='largest'"),
        ({"region": "empty"}, ValueError, "only meaningful with learn_region=True"),
        ({"region": "given"}, ValueError, "needs given_region"),
        ({"learn_region": "False"}, TypeError, "learn_region must be True or False, got 'False'"),
        ({"only_moved": 0}, TypeError, "only_moved must be True or False"),
        ({"verify_base": "no"}, TypeError, "verify_base must be True or False"),
        ({"seed": 1.5}, ValueError, r"seed must be an int in \[0, 2\*\*63\), got 1.5"),
        ({"seed": -1}, ValueError, "seed must be an int"),
        ({"seed": 2**70}, ValueError, "seed must be an int"),
        ({"seed": True}, ValueError, "seed must be an int"),
        ({"include_parameters": 5}, TypeError, "include_parameters must be a string, a list of strings or None"),
        ({"exclude_parameters": ["ok", 3]}, TypeError, "exclude_parameters must hold strings only"),
        ({"modules_to_save": {"classifier": 1}}, TypeError, "modules_to_save must be a string, a list of strings"),
    ],
)
def test_bad_config_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        GraftConfig(finetuned=None, **kwargs)


def test_budget_larger_than_eligible_parameters(pair):
    pre, finetuned, _ = pair
    with pytest.raises(ValueError, match=r"exceeds the .* eligible parameters"):
        graft(pre, finetuned, num_entries=10**9)
    with pytest.raises(ValueError, match="rounds to 0 entries"):
        graft(pre, finetuned, sparsity=1e-9)


def test_finetuned_of_another_architecture(pair):
    pre, _, _ = pair
    gpt2_finetuned = make_pair("gpt2")[1]
    with pytest.raises(ValueError, match="finetuned is a 'gpt2' model but the pre-trained model is 'bert'"):
        graft(pre, gpt2_finetuned)


def test_finetuned_missing_or_differently_shaped_tensor(pair):
    pre, finetuned, _ = pair
    state = dict(finetuned.state_dict())
    del state[VALUE]
    with pytest.raises(ValueError, match=f"fine-tuned model has no tensor '{VALUE}'"):
        graft(pre, state)
    state = dict(finetuned.state_dict())
    state[VALUE] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=rf"'{VALUE}' has shape \(3, 3\) in the fine-tuned model but \(32, 32\)"):
        graft(pre, state)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_movement_names_the_tensor(pair, bad):
    pre, finetuned, _ = pair
    state = {k: v.clone() for k, v in finetuned.state_dict().items()}
    state[VALUE][1, 2] = bad
    with pytest.raises(ValueError, match=f"1 NaN or inf entries in tensor '{VALUE}'"):
        graft(pre, state)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (lambda t: t > 0, TypeError, "is not floating point"),
        (lambda t: (t * 100).long(), TypeError, "is not floating point"),
        (lambda t: t.to(torch.complex64), TypeError, "is not floating point"),
        (lambda t: t.numpy(), TypeError, "must be a tensor, got ndarray"),
        (lambda t: None, TypeError, "must be a tensor, got NoneType"),
        (lambda t: t.to("meta"), ValueError, "is on the meta device"),
    ],
)
def test_finetuned_tensor_of_the_wrong_kind_names_the_tensor(pair, value, error, match):
    """A bool or integer theta_ft would be cast and grafted as 0/1 values: refused, like other non-tensors."""
    pre, finetuned, _ = pair
    state = dict(finetuned.state_dict())
    state[VALUE] = value(state[VALUE])
    with pytest.raises(error, match=f"theta_ft of '{VALUE}' {match}"):
        graft(pre, state)


@pytest.mark.parametrize("head", ["classifier.weight", "classifier.bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_head_stored_whole_with_nan_or_inf_is_refused(pair, head, bad):
    pre, finetuned, _ = pair
    state = {k: v.clone() for k, v in finetuned.state_dict().items()}
    state[head].view(-1)[0] = bad
    with pytest.raises(ValueError, match=f"theta_ft of '{head}' \\(stored whole, modules_to_save\\) has NaN or inf"):
        graft(pre, state)


def test_a_state_dict_with_keys_other_than_names_is_refused(pair):
    pre, finetuned, _ = pair
    with pytest.raises(TypeError, match="must have parameter names \\(str\\) as keys, got 0"):
        graft(pre, {**finetuned.state_dict(), 0: torch.ones(1)})


def test_finetuned_of_wrong_type_or_missing_path(pair):
    pre, _, _ = pair
    with pytest.raises(TypeError, match="finetuned must be a model, a path or Hub id, or a state dict; got int"):
        graft(pre, 42)
    with pytest.raises(ValueError, match="needs finetuned="):
        graft(pre, None)
    with pytest.raises(ValueError, match="Cannot load the fine-tuned model finetuned='/nonexistent/model'"):
        graft(pre, "/nonexistent/model")


def test_unmoved_model_has_nothing_to_graft(pair):
    pre, _, _ = pair
    with pytest.raises(ValueError, match="No eligible tensor moved during fine-tuning"):
        graft(pre, clone_model(pre))


@pytest.fixture
def saved(pair, tmp_path):
    pre, finetuned, _ = pair
    graft(pre, finetuned, sparsity=0.02).save_pretrained(tmp_path / "graft")
    return tmp_path / "graft"


def corrupt_copy(saved, tmp_path, edit, keep_checksum: bool = False) -> str:
    """A copy of the saved graft whose weights file was changed by ``edit(tensors) -> tensors``; without
    ``keep_checksum`` its config loses the weights checksum (as a file written by another tool), so that the structural
    checks are reached."""
    target = tmp_path / "corrupt"
    shutil.copytree(saved, target)
    path = target / "adapter_model.safetensors"
    save_file(edit(load_file(path)), path)
    if not keep_checksum:
        config = json.loads((target / "adapter_config.json").read_text())
        del config["weights_checksum"]
        config["format_version"] = 0  # loaded knowingly as a save without integrity fields
        (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def first_key(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix))


def set_last_index(tensors, value):
    key = first_key(tensors, "graft_indices")
    tensors[key] = tensors[key].clone()
    tensors[key][-1] = value
    return tensors


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: set_last_index(t, 10**8), r"fall outside \[0, \d+\): the file is corrupt"),
        (lambda t: set_last_index(t, -1), r"fall outside \[0, \d+\): the file is corrupt"),
        (lambda t: {k: v for k, v in t.items() if k != first_key(t, "graft_indices")}, "it is incomplete"),
        (
            lambda t: t | {first_key(t, "graft_values"): t[first_key(t, "graft_values")][:-1].clone()},
            "config and weights do not match",
        ),
        (
            lambda t: t | {first_key(t, "graft_values"): torch.full_like(t[first_key(t, "graft_values")], torch.nan)},
            "contain NaN or inf",
        ),
        (
            lambda t: t | {first_key(t, "graft_indices"): t[first_key(t, "graft_indices")].float()},
            "expected int32 or int64",
        ),
    ],
)
@pytest.mark.parametrize("loader", LOADERS)
def test_corrupt_entries_are_refused(pair, saved, tmp_path, edit, match, loader):
    pre, _, _ = pair
    with pytest.raises(ValueError, match=match):
        LOADERS[loader](pre, corrupt_copy(saved, tmp_path, edit))


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t | {first_key(t, "graft_values"): t[first_key(t, "graft_values")].half()},
        lambda t: t | {first_key(t, "graft_values"): t[first_key(t, "graft_values")].to(torch.int64)},
        lambda t: t | {first_key(t, "graft_values"): t[first_key(t, "graft_values")].double()},
    ],
    ids=["fp16", "int64", "fp64"],
)
@pytest.mark.parametrize("loader", LOADERS)
def test_graft_values_of_another_dtype_are_refused_not_cast(pair, saved, tmp_path, edit, loader):
    pre, _, _ = pair
    with pytest.raises(ValueError, match=r"value dtype .*graft values are float32"):
        LOADERS[loader](pre, corrupt_copy(saved, tmp_path, edit))


def test_every_flipped_bit_of_the_weights_file_is_refused(pair, saved, tmp_path):
    pre, _, _ = pair
    data = (saved / "adapter_model.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    rng = random.Random(0)
    for trial in range(20):  # data bytes: indices, values and the head stored whole
        target = tmp_path / f"flipped{trial}"
        shutil.copytree(saved, target)
        position = rng.randrange(header, len(data))
        flipped = bytearray(data)
        flipped[position] ^= 1 << rng.randrange(8)
        (target / "adapter_model.safetensors").write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="does not match the checksum"):
            PeftModel.from_pretrained(clone_model(pre), target)
    with pytest.raises(ValueError, match="does not match the checksum"):
        Region.from_pretrained(target, clone_model(pre))
    with pytest.raises(ValueError, match="does not match the checksum"):
        clone_model(pre).load_adapter(target)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_truncated_or_corrupt_file_is_a_clear_error_and_leaves_the_model_as_it_was(pair, saved, tmp_path, damage):
    pre, _, _ = pair
    target = tmp_path / "damaged"
    shutil.copytree(saved, target)
    path = target / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        PeftModel.from_pretrained(clone_model(pre), target)

    model = PeftModel.from_pretrained(clone_model(pre), saved).eval()
    with torch.no_grad():
        before = model(input_ids=input_ids()).logits
    with pytest.raises(ValueError, match="truncated or corrupt"):
        model.load_adapter(target, adapter_name="broken")
    assert list(model.peft_config) == ["default"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids()).logits, before)


def test_graft_of_another_architecture_is_refused(saved):
    gpt2 = make_pair("gpt2")[0]
    with pytest.raises(ValueError, match="made for another architecture"):
        PeftModel.from_pretrained(gpt2, saved)


def test_wrong_base_is_refused_at_first_use(saved):
    torch.manual_seed(123)  # same architecture, other values
    with pytest.raises(ValueError, match="made for a different pre-trained model"):
        model = PeftModel.from_pretrained(make_bert_cls().eval(), saved)
        model(input_ids=input_ids())


def test_given_masks_must_have_the_parameters_shapes():
    pre, finetuned, task_type = make_pair("bert_cls")
    name, param = next((n, p) for n, p in pre.named_parameters() if p.dim() == 2 and p.shape[0] != p.shape[1])
    transposed = torch.zeros(param.shape[::-1], dtype=torch.bool)
    transposed[0, :3] = True
    config = GraftConfig(finetuned=finetuned, region="given", given_region={name: transposed}, task_type=task_type)
    with pytest.raises(ValueError, match=r"has shape .* pass a mask of the parameter's own shape"):
        get_peft_model(clone_model(pre), config)


@pytest.mark.parametrize("field", ["include_parameters", "exclude_parameters"])
def test_bad_regex_names_the_field(field):
    with pytest.raises(ValueError, match=f"{field}: '\\(unclosed' is not a valid regular expression"):
        GraftConfig(**{field: ["ok", "(unclosed"]})


def test_one_module_to_save_may_be_named_by_a_string(pair):
    pre, finetuned, _ = pair
    model = graft(pre, finetuned, num_entries=20, modules_to_save="classifier")
    saved = model.peft_config["default"].modules_to_save
    assert isinstance(saved, list) and "classifier" in saved  # (peft adds its sequence-classification heads)
    assert any("modules_to_save.default" in name for name, _ in model.named_parameters())


def test_reusing_a_config_object_for_a_second_adapter_is_refused():
    pre, finetuned, task_type = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, num_entries=20, task_type=task_type)
    model = get_peft_model(clone_model(pre), config)
    with pytest.raises(ValueError, match="already describes adapter 'default'"):
        model.add_adapter("b", config)
    assert list(model.peft_config) == ["default"]  # nothing half-added
    model.add_adapter("b", GraftConfig(finetuned=finetuned, num_entries=20, region="random", task_type=task_type))
    assert model.base_model.get_region("b").num_entries == 20


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "graft_" not in n}


@pytest.mark.parametrize("how", ["merge_adapter", "merge_and_unload"])
def test_a_refused_merge_changes_nothing(how):
    """The base of the last grafted module differs (verify_base): earlier modules must not be merged or unwrapped."""
    pre, finetuned, task_type = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=200, task_type=task_type))
    layers = [m for m in model.modules() if isinstance(m, GraftLayer) and m.graft_values]
    last = layers[-1]
    attr = last.stored_attrs[0]
    index = int(last.graft_indices["default"][0])
    with torch.no_grad():
        getattr(last.base_layer, attr).view(-1)[index] += 1.0  # another base at a grafted entry
    before, count = _weights(model), sum(isinstance(m, GraftLayer) for m in model.modules())
    with pytest.raises(ValueError, match="different pre-trained model"):
        model.merge_adapter() if how == "merge_adapter" else model.merge_and_unload()
    assert all(not layer.merged for layer in layers)
    assert sum(isinstance(m, GraftLayer) for m in model.modules()) == count
    after = _weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_safe_merge_refusing_non_finite_values_changes_nothing():
    pre, finetuned, task_type = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=200, task_type=task_type))
    layer = [m for m in model.modules() if isinstance(m, GraftLayer) and m.graft_values][-1]
    with torch.no_grad():
        layer.graft_values["default"][0] = float("inf")
    before = _weights(model)
    with pytest.raises(ValueError, match=r"NaNs detected in the merged weights\. The adapter default seems"):
        model.merge_adapter(safe_merge=True)
    assert not any(m.merged for m in model.modules() if isinstance(m, GraftLayer))
    after = _weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_any_failure_while_loading_a_graft_leaves_the_model_as_it_was(pair, saved, monkeypatch):
    pre, _, _ = pair
    model = PeftModel.from_pretrained(clone_model(pre), saved).eval()
    with torch.no_grad():
        before = model(input_ids=input_ids()).logits

    def failing_read(*args, **kwargs):
        raise OSError("disk read failed")

    monkeypatch.setattr("peft.utils.save_and_load.safe_load_file", failing_read)
    with pytest.raises(OSError, match="disk read failed"):
        model.load_adapter(saved, adapter_name="other")
    assert list(model.peft_config) == ["default"]
    assert not any("other" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids()).logits, before)


def test_pickled_graft_weights_are_refused(pair, saved, tmp_path):
    pre, _, _ = pair
    target = tmp_path / "pickled"
    shutil.copytree(saved, target)
    torch.save(load_file(target / "adapter_model.safetensors"), target / "adapter_model.bin")
    (target / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_model\.bin \(a pickle\)"):
        PeftModel.from_pretrained(clone_model(pre), target)


HUB_LOADERS = {
    "peft": lambda pre, repo, cache: PeftModel.from_pretrained(clone_model(pre), repo, cache_dir=cache),
    "transformers": lambda pre, repo, cache: clone_model(pre).load_adapter(repo, adapter_kwargs={"cache_dir": cache}),
}


@pytest.mark.parametrize("loader", HUB_LOADERS)
def test_pickled_graft_weights_reached_by_hub_id_are_refused_before_unpickling(pair, saved, tmp_path, loader):
    """A graft published with adapter_model.bin only, read from the Hub cache (offline here) by its repo id."""
    pre, _, _ = pair
    snapshot = tmp_path / "cache" / "models--someone--graft" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    shutil.copy(saved / "adapter_config.json", snapshot)
    torch.save(load_file(saved / "adapter_model.safetensors"), snapshot / "adapter_model.bin")
    unpickling = patch.object(torch, "load", side_effect=AssertionError("unpickled"))
    with unpickling, pytest.raises(ValueError, match=r"adapter_model\.bin \(a pickle\)"):
        HUB_LOADERS[loader](pre, "someone/graft", str(tmp_path / "cache"))


HEAD = "base_model.model.classifier.weight"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: {k: v for k, v in t.items() if k != HEAD}, "lack tensor|is missing: the file is incomplete"),
        (lambda t: t | {HEAD: torch.full_like(t[HEAD], torch.nan)}, "holds NaN or inf"),
        (lambda t: t | {HEAD: (t[HEAD] * 100).long()}, "is torch.int64 of shape"),
        (lambda t: t | {HEAD: t[HEAD][:1].clone()}, r"not floating point of shape \(3, 32\)"),
    ],
)
@pytest.mark.parametrize("loader", LOADERS)
def test_a_bad_head_stored_whole_is_refused(pair, saved, tmp_path, edit, match, loader):
    """A NaN, integer or missing head (the classifier a graft stores whole) was loaded as it was, cast, or left
    randomly initialised."""
    pre, _, _ = pair
    with pytest.raises(ValueError, match=match):
        LOADERS[loader](pre, corrupt_copy(saved, tmp_path, edit))
    model = clone_model(pre)
    with pytest.raises(ValueError, match=match):
        model.load_adapter(corrupt_copy(saved, tmp_path / "again", edit))
    assert torch.equal(_logits(model), _logits(pre))  # transformers' load is undone


def test_the_only_adapter_cannot_be_deleted():
    pre, finetuned, task_type = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20, task_type=task_type))
    with pytest.raises(ValueError, match=r"only adapter: .* unload"):
        model.delete_adapter("default")
    assert list(model.peft_config) == ["default"]
    model(input_ids=input_ids())  # still runs
    model.add_adapter("b", GraftConfig(finetuned=finetuned, num_entries=20, region="random", task_type=task_type))
    model.delete_adapter("b")
    assert list(model.peft_config) == ["default"]


def test_a_base_differing_at_any_grafted_entry_is_refused(saved):
    pre, _, _ = make_pair("bert_cls")
    model = PeftModel.from_pretrained(clone_model(pre), saved)
    layer = max(
        (m for m in model.modules() if isinstance(m, GraftLayer) and m.has_region("default")),
        key=lambda m: m.num_stored,
    )
    indices = layer.entries("default")[0]  # packed: loaded for inference
    assert indices.numel() > 2
    attr, local, _ = next(iter(layer.space.split(indices[-1:])))  # the last entry: not among the first two
    with torch.no_grad():
        getattr(layer.base_layer, attr).view(-1)[local] += 1.0
    with pytest.raises(ValueError, match="differ from the graft's theta_pre at some of its"):
        model(input_ids=input_ids())


def test_saving_while_merged_writes_a_graft_its_base_accepts(pair, tmp_path):
    pre, finetuned, task_type = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=200, task_type=task_type))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=input_ids()).logits
    model.merge_adapter()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids()).logits, expected)


class AttentionThenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.mha(x, x, x)[0])


def test_multihead_attention_out_proj_is_not_grafted_silently(caplog):
    """nn.MultiheadAttention reads out_proj.weight directly: it is reported as not graftable, never wrapped."""
    torch.manual_seed(0)
    pre, finetuned = AttentionThenLinear().eval(), AttentionThenLinear().eval()
    with torch.no_grad():
        for param in finetuned.parameters():
            param.add_(1.0)
    x = torch.randn(2, 3, 8)
    with caplog.at_level("WARNING", logger="peft_graft"):
        model = get_peft_model(pre, GraftConfig(finetuned=finetuned, sparsity=1.0))
    assert set(model.get_region()) == {"lin.weight", "lin.bias"}
    assert "mha.out_proj.weight" in caplog.text
    assert not isinstance(model.get_base_model().mha.out_proj, GraftLayer)
    with torch.no_grad():
        unmerged = model(x)
        model.merge_adapter()
        assert torch.equal(model(x), unmerged)  # what is grafted applies the same merged or not


def test_a_graft_under_fsdp_is_refused_at_forward(pair):
    """The parameter states FSDP v1 leaves (marked ``_fsdp_flattened`` outside the forward, plain tensors inside it);
    tests/test_fsdp.py runs real FSDP."""
    pre, finetuned, _ = pair
    model = graft(pre, finetuned, sparsity=0.02)
    layer = next(m for m in model.modules() if isinstance(m, GraftLayer) and m.stored_attrs)
    param = layer.base_layer._parameters[layer.stored_attrs[0]]
    param._fsdp_flattened = True
    with pytest.raises(ValueError, match="runs under FSDP"):
        model(input_ids=input_ids())
    del param._fsdp_flattened
    del layer.base_layer._parameters[layer.stored_attrs[0]]
    setattr(layer.base_layer, layer.stored_attrs[0], param.detach().clone())
    with pytest.raises(ValueError, match="runs under FSDP"):
        model(input_ids=input_ids())


def test_finetuned_model_with_extra_layers_is_warned_about(pair):
    pre, finetuned, _ = pair
    state = dict(finetuned.state_dict())
    state["bert.encoder.layer.7.output.dense.weight"] = torch.ones(3, 3)
    with pytest.warns(UserWarning, match="tensors the pre-trained model lacks"):
        graft(pre, state, sparsity=0.02)


def test_config_without_grafted_modules_says_it_is_incomplete(pair, saved):
    pre, _, _ = pair
    config = json.loads((saved / "adapter_config.json").read_text())
    config["grafted_modules"] = {}
    del config["weights_checksum"]
    config["format_version"] = 0
    (saved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"records none, so its adapter_config\.json is incomplete"):
        PeftModel.from_pretrained(clone_model(pre), saved)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_module_dropped_from_grafted_modules_is_refused(pair, saved, loader):
    """The file still holds that module's entries: loading the rest alone would be a silently smaller graft."""
    pre, _, _ = pair
    config = json.loads((saved / "adapter_config.json").read_text())
    dropped = sorted(config["grafted_modules"])[-1]
    for field in ("grafted_modules", "exact_entries", "base_checksum", "base_fingerprint"):
        config.get(field, {}).pop(dropped, None)
    (saved / "adapter_config.json").write_text(json.dumps(config))  # the weights checksum still matches
    with pytest.raises(ValueError, match=f"does not list \\(e.g. '{re.escape(dropped)}'\\)"):
        LOADERS[loader](pre, saved)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids()).logits


def test_a_failed_transformers_load_adapter_leaves_the_model_as_it_was(pair, saved, tmp_path):
    pre, _, _ = pair
    bad = corrupt_copy(saved, tmp_path, lambda t: set_last_index(t, 10**8))
    model = clone_model(pre)
    with pytest.raises(ValueError, match="the file is corrupt"):
        model.load_adapter(bad)  # the first adapter: the graft layers and the head wrapper are removed again
    assert not model._hf_peft_config_loaded
    assert not any(isinstance(m, (GraftLayer, AuxiliaryTrainingWrapper)) for m in model.modules())
    assert torch.equal(_logits(model), _logits(pre))

    model.load_adapter(saved, adapter_name="first")
    before = _logits(model)
    assert torch.equal(before, _logits(PeftModel.from_pretrained(clone_model(pre), saved)))
    with pytest.raises(ValueError, match="the file is corrupt"):
        model.load_adapter(bad, adapter_name="second")
    assert list(model.peft_config) == ["first"] and model.active_adapters() == ["first"]
    assert not any("second" in n for n, _ in model.named_parameters())
    assert torch.equal(_logits(model), before)


def test_a_second_transformers_adapter_is_active_with_its_head(pair, saved):
    """transformers activates the adapter it loads last; its modules_to_save head must be active with it."""
    pre, _, _ = pair
    expected = _logits(PeftModel.from_pretrained(clone_model(pre), saved))
    model = clone_model(pre)
    model.load_adapter(saved, adapter_name="first")
    model.load_adapter(saved, adapter_name="second")
    assert model.active_adapters() == ["second"]
    assert torch.equal(_logits(model), expected)
    model.set_adapter("first")
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("name", ["../outside", "/tmp/absolute", "a/b", "a\\b", "", " ", "v1.2", "c:drive"])
def test_adapter_names_that_are_paths_or_not_buffer_keys_are_refused(pair, saved, tmp_path, name):
    pre, finetuned, _ = pair
    match = "cannot name a graft"
    with pytest.raises(ValueError, match=match):
        get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20), adapter_name=name)
    model = graft(pre, finetuned, num_entries=20)
    with pytest.raises(ValueError, match=match):
        model.add_adapter(name, GraftConfig(finetuned=finetuned, num_entries=20, task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match=match):
        model.load_adapter(saved, adapter_name=name)
    with pytest.raises(ValueError, match=match):
        model.base_model.add_combined_adapter(["default"], name)
    with pytest.raises(ValueError, match=match):
        clone_model(pre).load_adapter(saved, adapter_name=name)
    assert list(model.peft_config) == ["default"]
    model.save_pretrained(tmp_path / "out", selected_adapters=list(model.peft_config))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["graft", "out"]


@pytest.mark.parametrize(
    "combination",
    [lambda stacked: 1 / 0, lambda stacked: stacked, lambda stacked: [0.0], lambda stacked: stacked[0] * torch.nan],
    ids=["raises", "2d", "list", "nan"],
)
def test_a_failed_combined_adapter_leaves_no_trace(pair, combination):
    pre, finetuned, _ = pair
    model = graft(pre, finetuned, num_entries=20)
    model.add_adapter("b", GraftConfig(finetuned=finetuned, num_entries=20, region="random", task_type="SEQ_CLS"))
    with pytest.raises((ZeroDivisionError, ValueError)):
        model.base_model.add_combined_adapter(["default", "b"], "both", combination=combination)
    assert list(model.peft_config) == ["default", "b"]
    assert not any(".both" in n for n in model.state_dict())
    model.base_model.add_combined_adapter(["default", "b"], "both")  # the name is free again
    assert model.base_model.get_region("both").num_entries >= 20


@pytest.mark.parametrize("names", [[], "default"])
def test_combining_needs_a_list_of_adapter_names(pair, names):
    pre, finetuned, _ = pair
    model = graft(pre, finetuned, num_entries=20)
    with pytest.raises(ValueError, match="adapter_names must be a non-empty list of adapter names"):
        model.base_model.add_combined_adapter(names, "both")


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (lambda m: {m: (torch.tensor([5, 3]), torch.tensor([0.1, 0.2]))}, "strictly increasing"),
        (lambda m: {m: (torch.tensor([3, 3]), torch.tensor([0.1, 0.2]))}, "strictly increasing"),
        (lambda m: {m: (torch.tensor([3, 5]), torch.tensor([0.1, torch.nan]))}, "NaN or inf"),
        (lambda m: {m: (torch.tensor([3.0, 5.0]), torch.tensor([0.1, 0.2]))}, "int32/int64"),
        (lambda m: {m: (torch.tensor([3, 5]), torch.tensor([0.1]))}, "one per index"),
        (lambda m: {m: (torch.tensor([3, 10**9]), torch.tensor([0.1, 0.2]))}, "out of range"),
        (lambda m: {"no.such.module": (torch.tensor([3]), torch.tensor([0.1]))}, "without a region being learned"),
    ],
)
def test_hardening_to_bad_entries_is_refused_and_learning_goes_on(pair, entries, match):
    """harden_region(entries=...) made grafts that saved but could not be loaded again."""
    pre, finetuned, _ = pair
    model = graft(pre, finetuned, num_entries=20, learn_region=True)
    module = next(iter(model.base_model.region_learners("default")))
    with pytest.raises(ValueError, match=match):
        model.base_model.harden_region(entries=entries(module))
    assert model.base_model.region_learners("default")  # nothing hardened
    with pytest.raises(TypeError, match="num_entries must be an int"):
        model.base_model.harden_region(num_entries=2.5)
    assert model.base_model.harden_region(num_entries=3) == 3


def _edited_config(saved, tmp_path, text: str):
    target = tmp_path / "edited"
    shutil.copytree(saved, target)
    (target / "adapter_config.json").write_text(text)
    return target


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: "{not json", r"adapter_config\.json' is not valid JSON"),
        (lambda c: "[1, 2]", "is not a JSON object"),
        (lambda c: json.dumps({**c, "peft_type": "NOPE"}), r"names peft_type='NOPE', which no registered peft method"),
        (lambda c: json.dumps({**c, "grafted_modules": list(c["grafted_modules"])}), "grafted_modules must map"),
        (lambda c: json.dumps({**c, "grafted_modules": dict.fromkeys(c["grafted_modules"], -1)}), "ints >= 0"),
        (lambda c: json.dumps({**c, "exact_entries": dict.fromkeys(c["grafted_modules"], 10**9)}), "exact entries"),
        (lambda c: json.dumps({**c, "base_fingerprint": dict.fromkeys(c["grafted_modules"], "x")}), "lists of numbers"),
        (
            lambda c: json.dumps({**c, "base_checksum": dict.fromkeys(c["grafted_modules"], 5)}),
            "map module names to str",
        ),
    ],
    ids=[
        "bad-json",
        "not-an-object",
        "unknown-peft-type",
        "modules-list",
        "negative",
        "exact",
        "fingerprint",
        "checksum",
    ],
)
@pytest.mark.parametrize("loader", [*LOADERS, "config"])
def test_malformed_adapter_config_is_a_clear_error(pair, saved, tmp_path, edit, match, loader):
    pre, _, _ = pair
    config = json.loads((saved / "adapter_config.json").read_text())
    folder = _edited_config(saved, tmp_path, edit(config))
    with pytest.raises(ValueError, match=match):
        PeftConfig.from_pretrained(folder) if loader == "config" else LOADERS[loader](pre, folder)


def test_config_without_peft_type_is_a_clear_error(pair, saved, tmp_path):
    pre, _, _ = pair
    config = json.loads((saved / "adapter_config.json").read_text())
    del config["peft_type"]
    with pytest.raises(ValueError, match="has no 'peft_type' field"):
        PeftModel.from_pretrained(clone_model(pre), _edited_config(saved, tmp_path, json.dumps(config)))
