"""Training: learning a region (``MaskTrainer``), fine-tuning with penalties, and the loss-term mechanism they share."""

from .finetune import MovementL1Penalty, MovementL1Trainer
from .losses import LossTerm, LossTermsTrainer
from .mask import MaskTrainer, MaskTrainingArguments, ScoreL1Penalty

__all__ = [
    "LossTerm",
    "LossTermsTrainer",
    "MaskTrainer",
    "MaskTrainingArguments",
    "MovementL1Penalty",
    "MovementL1Trainer",
    "ScoreL1Penalty",
]
