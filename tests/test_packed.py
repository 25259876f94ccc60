"""Packed grafts (issue 28): a graft loaded for inference is held in one flat store per adapter (``tuner/packed.py``)
rather than a few small tensors on every layer. It must give the unpacked adapter's outputs, merges and saved files
bit for bit, free its store when deleted, follow ``.to()``, unpack before anything trains it, and cost about the bytes
of its file."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import safetensors.torch
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from testing_utils import clone_model, input_ids, make_pair

from peft_graft import GraftConfig
from peft_graft.tuner.layer import GraftLayer
from peft_graft.tuner.packed import PackedStore

NAMES = ["a", "__base__", "b", "a"]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(pre, folder)``: grafts "a" and "b" saved under ``folder / name``; "a" has entries stored as theta_ft."""
    pre, finetuned, task_type = make_pair("roberta_cls")
    shrunk = copy.deepcopy(finetuned)
    with torch.no_grad():  # far smaller than the delta: no fp32 delta reproduces them, stored as theta_ft
        shrunk.get_parameter("roberta.encoder.layer.0.attention.self.query.weight").view(-1)[:40] *= 1e-7
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=shrunk, num_entries=300, task_type=task_type), adapter_name="a"
    )
    other = make_pair("roberta_cls", seed=3)[1]
    model.add_adapter("b", GraftConfig(finetuned=other, num_entries=300, region="random", seed=2, task_type=task_type))
    folder = tmp_path_factory.mktemp("grafts")
    model.save_pretrained(folder)
    return pre, folder


def load(pre, folder, trainable: bool = False, names: tuple[str, ...] = ("a", "b")) -> PeftModel:
    model = PeftModel.from_pretrained(
        clone_model(pre), folder / names[0], adapter_name=names[0], is_trainable=trainable
    )
    for name in names[1:]:
        model.load_adapter(folder / name, adapter_name=name, is_trainable=trainable)
    return model.eval()


def layers(model) -> list[GraftLayer]:
    return list(model.base_model.graft_layers().values())


def packed(model, name: str) -> int:
    return sum(name in layer.packed for layer in layers(model))


def run(model, grad: bool = False, **kwargs) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(input_ids=input_ids(4), **kwargs).logits.detach()


def test_a_graft_loaded_for_inference_is_packed_and_gives_the_unpacked_outputs(saved):
    pre, folder = saved
    unpacked, model = load(pre, folder, trainable=True), load(pre, folder)
    assert packed(unpacked, "a") == packed(unpacked, "b") == 0
    holding = [layer for layer in layers(model) if layer.has_region("a")]
    assert holding and packed(model, "a") == len(holding) and packed(model, "b") > 0
    assert not any("a" in layer.graft_values or "a" in layer.graft_indices for layer in layers(model))
    assert any(layer.exact_entries("a")[0].numel() for layer in holding)  # exact entries are packed too
    for name in ("a", "b"):
        model.base_model.set_adapter(name, inference_mode=True)  # stays packed
        unpacked.base_model.set_adapter(name, inference_mode=True)
        assert torch.equal(run(model), run(unpacked)), name
        assert torch.equal(run(model, grad=True), run(unpacked, grad=True)), name  # the functional forward
        assert torch.equal(run(model), run(model)), name  # cached entries
    assert torch.equal(run(model, adapter_names=NAMES), run(unpacked, adapter_names=NAMES))
    assert packed(model, "a") == len(holding)


def test_merging_a_packed_graft_writes_theta_ft_and_unmerging_restores_the_base(saved):
    pre, folder = saved
    unpacked, model = load(pre, folder, trainable=True), load(pre, folder)
    unpacked.base_model.set_adapter("a", inference_mode=True)
    before = {n: p.clone() for n, p in model.named_parameters()}
    model.merge_adapter()
    unpacked.merge_adapter()
    merged, expected = dict(model.named_parameters()), dict(unpacked.named_parameters())
    assert all(torch.equal(merged[n], expected[n]) for n in before if "graft_" not in n)
    assert any(not torch.equal(merged[n], before[n]) for n in before)
    model.unmerge_adapter()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert packed(model, "a") > 0


def test_a_packed_graft_saves_the_unpacked_files_byte_for_byte(saved, tmp_path):
    pre, folder = saved
    model = load(pre, folder)
    model.save_pretrained(tmp_path / "packed")
    for name in ("a", "b"):
        assert (tmp_path / "packed" / name / WEIGHTS).read_bytes() == (folder / name / WEIGHTS).read_bytes(), name
    state = get_peft_model_state_dict(model, adapter_name="a")
    expected = safetensors.torch.load_file(folder / "a" / WEIGHTS)
    assert state.keys() == expected.keys()
    assert all(state[k].dtype == expected[k].dtype and torch.equal(state[k], expected[k]) for k in expected)
    assert packed(model, "a") > 0


