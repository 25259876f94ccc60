"""peft_graft: skill localization by model grafting as a Hugging Face PEFT method.

``import peft_graft`` registers the ``graft`` method with peft, so that ``get_peft_model``,
``PeftModel.from_pretrained``, ``AutoPeftModel*`` and transformers' ``load_adapter`` know it.

The data flows one way through the sub-packages: ``scores`` (movement ``theta_ft - theta_pre``) -> ``regions`` (the
:class:`Region` value type, selection, named strategies) -> ``tuner`` (the peft method: config, planning, layer,
model) -> ``training`` (``MaskTrainer``, fine-tuning with penalties) -> ``analysis`` and ``calibration``.
"""

from peft.utils import PeftType

from ._peft_compat import register_peft_method, wrap_method
from .analysis import GraftStats
from .regions import (
    REGION_STRATEGIES,
    Region,
    RegionRequest,
    global_top_k,
    random_region,
    register_region_strategy,
    top_k_movement,
)
from .training import (
    ContinualGrafter,
    LocalizeStitch,
    LossTerm,
    LossTermsTrainer,
    MaskTrainer,
    MaskTrainingArguments,
    MovementL1Penalty,
    MovementL1Trainer,
    RestrictTrainingCallback,
    TrainingRestriction,
    restrict_training,
)
from .tuner import GRAFT_NAME, GRAFT_PREFIX, GraftConfig, GraftLayer, GraftModel, RegionLearner
from .tuner.wrappers import method_wrappers

__version__ = "0.1.0"


def register() -> PeftType:
    """Register the ``graft`` method with peft (done on import; idempotent, also after ``importlib.reload``)."""
    for owner, method, make_wrapper in method_wrappers():
        wrap_method(owner, method, make_wrapper)
    return register_peft_method(GRAFT_NAME, GraftConfig, GraftModel, GRAFT_PREFIX)


PEFT_TYPE = register()

__all__ = [
    "PEFT_TYPE",
    "REGION_STRATEGIES",
    "ContinualGrafter",
    "GraftConfig",
    "GraftLayer",
    "GraftModel",
    "GraftStats",
    "LocalizeStitch",
    "LossTerm",
    "LossTermsTrainer",
    "MaskTrainer",
    "MaskTrainingArguments",
    "MovementL1Penalty",
    "MovementL1Trainer",
    "Region",
    "RegionLearner",
    "RegionRequest",
    "RestrictTrainingCallback",
    "TrainingRestriction",
    "global_top_k",
    "random_region",
    "register",
    "register_region_strategy",
    "restrict_training",
    "top_k_movement",
]
