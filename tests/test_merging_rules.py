"""The newer merge rules and merge machinery: WUDI, RegMean and LiNeS in merge_grafts against their formulas on
hand-built task vectors, the stitch's scale, task-vector norms per layer type, the stacked task vectors built once for
many merges (identical results, a changed graft refused), input Gram matrices, and issue 60's refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import merge_utils
from safetensors import safe_open
from safetensors.torch import save_file
from test_merging import TASKS, folders, loaded, pre, state, task_vectors  # noqa: F401  (fixtures)
from testing_utils import clone_model, finetune_like, input_ids

from peft_graft import GraftConfig, Region, merge_rules, merging
from peft_graft.input_statistics import input_grams, linear_layers
from peft_graft.merge_rules import block_index, layer_type, lines_scales, reduce_off_diagonal, wudi_closed_form
from peft_graft.merging import HEADS_FILE, MergedGraft, TaskVectorStack, merge_grafts, task_vector_norms
from peft_graft.parameter_layout import build_layout, exact_positions
from peft_graft.tuner.layer import GraftLayer
from peft_graft.tuner.model import _exact_after_combining


def per_tensor(model: PeftModel, adapters: list[str]) -> dict[str, torch.Tensor]:
    """``(len(adapters), *shape)`` task vectors per stored tensor name."""
    flat = task_vectors(model, adapters)
    out, offset = {}, 0
    layout = build_layout(model.base_model.model)
    for module, layer in model.base_model.graft_layers().items():
        for attr in layer.stored_attrs:
            parameter = layout.by_site[(module, attr)].parameter
            out[f"{module}.{attr}"] = flat[:, offset : offset + parameter.numel()].reshape(
                len(adapters), *parameter.shape
            )
            offset += parameter.numel()
    return out


def test_wudi_is_the_closed_form_on_matrices_and_the_mean_elsewhere(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "sparse")  # sparse regions: tasks hold different entries of each matrix
    merged = merge_grafts(model, list(TASKS), "wudi")
    taus, result = per_tensor(model, list(TASKS)), per_tensor(model, ["merged"])
    for name, stacked in taus.items():
        if stacked.dim() == 3:
            a = sum(t.T.double() @ t.double() / t.double().square().sum() for t in stacked)
            b = sum(t.double() @ t.T.double() @ t.double() / t.double().square().sum() for t in stacked)
            torch.testing.assert_close((result[name][0].double() @ a), b, rtol=1e-4, atol=1e-9)  # X A = B
            torch.testing.assert_close(result[name][0], wudi_closed_form(stacked), rtol=0, atol=0)
        else:
            torch.testing.assert_close(result[name][0], stacked.mean(0), rtol=1e-6, atol=1e-9)
    assert merged.options == {"weights": None, "density": None, "majority_sign_method": "total", "seed": 0}


def test_wudi_closed_form_keeps_the_start_off_the_span():
    """Rank-deficient task vectors: the solution is the minimiser nearest the reference's start (sum of the taus)."""
    torch.manual_seed(0)
    taus = torch.randn(2, 6, 1) @ torch.randn(2, 1, 5)  # two rank-1 matrices: A has rank 2 of 5
    merged = wudi_closed_form(taus)
    a = sum(t.T @ t / t.square().sum() for t in taus)
    b = sum(t @ t.T @ t / t.square().sum() for t in taus)
    torch.testing.assert_close(merged @ a, b, rtol=1e-4, atol=1e-6)
    eigenvalues, vectors = torch.linalg.eigh(a.double())
    null = vectors[:, eigenvalues < 1e-9].float()
    torch.testing.assert_close(merged @ null, taus.sum(0) @ null, rtol=1e-4, atol=1e-6)


def test_regmean_is_the_closed_form_with_reduced_off_diagonals(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "full")
    torch.manual_seed(1)
    layers = linear_layers(model)
    grams = {}
    for task in TASKS:
        grams[task] = {}
        for name, layer in layers.items():
            x = torch.randn(40, layer.base_layer.in_features)
            grams[task][name] = x.T @ x / 40
    merge_grafts(model, list(TASKS), "regmean", grams=grams, regmean_alpha=0.5)
    taus, result = per_tensor(model, list(TASKS)), per_tensor(model, ["merged"])
    for name, stacked in taus.items():
        module, attr = name.rsplit(".", 1)
        if module in layers and attr == "weight":
            g = [reduce_off_diagonal(grams[t][module], 0.5).double() for t in TASKS]
            expected = torch.linalg.inv(sum(g)) @ sum(gi @ t.T.double() for gi, t in zip(g, stacked, strict=True))
            torch.testing.assert_close(result[name][0].double(), expected.T, rtol=1e-4, atol=1e-8)
        else:  # biases, LayerNorm, embeddings: the mean
            torch.testing.assert_close(result[name][0], stacked.mean(0), rtol=1e-6, atol=1e-9)
    gram = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
    assert torch.equal(reduce_off_diagonal(gram, 0.5), torch.tensor([[2.0, 0.5], [0.5, 3.0]]))


def test_input_grams_are_the_mean_outer_products_of_each_linear_input(pre):  # noqa: F811
    model = clone_model(pre)
    seen = {}
    handle = model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(
        lambda m, i, o: seen.setdefault("x", []).append(i[0].reshape(-1, i[0].shape[-1]))
    )
    batches = [{"input_ids": input_ids(3, 5, seed=s)} for s in range(4)]
    grams = input_grams(model, batches, max_examples=5)  # 3 + 3 examples: the third batch is not run
    handle.remove()
    x = torch.cat(seen["x"])
    assert x.shape[0] == 2 * 3 * 5
    torch.testing.assert_close(grams["bert.encoder.layer.0.intermediate.dense"], x.T @ x / x.shape[0])
    assert "classifier" in grams and "bert.pooler.dense" in grams
    model.train()  # dropout off while collecting, each module's mode given back after
    assert torch.equal(input_grams(model, batches[:1])["classifier"], input_grams(model, batches[:1])["classifier"])
    assert all(module.training for module in model.modules())
    with pytest.raises(ValueError, match="max_examples must be a positive int"):
        input_grams(model, batches, max_examples=0)


@pytest.mark.parametrize("rule", ["task_arithmetic", "ties", "consensus_ta", "consensus_ties"])
def test_lines_scales_the_merged_vector_by_depth(pre, folders, rule):  # noqa: F811
    model = loaded(pre, folders, "full")
    options = dict(weights=0.5) | (dict(density=0.3) if "ties" in rule else {})
    merge_grafts(model, list(TASKS), rule, "plain", **options)
    merge_grafts(model, list(TASKS), rule, "lines", lines=(0.4, 0.6), **options)
    plain, scaled = per_tensor(model, ["plain"]), per_tensor(model, ["lines"])
    for name in plain:
        block = block_index(name)
        factor = 0.4 + (0.6 * block if block is not None else 0.0)  # two blocks: 0 -> alpha, 1 -> alpha + beta
        torch.testing.assert_close(scaled[name], plain[name] * factor, rtol=1e-6, atol=0)
    assert lines_scales(["e", "x.0.a", "x.3.b", "x.6.c"], 1.0, 0.6) == {"e": 1.0, "x.0.a": 1.0, "x.3.b": 1.3,
                                                                        "x.6.c": 1.6}  # fmt: skip


