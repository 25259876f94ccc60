"""The peft and transformers methods the package wraps, because neither library offers a hook there.

Persistence (:mod:`.persistence`): atomic saves, checked loads through peft and through transformers' adapter API,
clear errors for malformed configs, ``push_to_hub`` with the graft's card. Here also: transformers'
``enable_adapters``, which re-enables adapter layers but not the ``modules_to_save`` heads its ``disable_adapters``
disabled (a graft stores a new classification head whole), so that a re-enabled graft model runs with its head; and
``Trainer.train`` and ``Trainer.evaluation_loop``, so that callbacks and metrics can clean up when they raise.
And the ``PeftModel`` methods that run a forward or change the model's state around the graft model's own, so that
they hold the lock threads serving the model take turns with (:mod:`.in_place`). Models without a graft adapter take
the original path everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

from peft import PeftConfig, PeftModel
from peft.auto import _BaseAutoPeftModel
from peft.utils import save_and_load
from peft.utils.other import AuxiliaryTrainingWrapper
from transformers import PreTrainedModel, Trainer, modeling_utils

from ..parameter_layout import num_base_parameters
from .in_place import model_forward, state_change
from .persistence import (
    is_graft_config,
    is_graft_model,
    wrap_auto_load,
    wrap_checkpoint_resolution,
    wrap_config_reader,
    wrap_load,
    wrap_peft_type_reader,
    wrap_push,
    wrap_safe_load_file,
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


def wrap_serving(original):
    """``PeftModel.forward``/``generate`` of a model without a task type, which call the base model directly: the
    whole forward holds the lock, as the graft model's own forward does (see :mod:`.in_place`)."""

    @functools.wraps(original)
    def serving(self, *args, **kwargs):
        if not is_graft_model(self):
            return original(self, *args, **kwargs)
        with model_forward(self.base_model):
            return original(self, *args, **kwargs)

    return serving


def wrap_state_change(original):
    """``PeftModel.add_adapter``/``delete_adapter``, which change the model in several steps around the graft
    model's: all of them under the lock, and refused inside a forward (see :mod:`.in_place`)."""

    @functools.wraps(original)
    def change(self, *args, **kwargs):
        if not is_graft_model(self):
            return original(self, *args, **kwargs)
        with state_change(f"{original.__name__}()"):
            return original(self, *args, **kwargs)

    return change


def wrap_parameter_count(original):
    """``PeftModel.get_nb_trainable_parameters``: for a graft model, ``(trainable, all)`` where ``all`` counts the
    parameters of the base model once (peft's count adds the graft's stored values, the scores S while a region is
    learned and the copies of heads stored whole, doubling it while S is dense) and ``trainable`` what training would
    update (S while learning, graft values peft marks trainable, heads stored whole): 0 for a hardened graft."""

    @functools.wraps(original)
    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        if not is_graft_model(self):
            return original(self)
        trainable, _ = original(self)
        return trainable, num_base_parameters(self.base_model.model)

    return get_nb_trainable_parameters


def wrap_parameter_report(original):
    """``PeftModel.print_trainable_parameters``: for a graft model, peft's line (with the counts of
    :func:`wrap_parameter_count`) and one line per graft saying what it holds and what trains."""

    @functools.wraps(original)
    def print_trainable_parameters(self) -> None:
        original(self)
        if is_graft_model(self):
            for line in graft_parameter_report(self):
                print(line)

    return print_trainable_parameters


def graft_parameter_report(model: PeftModel) -> list[str]:
    """One line per graft adapter of ``model``: its entries as a fraction of all parameters of the base model, and
    what of it trains (scores S while learning, its values, its heads stored whole)."""
    lines = []
    for name, config in model.peft_config.items():
        if not is_graft_config(config):
            continue
        graft_model = model.base_model
        stats = graft_model.graft_stats(name)
        total = stats.total_parameters or stats.num_parameters
        size = f"{stats.num_entries:,} entries = {stats.fraction_of_parameters:.4%} of all {total:,} parameters"
        learners = graft_model.region_learners(name)
        layers = graft_model.graft_layers().values()
        values = sum(
            int(layer.graft_values[name].numel())
            for layer in layers
            if name in layer.graft_values and layer.graft_values[name].requires_grad
        )
        head = head_trainable = 0
        for module_name, parameter in model.named_parameters():
            if f".modules_to_save.{name}." in module_name:
                head += parameter.numel()
                head_trainable += parameter.numel() if parameter.requires_grad else 0
        if learners:
            scores = sum(learner.scores.numel() for learner in learners.values() if learner.scores.requires_grad)
            dense = all(learner.is_dense for learner in learners.values())
            space = "every eligible entry, the paper's dense S" if dense else "a search space"
            text = f"graft {name!r}: learning its region: {scores:,} trainable scores S over {space}; "
            text += f"round(gamma) holds {size} now"
        else:
            text = f"graft {name!r}: {size} (a hard region)"
            text += f"; {values:,} trainable graft values" if values else "; its values are frozen"
        if head:
            state = "trainable" if head_trainable else "frozen"
            text += f"; heads stored whole (modules_to_save): {head:,} parameters, {state}"
        if not learners and not values and not head_trainable:
            text += ": trains nothing"
        lines.append(text)
    return lines


def method_wrappers() -> list[tuple[type | ModuleType, str, Callable]]:
    """``(class or module, method name, wrapper factory)`` of every library method the package wraps."""
    return [
        (PeftModel, "save_pretrained", wrap_save),
        (PeftModel, "load_adapter", wrap_load),
        (PeftModel, "push_to_hub", wrap_push),
        (_BaseAutoPeftModel, "from_pretrained", wrap_auto_load),
        (PeftModel, "forward", wrap_serving),
        (PeftModel, "generate", wrap_serving),
        (PeftModel, "add_adapter", wrap_state_change),
        (PeftModel, "delete_adapter", wrap_state_change),
        (PeftModel, "get_nb_trainable_parameters", wrap_parameter_count),
        (PeftModel, "print_trainable_parameters", wrap_parameter_report),
        (PeftConfig, "from_json_file", wrap_config_reader),
        (PeftConfig, "_get_peft_type", wrap_peft_type_reader),
        (PreTrainedModel, "load_adapter", wrap_transformers_load),
        (PreTrainedModel, "enable_adapters", wrap_transformers_enable),
        (Trainer, "train", wrap_trainer_train),
        (Trainer, "evaluation_loop", wrap_evaluation_loop),
        (save_and_load, "torch_load", wrap_torch_load),
        (save_and_load, "safe_load_file", wrap_safe_load_file),
        (modeling_utils, "_get_resolved_checkpoint_files", wrap_checkpoint_resolution),
    ]
