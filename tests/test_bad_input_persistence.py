"""Issue 35, saving and loading: a save never writes a graft its own loader refuses (the folder it would replace is
left byte for byte), ``format_version`` outside the known range is refused, an older save without integrity fields
loads with a warning, a weights path that is a link which cannot be resolved is not taken for a Hub id; a merged
graft's task heads are checked at load (checksum, dtype, finiteness, readable metadata) and saved with the adapter in
one atomic save; a merge whose values would overflow is refused."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from testing_utils import clone_model, finetune_like, input_ids, make_bert_cls

from peft_graft import GraftConfig, GraftLayer
from peft_graft._checksum import state_checksum
from peft_graft.merging import HEADS_FILE, MergedGraft, merge_grafts
from peft_graft.parameter_layout import NO_ENTRIES


def folder_bytes(folder) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(folder)
        for name in names
    }


def first_layer(model) -> tuple[str, GraftLayer]:
    return next((n, m) for n, m in model.named_modules() if isinstance(m, GraftLayer) and m.has_region("default"))


def spoil_values(model, change) -> str:
    """Change the stored graft values of the first grafted layer in place (as a cast would); returns its name."""
    name, layer = first_layer(model)
    layer.unpack("default")  # loaded for inference: the values are views of a packed store
    layer.graft_values["default"].data = change(layer.graft_values["default"].data)
    return name.removeprefix("base_model.model.")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: t.to(torch.bfloat16), r"value dtype torch.bfloat16.*torch.bfloat16 \(a cast.*model.float\(\)"),
        (lambda t: t.to(torch.float16), r"value dtype torch.float16.*model.float\(\)"),
        (lambda t: t.to(torch.float64), r"value dtype torch.float64.*model.float\(\)"),
        (lambda t: torch.full_like(t, torch.nan), r"NaN or inf.*the graft in memory is corrupt"),
    ],
    ids=["bf16", "fp16", "fp64", "nan"],
)
def test_a_save_the_loader_would_refuse_is_refused_and_the_folder_kept(gpt2_pair, saved_gpt2, change, match):
    """Saved back into the folder it was loaded from: refused, the folder byte for byte as it was, still loadable."""
    pre = gpt2_pair[0]
    before = folder_bytes(saved_gpt2)
    model = PeftModel.from_pretrained(clone_model(pre), saved_gpt2)
    expected = model(input_ids()).logits
    module = spoil_values(model, change)
    with pytest.raises(
        ValueError, match=rf"save_pretrained\('{saved_gpt2}'\) refused: adapter 'default'.*{module}"
    ) as info:
        model.save_pretrained(saved_gpt2)
    assert "Nothing was written" in str(info.value)
    assert folder_bytes(saved_gpt2) == before
    assert not [n for n in os.listdir(saved_gpt2.parent) if n.startswith(".graft.") and "lock" not in n]
    assert torch.equal(PeftModel.from_pretrained(clone_model(pre), saved_gpt2)(input_ids()).logits, expected)


def test_a_sub_folder_adapter_is_checked_too(gpt2_pair, tmp_path):
    pre, finetuned, task_type = gpt2_pair
    config = GraftConfig(finetuned=finetuned, sparsity=0.02, task_type=task_type)
    model = get_peft_model(clone_model(pre), config, adapter_name="task")
    layer = next(m for m in model.modules() if isinstance(m, GraftLayer) and m.has_region("task"))
    layer.graft_values["task"].data = layer.graft_values["task"].data.half()
    with pytest.raises(ValueError, match=r"adapter 'task' would be saved.*float16"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "task").exists()


def test_a_graft_without_entries_is_refused_at_save_with_why(gpt2_pair, saved_gpt2):
    """A learned region kept empty (the sign test kept region='empty') makes a graft peft cannot load (no target
    module): the save says so and how to fix it, and the folder keeps its graft."""
    pre, finetuned, task_type = gpt2_pair
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, region="empty", learn_region=True,
                                                         task_type=task_type))  # fmt: skip
    model.base_model.harden_region("default", entries={})
    before = folder_bytes(saved_gpt2)
    with pytest.raises(ValueError, match=r"Nothing was written.*has no entries.*targets no module.*region='movement'"):
        model.save_pretrained(saved_gpt2)
    assert folder_bytes(saved_gpt2) == before


def test_a_checkpoint_of_a_region_leaving_a_module_with_exact_entries_saves_and_loads(tmp_path):
    """A region being learned that leaves a module of gamma_base holding an exact entry (theta_ft stored whole) is
    saved as its hard mask alone: the module's gamma_base tensors are not written beside it (they were, and the
    loader's check refused the MaskTrainer checkpoint)."""
    torch.manual_seed(0)
    pre = make_bert_cls()
    finetuned = finetune_like(pre)
    module = "bert.encoder.layer.0.intermediate.dense"
    with torch.no_grad():  # an entry no fp32 delta reaches: 1e8 + (1e-8 - 1e8) == 0, not 1e-8
        pre.get_submodule(module).weight[0, 0] = 1e8
        finetuned.get_submodule(module).weight[0, 0] = 1e-8
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=8, learn_region=True,
                                                         task_type="SEQ_CLS"))  # fmt: skip
    layer = model.base_model.model.get_submodule(module)
    assert layer.exact_entries("default")[0].numel() == 1  # gamma_base holds it, stored exactly
    for name, learner in model.base_model.region_learners("default").items():  # as MaskTrainer.hard_mask sets it
        learner.hard = NO_ENTRIES if name == module else learner.harden()  # the region leaves that module
    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert module not in config["grafted_modules"] and config["grafted_modules"]
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "ckpt").eval()
    assert not isinstance(loaded.base_model.model.get_submodule(module), GraftLayer)
    with torch.no_grad():  # the hard mask the checkpoint holds
        assert torch.equal(loaded(input_ids()).logits, model.eval()(input_ids()).logits)