def test_stitch_with_a_scale(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    merge_grafts(model, list(TASKS), "stitch")
    merged = merge_grafts(model, list(TASKS), "stitch", "scaled", scale=1.5)
    plain, scaled = task_vectors(model, ["merged", "scaled"])
    torch.testing.assert_close(scaled, 1.5 * plain, rtol=1e-6, atol=0)
    assert merged.options["scale"] == 1.5 and merged.num_entries == int((plain != 0).sum())


def test_task_vector_norms_per_task_and_layer_type(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "full")
    norms = task_vector_norms(model, list(TASKS))
    taus = per_tensor(model, list(TASKS))
    for row, task in enumerate(TASKS):
        assert norms[task]["total"] == pytest.approx(float(task_vectors(model, [task])[0].double().norm()), rel=1e-6)
        query = sum(taus[n][row].double().square().sum() for n in taus if n.endswith("self.query.weight"))
        assert norms[task]["bert.encoder.layer.attention.self.query.weight"] == pytest.approx(float(query.sqrt()))
    assert norms["c"]["total"] > 2.5 * norms["a"]["total"]  # fine-tunes of scales 0.01 and 0.03
    assert layer_type("bert.encoder.layer.11.output.dense.weight") == "bert.encoder.layer.output.dense.weight"


def test_tensor_rules_never_hold_an_excluded_entry(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "full")
    layout = build_layout(model.base_model.model)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    exclude = Region({name: torch.arange(0, 1024, 3)})
    merge_grafts(model, list(TASKS), "wudi", exclude=exclude)
    merge_grafts(model, list(TASKS), "wudi", "all")
    held = model.base_model.get_region("merged")
    assert not torch.isin(exclude[name], held[name]).any()  # excluded: never merged
    assert held[name].numel() == layout.tensors[name].parameter.numel() - exclude[name].numel()
    assert model.base_model.get_region("all")[name].numel() == layout.tensors[name].parameter.numel()


@pytest.mark.parametrize(("rule", "options"), [("ties", dict(weights=0.7, density=0.3)), ("wudi", {}),
                                               ("dare_linear", dict(weights=0.5, density=0.5, seed=3))])  # fmt: skip
def test_a_stack_built_once_gives_identical_merges(pre, folders, rule, options):  # noqa: F811
    model = loaded(pre, folders, "full")
    stack = TaskVectorStack(model, list(TASKS))
    merge_grafts(model, list(TASKS), rule, "fresh", **options)
    merge_grafts(model, list(TASKS), rule, "stacked", stack=stack, **options)
    merge_grafts(model, list(TASKS), rule, "again", stack=stack, **options)
    fresh, stacked, again = task_vectors(model, ["fresh", "stacked", "again"])
    assert torch.equal(fresh, stacked) and torch.equal(fresh, again)


def test_a_grid_through_one_stack_equals_peft_at_every_setting(pre, folders, monkeypatch):  # noqa: F811
    """The stack trims once per density (and seed, sign method, Consensus setting) and reuses it across weights; every
    merge of a grid still equals peft's function on the whole task vectors, also after older trims were dropped."""
    monkeypatch.setattr(TaskVectorStack, "TRIMS_KEPT", 2)
    calls = []
    monkeypatch.setattr(merging, "trim", lambda *args: calls.append(args[1:]) or merge_rules.trim(*args))
    model = loaded(pre, folders, "full")
    stack = TaskVectorStack(model, list(TASKS))
    taus = task_vectors(model, list(TASKS))
    masked = {}
    for tall_lambda in (0.3, 0.6):
        votes = sum((t.abs() > tall_lambda * (taus.sum(0) - t).abs()).long() for t in taus)
        masked[tall_lambda] = [torch.where(votes >= 2, t, 0.0) for t in taus]
    grid = [(rule, dict(weights=w, density=d, **extra)) for rule, extra in
            [("ties", {}), ("ties", dict(majority_sign_method="frequency")), ("dare_ties", dict(seed=5)),
             ("dare_linear", dict(seed=5)), ("consensus_ties", dict(tall_lambda=0.3)),
             ("consensus_ties", dict(tall_lambda=0.6))]
            for d in (0.2, 1.0) for w in (0.5, [1.5, 1.0, 0.25])]  # fmt: skip
    grid += [("consensus_ta", dict(weights=w, tall_lambda=t)) for t in (0.3, 0.6) for w in (0.5, 1.5)]
    for i, (rule, options) in enumerate(grid + grid[:4]):  # grid[:4] again: its trims were dropped since
        merge_grafts(model, list(TASKS), rule, "m", stack=stack, **options)
        result = task_vectors(model, ["m"])[0]
        model.delete_adapter("m")
        weights = torch.tensor(options["weights"] if isinstance(options["weights"], list) else [options["weights"]] * 3)
        vectors = masked[options["tall_lambda"]] if "tall_lambda" in options else list(taus)
        torch.manual_seed(options.get("seed", 0))
        if rule == "consensus_ta":
            expected = merge_utils.task_arithmetic(vectors, weights)
        elif rule == "dare_linear":
            expected = merge_utils.dare_linear(vectors, weights, options["density"])
        else:
            function = merge_utils.dare_ties if rule == "dare_ties" else merge_utils.ties
            method = options.get("majority_sign_method", "total")
            expected = function(vectors, weights, options["density"], method)
        assert torch.equal(result, expected * (expected != 0)), (i, rule, options)
    assert len(stack._trims) == 2
    assert len(calls) == 14 + 2  # once per setting (14: not per weight), and the 2 dropped ones again


def test_a_merge_without_a_stack_records_no_checksums_for_later(pre, folders, monkeypatch):  # noqa: F811
    """merge_grafts' own stack serves one merge: the checksums a reused stack compares are not computed for it (they
    cost a pass over every graft's entries), and the base is still checked against each graft's theta_pre."""
    model = loaded(pre, folders, "full")
    calls = []
    monkeypatch.setattr(merging, "_digest", lambda *args: calls.append(args) or "x")
    merge_grafts(model, list(TASKS), "ties", weights=1.0, density=0.5)
    task_vector_norms(model, list(TASKS))
    assert calls == []
    TaskVectorStack(model, list(TASKS))
    assert len(calls) == len(TASKS) * len(model.base_model.graft_layers())


def test_a_changed_graft_is_not_served_from_a_stale_stack(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    stack = TaskVectorStack(model, list(TASKS))
    merge_grafts(model, list(TASKS), "stitch", "before", stack=stack)
    model.set_adapter("b")
    with torch.no_grad():
        model(input_ids())  # a forward unpacks the loaded (packed) adapter: held anew, the same entries
    merge_grafts(model, list(TASKS), "stitch", "unpacked", stack=stack)  # accepted: its entries did not change
    assert torch.equal(*task_vectors(model, ["before", "unpacked"]))
    layer = next(iter(model.base_model.graft_layers().values()))
    layer.unpack("b")
    with torch.no_grad():
        layer.graft_values["b"].mul_(2.0)  # written in place
    with pytest.raises(ValueError, match=r"Graft 'b' \(task 'b'\) changed in .* stale"):
        merge_grafts(model, list(TASKS), "stitch", "after", stack=stack)
    assert "after" not in model.peft_config
    stack = TaskVectorStack(model, list(TASKS))
    model.delete_adapter("c")  # deleted and loaded again, from another graft
    model.load_adapter(folders["full", "c"], "c")
    with pytest.raises(ValueError, match=r"Graft 'c' \(task 'c'\) changed"):
        merge_grafts(model, list(TASKS), "stitch", "after", stack=stack)
    fresh = TaskVectorStack(model, list(TASKS))
    merge_grafts(model, list(TASKS), "stitch", "after", stack=fresh)
    merge_grafts(model, list(TASKS), "stitch", "unstacked")
    assert torch.equal(*task_vectors(model, ["after", "unstacked"]))
    with pytest.raises(ValueError, match="holds the grafts"):
        merge_grafts(model, ["a", "b"], "stitch", "other", stack=fresh)
    with pytest.raises(ValueError, match="another exclude"):
        merge_grafts(model, list(TASKS), "stitch", "other", stack=fresh, exclude=Region())
    with pytest.raises(ValueError, match="holds the grafts"):  # its rows are in build order: weights would swap
        merge_grafts(model, list(reversed(TASKS)), "stitch", "other", stack=fresh)


def test_a_stack_sees_values_written_through_data(pre, folders):  # noqa: F811
    """A write through ``.data`` moves no version counter: the stack compares the entries on every merge."""
    model = loaded(pre, folders, "sparse")
    stack = TaskVectorStack(model, list(TASKS))
    layer = next(iter(model.base_model.graft_layers().values()))
    layer.unpack("b")
    merge_grafts(model, list(TASKS), "stitch", "before", stack=stack)
    version = layer.graft_values["b"]._version
    layer.graft_values["b"].data.mul_(2.0)
    assert layer.graft_values["b"]._version == version
    with pytest.raises(ValueError, match=r"Graft 'b' \(task 'b'\) changed in .* stale"):
        merge_grafts(model, list(TASKS), "stitch", "after", stack=stack)
    layer.graft_values["b"].data.div_(2.0)
    merge_grafts(model, list(TASKS), "stitch", "restored", stack=stack)
    indices = layer.graft_indices["b"]
    indices.data[-1] += 1 if int(indices[-1]) + 1 < layer.num_stored else -1  # an index, in its own dtype
    with pytest.raises(ValueError, match=r"Graft 'b' \(task 'b'\) changed in .* stale"):
        merge_grafts(model, list(TASKS), "stitch", "after", stack=stack)


def test_a_stack_sees_the_base_model_changed_at_the_grafts_entries(pre, folders):  # noqa: F811
    """The base is checked against each graft's theta_pre when the stack is built, and for changes on every merge."""
    model = loaded(pre, folders, "sparse")
    stack = TaskVectorStack(model, list(TASKS))
    module, layer = next(iter(model.base_model.graft_layers().items()))
    attr, local, _ = next(iter(layer.space.split(layer.entries("a")[0])))
    base = getattr(layer.base_layer, attr)
    original = base.data.view(-1)[local[0]].clone()
    with torch.no_grad():
        base.data.view(-1)[local[0]] += 1.0  # through .data: no version counter moves
    with pytest.raises(ValueError, match=f"base model's values at the grafts' entries of '{module}' changed"):
        merge_grafts(model, list(TASKS), "stitch", "after", stack=stack)
    with pytest.raises(ValueError, match="made from a different base model"):  # what a fresh stack or merge says
        TaskVectorStack(model, list(TASKS))
    with torch.no_grad():
        base.data.view(-1)[local[0]] = original
    merge_grafts(model, list(TASKS), "stitch", "restored", stack=stack)


def test_a_stack_sees_a_graft_recording_another_theta_pre(pre, folders, tmp_path):  # noqa: F811
    """A graft deleted and loaded again with the same entries but another recorded theta_pre (from another base) is
    refused, as a merge without the stack refuses it: the stack checks the base against the records only when built."""
    model = loaded(pre, folders, "sparse")
    stack = TaskVectorStack(model, list(TASKS))
    module = next(iter(model.peft_config["c"].base_checksum))
    shutil.copytree(folders["sparse", "c"], tmp_path / "c")
    config = json.loads((tmp_path / "c" / "adapter_config.json").read_text())
    config["base_checksum"][module] = "0" * 16  # recorded from another base model
    (tmp_path / "c" / "adapter_config.json").write_text(json.dumps(config))
    model.delete_adapter("c")
    model.load_adapter(str(tmp_path / "c"), "c")
    with pytest.raises(ValueError, match="made from a different base model"):
        merge_grafts(model, list(TASKS), "stitch", "unstacked")
    with pytest.raises(ValueError, match=rf"Graft 'c' \(task 'c'\) changed in '{module}' .* stale"):
        merge_grafts(model, list(TASKS), "stitch", "stacked", stack=stack)
    assert "stacked" not in model.peft_config


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(rule="regmean"), "rule 'regmean' needs grams"),
        (dict(rule="regmean", grams={"a": {}, "b": {}, "c": {}}), "grams\\['a'\\] has none for linear layer"),
        (dict(rule="wudi", grams={}), "takes no grams"),
        (dict(rule="wudi", wudi_steps=5), "takes no wudi_steps"),
        (dict(rule="wudi_adam", wudi_lr=0.0), "wudi_lr must be"),
        (dict(rule="stitch_dataless", density=0.5, lines=(1.0, 0.5)), "takes no lines"),
        (dict(rule="task_arithmetic", lines=(1.0,)), "lines must be"),
        (dict(rule="ties", density=0.5, scale=2.0), "takes no scale"),
        (dict(rule="stitch", scale=float("inf")), "scale must be a finite number"),
    ],
)
def test_bad_rule_options_are_refused(pre, folders, options, match):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    before = state(model)
    with pytest.raises(ValueError, match=match):
        merge_grafts(model, list(TASKS), **options)
    assert state(model) == before


