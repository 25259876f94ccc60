"""Helpers shared by the tests: tiny random models built from configs (no download), a synthetic "fine-tuning",
the small MaskTrainer set-ups several test modules use, and running a script in 2 processes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch
from datasets import Dataset
from peft import get_peft_model
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
)

from peft_graft import GraftConfig, GraftLayer, MaskTrainingArguments, Region

VOCAB = 99
SMALL = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, max_position_embeddings=64)


def make_bert_cls() -> BertForSequenceClassification:
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_labels=3, **SMALL))


def make_roberta_cls() -> RobertaForSequenceClassification:
    return RobertaForSequenceClassification(RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_labels=2, **SMALL))


def make_roberta_mlm() -> RobertaForMaskedLM:
    return RobertaForMaskedLM(RobertaConfig(vocab_size=VOCAB, hidden_size=32, **SMALL))


def make_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return GPT2LMHeadModel(config)


def make_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=37,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


# name -> (factory, task_type, tied tensor groups expected)
ARCHITECTURES = {
    "bert_cls": (make_bert_cls, "SEQ_CLS"),
    "roberta_cls": (make_roberta_cls, "SEQ_CLS"),
    "roberta_mlm": (make_roberta_mlm, None),
    "gpt2": (make_gpt2, "CAUSAL_LM"),
    "llama": (make_llama, "CAUSAL_LM"),
}


def finetune_like(model: torch.nn.Module, scale: float = 0.01, seed: int = 1, skip: str | None = None):
    """A copy of ``model`` (any ``nn.Module``) with every parameter moved by seeded noise (a stand-in for
    fine-tuning)."""
    generator = torch.Generator().manual_seed(seed)
    finetuned = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in finetuned.named_parameters():
            if skip is None or skip not in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return finetuned.eval()


def make_pair(arch: str, seed: int = 0, skip: str | None = None):
    """``(pre, finetuned, task_type)``: a tiny pre-trained model and its "fine-tuned" copy."""
    factory, task_type = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    pre = factory().eval()
    return pre, finetune_like(pre, skip=skip), task_type


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    copy = type(model)(model.config).to(next(model.parameters()).dtype)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def input_ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def fast_args(tmp_path, **kwargs) -> MaskTrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    return MaskTrainingArguments(**{**defaults, **kwargs})


def cls_dataset(n: int = 16, length: int = 9, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def learning_graft(arch: str = "roberta_cls", dtype: torch.dtype | None = None, **config):
    """A tiny graft learning its region (of the pair cast to ``dtype`` when given); dropout off, so that differently
    split batches give the same step."""
    pre, finetuned, task_type = make_pair(arch)
    if dtype is not None:
        pre, finetuned = pre.to(dtype), finetuned.to(dtype)
    config = {"num_entries": 20, "learn_region": True, "task_type": task_type, **config}
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, **config))
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return pre, model


def scores(model) -> dict[str, torch.Tensor]:
    return {
        n: m.learner("default").scores.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, GraftLayer) and m.is_learning("default")
    }


def check_bf16_mask_training(tmp_path, search: dict, device: str = "cpu") -> None:
    """Learn a region over a bf16 RoBERTa classifier on ``device``: S stays fp32, and the learned region merges into
    the bf16 model as theta_ft bit for bit."""
    from peft_graft import MaskTrainer

    pre, finetuned, task_type = make_pair("roberta_cls")
    pre, finetuned = pre.to(device, torch.bfloat16), finetuned.to(device, torch.bfloat16)
    config = GraftConfig(finetuned=finetuned, num_entries=20, learn_region=True, task_type=task_type, **search)
    model = get_peft_model(clone_model(pre).to(device), config)
    before = scores(model)
    assert before and all(s.dtype == torch.float32 for s in before.values())
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=2, learning_rate=1e6, use_cpu=device == "cpu")
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16))
    trainer.train()
    assert trainer.mask_report["grafted_entries"] == model.get_region().num_entries > 0
    region = model.get_region()
    merged = dict(model.merge_and_unload().named_parameters())
    tuned = dict(finetuned.named_parameters())
    for name, indices in region.items():
        assert merged[name].device.type == device and merged[name].dtype == torch.bfloat16
        assert torch.equal(merged[name].view(-1)[indices], tuned[name].view(-1)[indices]), name


def sparse_region(model: torch.nn.Module, fraction: float, seed: int) -> Region:
    """A seeded random region of ``fraction`` of every tensor of ``model`` (tied tensors under their first name)."""
    generator = torch.Generator().manual_seed(seed)
    return Region(
        {
            name: torch.randperm(param.numel(), generator=generator)[: max(1, int(fraction * param.numel()))]
            for name, param in model.named_parameters()
        }
    )


ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # tiny tensors partitioned too
}
"""The DeepSpeed ZeRO-3 config the 2-process scripts give a Trainer: no optimizer (the Trainer's), every tensor
partitioned."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def exit_rank() -> None:
    """End a torchrun script's process after its work, skipping the interpreter's finalization: a gloo rank torn down
    there aborted now and then ("terminate called without an active exception", exit code -6) after writing its
    results and destroying its process group. Output is flushed first; an exception before this exits as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def allow_fsdp_on_cpu() -> None:
    """Let accelerate take its FSDP path on CPU processes (gloo), as it does on GPUs: it enables the FSDP plugin only
    for accelerator devices, while ``fully_shard`` itself runs on CPU. The Trainer's own FSDP2 code (accelerate's
    ``fsdp2_prepare_model``, its checkpointing and gradient handling) then runs in the multi-process tests."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    AcceleratorState.__init__ = __init__


def run_command(command: list[str], cwd) -> str:
    """Run ``command`` (e.g. ``[*TORCHRUN, script, ...]``) on CPU threads only; its stdout, or a failed assertion."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU processes, also where a GPU is visible (one GPU serves no 2 ranks)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout
