"""The peft and transformers methods the package wraps, because neither library offers a hook there.

Persistence (:mod:`.persistence`): atomic saves, checked loads through peft and through transformers' adapter API,
clear errors for malformed configs, ``push_to_hub`` with the graft's card. Here also: transformers'
``enable_adapters``, which re-enables adapter layers but not the ``modules_to_save`` heads its ``disable_adapters``
disabled (a graft stores a new classification head whole), so that a re-enabled graft model runs with its head; and
``Trainer.train`` and ``Trainer.evaluation_loop``, so that callbacks and metrics can clean up when they raise.
Models without a graft adapter take the original path everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from peft import PeftConfig, PeftModel
from peft.utils import save_and_load
from peft.utils.other import AuxiliaryTrainingWrapper
from transformers import PreTrainedModel, Trainer, modeling_utils

from .persistence import (
    is_graft_config,
    wrap_checkpoint_resolution,
    wrap_config_reader,
    wrap_load,
    wrap_peft_type_reader,
    wrap_push,
    wrap_save,
    wrap_torch_load,
    wrap_transformers_load,
)


def wrap_transformers_enable(original):
    @functools.wraps(original)
    def enable_adapters(self) -> None:
        original(self)
        if any(is_graft_config(config) for config in getattr(self, "peft_config", {}).values()):
            for module in self.modules():
                if isinstance(module, AuxiliaryTrainingWrapper):
                    module.enable_adapters(True)

    return enable_adapters


def wrap_trainer_train(original):
    """``Trainer.train``: when it raises, each callback's ``on_train_error()`` (where one defines it, e.g.
    ``RestrictTrainingCallback``) runs, since the Trainer has no such event and hooks a callback attached to the model
    would otherwise outlive the run."""

    @functools.wraps(original)
    def train(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            for callback in self.callback_handler.callbacks:
                on_error = getattr(callback, "on_train_error", None)
                if callable(on_error):
                    on_error()
            raise

    return train


def wrap_evaluation_loop(original):
    """``Trainer.evaluation_loop``: when it raises, a ``compute_metrics`` with a ``reset()`` (e.g.
    ``CalibrationMetrics``, which keeps the batches of ``batch_eval_metrics``) forgets the failed evaluation."""

    @functools.wraps(original)
    def evaluation_loop(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            reset = getattr(self.compute_metrics, "reset", None)
            if callable(reset):
                reset()
            raise

    return evaluation_loop


def method_wrappers() -> list[tuple[type | ModuleType, str, Callable]]:
    """``(class or module, method name, wrapper factory)`` of every library method the package wraps."""
    return [
        (PeftModel, "save_pretrained", wrap_save),
        (PeftModel, "load_adapter", wrap_load),
        (PeftModel, "push_to_hub", wrap_push),
        (PeftConfig, "from_json_file", wrap_config_reader),
        (PeftConfig, "_get_peft_type", wrap_peft_type_reader),
        (PreTrainedModel, "load_adapter", wrap_transformers_load),
        (PreTrainedModel, "enable_adapters", wrap_transformers_enable),
        (Trainer, "train", wrap_trainer_train),
        (Trainer, "evaluation_loop", wrap_evaluation_loop),
        (save_and_load, "torch_load", wrap_torch_load),
        (modeling_utils, "_get_resolved_checkpoint_files", wrap_checkpoint_resolution),
    ]
