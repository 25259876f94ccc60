"""The public registry of region strategies, and reading a saved graft's region."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from testing_utils import clone_model, make_pair

from peft_graft import REGION_STRATEGIES, GraftConfig, Region, RegionRequest, global_top_k, register_region_strategy


@pytest.fixture
def strategy_name():
    """A name for a test strategy, unregistered afterwards."""
    yield "test_first_entries"
    REGION_STRATEGIES.pop("test_first_entries", None)


def first_entries(request: RegionRequest) -> Region:
    """The first k entries of the eligible tensors, in tensor order."""
    k = request.budget(request.num_eligible)
    region = {}
    for name, delta in request.movement.items():
        take = min(k, delta.numel())
        if take:
            region[name] = torch.arange(take)
        k -= take
    return Region(region)


def test_a_registered_strategy_is_one_function_and_its_grafts_load_without_it(tmp_path, strategy_name):
    pre, finetuned, task_type = make_pair("bert_cls")
    register_region_strategy(strategy_name, first_entries)
    config = GraftConfig(finetuned=finetuned, region=strategy_name, num_entries=50, task_type=task_type)
    model = get_peft_model(clone_model(pre), config)
    region = model.get_region()
    first = next(iter(region))
    assert region.num_entries == 50 and torch.equal(region[first], torch.arange(50))
    model.save_pretrained(tmp_path)
    REGION_STRATEGIES.pop(strategy_name)  # a saved graft no longer needs its strategy
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path)
    assert loaded.get_region() == region


def test_registry_errors(strategy_name):
    register_region_strategy(strategy_name)(first_entries)  # as a decorator
    with pytest.raises(ValueError, match="exists already"):
        register_region_strategy(strategy_name, first_entries)
    register_region_strategy(strategy_name, first_entries, overwrite=True)
    with pytest.raises(TypeError, match="function of a RegionRequest"):
        register_region_strategy(strategy_name, "not callable", overwrite=True)
    with pytest.raises(ValueError, match="non-empty name"):
        register_region_strategy("", first_entries)
    with pytest.raises(ValueError, match=r"Unknown region strategy region='nope'.*register_region_strategy"):
        GraftConfig(region="nope")


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        (lambda request: {"x": torch.tensor([0])}, TypeError, "returned dict, not a Region"),
        (lambda request: Region({"not.a.tensor": torch.tensor([0])}), ValueError, "not an eligible tensor"),
        (lambda request: Region({next(iter(request.movement)): torch.tensor([10**9])}), ValueError, "beyond its"),
    ],
)
def test_a_strategy_returning_a_bad_region_is_refused(strategy_name, returned, error, message):
    pre, finetuned, task_type = make_pair("bert_cls")
    register_region_strategy(strategy_name, returned)
    with pytest.raises(error, match=message):
        get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, region=strategy_name, task_type=task_type))


def test_a_strategy_without_budget_needs_no_sparsity(strategy_name):
    pre, finetuned, task_type = make_pair("bert_cls")
    register_region_strategy(strategy_name, first_entries)
    with pytest.raises(TypeError, match="sparsity"):
        GraftConfig(finetuned=finetuned, region=strategy_name, sparsity=None)
    name = next(n for n, _ in pre.named_parameters() if n.endswith("bias"))
    register_region_strategy(
        strategy_name, lambda request: Region({name: torch.tensor([1])}), uses_budget=False, overwrite=True
    )
    config = GraftConfig(finetuned=finetuned, region=strategy_name, sparsity=None, task_type=task_type)
    assert get_peft_model(clone_model(pre), config).get_region() == Region({name: torch.tensor([1])})


def test_region_from_pretrained_reads_a_saved_graft(tmp_path):
    pre, finetuned, task_type = make_pair("roberta_mlm")  # tied embeddings / decoder: one tensor, one entry set
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=300, task_type=task_type))
    model.save_pretrained(tmp_path)
    assert Region.from_pretrained(tmp_path, pre) == model.get_region()
    assert Region.from_pretrained(tmp_path, model) == model.get_region()  # a PeftModel of the base works too
    given = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, region="given", given_region=tmp_path))
    assert given.get_region() == model.get_region()


def test_region_from_pretrained_refuses_bad_folders(tmp_path):
    pre, finetuned, task_type = make_pair("bert_cls")
    with pytest.raises(ValueError, match=r"adapter_config\.json is missing"):
        Region.from_pretrained(tmp_path, pre)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=30, task_type=task_type))
    model.save_pretrained(tmp_path)
    weights_file = tmp_path / "adapter_model.safetensors"
    weights = load_file(weights_file)
    key = next(k for k in weights if k.endswith("graft_indices"))
    weights[key] = weights[key].clone()
    weights[key][-1] = 10**8
    save_file(weights, weights_file)
    with pytest.raises(ValueError, match="does not match the checksum"):
        Region.from_pretrained(tmp_path, pre)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    del config["weights_checksum"]  # as a file written by another tool: the indices are still checked
    config["format_version"] = 0
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="outside"):
        Region.from_pretrained(tmp_path, pre)
    other, _, _ = make_pair("gpt2")
    with pytest.raises(ValueError, match="does not fit this model"):
        Region.from_pretrained(tmp_path, other)
    weights[key] = load_file(weights_file)[key].clamp(max=10).float() + 0.7  # in range, but not integers
    save_file(weights, weights_file)
    with pytest.raises(ValueError, match=r"as torch\.float32, not integers"):
        Region.from_pretrained(tmp_path, pre)
    (tmp_path / "adapter_config.json").write_text(json.dumps([config]))
    with pytest.raises(ValueError, match="records no grafted_modules"):
        Region.from_pretrained(tmp_path, pre)
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        Region.from_pretrained(tmp_path, pre)


def test_the_readme_strategy_picks_the_largest_relative_movement(strategy_name):
    pre, finetuned, task_type = make_pair("bert_cls")

    @register_region_strategy(strategy_name)
    def relative_movement(request: RegionRequest) -> Region:  # as in docs/graft.md
        ratios = {n: d.abs() / (request.pretrained(n).abs() + 1e-8) for n, d in request.movement.items()}
        return global_top_k(ratios, request.budget(request.num_eligible))

    config = GraftConfig(finetuned=finetuned, region=strategy_name, num_entries=40, task_type=task_type)
    region = get_peft_model(clone_model(pre), config).get_region()
    fine = dict(finetuned.named_parameters())
    eligible = {n: p for n, p in pre.named_parameters() if "classifier" not in n}  # the new head is saved whole
    ratios = {n: ((fine[n] - p).abs() / (p.abs() + 1e-8)).detach().reshape(-1) for n, p in eligible.items()}
    threshold = torch.cat(list(ratios.values())).topk(40).values[-1]
    assert region.num_entries == 40
    for name, indices in region.items():
        assert bool((ratios[name][indices] >= threshold).all()), name