# ------------------------------------------------------------------------------------------ issue 60
def test_a_graft_given_twice_is_refused_naming_it(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    for grafts in (["a", "a"], {"x": "b", "y": "b"}):
        with pytest.raises(ValueError, match=r"grafts names \['.'\] more than once"):
            merge_grafts(model, grafts, "stitch")
    assert "merged" not in model.peft_config


def test_use_task_after_the_adapter_is_deleted(pre, folders):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    merged = merge_grafts(model, list(TASKS), "stitch")
    model.delete_adapter("merged")
    with pytest.raises(ValueError, match="'merged' is no longer in the model"):
        merged.use_task("a")


@pytest.fixture
def saved(pre, folders, tmp_path):  # noqa: F811
    model = loaded(pre, folders, "sparse")
    merged = merge_grafts(model, list(TASKS), "stitch")
    other = merge_grafts(model, list(TASKS), "stitch", "other", scale=0.5)
    return model, merged.save_pretrained(tmp_path / "one"), other.save_pretrained(tmp_path / "two")


def test_loading_under_an_adapter_name_in_use_is_refused(saved):
    model, folder, _ = saved
    before = state(model)
    with pytest.raises(ValueError, match="An adapter named 'a' is already in the model"):
        MergedGraft.from_pretrained(model, folder, adapter_name="a")
    assert state(model) == before


def rewrite_heads(path, change) -> None:
    """Rewrite a heads file with ``change(tensors, metadata)`` applied and its file checksum recorded again."""
    from peft_graft._checksum import state_checksum

    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
        metadata = dict(handle.metadata())
    change(tensors, metadata)
    metadata["checksum"] = state_checksum(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


def test_heads_of_another_merge_are_refused(pre, saved, tmp_path):  # noqa: F811
    model, one, two = saved
    (two / HEADS_FILE).write_bytes((one / HEADS_FILE).read_bytes())  # the heads of merge one beside body two
    with pytest.raises(ValueError, match="saved with another merged body"):
        MergedGraft.from_pretrained(clone_model(pre), two)
    before = state(model)
    with pytest.raises(ValueError, match="saved with another merged body"):
        MergedGraft.from_pretrained(model, two, adapter_name="loaded")
    assert state(model) == before
    again = MergedGraft.from_pretrained(clone_model(pre), one)  # its own heads load
    again.use_task("b")


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_a_heads_file_that_is_no_file_is_refused_naming_it(pre, saved, kind):  # noqa: F811
    """A heads file that links to a device, is a FIFO or a folder: refused at once, never read or waited on."""
    _, one, _ = saved
    heads = one / HEADS_FILE
    heads.unlink()
    if kind == "device":
        heads.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(heads)
    else:
        heads.mkdir()
    base = clone_model(pre)
    with pytest.raises(ValueError, match=f"task heads file.*{HEADS_FILE}"):
        MergedGraft.from_pretrained(base, one)
    assert not any("graft" in type(m).__name__.lower() for m in base.modules())


def test_an_old_heads_file_without_a_body_checksum(pre, saved):  # noqa: F811
    _, one, _ = saved
    rewrite_heads(one / HEADS_FILE, lambda tensors, metadata: metadata.pop("body_checksum"))
    base = clone_model(pre)
    with pytest.raises(ValueError, match=r"records no checksum of its merged body.*check_body=False"):
        MergedGraft.from_pretrained(base, one)
    assert not any("graft" in type(m).__name__.lower() for m in base.modules())  # the base model as it was
    merged = MergedGraft.from_pretrained(base, one, check_body=False)
    assert merged.tasks == list(TASKS)


def test_a_head_of_another_shape_names_the_head_and_both_shapes(pre, saved):  # noqa: F811
    _, one, _ = saved

    def widen(tensors, metadata):
        tensors["b/classifier.weight"] = torch.zeros(5, tensors["b/classifier.weight"].shape[1])

    rewrite_heads(one / HEADS_FILE, widen)
    with pytest.raises(ValueError, match=r"head tensor 'classifier.weight' of task 'b' has shape \(5, 32\), the merged "
                                         r"adapter's has \(3, 32\)"):  # fmt: skip
        MergedGraft.from_pretrained(clone_model(pre), one)


@pytest.mark.parametrize("density", [0.005, 0.1, 0.5, 0.9])  # topk's partial-sort branch (k * 64 <= n) and its other
def test_top_magnitude_keeps_peft_s_entries_among_ties(density):
    """The trim's mask (topk unsorted) is peft's magnitude pruning's (topk sorted), also where many magnitudes tie."""
    generator = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.5, 1.0, 2.0, 3.0])  # 4 magnitudes over 10,000 entries: ties at every threshold
    tau = levels[torch.randint(4, (10_000,), generator=generator)] * (
        torch.randint(2, (10_000,), generator=generator) * 2 - 1
    )
    expected = merge_utils.magnitude_based_pruning(tau, density) != 0
    assert torch.equal(merge_rules.top_magnitude(tau, density), expected)


