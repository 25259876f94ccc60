"""Configuration of the ``graft`` PEFT method."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import InitVar, dataclass, field
from typing import Any

from peft.config import PeftConfig

from .._peft_compat import extend_peft_type
from ..regions.region import Region
from ..regions.strategies import get_region_strategy
from .provenance import check_provenance

GRAFT_NAME = "graft"
GRAFT_PREFIX = "graft_"


@dataclass
class GraftConfig(PeftConfig):
    """Configuration of a graft: ``theta = theta_pre + gamma * (theta_ft - theta_pre)`` with a sparse binary ``gamma``.

    Args:
        finetuned: The fine-tuned model theta_ft: a model object, a local path or Hub id, or a state dict. Only used
            when the graft is created and never saved. A path or Hub id of safetensors files (one file or sharded) is
            streamed: one shard open at a time and one tensor read at a time, so creating the graft holds the
            pre-trained model plus one shard, never a second model.
        given_region: For ``region="given"``: a dict of boolean masks keyed by parameter name, a
            :class:`~peft_graft.Region`, or the path of a saved graft. Runtime only, never saved.
        region_scores: For ``region="fisher"``: per-parameter scores (tensors of the parameters' shapes, by parameter
            name), e.g. the Fisher diagonal of :func:`peft_graft.scores.fisher_diagonal`. Runtime only, never saved.
        finetuned_model_name_or_path: Recorded name of theta_ft when it was given as a path or Hub id.
        sparsity: The budget as a fraction of the *eligible* entries: ``k = round(sparsity * n_eligible)``, where
            ``n_eligible`` counts the entries of the tensors that pass ``include_parameters``/``exclude_parameters``,
            are not stored whole (``modules_to_save``) and, with ``only_moved``, that fine-tuning moved. It is not a
            fraction of all parameters: reports (``graft_stats()``, ``print_trainable_parameters()``, the model card,
            MaskTrainer's logs) give a graft's size as ``fraction_of_parameters``, entries over all parameters of the
            base model. The word means this budget and nothing else in the package.
        num_entries: Exact budget ``k``; overrides ``sparsity`` when set.
        region: A :class:`~peft_graft.Region` (the same as ``region="given", given_region=<it>``), or the name of the
            region strategy (see :mod:`peft_graft.regions.strategies`): ``"movement"`` (the paper's
            ``gamma_base``: top-k of ``|theta_ft - theta_pre|`` over all eligible tensors), ``"random"`` (seeded),
            ``"bias"`` (top-k movement among biases only), ``"fisher"`` (a FISH mask: top-k of ``region_scores``),
            ``"given"`` (``given_region``), ``"empty"``
            (``gamma_base = 0``, with ``learn_region=True`` only), or any name registered with
            :func:`~peft_graft.register_region_strategy`.
        seed: Seed of the ``"random"`` region.
        include_parameters: Regex (or list of regexes) a parameter name must match to be eligible; ``None`` = all.
        exclude_parameters: Regex (or list of regexes) that makes a parameter ineligible.
        only_moved: Count as eligible only tensors that fine-tuning moved (the paper's default).
        modules_to_save: Modules stored whole (e.g. a new classification head), outside the sparsity budget.
        learn_region: Keep ``theta_ft - theta_pre`` and real-valued scores ``S`` so that
            :class:`~peft_graft.MaskTrainer` can learn the region (paper Eq. 3-4). The dense state is never saved.
        score_init: Initial value of ``S``: ``sigmoid(-10) = 4.5e-5``, near 0 as the paper asks.
        score_init_width: With a width ``w > 0``, S starts uniform in ``[score_init, score_init + w)`` (seeded by
            ``seed`` and the module name, so every process draws the same S). The paper's reference code starts S
            uniform in [0, 1) under a sigmoid shifted by 10: ``score_init=-10, score_init_width=1``. ``0`` (default):
            a constant start.
        search_fraction: With ``learn_region=True``, learn ``S`` only on a *search space*: the top
            ``search_fraction`` of the eligible entries by ``|theta_ft - theta_pre|``, united with ``gamma_base``. A
            departure from the paper, which learns ``S`` over every entry: S, the movement and the gradient of S
            then exist on the search space only (much cheaper), and the learned region is a subset of it. ``None``
            (default): the paper's dense search space.
        search_entries: The search space as an exact number of top-movement entries; overrides ``search_fraction``.
        verify_base: Refuse to apply the graft onto a base whose values differ from the theta_pre it was made from.
        grafted_modules: Filled in by the library: number of grafted entries per module (needed to load).
        base_fingerprint: Filled in by the library: theta_pre at a few grafted entries per module.
        base_checksum: Filled in by the library: a checksum of theta_pre at every grafted entry, per module.
        exact_entries: Filled in by the library: the number of entries per module stored as theta_ft itself, because
            no fp32 delta reproduces it (see ``GraftLayer``).
        weights_checksum: Filled in when saving: the sha256 of ``adapter_model.safetensors``, checked when a local
            graft is loaded.
        region_provenance: Filled in by the library: how the region was found, a JSON object (the strategy and size
            of the starting region, whether and by what it was learned, steps, which mask was kept and the selection's
            metric and p-value; see :mod:`peft_graft.tuner.provenance`). Descriptive only: ``None`` in grafts saved by
            older versions, which load as before.
        format_version: Filled in when saving: 1 for a save that records every integrity field (``weights_checksum``,
            ``base_checksum``, ``base_fingerprint``); loading one that lacks any is refused. Set it to 0 to load a
            graft saved by an older peft_graft without them (``GraftConfig.from_pretrained(path)``, then
            ``PeftModel.from_pretrained(model, path, config=config)``).
    """

    # Not fields: a graft chooses its modules itself; peft's injection code reads these attributes.
    target_modules = None
    exclude_modules = None

    finetuned: InitVar[Any] = None
    given_region: InitVar[Any] = None
    region_scores: InitVar[Any] = None
    finetuned_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Recorded name of theta_ft when given as a path or Hub id."}
    )
    sparsity: float | None = field(
        default=1e-4,
        metadata={
            "help": "Budget as a fraction of the eligible entries (moved, filtered, not stored whole): k = "
            "round(sparsity * n_eligible). Not a fraction of all parameters (reports say fraction_of_parameters)."
        },
    )
    num_entries: int | None = field(default=None, metadata={"help": "Exact number of grafted entries k."})
    region: str = field(
        default="movement",
        metadata={"help": "Region strategy: movement, random, bias, fisher, given, empty, or a registered name."},
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
    score_init_width: float = field(
        default=0.0, metadata={"help": "S starts uniform in [score_init, score_init + width); reference code: 1."}
    )
    search_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Learn S only on this fraction of the eligible entries (top movement) plus gamma_base. Not in the "
            "paper (dense S); None = dense."
        },
    )
    search_entries: int | None = field(
        default=None,
        metadata={
            "help": "Learn S only on this many top-movement entries plus gamma_base (overrides search_fraction)."
        },
    )
    verify_base: bool = field(
        default=True, metadata={"help": "Refuse a base model whose values differ from the graft's theta_pre."}
    )
    grafted_modules: dict[str, int] = field(
        default_factory=dict, metadata={"help": "Set by the library: grafted entries per module."}
    )
    base_checksum: dict[str, str] = field(
        default_factory=dict, metadata={"help": "Set by the library: checksum of theta_pre at the grafted entries."}
    )
    base_fingerprint: dict[str, list[float]] = field(
        default_factory=dict, metadata={"help": "Set by the library: theta_pre at a few grafted entries per module."}
    )
    exact_entries: dict[str, int] = field(
        default_factory=dict,
        metadata={"help": "Set by the library: entries per module stored as theta_ft (no fp32 delta gives it)."},
    )
    weights_checksum: str | None = field(
        default=None, metadata={"help": "Set when saving: sha256 of the adapter's weights file, verified on load."}
    )
    region_provenance: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Set by the library: how the region was found (strategy, size, learned by MaskTrainer, steps, "
            "the mask kept and its selection)."
        },
    )
    format_version: int | None = field(
        default=None,
        metadata={"help": "Set when saving: 1 = every integrity field recorded; 0 = an older save, loaded knowingly."},
    )

    def __post_init__(self, finetuned: Any, given_region: Any, region_scores: Any) -> None:
        super().__post_init__()
        self.peft_type = extend_peft_type(GRAFT_NAME.upper())
        # Runtime objects are attributes, not fields: they are never serialised.
        self._finetuned = finetuned
        self._given_region = given_region
        self._region_scores = region_scores
        self._take_region_object()
        if isinstance(finetuned, str) and self.finetuned_model_name_or_path is None:
            self.finetuned_model_name_or_path = finetuned
        self._validate()
        self._intern_module_names()

    def _take_region_object(self) -> None:
        """``region=<a Region>`` means ``region="given", given_region=<that Region>``; ``region`` is otherwise a
        strategy's name (a ``TypeError`` saying what to pass)."""
        if isinstance(self.region, Region):
            if self._given_region is not None:
                raise ValueError(
                    "region=<a Region> and given_region= were both given: pass the region once, as region=<Region> "
                    'or as region="given", given_region=<Region>.'
                )
            self.region, self._given_region = "given", self.region
        elif not isinstance(self.region, str) and not self.is_created:  # a loaded graft needs no strategy
            raise TypeError(
                f"region must be the name of a region strategy (a string such as 'movement') or a Region, got "
                f"{type(self.region).__name__}. Pass boolean masks or a saved graft's path as "
                'region="given", given_region=<masks, Region or path>.'
            )

    def _intern_module_names(self) -> None:
        """Intern the module names keying the recorded layout: a thousand loaded grafts of one model then share one
        copy of each name (issue 28) instead of holding one per graft."""
        for name in ("grafted_modules", "base_checksum", "base_fingerprint", "exact_entries"):
            value = getattr(self, name)
            if isinstance(value, dict) and value:
                setattr(self, name, {sys.intern(k) if type(k) is str else k: v for k, v in value.items()})

    def _validate(self) -> None:
        self._check_recorded_layout()
        if not self.is_created:  # a loaded graft does not need its strategy any more
            strategy = get_region_strategy(self.region)
            if strategy.uses_budget and self.num_entries is None:
                _check_fraction("sparsity", self.sparsity, "e.g. 1e-4 grafts 0.01%")
        if self.num_entries is not None:
            _check_count("num_entries", self.num_entries)
        version = self.format_version
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"format_version must be an int >= 0 (or absent), got {version!r}.")
        for name in ("only_moved", "learn_region", "verify_base"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}.")
        if isinstance(self.modules_to_save, str):  # one module name, as peft's target_modules accepts
            self.modules_to_save = [self.modules_to_save]
        for name in ("include_parameters", "exclude_parameters", "modules_to_save"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, (str, list, tuple))):
                raise TypeError(f"{name} must be a string, a list of strings or None, got {type(value).__name__}.")
            if isinstance(value, (list, tuple)) and not all(isinstance(item, str) for item in value):
                raise TypeError(f"{name} must hold strings only, got {value!r:.200}.")
        for name in ("include_parameters", "exclude_parameters"):
            patterns = getattr(self, name)
            for pattern in [patterns] if isinstance(patterns, str) else patterns or []:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as error:
                    raise ValueError(f"{name}: {pattern!r} is not a valid regular expression ({error}).") from error
        for name in ("score_init", "score_init_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.score_init_width < 0:
            raise ValueError(f"score_init_width must be >= 0, got {self.score_init_width}.")
        if self.search_entries is not None:
            _check_count("search_entries", self.search_entries)
        elif self.search_fraction is not None:
            _check_fraction("search_fraction", self.search_fraction, "use search_entries for an exact count")
        searching = self.search_fraction is not None or self.search_entries is not None
        if searching and not self.learn_region and not self.is_created:
            raise ValueError(
                "search_fraction/search_entries only apply while learning a region: set learn_region=True."
            )
        if self.region == "empty" and not self.learn_region and not self.is_created:
            raise ValueError('region="empty" (gamma_base = 0) is only meaningful with learn_region=True.')
        if self.region == "given" and self._given_region is None and not self.is_created:
            raise ValueError('region="given" needs given_region=<masks, Region or saved graft path>.')
        if self.region == "fisher" and self._region_scores is None and not self.is_created:
            raise ValueError(
                'region="fisher" needs region_scores=<Fisher diagonal by parameter name>, e.g. '
                "peft_graft.scores.fisher_diagonal(model, dataset)."
            )

    def _check_recorded_layout(self) -> None:
        """The fields the library fills in must have the shapes it writes (a saved config may have been altered)."""

        def refuse(name: str, problem: str) -> None:
            raise ValueError(
                f"{name} {problem}. This field is written by peft_graft when a graft is created: the "
                "adapter_config.json was altered or not written by peft_graft. Save the graft again."
            )

        def mapping(name: str, valid: Any, expected: str) -> dict:
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and valid(v) for k, v in value.items()):
                refuse(name, f"must map module names to {expected}, got {value!r:.200}")
            return value

        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        grafted = mapping("grafted_modules", count, "entry counts (ints >= 0)")
        exact = mapping("exact_entries", count, "entry counts (ints >= 0)")
        mapping("base_fingerprint", lambda v: isinstance(v, list) and all(map(number, v)), "lists of numbers")
        mapping("base_checksum", lambda v: isinstance(v, str), "strings")
        check_provenance(self.region_provenance)
        for module, num_exact in exact.items():
            if num_exact > grafted.get(module, 0):
                refuse("exact_entries", f"records {num_exact} exact entries for {module!r}, which has "
                       f"{grafted.get(module, 0)} grafted entries")  # fmt: skip

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: str | None = None, **kwargs) -> GraftConfig:
        """peft's ``from_pretrained``; the config remembers the file it was read from, for error messages."""
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        config._source = os.path.join(os.fspath(pretrained_model_name_or_path), subfolder or "", "adapter_config.json")
        return config

    @property
    def source(self) -> str:
        """The file this config was read from, or a description of it."""
        return repr(getattr(self, "_source", None) or "the adapter config")

    @property
    def is_created(self) -> bool:
        """Whether this config describes an existing graft (loaded or already injected)."""
        return bool(self.grafted_modules)

    @property
    def searches_subset(self) -> bool:
        """Whether ``S`` is learned on a search space smaller than the eligible entries."""
        return self.search_entries is not None or self.search_fraction is not None

    def search_space_size(self, num_eligible: int) -> int:
        """The number of top-movement entries of the search space (``search_entries``/``search_fraction``)."""
        if self.search_entries is not None:
            size, field_name = self.search_entries, "search_entries"
        else:
            size, field_name = round(self.search_fraction * num_eligible), "search_fraction"
        return _check_budget(size, num_eligible, field_name, getattr(self, field_name))

    def budget(self, num_eligible: int) -> int:
        """The exact number of entries k to graft out of ``num_eligible`` eligible ones."""
        if self.num_entries is not None:
            return _check_budget(self.num_entries, num_eligible, "num_entries", self.num_entries)
        return _check_budget(round(self.sparsity * num_eligible), num_eligible, "sparsity", self.sparsity)


def _check_fraction(name: str, value: Any, hint: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in (0, 1], got {value!r}.")
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value}: {hint}.")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")


def _check_budget(size: int, num_eligible: int, name: str, value: Any) -> int:
    """``size`` entries out of ``num_eligible``, or a clear error naming the field that asked for them."""
    if size > num_eligible:
        raise ValueError(
            f"{name}={value} asks for {size} entries, which exceeds the {num_eligible} eligible parameters: lower it, "
            "or widen include_parameters/exclude_parameters/only_moved."
        )
    if size < 1:
        raise ValueError(f"{name}={value} of {num_eligible} eligible parameters rounds to 0 entries: raise it.")
    return size
