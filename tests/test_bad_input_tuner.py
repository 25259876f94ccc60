"""Careless input on the graft layers and the tuner (issue 35): ``modules_to_save`` entries resolved as peft resolves
them, graft values that keep fp32 through a cast of the model, clear errors for a module stored whole by one graft and
grafted by another, and a mixed batch that a concurrent ``delete_adapter`` waits for.

Deterministic: the concurrency test pauses the forward until the deleting thread either waits for the lock (correct)
or has finished (the bug it catches), as ``test_threads.py`` does."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from peft import PeftModel, get_peft_model
from test_threads import DEADLINE, ContendedLock
from testing_utils import clone_model, input_ids, make_pair
from torch import nn

from peft_graft import GraftConfig, GraftLayer
from peft_graft.tuner import in_place
from peft_graft.tuner.layer import GRAFT_TENSORS

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model: nn.Module, ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids() if ids is None else ids, **kwargs).logits


def graft_layer_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, GraftLayer)]


def grafted_by_hand(pre: nn.Module, finetuned: nn.Module, region, heads: tuple[str, ...]) -> nn.Module:
    """theta_pre with theta_ft written at ``region`` and the modules ``heads`` copied whole from theta_ft."""
    model = clone_model(pre)
    tuned = finetuned.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(heads):
                param.copy_(tuned[name])
            elif name in region:
                param.view(-1)[region[name]] = tuned[name].view(-1)[region[name]]
    return model


# ------------------------------------------------------------------------------------------ modules_to_save names
@pytest.mark.parametrize("pooler", ["pooler", "bert.pooler"])
def test_modules_to_save_by_short_name_is_stored_whole_as_by_the_full_name(pooler, tmp_path):
    """peft wraps every module whose name ends with an entry: "pooler" stores bert.pooler whole, so nothing is grafted
    inside it, and saving, loading, the region, stats, mixed batches and merge_and_unload all work as for the full
    name."""
    pre, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=[pooler, "classifier"])
    ).eval()
    assert not [name for name in graft_layer_names(model) if "pooler" in name]
    region = model.get_region()
    assert region.num_entries and not [name for name in region if "pooler" in name]
    assert model.graft_stats().num_entries == region.num_entries
    expected = grafted_by_hand(pre, finetuned, region, ("bert.pooler.", "classifier."))
    out = logits(model)
    assert torch.equal(out, logits(expected))

    model.save_pretrained(tmp_path / "graft")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft").eval()
    assert torch.equal(logits(loaded), out)

    ids = input_ids(batch=2)
    mixed = logits(model, ids, adapter_names=["default", "__base__"])
    torch.testing.assert_close(mixed[:1], logits(model, ids[:1]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1:], logits(pre, ids[1:]), rtol=1e-5, atol=1e-6)

    merged = model.merge_and_unload()
    assert not graft_layer_names(merged)
    assert torch.equal(logits(merged), out)


def test_storing_whole_a_module_another_graft_grafts_in_is_refused(tmp_path):
    """A graft storing bert.pooler whole, added after one that grafts entries inside it, would copy that graft's layer
    into its stored module (the model then cannot be saved): refused, naming both, and nothing changes."""
    pre, finetuned, _ = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, num_entries=40, include_parameters="pooler", modules_to_save="classifier")
    model = get_peft_model(clone_model(pre), config).eval()
    assert "bert.pooler.dense" in [name.removeprefix("base_model.model.") for name in graft_layer_names(model)]
    before = logits(model)
    whole = GraftConfig(finetuned=finetuned, sparsity=0.01, modules_to_save=["bert.pooler", "classifier"])
    message = (
        r"Adapter 'whole' stores module 'bert.pooler' whole .* adapter\(s\) \['default'\] of this model graft entries "
        r"of 'bert.pooler.dense' in it.*Make every graft with 'bert.pooler' in its modules_to_save"
    )
    with pytest.raises(ValueError, match=message):
        model.add_adapter("whole", whole)
    assert list(model.peft_config) == ["default"]
    assert torch.equal(logits(model), before)
    model.save_pretrained(tmp_path / "graft")
    assert torch.equal(logits(PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft")), before)


# ------------------------------------------------------------------------------------------ one module, two ways
@pytest.fixture(scope="module")
def head_grafts(tmp_path_factory):
    """``(pre, folder)``: grafts saved as "whole" (the classifier stored whole) and "entries" (classifier entries
    grafted, no head stored whole)."""
    pre, finetuned, _ = make_pair("bert_cls")
    folder = tmp_path_factory.mktemp("heads")
    whole = GraftConfig(finetuned=finetuned, sparsity=0.01, modules_to_save=["classifier"])
    get_peft_model(clone_model(pre), whole).save_pretrained(folder / "whole")
    entries = GraftConfig(finetuned=finetuned, num_entries=20, include_parameters="classifier")
    get_peft_model(clone_model(pre), entries).save_pretrained(folder / "entries")
    return pre, folder


@pytest.mark.parametrize(("first", "second"), [("entries", "whole"), ("whole", "entries")])
def test_loading_a_graft_that_stores_whole_a_module_another_grafts_is_a_clear_error(head_grafts, first, second):
    """One graft stores the classifier whole, the other grafts entries of it: loading the second names both adapters,
    the module and the fix (peft raised a raw TypeError, or the misleading "made for another architecture"), and
    leaves the model as it was."""
    pre, folder = head_grafts
    model = PeftModel.from_pretrained(clone_model(pre), folder / first, adapter_name=first).eval()
    before = logits(model)
    if first == "entries":
        message = r"Adapter 'whole' stores module 'classifier' whole .* adapter\(s\) \['entries'\] .* 'classifier'"
    else:
        message = r"Graft 'entries' .* grafts entries of module 'classifier', but this model stores 'classifier' whole"
    with pytest.raises(ValueError, match=message + r".*modules_to_save.*separate copies of the base model"):
        model.load_adapter(folder / second, adapter_name=second)
    assert list(model.peft_config) == [first]
    assert torch.equal(logits(model), before)


def test_a_graft_without_its_head_on_a_model_storing_the_head_names_the_head(head_grafts):
    """A graft saved without its head (its classifier entries grafted), loaded beside a SEQ_CLS graft (peft stores the
    classifier whole for that task type) on the same architecture: the error says the head is stored whole here and
    how to fix it, not "made for another architecture"."""
    pre, folder = head_grafts
    _, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.01, task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match=r"this model stores 'classifier' whole \(modules_to_save\)") as error:
        model.load_adapter(folder / "entries", adapter_name="entries")
    assert "another architecture" not in str(error.value)
    assert "a task head fine-tuning changed must be stored whole" in str(error.value)
    assert list(model.peft_config) == ["default"]


# ------------------------------------------------------------------------------------------ casts
CASTS = {
    "bf16": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "half": (lambda m: m.half(), torch.float16),
    "fp64": (lambda m: m.to(torch.float64), torch.float64),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_graft_values_keep_fp32_through_a_cast_and_the_graft_survives_save_and_load(cast, tmp_path):
    """Casting a graft model casts its base, never its graft tensors (the loader refuses graft values other than
    fp32): the cast model applies theta_ft in the new dtype at the grafted entries, as the cast of the grafted model,
    and saves a graft that loads onto theta_pre (heads stored whole are part of the model and cast with it) and
    gives theta_ft itself there, as does the model cast back to fp32."""
    pre, finetuned, _ = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"])
    model = get_peft_model(clone_model(pre), config).eval()
    values = {name: p.detach().clone() for name, p in model.named_parameters() if ".graft_values." in name}
    region = model.get_region()
    expected = grafted_by_hand(pre, finetuned, region, ("classifier.",))
    apply_cast, dtype = CASTS[cast]

    apply_cast(model)
    for layer in model.base_model.graft_layers().values():
        for container in GRAFT_TENSORS:
            kinds = (torch.int32, torch.int64) if container.endswith(("indices", "positions")) else (torch.float32,)
            assert all(tensor.dtype in kinds for tensor in getattr(layer, container).values()), container
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters() if name in values)
    assert next(model.get_base_model().parameters()).dtype == dtype
    out = logits(model)
    assert torch.equal(out, logits(expected.to(dtype)))

    model.save_pretrained(tmp_path / "graft")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft").eval()  # onto theta_pre (fp32)
    assert_theta_ft_at(copy.deepcopy(loaded), region, finetuned)
    assert torch.equal(logits(apply_cast(loaded)), out)
    assert_theta_ft_at(model.to(torch.float32), region, finetuned)  # cast back


@pytest.mark.parametrize("arch", ["roberta_mlm", "gpt2"])
@pytest.mark.parametrize("first", ["model", "lm_head"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True], ids=["made", "loaded"])
def test_a_tied_lm_head_cast_before_its_first_forward_keeps_its_graft(arch, first, dtype, packed, tmp_path):
    """A tied LM head reads its embedding's weight, whose entries the embedding's layer stores. Whichever module the
    cast reaches first casts that tensor for both: the model (the embedding first; a RoBERTa head then has only its
    bias left to cast) or the head alone. Each layer's base check and exact entries are readied before its tensors
    change, a graft loaded for inference (packed) unpacked first, so the cast model gives the cast of the grafted
    model; it raised a false "different pre-trained model" error."""
    pre, finetuned, task_type = make_pair(arch)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    region = model.get_region()
    if packed:
        model.save_pretrained(tmp_path / "graft")
        model = PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft")
        assert any(layer.packed for layer in model.base_model.graft_layers().values())
    model.eval()
    head = model.get_base_model().get_output_embeddings()
    assert head.weight is model.get_base_model().get_input_embeddings().weight
    if first == "lm_head":
        head.to(dtype)
    model.to(dtype)
    expected = grafted_by_hand(pre, finetuned, region, ()).to(dtype)
    assert torch.equal(logits(model), logits(expected))
    assert_theta_ft_at(model.to(torch.float32), region, finetuned)  # cast back


@pytest.mark.parametrize("cast", list(CASTS))
def test_an_adapter_merged_before_a_cast_unmerges_to_the_cast_theta_pre(cast):
    """Unmerging after a cast writes back theta_pre in the new dtype, bit for bit the cast of the pre-trained model
    (the saved originals stayed fp32: a RuntimeError from index_put), and the model applies the graft again, its fp32
    delta on that theta_pre (docs/graft.md)."""
    pre, finetuned, _ = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"])
    model = get_peft_model(clone_model(pre), config).eval()
    apply_cast, _ = CASTS[cast]
    model.merge_adapter()
    apply_cast(model)
    model.unmerge_adapter()
    assert not any(layer.merged for layer in model.base_model.graft_layers().values())
    grafted = logits(apply_cast(grafted_by_hand(pre, finetuned, model.get_region(), ())))
    torch.testing.assert_close(logits(model), grafted, rtol=0.05, atol=0.05)
    expected = apply_cast(clone_model(pre)).state_dict()
    unloaded = model.unload().state_dict()  # peft's unload keeps the head stored whole (modules_to_save)
    assert unloaded.keys() == expected.keys()
    assert all(torch.equal(unloaded[name], expected[name]) for name in expected if not name.startswith("classifier."))


def test_a_graft_made_on_a_bf16_base_cast_to_fp32_gives_its_theta_ft():
    """Its fp32 deltas were chosen to round to theta_ft in bf16; on the fp32 cast of the same base they would give
    theta_pre + delta unrounded: the cast stores those entries exactly, and the model gives theta_ft bit for bit."""
    pre, finetuned, _ = make_pair("bert_cls")
    pre, finetuned = clone_model(pre).to(torch.bfloat16), clone_model(finetuned).to(torch.bfloat16)
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"])
    model = get_peft_model(clone_model(pre), config).eval()
    region = model.get_region()
    model.to(torch.float32)
    assert_theta_ft_at(model, region, finetuned.float())


def assert_theta_ft_at(model, region, finetuned: nn.Module) -> None:
    """``model`` merged holds theta_ft bit for bit (in fp32) at every entry of ``region``."""
    merged, tuned = model.merge_and_unload().state_dict(), finetuned.state_dict()
    for name, idx in region.items():
        assert merged[name].dtype == torch.float32
        assert torch.equal(merged[name].view(-1)[idx], tuned[name].view(-1)[idx]), name


# ------------------------------------------------------------------------------------------ threads
def test_delete_adapter_from_another_thread_waits_for_a_mixed_batch(monkeypatch):
    """The mixed batch's checks of adapter_names ran before it took the lock: a delete_adapter (or load_adapter) from
    another thread could change the adapters under them (a raw "dictionary changed size during iteration", or rows
    served by a graft deleted meanwhile). The delete now waits for the whole mixed forward."""
    pre, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type="SEQ_CLS"), adapter_name="a"
    )
    _, other, _ = make_pair("bert_cls", seed=0)
    model.add_adapter("b", GraftConfig(finetuned=other, sparsity=0.05, region="random", task_type="SEQ_CLS"))
    model.eval()
    ids, names = input_ids(batch=4), ["a", "b", "__base__", "b"]
    expected = logits(model, ids, adapter_names=names)

    spy = ContendedLock(in_place.WRITE_LOCK)
    monkeypatch.setattr(in_place, "WRITE_LOCK", spy)
    done, errors = threading.Event(), []

    def delete() -> None:
        try:
            model.delete_adapter("b")
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            done.set()

    deleter = threading.Thread(target=delete, daemon=True)
    tuner, adapter_modules = model.base_model, model.base_model._adapter_modules

    def paused_adapter_modules():  # the checks of adapter_names read the adapters' modules: pause there once
        if deleter.ident is None:
            deleter.start()
            deadline = time.monotonic() + DEADLINE
            while not (spy.contended.wait(0.005) or done.is_set()):
                assert time.monotonic() < deadline, "the deleting thread neither waited nor finished"
        return adapter_modules()

    monkeypatch.setattr(tuner, "_adapter_modules", paused_adapter_modules)
    out = logits(model, ids, adapter_names=names)
    deleter.join(DEADLINE)
    assert not deleter.is_alive() and not errors
    assert spy.contended.is_set(), "the delete did not wait for the mixed forward"
    assert torch.equal(out, expected)
    assert list(model.peft_config) == ["a"]


# ------------------------------------------------------------------------------------------ heads of a later adapter
def test_a_head_first_stored_whole_by_a_later_adapter_is_switched_and_served_in_mixed_batches():
    """The graft layers and heads are found once per set of adapters; they were found before peft wrapped the new
    adapter's head, so set_adapter never activated it and a mixed batch served every row with the active head."""
    pre, finetuned, _ = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, num_entries=30, exclude_parameters="classifier")
    model = get_peft_model(clone_model(pre), config).eval()
    headed = dict(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"], seed=3)
    model.add_adapter("headed", GraftConfig(**headed))
    alone = get_peft_model(clone_model(pre), GraftConfig(**headed)).eval()
    ids = input_ids(batch=2)
    model.set_adapter("headed")
    assert torch.equal(logits(model, ids), logits(alone, ids))
    mixed = logits(alone, ids, adapter_names=["default", "__base__"])
    torch.testing.assert_close(mixed[1:], logits(pre, ids[1:]), rtol=1e-5, atol=1e-6)