@pytest.fixture(scope="module", params=[0.5, 1.0], ids=["sparse", "full"])
def exact_grafts(pre, request):  # noqa: F811
    """Three grafts of ``pre`` (overlapping sparse ones, or full ones) with entries stored exactly: a quarter of each
    fine-tune's weights shrunk to 1e-3 theta_pre, which no fp32 delta reaches."""
    model = None
    for seed, task in enumerate(TASKS, 1):
        finetuned = finetune_like(pre, scale=0.01 * seed, seed=seed)
        with torch.no_grad():
            for name, param in finetuned.named_parameters():
                if name.endswith("weight") and param.dim() == 2:
                    param.view(-1)[seed::4] = pre.get_parameter(name).view(-1)[seed::4] * 1e-3
        region = (
            dict(sparsity=1.0) if request.param == 1.0 else dict(sparsity=request.param, region="random", seed=seed)
        )
        config = GraftConfig(finetuned=finetuned, modules_to_save=["classifier"], task_type="SEQ_CLS", **region)
        if model is None:
            model = get_peft_model(clone_model(pre), config, adapter_name=task)
        else:
            model.add_adapter(task, config)
    return model


@pytest.mark.parametrize(("rule", "options"), [("ties", dict(weights=1.0, density=0.6)), ("stitch", {}),
                                               ("task_arithmetic", dict(weights=1.0))])  # fmt: skip
