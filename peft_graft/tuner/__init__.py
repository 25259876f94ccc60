"""The ``graft`` PEFT method, laid out as peft's own methods: config, planning, layer (and its learning state), model.

``config`` -> ``planning`` (movement -> region -> per-module entries) -> ``layer`` (applies and merges sparse entries;
``learning`` holds the state of a region being learned, ``autograd`` its differentiable tensors) -> ``model`` (the
peft tuner) -> ``persistence`` (atomic saves, checked loads, model card).
"""

from .config import GRAFT_NAME, GRAFT_PREFIX, GraftConfig
from .layer import GraftLayer
from .learning import RegionLearner
from .model import GraftModel

__all__ = ["GRAFT_NAME", "GRAFT_PREFIX", "GraftConfig", "GraftLayer", "GraftModel", "RegionLearner"]
