"""The peft and transformers methods the package wraps, because neither library offers a hook there.

Persistence (:mod:`.persistence`): atomic saves, checked loads through peft and through transformers' adapter API,
clear errors for malformed configs, ``push_to_hub`` with the graft's card. Here also: transformers'
``enable_adapters``, which re-enables adapter layers but not the ``modules_to_save`` heads its ``disable_adapters``
disabled (a graft stores a new classification head whole), so that a re-enabled graft model runs with its head.
Models without a graft adapter take the original path everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from peft import PeftConfig, PeftModel
from peft.utils.other import AuxiliaryTrainingWrapper
from transformers import PreTrainedModel

from .persistence import (
    _wrap_config_reader,
    _wrap_load,
    _wrap_peft_type_reader,
    _wrap_push,
    _wrap_save,
    _wrap_transformers_load,
    is_graft_config,
)


def _wrap_transformers_enable(original):
    @functools.wraps(original)
    def enable_adapters(self) -> None:
        original(self)
        if any(is_graft_config(config) for config in getattr(self, "peft_config", {}).values()):
            for module in self.modules():
                if isinstance(module, AuxiliaryTrainingWrapper):
                    module.enable_adapters(True)

    return enable_adapters


def method_wrappers() -> list[tuple[type, str, Callable]]:
    """``(class, method name, wrapper factory)`` of every library method the package wraps."""
    return [
        (PeftModel, "save_pretrained", _wrap_save),
        (PeftModel, "load_adapter", _wrap_load),
        (PeftModel, "push_to_hub", _wrap_push),
        (PeftConfig, "from_json_file", _wrap_config_reader),
        (PeftConfig, "_get_peft_type", _wrap_peft_type_reader),
        (PreTrainedModel, "load_adapter", _wrap_transformers_load),
        (PreTrainedModel, "enable_adapters", _wrap_transformers_enable),
    ]
