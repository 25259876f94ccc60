"""The state of a region being learned on one graft layer for one adapter (paper Eq. 3-4).

``gamma = gamma_base * (1 - sigmoid(S)) + (1 - gamma_base) * sigmoid(S)`` over a search space of the layer's flat
index space: every entry (the paper's default) or sorted ``search_indices`` (``GraftConfig.search_fraction``). A
:class:`RegionLearner` holds S (the only trained parameter), the movement ``theta_ft - theta_pre`` there, the positions
of ``gamma_base``, and builds the differentiable grafted tensors ``theta_pre + gamma * delta`` through the autograd
Functions of :mod:`.autograd`. Only the hard region it rounds to is ever saved.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parameter_layout import NO_ENTRIES, FlatIndexSpace, exact_positions
from ..regions import global_top_k
from .autograd import (
    BufferPool,
    GradientSlot,
    GraftedRows,
    GraftedSearchSpace,
    GraftedTensors,
    LinearPattern,
    SoftBackward,
    SparseLinearDelta,
)


class RegionLearner(nn.Module):
    """Scores ``S`` and the fixed data of one layer's learned region.

    The movement is a plain attribute, not a buffer: DDP would broadcast a buffer every step and FSDP would shard
    it; it is runtime state only and follows S to its device on first use.

    Args:
        space: The layer's flat index space.
        movement: ``theta_ft - theta_pre`` (fp32) over the search space.
        base_region: ``gamma_base``: flat indices (dense) or positions among ``search_indices``.
        score_init: Initial value of the scores (their lower end with ``score_init_width``).
        search_indices: Sorted flat indices S covers, or ``None`` for the whole space.
        score_init_width: S starts uniform in ``[score_init, score_init + score_init_width)``, drawn with ``generator``.
        generator: Seeded generator of the uniform start.
        unreachable: Sorted flat indices and theta_ft (fp32) of the entries no fp32 delta reproduces
            (``scores.exact_movement``), to be stored exactly by the hard region.
    """

    def __init__(
        self,
        space: FlatIndexSpace,
        movement: torch.Tensor,
        base_region: torch.Tensor,
        score_init: float,
        search_indices: torch.Tensor | None = None,
        score_init_width: float = 0.0,
        generator: torch.Generator | None = None,
        unreachable: tuple[torch.Tensor, torch.Tensor] = NO_ENTRIES,
    ) -> None:
        super().__init__()
        if search_indices is not None:
            search_indices = search_indices.to(torch.int64)
            if search_indices.numel() != movement.numel():
                raise ValueError("search_indices and movement must have the same length.")
            if search_indices.numel() and (int(search_indices.min()) < 0 or int(search_indices.max()) >= space.size):
                raise ValueError(f"Search-space indices out of range [0, {space.size}).")
            if search_indices.numel() > 1 and not bool((search_indices[1:] > search_indices[:-1]).all()):
                raise ValueError("Search-space indices must be strictly increasing.")
        elif movement.numel() != space.size:
            raise ValueError(f"A dense movement must cover the layer's {space.size} entries, got {movement.numel()}.")
        self.space = space
        self.movement = movement.to(torch.float32)
        self.search_indices = search_indices
        self.unreachable = unreachable
        self.register_buffer("base_region", base_region.to(torch.int64), persistent=False)
        scores = torch.full(self.movement.shape, float(score_init))
        if score_init_width:
            scores.add_(torch.rand(self.movement.shape, generator=generator), alpha=score_init_width)
        self.scores = nn.Parameter(scores.to(self.movement.device))
        # The hard region (flat indices, values) the layer applies instead of the soft gamma, e.g. while MaskTrainer
        # evaluates the mask it would keep; None: the soft gamma of Eq. 4.
        self.hard: tuple[torch.Tensor, torch.Tensor] | None = None
        self._parts: list[tuple[str, tuple[int, int, torch.Tensor]]] | None = None
        self._pool = BufferPool()  # reused outputs of GraftedSearchSpace or GraftedTensors
        self._gradients = GradientSlot()  # the dense gradient of S, reused across steps
        self._linear_patterns: dict[tuple, LinearPattern] = {}  # see linear_delta

    @property
    def is_dense(self) -> bool:
        """Whether S covers the layer's whole flat index space (the paper)."""
        return self.search_indices is None

    # ------------------------------------------------------------------------------------------ the region
    def gamma(self) -> torch.Tensor:
        """Paper Eq. 4 over the search space: ``gamma_base * (1 - sigmoid(S)) + (1 - gamma_base) * sigmoid(S)``."""
        gamma = torch.sigmoid(self.scores)
        return gamma.index_put((self.base_region,), 1.0 - gamma[self.base_region])

    def gamma_order(self) -> torch.Tensor:
        """A key that orders the search space as ``gamma`` does without saturating: ``S`` outside ``gamma_base``,
        ``-S`` inside it (``gamma = sigmoid(-S)`` there), ``-inf`` where fine-tuning moved nothing.

        ``sigmoid(S)`` is exactly 1.0 in fp32 for ``S >= 16.7``, while the paper's learning rates take S to thousands:
        ranking gamma itself would tie every learned entry and let module order pick the region.
        """
        with torch.no_grad():
            key = self.scores.detach().clone()
            key[self.base_region] = -key[self.base_region]
            return key.masked_fill_(~self.moved(), -torch.inf)

    def moved(self) -> torch.Tensor:
        """Which entries of the search space fine-tuning moved (only those can be grafted)."""
        return self._movement() != 0

    def flat_indices(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat indices of the layer's space for ``positions`` in S (the identity when dense)."""
        if self.search_indices is None:
            return positions
        return self.search_indices.to(positions.device)[positions]

    def harden(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat indices, values)`` of ``round(gamma)`` (moved entries); an exact budget is :func:`harden_exact`."""
        with torch.no_grad():
            positions = ((self.gamma() >= 0.5) & self.moved()).nonzero().reshape(-1)
            return self.entries_at(positions)

    def entries_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat indices, movement)`` at sorted ``positions`` in S, on the device of S (positions chosen on the CPU,
        e.g. by :func:`harden_exact`, would otherwise give CPU indices beside values on a GPU)."""
        positions = positions.to(self.scores.device)
        return self.flat_indices(positions), self._movement()[positions]

    def exact_at(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions in sorted flat indices, theta_ft)`` of the entries among ``indices`` stored exactly."""
        return exact_positions(indices, self.unreachable)

    def num_hard_entries(self) -> int:
        """Size of ``round(gamma)`` (moved entries only), without materialising the region."""
        with torch.no_grad():
            return int(((self.gamma() >= 0.5) & self.moved()).sum())

    # ------------------------------------------------------------------------------------------ grafted tensors
    def soft_parameters(self, base_layer: nn.Module, mode: SoftBackward = "keep") -> dict[str, torch.Tensor]:
        """``theta_pre + gamma(S) * delta`` for the stored tensors of ``base_layer``, differentiable in S.

        With a search space, only the tensors holding some of it are returned (the others are ``theta_pre``).
        ``mode`` (dense only): whether the layers keep them for backward, rebuild them there through
        ``RecomputeSoftParameters``, or this is that rebuild (see ``SoftBackward``).
        """
        scores, movement = self.scores, self._movement()
        # Reuse the output tensors across steps when a backward will release them (see BufferPool).
        pool = self._pool if torch.is_grad_enabled() else None
        if self.search_indices is not None:
            parts = self._search_parts(scores.device)
            attrs = [attr for attr, _ in parts]
            thetas = [getattr(base_layer, attr) for attr in attrs]
            outputs = GraftedSearchSpace.apply(scores, movement, self.base_region, [p for _, p in parts], pool, *thetas)
            return dict(zip(attrs, outputs, strict=True))
        thetas = [getattr(base_layer, attr) for attr in self.space.attrs]
        offsets = [int(o) for o in self.space.offsets]
        outputs = GraftedTensors.apply(
            scores, movement, self.base_region, offsets, mode, self._gradients, pool, *thetas
        )
        return dict(zip(self.space.attrs, outputs, strict=True))

    def linear_delta(
        self, x: torch.Tensor, attrs: tuple[str | None, str | None], shape: tuple[int, int]
    ) -> torch.Tensor | None:
        """What the search space adds to a linear layer's output, ``x @ dW.T + db``, differentiable in S and ``x``
        (see ``SparseLinearDelta``); ``attrs``: the tensors of this learner's layer that the linear layer uses as its
        weight and bias (``None``: not grafted); ``shape``: ``(out_features, in_features)``. ``None`` when the search
        space has no entry in them."""
        pattern = self.linear_pattern(attrs, shape, x.device)
        if pattern.weight_slice is None and pattern.bias_slice is None:
            return None
        base = self.base_region.to(x.device)
        return SparseLinearDelta.apply(x, self.scores, self._movement(), base, pattern)

    def linear_pattern(
        self, attrs: tuple[str | None, str | None], shape: tuple[int, int], device: torch.device
    ) -> LinearPattern:
        """Where the search space falls in a linear layer's weight and bias (arguments as :meth:`linear_delta`), cached;
        its ``sparse_is_cheaper(tokens)`` tells whether :meth:`linear_delta` pays for a batch."""
        key = (attrs, shape, device)
        pattern = self._linear_patterns.get(key)
        if pattern is None:
            parts = dict(self._search_parts(device))
            weight, bias = (parts.get(attr) if attr else None for attr in attrs)
            pattern = self._linear_patterns[key] = LinearPattern(weight, bias, *shape)
        return pattern

    def soft_rows(self, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (sorted, unique) of an embedding's soft matrix, differentiable in S (see ``GraftedRows``)."""
        dim = weight.shape[1]
        rows = rows.to(torch.int64)
        place = torch.full((weight.shape[0],), -1, dtype=torch.int64, device=rows.device)
        place[rows] = torch.arange(rows.numel(), device=rows.device)  # row of the output, or -1
        base = self.base_region.to(rows.device)
        if self.search_indices is None:  # S is the flat matrix: whole rows, and gamma_base by its flat indices
            positions = targets = None
            out_row = place[base // dim]
            hit = out_row >= 0
            flipped = torch.zeros(rows.numel() * dim, dtype=torch.bool, device=rows.device)
            flipped[out_row[hit] * dim + base[hit] % dim] = True
        else:  # S is over the search space: its entries in rows, and gamma_base by position among them
            search = self.search_indices.to(rows.device)
            out_row = place[search // dim]
            positions = (out_row >= 0).nonzero().reshape(-1)
            targets = out_row[positions] * dim + search[positions] % dim
            flipped = torch.isin(positions, base)
        return GraftedRows.apply(
            self.scores, self._movement(), weight, rows, positions, targets, flipped, self._gradients
        )

    def _movement(self) -> torch.Tensor:
        device = self.scores.device
        if self.movement.device != device:  # a plain attribute does not follow module.to(): move it once
            self.movement = self.movement.to(device)
        return self.movement

    def _search_parts(self, device: torch.device) -> list[tuple[str, tuple[int, int, torch.Tensor]]]:
        """Per stored tensor holding some of the search space: ``(attr, (a, b, local flat indices))``, cached."""
        parts = self._parts
        if parts is None or (parts and parts[0][1][2].device != device):
            if self.search_indices.device != device:
                self.search_indices = self.search_indices.to(device)
            parts = [
                (attr, (position.start, position.stop, local.to(device)))
                for attr, local, position in self.space.split(self.search_indices)
            ]
            self._parts = parts
        return parts

    def extra_repr(self) -> str:
        space = "dense" if self.search_indices is None else f"search space of {self.search_indices.numel()}"
        return f"{self.scores.numel()} scores ({space}), gamma_base of {self.base_region.numel()}"


def harden_exact(learners: dict[str, RegionLearner], k: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Exactly ``k`` moved entries of largest gamma over all learners: module -> (flat indices, values).

    Entries are ranked by :meth:`RegionLearner.gamma_order` (the scores, not their saturating sigmoid); exact ties go
    to the earlier module, then the lower index.
    """
    with torch.no_grad():
        keys = {module: learner.gamma_order() for module, learner in learners.items()}
        region = global_top_k(keys, k)  # positions in each module's S
        return {module: learners[module].entries_at(positions) for module, positions in region.items()}
