"""Regions: the value type (:class:`Region`), how entries are selected, and the registry of region strategies."""

from .region import Region
from .selection import global_top_k, random_region, top_k_movement
from .strategies import (
    REGION_STRATEGIES,
    RegionRequest,
    RegionStrategy,
    choose_region,
    get_region_strategy,
    register_region_strategy,
)

__all__ = [
    "REGION_STRATEGIES",
    "Region",
    "RegionRequest",
    "RegionStrategy",
    "choose_region",
    "get_region_strategy",
    "global_top_k",
    "random_region",
    "register_region_strategy",
    "top_k_movement",
]
