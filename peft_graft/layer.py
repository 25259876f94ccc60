"""The graft adapter layer: applies ``gamma * (theta_ft - theta_pre)`` to the parameters of any module."""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn
from torch.nn import functional as F

from .soft import BufferPool, GraftedCandidates, GraftedRows, GraftedTensors, RecomputeSoftParameters

# Module switches, for tests and benchmarks of soft.RecomputeSoftParameters and soft.GraftedRows.
RECOMPUTE_SOFT_PARAMETERS = True
GRAFT_EMBEDDING_ROWS = True


class GraftLayer(nn.Module, BaseTunerLayer):
    """Wraps one module and grafts sparse entries onto its parameters.

    The layer *stores* the entries of the tensors in ``stored_attrs`` (a flat index space: those tensors flattened
    and concatenated in order) and *applies* them together with the entries of tied tensors stored on other layers
    (``tied_sources``), so a tensor shared by several modules is stored once and used consistently everywhere.

    Per adapter it holds either a hard region (``graft_indices``, sorted, and fp32 ``graft_values`` = theta_ft -
    theta_pre there), or, while :class:`~peft_graft.MaskTrainer` learns the region, the dense training state of paper
    Eq. 4: scores ``S`` (``graft_scores``), movement ``theta_ft - theta_pre`` (``graft_movement``) and the candidate
    region ``gamma_base`` (``graft_base_region``). Only the hard region is ever saved. The movement is a plain dict, not
    a buffer: DDP would broadcast a buffer every step, FSDP would shard and gather it; it is runtime state only.

    With ``GraftConfig.candidates`` the training state covers only sorted candidate flat indices
    (``graft_candidates``, a plain dict too): S and the movement are then over the candidates, and
    ``graft_base_region`` holds positions among them. Without it, positions are flat indices.
    """

    adapter_layer_names = ("graft_values", "graft_scores")
    other_param_names = ("graft_indices", "graft_movement", "graft_base_region", "graft_candidates")

    def __init__(
        self,
        base_layer: nn.Module,
        stored_attrs: list[str],
        tied_sources: dict[str, tuple[GraftLayer, str]],
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.graft_values = nn.ParameterDict()
        self.graft_indices = BufferDict(persistent=True)
        self.graft_scores = nn.ParameterDict()
        self.graft_movement: dict[str, torch.Tensor] = {}  # not a buffer: never broadcast, synced or saved
        self.graft_base_region = BufferDict(persistent=False)
        self.graft_candidates: dict[str, torch.Tensor] = {}  # sorted flat indices S covers (candidates mode only)
        self._candidate_parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self._soft_buffers: dict[str, BufferPool] = {}  # reused outputs of GraftedCandidates, per adapter
        self.stored_attrs = list(stored_attrs)
        self.tied_sources = dict(tied_sources)  # plain dict: the source layers are not submodules of this one
        self.fingerprints: dict[str, list[float]] = {}
        self.verify_base: dict[str, bool] = {}
        self._merge_backup: dict[str, list[torch.Tensor]] = {}
        self._hard_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # rounded learning region, for eval
        self._disable_adapters = False
        self.merged_adapters = []
        sizes = [getattr(base_layer, attr).numel() for attr in self.stored_attrs]
        self.offsets = torch.tensor([0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()])

    # ----------------------------------------------------------------------------------------------- state
    @property
    def num_stored(self) -> int:
        """Size of this layer's flat index space."""
        return int(self.offsets[-1])

    def index_dtype(self) -> torch.dtype:
        return torch.int64 if self.num_stored > torch.iinfo(torch.int32).max else torch.int32

    def update_layer(self, adapter_name: str, num_entries: int, fingerprint: list[float], verify_base: bool) -> None:
        """Create an empty hard region of ``num_entries`` entries, to be filled by loading or :meth:`set_region`."""
        device = self._device()
        self.graft_indices[adapter_name] = torch.zeros(num_entries, dtype=self.index_dtype(), device=device)
        self.graft_values[adapter_name] = nn.Parameter(torch.zeros(num_entries, device=device))
        self.fingerprints[adapter_name] = list(fingerprint)
        self.verify_base[adapter_name] = verify_base

    def set_region(self, adapter_name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Set the hard region: sorted flat ``indices`` into this layer's space and fp32 ``values`` there."""
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_stored):
            raise ValueError(f"Graft indices out of range [0, {self.num_stored}) for adapter {adapter_name!r}.")
        device = self._device()
        requires_grad = adapter_name in self.graft_values and self.graft_values[adapter_name].requires_grad
        self.graft_indices[adapter_name] = indices.to(device, self.index_dtype())
        self.graft_values[adapter_name] = nn.Parameter(values.to(device, torch.float32), requires_grad=requires_grad)
        self.fingerprints[adapter_name] = self.base_values(indices[:2]).tolist()
        self.verify_base.setdefault(adapter_name, True)

    def set_training_state(
        self,
        adapter_name: str,
        movement: torch.Tensor,
        base_region: torch.Tensor,
        score_init: float,
        candidates: torch.Tensor | None = None,
    ) -> None:
        """State to learn the region: movement, ``gamma_base`` positions and scores S.

        Dense (``candidates=None``): over this layer's whole flat space. Otherwise over the sorted flat indices
        ``candidates`` only, ``base_region`` being positions among them.
        """
        device = self._device()
        self._candidate_parts.pop(adapter_name, None)
        self.graft_candidates.pop(adapter_name, None)
        if candidates is not None:
            candidates = candidates.to(device, torch.int64)
            if candidates.numel() != movement.numel():
                raise ValueError("candidates and movement must have the same length.")
            if candidates.numel() and (int(candidates.min()) < 0 or int(candidates.max()) >= self.num_stored):
                raise ValueError(f"Candidate indices out of range [0, {self.num_stored}) for {adapter_name!r}.")
            if candidates.numel() > 1 and not bool((candidates[1:] > candidates[:-1]).all()):
                raise ValueError("Candidate indices must be strictly increasing.")
            self.graft_candidates[adapter_name] = candidates
        self.graft_movement[adapter_name] = movement.to(device, torch.float32)
        self.graft_base_region[adapter_name] = base_region.to(device, torch.int64)
        self.graft_scores[adapter_name] = nn.Parameter(torch.full_like(self.graft_movement[adapter_name], score_init))

    def score_indices(self, adapter_name: str, positions: torch.Tensor) -> torch.Tensor:
        """Flat indices of this layer's space for ``positions`` in S (the identity without candidates)."""
        candidates = self.graft_candidates.get(adapter_name)
        if candidates is None:
            return positions
        return candidates.to(positions.device)[positions]

    def gamma(self, adapter_name: str) -> torch.Tensor:
        """Paper Eq. 4: ``gamma_base * (1 - sigmoid(S)) + (1 - gamma_base) * sigmoid(S)``, dense."""
        gamma = torch.sigmoid(self.graft_scores[adapter_name])
        base = self.graft_base_region[adapter_name]
        return gamma.index_put((base,), 1.0 - gamma[base])

    def harden(self, adapter_name: str, num_entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hard region of the learned state: ``round(gamma)`` (or the top ``num_entries`` of ``gamma``)."""
        with torch.no_grad():
            gamma = self.gamma(adapter_name)
            moved = self.graft_movement[adapter_name] != 0
            if num_entries is None:
                positions = ((gamma >= 0.5) & moved).nonzero().reshape(-1)
            else:
                positions = torch.sort(torch.topk(torch.where(moved, gamma, -1.0), num_entries).indices).values
            return self.score_indices(adapter_name, positions), self.graft_movement[adapter_name][positions]

    def drop_training_state(self, adapter_name: str) -> None:
        self._hard_cache.pop(adapter_name, None)
        self._candidate_parts.pop(adapter_name, None)
        self._soft_buffers.pop(adapter_name, None)
        for container in (self.graft_scores, self.graft_movement, self.graft_base_region, self.graft_candidates):
            if adapter_name in container:
                del container[adapter_name]

    def is_training_region(self, adapter_name: str) -> bool:
        return adapter_name in self.graft_scores

    def use_hard_region(self, adapter_name: str, hard: bool) -> None:
        """While learning, make the forward apply ``round(gamma)`` (``hard=True``) or the soft gamma of Eq. 4."""
        self._hard_cache.pop(adapter_name, None)
        if hard and self.is_training_region(adapter_name):
            self._hard_cache[adapter_name] = self.harden(adapter_name)

    def num_hard_entries(self, adapter_name: str) -> int:
        """Size of ``round(gamma)`` (moved entries only), without materialising the region."""
        with torch.no_grad():
            gamma = self.gamma(adapter_name)
            return int(((gamma >= 0.5) & (self.graft_movement[adapter_name] != 0)).sum())

    def soft_parameters(self, adapter_name: str, recomputing: bool = False) -> dict[str, torch.Tensor]:
        """``theta_pre + gamma(S) * delta`` (paper Eq. 3-4) for every stored tensor, differentiable in S.

        With candidates, only the tensors holding candidates are returned (the others are ``theta_pre``).
        ``recomputing``: rebuilt in backward by ``RecomputeSoftParameters`` (dense only), whose sigmoid is kept for
        this layer's backward.
        """
        scores, movement = self.graft_scores[adapter_name], self._movement(adapter_name)
        if adapter_name in self.graft_candidates:
            parts = self._parts(adapter_name, scores.device)
            attrs = [attr for attr, _ in parts]
            thetas = [getattr(self.base_layer, attr) for attr in attrs]
            base = self.graft_base_region[adapter_name]
            # Reuse the output tensors across steps when a backward will release them (see BufferPool).
            pool = self._soft_buffers.setdefault(adapter_name, BufferPool()) if torch.is_grad_enabled() else None
            outputs = GraftedCandidates.apply(scores, movement, base, [p for _, p in parts], pool, *thetas)
            return dict(zip(attrs, outputs, strict=True))
        thetas = [getattr(self.base_layer, attr) for attr in self.stored_attrs]
        offsets = [int(o) for o in self.offsets]
        base = self.graft_base_region[adapter_name]
        outputs = GraftedTensors.apply(scores, movement, base, offsets, recomputing, *thetas)
        return dict(zip(self.stored_attrs, outputs, strict=True))

    def soft_rows(self, adapter_name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (sorted, unique) of this embedding's soft matrix, differentiable in S (see ``GraftedRows``)."""
        weight = self.base_layer.weight
        dim = weight.shape[1]
        rows = rows.to(torch.int64)
        place = torch.full((weight.shape[0],), -1, dtype=torch.int64, device=rows.device)
        place[rows] = torch.arange(rows.numel(), device=rows.device)  # row of the output, or -1
        base = self.graft_base_region[adapter_name].to(rows.device)
        candidates = self.graft_candidates.get(adapter_name)
        if candidates is None:  # S is the flat matrix: whole rows, and gamma_base by its flat indices
            positions = targets = None
            out_row = place[base // dim]
            hit = out_row >= 0
            flipped = torch.zeros(rows.numel() * dim, dtype=torch.bool, device=rows.device)
            flipped[out_row[hit] * dim + base[hit] % dim] = True
        else:  # S is over the candidates: those in rows, and gamma_base by position among them
            candidates = candidates.to(rows.device)
            out_row = place[candidates // dim]
            positions = (out_row >= 0).nonzero().reshape(-1)
            targets = out_row[positions] * dim + candidates[positions] % dim
            flipped = torch.isin(positions, base)
        scores, movement = self.graft_scores[adapter_name], self._movement(adapter_name)
        return GraftedRows.apply(scores, movement, weight, rows, positions, targets, flipped)

    def _movement(self, adapter_name: str) -> torch.Tensor:
        movement = self.graft_movement[adapter_name]
        device = self.graft_scores[adapter_name].device
        if movement.device != device:  # a plain dict does not follow module.to(): move it once
            movement = self.graft_movement[adapter_name] = movement.to(device)
        return movement

    def _parts(self, adapter_name: str, device: torch.device) -> list[tuple[str, tuple[int, int, torch.Tensor]]]:
        """Per stored tensor holding candidates: ``(attr, (a, b, local flat indices))``, cached."""
        parts = self._candidate_parts.get(adapter_name)
        if parts is None or (parts and parts[0][1][2].device != device):
            candidates = self.graft_candidates[adapter_name]
            if candidates.device != device:
                candidates = self.graft_candidates[adapter_name] = candidates.to(device)
            parts = [
                (attr, (position.start, position.stop, local.to(device)))
                for attr, local, position in self._split(candidates)
            ]
            self._candidate_parts[adapter_name] = parts
        return parts

    def base_values(self, indices: torch.Tensor) -> torch.Tensor:
        """Current values of the stored tensors at flat ``indices`` (as fp32)."""
        out = torch.empty(indices.numel(), dtype=torch.float32)
        for attr, local, position in self._split(indices):
            out[position] = getattr(self.base_layer, attr).detach().reshape(-1)[local.to(torch.int64)].float().cpu()
        return out

    def _split(self, indices: torch.Tensor):
        """Yield ``(attr, local indices, positions in indices)`` per stored tensor, for sorted flat ``indices``."""
        bounds = torch.searchsorted(indices.to(torch.int64).cpu(), self.offsets).tolist()
        for i, attr in enumerate(self.stored_attrs):
            if bounds[i + 1] > bounds[i]:
                position = slice(bounds[i], bounds[i + 1])
                yield attr, indices[position].to(torch.int64) - int(self.offsets[i]), position

    def sparse_entries(self, adapter_name: str, attr: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(local indices, values)`` of the hard region of ``adapter_name`` in stored tensor ``attr``."""
        indices, values = self.graft_indices[adapter_name], self.graft_values[adapter_name]
        for name, local, position in self._split(indices):
            if name == attr:
                return local, values[position]
        return None

    def _device(self) -> torch.device:
        param = next(self.base_layer.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        # Values stay fp32 whatever the base dtype (exactness), indices stay integers: move devices only.
        device = device or self._device()
        for name in self.adapter_layer_names + self.other_param_names:
            container = getattr(self, name)
            if adapter_name in container and container[adapter_name].device != device:
                item = container[adapter_name]
                container[adapter_name] = (
                    nn.Parameter(item.to(device), requires_grad=item.requires_grad)
                    if isinstance(item, nn.Parameter)
                    else item.to(device)
                )

    # ----------------------------------------------------------------------------------------------- checks
    def check_base(self, adapter_name: str) -> None:
        """Refuse to apply a graft made for other pre-trained values (see ``GraftConfig.verify_base``)."""
        expected = self.fingerprints.get(adapter_name)
        if not expected or not self.verify_base.get(adapter_name, True) or self.is_training_region(adapter_name):
            return
        indices = self.graft_indices[adapter_name][: len(expected)]
        found = self.base_values(indices)
        for attr, local, position in self._split(indices):
            dtype = getattr(self.base_layer, attr).dtype
            want = torch.tensor(expected[position], dtype=torch.float32).to(dtype).float()
            if not torch.equal(found[position], want):
                raise ValueError(
                    f"Graft {adapter_name!r} was made for a different pre-trained model: tensor {attr!r} of "
                    f"{type(self.base_layer).__name__} holds {found[position].tolist()} at entries {local.tolist()}, "
                    f"the graft expects {want.tolist()}. Load it onto the base it was made from, or override: "
                    "config = GraftConfig.from_pretrained(path); config.verify_base = False; "
                    "PeftModel.from_pretrained(model, path, config=config)."
                )
        self.verify_base[adapter_name] = False  # checked once

    # ----------------------------------------------------------------------------------------------- forward
    def _contribution(self, adapter_name: str, attr: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sparse ``(indices, values)`` of tensor ``attr`` (of the rounded region while one is being learned)."""
        if adapter_name in self._hard_cache:
            indices, values = self._hard_cache[adapter_name]
            for name, local, position in self._split(indices):
                if name == attr:
                    return local, values[position]
            return None
        if adapter_name not in self.graft_values:
            return None
        self.check_base(adapter_name)
        return self.sparse_entries(adapter_name, attr)

    def effective_parameters(
        self, adapter_names: list[str], recipes: dict[str, tuple[GraftLayer, str, str]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Parameters of the base layer with the given adapters grafted on, for those that change.

        ``recipes``, when given, receives ``attr -> (source layer, adapter, source attr)`` for every override that is
        exactly a dense soft parameter (``soft_parameters`` without candidates) of a learning adapter, so that it can
        be recomputed in backward.
        """
        sources = {attr: (self, attr) for attr in self.stored_attrs} | self.tied_sources
        overrides = {}
        soft: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # one autograd node per (source layer, adapter)
        for attr, (layer, source_attr) in sources.items():
            param = getattr(self.base_layer, attr)
            value = param
            recipe = None
            for adapter_name in adapter_names:
                if layer.is_training_region(adapter_name) and adapter_name not in layer._hard_cache:
                    key = (id(layer), adapter_name)
                    if key not in soft:
                        soft[key] = layer.soft_parameters(adapter_name)
                    if source_attr not in soft[key]:  # no candidate in this tensor: theta_pre
                        continue
                    # Soft graft of the learning adapter, plus what earlier adapters added to this tensor.
                    # Recompute in backward only the dense soft parameters: with candidates, keeping them measured no
                    # lower peak RSS and recomputing costs one more copy pass per layer.
                    dense = adapter_name not in layer.graft_candidates
                    recipe = (layer, adapter_name, source_attr) if value is param and dense else None
                    value = soft[key][source_attr] if value is param else value + (soft[key][source_attr] - param)
                    continue
                contribution = layer._contribution(adapter_name, source_attr)
                if contribution is None:
                    continue
                indices, values = contribution
                flat = value.reshape(-1)
                value = flat.index_put((indices,), (flat[indices].float() + values).to(param.dtype)).view_as(param)
                recipe = None
            if value is not param:
                overrides[attr] = value
                if recipe is not None and recipes is not None:
                    recipes[attr] = recipe
        return overrides

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(*args, **kwargs)
        if self.merged:
            return self.base_layer(*args, **kwargs)
        row_adapter = self._row_learning_adapter()
        if row_adapter is not None:
            return self._embedding_rows_forward(row_adapter, *args, **kwargs)
        recipes: dict[str, tuple[GraftLayer, str, str]] = {}
        overrides = self.effective_parameters(self.active_adapters, recipes)
        if not overrides:
            return self.base_layer(*args, **kwargs)
        if recipes and RECOMPUTE_SOFT_PARAMETERS and torch.is_grad_enabled():
            sources = {
                overrides[attr].untyped_storage().data_ptr(): (overrides[attr].dtype, *recipe)
                for attr, recipe in recipes.items()
            }
            with RecomputeSoftParameters(sources):
                return torch.func.functional_call(
                    self.base_layer, overrides, args, kwargs, tie_weights=False, strict=False
                )
        return torch.func.functional_call(self.base_layer, overrides, args, kwargs, tie_weights=False, strict=False)

    def _row_learning_adapter(self) -> str | None:
        """The learning adapter, when this layer is a plain ``nn.Embedding`` that only it changes: then a batch needs
        the soft values of the rows it looks up only (``soft_rows``), not of the whole matrix."""
        base = self.base_layer
        if not GRAFT_EMBEDDING_ROWS or type(base).forward is not nn.Embedding.forward:
            return None
        if base.max_norm is not None or base.sparse or self.tied_sources or self.stored_attrs != ["weight"]:
            return None
        if len(self.active_adapters) != 1:
            return None
        adapter_name = self.active_adapters[0]
        learning = self.is_training_region(adapter_name) and adapter_name not in self._hard_cache
        return adapter_name if learning else None

    def _embedding_rows_forward(self, adapter_name: str, input: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        rows, inverse = torch.unique(input, return_inverse=True)
        padding_idx = None
        if base.padding_idx is not None:
            found = (rows == base.padding_idx).nonzero()
            padding_idx = int(found[0, 0]) if found.numel() else None
        weight = self.soft_rows(adapter_name, rows)
        return F.embedding(inverse, weight, padding_idx, None, base.norm_type, base.scale_grad_by_freq, False)

    # ----------------------------------------------------------------------------------------------- merging
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Write the grafted values into the base tensors (exactly: unmerge restores the saved originals)."""
        for adapter_name in check_adapters_to_merge(self, adapter_names):
            if self.is_training_region(adapter_name):
                raise ValueError(f"Adapter {adapter_name!r} is still learning its region: harden it before merging.")
            # A layer storing nothing for this adapter (e.g. only applying a tied tensor) still records the merge,
            # so that its forward does not apply the (already merged) tied entries again.
            stored_here = adapter_name in self.graft_values
            if stored_here:
                self.check_base(adapter_name)
            backup = []
            for attr in self.stored_attrs:
                entries = self.sparse_entries(adapter_name, attr) if stored_here else None
                if entries is None:
                    backup.append(None)
                    continue
                indices, values = entries
                flat = getattr(self.base_layer, attr).data.view(-1)
                original = flat[indices].clone()
                merged = (original.float() + values.detach()).to(flat.dtype)
                if safe_merge and not torch.isfinite(merged).all():
                    raise ValueError(f"NaNs detected in the merged weights of adapter {adapter_name!r}.")
                flat[indices] = merged
                backup.append(original)
            self._merge_backup[adapter_name] = backup
            self.merged_adapters.append(adapter_name)

    def unmerge(self) -> None:
        """Restore the base tensors bit for bit, most recently merged adapter first."""
        while self.merged_adapters:
            adapter_name = self.merged_adapters.pop()
            for attr, original in zip(self.stored_attrs, self._merge_backup.pop(adapter_name), strict=True):
                if original is not None:
                    indices, _ = self.sparse_entries(adapter_name, attr)
                    getattr(self.base_layer, attr).data.view(-1)[indices] = original

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        self.fingerprints.pop(adapter_name, None)
        self.verify_base.pop(adapter_name, None)

    def __repr__(self) -> str:
        return "graft." + super().__repr__()
