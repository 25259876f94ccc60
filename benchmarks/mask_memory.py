"""The state a mask-step benchmark's trainer keeps, per parameter, and what it means for 7B and 70B models
(``kept_state``, ``bytes_per_parameter``, ``on_paper``); a rough peak estimate to refuse what cannot fit."""

from __future__ import annotations

import statistics

import torch
from bench_models import DTYPES, num_parameters
from bench_timing import GIB
from mask_reference import ReferenceGraft
from mask_trainers import REFERENCE, search_space
from transformers import Trainer

from peft_graft import MaskTrainer


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def kept_state(trainer: Trainer | ReferenceGraft) -> dict[str, int]:
    """Bytes of the state a step keeps (measured on the objects, after the optimizer step, before ``zero_grad``).

    Plain: weights, gradients, optimizer state. Mask: the base weights (frozen), then per region learner (see
    ``peft_graft/tuner/learning.py``) S and its gradient, the movement, the int64 indices of the search space (and
    their per-tensor local copies), gamma_base, and the buffers of the soft tensors (``GraftedSearchSpace``'s
    ``BufferPool``, one per tensor holding part of the search space, in the tensor's dtype). Reference: the working
    model's weights and gradients (none: its ``zero_grad`` freed them), theta_pre and theta_ft, S, gamma_base and
    theta_ft - theta_pre, and the two gradient-sized lists it keeps until its next step.
    """
    params = {id(p): (n, p) for n, p in trainer.model.named_parameters()}
    if isinstance(trainer, ReferenceGraft):  # all in the weights' dtype

        def total(tensors) -> int:
            return sum(nbytes(t) for t in tensors or [])

        return {
            "parameters": sum(p.numel() for _, p in params.values()),
            "weights": total(p for _, p in params.values()),
            "reference": True,
            "model_copies": total(trainer.pretrained.parameters()) + total(trainer.finetuned.parameters()),
            "gradients": total(p.grad for _, p in params.values()),
            "mask_state": total(trainer.scores) + total(trainer.base) + total(trainer.directions),
            "step_buffers": total(trainer.grad) + total(trainer.total_grad),
        }
    if not isinstance(trainer, MaskTrainer):
        state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {
            "parameters": sum(p.numel() for _, p in params.values()),
            "weights": sum(nbytes(p) for _, p in params.values()),
            "gradients": sum(nbytes(p.grad) for _, p in params.values()),
            "optimizer_state": sum(nbytes(t) for t in state),
        }
    learners = list(trainer.region_learners().values())
    base = [p for n, p in params.values() if "graft_" not in n]
    out = {
        "parameters": sum(p.numel() for p in base),
        "weights": sum(nbytes(p) for p in base),
        "candidates": sum(learner.scores.numel() for learner in learners),
        "dense": all(learner.is_dense for learner in learners),
        "scores": 0,
        "score_gradients": 0,
        "movement": 0,
        "indices": 0,
        "soft_buffers": 0,
        "soft_buffer_entries": 0,
    }
    for learner in learners:
        out["scores"] += nbytes(learner.scores)
        out["score_gradients"] += nbytes(learner.scores.grad)
        out["movement"] += nbytes(learner.movement)
        parts = getattr(learner, "_parts", None) or []
        out["indices"] += nbytes(learner.search_indices) + nbytes(learner.base_region)
        out["indices"] += sum(nbytes(local) for _, (_, _, local) in parts)
        buffers = getattr(getattr(learner, "_pool", None), "buffers", {}).values()
        out["soft_buffers"] += sum(nbytes(b) for b in buffers)
        out["soft_buffer_entries"] += sum(b.numel() for b in buffers)
    return out


# ----------------------------------------------------------------------------------------------- bytes per parameter
def bytes_per_parameter(state: dict) -> dict[str, float]:
    """The kept state of one variant (:func:`kept_state`) per parameter of the model.

    ``*_share`` terms follow the weights' dtype (a gradient, an optimizer state or a soft-tensor buffer has the dtype
    of its tensor): they are given as a multiple of the weights' bytes. The others are fixed: S, its gradient and the
    movement are fp32, and the search-space indices int64, whatever the weights' dtype; dense, they are bytes per
    parameter; with a search space, bytes per candidate. The reference keeps everything in the weights' dtype: shares.
    """
    n, weights = state["parameters"], state["weights"]
    if state.get("reference"):
        terms = {"models": "model_copies", "gradient": "gradients", "mask": "mask_state", "step": "step_buffers"}
        return {"weight_bytes": weights / n, **{f"{k}_share": state[v] / weights for k, v in terms.items()}}
    if "candidates" not in state:
        return {
            "weight_bytes": weights / n,
            "gradient_share": state["gradients"] / weights,
            "optimizer_share": state["optimizer_state"] / weights,
        }
    fixed = state["scores"] + state["score_gradients"] + state["movement"] + state["indices"]
    out = {
        "weight_bytes": weights / n,
        "buffer_share": state["soft_buffers"] / weights,
        "candidate_fraction": state["candidates"] / n,
        "dense": state["dense"],
    }
    out["bytes_per_parameter" if state["dense"] else "bytes_per_candidate"] = fixed / max(state["candidates"], 1)
    return out


