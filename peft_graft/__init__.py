"""peft_graft: skill localization by model grafting as a Hugging Face PEFT method.

``import peft_graft`` registers the ``graft`` method with peft, so that ``get_peft_model``,
``PeftModel.from_pretrained``, ``AutoPeftModel*`` and transformers' ``load_adapter`` know it.
"""

from . import saving
from .config import GraftConfig
from .layer import GraftLayer
from .model import GraftModel
from .penalties import MovementL1Penalty, MovementL1Trainer
from .regions import Region, global_top_k, random_region, top_k_movement
from .registration import register
from .stats import GraftStats
from .trainer import MaskTrainer, MaskTrainingArguments

__version__ = "0.1.0"

PEFT_TYPE = register()
saving.install()

__all__ = [
    "PEFT_TYPE",
    "GraftConfig",
    "GraftLayer",
    "GraftModel",
    "GraftStats",
    "MaskTrainer",
    "MaskTrainingArguments",
    "MovementL1Penalty",
    "MovementL1Trainer",
    "Region",
    "global_top_k",
    "random_region",
    "register",
    "top_k_movement",
]