def test_a_stack_s_exact_columns_store_what_the_search_over_every_merged_entry_does(exact_grafts, rule, options):
    """A merge looks for the entries to store exactly only among the columns where a graft stores theta_ft exactly,
    found once per stack: the merged adapter's exact entries are those of the search over all its entries, bit for bit;
    a graft whose exact entries changed refuses the stack, and a new stack finds the new columns."""
    model, names = exact_grafts, list(TASKS)
    stack = TaskVectorStack(model, names)
    stored = 0
    for adapter in ("m", "again"):  # the second merge reuses the columns found by the first
        merge_grafts(model, names, rule, adapter, stack=stack, **options)
        for module, layer in model.base_model.graft_layers().items():
            indices, values = layer.entries(adapter)
            union, rows, exact = stack.layers[module]
            columns = torch.searchsorted(union, indices.long())
            expected = exact_positions(indices, _exact_after_combining(rows[:, columns], exact[:, columns], values,
                                                                       indices.long()))  # fmt: skip
            positions, targets = layer.exact_entries(adapter)
            assert torch.equal(positions.long(), expected[0]) and torch.equal(targets, expected[1]), module
            stored += positions.numel()
        assert all(stack.exact_columns(module) is found for module, found in stack._exact.items())
        model.delete_adapter(adapter)
    full = stack.layers[module][1].isnan().sum() == 0  # then only TIES keeps one graft's delta at a column
    assert stored > 0 or (full and rule != "ties")  # the premise: some merged entries are stored exactly
    module, layer = next((m, layer) for m, layer in model.base_model.graft_layers().items()
                         if layer.exact_entries("b")[0].numel())  # fmt: skip
    before = stack.exact_columns(module)[0]
    indices, values = (t.clone() for t in layer.entries("b"))
    positions, targets = (t.clone() for t in layer.exact_entries("b"))
    layer.set_region("b", indices, values)  # b's exact entries dropped here
    try:
        with pytest.raises(ValueError, match=r"Graft 'b' \(task 'b'\) changed"):
            merge_grafts(model, names, rule, "after", stack=stack, **options)
        assert not torch.equal(TaskVectorStack(model, names).exact_columns(module)[0], before)
    finally:
        layer.set_region("b", indices, values, (indices[positions.long()], targets))


