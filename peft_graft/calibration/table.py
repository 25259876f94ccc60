"""One table of accuracy and calibration for several models on several (in- and out-of-distribution) datasets.

This is the shape of the grafting paper's OOD results (Tables 3 and 7): one row per ``(model, dataset)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .metrics import DEFAULT_N_BINS, REPORT_KEYS, ArrayLike, InputType, _n_bins_arg_validation, calibration_report

__all__ = ["DEFAULT_TABLE_METRICS", "CalibrationTable", "calibration_table", "print_table"]

logger = logging.getLogger(__name__)

DEFAULT_TABLE_METRICS = ("accuracy", "ece", "mce", "brier", "nll")


@dataclass
class CalibrationTable:
    """A tidy table: ``rows`` is a list of dicts sharing the keys in ``columns``.

    Use :meth:`to_markdown` (no dependency), :meth:`to_pandas` (needs pandas) or iterate over the rows.
    """

    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def row(self, model: str, dataset: str) -> dict[str, Any]:
        """The row of ``(model, dataset)``."""
        for r in self.rows:
            if r["model"] == model and r["dataset"] == dataset:
                return r
        raise KeyError(f"No row for model={model!r}, dataset={dataset!r}.")

    def to_markdown(self, floatfmt: str = ".4f") -> str:
        """Render as a GitHub-flavoured markdown table (floats formatted with ``floatfmt``)."""

        def fmt(value: Any) -> str:
            if value is None:
                return ""
            if isinstance(value, float):
                return format(value, floatfmt)
            return str(value).replace("|", "\\|")

        cells = [[fmt(r.get(c)) for c in self.columns] for r in self.rows]
        widths = [max([len(c), 3, *(len(row[i]) for row in cells)]) for i, c in enumerate(self.columns)]
        numeric = [all(isinstance(r.get(c), (int, float)) for r in self.rows) and self.rows for c in self.columns]

        def line(values: Sequence[str]) -> str:
            padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
            return "| " + " | ".join(padded) + " |"

        rule = (
            "|"
            + "|".join(
                ("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric, strict=True)
            )
            + "|"
        )
        return "\n".join([line(self.columns), rule, *(line(row) for row in cells)])

    def to_pandas(self) -> Any:
        """Return a ``pandas.DataFrame`` (pandas is optional: ``pip install pandas``)."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError(
                "CalibrationTable.to_pandas() needs pandas, which is an optional dependency: `pip install pandas` "
                "(or use .rows / .to_markdown())."
            ) from err
        return pd.DataFrame(self.rows, columns=self.columns)

    def __str__(self) -> str:
        return self.to_markdown()


def print_table(table: CalibrationTable, floatfmt: str = ".4f") -> None:
    """Print ``table`` as markdown."""
    print(table.to_markdown(floatfmt))


def _is_trainer(obj: Any) -> bool:
    return callable(getattr(obj, "predict", None)) and hasattr(obj, "args") and not isinstance(obj, Mapping)


def _unpack(output: Any, where: str) -> tuple[ArrayLike, ArrayLike | None]:
    if hasattr(output, "predictions"):
        preds, labels = output.predictions, getattr(output, "label_ids", None)
    elif isinstance(output, tuple) and len(output) == 2:
        preds, labels = output
    else:
        preds, labels = output, None
    if isinstance(preds, tuple):  # extra model outputs: the logits come first
        preds = preds[0]
    if isinstance(labels, tuple):
        labels = labels[0]
    if preds is None:
        raise ValueError(f"{where} produced no predictions.")
    return preds, labels


def _labels_from_dataset(dataset: Any, label_column: str, where: str) -> ArrayLike:
    try:
        return dataset[label_column]
    except (KeyError, TypeError, IndexError, ValueError):
        raise ValueError(
            f"{where} returned only predictions and the dataset has no column {label_column!r}; return "
            f"(logits, labels) from the callable or set `label_column`."
        ) from None


