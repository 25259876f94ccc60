"""merge_grafts: every rule's entries equal its formula on hand-built task vectors, peft's merge functions reproduced
where reused, bad input refused with the model unchanged, per-task heads, save/load and merge round trips."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import merge_utils
from testing_utils import clone_model, finetune_like, input_ids, make_bert_cls

from peft_graft import GraftConfig, Region
from peft_graft.merging import MERGE_RULES, MergedGraft, merge_grafts
from peft_graft.parameter_layout import build_layout

TASKS = ("a", "b", "c")


@pytest.fixture(scope="module")
def pre():
    torch.manual_seed(0)
    return make_bert_cls().eval()


@pytest.fixture(scope="module")
def folders(pre, tmp_path_factory):
    """Three full grafts (every entry moved: dense task vectors, fine-tunes of seeds 1-3) and three sparse ones (30% of
    the entries, random regions: they overlap in part), each with its own head stored whole."""
    root = tmp_path_factory.mktemp("grafts")
    out = {}
    for seed, task in enumerate(TASKS, 1):
        finetuned = finetune_like(pre, scale=0.01 * seed, seed=seed)
        for kind, extra in (("full", dict(sparsity=1.0)), ("sparse", dict(sparsity=0.3, region="random", seed=seed))):
            config = GraftConfig(finetuned=finetuned, modules_to_save=["classifier"], task_type="SEQ_CLS", **extra)
            get_peft_model(clone_model(pre), config).save_pretrained(root / kind / task)
            out[kind, task] = str(root / kind / task)
    return out


def loaded(pre, folders, kind: str) -> PeftModel:
    model = PeftModel.from_pretrained(clone_model(pre), folders[kind, TASKS[0]], adapter_name=TASKS[0])
    for task in TASKS[1:]:
        model.load_adapter(folders[kind, task], task)
    return model


def task_vectors(model: PeftModel, adapters: list[str]) -> torch.Tensor:
    """The adapters' stored deltas as dense flat vectors over every stored entry, ``(len(adapters), n)``."""
    tuner = model.base_model
    layout = build_layout(tuner.model)
    rows = []
    for adapter in adapters:
        parts = []
        for module, layer in tuner.graft_layers().items():  # the order merge_grafts flattens in
            for attr in layer.stored_attrs:
                dense = torch.zeros(layout.by_site[(module, attr)].parameter.numel())
                if layer.has_region(adapter):  # its own tensors or packed (loaded for inference)
                    local, values = layer.sparse_entries(adapter, attr)
                    dense[local.long()] = values.detach()
                parts.append(dense)
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def top_mask(tau: torch.Tensor, density: float) -> torch.Tensor:
    keep = torch.zeros_like(tau, dtype=torch.bool)
    keep[tau.abs().argsort(descending=True)[: int(density * tau.numel())]] = True
    return keep


def state(model: PeftModel) -> dict:
    return {"adapters": list(model.peft_config), "keys": sorted(model.state_dict())}


def test_stitch_averages_where_regions_overlap(pre, folders):
    model = loaded(pre, folders, "sparse")
    merged = merge_grafts(model, list(TASKS), "stitch")
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    present = taus != 0
    expected = taus.sum(0) / present.sum(0).clamp(min=1)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=0)
    assert (present.sum(0) > 1).any()  # the regions overlap, so averaging is exercised
    assert merged.num_entries == int(present.any(0).sum())  # the union of the regions
    union = Region()
    for task in TASKS:
        union = union | model.base_model.get_region(task)
    assert model.base_model.get_region("merged") == union


def test_stitch_equals_add_combined_adapter_average(pre, folders):
    model = loaded(pre, folders, "sparse")
    merge_grafts(model, list(TASKS), "stitch")
    model.base_model.add_combined_adapter(list(TASKS), "combined", combination="average")
    assert torch.equal(task_vectors(model, ["merged"]), task_vectors(model, ["combined"]))


def test_stitch_dataless_keeps_each_tasks_top_entries(pre, folders):
    model = loaded(pre, folders, "full")
    merged = merge_grafts(model, list(TASKS), "stitch_dataless", density=0.1)
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    keep = torch.stack([top_mask(tau, 0.1) for tau in taus])
    expected = (taus * keep).sum(0) / keep.sum(0).clamp(min=1)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=0)
    assert merged.num_entries == int(keep.any(0).sum())


@pytest.mark.parametrize("weights", [0.4, [1.0, 0.5, -0.25]])
def test_task_arithmetic_is_the_weighted_sum_and_peft_s(pre, folders, weights):
    model = loaded(pre, folders, "full")
    merged = merge_grafts(model, list(TASKS), "task_arithmetic", weights=weights)
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    w = torch.tensor([weights] * 3 if isinstance(weights, float) else weights)
    torch.testing.assert_close(result, (w[:, None] * taus).sum(0), rtol=1e-6, atol=1e-9)
    assert torch.equal(result, merge_utils.task_arithmetic(list(taus), w))
    assert merged.num_entries == int((result != 0).sum())  # it stores what it changed: every moved entry


