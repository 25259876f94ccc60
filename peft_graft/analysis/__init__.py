"""Where a graft's entries sit in the model (paper Figures 9-10)."""

from .stats import GraftStats, compute_graft_stats, layer_index, module_type

__all__ = ["GraftStats", "compute_graft_stats", "layer_index", "module_type"]