def _predict(source: Any, model: str, name: str, datasets: Mapping[str, Any] | None, label_column: str):
    where = f"Model {model!r} on dataset {name!r}"
    if isinstance(source, Mapping):
        if name not in source:
            raise ValueError(f"Precomputed predictions of model {model!r} have no dataset {name!r}.")
        return _unpack(source[name], where)
    if datasets is None:
        raise ValueError(f"Model {model!r} is a Trainer or callable: pass `datasets` (a dict name -> dataset).")
    dataset = datasets[name]
    if _is_trainer(source):
        output = source.predict(dataset, metric_key_prefix=f"test_{name}")
    elif callable(source):
        output = source(dataset)
    else:
        raise TypeError(
            f"Model {model!r} must be a Trainer, a callable dataset -> logits / (logits, labels), or a dict "
            f"dataset name -> (logits, labels); got {type(source).__name__}."
        )
    preds, labels = _unpack(output, where)
    return preds, (labels if labels is not None else _labels_from_dataset(dataset, label_column, where))


def calibration_table(
    models: Mapping[str, Any] | Any,
    datasets: Mapping[str, Any] | None = None,
    *,
    reference: str | None = None,
    n_bins: int = DEFAULT_N_BINS,
    input_type: InputType = "auto",
    metrics: Sequence[str] = DEFAULT_TABLE_METRICS,
    label_column: str = "label",
) -> CalibrationTable:
    """Evaluate one or several models on several named datasets; one row per ``(model, dataset)``.

    Args:
        models: ``{name: source}`` (or a single source, named ``"model"``). A source is a ``Trainer`` (its
            ``predict`` is called), a callable ``dataset -> logits`` or ``-> (logits, labels)``, or precomputed
            predictions ``{dataset_name: (logits, labels)}``.
        datasets: ``{name: dataset}`` for Trainer/callable sources (e.g. ``{"SST-2": id_ds, "IMDB": ood_ds}``). When
            a callable returns only logits, labels are read from ``dataset[label_column]``. For precomputed sources
            it restricts and orders the datasets; otherwise each source's own keys are used.
        reference: Name of the model to compare against: adds an ``agreement`` column (fraction of examples whose
            argmax prediction matches the reference model's on the same dataset).
        n_bins: Number of bins of the binned metrics.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        metrics: Columns from ``("accuracy", "ece", "mce", "adaptive_ece", "classwise_ece", "brier", "nll")``.
        label_column: Label column for callables that return only logits.

    Returns:
        A :class:`CalibrationTable` with columns ``model, dataset, n, <metrics>[, agreement]``.
    """
    _n_bins_arg_validation(n_bins)
    if not isinstance(models, Mapping) or (models and not all(isinstance(k, str) for k in models)):
        models = {"model": models}
    if not models:
        raise ValueError("Argument `models` is empty; pass e.g. {'FT': trainer_ft, 'graft': trainer_graft}.")
    unknown = set(metrics) - set(REPORT_KEYS)
    if unknown:
        raise ValueError(f"Argument `metrics` has unknown names {sorted(unknown)}; choose from {REPORT_KEYS}.")
    if reference is not None and reference not in models:
        raise ValueError(f"Argument `reference`={reference!r} is not one of the models {list(models)}.")

    def names_for(source: Any) -> list[str]:
        if datasets is not None:
            return list(datasets)
        if isinstance(source, Mapping):
            return list(source)
        raise ValueError("Argument `datasets` is required when a model is a Trainer or callable.")

    predictions: dict[str, dict[str, tuple[ArrayLike, ArrayLike]]] = {
        model: {name: _predict(source, model, name, datasets, label_column) for name in names_for(source)}
        for model, source in models.items()
    }
    columns = ["model", "dataset", "n", *metrics] + (["agreement"] if reference is not None else [])
    table = CalibrationTable(columns=columns)
    for model, per_dataset in predictions.items():
        for name, (preds, labels) in per_dataset.items():
            ref = None
            if reference is not None:
                if name not in predictions[reference]:
                    raise ValueError(f"Reference model {reference!r} has no predictions on dataset {name!r}.")
                ref = predictions[reference][name][0]
            report = calibration_report(preds, labels, n_bins, input_type, reference_preds=ref, metrics=metrics)
            table.rows.append({"model": model, "dataset": name, "n": len(labels), **report})
            logger.debug("Evaluated %s on %s: %s", model, name, report)
    return table
