"""The merge rules on plain tensors: the trims of the global rules, the rules on whole tensors, LiNeS's scaling.

* **Trims** (:func:`trim`, :func:`combine`): TIES's magnitude trim and sign election, DARE's random drops and
  Consensus's TALL masks on the flat task vectors ``(T, n)``, exactly as :mod:`peft.utils.merge_utils` computes them
  (bit for bit, ``tests/test_merging.py``), split in the part that the weights do not change (:func:`trim`, computed
  once per density by :class:`~peft_graft.merging.TaskVectorStack`) and the weighted combination (:func:`combine`).

:func:`peft_graft.merging.merge_grafts` calls these per stored tensor with the task vectors ``tau_t`` (dense, 0 off a
graft's region); they know nothing of grafts. Each follows its paper and the reference code's treatment of the tensors
that are not matrices (FusionBench 0.2.33, ``fusion_bench/method/wudi`` and ``fusion_bench/method/regmean``; checked
against it in ``tests/test_merge_rules_reference.py``):

* **WUDI-Merging** (Cheng et al., ICML 2025): per matrix ``tau_m = argmin_X sum_t ||(X - tau_t) tau_t^T||^2 /
  ||tau_t||^2``. :func:`wudi_closed_form` solves it exactly; :func:`wudi_adam` is the reference's iterative form (Adam
  from ``sum_t tau_t``, a few hundred steps of a small learning rate), which stops far from the optimum. Tensors that
  are not matrices (biases, LayerNorm) get the mean of the task vectors.
* **RegMean** (Jin et al., ICLR 2023): per linear layer ``W = (sum_t G_t)^-1 sum_t G_t W_t`` (in peft's
  ``(out, in)`` layout, transposed), ``G_t`` the Gram matrix of the layer's inputs under task t with its off-diagonal
  entries scaled by ``alpha``. As ``sum_t G_t W_pre = (sum_t G_t) W_pre``, it is the same on the task vectors. Every
  other tensor gets the mean of the task vectors.
* **LiNeS** (Wang et al., ICLR 2025): the merged task vector of transformer block ``l`` of ``L`` scaled by
  ``alpha + beta * l / (L - 1)``; tensors outside the blocks by ``alpha``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from peft.utils import merge_utils

_BLOCK = re.compile(r"\.(\d+)\.")
SIGN_RULES = ("ties", "dare_ties", "consensus_ties")  # elect a sign per entry and average the agreeing
DARE_RULES = ("dare_ties", "dare_linear")
CONSENSUS_RULES = ("consensus_ta", "consensus_ties")


def top_magnitude(tau: torch.Tensor, density: float) -> torch.Tensor:
    """The entries peft's magnitude pruning keeps (its top ``int(density * n)`` of ``|tau|``), as a mask. ``topk``
    unsorted: it selects the same entries (ties included) and only skips ordering them, which a mask does not use."""
    mask = torch.zeros(tau.numel(), dtype=torch.bool)
    if density >= 1:
        return mask | True
    mask[torch.topk(tau.abs(), k=int(density * tau.numel()), sorted=False).indices] = True
    return mask


def consensus_mask(taus: torch.Tensor, k: int, tall_lambda: float) -> torch.Tensor:
    """Consensus merging's entries (Wang et al., ICML 2024) of the task vectors ``(T, n)``: task t's TALL mask holds
    ``|tau_t| > tall_lambda * |tau_MTL - tau_t|`` (``tau_MTL = sum_t tau_t``); an entry is kept where at least ``k``
    masks hold it (dropped from every task vector where fewer do)."""
    total = taus.sum(0)
    votes = (taus.abs() > tall_lambda * (total - taus).abs()).sum(0)
    return votes >= k


def trim(
    taus: torch.Tensor, rule: str, density: float | None, seed: int, majority_sign_method: str, consensus: tuple | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What ``rule`` does to the task vectors ``taus`` ``(T, n)`` before weighting them: the entries each keeps
    (``None``: all) and, for :data:`SIGN_RULES`, where each agrees with the elected sign (``None`` otherwise), as
    peft's functions compute them: Consensus's mask (``consensus = (k, tall_lambda)``), then TIES's top-``density``
    of each ``|tau_t|`` or DARE's drops (Bernoulli per entry, seeded by ``seed``), then the election on the trimmed,
    unweighted vectors."""
    keep = None if consensus is None else consensus_mask(taus, *consensus).expand_as(taus)
    trimmed = taus if keep is None else torch.where(keep, taus, 0.0)
    if rule in DARE_RULES and density < 1:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = torch.stack([torch.bernoulli(torch.full_like(tau, density)) for tau in trimmed]).bool()
        keep = drawn if keep is None else keep & drawn
    elif rule in ("ties", "consensus_ties") and density < 1:
        kept = torch.stack([top_magnitude(tau, density) for tau in trimmed])
        keep = kept if keep is None else keep & kept
    if rule not in SIGN_RULES:
        return keep, None
    trimmed = taus if keep is None else torch.where(keep, taus, 0.0)
    if rule in DARE_RULES and density < 1:
        trimmed = trimmed / density
    return keep, merge_utils.calculate_majority_sign_mask(trimmed, method=majority_sign_method)


