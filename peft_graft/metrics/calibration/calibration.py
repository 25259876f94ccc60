"""`evaluate` module for calibration metrics: ECE, MCE, adaptive ECE, classwise ECE, Brier score, NLL, accuracy.

Load it offline from its directory (the script name matches the directory name, as `evaluate` requires); the
directory ships with the installed package and its path is ``peft_graft.calibration.EVALUATE_MODULE_PATH``::

    import evaluate
    from peft_graft.calibration import EVALUATE_MODULE_PATH
    calibration = evaluate.load(EVALUATE_MODULE_PATH)
    calibration.compute(predictions=logits, references=labels, n_bins=15)

It is a thin layer over :func:`peft_graft.calibration.calibration_report`, so ``peft_graft`` must be importable.
"""

import datasets
import evaluate

from peft_graft.calibration.metrics import DEFAULT_N_BINS, calibration_report

_CITATION = """\
@inproceedings{guo2017calibration,
  title={On Calibration of Modern Neural Networks},
  author={Guo, Chuan and Pleiss, Geoff and Sun, Yu and Weinberger, Kilian Q.},
  booktitle={International Conference on Machine Learning},
  year={2017}
}
@inproceedings{panigrahi2023skill,
  title={Task-Specific Skill Localization in Fine-tuned Language Models},
  author={Panigrahi, Abhishek and Saunshi, Nikunj and Zhao, Haoyu and Arora, Sanjeev},
  booktitle={International Conference on Machine Learning},
  year={2023}
}
"""

_DESCRIPTION = """\
Calibration of a classifier's predicted probabilities. The expected calibration error (ECE) uses the top-label
confidence and M equal-width bins I_m = [(m-1)/M, m/M) (a confidence of exactly 1 falls in the last bin):
ECE = sum_m |B_m|/n * |acc(B_m) - conf(B_m)|. The maximum calibration error (MCE) is the largest per-bin gap,
the adaptive ECE uses equal-mass bins, the classwise ECE averages the ECE of every class probability. Also
reports accuracy, the multi-class Brier score and the negative log-likelihood.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: logits or probabilities, shape (n, num_classes); or, for binary tasks, one positive-class score
        per example, shape (n,).
    references: integer labels, shape (n,).
    n_bins: number of bins M (default 15, the default of Guo et al.'s reference ECE code;
        the grafting paper does not state M).
    input_type: "auto" (default), "logits" or "probs". With "auto", arrays whose values all lie in [0, 1] are
        probabilities (2-D rows must then sum to 1), anything else is logits; 1-D scores are P(y=1) or a logit.
    metrics: optional subset of ("accuracy", "ece", "mce", "adaptive_ece", "classwise_ece", "brier", "nll").
Returns:
    dict with keys accuracy, ece, mce, adaptive_ece, classwise_ece, brier, nll (floats).
Examples:
    >>> calibration = evaluate.load(EVALUATE_MODULE_PATH)
    >>> calibration.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0], metrics=["accuracy", "ece"])
    {'accuracy': 0.5, 'ece': 0.45}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Calibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Sequence(datasets.Value("float64")),
                        "references": datasets.Value("int64"),
                    }
                ),
                datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}),
            ],
            reference_urls=["https://arxiv.org/abs/1706.04599", "https://arxiv.org/abs/2302.06600"],
        )

    def _compute(self, predictions, references, n_bins=DEFAULT_N_BINS, input_type="auto", metrics=None):
        return calibration_report(predictions, references, n_bins=n_bins, input_type=input_type, metrics=metrics)
