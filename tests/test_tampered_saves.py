"""Saved grafts whose integrity fields were deleted or whose config was edited, pickled saves, ContinualGrafter state
files with flipped bits, shard paths outside a checkpoint: each a ``ValueError`` naming the file, none a silent load."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from testing_utils import clone_model, input_ids

from peft_graft import ContinualGrafter, GraftConfig, Region

LOADERS = {
    "peft": lambda pre, path: PeftModel.from_pretrained(clone_model(pre), path),
    "transformers": lambda pre, path: clone_model(pre).load_adapter(path),
    "region": lambda pre, path: Region.from_pretrained(path, pre),
}


def edit_config(folder, edit) -> dict:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return config


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids()).logits


def test_a_save_records_its_format_version(saved_gpt2):
    assert json.loads((saved_gpt2 / "adapter_config.json").read_text())["format_version"] == 1


def _drop_module_field(field):
    def edit(config):
        config[field].pop(sorted(config["grafted_modules"])[0])

    return edit


DELETIONS = {
    "weights_checksum": lambda c: c.pop("weights_checksum"),
    "base_checksum": lambda c: c.pop("base_checksum"),
    "base_fingerprint": lambda c: c.pop("base_fingerprint"),
    "one module's base_checksum": _drop_module_field("base_checksum"),
    "one module's base_fingerprint": _drop_module_field("base_fingerprint"),
}


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("deleted", list(DELETIONS))
def test_deleting_an_integrity_field_is_refused(gpt2_pair, saved_gpt2, deleted, loader):
    edit_config(saved_gpt2, DELETIONS[deleted])
    field = deleted.split("'s ")[-1]
    with pytest.raises(ValueError, match=f"adapter_config.json' lacks {field}"):
        LOADERS[loader](gpt2_pair[0], str(saved_gpt2))


@pytest.mark.parametrize("where", ["in the file", "in the config passed"])
def test_an_older_save_without_integrity_fields_loads_knowingly_with_format_version_0(gpt2_pair, saved_gpt2, where):
    pre = gpt2_pair[0]
    expected = logits(PeftModel.from_pretrained(clone_model(pre), saved_gpt2))
    edit_config(saved_gpt2, lambda c: [c.pop(k) for k in ("weights_checksum", "base_fingerprint", "format_version")])
    if where == "in the file":
        edit_config(saved_gpt2, lambda c: c.update(format_version=0))
        loaded = PeftModel.from_pretrained(clone_model(pre), saved_gpt2)
    else:
        config = GraftConfig.from_pretrained(saved_gpt2)
        config.format_version = 0
        loaded = PeftModel.from_pretrained(clone_model(pre), saved_gpt2, config=config)
    assert torch.equal(logits(loaded), expected)


def test_without_its_fingerprint_the_base_checksum_is_still_checked(gpt2_pair, saved_gpt2):
    """The two-entry fingerprint is a quick check before the checksum of every entry: without it, the checksum runs."""
    pre = gpt2_pair[0]
    edit_config(saved_gpt2, lambda c: [c.pop("base_fingerprint"), c.update(format_version=0)])
    other = clone_model(pre)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1e-3)
    loaded = PeftModel.from_pretrained(other, saved_gpt2)
    with pytest.raises(ValueError, match="made for a different pre-trained model"):
        logits(loaded)


@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_a_graft_folder_relabelled_as_lora_is_refused(gpt2_pair, saved_gpt2, loader):
    edit_config(saved_gpt2, lambda c: c.update(peft_type="LORA"))
    with pytest.raises(ValueError, match=r"names peft_type='LORA',? but"):
        LOADERS[loader](gpt2_pair[0], str(saved_gpt2))


def test_graft_tensors_under_another_peft_type_are_refused(gpt2_pair, saved_gpt2):
    """Also with the graft's own fields removed: the tensors say what the adapter is."""
    keep = ("peft_type", "task_type", "base_model_name_or_path", "r", "target_modules")
    edit_config(saved_gpt2, lambda c: [c.pop(k) for k in list(c) if k not in keep] and c.update(peft_type="LORA"))
    with pytest.raises(ValueError, match="holds graft tensors"):
        PeftModel.from_pretrained(clone_model(gpt2_pair[0]), saved_gpt2)


def test_modules_to_save_added_to_a_saved_graft_is_a_clear_error(gpt2_pair, saved_gpt2):
    edit_config(saved_gpt2, lambda c: c.update(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match=r"adapter_config\.json' \(adapter 'default'\) lists modules_to_save"):
        PeftModel.from_pretrained(clone_model(gpt2_pair[0]), saved_gpt2)


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_pickle_saves_are_refused_at_save_time(gpt2_pair, tmp_path, how):
    pre, finetuned, task_type = gpt2_pair
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.02, task_type=task_type))
    with pytest.raises(ValueError, match="safe_serialization=False"):
        if how == "keyword":
            model.save_pretrained(tmp_path / "g", safe_serialization=False)
        else:
            model.save_pretrained(tmp_path / "g", False)
    assert not (tmp_path / "g").exists()


def test_a_continual_state_file_with_a_flipped_bit_is_refused(gpt2_pair, tmp_path):
    pre, _, _ = gpt2_pair
    learner = ContinualGrafter(clone_model(pre))
    name, region = "transformer.h.0.mlp.c_fc.weight", torch.arange(0, 40, 3)
    with learner.task("a", Region({name: region})), torch.no_grad():
        learner.model.get_parameter(name).view(-1)[region] += 0.01
    learner.save_pretrained(tmp_path / "state")
    path = tmp_path / "state" / "continual_state.safetensors"
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    assert metadata["checksum"].startswith("sha256:")
    key = next(k for k in sorted(tensors) if "/values/" in k)
    tensors[key].view(torch.int32)[0] ^= 1  # one flipped bit in a stored theta value
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="does not match the checksum it records"):
        ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre))
    del metadata["checksum"]  # an older state file
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="records no checksum"):
        ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre))
    resumed = ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre), require_checksum=False)
    assert resumed.task_names == ["a"]


def test_a_shard_path_outside_the_checkpoint_folder_is_refused(gpt2_pair, tmp_path):
    pre, finetuned, _ = gpt2_pair
    finetuned.save_pretrained(tmp_path / "ft", max_shard_size="20KB")
    index_path = tmp_path / "ft" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    (tmp_path / "elsewhere").mkdir()
    shard = index["weight_map"][name]
    (tmp_path / "elsewhere" / shard).write_bytes((tmp_path / "ft" / shard).read_bytes())
    index["weight_map"][name] = f"../elsewhere/{shard}"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: 'weight_map' names shard '\.\./elsewhere"):
        get_peft_model(clone_model(pre), GraftConfig(finetuned=str(tmp_path / "ft"), sparsity=0.02))
