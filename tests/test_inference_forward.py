"""The unmerged forward without autograd writes the grafted entries into the base tensors for the duration of the base
forward and writes the originals back: outputs bit-identical to the functional forward (and to theta_ft on the
region), base tensors unchanged after, also with several adapters, a scale, tied tensors and an error."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import get_peft_model
from testing_utils import clone_model, input_ids, make_pair

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, Region
from peft_graft.tuner.in_place import InPlacePlan


def graft(arch: str):
    pre, finetuned, task_type = make_pair(arch)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    return pre, finetuned, task_type, model.eval()


def state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def outputs(model, grad: bool, in_place: bool, monkeypatch, entry: str = "peft model") -> torch.Tensor:
    """The logits of ``model``'s forward, called through the peft model (whose graft model writes every layer's
    entries once, ``in_place.written_in_place``, when a task type routes it there) or through the base model (each
    layer writes its own)."""
    monkeypatch.setattr(graft_layer, "GRAFT_IN_PLACE_INFERENCE", in_place)
    call = model if entry == "peft model" else model.get_base_model()
    with torch.set_grad_enabled(grad):
        return call(input_ids=input_ids()).logits.detach()


def _per_layer_writes_refused(*args, **kwargs):
    raise AssertionError("a layer wrote its own entries inside the graft model's forward")


@pytest.mark.parametrize("entry", ["peft model", "base model"])
def test_in_place_inference_equals_the_functional_forward(arch, monkeypatch, entry):
    _, _, task_type, model = graft(arch)
    before = state(model)
    with monkeypatch.context() as patch:
        if entry == "peft model" and task_type:  # the task's peft model calls the graft model's forward
            patch.setattr(InPlacePlan, "run", _per_layer_writes_refused)
        fast = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch, entry=entry)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # written back, bit for bit
    assert torch.equal(fast, outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))
    assert torch.equal(fast, outputs(model, grad=True, in_place=True, monkeypatch=monkeypatch))  # autograd: functional
    merged = copy.deepcopy(model).merge_and_unload()  # theta_ft on the region (and heads stored whole)
    with torch.no_grad():
        assert torch.equal(fast, merged(input_ids=input_ids()).logits)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_two_active_adapters_and_a_scale(monkeypatch, scale):
    _, finetuned, task_type, model = graft("roberta_mlm")
    other = GraftConfig(finetuned=finetuned, sparsity=0.02, region="random", seed=3, task_type=task_type)
    model.add_adapter("other", other)
    model.base_model.set_adapter(["default", "other"])
    model.set_scale(scale, "other")
    before = state(model)
    fast = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    assert torch.equal(fast, outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("entry", ["peft model", "base model"])
def test_an_error_in_the_base_forward_still_writes_the_originals_back(entry):
    _, _, _, model = graft("bert_cls")
    before = state(model)
    call = model if entry == "peft model" else model.get_base_model()
    with torch.no_grad(), pytest.raises(IndexError):
        call(input_ids=torch.full((1, 4), 10_000))  # beyond the vocabulary: the embedding lookup fails
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(layer.written_plan is None for layer in _graft_layers(model))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # tied input and output embeddings: written once
def test_generate_writes_the_entries_once_and_gives_the_merged_models_tokens(arch, monkeypatch):
    _, _, _, model = graft(arch)
    before = state(model)
    kwargs = dict(input_ids=input_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with monkeypatch.context() as patch:
        patch.setattr(InPlacePlan, "run", _per_layer_writes_refused)  # written once for the whole generation
        tokens = model.generate(**kwargs)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    monkeypatch.setattr(graft_layer, "GRAFT_IN_PLACE_INFERENCE", False)
    assert torch.equal(tokens, model.generate(**kwargs))
    assert torch.equal(tokens, copy.deepcopy(model).merge_and_unload().generate(**kwargs))


def test_a_second_adapter_applies_its_exact_entries_as_the_functional_forward_does(monkeypatch):
    """Entries no fp32 delta reproduces are written as theta_ft only by the first adapter on a tensor."""
    pre, _, task_type, model = graft("roberta_mlm")
    shrunk = clone_model(pre)
    name = "roberta.encoder.layer.0.attention.self.query.weight"
    with torch.no_grad():
        shrunk.get_parameter(name).view(-1)[:40] *= 1e-7  # far smaller than the delta: stored as theta_ft
    model.add_adapter("shrunk", GraftConfig(finetuned=shrunk, num_entries=40, task_type=task_type))
    layer = model.base_model.graft_layers()["roberta.encoder.layer.0.attention.self.query"]
    assert layer.exact_entries("shrunk")[0].numel() > 0 and layer.graft_indices["default"].numel() > 0
    model.base_model.set_adapter(["default", "shrunk"])
    fast = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    assert torch.equal(fast, outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))


def test_loading_new_values_into_an_adapter_is_seen_by_the_next_forward(monkeypatch):
    """The per-layer cache of entries follows the adapter's tensors: loading another graft of the same layout (other
    indices and values, written in place) changes the next forward."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from testing_utils import finetune_like

    pre, _, task_type, model = graft("bert_cls")
    other_ft = finetune_like(pre, seed=7)
    shifted = Region({n: (i + 1) % pre.get_parameter(n).numel() for n, i in model.get_region().items()})
    config = GraftConfig(finetuned=other_ft, region="given", given_region=shifted, task_type=task_type)
    other = get_peft_model(clone_model(pre), config).eval()  # other entries, as many per module: same layout
    expected = outputs(other, grad=False, in_place=True, monkeypatch=monkeypatch)
    assert not torch.equal(outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch), expected)
    set_peft_model_state_dict(model, get_peft_model_state_dict(other))
    assert torch.equal(outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch), expected)


