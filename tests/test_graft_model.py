"""The graft PEFT method on tiny models: regions, exactness, loaders, adapters, merging, storage."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from peft import (
    AutoPeftModelForCausalLM,
    AutoPeftModelForSequenceClassification,
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from safetensors.torch import load_file
from testing_utils import clone_model, finetune_like, input_ids, make_pair

from peft_graft import GraftConfig, GraftLayer, Region

HEADS = ("classifier", "score")


def unique_params(model) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


def eligible(pre, task_type) -> dict[str, torch.nn.Parameter]:
    """The tensors a default graft may use: all moved ones, less the head stored whole for classifiers."""
    head = HEADS if task_type == "SEQ_CLS" else ()
    return {n: p for n, p in unique_params(pre).items() if not n.startswith(head)}


def brute_force_top_k(pre, finetuned, names, k) -> Region:
    """Top-k by |theta_ft - theta_pre| with a full stable sort: ties to the earliest tensor and index."""
    ft = finetuned.state_dict()
    flat = torch.cat([(ft[n].float() - p.detach().float()).abs().reshape(-1) for n, p in names.items()])
    order = torch.sort(-flat, stable=True).indices[:k]
    region, start = {}, 0
    for name, param in names.items():
        chosen = order[(order >= start) & (order < start + param.numel())] - start
        if chosen.numel():
            region[name] = chosen
        start += param.numel()
    return Region(region)


def grafted_state(pre, finetuned, region: Region) -> dict[str, torch.Tensor]:
    """theta_pre with theta_ft written on the region, per unique tensor (the definition, paper Eq. 1).

    A classifier's head is new in the fine-tuned model: it is taken whole (``modules_to_save``).
    """
    ft = finetuned.state_dict()
    whole = (
        HEADS if (getattr(pre.config, "num_labels", 0) and hasattr(pre, "classifier")) or hasattr(pre, "score") else ()
    )
    out = {}
    for name, param in unique_params(pre).items():
        value = param.detach().clone()
        if name.startswith(whole):
            value = ft[name].clone()
        elif name in region:
            value.view(-1)[region[name]] = ft[name].reshape(-1)[region[name]].to(value.dtype)
        out[name] = value
    return out


def manual_graft(pre, finetuned, region: Region):
    model = clone_model(pre)
    with torch.no_grad():
        for name, value in grafted_state(pre, finetuned, region).items():
            model.get_parameter(name).copy_(value)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_region_is_exact_top_k_and_grafting_is_bit_exact(arch):
    pre, finetuned, task_type = make_pair(arch)
    pre_state = {n: p.detach().clone() for n, p in unique_params(pre).items()}
    pre_logits = logits(pre, input_ids())
    k = 257
    expected_region = brute_force_top_k(pre, finetuned, eligible(pre, task_type), k)
    expected = grafted_state(pre, finetuned, expected_region)
    reference = manual_graft(pre, finetuned, expected_region)
    model = get_peft_model(pre, GraftConfig(finetuned=finetuned, num_entries=k, task_type=task_type)).eval()

    region = model.get_region()
    assert region.num_entries == k
    assert region == expected_region
    assert torch.equal(logits(model, input_ids()), logits(reference, input_ids()))  # unmerged forward
    with model.disable_adapter():
        assert torch.equal(logits(model, input_ids()), pre_logits)

    model.merge_adapter()
    for name, value in expected.items():
        if not name.startswith(HEADS):
            assert torch.equal(model.get_base_model().get_parameter(_wrapped_name(model, name)), value), name
    assert torch.equal(logits(model, input_ids()), logits(reference, input_ids()))
    model.unmerge_adapter()
    for name, value in pre_state.items():
        if not name.startswith(HEADS):
            assert torch.equal(model.get_base_model().get_parameter(_wrapped_name(model, name)), value), name


def _wrapped_name(model, name: str) -> str:
    module_name, _, attr = name.rpartition(".")
    module = model.get_base_model().get_submodule(module_name)
    return f"{module_name}.base_layer.{attr}" if isinstance(module, GraftLayer) else name


@pytest.mark.parametrize("arch", ["roberta_mlm", "llama", "gpt2"])
def test_tied_weights_are_stored_once_and_applied_at_every_use(arch):
    pre, finetuned, task_type = make_pair(arch)
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type)
    # Graft only the tied embedding matrix, so the output head must see it through the tie.
    config.include_parameters = r"(word_embeddings|embed_tokens|wte)\.weight$"
    model = get_peft_model(clone_model(pre), config).eval()
    region = model.get_region()
    assert len(region) == 1 and region.num_entries == round(0.05 * pre.get_input_embeddings().weight.numel())
    assert sum(config.grafted_modules.values()) == region.num_entries  # stored once
    reference = manual_graft(pre, finetuned, region)
    assert torch.equal(logits(model, input_ids()), logits(reference, input_ids()))


def test_roberta_mlm_tied_bias_is_grafted_once():
    pre, finetuned, _ = make_pair("roberta_mlm")
    config = GraftConfig(finetuned=finetuned, num_entries=7, include_parameters=r"^lm_head\.bias$")
    model = get_peft_model(clone_model(pre), config).eval()
    region = model.get_region()
    assert list(region) == ["lm_head.bias"] and region.num_entries == 7
    assert list(config.grafted_modules) == ["lm_head.decoder"]
    assert torch.equal(logits(model, input_ids()), logits(manual_graft(pre, finetuned, region), input_ids()))


def save_reload_models(arch, tmp_path, **config_kwargs):
    pre, finetuned, task_type = make_pair(arch)
    pre.save_pretrained(tmp_path / "base")
    base = type(pre).from_pretrained(tmp_path / "base")  # records name_or_path, needed by AutoPeftModel
    model = get_peft_model(base, GraftConfig(finetuned=finetuned, task_type=task_type, **config_kwargs))
    model.eval().save_pretrained(tmp_path / "graft")
    return pre, model, task_type


def test_save_and_load_with_peft(arch, tmp_path):
    pre, model, _ = save_reload_models(arch, tmp_path, sparsity=0.02)
    expected = logits(model, input_ids())
    assert isinstance(PeftConfig.from_pretrained(tmp_path / "graft"), GraftConfig)
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft").eval()
    assert torch.equal(logits(loaded, input_ids()), expected)
    assert loaded.get_region() == model.get_region()


def test_saved_adapter_holds_only_sparse_entries(tmp_path):
    _, model, _ = save_reload_models("roberta_cls", tmp_path, sparsity=0.02)
    tensors = load_file(tmp_path / "graft" / "adapter_model.safetensors")
    grafted = {k: v for k, v in tensors.items() if ".graft_" in k}
    whole = {k: v for k, v in tensors.items() if ".graft_" not in k}
    assert all(".modules_to_save." in k or k.startswith("base_model.model.classifier") for k in whole)
    assert {v.dtype for k, v in grafted.items() if k.endswith("graft_indices")} == {torch.int32}
    assert {v.dtype for k, v in grafted.items() if k.endswith("graft_values")} == {torch.float32}
    assert sum(v.numel() for k, v in grafted.items() if k.endswith("graft_values")) == model.get_region().num_entries
    assert not any("scores" in k or "movement" in k for k in tensors)


def test_storage_is_at_most_8_bytes_per_entry_plus_header(tmp_path):
    _, model, _ = save_reload_models("bert_cls", tmp_path, sparsity=0.05, modules_to_save=None)
    path = tmp_path / "graft" / "adapter_model.safetensors"
    with open(path, "rb") as handle:
        header_size = struct.unpack("<Q", handle.read(8))[0]
    tensors = load_file(path)
    graft_bytes = sum(v.numel() * v.element_size() for k, v in tensors.items() if ".graft_" in k)
    assert graft_bytes == 8 * model.get_region().num_entries
    head_bytes = sum(v.numel() * v.element_size() for k, v in tensors.items() if ".graft_" not in k)
    assert os.path.getsize(path) == 8 + header_size + graft_bytes + head_bytes


def test_auto_peft_model_and_transformers_load_adapter(tmp_path):
    _, model, _ = save_reload_models("roberta_cls", tmp_path, sparsity=0.02)
    expected = logits(model, input_ids())
    auto = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "graft").eval()
    assert torch.equal(logits(auto, input_ids()), expected)

    pre_lm, model_lm, _ = save_reload_models("gpt2", tmp_path / "lm", sparsity=0.02)
    expected_lm = logits(model_lm, input_ids())
    assert torch.equal(
        logits(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "lm" / "graft"), input_ids()), expected_lm
    )
    native = clone_model(pre_lm)
    native.load_adapter(str(tmp_path / "lm" / "graft"))
    assert torch.equal(logits(native.eval(), input_ids()), expected_lm)


def test_get_and_set_peft_model_state_dict(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.03)).eval()
    state = get_peft_model_state_dict(model)
    assert state and all(".graft_indices" in k or ".graft_values" in k for k in state)
    config = PeftConfig.from_peft_type(**model.peft_config["default"].to_dict())
    fresh = inject_adapter_in_model(config, clone_model(pre))
    result = set_peft_model_state_dict(fresh, state)
    assert not [k for k in result.unexpected_keys if "graft" in k]
    assert torch.equal(logits(fresh.eval(), input_ids()), logits(model, input_ids()))


def test_several_adapters_switch_delete_and_stay_exact(tmp_path):
    pre, finetuned_a, task_type = make_pair("bert_cls")
    finetuned_b = finetune_like(pre, seed=7)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned_a, sparsity=0.02, task_type=task_type))
    model.save_pretrained(tmp_path / "a")
    graft_b = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned_b, sparsity=0.02, task_type=task_type))
    graft_b.save_pretrained(tmp_path / "b")
    expected_a, expected_b = logits(model.eval(), input_ids()), logits(graft_b.eval(), input_ids())

    model.load_adapter(tmp_path / "b", adapter_name="b")
    model.eval()
    assert torch.equal(logits(model, input_ids()), expected_a)
    model.set_adapter("b")
    assert torch.equal(logits(model, input_ids()), expected_b)
    model.merge_adapter()
    assert torch.equal(logits(model, input_ids()), expected_b)
    model.unmerge_adapter()
    model.set_adapter("default")
    assert torch.equal(logits(model, input_ids()), expected_a)
    model.delete_adapter("b")
    assert list(model.peft_config) == ["default"]
    assert torch.equal(logits(model, input_ids()), expected_a)


def test_merge_and_unload_and_unload(arch):
    pre, finetuned, task_type = make_pair(arch)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=100, task_type=task_type))
    region = model.get_region()
    expected = logits(model.eval(), input_ids())
    merged = model.merge_and_unload()
    assert not any(isinstance(m, GraftLayer) for m in merged.modules())
    assert torch.equal(logits(merged, input_ids()), expected)
    reference = grafted_state(pre, finetuned, region)
    for name, param in merged.named_parameters():
        if name in reference and not name.startswith(("classifier", "score")):
            assert torch.equal(param, reference[name]), name

    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=100, task_type=task_type))
    plain = model.unload()  # peft keeps the trained copy of modules_to_save (the head)
    for name, param in plain.named_parameters():
        if not name.startswith(HEADS):
            assert torch.equal(param, pre.get_parameter(name)), name


def test_bf16_base_is_exact():
    pre, finetuned, _ = make_pair("llama")
    pre, finetuned = pre.to(torch.bfloat16), finetuned.to(torch.bfloat16)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05))
    region = model.get_region()
    assert {p.dtype for n, p in model.named_parameters() if "graft_values" in n} == {torch.float32}
    model.merge_adapter()
    reference = grafted_state(pre, finetuned, region)
    for name, value in reference.items():
        assert torch.equal(model.get_base_model().get_parameter(_wrapped_name(model, name)), value), name


def test_graft_onto_wrong_base_is_refused_unless_overridden(tmp_path):
    pre, model, _ = save_reload_models("gpt2", tmp_path, sparsity=0.02)
    other = finetune_like(pre, seed=11)
    loaded = PeftModel.from_pretrained(clone_model(other), tmp_path / "graft").eval()
    with pytest.raises(ValueError, match="different pre-trained model"):
        logits(loaded, input_ids())
    config = GraftConfig.from_pretrained(tmp_path / "graft")
    config.verify_base = False
    loaded = PeftModel.from_pretrained(clone_model(other), tmp_path / "graft", config=config).eval()
    assert logits(loaded, input_ids()).shape == logits(model, input_ids()).shape


def test_modules_to_save_head_is_stored_whole_and_reported(tmp_path):
    pre, model, _ = save_reload_models("roberta_cls", tmp_path, sparsity=0.02)
    stats = model.graft_stats()
    head = sum(p.numel() for n, p in pre.named_parameters() if n.startswith("classifier"))
    assert stats.modules_to_save_parameters == head
    assert stats.num_parameters == sum(p.numel() for p in pre.parameters()) - head
    assert not any(n.startswith("classifier") for n in model.get_region())
    finetuned_head = make_pair("roberta_cls")[1].classifier.dense.weight
    assert torch.equal(model.classifier.modules_to_save["default"].dense.weight, finetuned_head)


def test_graft_stats_counts():
    pre, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=300, task_type="SEQ_CLS"))
    stats = model.graft_stats()
    region = model.get_region()
    assert stats.num_entries == 300 == sum(stats.per_tensor.values())
    assert sum(stats.per_module_type.values()) == sum(stats.per_layer.values()) == 300
    assert stats.per_tensor == {n: int(i.numel()) for n, i in region.items()}
    value = sum(count for name, count in stats.per_tensor.items() if ".attention.self.value." in name)
    assert value > 0 and stats.per_module_type["attention_value"] == value
    layer_0 = sum(count for name, count in stats.per_tensor.items() if ".layer.0." in name)
    assert stats.per_layer[0] == layer_0
    assert f"| attention_value | {value} |" in stats.to_markdown()


@pytest.mark.parametrize("strategy", ["random", "bias"])
def test_other_region_strategies_are_exact_and_deterministic(strategy):
    pre, finetuned, task_type = make_pair("roberta_cls")
    regions = []
    for _ in range(2):
        config = GraftConfig(finetuned=finetuned, num_entries=40, region=strategy, seed=3, task_type=task_type)
        regions.append(get_peft_model(clone_model(pre), config).get_region())
    assert regions[0] == regions[1] and regions[0].num_entries == 40
    if strategy == "bias":
        assert all(name.endswith("bias") for name in regions[0])
        assert regions[0] == brute_force_top_k(
            pre, finetuned, {n: p for n, p in eligible(pre, task_type).items() if n.endswith("bias")}, 40
        )


def test_given_region_from_masks_and_from_saved_graft(tmp_path):
    pre, model, task_type = save_reload_models("bert_cls", tmp_path, sparsity=0.01)
    finetuned = make_pair("bert_cls")[1]
    saved = model.get_region()
    from_path = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, region="given", given_region=str(tmp_path / "graft"))
    )
    assert from_path.get_region() == saved
    name = "bert.encoder.layer.0.output.dense.weight"
    mask = torch.zeros_like(pre.get_parameter(name), dtype=torch.bool)
    mask[0, :5] = True
    config = GraftConfig(finetuned=finetuned, region="given", given_region={name: mask}, task_type=task_type)
    assert get_peft_model(clone_model(pre), config).get_region() == Region({name: torch.arange(5)})


def test_region_algebra_and_combined_adapter():
    pre, finetuned_a, task_type = make_pair("bert_cls")
    finetuned_b = finetune_like(pre, seed=5)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned_a, sparsity=0.05, task_type=task_type))
    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned_b, sparsity=0.05, task_type=task_type))
    state = get_peft_model_state_dict(other)
    model.add_adapter("b", other.peft_config["default"])
    set_peft_model_state_dict(model, state, adapter_name="b")
    a, b = model.get_region("default"), model.get_region("b")
    both = a & b
    assert 0 < both.num_entries < a.num_entries
    assert (a | b).num_entries == a.num_entries + b.num_entries - both.num_entries
    assert (a - b).num_entries == a.num_entries - both.num_entries
    assert a.overlap(b) == both.num_entries / b.num_entries
    assert a.iou(b) == both.num_entries / (a | b).num_entries

    union = model.add_combined_adapter(["default", "b"], "ab", combination="average")
    assert union == a | b
    name = next(iter(both))
    entry = int(both[name][0])
    module, _, attr = name.rpartition(".")
    delta_a = finetuned_a.get_parameter(name).reshape(-1)[entry] - pre.get_parameter(name).reshape(-1)[entry]
    delta_b = finetuned_b.get_parameter(name).reshape(-1)[entry] - pre.get_parameter(name).reshape(-1)[entry]
    layer = model.get_base_model().get_submodule(module)
    indices, values = layer.sparse_entries("ab", attr)
    value = values[(indices == entry).nonzero().item()]
    torch.testing.assert_close(value, (delta_a + delta_b) / 2)
    first = model.add_combined_adapter(["default", "b"], "a_first", combination="first")
    assert first == union
    indices, values = layer.sparse_entries("a_first", attr)
    torch.testing.assert_close(values[(indices == entry).nonzero().item()], delta_a)


def test_learnable_state_rounds_to_gamma_base_and_hardens_exactly(tmp_path):
    pre, finetuned, task_type = make_pair("roberta_cls")
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50, learn_region=True, task_type=task_type)
    )
    base = brute_force_top_k(pre, finetuned, eligible(pre, task_type), 50)
    assert model.get_region() == base  # sigmoid(S) ~ 0: gamma rounds to gamma_base
    layers = [m for m in model.modules() if isinstance(m, GraftLayer) and m.is_learning("default")]
    assert layers and all(torch.all(m.learner("default").scores == -10.0) for m in layers)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("graft_learning" in n for n in trainable)

    # Flip 3 entries outside gamma_base on: round(gamma) grows by 3, and saving writes that hard region.
    layer = layers[0]
    outside = (~torch.isin(torch.arange(layer.num_stored), layer.learner("default").base_region)).nonzero()[:3, 0]
    with torch.no_grad():
        layer.learner("default").scores[outside] = 5.0
    assert model.get_region().num_entries == 53
    model.save_pretrained(tmp_path / "g")
    saved = load_file(tmp_path / "g" / "adapter_model.safetensors")
    assert sum(v.numel() for k, v in saved.items() if k.endswith("graft_values")) == 53
    assert json.loads((tmp_path / "g" / "adapter_config.json").read_text())["learn_region"] is True
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")
    assert loaded.get_region() == model.get_region()

    assert model.harden_region(num_entries=51) == 51
    assert not any(m.is_learning("default") for m in layers)
    assert model.get_region().num_entries == 51


def test_finetuned_from_a_local_path_or_state_dict_gives_the_same_graft_and_is_released(tmp_path):
    pre, finetuned, task_type = make_pair("roberta_cls")
    finetuned.save_pretrained(tmp_path / "ft")
    regions = []
    for source in (finetuned, str(tmp_path / "ft"), finetuned.state_dict()):
        config = GraftConfig(finetuned=source, num_entries=77, task_type=task_type)
        model = get_peft_model(clone_model(pre), config)
        regions.append(model.get_region())
        assert config._finetuned is None  # theta_ft is not kept once the region is fixed
    assert regions[0] == regions[1] == regions[2]
    assert model.peft_config["default"].finetuned_model_name_or_path is None
    by_path = GraftConfig(finetuned=str(tmp_path / "ft"), num_entries=77, task_type=task_type)
    assert by_path.finetuned_model_name_or_path == str(tmp_path / "ft")


def test_include_and_exclude_parameter_filters():
    pre, finetuned, task_type = make_pair("bert_cls")
    config = GraftConfig(
        finetuned=finetuned, num_entries=60, exclude_parameters=[r"\.attention\.", r"embeddings"], task_type=task_type
    )
    region = get_peft_model(clone_model(pre), config).get_region()
    assert region.num_entries == 60 and not any(".attention." in n or "embeddings" in n for n in region)
    kept = {n: p for n, p in eligible(pre, task_type).items() if ".attention." not in n and "embeddings" not in n}
    assert region == brute_force_top_k(pre, finetuned, kept, 60)
    config = GraftConfig(finetuned=finetuned, sparsity=1.0, include_parameters=r"LayerNorm\.bias$", task_type=task_type)
    region = get_peft_model(clone_model(pre), config).get_region()
    assert set(region) == {n for n in eligible(pre, task_type) if n.endswith("LayerNorm.bias")}


@pytest.mark.parametrize(
    ("name", "kind", "layer"),
    [
        ("bert.encoder.layer.3.attention.self.value.weight", "attention_value", 3),
        ("bert.encoder.layer.0.attention.output.dense.bias", "attention_output", 0),
        ("bert.encoder.layer.1.intermediate.dense.weight", "ffn_in", 1),
        ("bert.encoder.layer.1.output.dense.weight", "ffn_out", 1),
        ("bert.encoder.layer.1.output.LayerNorm.weight", "layer_norm", 1),
        ("bert.embeddings.word_embeddings.weight", "embeddings", None),
        ("bert.pooler.dense.weight", "pooler", None),
        ("classifier.weight", "head", None),
        ("transformer.h.2.attn.c_attn.weight", "attention_qkv", 2),
        ("transformer.h.2.mlp.c_fc.bias", "ffn_in", 2),
        ("transformer.h.2.mlp.c_proj.weight", "ffn_out", 2),
        ("model.layers.5.self_attn.k_proj.weight", "attention_key", 5),
        ("model.layers.5.mlp.down_proj.weight", "ffn_out", 5),
        ("model.layers.5.post_attention_layernorm.weight", "layer_norm", 5),
        ("model.norm.weight", "layer_norm", None),
        ("lm_head.weight", "head", None),
    ],
)
def test_module_type_and_layer_of_parameter_names(name, kind, layer):
    from peft_graft.analysis.stats import layer_index, module_type

    assert module_type(name) == kind
    assert layer_index(name) == layer


def test_while_learning_every_trainable_parameter_gets_a_gradient_and_counts_are_right():
    pre, finetuned, task_type = make_pair("roberta_cls")
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50, learn_region=True, task_type=task_type)
    )
    model.set_adapter("default")  # peft marks the active adapter's parameters trainable: graft_values stay frozen
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert not any("graft_values" in n for n in trainable)
    scores = sum(p.numel() for n, p in trainable.items() if "graft_learning" in n)
    head = sum(p.numel() for n, p in trainable.items() if "modules_to_save" in n)
    assert model.get_nb_trainable_parameters()[0] == scores + head
    model(input_ids=input_ids(), labels=torch.tensor([0, 1])).loss.backward()
    assert all(p.grad is not None for p in trainable.values()), [n for n, p in trainable.items() if p.grad is None]


@pytest.mark.parametrize(
    ("arch", "module", "features"),
    [
        ("roberta_cls", "roberta.encoder.layer.0.attention.self.query", (32, 32)),
        ("gpt2", "transformer.h.0.mlp.c_fc", (32, 128)),
    ],
)
def test_graft_layers_expose_in_and_out_features(arch, module, features):
    pre, finetuned, task_type = make_pair(arch)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.5, task_type=task_type))
    layer = model.get_base_model().get_submodule(module)
    assert isinstance(layer, GraftLayer)
    assert (layer.in_features, layer.out_features) == features


@pytest.mark.parametrize("combination", ["first", "last", "average"])
def test_combined_adapter_combines_heads_stored_whole_by_the_same_rule(combination):
    pre, finetuned, _ = make_pair("bert_cls")
    other = finetune_like(pre, seed=2)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20, task_type="SEQ_CLS"))
    model.add_adapter("b", GraftConfig(finetuned=other, num_entries=20, task_type="SEQ_CLS"))
    model.base_model.add_combined_adapter(["default", "b"], "both", combination=combination)
    heads = model.base_model.model.classifier.modules_to_save
    first, last = heads["default"].weight, heads["b"].weight
    expected = {"first": first, "last": last, "average": (first + last) / 2}[combination]
    assert torch.equal(heads["both"].weight, expected) and not heads["both"].weight.requires_grad
    model.set_adapter("both")
    assert model.base_model.model.classifier.active_adapters == ["both"]
    model.delete_adapter("both")
    assert "both" not in heads