def test_deleting_a_packed_graft_frees_its_store(saved):
    pre, folder = saved
    model = load(pre, folder)
    stores = {id(layer.packed["b"]): weakref.ref(layer.packed["b"]) for layer in layers(model) if "b" in layer.packed}
    assert len(stores) == 1  # one store per adapter (index dtype and device)
    model.delete_adapter("b")
    gc.collect()
    assert all(ref() is None for ref in stores.values())
    assert not any("b" in layer.packed or "b" in layer._all_available_adapter_names() for layer in layers(model))


def test_to_keeps_a_graft_packed_on_its_device_and_converts_it_as_unpacked_otherwise(saved):
    pre, folder = saved
    model = load(pre, folder)
    expected = run(model)
    model.to("cpu").float()  # changes nothing: stays packed
    assert packed(model, "a") > 0 and packed(model, "b") > 0
    assert torch.equal(run(model), expected)
    unpacked = load(pre, folder, trainable=True)
    model.to(torch.bfloat16)
    unpacked.to(torch.bfloat16)
    assert packed(model, "a") == packed(model, "b") == 0  # converted as the unpacked adapter's tensors are
    state, expected_state = model.state_dict(), unpacked.state_dict()
    assert state.keys() == expected_state.keys()
    assert all(state[k].dtype == expected_state[k].dtype and torch.equal(state[k], expected_state[k]) for k in state)


def test_a_graft_to_train_is_not_packed_and_set_adapter_unpacks_one(saved):
    pre, folder = saved
    trainable = load(pre, folder, trainable=True, names=("a",))
    assert packed(trainable, "a") == 0
    values = [p for n, p in trainable.named_parameters() if "graft_values" in n]
    assert values and all(p.requires_grad for p in values)
    model = load(pre, folder)
    expected = run(model)
    model.set_adapter("a")  # peft makes the active adapter's values trainable: unpacked first
    assert packed(model, "a") == 0 and packed(model, "b") > 0
    values = [p for n, p in model.named_parameters() if "graft_values.a" in n]
    assert values and all(p.requires_grad for p in values)
    assert torch.equal(run(model), expected)
    model.train()
    model(input_ids=input_ids(4)).logits.sum().backward()
    assert all(p.grad is not None for p in values)
    with torch.no_grad():
        for p in values:
            p.sub_(0.1 * p.grad)
    assert not torch.equal(run(model.eval()), expected)


def test_loading_a_state_dict_into_a_packed_graft_unpacks_it(saved):
    pre, folder = saved
    model = load(pre, folder)
    state = get_peft_model_state_dict(model, adapter_name="b")
    doubled = {k: v * 2 if "graft_values" in k else v for k, v in state.items()}
    set_peft_model_state_dict(model, doubled, adapter_name="b")
    assert packed(model, "b") == 0 and packed(model, "a") > 0
    after = get_peft_model_state_dict(model, adapter_name="b")
    assert all(torch.equal(after[k], doubled[k]) for k in doubled)


def test_many_packed_grafts_hold_their_bytes_in_one_store_each(saved):
    """Memory near the files' bytes: per graft one store (four tensors) whose bytes are the file's graft tensors',
    and no per-layer tensor of it; deleting gives it back."""
    pre, folder = saved
    count = 12
    names = tuple(f"g{i}" for i in range(count))
    model = PeftModel.from_pretrained(clone_model(pre), folder / "b", adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(folder / ("a" if int(name[1:]) % 2 else "b"), adapter_name=name)
    file_bytes = {
        name: sum(
            t.numel() * t.element_size()
            for k, t in safetensors.torch.load_file(folder / name / WEIGHTS).items()
            if ".graft_" in k
        )
        for name in ("a", "b")
    }
    run(model, adapter_names=list(names[:4]))
    for name in names:
        stores = {id(layer.packed[name]): layer.packed[name] for layer in layers(model) if name in layer.packed}
        assert len(stores) == 1
        store: PackedStore = next(iter(stores.values()))
        assert len(store.tensors) == 4
        assert store.nbytes() == file_bytes["a" if int(name[1:]) % 2 else "b"]
    own = [
        t
        for layer in layers(model)
        for container in (
            layer.graft_indices,
            layer.graft_values,
            layer.graft_exact_positions,
            layer.graft_exact_values,
        )
        for t in container.values()
    ]
    assert own == []  # no adapter holds tensors of its own on a layer
    state = model.state_dict()  # views of the stores, not copies (peft reads it at every load)
    key = next(k for k in state if k.endswith(f".graft_values.{names[1]}"))
    store = next(layer.packed[names[1]] for layer in layers(model) if names[1] in layer.packed)
    assert state[key].untyped_storage().data_ptr() == store.tensors["values"].untyped_storage().data_ptr()
    calls = []
    entries = PackedStore.entries

    def counting(self: PackedStore, row: int):  # state_dict() views every packed tensor: a load must not
        calls.append(row)
        return entries(self, row)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PackedStore, "entries", counting)
        model.load_adapter(folder / "b", adapter_name="extra")
    assert len(calls) < count  # not one per packed layer of every loaded graft
    for name in (*names[1:], "extra"):
        model.delete_adapter(name)
    assert all(set(layer.packed) <= {names[0]} for layer in layers(model))
    assert all(key[0] == names[0] for layer in layers(model) for key in layer._entries_cache)


