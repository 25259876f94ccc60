"""Configuration of the ``graft`` PEFT method."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

from peft.config import PeftConfig

from .registration import GRAFT_NAME, extend_peft_type

RegionStrategy = Literal["movement", "random", "bias", "given", "empty"]
REGION_STRATEGIES: tuple[str, ...] = ("movement", "random", "bias", "given", "empty")


@dataclass
class GraftConfig(PeftConfig):
    """Configuration of a graft: ``theta = theta_pre + gamma * (theta_ft - theta_pre)`` with a sparse binary ``gamma``.

    Args:
        finetuned: The fine-tuned model theta_ft: a model object, a local path or Hub id, or a state dict. Only used
            when the graft is created (it is read once to form ``theta_ft - theta_pre``) and never saved.
        given_region: For ``region="given"``: a dict of boolean masks keyed by parameter name, a
            :class:`~peft_graft.Region`, or the path of a saved graft. Runtime only, never saved.
        finetuned_model_name_or_path: Recorded name of theta_ft when it was given as a path or Hub id.
        sparsity: Fraction of the eligible parameters to graft; the budget is ``k = round(sparsity * n_eligible)``.
        num_entries: Exact budget ``k``; overrides ``sparsity`` when set.
        region: How the region is chosen: ``"movement"`` (the paper's ``gamma_base``: top-k of
            ``|theta_ft - theta_pre|`` over all eligible tensors), ``"random"`` (seeded), ``"bias"`` (top-k movement
            among biases only), ``"given"`` (``given_region``), ``"empty"`` (``gamma_base = 0``, with
            ``learn_region=True`` only).
        seed: Seed of the ``"random"`` region.
        include_parameters: Regex (or list of regexes) a parameter name must match to be eligible; ``None`` = all.
        exclude_parameters: Regex (or list of regexes) that makes a parameter ineligible.
        only_moved: Count as eligible only tensors that fine-tuning moved (the paper's default).
        modules_to_save: Modules stored whole (e.g. a new classification head), outside the sparsity budget.
        learn_region: Keep ``theta_ft - theta_pre`` and real-valued scores ``S`` so that
            :class:`~peft_graft.MaskTrainer` can learn the region (paper Eq. 3-4). The dense state is never saved.
        score_init: Initial value of ``S``; ``sigmoid(-10) = 4.5e-5``, near 0 as in the paper's reference code.
        candidates: With ``learn_region=True``, learn ``S`` only on candidate coordinates: the global top-c entries
            by ``|theta_ft - theta_pre|`` united with ``gamma_base``, where c is a fraction of the eligible entries
            (a float in (0, 1]) or an exact count (an int >= 1). A departure from the paper, which learns ``S`` over
            every coordinate: it trades exactness of the search space for cost (S, the movement and the gradient of
            S then exist on the candidates only, and the learned region is a subset of them). ``None`` (default):
            the paper's dense search space.
        verify_base: Refuse to apply the graft onto a base whose values differ from the theta_pre it was made from.
        grafted_modules: Filled in by the library: number of grafted entries per module (needed to load).
        base_fingerprint: Filled in by the library: theta_pre at a few grafted entries per module.
    """

    # Not fields: a graft chooses its modules itself; peft's injection code reads these attributes.
    target_modules = None
    exclude_modules = None

    finetuned: InitVar[Any] = None
    given_region: InitVar[Any] = None
    finetuned_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Recorded name of theta_ft when given as a path or Hub id."}
    )
    sparsity: float | None = field(
        default=1e-4, metadata={"help": "Fraction of eligible parameters to graft (k = round(sparsity * n_eligible))."}
    )
    num_entries: int | None = field(default=None, metadata={"help": "Exact number of grafted entries k."})
    region: RegionStrategy = field(
        default="movement", metadata={"help": f"Region strategy, one of {REGION_STRATEGIES}."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the random region."})
    include_parameters: list[str] | str | None = field(
        default=None, metadata={"help": "Regex(es) a parameter name must match to be eligible."}
    )
    exclude_parameters: list[str] | str | None = field(
        default=None, metadata={"help": "Regex(es) that make a parameter ineligible."}
    )
    only_moved: bool = field(default=True, metadata={"help": "Only tensors moved by fine-tuning are eligible."})
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules stored whole, outside the sparsity budget (e.g. a new head)."}
    )
    learn_region: bool = field(
        default=False, metadata={"help": "Keep theta_ft - theta_pre and scores S for MaskTrainer (never saved)."}
    )
    score_init: float = field(default=-10.0, metadata={"help": "Initial scores S (sigmoid(S) near 0)."})
    candidates: float | int | None = field(
        default=None,
        metadata={
            "help": "Learn S only on the top-c movement entries plus gamma_base: c a fraction (float) of the eligible "
            "entries or a count (int). Not in the paper (dense S); None = dense."
        },
    )
    verify_base: bool = field(
        default=True, metadata={"help": "Refuse a base model whose values differ from the graft's theta_pre."}
    )
    grafted_modules: dict[str, int] = field(
        default_factory=dict, metadata={"help": "Set by the library: grafted entries per module."}
    )
    base_fingerprint: dict[str, list[float]] = field(
        default_factory=dict, metadata={"help": "Set by the library: theta_pre at a few grafted entries per module."}
    )

    def __post_init__(self, finetuned: Any, given_region: Any) -> None:
        super().__post_init__()
        self.peft_type = extend_peft_type(GRAFT_NAME.upper())
        # Runtime objects are attributes, not fields: they are never serialised.
        self._finetuned = finetuned
        self._given_region = given_region
        if isinstance(finetuned, str) and self.finetuned_model_name_or_path is None:
            self.finetuned_model_name_or_path = finetuned
        self._validate()

    def _validate(self) -> None:
        if self.region not in REGION_STRATEGIES:
            raise ValueError(f"Unknown region strategy region={self.region!r}: use one of {REGION_STRATEGIES}.")
        if self.num_entries is not None:
            if isinstance(self.num_entries, bool) or not isinstance(self.num_entries, int):
                raise TypeError(f"num_entries must be an int, got {type(self.num_entries).__name__}.")
            if self.num_entries < 1:
                raise ValueError(f"num_entries must be at least 1, got {self.num_entries}.")
        elif self.region not in ("given", "empty"):
            if self.sparsity is None or not isinstance(self.sparsity, (int, float)) or isinstance(self.sparsity, bool):
                raise TypeError(f"sparsity must be a float in (0, 1], got {self.sparsity!r}.")
            if not (0.0 < self.sparsity <= 1.0) or math.isnan(self.sparsity):
                raise ValueError(f"sparsity must lie in (0, 1], got {self.sparsity}: e.g. 1e-4 grafts 0.01%.")
        if self.candidates is not None:
            if isinstance(self.candidates, bool) or not isinstance(self.candidates, (int, float)):
                raise TypeError(
                    f"candidates must be a float fraction in (0, 1], an int count >= 1 or None, got "
                    f"{type(self.candidates).__name__}."
                )
            if isinstance(self.candidates, float) and (math.isnan(self.candidates) or not 0.0 < self.candidates <= 1.0):
                raise ValueError(
                    f"candidates={self.candidates}: a float is a fraction of the eligible entries in (0, 1]; pass an "
                    "int for an exact count."
                )
            if isinstance(self.candidates, int) and self.candidates < 1:
                raise ValueError(f"candidates={self.candidates}: an int count must be at least 1.")
            if not self.learn_region and not self.grafted_modules:
                raise ValueError("candidates only applies while learning a region: set learn_region=True.")
        if self.region == "empty" and not self.learn_region and not self.grafted_modules:  # hardened: fine
            raise ValueError('region="empty" (gamma_base = 0) is only meaningful with learn_region=True.')
        if self.region == "given" and self._given_region is None and not self.grafted_modules:
            raise ValueError('region="given" needs given_region=<masks, Region or saved graft path>.')

    @property
    def is_created(self) -> bool:
        """Whether this config describes an existing graft (loaded or already injected)."""
        return bool(self.grafted_modules)

    def candidate_count(self, num_eligible: int) -> int:
        """The number c of top-movement candidate coordinates (``candidates``) out of ``num_eligible`` entries."""
        c = self.candidates if isinstance(self.candidates, int) else round(self.candidates * num_eligible)
        if c > num_eligible:
            raise ValueError(
                f"candidates={self.candidates} exceeds the {num_eligible} eligible parameters: lower it (or use a "
                "float fraction)."
            )
        if c < 1:
            raise ValueError(
                f"candidates={self.candidates} of {num_eligible} eligible parameters rounds to 0 entries: raise it."
            )
        return c

    def budget(self, num_eligible: int) -> int:
        """The exact number of entries k to graft out of ``num_eligible`` eligible ones."""
        k = self.num_entries if self.num_entries is not None else round(self.sparsity * num_eligible)
        if k > num_eligible:
            raise ValueError(
                f"The budget of {k} entries exceeds the {num_eligible} eligible parameters: lower sparsity or "
                "num_entries, or widen include_parameters/exclude_parameters/only_moved."
            )
        if k < 1:
            raise ValueError(
                f"sparsity={self.sparsity} of {num_eligible} eligible parameters rounds to 0 entries: raise sparsity "
                "or set num_entries."
            )
        return k
