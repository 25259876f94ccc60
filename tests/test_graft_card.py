"""How a graft's region was found (``GraftConfig.region_provenance``) and the model card of a saved or pushed graft."""

from __future__ import annotations

import copy
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import yaml
from datasets import Dataset
from huggingface_hub import HfApi
from peft import PeftModel, get_peft_model
from test_mask_selection import _accuracy, _two_class_task
from testing_utils import clone_model, cls_dataset, fast_args, input_ids, learning_graft, make_pair

from peft_graft import GraftConfig, MaskTrainer
from peft_graft.merging import merge_grafts

NO_TEMPLATE = ("[More Information Needed]", "Model Card for Model ID")


def card_parts(folder) -> tuple[dict, str]:
    """The card's YAML metadata and its text."""
    _, front, text = (folder / "README.md").read_text().split("---", 2)
    return yaml.safe_load(front), text


def saved_config(folder) -> dict:
    return json.loads((folder / "adapter_config.json").read_text())


def code_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def top_k(tmp_path):
    """A top-k graft of a GPT-2 loaded by path (so that the card can name its base model)."""
    pre, finetuned, _ = make_pair("gpt2")
    pre.save_pretrained(tmp_path / "base")
    base = type(pre).from_pretrained(tmp_path / "base")
    return pre, get_peft_model(base, GraftConfig(finetuned=finetuned, num_entries=123))


def check_graft_facts(text: str, model, pre: torch.nn.Module, adapter_name: str = "default") -> None:
    """The card states the graft's size, its fraction of all parameters of the base model ``pre`` and where its
    entries sit, as graft_stats counts them."""
    stats = model.graft_stats(adapter_name)
    total = sum(p.numel() for p in pre.parameters())  # each tied tensor once, heads included
    assert stats.total_parameters == total
    assert f"| Grafted entries | {stats.num_entries:,} |" in text
    assert f"| Fraction of all parameters | {stats.num_entries / total:.4%} of the {total:,} parameters" in text
    for kind, count in stats.per_module_type.items():
        assert f"| {kind} | {count:,} | {count / stats.num_entries:.1%} |" in text
    top_tensor, top_count = max(stats.per_tensor.items(), key=lambda item: (item[1], item[0]))
    assert f"| `{top_tensor}` | {top_count:,} |" in text or top_count == min(stats.per_tensor.values())
    assert "theta = theta_pre + gamma * (theta_ft - theta_pre)" in text


# ------------------------------------------------------------------------------------------ provenance
def test_a_top_k_graft_records_how_its_region_was_chosen(top_k, tmp_path):
    pre, model = top_k
    model.save_pretrained(tmp_path / "g")
    recorded = saved_config(tmp_path / "g")["region_provenance"]
    eligible = sum(p.numel() for p in pre.parameters())  # every GPT-2 tensor moved; none stored whole
    assert recorded == {
        "strategy": "movement",
        "start_entries": 123,
        "eligible_entries": eligible,
        "num_parameters": eligible,
        "learned": False,
        "kept": "strategy",
    }
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")
    assert loaded.peft_config["default"].region_provenance == recorded


def test_a_region_learned_by_mask_trainer_records_its_run_and_selected_mask(tmp_path):
    pre, model = learning_graft("roberta_cls", num_entries=20)
    args = fast_args(
        tmp_path, per_device_train_batch_size=8, max_steps=4, learning_rate=1e6, eval_strategy="steps", eval_steps=2,
        metric_for_best_model="accuracy", num_entries=20,
    )  # fmt: skip
    data = cls_dataset(16)
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=_accuracy)
    trainer.train()
    recorded = model.peft_config["default"].region_provenance
    step = trainer.mask_report["selected_step"]
    assert recorded["strategy"] == "movement" and recorded["start_entries"] == 20
    assert recorded["learned"] is True and recorded["trainer"] == "MaskTrainer" and recorded["steps_trained"] == 4
    assert recorded["search_space_entries"] is None  # the paper's dense S
    assert recorded["selected_step"] == step and recorded["selection_metric"] == "accuracy"
    assert recorded["kept"] == ("gamma_base" if step == 0 else "best evaluated mask")
    history = {h["step"]: h for h in trainer.state.log_history if "eval_accuracy" in h}
    if step:
        assert recorded["metrics"]["eval_accuracy"] == pytest.approx(history[step]["eval_accuracy"])
    assert recorded["selection_value"] == pytest.approx(recorded["metrics"]["eval_accuracy"])
    assert "selection_p_value" not in recorded  # no selection_alpha: no test

    model.save_pretrained(tmp_path / "g")
    assert saved_config(tmp_path / "g")["region_provenance"] == recorded
    text = card_parts(tmp_path / "g")[1]
    assert not any(marker in text for marker in NO_TEMPLATE)
    learned = "Learned by MaskTrainer (paper Eq. 3-4) from gamma_base, the `movement` region (20 entries) over 4 steps"
    assert f"{learned}, scores S over every eligible entry" in text
    if step:
        assert f"the best evaluated mask was kept (step {step})" in text
    else:
        assert "gamma_base was kept" in text
    assert f"selected on `accuracy` = {recorded['selection_value']:.4g}" in text
    assert f"| eval_accuracy | {recorded['metrics']['eval_accuracy']:.6g} |" in text
    check_graft_facts(text, model, pre)
    assert "| Stored whole (modules_to_save) | `classifier`: 1,122 parameters |" in text
    assert "from transformers import RobertaForSequenceClassification" in text


