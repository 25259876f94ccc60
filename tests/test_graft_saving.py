"""Atomic saves, the model card and ``push_to_hub`` of graft adapters (no network: the upload is intercepted)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import peft.peft_model
import pytest
import torch
import yaml
from filelock import FileLock, Timeout
from huggingface_hub import HfApi
from peft import PeftModel, get_peft_model
from testing_utils import clone_model, finetune_like, input_ids, make_pair

from peft_graft import GraftConfig
from peft_graft.tuner import persistence


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=input_ids()).logits


@pytest.fixture
def graft(tmp_path):
    pre, finetuned, _ = make_pair("gpt2")
    pre.save_pretrained(tmp_path / "base")
    base = type(pre).from_pretrained(tmp_path / "base")  # records name_or_path for the card's base_model
    return pre, get_peft_model(base, GraftConfig(finetuned=finetuned, num_entries=123))


def side_files(folder) -> list[str]:
    """The hidden staging and backup folders beside a save of ``folder / "graft"`` (its lock file stays, as hf's)."""
    return [p.name for p in folder.iterdir() if p.name.startswith(".graft.") and p.name != ".graft.lock"]


def card_metadata(folder) -> dict:
    text = (folder / "README.md").read_text()
    return yaml.safe_load(text.split("---")[1])


def test_push_to_hub_uploads_a_reloadable_graft_with_its_card(graft, tmp_path, monkeypatch):
    pre, model = graft
    uploaded = tmp_path / "hub"
    calls = {}

    def create_repo(self, repo_id, private=None, exist_ok=False, **kwargs):
        calls["create_repo"] = (repo_id, private, exist_ok)
        return SimpleNamespace(repo_id=f"user/{repo_id}")

    def upload_folder(self, repo_id, folder_path, commit_message=None, revision=None, create_pr=False, **kwargs):
        calls["upload_folder"] = (repo_id, commit_message)
        shutil.copytree(folder_path, uploaded)
        return "https://huggingface.co/user/my-graft"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert model.push_to_hub("my-graft", private=True) == "https://huggingface.co/user/my-graft"
    assert calls["create_repo"] == ("my-graft", True, True)
    assert calls["upload_folder"] == ("user/my-graft", "Upload graft adapter")
    files = sorted(p.name for p in uploaded.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]

    meta = card_metadata(uploaded)
    assert meta["library_name"] == "peft"
    assert "base_model" not in meta  # a local folder's path is not a Hub id (tests/test_hub_boundary.py)
    assert {"graft", "skill-localization"} <= set(meta["tags"])
    card = (uploaded / "README.md").read_text()
    assert "| Grafted entries | 123 |" in card and "| Region strategy | `movement`" in card
    fraction = 123 / sum(p.numel() for p in pre.parameters())
    assert f"| Fraction of all parameters | {fraction:.4%} of the" in card

    reloaded = PeftModel.from_pretrained(clone_model(pre), uploaded)
    assert torch.equal(logits(reloaded), logits(model))


def test_interrupted_save_leaves_the_previous_adapter_intact(graft, tmp_path, monkeypatch):
    pre, model = graft
    target = tmp_path / "graft"
    model.save_pretrained(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=9), num_entries=50))
    original_save = peft.peft_model.safe_save_file

    def save_then_die(tensors, filename, metadata=None):
        original_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as handle:  # half-written file, then the process is interrupted
            handle.truncate(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(peft.peft_model, "safe_save_file", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        other.save_pretrained(target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if "saving" in p.name] == []  # no staging folder left behind

    monkeypatch.undo()
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(peft.peft_model, "safe_save_file", save_then_die)
        other.save_pretrained(fresh)
    assert not fresh.exists()  # an interrupted first save leaves no adapter at all
    monkeypatch.undo()
    other.save_pretrained(target)
    assert torch.equal(logits(PeftModel.from_pretrained(clone_model(pre), target)), logits(other))


@pytest.mark.parametrize("failing_move", [1, 2, 3])
def test_a_save_whose_move_fails_leaves_the_previous_adapter(graft, tmp_path, monkeypatch, failing_move):
    """A move that raises (a full disk, permissions) is undone at once: the previous files, bit for bit."""
    pre, model = graft
    target = tmp_path / "graft"
    model.save_pretrained(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    (target / "README.md").unlink()  # a file the new save adds rather than replaces
    before.pop("README.md")
    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=9), num_entries=50))
    real_replace, moves = persistence.os.replace, []

    def replace_or_fail(source, destination):
        moves.append(destination)
        if len(moves) == failing_move:
            raise OSError(5, "Input/output error")
        real_replace(source, destination)

    monkeypatch.setattr(persistence.os, "replace", replace_or_fail)
    with pytest.raises(OSError, match="Input/output"):
        other.save_pretrained(target)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert side_files(tmp_path) == []
    assert torch.equal(logits(PeftModel.from_pretrained(clone_model(pre), target)), logits(model))


