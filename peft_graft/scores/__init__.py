"""Per-entry scores of a model's parameters: the movement ``theta_ft - theta_pre`` (the paper's ``gamma_base``)."""

from .movement import compute_movement, eligible_tensors, exact_delta, exact_movement, finetuned_tensor, load_finetuned

__all__ = [
    "compute_movement",
    "eligible_tensors",
    "exact_delta",
    "exact_movement",
    "finetuned_tensor",
    "load_finetuned",
]
