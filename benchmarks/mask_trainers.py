"""The trainers of the mask-step benchmark (``bench_mask_step.py``): plain SGD, and ``MaskTrainer`` on a graft of each
variant (``none``: dense S; a fraction or a count: a search space), with the suffixes that force one choice each
(``use_variant``)."""

from __future__ import annotations

import dataclasses

import torch
from peft import get_peft_model
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments
from peft_graft.tuner import autograd

# The path rule of a linear layer's search space, to force one path (``:sparse``); absent before issue 38 (this script
# also runs against older commits through PYTHONPATH, see --profile).
LinearPattern = getattr(autograd, "LinearPattern", None)
SPARSE_IS_CHEAPER = getattr(LinearPattern, "sparse_is_cheaper", None)
SPARSITY = 1e-4

REFERENCE = "reference"  # the paper's code (``mask_reference.py``): a variant with no GraftConfig


# ----------------------------------------------------------------------------------------------- trainers
def plain_trainer(model: torch.nn.Module, device: str = "cpu") -> Trainer:
    args = TrainingArguments(
        output_dir="/tmp/bench_plain", optim="sgd", learning_rate=1e-3, report_to=[], use_cpu=device == "cpu"
    )
    return Trainer(model=model, args=args)


def search_space(text: str) -> dict[str, float | int]:
    """``GraftConfig`` search-space fields of a variant: ``none`` (dense S), a fraction (float) or a count (int);
    ``reference`` (no ``GraftConfig``) has none."""
    text = text.split(":")[0]
    if text.lower() in ("none", REFERENCE):
        return {}
    return {"search_fraction": float(text)} if any(c in text for c in ".e") else {"search_entries": int(text)}


VARIANT_FLAGS = ("keep", "recompute", "no-rows", "sparse", "copy")


def use_variant(variant: str) -> None:
    """Set the layer switches for ``VALUE[:keep|:recompute][:no-rows][:sparse|:copy]`` (see the module docstring)."""
    flags = variant.split(":")[1:]
    if flags and variant.split(":")[0] == REFERENCE:
        raise ValueError(f"Variant {variant!r}: the reference step takes no suffixes.")
    unknown = set(flags) - set(VARIANT_FLAGS)
    if unknown or {"sparse", "copy"} <= set(flags) or {"keep", "recompute"} <= set(flags):
        raise ValueError(
            f"Variant {variant!r}: suffixes are one of :keep or :recompute, :no-rows and one of :sparse or :copy, got "
            f"{flags}."
        )
    if hasattr(graft_layer, "RECOMPUTE_SOFT_PARAMETERS"):  # a commit before the MaskTrainingArguments field
        graft_layer.RECOMPUTE_SOFT_PARAMETERS = "keep" not in flags
    graft_layer.GRAFT_EMBEDDING_ROWS = "no-rows" not in flags
    graft_layer.GRAFT_SPARSE_LINEAR = "copy" not in flags
    if SPARSE_IS_CHEAPER is not None:
        LinearPattern.sparse_is_cheaper = (lambda self, tokens: True) if "sparse" in flags else SPARSE_IS_CHEAPER


def mask_trainer(pre: torch.nn.Module, finetuned, variant: str, device: str = "cpu") -> MaskTrainer:
    """``finetuned``: a model object (encoders) or the path of a saved checkpoint (Llama models)."""
    heads = None if isinstance(pre, LlamaForCausalLM) else ["classifier"]
    config = GraftConfig(
        finetuned=finetuned, sparsity=SPARSITY, learn_region=True, modules_to_save=heads, **search_space(variant)
    )
    model = get_peft_model(pre, config)
    flags = variant.split(":")[1:]
    recompute = True if "recompute" in flags else False if "keep" in flags else None
    if "recompute_soft_parameters" in {f.name for f in dataclasses.fields(MaskTrainingArguments)}:
        extra = {"recompute_soft_parameters": recompute}
    else:  # a commit before the field: use_variant sets the module switch
        extra = {}
    args = MaskTrainingArguments(
        output_dir="/tmp/bench_mask", report_to=[], use_cpu=device == "cpu", mask_batch_size=None, **extra
    )
    trainer = MaskTrainer(model=model, args=args)
    assert trainer.args.gradient_accumulation_steps == 1  # one step = one micro-batch, as the plain step
    return trainer
