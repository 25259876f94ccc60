"""Issue 60, careless use of the adapter API: nested ``modules_to_save`` are refused before a save could write what
its loader refuses, ``GraftConfig(region=<Region>)`` grafts that region, loading under an adapter name in use names
it, a cast never loses a head a folder held in higher precision nor turns a grafted value into inf."""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import clone_model, finetune_like, input_ids, make_pair

from peft_graft import GraftConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def folder_bytes(folder) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(folder)
        for name in names
    }


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids()).logits


@pytest.fixture(scope="module")
def bert():
    return make_pair("bert_cls")[:2]


# ------------------------------------------------------------------------------------------ nested modules_to_save
@pytest.mark.parametrize(
    ("entries", "inner", "outer"),
    [
        (["pooler", "pooler.dense"], "pooler.dense", "pooler"),
        (["bert.pooler.dense", "bert.pooler"], "bert.pooler.dense", "bert.pooler"),
        (["classifier", "pooler", "dense"], "dense", "pooler"),  # "dense" ends many names, bert.pooler.dense too
    ],
)
def test_nested_modules_to_save_are_refused_at_creation_and_no_save_is_written(bert, tmp_path, entries, inner, outer):
    """They were accepted, and the save replaced a good graft folder with one from_pretrained refuses."""
    pre, finetuned = bert
    good = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"))
    good.save_pretrained(tmp_path / "g")
    before = folder_bytes(tmp_path / "g")
    model = clone_model(pre)
    with pytest.raises(ValueError, match=rf"Adapter 'default': modules_to_save=.*names module '\S*{inner}' \(entry "
                                         rf"'{inner}'\) inside module '\S*{outer}' \(entry '{outer}'\).*List only "
                                         rf"'{outer}'"):  # fmt: skip
        get_peft_model(model, GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=entries))
    assert folder_bytes(tmp_path / "g") == before
    assert torch.equal(logits(PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")), logits(good))


def test_a_head_nested_in_another_adapters_head_is_refused_and_the_model_kept(bert):
    pre, finetuned = bert
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["pooler", "classifier"])
    model = get_peft_model(clone_model(pre), config)
    expected = logits(model)
    config = GraftConfig(finetuned=finetune_like(pre, seed=3), sparsity=0.05, modules_to_save=["bert.pooler.dense"])
    with pytest.raises(ValueError, match=r"Adapter 'other'.*stores module 'bert.pooler.dense' whole, and adapter\(s\) "
                                         r"\['default'\] of this model store 'bert.pooler' whole"):  # fmt: skip
        model.add_adapter("other", config)
    assert list(model.peft_config) == ["default"] and torch.equal(logits(model), expected)


def test_a_saved_config_with_nested_modules_to_save_is_refused_at_load(bert, tmp_path):
    import json

    pre, finetuned = bert
    get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["pooler"])
                   ).save_pretrained(tmp_path / "g")  # fmt: skip
    path = tmp_path / "g" / "adapter_config.json"
    config = json.loads(path.read_text())
    config["modules_to_save"] = ["pooler", "pooler.dense"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"names module 'bert.pooler.dense'.*List only 'pooler'"):
        PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")


# ------------------------------------------------------------------------------------------ region=<Region>
def test_a_region_object_as_region_grafts_that_region(bert):
    """It was a TypeError ("unhashable type: 'Region'")."""
    pre, finetuned = bert
    made = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"))
    region = made.base_model.get_region()
    config = GraftConfig(finetuned=finetuned, region=region, task_type="SEQ_CLS")
    assert config.region == "given"
    again = get_peft_model(clone_model(pre), config)
    assert again.base_model.get_region() == region and torch.equal(logits(again), logits(made))
    with pytest.raises(ValueError, match=r"region=<a Region> and given_region= were both given"):
        GraftConfig(finetuned=finetuned, region=region, given_region=region)
    with pytest.raises(TypeError, match=r"region must be the name of a region strategy .* or a Region, got dict.*"
                                        r'region="given", given_region='):  # fmt: skip
        GraftConfig(finetuned=finetuned, region={"bert.pooler.dense.weight": [0]})