def test_a_stack_bounds_theta_pre_once_and_reads_the_base_only_where_the_bound_is_too_loose(pre, monkeypatch):  # noqa: F811
    """A merge through a stack checks its merged parameters for overflow by the stack's bound on |theta_pre| per stored
    tensor (found once) and its largest merged value; it reads the base entry by entry only where that bound cannot
    show them finite, and then decides as before: grafts of a base holding 1e18 merge (theta up to 2e18: the sum of
    squares fits float32), with weights of 20 the merged values' squares overflow float32 and are refused."""
    big = clone_model(pre)
    weight = big.bert.encoder.layer[0].attention.self.query.weight
    with torch.no_grad():
        weight.view(-1)[7] = 1e18
    model = None
    for seed, task in enumerate(("x", "y"), 1):
        finetuned = finetune_like(big, scale=0.01, seed=seed)
        with torch.no_grad():
            finetuned.bert.encoder.layer[0].attention.self.query.weight.view(-1)[7] = 2e18  # moved by 1e18
        config = GraftConfig(finetuned=finetuned, sparsity=1.0, modules_to_save=["classifier"], task_type="SEQ_CLS")
        if model is None:
            model = get_peft_model(clone_model(big), config, adapter_name=task)
        else:
            model.add_adapter(task, config)
    reads = []
    original = GraftLayer.base_values
    monkeypatch.setattr(GraftLayer, "base_values", lambda self, idx: reads.append(idx.numel()) or original(self, idx))
    stack = TaskVectorStack(model, ["x", "y"])
    merge_grafts(model, ["x", "y"], "ties", "first", weights=1.0, density=0.5, stack=stack)
    bounds = dict(stack._bounds)
    assert bounds and all(stack.base_bounds(module) is found for module, found in bounds.items())
    query = next(m for m in bounds if m.endswith("layer.0.attention.self.query"))
    assert bounds[query]["weight"] == float(torch.tensor(1e18)) and all(
        v < 10 for m, b in bounds.items() for v in b.values() if m != query
    )
    reads.clear()
    merge_grafts(model, ["x", "y"], "ties", "again", weights=1.0, density=0.5, stack=stack)
    assert [n for n in reads if n > 2] == [model.base_model.model.get_submodule(query).entries("again")[0].numel()]
    assert torch.equal(*task_vectors(model, ["first", "again"]))
    with pytest.raises(ValueError, match=r"gives merged values of .*query\.weight up to 2\.1e\+19 .*inf or NaN"):
        merge_grafts(model, ["x", "y"], "ties", "huge", weights=20.0, density=0.5, stack=stack)
    assert "huge" not in model.peft_config


