"""Per-process peak memory of FSDP2 against DDP: plain fine-tuning and MaskTrainer, 2 CPU processes (gloo).

    python benchmarks/bench_fsdp_memory.py --model llama-400m --steps 3  # figures/fsdp_memory_llama-400m.json

Each variant runs under ``torchrun --nproc_per_node 2`` in its own processes, started through the Trainer as users do
(``fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}``; without them the
Trainer wraps the model in DDP):

- ``fsdp-plain``: plain fine-tuning of every parameter (SGD), FSDP2;
- ``fsdp-mask-none`` / ``fsdp-mask-0.01``: MaskTrainer with dense S (the paper) / ``search_fraction=0.01``, FSDP2;
- ``ddp-mask-none`` / ``ddp-mask-0.01``: the same under DDP.

The model is a random Llama of ``benchmarks/bench_models.py``'s family (fp32, seeded, the same on both processes),
batch 2 x 64 tokens per process, one micro-batch per step, sparsity 1e-4; theta_ft is written once to ``--cache``
as safetensors shards and each process streams it from there. Every process reports its RSS after loading theta_pre,
its peak while creating the graft, its RSS once the Trainer has sharded (or wrapped) the model, and the peak RSS of the
steps after the first (VmHWM reset after ``malloc_trim``), plus the bytes of the state its step keeps. Results are
written to ``--out`` as each variant finishes (a rerun skips the variants already there).

accelerate enables its FSDP plugin only on accelerator devices; here (CPU processes) :func:`allow_fsdp_on_cpu` lets it
take the same FSDP2 path (``fully_shard`` runs on CPU with gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
from bench_models import DEFAULT_CACHE, LLAMA_BATCH, check_pretrained, load_pretrained, prepare_finetuned
from bench_timing import GIB, release_free_memory, reset_peak, rss_gb

from peft_graft import GraftConfig, MaskTrainer, MaskTrainingArguments

VARIANTS = ["fsdp-plain", "fsdp-mask-0.01", "ddp-mask-0.01", "fsdp-mask-none", "ddp-mask-none"]


def allow_fsdp_on_cpu() -> None:
    """Let accelerate take its FSDP path on CPU processes, as it does on GPUs (the same shim as the tests')."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    AcceleratorState.__init__ = __init__


class StepMemory(TrainerCallback):
    """RSS once the model is prepared, and the peak RSS and time of the steps after the first."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}
        self.times: list[float] = []
        self.kept: dict[str, int] = {}
        self._start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        release_free_memory()
        self.figures["rss_prepared_gb"] = rss_gb()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:  # after the warm-up step
            release_free_memory()
            self.figures["rss_before_steps_gb"] = rss_gb()
            reset_peak()
        self._start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.kept = kept_bytes(model)  # with the step's gradients

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > 1:
            self.times.append(time.perf_counter() - self._start)
        self.figures["step_peak_gb"] = rss_gb("VmHWM")


def kept_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of this process's parameters (local shards under FSDP2), their gradients, and the graft's learning state
    (S, its gradient, the movement, the search-space indices)."""
    out = {"parameters": 0, "gradients": 0, "graft_state": 0}
    for name, param in model.named_parameters():
        local = param.to_local() if type(param).__name__ == "DTensor" else param
        grad = param.grad.to_local() if type(param.grad).__name__ == "DTensor" else param.grad
        key = "graft_state" if "graft_learning" in name else "parameters"
        out[key] += local.numel() * local.element_size()
        if grad is not None:
            out["graft_state" if key == "graft_state" else "gradients"] += grad.numel() * grad.element_size()
    for module in model.modules():
        for attr in ("movement", "search_indices"):
            tensor = getattr(module, attr, None) if type(module).__name__ == "RegionLearner" else None
            if tensor is not None:
                out["graft_state"] += tensor.numel() * tensor.element_size()
    return out


def worker(args: argparse.Namespace) -> None:
    engine, kind = args.variant.split("-", 1)
    torch.set_num_threads(1)
    if engine == "fsdp":
        allow_fsdp_on_cpu()
    rank = int(os.environ["RANK"])
    pre = load_pretrained(args.model)
    figures = {"variant": args.variant, "rank": rank, "rss_after_load_gb": rss_gb()}
    figures["parameters"] = sum(p.numel() for p in pre.parameters())
    size, length = LLAMA_BATCH
    ids = torch.randint(0, pre.config.vocab_size, (size * 2 * args.steps, length), generator=torch.Generator())
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    sharding = (
        dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
        if engine == "fsdp"
        else {}
    )
    common = dict(
        output_dir=os.path.join(args.cache, "fsdp_memory_run"), per_device_train_batch_size=size, max_steps=args.steps,
        use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no", dataloader_pin_memory=False, seed=0,
        **sharding,
    )  # fmt: skip
    callback = StepMemory()
    reset_peak()
    if kind == "plain":
        model = pre.train()
        train_args = TrainingArguments(optim="sgd", learning_rate=1e-4, max_grad_norm=0.0, **common)
        trainer = Trainer(model=model, args=train_args, train_dataset=data, callbacks=[callback])
    else:
        folder = prepare_finetuned(args.model, "float32", args.cache)
        check_pretrained(pre, folder)
        search = kind.removeprefix("mask-")
        extra = {} if search == "none" else {"search_fraction": float(search)}
        config = GraftConfig(finetuned=str(folder), sparsity=1e-4, learn_region=True, task_type="CAUSAL_LM", **extra)
        model = get_peft_model(pre, config)
        figures["creation_peak_gb"] = rss_gb("VmHWM")
        mask_args = MaskTrainingArguments(mask_batch_size=None, learning_rate=1e6, **common)
        trainer = MaskTrainer(model=model, args=mask_args, train_dataset=data, callbacks=[callback])
    trainer.train()
    figures.update(callback.figures)
    figures["step_s"] = statistics.median(callback.times) if callback.times else None
    figures["sharded"] = any(type(p).__name__ == "DTensor" for p in model.parameters())
    figures["kept_bytes"] = callback.kept
    figures["world_size"] = int(os.environ["WORLD_SIZE"])
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(figures))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def summary(results: dict, gpus: int = 8) -> list[str]:
    """One line per variant (GiB, the larger of the two processes), and the per-GPU GiB of 8B and 70B models in bf16
    on ``gpus`` GPUs projected from the measured bytes per parameter: the weights (2 B) divided among the GPUs under
    FSDP2, whole under DDP, plus the graft's state (S, its gradient, the movement, indices), kept whole on every
    process; activations aside."""
    lines = []
    for variant, run in results["variants"].items():
        ranks = run["ranks"]
        top = {key: max(r.get(key) or 0.0 for r in ranks) for key in ranks[0] if key.endswith("_gb")}
        params = ranks[0]["parameters"]
        graft = max(r["kept_bytes"]["graft_state"] for r in ranks) / params
        line = (
            f"{variant}: loaded {top['rss_after_load_gb']:.2f}, creating {top.get('creation_peak_gb', 0.0):.2f}, "
            f"prepared {top['rss_prepared_gb']:.2f}, step peak {top['step_peak_gb']:.2f} GiB "
            f"(+{top['step_peak_gb'] - top['rss_after_load_gb']:.2f}); step {ranks[0]['step_s']:.2f} s; "
            f"graft state {graft:.2f} B/param"
        )
        if "mask" in variant:
            share = 1 / gpus if variant.startswith("fsdp") else 1.0
            per_gpu = {size: size * 1e9 * (2 * share + graft) / GIB for size in (8, 70)}
            line += f"; on {gpus} GPUs: 8B {per_gpu[8]:.1f} GiB, 70B {per_gpu[70]:.1f} GiB per GPU"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-400m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--cache", default=DEFAULT_CACHE)
    parser.add_argument("--out", help="results file (default: benchmarks/figures/fsdp_memory_<model>.json)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the worker processes
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).parent / "figures" / f"fsdp_memory_{args.model}.json")
    if args.variant:
        return worker(args)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results = results if results.get("model") == args.model else {"model": args.model, "variants": {}}
    prepare_finetuned(args.model, "float32", args.cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for variant in args.variants:
        if variant in results["variants"]:
            continue
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        command += ["--model", args.model, "--steps", str(args.steps), "--cache", args.cache, "--out", args.out]
        start = time.perf_counter()
        run = subprocess.run([*command, "--variant", variant], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stdout[-2000:], run.stderr[-4000:])
            raise SystemExit(f"{variant} failed")
        ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in (0, 1)]
        results["variants"][variant] = {"ranks": ranks, "wall_s": time.perf_counter() - start, "load": os.getloadavg()}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        print(variant, json.dumps(ranks), flush=True)
    print("\n".join(summary(results)))
    return None


if __name__ == "__main__":
    main()
