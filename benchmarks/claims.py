"""Every performance claim the README and the guides quote, in one registry: what is measured, the baseline it is
paired with, the claimed median, the tolerance, where the figure comes from (``measures.py``: a measurement and one of
its figures) and where the claim is written. ``run_all.py`` re-measures them; ``render.py`` tables the result files.

A claim ``about`` a value holds where the measured median is within ``tolerance`` of it; an ``at_most`` claim holds
where the median is at most the claimed value plus ``tolerance``. Ratios are medians of per-round ratios, each round
timing the variant and its baseline back to back in one process (``bench_timing.rounds``); ``ms`` and ``B/param``
figures are absolute, a ``peak`` ratio compares peaks measured each in its own process.
"""

from __future__ import annotations

import dataclasses

TARGETS = ("about", "at_most")


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str
    what: str  # what is measured, with its shapes
    baseline: str  # what it is paired with
    claimed: float  # the claimed median
    tolerance: float  # how far the measured median may be from it (about) or above it (at_most)
    measure: str  # the measurement of measures.MEASURES
    figure: str  # the figure of that measurement
    source: str  # where the figure is quoted: a page, or a page#section
    target: str = "about"
    unit: str = "x"

    def verdict(self, median: float) -> str:
        """``"holds"`` or ``"does not hold here"`` for a measured median."""
        off = median - self.claimed if self.target == "at_most" else abs(median - self.claimed)
        ok = off <= self.tolerance + 1e-9  # a median at the edge holds, whatever the float rounding
        return "holds" if ok else "does not hold here"

    def claimed_text(self) -> str:
        sign = "<= " if self.target == "at_most" else ""
        spread = (
            f" ± {self.tolerance:g}" if self.target == "about" else f" (+{self.tolerance:g})" * bool(self.tolerance)
        )
        claimed = f"{self.claimed:.3f}"
        claimed = claimed[:-1] if claimed.endswith("0") else claimed  # 1.05, 1.035, 0.50
        return f"{sign}{claimed}{'x' if self.unit == 'x' else ' ' + self.unit}{spread}"


def value_text(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.2f} {unit}"


SGD = "plain SGD step, same model and batch"
BASE = "base model's forward, same batch"
LORA = "peft LoRA's mixed batch (r=8, as many adapters), same round"
ROBERTA = "random RoBERTa-base classifier (125M)"
MINILM = "MiniLM-L6 shapes (22.7M, random)"
# where BENCHMARKS.md quotes the figures
STEPS, SERVING = "BENCHMARKS.md#the-mask-step", "BENCHMARKS.md#serving-and-decoding"
CREATING, MEMORY = "BENCHMARKS.md#creating-and-loading-grafts", "BENCHMARKS.md#memory"