def test_forwards_follow_packing_unpacking_and_changed_values(saved):
    """The cached entries and in-place plans of a packed adapter are refreshed when it is unpacked or packed anew."""
    pre, folder = saved
    model = load(pre, folder)
    expected = run(model)

    def negate() -> None:
        with torch.no_grad():
            for layer in layers(model):
                if "a" in layer.graft_values:
                    layer.graft_values["a"].mul_(-1)

    model.base_model.unpack_adapter("a")
    assert packed(model, "a") == 0 and torch.equal(run(model), expected)
    negate()
    changed = run(model)
    assert not torch.equal(changed, expected)
    model.base_model.pack_adapter("a")
    assert packed(model, "a") > 0 and torch.equal(run(model), changed)
    model.base_model.unpack_adapter("a")
    negate()
    model.base_model.pack_adapter("a")
    assert torch.equal(run(model), expected)


def test_a_packed_graft_of_a_model_with_tied_weights_gives_the_unpacked_outputs(tmp_path):
    pre, finetuned, _ = make_pair("gpt2")  # the LM head is the token embedding
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=300))
    model.save_pretrained(tmp_path)
    unpacked = PeftModel.from_pretrained(clone_model(pre), tmp_path, is_trainable=True).eval()
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path).eval()
    assert packed(loaded, "default") > 0
    ids = input_ids(4)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, unpacked(input_ids=ids).logits)
        kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(loaded.generate(**kwargs), unpacked.generate(**kwargs))


def test_unpacking_everywhere_frees_the_store(saved):
    pre, folder = saved
    model = load(pre, folder)
    run(model)  # caches entries and plans built from the store
    ref = weakref.ref(next(layer.packed["a"] for layer in layers(model) if "a" in layer.packed))
    model.base_model.unpack_adapter("a")
    gc.collect()
    assert ref() is None


def test_packing_and_unpacking_inside_inference_mode_keep_working_tensors(saved):
    pre, folder = saved
    model = load(pre, folder, names=("a",))
    expected = run(model)
    with torch.inference_mode():
        model.set_adapter("a")  # unpacks: peft makes its values trainable
        assert packed(model, "a") == 0
        assert torch.equal(model(input_ids=input_ids(4)).logits, expected)
        model.base_model.set_adapter("a", inference_mode=True)
        model.base_model.pack_adapter("a")
        assert packed(model, "a") > 0
        assert torch.equal(model(input_ids=input_ids(4)).logits, expected)
    assert torch.equal(run(model), expected)


def test_holding_names_the_grafts_with_entries_on_a_layer_as_entries_does(saved):
    """``GraftLayer.holding`` (how a mixed batch finds the grafts of each layer) agrees with ``entries`` on every layer
    for a stored graft, a packed one, one learning its region, and a name that is not there."""
    pre, folder = saved
    model = load(pre, folder)
    model.set_adapter("a")  # "a" unpacked (stored), "b" packed
    finetuned = make_pair("roberta_cls", seed=5)[1]
    model.add_adapter("c", GraftConfig(finetuned=finetuned, num_entries=8, learn_region=True, task_type="SEQ_CLS"))
    names = ["a", "b", "c", "missing"]
    seen, empty = set(), set()
    for layer in layers(model):
        expected = {name for name in names if layer.entries(name)[0].numel()}
        assert layer.holding(names) == expected
        kind = {name: "learning" if name in layer.graft_learning else "stored" for name in expected}
        seen |= {"packed" if name in layer.packed else kind[name] for name in expected}
        empty |= set(names) - expected
    assert seen == {"stored", "packed", "learning"} and {"a", "c", "missing"} <= empty
