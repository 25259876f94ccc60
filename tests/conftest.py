"""pytest set-up: offline Hugging Face, quiet transformers, the graft method registered, the ``arch``,
``one_thread``, ``gpt2_pair`` and ``saved_gpt2`` fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported: it reads this once

import pytest
import torch
from peft import get_peft_model
from testing_utils import ARCHITECTURES, clone_model, make_pair
from transformers.utils import logging as hf_logging

from peft_graft import GraftConfig  # also registers the graft method

hf_logging.set_verbosity_error()


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models run
    as fast on one, and a busy machine does not slow them down by thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt2_pair():
    """A tiny GPT-2, its fine-tuned copy and task type (``make_pair("gpt2")``), once per module."""
    return make_pair("gpt2")


@pytest.fixture
def saved_gpt2(gpt2_pair, tmp_path):
    """A graft of ``gpt2_pair`` (sparsity 0.02) saved with ``save_pretrained`` in ``tmp_path / "graft"``."""
    pre, finetuned, task_type = gpt2_pair
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.02, task_type=task_type))
    model.save_pretrained(tmp_path / "graft")
    return tmp_path / "graft"