def edit_config(folder, **fields) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("version", [99, 2, -1, "x", 1.0, True])
@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_a_format_version_outside_the_known_range_is_refused(gpt2_pair, saved_gpt2, version, loader):
    edit_config(saved_gpt2, format_version=version)
    load = {"peft": lambda: PeftModel.from_pretrained(clone_model(gpt2_pair[0]), saved_gpt2),
            "transformers": lambda: clone_model(gpt2_pair[0]).load_adapter(str(saved_gpt2))}[loader]  # fmt: skip
    path = str(saved_gpt2 / "adapter_config.json")
    with pytest.raises(ValueError, match=rf"'{path}' has format_version={version!r}.*reads formats 0 and 1"):
        load()


def test_format_version_0_without_integrity_fields_loads_with_a_warning(gpt2_pair, saved_gpt2, caplog):
    """With every integrity field present the checks run and nothing is logged; without them it loads, logged."""
    pre = gpt2_pair[0]
    expected = PeftModel.from_pretrained(clone_model(pre), saved_gpt2)(input_ids()).logits
    config = json.loads((saved_gpt2 / "adapter_config.json").read_text())
    config["format_version"] = 0
    (saved_gpt2 / "adapter_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="peft_graft"):
        PeftModel.from_pretrained(clone_model(pre), saved_gpt2)
    assert not [r for r in caplog.records if "integrity could not be checked" in r.getMessage()]
    for field in ("weights_checksum", "base_fingerprint"):
        del config[field]
    (saved_gpt2 / "adapter_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="peft_graft"):
        loaded = PeftModel.from_pretrained(clone_model(pre), saved_gpt2)
    assert torch.equal(loaded(input_ids()).logits, expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "format_version" in r.msg]
    assert warnings, caplog.text
    assert str(saved_gpt2 / "adapter_config.json") in warnings[0]
    assert "integrity could not be checked" in warnings[0] and "weights_checksum" in warnings[0]


def _weights_loop(folder):
    weights = folder / "adapter_model.safetensors"
    weights.unlink()
    os.symlink(weights, weights)
    return weights


def _folder_loop(folder):
    link = folder.parent / "loop"
    os.symlink(link, link)
    return link


def _dangling_folder(folder):
    link = folder.parent / "moved"
    os.symlink(folder.parent / "gone", link)
    return link


@pytest.mark.parametrize("make", [_weights_loop, _folder_loop, _dangling_folder])
@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_a_link_that_cannot_be_resolved_is_not_taken_for_a_hub_id(gpt2_pair, saved_gpt2, make, loader):
    link = make(saved_gpt2)
    folder = saved_gpt2 if link.name == "adapter_model.safetensors" else link
    load = {"peft": lambda: PeftModel.from_pretrained(clone_model(gpt2_pair[0]), str(folder)),
            "transformers": lambda: clone_model(gpt2_pair[0]).load_adapter(str(folder))}[loader]  # fmt: skip
    with pytest.raises(ValueError, match=rf"'{link}' is a symbolic link that cannot be resolved"):
        load()


# ------------------------------------------------------------------------------------------------- merged grafts
@pytest.fixture(scope="module")
def merge_base():
    torch.manual_seed(0)
    return make_bert_cls().eval()


def two_tasks(pre) -> PeftModel:
    model = None
    for seed, task in enumerate(("x", "y"), 1):
        config = GraftConfig(finetuned=finetune_like(pre, scale=0.01 * seed, seed=seed), sparsity=0.3, region="random",
                             seed=seed, modules_to_save=["classifier"], task_type="SEQ_CLS")  # fmt: skip
        if model is None:
            model = get_peft_model(clone_model(pre), config, adapter_name=task)
        else:
            model.add_adapter(task, config)
    return model


@pytest.fixture
def merged_folder(merge_base, tmp_path):
    merged = merge_grafts(two_tasks(merge_base), ["x", "y"], "stitch")
    folder = merged.save_pretrained(tmp_path / "saved")
    merged.use_task("y")
    return folder, merged.model(input_ids()).logits


def rewrite_heads(folder, change, keep_checksum: bool) -> None:
    """Rewrite the heads file with ``change(tensors, metadata)`` applied; its checksum kept as it was, or recomputed
    (as by a tool that writes a consistent file)."""
    path = str(folder / HEADS_FILE)
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    change(tensors, metadata)
    if not keep_checksum:
        metadata["checksum"] = state_checksum(tensors, metadata)
    save_file(tensors, path, metadata=metadata)


def _first_head(change):
    def edit(tensors, metadata):
        key = sorted(tensors)[0]
        tensors[key] = change(tensors[key])

    return edit


TAMPERED = {
    "NaN head": (_first_head(lambda t: torch.full_like(t, torch.nan)), False, r"head tensor 'x/.*' holds NaN or inf"),
    "int64 head": (_first_head(lambda t: t.to(torch.int64)), False, r"head tensor 'x/.*' is torch.int64, not floating"),
    "+0.5": (_first_head(lambda t: t + 0.5), True, "does not match the checksum it records"),
    "no checksum": (lambda tensors, metadata: metadata.pop("checksum"), True, "records no checksum"),
    "non-JSON tasks": (lambda tensors, metadata: metadata.update(tasks="[a, b"), False, "metadata is not JSON"),
    "non-JSON options": (lambda tensors, metadata: metadata.update(options="{"), False, "metadata is not JSON"),
    "tasks not a list": (lambda tensors, metadata: metadata.update(tasks='{"a": 1}'), False, "must be a list"),
}


@pytest.mark.parametrize("tampered", list(TAMPERED))
def test_a_tampered_heads_file_is_refused_naming_it(merge_base, merged_folder, tampered):
    folder, _ = merged_folder
    change, keep_checksum, match = TAMPERED[tampered]
    rewrite_heads(folder, change, keep_checksum)
    with pytest.raises(ValueError, match=rf"'{folder / HEADS_FILE}'.*{match}"):
        MergedGraft.from_pretrained(clone_model(merge_base), folder)


def test_a_truncated_heads_file_is_refused_naming_it(merge_base, merged_folder):
    folder, _ = merged_folder
    path = folder / HEADS_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"'{path}' is truncated or corrupt"):
        MergedGraft.from_pretrained(clone_model(merge_base), folder)


def test_a_refused_merged_save_leaves_adapter_and_heads_as_they_were(merge_base, merged_folder):
    """The heads move into place with the adapter's files, in one save: a refused save changes neither."""
    folder, logits = merged_folder
    before = folder_bytes(folder.parent)
    again = MergedGraft.from_pretrained(clone_model(merge_base), folder)
    again.heads["x"] = {name: tensor + 1.0 for name, tensor in again.heads["x"].items()}
    layer = next(m for m in again.model.modules() if isinstance(m, GraftLayer) and m.has_region("merged"))
    layer.unpack("merged")
    layer.graft_values["merged"].data = layer.graft_values["merged"].data.bfloat16()
    with pytest.raises(ValueError, match="adapter 'merged' would be saved"):
        again.save_pretrained(folder.parent)
    assert folder_bytes(folder.parent) == before
    reloaded = MergedGraft.from_pretrained(clone_model(merge_base), folder)
    reloaded.use_task("y")
    assert torch.equal(reloaded.model(input_ids()).logits, logits)


@pytest.mark.parametrize("spoil", ["nan", "int64"])
def test_heads_its_loader_would_refuse_are_not_saved(merge_base, merged_folder, spoil):
    """A merged graft whose heads in memory hold NaN or integers is refused at save, before anything is replaced."""
    folder, _ = merged_folder
    before = folder_bytes(folder.parent)
    again = MergedGraft.from_pretrained(clone_model(merge_base), folder)
    change = {"nan": lambda t: t * float("nan"), "int64": lambda t: t.long()}[spoil]
    again.heads["x"] = {name: change(tensor) for name, tensor in again.heads["x"].items()}
    with pytest.raises(ValueError, match=r"save_pretrained refused: the task heads .*Nothing was written"):
        again.save_pretrained(folder.parent)
    assert folder_bytes(folder.parent) == before


def test_merge_weights_beyond_a_half_precision_base_are_refused(merge_base):
    """Merged values finite in fp32 but beyond fp16's 65,504 would be inf in an fp16 model: refused as well, naming
    the dtype, and nothing is added (they were accepted: the float32 check alone let them through)."""
    model = two_tasks(merge_base.half())
    before = sorted(model.state_dict())
    with pytest.raises(
        ValueError,
        match=r"up to .* \(checked in torch.float16, which holds up to 6\.55e\+04\).*inf or NaN; use smaller",
    ):
        merge_grafts(model, ["x", "y"], "task_arithmetic", weights=1e8)
    assert sorted(model.state_dict()) == before and "merged" not in model.peft_config


@pytest.mark.parametrize(("rule", "extra"), [("task_arithmetic", {}), ("ties", {"density": 0.5})], ids=["ta", "ties"])
def test_huge_finite_merge_weights_are_refused(merge_base, rule, extra):
    model = two_tasks(merge_base)
    before = sorted(model.state_dict())
    with pytest.raises(ValueError, match=rf"rule '{rule}' with weights \[1e\+38, 1e\+38\] gives merged values of "
                                         r"\S+ up to .*inf or NaN; use smaller weights"):  # fmt: skip
        merge_grafts(model, ["x", "y"], rule, weights=1e38, **extra)
    assert sorted(model.state_dict()) == before and "merged" not in model.peft_config
    merged = merge_grafts(model, ["x", "y"], rule, weights=1.0, **extra)  # the ordinary size merges
    merged.use_task("x")
    assert torch.isfinite(model(input_ids()).logits).all()