def combine(
    taus: torch.Tensor,
    weights: torch.Tensor,
    trimmed: tuple[torch.Tensor | None, torch.Tensor | None],
    rule: str,
    density: float | None,
) -> torch.Tensor:
    """The merged task vector ``(n,)`` of ``rule`` from the task vectors ``(T, n)``, the weights ``(T,)`` and their
    :func:`trim`: the kept entries (DARE's rescaled by ``1 / density``) weighted, then averaged over the entries that
    agree with the elected sign (:data:`SIGN_RULES`) or summed."""
    keep, agree = trimmed
    kept = taus if keep is None else torch.where(keep, taus, 0.0)
    if rule in DARE_RULES and density < 1:
        kept = kept / density
    weighted = kept * weights.view(-1, 1)
    return merge_utils.disjoint_merge(weighted, agree) if agree is not None else weighted.sum(0)


def mean_task_vector(taus: torch.Tensor) -> torch.Tensor:
    """The mean of ``taus`` ``(T, ...)`` over the tasks: the references' rule for tensors that are not matrices."""
    return taus.sum(0) / taus.shape[0]


def _wudi_terms(taus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A, B, S)`` of WUDI's objective on matrices ``taus`` ``(T, m, n)``: ``A = sum_t tau_t^T tau_t / ||tau_t||^2``,
    ``B = sum_t tau_t tau_t^T tau_t / ||tau_t||^2`` (its gradient is ``2 (X A - B)``) and the start ``S = sum_t tau_t``.
    A task with no entry in the matrix (``tau_t = 0``) adds nothing (the reference would divide 0 by 0)."""
    norms = taus.flatten(1).square().sum(1)
    held = norms > 0
    taus_held, norms_held = taus[held], norms[held]
    grams = taus_held.transpose(1, 2) @ taus_held / norms_held[:, None, None]
    return grams.sum(0), (taus_held @ grams).sum(0), taus.sum(0)


def wudi_closed_form(taus: torch.Tensor) -> torch.Tensor:
    """WUDI's merged matrix, solved exactly (in float64): ``X A = B``, the minimiser nearest the reference's start ``S``
    (``X = B A^+ + S (I - A A^+)``: gradient steps from ``S`` never move it off ``A``'s null space)."""
    a, b, start = (t.double() for t in _wudi_terms(taus.double()))
    eigenvalues, vectors = torch.linalg.eigh(a)
    cutoff = eigenvalues.abs().max().clamp(min=torch.finfo(torch.float64).tiny) * a.shape[0] * 1e-12
    kept = eigenvalues > cutoff
    basis = vectors[:, kept]
    pinv = basis @ torch.diag(1.0 / eigenvalues[kept]) @ basis.T
    solution = b @ pinv + start - (start @ basis) @ basis.T
    return solution.to(taus.dtype)


def wudi_adam(taus: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """WUDI's merged matrix as the reference computes it: ``steps`` Adam steps (``lr``, no weight decay) from
    ``S = sum_t tau_t`` on the objective, in the task vectors' dtype. The gradient is taken in its closed form
    ``2 (X A - B)``, which never forms the reference's ``(T, m, m)`` products (an embedding's: vocab x vocab)."""
    a, b, start = _wudi_terms(taus)
    merged = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.Adam([merged], lr=lr, weight_decay=0)
    for _ in range(steps):
        merged.grad = 2 * (merged.detach() @ a - b)
        optimizer.step()
    return merged.detach()


def reduce_off_diagonal(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """RegMean's regularised Gram matrix: the diagonal kept, every other entry times ``alpha``."""
    scaled = gram * alpha
    return scaled + torch.diag(torch.diagonal(gram) * (1 - alpha))


def regmean(taus: torch.Tensor, grams: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """RegMean's merged linear weight ``(out, in)`` from the task vectors ``(T, out, in)`` and each task's input Gram
    matrix ``(in, in)``: ``((sum_t G'_t)^-1 sum_t G'_t tau_t^T)^T`` with ``G'_t`` = :func:`reduce_off_diagonal`."""
    reduced = [reduce_off_diagonal(g.to(taus.dtype), alpha) for g in grams]
    total = torch.stack(reduced).sum(0)
    right = sum(g @ tau.T for g, tau in zip(reduced, taus, strict=True))
    return torch.linalg.solve(total, right).T


def block_index(module: str) -> int | None:
    """The transformer block a module lies in: the first number among its name's parts (``encoder.layer.3.output`` ->
    3); ``None`` outside the blocks (embeddings, a final norm)."""
    found = _BLOCK.search(f".{module}.")
    return None if found is None else int(found.group(1))


def lines_scales(modules: Iterable[str], alpha: float, beta: float) -> dict[str, float]:
    """LiNeS's scale per module: ``alpha + beta * l / (L - 1)`` in block ``l`` of the ``L`` blocks that ``modules``
    name (``alpha`` with one block), ``alpha`` outside the blocks."""
    modules = list(modules)
    blocks = [block_index(m) for m in modules]
    last = max((b for b in blocks if b is not None), default=0)
    return {m: alpha + (beta * b / last if b is not None and last else 0.0)
            for m, b in zip(modules, blocks, strict=True)}  # fmt: skip


def layer_type(name: str) -> str:
    """A tensor's kind across blocks: its name without the block numbers (``encoder.layer.3.output.dense.weight`` ->
    ``encoder.layer.output.dense.weight``)."""
    return _BLOCK.sub(".", f".{name}.").strip(".")


__all__ = [
    "block_index",
    "combine",
    "consensus_mask",
    "layer_type",
    "lines_scales",
    "mean_task_vector",
    "reduce_off_diagonal",
    "regmean",
    "top_magnitude",
    "trim",
    "wudi_adam",
    "wudi_closed_form",
]