def test_a_significant_selection_records_its_p_value(tmp_path):
    pre, finetuned, x, labels = _two_class_task()
    model = get_peft_model(copy.deepcopy(pre), GraftConfig(finetuned=finetuned, num_entries=4, learn_region=True))
    data = Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})
    args = fast_args(
        tmp_path, per_device_train_batch_size=512, max_steps=10, learning_rate=1e4, num_entries=4,
        remove_unused_columns=False, eval_strategy="steps", eval_steps=2, metric_for_best_model="accuracy",
        selection_alpha=0.01,
    )  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=_accuracy)
    trainer.train()
    report, recorded = trainer.mask_report, model.peft_config["default"].region_provenance
    assert report["selected_step"] > 0
    assert recorded["kept"] == "best evaluated mask" and recorded["selected_step"] == report["selected_step"]
    assert recorded["selection_p_value"] == report["selection_p_value"]
    assert recorded["selection_alpha"] == 0.01 and recorded["evaluated_masks"] == report["evaluated_masks"] == 5
    model.save_pretrained(tmp_path / "g")
    _, text = card_parts(tmp_path / "g")
    assert f"sign test p-value {report['selection_p_value']:.3g} vs gamma_base, alpha 0.01 over 5 evaluated" in text
    assert "base = ...  # the pre-trained model" in text  # not a transformers model: no class to import


def test_gamma_base_kept_by_the_selection_is_recorded_without_a_p_value(tmp_path):
    from test_mask_selection import _planted_run

    kept_start, trainer, _, _ = _planted_run(tmp_path, selection_alpha=0.05)
    recorded = trainer.model.peft_config["default"].region_provenance
    assert kept_start and recorded["kept"] == "gamma_base" and recorded["selected_step"] == 0
    assert "selection_p_value" not in recorded and recorded["evaluated_masks"] == 4
    trainer.model.save_pretrained(tmp_path / "g")
    assert "gamma_base was kept: no learned mask beat it" in card_parts(tmp_path / "g")[1]


def test_a_checkpoint_of_a_region_being_learned_says_so(tmp_path):
    _, model = learning_graft("roberta_cls", num_entries=20)
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=2, learning_rate=1e6, save_strategy="steps",
                     save_steps=1, num_entries=20)  # fmt: skip
    MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16)).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    recorded = saved_config(checkpoint)["region_provenance"]
    assert recorded["kept"] is None and recorded["steps_trained"] == 1 and recorded["trainer"] == "MaskTrainer"
    assert "the region is still being learned" in card_parts(checkpoint)[1]
    final = model.peft_config["default"].region_provenance
    assert final["kept"] == "top num_entries of gamma" and final["steps_trained"] == 2


def test_a_run_that_reloads_its_best_checkpoint_records_whose_scores_it_hardened(tmp_path):
    _, model = learning_graft("roberta_cls", num_entries=20)
    args = fast_args(
        tmp_path, per_device_train_batch_size=8, max_steps=3, learning_rate=1e6, num_entries=20, keep_best_mask=False,
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=False,
    )  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16), eval_dataset=cls_dataset(8, seed=1))
    trainer.train()
    recorded = model.peft_config["default"].region_provenance
    best = trainer.state.best_global_step
    assert recorded["kept"] == "top num_entries of gamma" and recorded["scores_from_step"] == best
    evaluation = next(h for h in trainer.state.log_history if h.get("step") == best and "eval_loss" in h)
    assert recorded["metrics"]["eval_loss"] == pytest.approx(evaluation["eval_loss"])
    model.save_pretrained(tmp_path / "g")
    assert f"of the scores at step {best} (the best checkpoint)" in card_parts(tmp_path / "g")[1]