def test_a_stack_holds_each_graft_s_values_and_theta_ft_at_its_columns(exact_grafts):
    """The stacked task vectors, checked against each graft's own entries: its values and exact theta_ft at the union's
    columns of its indices, NaN elsewhere (a full graft's row is its entries as they are)."""
    model = exact_grafts
    stack = TaskVectorStack(model, list(TASKS))
    for module, (union, rows, exact) in stack.layers.items():
        layer = model.base_model.model.get_submodule(module)
        for row, task in enumerate(TASKS):
            indices, values = layer.entries(task)
            positions, targets = layer.exact_entries(task)
            expected = torch.full((union.numel(),), torch.nan)
            expected[torch.searchsorted(union, indices.long())] = values.detach()
            assert torch.equal(rows[row].nan_to_num(7.0), expected.nan_to_num(7.0)), (module, task)
            expected = torch.full((union.numel(),), torch.nan)
            expected[torch.searchsorted(union, indices.long()[positions.long()])] = targets
            assert torch.equal(exact[row].nan_to_num(7.0), expected.nan_to_num(7.0)), (module, task)


def test_full_grafts_check_the_base_once_per_layer_against_each_record(exact_grafts, monkeypatch):
    """Grafts holding the same entries of a layer (full grafts) and their union read the base there once; each graft's
    recorded checksum is still compared with it: one recording another theta_pre is refused, naming it."""
    model = exact_grafts
    calls = []
    original = GraftLayer.base_checksum
    monkeypatch.setattr(GraftLayer, "base_checksum", lambda self, idx: calls.append(self) or original(self, idx))
    TaskVectorStack(model, list(TASKS))
    layers = model.base_model.graft_layers()
    full = all(layer.entries(t)[0].numel() == layer.entries(TASKS[0])[0].numel() for layer in layers.values()
               for t in TASKS)  # fmt: skip
    assert full == (exact_grafts.peft_config["a"].region_provenance["strategy"] != "random")
    assert len(calls) == (len(layers) if full else len(layers) * (len(TASKS) + 1))
    module = next(iter(model.peft_config["c"].base_checksum))
    recorded = model.peft_config["c"].base_checksum[module]
    model.peft_config["c"].base_checksum[module] = "0" * 16  # recorded from another base model
    try:
        with pytest.raises(ValueError, match=rf"Graft 'c' \(task 'c'\) was made from a different base .*'{module}'"):
            TaskVectorStack(model, list(TASKS))
    finally:
        model.peft_config["c"].base_checksum[module] = recorded