CLAIMS = [
    Claim("mask_step.roberta.dense", f"MaskTrainer step, dense S, {ROBERTA}, 4 x 32", SGD, 1.05, 0.15,
          "mask_step_roberta", "none", STEPS),
    Claim("mask_step.roberta.capped", f"MaskTrainer step, search_fraction=0.01, {ROBERTA}, 4 x 32", SGD, 0.84, 0.15,
          "mask_step_roberta", "0.01", STEPS),
    Claim("mask_step.roberta.dense_peak", "peak RSS of the dense-S step (own process), RoBERTa 4 x 32",
          "plain SGD's peak RSS (own process)", 1.82, 0.2, "mask_step_roberta", "none_peak",
          "BENCHMARKS.md#memory (2.82 / 1.55 GiB)"),
    Claim("mask_step.roberta.capped_peak", "peak RSS of the search_fraction=0.01 step (own process), RoBERTa 4 x 32",
          "plain SGD's peak RSS (own process)", 0.76, 0.1, "mask_step_roberta", "0.01_peak",
          "BENCHMARKS.md#memory (1.18 / 1.55 GiB)"),
    Claim("mask_step.minilm.dense", f"MaskTrainer step, dense S, {MINILM}, 32 x 64", SGD, 0.91, 0.15,
          "mask_step_minilm", "none", STEPS),
    Claim("mask_step.minilm.capped", f"MaskTrainer step, search_fraction=0.01, {MINILM}, 32 x 64", SGD, 0.89, 0.15,
          "mask_step_minilm", "0.01", STEPS),
    Claim("restriction.roberta.frozen", "restrict_training(frozen=0.1% of every tensor) step, RoBERTa 4 x 32",
          "plain AdamW(fused=True) step", 1.035, 0.1, "restriction_roberta", "frozen",
          STEPS),
    Claim("restriction.roberta.allowed", "restrict_training(allowed=0.1% of every tensor) step, RoBERTa 4 x 32",
          "plain AdamW(fused=True) step", 1.065, 0.1, "restriction_roberta", "allowed",
          STEPS),
    Claim("fisher.minilm.time", f"empirical fisher_diagonal per example, {MINILM}, 64 tokens",
          "plain forward + backward per example", 1.12, 0.15, "fisher_minilm", "empirical", STEPS),
    Claim("fisher.minilm.memory", f"peak RSS the empirical Fisher adds (own process), {MINILM}",
          "plain backward's peak RSS (own process)", 4.0, 1.5, "fisher_minilm", "empirical_bytes_per_parameter",
          "docs/fisher_surgical.md", unit="B/param"),
    Claim("surgical.minilm.top1", f"step training the top block and the head, {MINILM}, 8 x 64",
          "full fine-tuning step (SGD, frozen embeddings)", 0.52, 0.1, "surgical_minilm", "top1",
          STEPS),
    Claim("surgical.minilm.top3", f"step training the top 3 blocks and the head, {MINILM}, 8 x 64",
          "full fine-tuning step (SGD, frozen embeddings)", 0.70, 0.1, "surgical_minilm", "top3",
          STEPS),
    Claim("surgical.minilm.bottom1", f"step training the bottom block and the head, {MINILM}, 8 x 64",
          "full fine-tuning step (SGD, frozen embeddings)", 0.77, 0.1, "surgical_minilm", "bottom1",
          STEPS),
    Claim("surgical.minilm.bottom3", f"step training the bottom 3 blocks and the head, {MINILM}, 8 x 64",
          "full fine-tuning step (SGD, frozen embeddings)", 0.85, 0.1, "surgical_minilm", "bottom3",
          STEPS),
    Claim("creation.llama_22m", "get_peft_model, learn_region=True, search_fraction=0.01, sparsity 1e-4, llama-22m",
          "the same graft by top-k", 2.0, 0.0, "creation_llama", "learnable", CREATING, "at_most"),
    Claim("mixed.8.exact", f"8 grafts of 0.01% (own heads) in one mixed batch, exact mode, {ROBERTA}, 32 x 128",
          BASE, 1.10, 0.1, "mixed_8", "exact_over_base", SERVING),
    Claim("mixed.8.sparse_delta", "8 grafts of 0.01% in one mixed batch, sparse_delta mode, RoBERTa 32 x 128",
          BASE, 1.04, 0.1, "mixed_8", "sparse_delta_over_base", SERVING),
    Claim("mixed.8.sparse_delta_vs_lora", "8 grafts of 0.01%, sparse_delta mode, RoBERTa 32 x 128", LORA, 1.01, 0.05,
          "mixed_8", "sparse_delta_over_lora", SERVING),
    Claim("mixed.8.default_vs_lora", "8 grafts of 0.01%, the default mixed-batch mode, RoBERTa 32 x 128",
          f"{LORA} (ratio of the two ratios over the base)", 1.02, 0.0, "mixed_8", "default_over_lora",
          "issue 61: at most LoRA + 0.02", "at_most"),
    Claim("mixed.32.sparse_delta", "32 grafts of 0.01% in one mixed batch, sparse_delta mode, RoBERTa 32 x 128",
          BASE, 1.07, 0.1, "mixed_32", "sparse_delta_over_base", SERVING),
    Claim("mixed.32.sparse_delta_vs_lora", "32 grafts of 0.01%, sparse_delta mode, RoBERTa 32 x 128", LORA, 1.00,
          0.05, "mixed_32", "sparse_delta_over_lora", SERVING),
    Claim("decode.8.sparse_delta", "decode step, 8 mixed grafts of 0.01%, sparse_delta, SmolLM2-135M shapes, 8 x 64",
          "base model's decode step, same round", 1.13, 0.1, "decode_8", "graft_sparse_delta_over_base",
          SERVING),
    Claim("decode.8.sparse_delta_vs_lora", "decode step, 8 mixed grafts, sparse_delta, SmolLM2-135M shapes",
          "peft LoRA's mixed decode step (8 adapters), same round", 0.83, 0.1, "decode_8",
          "graft_sparse_delta_over_lora", SERVING),
    Claim("forward.unmerged", "unmerged forward of one graft of 12,500 entries, RoBERTa-base 4 x 32",
          "base model's forward, right before it", 1.035, 0.1, "forward_graft", "unmerged", SERVING),
    Claim("forward.switching", "set_adapter between two grafts of 12,500 entries + forward, RoBERTa-base 4 x 32",
          "base model's forward, right before it", 1.045, 0.1, "forward_graft", "switching", SERVING),
    Claim("switch.8_heads", "set_adapter among 8 loaded grafts of 0.01% with their own heads, RoBERTa-base",
          "none (absolute; two grafts without heads timed in turn)", 0.5, 0.25, "switch_8", "ms",
          CREATING, "at_most", "ms"),
    Claim("packed.1000", "RSS of 1,000 loaded grafts of 0.01% (no heads) over the base, RoBERTa-base",
          "the grafts' file sizes", 1.17, 0.1, "packed_1000", "peak_over_files", MEMORY),
]  # fmt: skip


def by_id() -> dict[str, Claim]:
    return {claim.id: claim for claim in CLAIMS}


def check_registry(measures: dict) -> None:
    """Every claim names a known measurement and target, and ids are unique; ``ValueError`` naming the claim if not."""
    seen = set()
    for claim in CLAIMS:
        if claim.id in seen:
            raise ValueError(f"claim {claim.id!r} is registered twice in benchmarks/claims.py.")
        seen.add(claim.id)
        if claim.measure not in measures:
            raise ValueError(f"claim {claim.id!r}: unknown measurement {claim.measure!r} (measures.MEASURES).")
        if claim.target not in TARGETS:
            raise ValueError(f"claim {claim.id!r}: target must be one of {TARGETS}, got {claim.target!r}.")