def test_resaving_updates_the_card_section_instead_of_repeating_it(graft, tmp_path):
    _, model = graft
    model.save_pretrained(tmp_path / "g")
    model.save_pretrained(tmp_path / "g")
    card = (tmp_path / "g" / "README.md").read_text()
    assert card.count("peft_graft card: start") == card.count("| Grafted entries |") == 1


KILLED_SAVE = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from peft import get_peft_model
import peft_graft.tuner.persistence as persistence
from testing_utils import clone_model, finetune_like, make_pair
from peft_graft import GraftConfig

pre, _, _ = make_pair("gpt2")
model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=9), num_entries=50))
moves = []
real_replace = os.replace

def replace_then_die(source, target):
    real_replace(source, target)
    moves.append(target)
    if len(moves) == {moves}:
        os._exit(9)  # SIGKILL-like: no cleanup, no finally

persistence.os.replace = replace_then_die
model.save_pretrained({target!r})
"""


@pytest.mark.parametrize("moves", [1, 2, 3])
def test_save_killed_between_moves_is_undone_or_finished_by_the_next_load(graft, tmp_path, moves):
    import subprocess
    import sys
    from pathlib import Path

    pre, model = graft
    target = tmp_path / "graft"
    model.save_pretrained(target)
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), target=str(target), moves=moves)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    assert side_files(tmp_path)  # the killed save left folders

    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=9), num_entries=50))
    loaded = PeftModel.from_pretrained(clone_model(pre), target)
    files = sorted(p.name for p in target.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    # Card, weights and config move in that order: before the config moved, the previous adapter is restored.
    expected = other if moves == 3 else model
    assert torch.equal(logits(loaded), logits(expected))
    assert side_files(tmp_path) == []
    card = (target / "README.md").read_text()
    assert ("| Grafted entries | 50 |" in card) == (moves == 3)  # the card is restored with the rest


PAUSED_SAVE = """
import os, sys, time
sys.path.insert(0, {tests!r})
from peft import get_peft_model
import peft_graft.tuner.persistence as persistence
from testing_utils import clone_model, finetune_like, make_pair
from peft_graft import GraftConfig

pre, _, _ = make_pair("gpt2")
model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre, seed=9), num_entries=50))
real_replace = os.replace

def replace_then_pause(source, target):
    real_replace(source, target)
    if target.endswith("adapter_model.safetensors"):  # between the weights' move and the config's
        open({paused!r}, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists({go!r}):
            assert time.monotonic() < deadline
            time.sleep(0.01)

persistence.os.replace = replace_then_pause
model.save_pretrained({target!r})
"""


def test_saves_into_one_folder_from_two_processes_take_turns(graft, tmp_path, monkeypatch):
    """A saver paused between moving its weights and its config: a second process's save of the folder waits for
    it (the lock file beside the folder), so the folder ends with one whole graft, the last one saved."""
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    pre, model = graft
    target, paused, go = tmp_path / "graft", tmp_path / "paused", tmp_path / "go"
    script = PAUSED_SAVE.format(tests=str(Path(__file__).parent), target=str(target), paused=str(paused), go=str(go))
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not paused.exists():
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)

        waiting, saved, errors = threading.Event(), threading.Event(), []

        class NotedLock(FileLock):
            def acquire(self, *args, **kwargs):
                try:
                    return super().acquire(timeout=0)
                except Timeout:
                    waiting.set()  # held by the paused process
                    return super().acquire(*args, **kwargs)

        monkeypatch.setattr(persistence, "FileLock", NotedLock, raising=False)

        def save() -> None:
            try:
                model.save_pretrained(target)
            except BaseException as error:  # reported below
                errors.append(error)
            finally:
                saved.set()

        second = threading.Thread(target=save, daemon=True)
        second.start()
        while not (waiting.wait(0.01) or saved.is_set()):
            assert time.monotonic() < deadline
        go.touch()
        assert first.wait(120) == 0, first.communicate()[1]
        second.join(120)
        assert not second.is_alive() and not errors
    finally:
        go.touch()
        first.kill() if first.poll() is None else None
        first.communicate()
    loaded = PeftModel.from_pretrained(clone_model(pre), target)  # the weights match the config's checksum
    assert torch.equal(logits(loaded), logits(model))  # the second save, made after the first
