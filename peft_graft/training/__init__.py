"""Training: learning a region (``MaskTrainer``, or Localize-and-Stitch's ``LocalizeStitch``), fine-tuning with
penalties, the loss-term mechanism they share, and training restricted to a region (``TrainingRestriction``) and
forget-free continual learning on top of it (``ContinualGrafter``), and surgical fine-tuning of the layers with the
highest FIM score."""

from .continual import ContinualGrafter, ContinualTask
from .finetune import MovementL1Penalty, MovementL1Trainer
from .localize_stitch import LocalizeStitch
from .losses import LossTerm, LossTermsTrainer
from .mask import MaskTrainer, MaskTrainingArguments, ScoreL1Penalty
from .restriction import RestrictTrainingCallback, TrainingRestriction, restrict_training
from .surgical import LayerRankCallback, freeze_outside, layer_region, surgical_region

__all__ = [
    "ContinualGrafter",
    "ContinualTask",
    "LayerRankCallback",
    "LocalizeStitch",
    "LossTerm",
    "LossTermsTrainer",
    "MaskTrainer",
    "MaskTrainingArguments",
    "MovementL1Penalty",
    "MovementL1Trainer",
    "RestrictTrainingCallback",
    "ScoreL1Penalty",
    "TrainingRestriction",
    "freeze_outside",
    "layer_region",
    "restrict_training",
    "surgical_region",
]
