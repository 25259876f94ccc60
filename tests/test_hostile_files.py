"""Issue 60, files that are not what they claim: an adapter config, weights file, fine-tuned checkpoint or saved region
that is a link to a device (``/dev/zero`` reads without end, ``/dev/urandom`` too), a named pipe (``open`` waits for a
writer forever) or a folder is a ``ValueError`` naming the path at once, for every loader, and the model is left as
it was.

Each load runs under an alarm: a loader that reads without bound or waits would fail the test (``TimeoutError``)
instead of hanging the run."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from testing_utils import clone_model, input_ids

from peft_graft import GraftConfig, Region
from peft_graft._checksum import file_checksum
from peft_graft._files import read_file, read_json

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX only")

LIMIT_S = 20  # far above a refused load (well under a second); reading /dev/zero would not finish


@contextmanager
def bounded():
    """Fail with ``TimeoutError`` if the block runs longer than ``LIMIT_S`` (a read without end, a wait on a FIFO)."""

    def expire(*_):
        raise TimeoutError("the load read without bound or waited forever")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _link(target):
    def make(path):
        os.symlink(target, path)

    return make


def _fifo(path):
    os.mkfifo(path)


def _link_to_fifo(path):
    os.mkfifo(f"{path}.pipe")
    os.symlink(f"{path}.pipe", path)


def _folder(path):
    os.mkdir(path)


def _link_to_folder(path):
    os.mkdir(f"{path}.d")
    os.symlink(f"{path}.d", path)


HOSTILE = {
    "/dev/zero": (_link("/dev/zero"), "a character device"),
    "/dev/urandom": (_link("/dev/urandom"), "a character device"),
    "fifo": (_fifo, r"a named pipe \(FIFO\)"),
    "link to a fifo": (_link_to_fifo, r"a named pipe \(FIFO\)"),
    "folder": (_folder, "a folder"),
    "link to a folder": (_link_to_folder, "a folder"),
}
FILES = {"weights": ("adapter_model.safetensors", "adapter weights file"), "config": ("adapter_config.json",
                                                                                      "adapter config")}  # fmt: skip


def replace(folder, name: str, hostile: str) -> str:
    path = folder / name
    path.unlink()
    HOSTILE[hostile][0](str(path))
    return str(path)


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("file", list(FILES))
@pytest.mark.parametrize("loader", ["peft", "load_adapter", "transformers"])
def test_an_adapter_file_that_is_not_a_regular_file_is_refused_naming_it(gpt2_pair, saved_gpt2, hostile, file, loader):
    pre = gpt2_pair[0]
    path = replace(saved_gpt2, FILES[file][0], hostile)
    base = clone_model(pre)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=gpt2_pair[1], sparsity=0.01)) if loader == (
        "load_adapter") else None  # fmt: skip
    expected = model(input_ids()).logits if model is not None else None
    load = {
        "peft": lambda: PeftModel.from_pretrained(base, str(saved_gpt2)),
        "load_adapter": lambda: model.load_adapter(str(saved_gpt2), adapter_name="other"),
        "transformers": lambda: base.load_adapter(str(saved_gpt2)),
    }[loader]
    kind = HOSTILE[hostile][1]
    with bounded(), pytest.raises(ValueError, match=rf"The {FILES[file][1]} '{path}' is {kind}.*not a regular file"):
        load()
    if model is not None:  # the model is left as it was
        assert list(model.peft_config) == ["default"] and torch.equal(model(input_ids()).logits, expected)
    else:
        assert not getattr(base, "_hf_peft_config_loaded", False)


@pytest.mark.parametrize("hostile", ["/dev/zero", "fifo", "folder"])
def test_auto_loading_and_saved_regions_refuse_them_too(gpt2_pair, saved_gpt2, hostile):
    path = replace(saved_gpt2, "adapter_model.safetensors", hostile)
    with bounded():
        with pytest.raises(ValueError, match=rf"'{path}' is .*not a regular file"):
            Region.from_pretrained(saved_gpt2, gpt2_pair[0])
        with pytest.raises(ValueError, match=rf"'{path}' is .*not a regular file"):
            AutoPeftModelForCausalLM.from_pretrained(saved_gpt2)


@pytest.mark.parametrize("hostile", ["/dev/zero", "fifo", "folder"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_finetuned_checkpoint_that_is_not_a_regular_file_is_refused_naming_it(gpt2_pair, tmp_path, hostile, layout):
    """theta_ft streamed from a folder (scores/checkpoint.py): its model.safetensors, or a shard, is refused."""
    pre, finetuned, _ = gpt2_pair
    folder = tmp_path / "ft"
    finetuned.save_pretrained(folder, max_shard_size="50MB" if layout == "single" else "20KB")
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    assert (len(names) == 1) == (layout == "single")
    name = names[-1]
    path = replace(folder, name, hostile)
    with bounded(), pytest.raises(ValueError, match=rf"'{path}' is .*not a regular file"):
        get_peft_model(clone_model(pre), GraftConfig(finetuned=str(folder), sparsity=0.01))


def test_the_checked_reads_read_regular_files_to_their_size(tmp_path):
    (tmp_path / "a.json").write_text('{"a": [1, 2]}')
    assert read_json(tmp_path / "a.json") == {"a": [1, 2]}
    assert read_file(tmp_path / "a.json") == b'{"a": [1, 2]}'
    assert file_checksum(tmp_path / "a.json").startswith("sha256:")
    os.symlink(tmp_path / "a.json", tmp_path / "link.json")
    assert read_json(tmp_path / "link.json") == {"a": [1, 2]}  # a link to a regular file is read as it
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "missing")
    os.mkfifo(tmp_path / "pipe")
    with bounded(), pytest.raises(ValueError, match=r"'.*pipe' is a named pipe \(FIFO\), not a regular file"):
        read_file(tmp_path / "pipe")


@pytest.mark.parametrize("hostile", ["/dev/zero", "fifo"])
def test_a_finetuned_path_that_is_not_a_regular_file_is_refused_naming_it(gpt2_pair, tmp_path, hostile):
    """It was taken for a Hub id ("Repo id must be in the form ...")."""
    path = tmp_path / "ft.safetensors"
    HOSTILE[hostile][0](str(path))
    with bounded(), pytest.raises(ValueError, match=rf"The fine-tuned checkpoint '{path}' is {HOSTILE[hostile][1]}"):
        get_peft_model(clone_model(gpt2_pair[0]), GraftConfig(finetuned=str(path), sparsity=0.01))