def test_ties_trims_elects_and_averages_the_agreeing(pre, folders):
    model = loaded(pre, folders, "full")
    merge_grafts(model, list(TASKS), "ties", weights=1.5, density=0.2)
    taus, result = task_vectors(model, list(TASKS)), task_vectors(model, ["merged"])[0]
    trimmed = torch.stack([tau * top_mask(tau, 0.2) for tau in taus])  # top 20% of each whole task vector
    elected = torch.where(trimmed.sum(0) >= 0, 1.0, -1.0)
    agree = trimmed.sign() == elected
    expected = 1.5 * (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-9)
    peft_result = merge_utils.ties(list(taus), torch.full((3,), 1.5), 0.2, "total")
    assert torch.equal(result, peft_result)
    # Per tensor (peft's use for LoRA) would keep 20% of every tensor: the global trim keeps other entries.
    assert result.count_nonzero() <= (trimmed != 0).any(0).sum()


@pytest.mark.parametrize("rule", ["dare_ties", "dare_linear"])
def test_dare_reproduces_peft_with_the_seed(pre, folders, rule):
    model = loaded(pre, folders, "full")
    merge_grafts(model, list(TASKS), rule, weights=[0.5, 1.0, 0.7], density=0.3, seed=7)
    merge_grafts(model, list(TASKS), rule, "again", weights=[0.5, 1.0, 0.7], density=0.3, seed=7)
    merge_grafts(model, list(TASKS), rule, "other_seed", weights=[0.5, 1.0, 0.7], density=0.3, seed=8)
    taus = task_vectors(model, list(TASKS))
    result, again, other = task_vectors(model, ["merged", "again", "other_seed"])
    torch.manual_seed(7)
    function = getattr(merge_utils, rule)
    args = (list(taus), torch.tensor([0.5, 1.0, 0.7]), 0.3) + (("total",) if rule == "dare_ties" else ())
    assert torch.equal(result, function(*args))
    assert torch.equal(result, again) and not torch.equal(result, other)
    if rule == "dare_linear":  # kept entries rescaled by 1 / density
        kept = torch.stack([torch.isclose(result, w * t / 0.3) for w, t in zip([0.5, 1.0, 0.7], taus, strict=True)])
        assert kept.any(0)[result != 0].float().mean() > 0.5


def test_each_task_keeps_its_head_and_a_single_graft_merges_to_itself(pre, folders):
    model = loaded(pre, folders, "sparse")
    merged = merge_grafts(model, list(TASKS), "stitch")
    for task in TASKS:
        merged.use_task(task)
        head = model.base_model.model.classifier.modules_to_save
        assert torch.equal(head["merged"].weight, head[task].weight)
        assert model.active_adapter == "merged"
    single = merge_grafts(model, {"a": "a"}, "stitch", "only_a")
    single.use_task("a")
    ids = input_ids()
    out = model(ids).logits
    model.set_adapter("a")
    assert torch.equal(out, model(ids).logits)  # exact entries included: bit for bit the graft itself


def test_exclude_drops_the_overlap(pre, folders):
    model = loaded(pre, folders, "sparse")
    regions = {task: model.base_model.get_region(task) for task in TASKS}
    overlap = (regions["a"] & regions["b"]) | (regions["a"] & regions["c"]) | (regions["b"] & regions["c"])
    merge_grafts(model, list(TASKS), "stitch", exclude=overlap)
    merge_grafts(model, list(TASKS), "stitch", "with_overlap")
    without = model.base_model.get_region("merged")
    assert without == model.base_model.get_region("with_overlap") - overlap and overlap.num_entries > 0
    assert (without & overlap).num_entries == 0


def test_save_load_merge_round_trip(pre, folders, tmp_path):
    model = PeftModel.from_pretrained(clone_model(pre), folders["sparse", "a"], adapter_name="a")
    sources = {task: folders["sparse", task] for task in TASKS[1:]} | {"a": "a"}  # folders and a loaded adapter
    merged = merge_grafts(model, sources, "ties", "ties_merged", density=0.5, weights=0.8)
    ids = input_ids()
    outputs = {}
    for task in TASKS:
        merged.use_task(task)
        outputs[task] = model(ids).logits
    assert not torch.equal(outputs["a"], outputs["b"])  # the heads differ
    folder = merged.save_pretrained(tmp_path / "saved")
    again = MergedGraft.from_pretrained(clone_model(pre), folder, adapter_name="ties_merged")
    assert again.rule == "ties" and again.tasks == ["b", "c", "a"] and again.options["density"] == 0.5
    assert again.nbytes == merged.nbytes and again.num_entries == merged.num_entries
    for task in TASKS:
        again.use_task(task)
        assert torch.equal(again.model(ids).logits, outputs[task])
    again.use_task("c")
    plain = again.model.merge_and_unload()  # merges like any graft
    torch.testing.assert_close(plain(ids).logits, outputs["c"], rtol=1e-5, atol=1e-6)