def _graft_layers(model) -> list:
    return list(model.base_model.graft_layers().values())


def _scale(model):
    model.set_scale(0.5, "default")


def _write_values(model):
    with torch.no_grad():
        for layer in _graft_layers(model):
            if "default" in layer.graft_values:
                layer.graft_values["default"].mul_(-1)


def _write_base_through_data(model):
    for name, param in model.named_parameters():
        if "base_layer" in name:
            param.data.mul_(0.5)  # .data: no version counter moves; the originals are read at every forward


def _switch_adapter(model):
    _, finetuned, task_type = make_pair("bert_cls", seed=5)
    model.add_adapter("other", GraftConfig(finetuned=finetuned, sparsity=0.02, task_type=task_type))
    model.set_adapter("other")


def _float64(model):
    model.double()


@pytest.mark.parametrize("change", [_scale, _write_values, _write_base_through_data, _switch_adapter, _float64])
def test_the_kept_plan_follows_every_change(monkeypatch, change):
    """Each layer keeps its in-place plan between forwards (found once, reused while its inputs stay); a change of
    scale, entry values, base values, active adapters or dtype gives the functional forward's output at once."""
    _, _, _, model = graft("bert_cls")
    ids = input_ids()
    before = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    plans = [layer._in_place_plans[("default",)] for layer in _graft_layers(model)]
    assert torch.equal(outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch), before)
    assert [layer._in_place_plans[("default",)] for layer in _graft_layers(model)] == plans  # reused, not rebuilt
    change(model)
    fast = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    assert not torch.equal(fast, before.to(fast.dtype))
    assert torch.equal(fast, outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))
    with torch.no_grad():
        assert torch.equal(fast, copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits)


def test_no_plan_is_kept_while_a_region_is_learned(monkeypatch):
    """A learning adapter's hard region (MaskTrainer's evaluation) changes with S: the plan is built at each forward."""
    pre, finetuned, task_type = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, learn_region=True, task_type=task_type)
    model = get_peft_model(clone_model(pre), config).eval()
    layers = [layer for layer in _graft_layers(model) if layer.learner("default") is not None]
    outputs_by_region = []
    for entries in ("kept", "none"):
        for layer in layers:
            learner = layer.learner("default")
            learner.hard = learner.harden() if entries == "kept" else (learner.hard[0][:0], learner.hard[1][:0])
        outputs_by_region.append(outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch))
        assert all(not layer._in_place_plans for layer in layers)
        assert torch.equal(outputs_by_region[-1], outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))
    assert not torch.equal(*outputs_by_region)


def test_switching_adapters_finds_each_plan_again_and_deleting_one_drops_them(monkeypatch):
    _, _, _, model = graft("bert_cls")
    _, finetuned, task_type = make_pair("bert_cls", seed=5)
    model.add_adapter("other", GraftConfig(finetuned=finetuned, sparsity=0.02, task_type=task_type))
    by_adapter, plans = {}, {}
    for name in ("default", "other"):
        model.set_adapter(name)
        by_adapter[name] = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
        plans[name] = [layer._in_place_plans[(name,)] for layer in _graft_layers(model)]
    for name in ("default", "other", "default"):
        model.set_adapter(name)
        assert torch.equal(outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch), by_adapter[name])
        assert [layer._in_place_plans[(name,)] for layer in _graft_layers(model)] == plans[name]
    assert not torch.equal(by_adapter["default"], by_adapter["other"])
    model.delete_adapter("other")
    assert all(not layer._in_place_plans for layer in _graft_layers(model))


