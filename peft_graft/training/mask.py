"""``MaskTrainer``: learn the grafting region of a graft PeftModel (Panigrahi et al., ICML 2023, section 2.3).

Only the scores ``S`` are trained: ``gamma = gamma_base * (1 - sigmoid(S)) + (1 - gamma_base) * sigmoid(S)`` (Eq. 4)
and the loss is that of ``theta_pre + gamma * (theta_ft - theta_pre)`` (Eq. 3). Evaluation applies the hard mask that
hardening would keep (``round(gamma)``, or exactly ``num_entries`` entries of largest ``gamma``), every checkpoint is a
loadable sparse graft of it (the dense ``S`` rides along in ``graft_scores.safetensors`` for resuming only), and after
training the model holds that hard sparse graft, or the best one evaluated (``keep_best_mask``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import TrainOutput

from .._files import check_file
from ..parameter_layout import NO_ENTRIES, num_base_parameters
from ..sharding import deepspeed_refusal, gathered
from ..tuner.layer import graft_state_modules
from ..tuner.learning import RegionLearner, harden_exact
from ..tuner.model import GraftModel
from ..tuner.provenance import numeric_metrics
from .losses import LossTermsTrainer
from .mask_selection import Entries, SignificantSelection, copy_entries, per_example_correct, region_change

logger = logging.getLogger(__name__)

SCORES_NAME = "graft_scores.safetensors"
FINGERPRINT_KEY = "learning_fingerprint"  # metadata of SCORES_NAME: see MaskTrainer.learning_fingerprint
LABEL_KEYS = ("labels", "label", "label_ids", "start_positions")
OVERSHOOT = 3  # round(gamma) this many times the num_entries budget: most of the learned region is trimmed away


@dataclass
class MaskTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose defaults are the paper's mask training (section 3), plus the mask fields.

    Paper defaults: SGD without momentum or weight decay (``optim="sgd"``, ``weight_decay=0``), ``learning_rate=1e7``,
    ``max_steps=100``, a constant schedule without warmup, no gradient clipping (``max_grad_norm=0``), and a global
    batch of 1024 examples or the whole training set when it is smaller (``mask_batch_size``, reached with gradient
    accumulation). Every field can be changed.

    Args:
        mask_batch_size: Global batch of one mask step (all processes, all accumulation steps). ``MaskTrainer``
            derives ``gradient_accumulation_steps`` from it, ``per_device_train_batch_size`` and the world size;
            the whole training set when it is smaller. ``None``: use the batch arguments as given.
        num_entries: Exact budget after training: keep the ``num_entries`` entries of largest ``gamma``. ``None``:
            keep ``round(gamma)`` (the paper).
        l1_penalty: Weight of an optional ``l1_penalty * sum(sigmoid(S))`` added to the training loss (the paper's
            alternative to few steps). ``0`` disables it.
        mask_dropout: Keep dropout on while learning S (the model in training mode, as any ``Trainer`` runs it).
            Default ``False``: the model runs in eval mode during mask training, as in the paper's reference code, so
            a step is a deterministic function of S and the batch.
        keep_best_mask: When evaluation runs during training and ``metric_for_best_model`` is set, evaluate the
            starting mask (``gamma_base``) before the first step too, and end with the best evaluated mask instead of
            the last one (ties keep the earlier mask), so a run never returns a mask worse than ``gamma_base`` on its
            selection metric. A run resumed from a checkpoint compares gamma_base and the masks evaluated after
            resuming.
        select_on_train: Also evaluate the hard mask on the training set at each evaluation and report
            ``eval_train_plus_eval_<metric>`` (the paper picks the mask by train + validation score); use it with
            ``metric_for_best_model="train_plus_eval_<metric>"`` and ``load_best_model_at_end=True``.
        selection_alpha: With ``keep_best_mask``: a learned mask replaces gamma_base only if it is more accurate on
            the selection examples (eval, plus train with ``select_on_train``) by a one-sided exact sign test at level
            ``selection_alpha / m``, m the learned masks evaluated (see :mod:`.mask_selection`); the best selection
            metric among those that pass wins. Needs ``metric_for_best_model`` to be an accuracy and one label per
            example. ``None``: the best selection metric wins, however small the margin (the paper).
        recompute_soft_parameters: With dense S, rebuild ``theta_pre + gamma * delta`` of every learning layer in
            backward instead of letting the layers' ops keep it from the forward, as ``gradient_checkpointing`` does
            for activations: saves one copy of those layers' parameters (in the model's dtype) and one fp32 tensor
            of their size (``sigmoid'(S) * delta``, kept otherwise for the gradient of S) while the forward's
            activations are held, at the cost of a sigmoid and a multiply-add over them per step. ``None``: on under
            FSDP (where memory is why the model is sharded), off otherwise.
    """

    learning_rate: float = field(default=1e7, metadata={"help": "Learning rate of S (paper: 1e7)."})
    max_steps: int = field(default=100, metadata={"help": "Mask-training steps (paper: 100)."})
    optim: str = field(default="sgd", metadata={"help": "Optimizer of S (paper: SGD without momentum)."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule (paper: constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay on S (paper: none)."})
    warmup_steps: float = field(default=0, metadata={"help": "Warmup steps (paper: none)."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Gradient clipping of S (paper: none; 0 = off)."})
    mask_batch_size: int | None = field(
        default=1024, metadata={"help": "Global batch of a mask step, or the full training set when smaller."}
    )
    num_entries: int | None = field(
        default=None, metadata={"help": "Exact number of grafted entries after training; None = round(gamma)."}
    )
    l1_penalty: float = field(default=0.0, metadata={"help": "Weight of l1_penalty * sum(sigmoid(S)) in the loss."})
    mask_dropout: bool = field(
        default=False, metadata={"help": "Keep dropout on while learning S (default off, as the reference code)."}
    )
    keep_best_mask: bool = field(
        default=True,
        metadata={
            "help": "With evaluation and metric_for_best_model: keep the best evaluated mask, gamma_base included."
        },
    )
    select_on_train: bool = field(
        default=False, metadata={"help": "Also evaluate on the training set; report train + eval metric sums."}
    )
    selection_alpha: float | None = field(
        default=None,
        metadata={
            "help": "Keep a learned mask over gamma_base only if a sign test on the selection examples finds it more "
            "accurate at this level (Bonferroni over the evaluated masks). None: the best metric wins (the paper)."
        },
    )
    recompute_soft_parameters: bool | None = field(
        default=None,
        metadata={
            "help": "Dense S: rebuild the soft parameters in backward instead of keeping them (less memory, a slower "
            "step). None: on under FSDP, off otherwise."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_entries is not None:
            if isinstance(self.num_entries, bool) or not isinstance(self.num_entries, int):
                raise TypeError(f"num_entries must be an int or None, got {type(self.num_entries).__name__}.")
            if self.num_entries < 1:
                raise ValueError(
                    f"num_entries={self.num_entries}: a graft needs at least 1 entry. Use None to keep round(gamma)."
                )
        if self.mask_batch_size is not None and (
            isinstance(self.mask_batch_size, bool)
            or not isinstance(self.mask_batch_size, int)
            or self.mask_batch_size < 1
        ):
            raise ValueError(f"mask_batch_size must be a positive int or None, got {self.mask_batch_size!r}.")
        if isinstance(self.learning_rate, bool) or not (0.0 < self.learning_rate < math.inf):
            raise ValueError(
                f"learning_rate must be a finite number > 0, got {self.learning_rate}: the paper's mask training uses "
                "1e7."
            )
        if self.selection_alpha is not None:
            check_selection_alpha(self.selection_alpha)
        if not (self.l1_penalty >= 0.0) or math.isinf(self.l1_penalty):
            raise ValueError(f"l1_penalty must be a finite number >= 0, got {self.l1_penalty}.")
        if self.recompute_soft_parameters is not None and not isinstance(self.recompute_soft_parameters, bool):
            raise TypeError(
                f"recompute_soft_parameters must be True, False or None, got {self.recompute_soft_parameters!r}."
            )


def check_selection_alpha(value: Any) -> None:
    """``selection_alpha`` must be a level in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"selection_alpha must be a level in (0, 1) or None, got {value!r} (e.g. 0.05).")


class ScoreL1Penalty:
    """``strength * sum(sigmoid(S))`` over the scores of region learners (a loss term, logged as ``mask_l1``)."""

    name = "mask_l1"

    def __init__(self, learners: list[RegionLearner], strength: float) -> None:
        self.learners = learners
        self.strength = strength

    def __call__(self) -> torch.Tensor:
        return self.strength * sum(torch.sigmoid(learner.scores).sum() for learner in self.learners)


class MaskTrainer(LossTermsTrainer):
    """A ``transformers.Trainer`` that learns the region of a graft PeftModel and leaves the hard sparse graft.

    The model must come from ``get_peft_model(pre, GraftConfig(finetuned=ft, learn_region=True, ...))``. All its
    parameters are frozen except the scores ``S``. The loss is whatever the model returns (or ``compute_loss_func``),
    plus the optional L1 penalty. After :meth:`train`, ``trainer.model`` holds the hard region and
    ``trainer.mask_report`` the number of grafted entries before (``round(gamma)``) and after the exact budget.
    """

    def __init__(self, model: PeftModel | None = None, args: MaskTrainingArguments | None = None, **kwargs: Any):
        adapter_name = _check_model(model)
        if args is None:
            args = MaskTrainingArguments(output_dir="mask_trainer_output")
        if not isinstance(args, MaskTrainingArguments):
            raise TypeError(
                f"args must be MaskTrainingArguments (the paper's defaults and the mask fields), got "
                f"{type(args).__name__}: use MaskTrainingArguments(output_dir=..., ...)."
            )
        if args.fsdp and (args.fsdp_plugin_args or {}).get("fsdp_version", 2) != 2:
            _refuse_engine("FSDP v1 (fsdp_config version 1)")
        args = copy.copy(args)  # the derived gradient_accumulation_steps is this trainer's, not the caller's
        _configure_global_batch(args, kwargs.get("train_dataset"))
        for name, param in model.named_parameters():  # only S is trained (heads in modules_to_save stay theta_ft)
            param.requires_grad_(f"graft_learning.{adapter_name}.scores" in name)
        super().__init__(model=model, args=args, **kwargs)
        self.adapter_name = adapter_name
        self._zero3 = self._prepare_deepspeed()
        self._sharded = self._prepare_sharding()
        self._set_soft_parameter_recomputation()
        # Each micro-batch loss is taken as a mean and divided by the accumulation steps, so that a step's gradient is
        # that of the mean loss over the global batch on any number of processes (many heads, e.g. sequence
        # classification, ignore the num_items_in_batch the Trainer would otherwise rely on).
        self.model_accepts_loss_kwargs = False
        learners = self.region_learners()
        self._num_moved = sum(int(learner.moved().sum()) for learner in learners.values())
        self._num_parameters = num_base_parameters(model.base_model.model)  # fraction_of_parameters' denominator
        if args.l1_penalty:
            self.loss_terms.append(ScoreL1Penalty(list(learners.values()), args.l1_penalty))
        self.mask_report: dict[str, float] = {}
        self._selection_report: dict[str, float] = {}
        self._tracking_best = False  # while train() keeps the best evaluated mask (keep_best_mask)
        self._best: tuple[float, int, Entries] | None = None
        self._selection: SignificantSelection | None = None  # with selection_alpha, while train() runs
        self._correct: dict[str, np.ndarray] = {}  # per-example correctness of the last evaluations, by prefix
        self._evaluations: dict[int, dict[str, float]] = {}  # metrics of each mask evaluated while learning, by step
        if args.selection_alpha is not None:
            _check_selection_setup(args, self.eval_dataset)
        if isinstance(self.eval_dataset, dict) and args.keep_best_mask and args.metric_for_best_model is not None:
            raise ValueError(
                f"keep_best_mask selects the mask on one evaluation set, but eval_dataset is a dict of "
                f"{len(self.eval_dataset)} ({sorted(self.eval_dataset)}): pass the selection set alone as "
                "eval_dataset (evaluate the others after training), or set keep_best_mask=False."
            )
        self._fingerprint: str | None = None
        self.add_callback(_StartingMaskEvaluation(self))

    def _set_soft_parameter_recomputation(self) -> None:
        """``recompute_soft_parameters`` on every graft layer (``None``: on where FSDP2 shards the model)."""
        recompute = self.args.recompute_soft_parameters
        for layer in self.model.base_model.graft_layers().values():
            layer.recompute_soft_parameters = self._sharded if recompute is None else recompute

    # ------------------------------------------------------------------------------------------ FSDP2
    def _prepare_sharding(self) -> bool:
        """Whether this run shards the model with FSDP2 (Trainer ``fsdp``/``fsdp_config`` or an accelerate config).

        FSDP2 then shards the frozen model; the graft's own state (S, the hard regions, heads stored whole) stays whole
        on every process as FSDP's ignored parameters, as under DDP: S's gradient is averaged over the processes once
        per step (:meth:`_average_score_gradients`), and hardening, evaluation and saving read S as one process does.
        Other engines are refused with a clear error."""
        if not self.is_fsdp_enabled:
            return False
        plugin = self.accelerator.state.fsdp_plugin
        if plugin.fsdp_version != 2:
            _refuse_engine("FSDP v1 (fsdp_version 1 in the accelerate config)")
        if plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "MaskTrainer under FSDP2 needs cpu_ram_efficient_loading off: the graft (theta_pre, S, the movement) "
                "is built on every process before the Trainer shards the model: there is nothing to load from rank 0. "
                "Set fsdp_config['cpu_ram_efficient_loading'] = False (fsdp_cpu_ram_efficient_loading: false)."
            )
        graft_state = graft_state_modules(self.model)
        for module in graft_state:
            module.to(self.args.device)  # FSDP moves only what it shards
        ignored = plugin.ignored_modules or []
        if isinstance(ignored, str):  # accelerate's regex over module names
            ignored = [module for name, module in self.model.named_modules() if re.fullmatch(ignored, name)]
        plugin.ignored_modules = [*ignored, *graft_state]
        return True

    # ------------------------------------------------------------------------------------------ DeepSpeed ZeRO-3
    def _prepare_deepspeed(self) -> bool:
        """Whether this run partitions the model with DeepSpeed ZeRO-3 (``TrainingArguments(deepspeed=...)`` or an
        accelerate config); other ZeRO stages are refused.

        ZeRO-3 partitions every parameter, S included, and gathers a module's own parameters around its forward. A
        graft layer reads its base tensors and S in its own forward, so each of them is registered as an external
        parameter of the graft layer (``deepspeed.zero.register_external_parameter``): ZeRO-3 gathers them for its
        forward and backward, and reduce-scatters S's gradient (averaged, as DDP does) once autograd has accumulated
        it. (Not a ZeRO-3 leaf module: ZeRO-3 reduces a leaf's gradients from a module backward hook, which can fire
        before S's gradient is computed, as it did for the embeddings, whose inputs need no gradient.)
        Outside the forward, hardening, evaluation of the hard mask and saving gather S (:meth:`_whole_scores`) and
        read theta_pre at the entries with :func:`~peft_graft.sharding.read_entries`; each of them is a collective."""
        if not self.is_deepspeed_enabled:
            return False
        stage = self.accelerator.state.deepspeed_plugin.zero_stage
        action = "MaskTrainer (TrainingArguments(deepspeed=...) or an accelerate config with DeepSpeed)"
        if stage != 3:
            raise deepspeed_refusal(action, f"DeepSpeed ZeRO-{stage}")
        args, why = self.args, None
        if args.l1_penalty:
            why = "l1_penalty reads S outside the graft layers' forward, where ZeRO-3 holds none of it: set it to 0"
        elif args.load_best_model_at_end:
            why = "load_best_model_at_end reloads S into a partitioned parameter: set load_best_model_at_end=False"
        elif any(layer.tied_sources for layer in self.model.base_model.graft_layers().values()):
            why = (
                "a graft layer applies the entries of a tied tensor stored on another layer, whose S ZeRO-3 does not "
                "gather for it: untie the weights (tie_word_embeddings=False)"
            )
        layers = self.model.base_model.graft_layers().values()
        if why is None:  # the empty starts dropped below are no such parameter; checked before anything changes
            dropped = {id(layer.empty_start(self.adapter_name)) for layer in layers} - {id(None)}
            sizes = ((name, getattr(param, "ds_numel", param.numel())) for name, param in self.model.named_parameters()
                     if id(param) not in dropped)  # fmt: skip
            empty = next((name for name, size in sizes if not size), None)
            if empty is not None:
                why = (
                    f"{empty!r} is empty, and DeepSpeed ZeRO-3 cannot gather an empty parameter: delete the adapter "
                    "holding it (delete_adapter) before training"
                )
        if why is not None:
            raise ValueError(f"{action} under DeepSpeed ZeRO-3: {why}, or use DDP or FSDP2. See docs/fsdp.md.")
        for layer in layers:
            layer.drop_empty_start(self.adapter_name)
        import deepspeed

        for layer in self.model.base_model.graft_layers().values():
            for param in layer.parameters():  # its base tensors, S and stored regions: gathered for its forward
                deepspeed.zero.register_external_parameter(layer, param)
        return True

    @staticmethod
    def _zero3_resume_refusal(path: str) -> ValueError:
        return ValueError(
            f"Resuming mask training ({path}) under DeepSpeed ZeRO-3 would write S into a partitioned parameter behind "
            "the engine's fp32 copy: resume in one process, under DDP or under FSDP2 (a checkpoint's "
            f"{SCORES_NAME} holds the whole S), or train again. See docs/fsdp.md."
        )

    def _whole_scores(self):
        """A context in which every S is whole on every process (ZeRO-3 gathers them: a collective); nothing
        otherwise."""
        return gathered(learner.scores for learner in self.region_learners().values())

    def _average_score_gradients(self) -> list[Any]:
        """Under FSDP2: hooks averaging each S gradient over the processes once it holds a whole step's gradient (the
        last micro-batch of an accumulation), before clipping and the optimizer see it, as DDP does."""
        world_size, accelerator = self.args.world_size, self.accelerator

        def average(scores: torch.Tensor) -> None:
            if accelerator.sync_gradients:
                torch.distributed.all_reduce(scores.grad)
                scores.grad.div_(world_size)

        return [
            learner.scores.register_post_accumulate_grad_hook(average) for learner in self.region_learners().values()
        ]

    @contextmanager
    def _plain_optimizer_checkpoint(self) -> Iterator[None]:
        """The optimizer of S is not FSDP's (S is not sharded): save and load its state as one process does."""
        fsdp, self.is_fsdp_enabled = self.is_fsdp_enabled, False
        try:
            yield
        finally:
            self.is_fsdp_enabled = fsdp

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with self._plain_optimizer_checkpoint():
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with self._plain_optimizer_checkpoint():
            super()._load_optimizer_and_scheduler(checkpoint)

    # ------------------------------------------------------------------------------------------ mask state
    def region_learners(self) -> dict[str, RegionLearner]:
        """The learning state of the region by module name (empty once hardened)."""
        graft_model: GraftModel = self.model.base_model
        return graft_model.region_learners(self.adapter_name)

    def num_grafted_entries(self) -> int:
        """Size of the current hard region (``round(gamma)`` while learning)."""
        learners = self.region_learners()
        if learners:
            with self._whole_scores():
                return sum(learner.num_hard_entries() for learner in learners.values())
        return self.model.base_model.get_region(self.adapter_name).num_entries

    def kept_entries(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The hard region hardening would keep now, by module: ``round(gamma)``, or the ``num_entries`` of largest
        gamma (at most the moved entries)."""
        learners = self.region_learners()
        with self._whole_scores():
            if self.args.num_entries is None:
                return {module: learner.harden() for module, learner in learners.items()}
            return harden_exact(learners, min(self.args.num_entries, self._num_moved))

    def starting_entries(self) -> Entries:
        """The starting mask gamma_base (its moved entries), by module."""
        entries = {}
        for module, learner in self.region_learners().items():
            positions = torch.sort(learner.base_region).values
            entries[module] = learner.entries_at(positions[learner.moved()[positions]])
        return entries

    @contextmanager
    def hard_mask(self, entries: Entries | None = None) -> Iterator[Entries]:
        """Within this context the model applies a hard region, by default the one it would keep
        (:meth:`kept_entries`), as the paper evaluates; yields those entries."""
        learners = self.region_learners()
        if entries is None:
            entries = self.kept_entries() if learners else {}
        for module, learner in learners.items():
            learner.hard = entries.get(module, NO_ENTRIES)
        try:
            yield entries
        finally:
            for learner in learners.values():
                learner.hard = None

    def _scores_state(self) -> dict[str, torch.Tensor]:
        with self._whole_scores():
            return {
                module: learner.scores.detach().cpu().contiguous().clone()
                for module, learner in self.region_learners().items()
            }

    def learning_fingerprint(self) -> str:
        """A digest of what the scores belong to: each module's search space, gamma_base and movement, and the budget.
        Saved with the scores and checked when resuming, so that another run's checkpoint is refused."""
        if self._fingerprint is None:
            digest = hashlib.sha256(repr(self.args.num_entries).encode())
            for module, learner in sorted(self.region_learners().items()):
                digest.update(module.encode())
                parts = [learner.base_region, learner._movement(), learner.search_indices]
                for tensor in parts:
                    if tensor is not None:
                        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    def _load_scores(self, path: str) -> None:
        if self._zero3:
            raise self._zero3_resume_refusal(path)
        check_file(path, "mask-training checkpoint")  # a folder, device or FIFO: a ValueError naming it
        try:
            with safe_open(path, framework="pt") as handle:
                recorded = (handle.metadata() or {}).get(FINGERPRINT_KEY)
            state = load_file(path)
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"{path} cannot be read ({error}): the mask-training checkpoint is truncated or corrupt. Resume from "
                "another checkpoint, or start again."
            ) from error
        learners = self.region_learners()
        if set(state) != set(learners):
            raise ValueError(f"{path} holds scores for other modules than this model's learning graft layers.")
        for module, learner in learners.items():
            if state[module].shape != learner.scores.shape:
                raise ValueError(
                    f"{path} holds {tuple(state[module].shape)} scores for {module!r}, this model learns "
                    f"{tuple(learner.scores.shape)}: create the graft with the same GraftConfig (search space, "
                    "region, budget) as the run that wrote the checkpoint."
                )
        if recorded is not None and recorded != self.learning_fingerprint():
            raise ValueError(
                f"{path} holds the scores of another mask-training run (another theta_ft, gamma_base, search space or "
                "num_entries): resume only from a checkpoint of a run with the same graft and arguments."
            )
        with torch.no_grad():
            for module, learner in learners.items():
                learner.scores.copy_(state[module])

    # ------------------------------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """Learn S (paper Eq. 3-4), then harden: the best evaluated mask (``keep_best_mask``), else ``round(gamma)``
        or the ``num_entries`` of largest gamma."""
        if not self.region_learners():
            raise ValueError(
                f"Adapter {self.adapter_name!r} is no longer learning its region (it was hardened): build a new "
                "graft with GraftConfig(finetuned=..., learn_region=True) to train again."
            )
        self._check_labels()
        self._check_distributed_wrapping()
        self._best = None
        self._selection_report = {}
        self._evaluations = {}
        self._tracking_best = self._selects_best_mask()
        alpha = self.args.selection_alpha
        if self._tracking_best and alpha is not None:
            self._selection = SignificantSelection(alpha, self.args.greater_is_better)
        if self._zero3 and resume_from_checkpoint:
            raise self._zero3_resume_refusal(str(resume_from_checkpoint))
        hooks = self._average_score_gradients() if self._sharded else []
        try:  # with _tracking_best, _StartingMaskEvaluation evaluates gamma_base first
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            if self._selection is not None:
                self._choose_significant()
        finally:
            self._tracking_best = False
            self._selection = None
            for hook in hooks:
                hook.remove()
        if self.args.num_entries is not None and self.args.num_entries > self._num_moved:
            raise ValueError(
                f"num_entries={self.args.num_entries} exceeds the {self._num_moved} entries fine-tuning moved: lower "
                "it. The learned scores are kept: set trainer.args.num_entries and call trainer.finalize_mask()."
            )
        self.finalize_mask()
        self._log_kept_entries()
        if self.is_world_process_zero():
            self.log({f"final_{k}": v for k, v in self.mask_report.items()})
        return output

    def _log_kept_entries(self) -> None:
        """INFO with the sizes kept; a WARNING when the budget trimmed away most of round(gamma), whose discarded
        entries the user likely meant to learn."""
        rounded, kept = self.mask_report["grafted_entries_rounded"], self.mask_report["grafted_entries"]
        if self.args.num_entries is not None and "selected_step" not in self.mask_report and rounded > OVERSHOOT * kept:
            logger.warning(
                "round(gamma) holds %d entries, %.1fx the budget num_entries=%d: only the entries of largest score "
                "were kept. Lower learning_rate or max_steps, or raise num_entries.",
                rounded,
                rounded / kept,
                kept,
            )
        else:
            logger.info("Grafted entries: %d by round(gamma), %d kept.", rounded, kept)

    def _check_distributed_wrapping(self) -> None:
        """Refuse to train without DDP in a DDP run: an evaluation before the first ``train`` makes accelerate mark
        the model as prepared, and the Trainer would then train it unwrapped, each process with its own S."""
        unwrapped = self.model_wrapped is self.model and getattr(self.model, "_is_accelerate_prepared", False)
        if self.args.world_size > 1 and unwrapped:
            raise ValueError(
                f"This model was evaluated before its first training on {self.args.world_size} processes, so the "
                "Trainer would train it without DistributedDataParallel (each process learning its own S). Create "
                "the MaskTrainer again and call train() before evaluate(); with keep_best_mask the starting mask is "
                "evaluated when training begins."
            )

    def _selects_best_mask(self) -> bool:
        args = self.args
        evaluates = args.eval_strategy != "no" and self.eval_dataset is not None
        return args.keep_best_mask and evaluates and args.metric_for_best_model is not None

    def evaluate_starting_mask(self) -> None:
        """Evaluate gamma_base as the first candidate of the best-mask selection (step 0)."""
        self._evaluate_mask(self.starting_entries(), starting=True)

    def _track_best(self, metrics: dict[str, float], entries: Entries, step: int) -> None:
        """Keep a copy of the evaluated hard region when its selection metric is the best so far (strictly), or offer
        it to the significance test (``selection_alpha``)."""
        name = self.args.metric_for_best_model
        value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
        if value is None:
            raise ValueError(
                f"metric_for_best_model={name!r} is not among the evaluation metrics {sorted(metrics)}: fix it, or "
                "set keep_best_mask=False."
            )
        if self._selection is not None:
            prefixes = ("eval", "train") if self.args.select_on_train else ("eval",)
            correct = np.concatenate([self._correct.pop(prefix) for prefix in prefixes])
            self._selection.offer(value, step, correct, entries)
            return
        best = self._best
        better = best is None or (value > best[0] if self.args.greater_is_better else value < best[0])
        if better:
            self._best = (value, step, copy_entries(entries))

    def _choose_significant(self) -> None:
        """The mask :class:`SignificantSelection` keeps becomes the one hardening applies."""
        selection = self._selection
        chosen = selection.choice()
        if chosen is None:
            return
        self._best = (chosen.value, chosen.step, chosen.entries)
        report = {"evaluated_masks": selection.evaluated}
        if chosen is not selection.start:  # gamma_base is the reference, not tested
            report["selection_p_value"] = chosen.p_value
        best = selection.best_learned
        if best is not None:  # kept or not: how far the best learned mask was from passing
            report.update(best_learned_step=best.step, best_learned_p_value=best.p_value)
        self._selection_report = report

    def finalize_mask(self) -> int:
        """Harden the learned region in place; returns its size.

        Keeps the best evaluated mask when :attr:`MaskTrainingArguments.keep_best_mask` selected one, else
        ``round(gamma)`` or the ``args.num_entries`` of largest gamma.
        """
        rounded = self.num_grafted_entries()
        best = self._best
        change = region_change(self.starting_entries(), best[2] if best is not None else self.kept_entries())
        with self._whole_scores():
            if best is not None:
                kept = self.model.base_model.harden_region(self.adapter_name, entries=best[2])
            else:
                kept = self.model.base_model.harden_region(self.adapter_name, self.args.num_entries)
        if kept == 0:
            logger.warning(
                "The learned region is empty (no gamma reached 0.5): raise learning_rate or max_steps, or set "
                "num_entries to keep the entries of largest gamma."
            )
        self.mask_report = {"grafted_entries_rounded": rounded, "grafted_entries": kept, **change}
        if best is not None:
            self.mask_report["selected_step"] = best[1]
            self.mask_report.update(self._selection_report)
        self._record_provenance(best)
        return kept

    def _record_provenance(self, best: tuple[float, int, Entries] | None, kept: str | None = "final") -> None:
        """Record in the graft's config how MaskTrainer found its region (``GraftConfig.region_provenance``): the
        steps trained, the mask kept and, when one was selected, its step, metric and p-value, and the evaluation
        metrics of the kept mask. ``kept=None``: the region is still being learned (a checkpoint)."""
        config = self.model.peft_config[self.adapter_name]
        record = dict(config.region_provenance or {"strategy": config.region})
        for name in ("selected_step", "selection_metric", "selection_value", "selection_alpha", "selection_p_value",
                     "evaluated_masks", "metrics", "scores_from_step"):  # fmt: skip
            record.pop(name, None)
        step = self.state.global_step
        record.update(learned=True, trainer="MaskTrainer", steps_trained=int(step))
        if kept is None:
            record["kept"] = None
        elif best is None:
            record["kept"] = "round(gamma)" if self.args.num_entries is None else "top num_entries of gamma"
            best_step = getattr(self.state, "best_global_step", None)
            if self.args.load_best_model_at_end and self.state.best_model_checkpoint and best_step is not None:
                step = record["scores_from_step"] = int(best_step)  # the Trainer reloaded the best checkpoint's S
        else:
            value, step = best[0], best[1]
            record["kept"] = "gamma_base" if step == 0 else "best evaluated mask"
            record.update(selected_step=int(step), selection_metric=self.args.metric_for_best_model)
            if isinstance(value, (int, float)) and math.isfinite(value):
                record["selection_value"] = float(value)
            if self.args.selection_alpha is not None:
                record["selection_alpha"] = float(self.args.selection_alpha)
                record["evaluated_masks"] = int(self._selection_report.get("evaluated_masks", 0))
                p_value = self._selection_report.get("selection_p_value")
                if step != 0 and p_value is not None:  # gamma_base is the reference, not tested
                    record["selection_p_value"] = float(p_value)
        if kept is not None and self._evaluations.get(step):
            record["metrics"] = self._evaluations[step]
        config.region_provenance = record

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._in_training_step and not self.args.mask_dropout:
            model.eval()  # training_step put it in training mode; S is learned with dropout off (reference code)
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        loss = result[0] if return_outputs else result
        if self._in_training_step and not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"Mask training step {self.state.global_step + 1}: the loss is {loss.detach().item()}, so S would "
                "become NaN and the region empty. Check the inputs and labels, theta_ft (no NaN/inf weights), and "
                f"learning_rate={self.args.learning_rate} / l1_penalty={self.args.l1_penalty}; the scores are left "
                "as they were before this step."
            )
        return result

    def _check_labels(self) -> None:
        """Fail before training when the training examples carry no labels the model could compute a loss from."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("MaskTrainer needs a train_dataset: the region is learned from the task loss.")
        if self.compute_loss_func is not None or type(self).compute_loss is not MaskTrainer.compute_loss:
            return  # a user loss may find its targets anywhere
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            return
        if len(dataset) == 0:
            raise ValueError("train_dataset is empty.")
        try:
            batch = self.data_collator([self._remove_unused_columns(dataset, description="training")[0]])
        except Exception:  # an exotic dataset or collator: the Trainer will report its own error
            return
        keys = set(batch) if isinstance(batch, dict) else set()
        if keys and not keys & {*LABEL_KEYS, *self.label_names}:
            raise ValueError(
                f"The training batches have no labels (keys: {sorted(keys)}): MaskTrainer learns the region from the "
                "task loss. Add a 'labels' (or 'label') column, use a data collator that creates labels (e.g. "
                "DataCollatorForLanguageModeling for causal LMs), or pass compute_loss_func."
            )

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate the hard region (:meth:`kept_entries`), as the paper does; optionally also on the training set."""
        return self._evaluate_mask(None, eval_dataset, ignore_keys, metric_key_prefix)

    def _evaluate_mask(
        self,
        entries: Entries | None,
        eval_dataset=None,
        ignore_keys=None,
        metric_key_prefix: str = "eval",
        starting: bool = False,
    ) -> dict[str, float]:
        """:meth:`evaluate` with the hard region ``entries`` (default: :meth:`kept_entries`); ``starting``: it is
        gamma_base, recorded as step 0."""
        with self.hard_mask(entries) as entries:
            metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            learning = bool(self.region_learners())
            size = sum(int(idx.numel()) for idx, _ in entries.values()) if learning else self.num_grafted_entries()
            extra = {f"{metric_key_prefix}_grafted_entries": size}
            if self.args.select_on_train and metric_key_prefix.startswith("eval") and self.train_dataset is not None:
                train = super().evaluate(self.train_dataset, ignore_keys=ignore_keys, metric_key_prefix="train")
                for key, value in metrics.items():
                    name = key.removeprefix(f"{metric_key_prefix}_")
                    if f"train_{name}" in train and isinstance(value, (int, float)) and "runtime" not in name:
                        extra[f"{metric_key_prefix}_train_plus_eval_{name}"] = value + train[f"train_{name}"]
        metrics.update(extra)
        self.log(extra)
        if learning and eval_dataset is None and metric_key_prefix == "eval":
            self._evaluations[0 if starting else self.state.global_step] = numeric_metrics(metrics)
        if self._tracking_best and eval_dataset is None and metric_key_prefix == "eval":
            self._track_best(metrics, entries, 0 if starting else self.state.global_step)
        return metrics

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self._selection is not None and metric_key_prefix in ("eval", "train"):  # the examples of the sign test
            self._correct[metric_key_prefix] = per_example_correct(output.predictions, output.label_ids)
        return output

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        with self.hard_mask():
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.region_learners():
            grafted = self.num_grafted_entries()
            logs["grafted_entries"] = grafted
            logs["fraction_of_parameters"] = grafted / max(self._num_parameters, 1)  # not GraftConfig.sparsity
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (self._sharded or self._zero3):
            return super().save_model(output_dir, _internal_call)
        # FSDP2: the graft is whole on every process, FSDP need not gather the model. ZeRO-3: _save gathers the graft's
        # own tensors, and theta_pre only at the entries.
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A loadable sparse graft (the mask evaluation measures); while learning, S rides along for resuming."""
        if self.region_learners():  # a checkpoint of a region still being learned: say so in its config and card
            self._record_provenance(None, kept=None)
        own = [param for module in graft_state_modules(self.model) for param in module.parameters()]
        with self.hard_mask(), gathered(own):  # gathered: ZeRO-3 partitions the graft's own tensors too
            if (self._sharded or self._zero3) and not self.args.should_save:  # join the collectives reading
                get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)  # theta_pre at the entries
            super()._save(output_dir, state_dict)
            scores = self._scores_state()  # S whole here on every process (under ZeRO-3 gathered above)
        if not self.args.should_save:  # transformers calls _save on every rank; one writes (others: no folder yet)
            return
        if scores:
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            metadata = {FINGERPRINT_KEY: self.learning_fingerprint()}
            save_file(scores, os.path.join(output_dir, SCORES_NAME), metadata=metadata)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        path = os.path.join(resume_from_checkpoint, SCORES_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{resume_from_checkpoint} holds no mask-training state ({SCORES_NAME}): resume from a checkpoint "
                "written by MaskTrainer during training."
            )
        self._load_scores(path)

    def _load_best_model(self) -> None:
        path = os.path.join(self.state.best_model_checkpoint, SCORES_NAME)
        if not os.path.isfile(path):
            logger.warning("Best checkpoint %s has no %s: keeping the last mask.", path, SCORES_NAME)
            return
        logger.info("Loading the best mask from %s (score: %s).", path, self.state.best_metric)
        self._load_scores(path)


class _StartingMaskEvaluation(TrainerCallback):
    """Evaluates gamma_base when training begins, while ``MaskTrainer`` keeps the best mask.

    Not before ``Trainer.train``: an evaluation before it registers the model with accelerate unwrapped, and the
    training that follows then runs without DDP (each process learns its own S from its own shard).
    """

    def __init__(self, trainer: MaskTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer._tracking_best:
            self.trainer.evaluate_starting_mask()


def _refuse_engine(engine: str) -> None:
    raise ValueError(
        f"MaskTrainer does not support {engine}: it shards parameters into flat buffers that the graft layers do not "
        "see, so the soft graft would not apply. Use FSDP2 (Trainer fsdp=True with fsdp_config={'version': 2}, or an "
        "accelerate config with fsdp_version: 2), which shards the frozen model, or DDP; see docs/fsdp.md."
    )


def _check_selection_setup(args: MaskTrainingArguments, eval_dataset: Any) -> None:
    """``selection_alpha`` chooses among masks evaluated during training, by accuracy."""
    if not args.keep_best_mask or args.eval_strategy == "no" or eval_dataset is None:
        raise ValueError(
            f"selection_alpha={args.selection_alpha} chooses among the masks evaluated during training, but "
            f"keep_best_mask={args.keep_best_mask}, eval_strategy={str(args.eval_strategy)!r} and the eval_dataset is "
            f"{'missing' if eval_dataset is None else 'given'}: set keep_best_mask=True, eval_strategy='steps' with "
            "eval_steps, and pass an eval_dataset, or set selection_alpha=None."
        )
    name = (args.metric_for_best_model or "").removeprefix("eval_").removeprefix("train_plus_eval_")
    if name != "accuracy" or not args.greater_is_better:
        raise ValueError(
            f"selection_alpha={args.selection_alpha} compares masks by a sign test on per-example accuracy, but "
            f"metric_for_best_model={args.metric_for_best_model!r} (greater_is_better={args.greater_is_better}): set "
            "metric_for_best_model='accuracy' (or 'train_plus_eval_accuracy' with select_on_train), or "
            "selection_alpha=None."
        )


def _check_model(model: Any) -> str:
    """The learning adapter of a graft PeftModel, or a clear error."""
    if not isinstance(model, PeftModel) or not isinstance(model.base_model, GraftModel):
        raise TypeError(
            f"MaskTrainer needs a graft PeftModel, got {type(model).__name__}: create it with "
            "peft.get_peft_model(pretrained, GraftConfig(finetuned=finetuned, learn_region=True, ...))."
        )
    adapter_name = model.active_adapters[0]
    if not model.base_model.region_learners(adapter_name):
        raise ValueError(
            f"Adapter {adapter_name!r} has no theta_ft attached to learn a region from: create the graft with "
            "GraftConfig(finetuned=<fine-tuned model, path or state dict>, learn_region=True). A graft loaded with "
            "PeftModel.from_pretrained, or one already hardened, holds only its sparse entries."
        )
    return adapter_name


def _configure_global_batch(args: MaskTrainingArguments, train_dataset: Any) -> None:
    """Set ``gradient_accumulation_steps`` so that one step sees ``mask_batch_size`` examples (or the full set)."""
    if args.mask_batch_size is None:
        return
    target = args.mask_batch_size
    if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) > 0:
        target = min(target, len(train_dataset))
    per_pass = args.per_device_train_batch_size * args.world_size
    accumulation = max(1, math.ceil(target / per_pass))
    if args.gradient_accumulation_steps not in (1, accumulation):
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} with per_device_train_batch_size="
            f"{args.per_device_train_batch_size} on {args.world_size} process(es) gives a global batch of "
            f"{args.gradient_accumulation_steps * per_pass}, not mask_batch_size={target}: leave "
            "gradient_accumulation_steps at 1 (MaskTrainer derives it) or set mask_batch_size=None."
        )
    if accumulation * per_pass != target:
        logger.warning(
            "mask_batch_size=%d is not a multiple of per_device_train_batch_size (%d) x world size (%d): one mask "
            "step accumulates %d batches (%d examples%s). Choose sizes that divide evenly to get exactly the "
            "same steps on any number of processes.",
            target,
            args.per_device_train_batch_size,
            args.world_size,
            accumulation,
            accumulation * per_pass,
            ", one pass over the training set" if train_dataset is not None and target == len(train_dataset) else "",
        )
    args.gradient_accumulation_steps = accumulation