MODEL_SIZES = {"7B": 7e9, "70B": 70e9}
GPU_GIB = 80


def on_paper(measured: dict[str, dict], fractions: list[float], dtype_bytes: int = 2) -> list[str]:
    """What each mode keeps per parameter, and what 7B and 70B models in bf16 need of one 80 GB GPU.

    ``measured``: :func:`bytes_per_parameter` by variant (``plain``, ``none``, fractions, ``reference``: a row only when
    measured). Terms that follow the
    weights' dtype scale to ``dtype_bytes``; the fp32 and int64 ones stay. A variant not measured falls back on what
    the code keeps (gradient = weights; S, its gradient and the movement fp32; a candidate adds two int64 indices, its
    global and its per-tensor one; every tensor holds some candidate, so one buffer per tensor).
    """
    plain = measured.get("plain", {"gradient_share": 1.0, "optimizer_share": 0.0})
    dense = next((m for m in measured.values() if m.get("dense")), {"bytes_per_parameter": 12.0})
    capped = [m for m in measured.values() if "bytes_per_candidate" in m]
    per_candidate = statistics.median([m["bytes_per_candidate"] for m in capped]) if capped else 28.0
    share = max([m["buffer_share"] for m in capped], default=1.0)
    b = dtype_bytes
    rows = [
        ("weights alone", b, f"{b}"),
        ("plain SGD (no momentum)", b * (1 + plain["gradient_share"] + plain["optimizer_share"]),
         f"{b} + grad {b * plain['gradient_share']:g}"),
        ("plain AdamW (moments in bf16)", 4 * b, f"{b} + grad {b} + 2 moments {2 * b}"),
        ("plain AdamW, mixed precision", b + b + 12, f"{b} + grad {b} + fp32 master and 2 moments 12"),
        ("mask, dense S (paper)", b + dense["bytes_per_parameter"],
         f"{b} + S, grad S, movement {dense['bytes_per_parameter']:.0f}"),
    ]  # fmt: skip
    reference = measured.get(REFERENCE)
    if reference is not None:
        shares = {k[: -len("_share")]: v for k, v in reference.items() if k.endswith("_share")}
        rows.append((
            "reference code (paper)", b * (1 + sum(shares.values())),
            f"{b}x(1+" + "+".join(f"{k.replace('gradient', 'grad')} {v:.3g}" for k, v in shares.items()) + ")",
        ))  # fmt: skip
    for fraction in fractions:
        rows.append((
            f"mask, search_fraction={fraction:g}", b + b * share + fraction * per_candidate,
            f"{b} + buffers {b * share:.2f} + {per_candidate:.0f} B x {fraction:g}",
        ))  # fmt: skip
    lines = [
        f"On paper: bytes per parameter kept through a step with {b}-byte weights (activations and per-layer "
        "temporaries aside), and one 80 GB (80 GiB) GPU:",
        f"  {'mode':<33} {'B/param':>7}  {'= terms':<44}" + "".join(f" {s:>5} GiB {'fits':>4}" for s in MODEL_SIZES),
    ]
    for label, per_parameter, terms in rows:
        cells = ""
        for size in MODEL_SIZES.values():
            gib = per_parameter * size / GIB
            cells += f" {gib:>9.1f} {'yes' if gib <= GPU_GIB else 'no':>4}"
        lines.append(f"  {label:<33} {per_parameter:>7.2f}  {terms:<44}{cells}")
    source = "measured" if capped else "from the code (not measured in this run)"
    lines.append(
        f"  (per candidate {per_candidate:.1f} B and buffer share {share:.2f} of the weights: {source}; "
        f"dense: {dense['bytes_per_parameter']:.1f} B/param of fp32 state)"
    )
    return lines


def estimated_peak_gb(name: str, variant: str, dtype: str) -> float | None:
    """A rough upper estimate of a variant's peak (creation included) on CPU, to refuse what cannot fit."""
    n = num_parameters(name)
    if n is None:
        return None
    b = DTYPES[dtype].itemsize
    if variant == "plain":
        per_parameter = 2 * b
    elif variant == REFERENCE:  # three models, the gradients, S, gamma_base, the movement, two gradient-sized lists
        per_parameter = 10 * b
    elif search_space(variant):  # theta_pre, theta_ft read in fp32, the fp32 movement of every tensor
        per_parameter = b + 8
    else:  # and S, its gradient and the movement again, per module
        per_parameter = b + 16
    return 1.1 * n * per_parameter / GIB + 1.0