def test_a_kept_plan_does_not_keep_replaced_weights_alive(monkeypatch):
    """A plan holds no base tensor: weights replaced after a forward (a new parameter, as a load with assign=True does)
    are freed, and the next forward uses the new ones."""
    import gc
    import weakref

    _, _, _, model = graft("bert_cls")
    outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    layer = next(layer for layer in _graft_layers(model) if type(layer.base_layer).__name__ == "Linear")
    old = weakref.ref(layer.base_layer.weight)
    layer.base_layer.weight = torch.nn.Parameter(layer.base_layer.weight.detach() * 2)
    gc.collect()
    assert old() is None
    fast = outputs(model, grad=False, in_place=True, monkeypatch=monkeypatch)
    assert torch.equal(fast, outputs(model, grad=False, in_place=False, monkeypatch=monkeypatch))


def test_a_model_without_generate_still_has_none():
    _, _, _, model = graft("bert_cls")
    assert not hasattr(model.base_model, "generate")
    assert hasattr(graft("gpt2")[3].base_model, "generate")


@pytest.mark.parametrize("entry", ["peft model", "base model"])
def test_graft_values_still_learn_after_a_forward_without_autograd(entry):
    """Training the grafted values (they are the adapter's parameters) with an evaluation between steps, as the
    Trainer does: the entries cached by a forward without autograd are not reused by one with it."""
    _, _, _, model = graft("llama")
    call = model if entry == "peft model" else model.get_base_model()
    layers = [layer for layer in model.base_model.graft_layers().values() if "default" in layer.graft_values]
    assert layers and all(layer.graft_values["default"].requires_grad for layer in layers)
    for _ in range(2):
        with torch.no_grad():
            call(input_ids=input_ids())
        model.zero_grad()
        call(input_ids=input_ids()).logits.sum().backward()
        assert all(layer.graft_values["default"].grad is not None for layer in layers)


def test_deleting_an_adapter_drops_its_cached_entries():
    _, finetuned, task_type, model = graft("gpt2")
    model.add_adapter("other", GraftConfig(finetuned=finetuned, sparsity=0.01, task_type=task_type))
    model.set_adapter("other")
    with torch.no_grad():
        model(input_ids=input_ids())
    layers = list(model.base_model.graft_layers().values())
    assert any(key[0] == "other" for layer in layers for key in layer._entries_cache)
    model.set_adapter("default")
    model.delete_adapter("other")
    assert not any(key[0] == "other" for layer in layers for key in layer._entries_cache)


@pytest.mark.parametrize("entry", ["peft model", "base model"])
@pytest.mark.parametrize("state_asked", ["adapters disabled", "another adapter", "autograd on"])
def test_a_forward_nested_in_a_written_one_sees_the_state_it_asks_for(entry, state_asked):
    """A hook calling the model inside its forward (as a reference model's score, or contrastive decoding, does) gets
    the outputs it would get on its own, and the outer forward is unchanged."""
    pre, finetuned, task_type, model = graft("gpt2")
    model.add_adapter("other", GraftConfig(finetuned=finetuned, sparsity=0.01, region="random", task_type=task_type))
    call = model if entry == "peft model" else model.get_base_model()
    ids, before = input_ids(), state(model)

    def nested() -> torch.Tensor:
        if state_asked == "adapters disabled":
            with model.disable_adapter():
                return call(input_ids=ids).logits.detach()
        if state_asked == "autograd on":
            with torch.enable_grad():
                return call(input_ids=ids).logits.detach()
        model.set_adapter("other")
        try:
            return call(input_ids=ids).logits.detach()
        finally:
            model.set_adapter("default")

    with torch.no_grad():
        alone, outer_alone = nested(), model(input_ids=ids).logits
    if state_asked == "adapters disabled":
        assert torch.equal(alone, pre(input_ids=ids).logits.detach())
    seen = []

    def hook(*_):
        if not seen:  # the nested forward runs this hook too
            seen.append(None)
            seen[0] = nested()

    hook = model.get_base_model().transformer.h[1].register_forward_hook(hook)
    with torch.no_grad():
        outer = model(input_ids=ids).logits
    hook.remove()
    assert torch.equal(seen[0], alone) and torch.equal(outer, outer_alone)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(layer.written_plan is None for layer in _graft_layers(model))


def test_threads_serving_one_unmerged_model_get_its_outputs():
    """Unmerged forwards write into shared base tensors: graft layers take a lock, so threads take turns."""
    _, _, _, model = graft("gpt2")
    before, batches = state(model), [input_ids(seed=seed) for seed in range(4)]
    with torch.no_grad():
        expected = [model(input_ids=ids).logits for ids in batches]

    def serve(i: int) -> bool:
        call = model if i % 2 else model.get_base_model()  # the whole-model writes and the per-layer ones
        with torch.no_grad():
            return all(torch.equal(call(input_ids=batches[i]).logits, expected[i]) for _ in range(20))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(serve, range(4)))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