def test_harden_region_and_combined_adapters_record_their_provenance():
    _, model = learning_graft("roberta_cls", num_entries=20)
    model.base_model.harden_region(num_entries=10)
    recorded = model.peft_config["default"].region_provenance
    assert recorded["learned"] is True and "trainer" not in recorded and recorded["kept"] == "top num_entries of gamma"
    pre, finetuned, _ = make_pair("gpt2")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=30), adapter_name="first")
    model.add_adapter("second", GraftConfig(finetuned=finetuned, num_entries=30, region="random"))
    model.base_model.add_combined_adapter(["first", "second"], "both", combination="sum")
    assert model.peft_config["both"].region_provenance == {
        "strategy": "union", "learned": False, "kept": "combination", "combined_from": ["first", "second"],
        "combination": "sum",
    }  # fmt: skip
    assert model.peft_config["first"].region_provenance["strategy"] == "movement"
    assert model.peft_config["second"].region_provenance["strategy"] == "random"
    merge_grafts(model, ["first", "second"], "task_arithmetic", adapter_name="merged")
    merged = model.peft_config["merged"].region_provenance
    assert merged["kept"] == "combination" and merged["combination"] == "task_arithmetic"
    assert merged["combined_from"] == ["first", "second"]


@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_a_graft_saved_before_region_provenance_existed_still_loads(top_k, tmp_path, loader):
    pre, model = top_k
    model.save_pretrained(tmp_path / "g")
    path = tmp_path / "g" / "adapter_config.json"
    config = json.loads(path.read_text())
    del config["region_provenance"]
    path.write_text(json.dumps(config))
    if loader == "peft":
        loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")
        assert loaded.peft_config["default"].region_provenance is None
    else:
        loaded = clone_model(pre)
        loaded.load_adapter(str(tmp_path / "g"))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids()).logits, model(input_ids=input_ids()).logits)
    if loader == "peft":  # saved again: the card says what is not known
        loaded.save_pretrained(tmp_path / "again")
        text = card_parts(tmp_path / "again")[1]
        assert "not recorded (saved by a peft_graft older than `region_provenance`)" in text


@pytest.mark.parametrize(
    "value",
    ["movement", {"start_entries": 3}, {"strategy": 3}, {"strategy": "movement", "kept": "the best"},
     {"strategy": "movement", "metrics": {"eval_loss": float("nan")}},
     {"strategy": "movement", "x": {"a": {"b": [1]}}}],
)  # fmt: skip
def test_a_malformed_region_provenance_is_refused_naming_the_field(top_k, tmp_path, value):
    pre, model = top_k
    model.save_pretrained(tmp_path / "g")
    path = tmp_path / "g" / "adapter_config.json"
    config = json.loads(path.read_text())
    config["region_provenance"] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="region_provenance"):
        PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")


def test_region_provenance_marks_a_config_as_a_grafts(top_k, tmp_path):
    pre, model = top_k
    model.save_pretrained(tmp_path / "g")
    path = tmp_path / "g" / "adapter_config.json"
    config = json.loads(path.read_text())
    kept = {k: config[k] for k in ("peft_type", "task_type", "region_provenance")}
    path.write_text(json.dumps({**kept, "peft_type": "LORA"}))
    with pytest.raises(ValueError, match="holds a graft's fields \\(region_provenance\\)"):
        PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")


