"""pytest set-up: offline Hugging Face, quiet transformers, the graft method registered, the ``arch`` fixture."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported: it reads this once

import pytest
from testing_utils import ARCHITECTURES
from transformers.utils import logging as hf_logging

import peft_graft  # noqa: F401  (registers the graft method)

hf_logging.set_verbosity_error()


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param
