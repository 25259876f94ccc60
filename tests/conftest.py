"""pytest set-up: offline Hugging Face, quiet transformers, the graft method registered, the ``arch`` and
``one_thread`` fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported: it reads this once

import pytest
import torch
from testing_utils import ARCHITECTURES
from transformers.utils import logging as hf_logging

import peft_graft  # noqa: F401  (registers the graft method)

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