# ------------------------------------------------------------------------------------------ the card
def test_the_card_of_a_top_k_graft_replaces_peft_template_and_runs_as_written(top_k, tmp_path):
    pre, model = top_k
    folder = tmp_path / "g"
    model.save_pretrained(folder)
    meta, text = card_parts(folder)
    base = str(tmp_path / "base")  # a local folder: named by its name only (tests/test_hub_boundary.py)
    assert meta["library_name"] == "peft" and "base_model" not in meta
    assert {"graft", "skill-localization", "transformers"} <= set(meta["tags"])
    assert not any(marker in text for marker in NO_TEMPLATE)
    assert "# Graft of the model in a local folder, `base`" in text and base not in text
    check_graft_facts(text, model, pre)
    eligible = sum(p.numel() for p in pre.parameters())
    assert f"| Budget | `num_entries=123` (exact), chosen among the {eligible:,} eligible entries |" in text
    assert "| How the region was found | Chosen by the `movement` strategy (123 entries), not learned. |" in text
    assert "### Metrics" not in text  # no run recorded any
    snippet = code_block(text)
    assert "import peft_graft" in snippet and 'PeftModel.from_pretrained(base, "path/to/g")' in snippet
    assert str(tmp_path) not in (folder / "README.md").read_text()  # no machine's path (issue 60)
    namespace: dict = {}
    exec(snippet.replace("path/to/base", base).replace("path/to/g", str(folder)), namespace)  # runs as written
    with torch.no_grad():
        expected = model(input_ids=input_ids()).logits
        assert torch.equal(namespace["model"](input_ids=input_ids()).logits, expected)


def test_sparsity_is_stated_as_a_fraction_of_the_eligible_entries(tmp_path):
    pre, finetuned, _ = make_pair("gpt2")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, include_parameters="mlp"))
    eligible = sum(p.numel() for n, p in pre.named_parameters() if "mlp" in n)
    assert model.graft_stats().num_entries == round(0.05 * eligible)
    assert model.peft_config["default"].region_provenance["eligible_entries"] == eligible
    model.save_pretrained(tmp_path / "g")
    text = card_parts(tmp_path / "g")[1]
    assert f"`sparsity=0.05`: a fraction of the {eligible:,} eligible entries, not of all parameters" in text


def test_pushing_a_graft_uploads_its_card_naming_the_repository(top_k, tmp_path, monkeypatch):
    pre, model = top_k
    uploaded = tmp_path / "hub"
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=f"user/{repo_id}"))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, folder_path, **kw: shutil.copytree(folder_path, uploaded))
    model.push_to_hub("my-graft")
    meta, text = card_parts(uploaded)
    assert meta["library_name"] == "peft" and {"graft", "skill-localization"} <= set(meta["tags"])
    assert not any(marker in text for marker in NO_TEMPLATE)
    check_graft_facts(text, model, pre)
    assert 'PeftModel.from_pretrained(base, "user/my-graft")' in code_block(text)
    assert "Chosen by the `movement` strategy (123 entries), not learned." in text


def test_a_card_the_user_wrote_keeps_its_text_and_the_graft_part_is_replaced_on_each_save(top_k, tmp_path):
    _, model = top_k
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# My sentiment graft\n\nTrained on movie reviews.\n")
    model.save_pretrained(folder)
    model.save_pretrained(folder)
    meta, text = card_parts(folder)
    assert meta["license"] == "mit" and meta["library_name"] == "peft"
    assert text.count("# My sentiment graft") == 1 and "Trained on movie reviews." in text
    assert text.count("peft_graft card: start") == 1 and text.count("| Grafted entries | 123 |") == 1
    assert not any(marker in text for marker in NO_TEMPLATE)


def test_a_card_with_several_grafts_has_a_section_per_saved_adapter(tmp_path):
    pre, finetuned, _ = make_pair("gpt2")
    pre.save_pretrained(tmp_path / "base")
    base = type(pre).from_pretrained(tmp_path / "base")
    model = get_peft_model(base, GraftConfig(finetuned=finetuned, num_entries=40), adapter_name="first")
    model.add_adapter("second", GraftConfig(finetuned=finetuned, num_entries=60, region="random"))
    model.save_pretrained(tmp_path / "all")
    text = card_parts(tmp_path / "all")[1]
    assert "## Adapter `first`" in text and "## Adapter `second`" in text
    assert "| Grafted entries | 40 |" in text and "| Grafted entries | 60 |" in text
    assert "Chosen by the `random` strategy (60 entries), not learned." in text
    model.save_pretrained(tmp_path / "one", selected_adapters=["second"])
    text = card_parts(tmp_path / "one")[1]
    assert "| Grafted entries | 40 |" not in text and "| Grafted entries | 60 |" in text
    snippet = code_block(text)
    assert 'subfolder="second", adapter_name="second"' in snippet
    namespace: dict = {}
    snippet = snippet.replace("path/to/base", str(tmp_path / "base")).replace("path/to/one", str(tmp_path / "one"))
    exec(snippet, namespace)  # loads the graft from its sub-folder
    model.set_adapter("second")
    with torch.no_grad():
        assert torch.equal(namespace["model"](input_ids=input_ids()).logits, model(input_ids=input_ids()).logits)
