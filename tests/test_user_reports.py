"""What a new user meets: no unactionable peft warning, a warning when a fine-tuned head would be dropped, counts
that say what a graft holds and trains, one meaning of ``sparsity``, and a Region's entry count."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import _get_in_out_features
from testing_utils import clone_model, cls_dataset, fast_args, learning_graft, make_pair
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from peft_graft import GraftConfig, MaskTrainer, Region
from peft_graft.tuner.layer import GraftLayer

UNSUPPORTED = "Unsupported layer type"


def messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


# ------------------------------------------------------------------------------------------ peft's layer warning
@pytest.mark.parametrize(("arch", "norms"), [("llama", "norm"), ("bert_cls", "LayerNorm")])
def test_grafting_norm_layers_emits_no_unsupported_layer_warning(arch, norms, tmp_path):
    pre, finetuned, task_type = make_pair(arch)
    config = GraftConfig(finetuned=finetuned, sparsity=0.5, include_parameters=norms, task_type=task_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(clone_model(pre), config)
        model.save_pretrained(tmp_path / "g")
        PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")
    grafted = [type(m.base_layer).__name__ for m in model.modules() if isinstance(m, GraftLayer)]
    assert grafted and all("Norm" in name for name in grafted)  # only norms, each without in/out features
    assert not [m for m in messages(caught) if UNSUPPORTED in m]


def test_peft_still_warns_about_unsupported_layers_outside_grafts():
    pre, finetuned, _ = make_pair("llama")
    get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.5, include_parameters="norm"))
    with pytest.warns(UserWarning, match=UNSUPPORTED):  # no filter left behind
        _get_in_out_features(LlamaRMSNorm(8))
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to True"):  # a LoRA gets peft's warnings as usual
        get_peft_model(clone_model(pre), LoraConfig(target_modules=["q_proj"], fan_in_fan_out=True))


# ------------------------------------------------------------------------------------------ dropped heads
@pytest.mark.parametrize(
    "fields",
    [{}, {"include_parameters": "LayerNorm"}, {"region": "random", "seed": 1}],
    ids=["top-k", "head-ineligible", "random"],
)
def test_a_fine_tuned_head_the_graft_would_drop_is_named_with_the_fix(fields):
    pre, finetuned, _ = make_pair("bert_cls")
    with pytest.warns(UserWarning, match="task head") as caught:
        get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50, **fields))
    message = next(m for m in messages(caught) if "task head" in m)
    assert re.search(r"'classifier': \d+ of its 99 moved entries", message)  # 3 x 32 weights and 3 biases
    assert "modules_to_save=['classifier']" in message and "task_type='SEQ_CLS'" in message


@pytest.mark.parametrize(
    ("arch", "fields"),
    [
        ("bert_cls", {"task_type": "SEQ_CLS"}),
        ("bert_cls", {"modules_to_save": ["classifier"]}),
        ("bert_cls", {"sparsity": 1.0, "num_entries": None}),  # every moved head entry is grafted
        ("llama", {}),  # the LM head is the pre-trained (tied) embedding, not a new head
        ("gpt2", {}),
    ],
)
def test_no_head_warning_when_the_head_is_kept(arch, fields):
    pre, finetuned, _ = make_pair(arch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, **{"num_entries": 50, **fields}))
    assert not [m for m in messages(caught) if "task head" in m]


def test_a_head_that_fine_tuning_left_alone_is_not_reported():
    pre, finetuned, _ = make_pair("bert_cls", skip="classifier")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50))
    assert not [m for m in messages(caught) if "task head" in m]


# ------------------------------------------------------------------------------------------ counting helpers
def base_parameters(pre) -> int:
    return sum(p.numel() for p in pre.parameters())


def test_counts_of_a_top_k_graft_say_its_entries_and_what_trains(capsys):
    pre, finetuned, _ = make_pair("roberta_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50, task_type="SEQ_CLS"))
    head = sum(p.numel() for n, p in pre.named_parameters() if n.startswith("classifier"))
    total = base_parameters(pre)
    assert model.get_nb_trainable_parameters() == (50 + head, total)  # values peft marks trainable, the head copy
    model.print_trainable_parameters()
    out = capsys.readouterr().out
    assert f"trainable params: {50 + head:,} || all params: {total:,}" in out
    assert f"graft 'default': 50 entries = {50 / total:.4%} of all {total:,} parameters (a hard region)" in out
    assert "50 trainable graft values" in out and f"{head:,} parameters, trainable" in out


def test_counts_of_a_region_being_learned_and_then_hardened(tmp_path, capsys):
    pre, model = learning_graft("roberta_cls", num_entries=20)
    total = base_parameters(pre)
    scores = sum(p.numel() for n, p in model.named_parameters() if "graft_learning" in n)
    model.print_trainable_parameters()
    out = capsys.readouterr().out
    assert f"learning its region: {scores:,} trainable scores S over every eligible entry" in out
    args = fast_args(
        tmp_path, per_device_train_batch_size=8, max_steps=2, learning_rate=1e6, num_entries=20, logging_steps=1
    )
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16))
    trainer.train()
    assert model.get_nb_trainable_parameters() == (0, total)  # a hardened graft trains nothing
    model.print_trainable_parameters()
    out = capsys.readouterr().out
    assert f"trainable params: 0 || all params: {total:,} || trainable%: 0.0000" in out
    assert f"graft 'default': 20 entries = {20 / total:.4%} of all {total:,} parameters" in out
    assert out.rstrip().endswith("trains nothing")
    logs = [h for h in trainer.state.log_history if "grafted_entries" in h and "loss" in h]
    assert logs and all("sparsity" not in h for h in logs)  # sparsity names GraftConfig's budget only
    assert all(h["fraction_of_parameters"] == pytest.approx(h["grafted_entries"] / total) for h in logs)


def test_counts_of_a_loaded_graft_and_of_other_methods(tmp_path, capsys):
    pre, finetuned, _ = make_pair("gpt2")
    get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=30)).save_pretrained(tmp_path / "g")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")
    assert loaded.get_nb_trainable_parameters() == (0, base_parameters(pre))
    lora = get_peft_model(clone_model(pre), LoraConfig(target_modules=["c_attn"]))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert lora.get_nb_trainable_parameters() == (trainable, sum(p.numel() for p in lora.parameters()))
    lora.print_trainable_parameters()
    assert "graft" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ one meaning per name
def test_graft_stats_report_a_fraction_of_all_parameters_and_sparsity_is_deprecated_there():
    pre, finetuned, _ = make_pair("roberta_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=50, task_type="SEQ_CLS"))
    stats = model.graft_stats()
    total = base_parameters(pre)
    assert stats.total_parameters == total and stats.fraction_of_parameters == 50 / total
    assert f"Grafted entries: 50 = {50 / total:.6%} of all {total:,} parameters" in stats.to_markdown()
    assert "sparsity" not in stats.to_markdown()
    with pytest.warns(FutureWarning, match="fraction_of_parameters"):
        assert stats.sparsity == 50 / stats.num_parameters  # the old value, for old callers


def test_sparsity_counts_eligible_entries_only():
    pre, finetuned, _ = make_pair("gpt2")
    config = GraftConfig(finetuned=finetuned, sparsity=0.1, include_parameters=r"\.bias$")
    model = get_peft_model(clone_model(pre), config)
    eligible = sum(p.numel() for n, p in pre.named_parameters() if n.endswith(".bias"))
    assert model.graft_stats().num_entries == round(0.1 * eligible)
    assert "fraction of the *eligible* entries" in GraftConfig.__doc__
    assert "not a fraction of all parameters" in GraftConfig.__doc__.replace("\n            ", " ").lower()


# ------------------------------------------------------------------------------------------ Region sizes
def test_a_region_counts_tensors_with_len_and_entries_with_num_entries():
    region = Region({"a.weight": torch.tensor([0, 3, 5]), "b.bias": torch.tensor([1]), "c.weight": torch.tensor([])})
    assert len(region) == region.num_tensors == 2
    assert region.num_entries == 4
    assert repr(region) == "Region(4 entries in 2 tensors)"
    assert "num_entries" in Region.__doc__ and "len(region)" in Region.__doc__
    assert "tensors" in Region.__len__.__doc__