def test_storage_counts_indices_values_and_heads(pre, folders):
    model = loaded(pre, folders, "full")
    stitched = merge_grafts(model, list(TASKS), "stitch_dataless", density=0.05)
    dense = merge_grafts(model, list(TASKS), "task_arithmetic", "ta", weights=0.3)
    head = sum(p.numel() * 4 for p in pre.classifier.parameters())
    for merged in (stitched, dense):
        assert merged.nbytes["heads"] == 3 * head
        assert merged.nbytes["body"] >= merged.num_entries * 8  # an index and an fp32 value per entry
    assert stitched.nbytes["body"] < dense.nbytes["body"] / 3


@pytest.fixture(scope="module")
def odd_folders(pre, tmp_path_factory):
    """A graft of another base model (same architecture), and one without a head."""
    root = tmp_path_factory.mktemp("odd")
    other = finetune_like(pre, scale=0.1, seed=11)
    config = GraftConfig(finetuned=finetune_like(other, seed=12), sparsity=0.3, modules_to_save=["classifier"])
    get_peft_model(clone_model(other), config).save_pretrained(root / "other_base")
    config = GraftConfig(finetuned=finetune_like(pre, seed=13), sparsity=0.3, exclude_parameters="classifier")
    get_peft_model(clone_model(pre), config).save_pretrained(root / "no_head")
    config = GraftConfig(finetuned=finetune_like(pre, seed=14), sparsity=0.3)  # grafts the head's entries
    get_peft_model(clone_model(pre), config).save_pretrained(root / "head_grafted")
    return {name: str(root / name) for name in ("other_base", "no_head", "head_grafted")}


@pytest.fixture(scope="module")
def shared(pre, folders):
    """One model for every refused call: each must leave it as it was."""
    return loaded(pre, folders, "sparse")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, f: merge_grafts(m, [], "stitch"), "grafts is empty"),
        (lambda m, f: merge_grafts(m, {}, "stitch"), "grafts is empty"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "average"), "Unknown rule 'average'"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "ties"), "needs density in"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "ties", density=0.0), "needs density in"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "dare_linear", density=1.5), "needs density in"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "stitch", density=0.5), "takes no density"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "stitch", weights=0.5), "takes no weights"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "task_arithmetic", weights=[1.0]), "one per graft"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "task_arithmetic", weights=[1.0, float("nan")]), "finite"),
        (lambda m, f: merge_grafts(m, ["a", "b"], "stitch", adapter_name="a"), "already exists"),
        (lambda m, f: merge_grafts(m, ["a", "nope"], "stitch"), "could not load the graft 'nope'"),
        (lambda m, f: merge_grafts(m, {"a": "a", "x": f["other_base"]}, "stitch"), "'x'.*different base model"),
        (lambda m, f: merge_grafts(m, {"a": "a", "y": f["no_head"]}, "stitch"), "'y'.*lack tensor.*classifier"),
        (lambda m, f: merge_grafts(m, {"a": "a", "h": f["head_grafted"]}, "stitch"), "'h'.*stores 'classifier' whole"),
        (lambda m, f: merge_grafts(m, {"a": "a", "z": f["sparse", "c"]}, "ties", density=2.0), "needs density"),
        (lambda m, f: merge_grafts(m.base_model.model, ["a"], "stitch"), "PeftModel of the graft method"),
    ],
)
def test_bad_input_is_refused_and_nothing_changes(shared, folders, odd_folders, call, match):
    extra, model = {**odd_folders, **folders}, shared
    before, ids = state(model), input_ids()
    model.set_adapter("b")
    out = model(ids).logits
    with pytest.raises((ValueError, TypeError), match=match):
        call(model, extra)
    assert state(model) == before  # the adapters loaded for the call are gone again
    assert torch.equal(model(ids).logits, out) and model.active_adapter == "b"


def test_grafts_with_other_heads_are_refused(pre):
    config = GraftConfig(finetuned=finetune_like(pre, seed=4), sparsity=0.3, modules_to_save=["classifier"])
    model = get_peft_model(clone_model(pre), config, adapter_name="a")  # no task type: heads only as configured
    config = GraftConfig(finetuned=finetune_like(pre, seed=5), sparsity=0.3, exclude_parameters="classifier")
    model.add_adapter("no_head", config)
    with pytest.raises(ValueError, match=r"'no_head'.*another layout.*are \[\], graft 'a'"):
        merge_grafts(model, ["a", "no_head"], "stitch")
    assert "merged" not in model.peft_config


def test_a_region_still_being_learned_is_refused(pre, folders):
    model = loaded(pre, folders, "sparse")
    config = GraftConfig(finetuned=finetune_like(pre, seed=5), sparsity=0.3, learn_region=True,
                         modules_to_save=["classifier"], task_type="SEQ_CLS")  # fmt: skip
    model.add_adapter("learning", config)
    with pytest.raises(ValueError, match=r"'learning'.*still learning its region"):
        merge_grafts(model, ["a", "learning"], "stitch")
    assert "merged" not in model.peft_config


def test_every_rule_is_listed():
    assert set(MERGE_RULES) == {"stitch", "stitch_dataless", "task_arithmetic", "ties", "dare_ties", "dare_linear",
                                "consensus_ta", "consensus_ties", "wudi", "wudi_adam", "regmean"}  # fmt: skip