# ------------------------------------------------------------------------------------------ adapter name in use
@pytest.mark.parametrize("how", ["load_adapter", "from_pretrained_then_load"])
def test_loading_under_an_adapter_name_in_use_names_it_and_changes_nothing(bert, tmp_path, how):
    """It was a misleading "grafted_modules does not list" error about the file."""
    pre, finetuned = bert
    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=5), sparsity=0.01,
                                                         task_type="SEQ_CLS"))  # fmt: skip
    other.save_pretrained(tmp_path / "other")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"))
    if how == "from_pretrained_then_load":
        model.save_pretrained(tmp_path / "mine")
        model = PeftModel.from_pretrained(clone_model(pre), tmp_path / "mine")
    expected = logits(model)
    with pytest.raises(ValueError, match=rf"load_adapter\('{tmp_path / 'other'}', adapter_name='default'\): this model "
                                         r"already has an adapter named 'default'.*Pick another adapter_name, or "
                                         r"delete that adapter first"):  # fmt: skip
        model.load_adapter(tmp_path / "other", adapter_name="default")
    assert list(model.peft_config) == ["default"] and torch.equal(logits(model), expected)
    model.load_adapter(tmp_path / "other", adapter_name="other")  # another name loads
    model.set_adapter("other")
    assert torch.equal(logits(model), logits(other))


# ------------------------------------------------------------------------------------------ casts
def test_a_save_of_a_cast_model_never_replaces_a_head_saved_in_higher_precision(bert, tmp_path):
    """After .to(torch.bfloat16) the head stored whole is bf16: saved into its own folder, the fp32 head was gone."""
    pre, finetuned = bert
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"))
    model.save_pretrained(tmp_path / "g")
    before = folder_bytes(tmp_path / "g")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "g").to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"save_pretrained\('{tmp_path / 'g'}'\) refused: adapter 'default' would "
                                         r"replace its head tensor 'classifier\.(bias|weight)' .*saved there as "
                                         r"torch.float32, with torch.bfloat16.*Nothing was written.*another "
                                         r"folder"):  # fmt: skip
        loaded.save_pretrained(tmp_path / "g")
    assert folder_bytes(tmp_path / "g") == before
    loaded.save_pretrained(tmp_path / "bf16")  # another folder: saved, and it loads
    again = PeftModel.from_pretrained(clone_model(pre), tmp_path / "bf16").to(torch.bfloat16)
    assert torch.equal(logits(again), logits(loaded))
    model.save_pretrained(tmp_path / "g")  # the same precision replaces it as before


def test_a_cast_that_turns_a_grafted_value_into_inf_is_refused_naming_it(bert):
    """A grafted value beyond fp16's 65,504 was accepted by .half(), and the logits became inf or NaN."""
    pre, finetuned = bert
    finetuned = clone_model(finetuned)
    with torch.no_grad():
        finetuned.bert.encoder.layer[0].output.dense.weight[0, 0] = 1e5  # the largest movement: in the region
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"))
    expected = logits(model)
    name = r"bert.encoder.layer.0.output.dense.weight"
    for cast in (lambda m: m.half(), lambda m: m.to(torch.float16)):
        match = (
            rf"Casting to torch.float16 would turn the grafted value 100000 of adapter 'default' in tensor \S*{name}"
        )
        with pytest.raises(ValueError, match=rf"{match} into inf .*65504.*Nothing was cast"):
            cast(model)
        assert all(p.dtype == torch.float32 for p in model.parameters()) and torch.equal(logits(model), expected)
    model.merge_adapter()
    with pytest.raises(ValueError, match=rf"grafted value 100000 of adapter 'default' in tensor \S*{name}"):
        model.half()
    model.unmerge_adapter()
    model.to(torch.bfloat16)  # float32's range: cast
    assert torch.isfinite(logits(model)).all()
