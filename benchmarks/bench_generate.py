"""Causal serving with mixed grafts: ``generate`` on a SmolLM2-135M-sized model (a seeded random ``LlamaForCausalLM``
with SmolLM2-135M's configuration: 30 layers, hidden 576, tied embeddings, 134.5M parameters), 2 threads.

8 prompts of 64 tokens, each asking for its own graft (8 grafts of 0.01% of every tensor); greedy decoding. Each round
times one ``generate`` of ``1 + N`` tokens per variant, the variants in a rotated order (each round starts one further
on), with a clock that ``generate`` calls after every token it produces (:class:`TokenClock`, a stopping criterion
that never stops): prefill is the time to the first token, the per-token decode cost the median of the N steps after
it, so that a slow step (another process, the allocator) moves it less than it moved a difference of two whole calls.
Ratios to the base's, and each graft variant's to LoRA's, in the same round give the median and quartiles
(``bench_timing.ratios``). Variants: the grafts' mixed batch (``adapter_names``) in the exact mode and in the
``"sparse_delta"`` mode (``model.set_mixed_batch_mode``), one graft for the whole batch, and peft LoRA (r = 8 on
q_proj and v_proj, 8 adapters) in a mixed batch.

Usage: ``python benchmarks/bench_generate.py [--repeats 5] [--new_tokens 16] [--out FILE]`` (appends one JSON line)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import random_region
from bench_timing import load_average, ratios, rotated

import peft_graft  # noqa: F401  (registers the graft method)
from peft_graft import GraftConfig

SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
PROMPTS, PROMPT_LENGTH, GRAFTS = 8, 64, 8


class TokenClock(StoppingCriteria):
    """A stopping criterion that never stops: the wall time at its creation and each time ``generate`` has produced a
    token (it asks its stopping criteria after every step)."""

    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def prefill(self) -> float:
        """Seconds to the first token."""
        return self.times[1] - self.times[0]

    def decode_step(self) -> float:
        """The median seconds of the steps after the first token."""
        return statistics.median(b - a for a, b in zip(self.times[1:-1], self.times[2:], strict=True))


def models(shapes: dict = SMOLLM2_135M) -> tuple[LlamaForCausalLM, object, object]:
    """``(base, graft model with 8 grafts, LoRA model with 8 adapters)``, all from the same seeded weights of a Llama of
    ``shapes`` (``LlamaConfig`` fields)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**shapes)).eval()
    state = base.state_dict()

    def copy_of_base():
        model = LlamaForCausalLM(base.config).eval()
        model.load_state_dict(state)
        return model

    generator = torch.Generator().manual_seed(1)
    parameters = dict(base.named_parameters())  # lm_head.weight is embed_tokens.weight: named once
    finetuned = {n: t.detach() + 1e-3 * torch.randn(t.shape, generator=generator) for n, t in parameters.items()}
    grafts = None
    for g in range(GRAFTS):
        region = random_region(finetuned, 1e-4, seed=g)
        config = GraftConfig(finetuned=finetuned, region="given", given_region=region, task_type="CAUSAL_LM")
        if grafts is None:
            grafts = get_peft_model(copy_of_base(), config, adapter_name="g0").eval()
        else:
            grafts.add_adapter(f"g{g}", config)
    lora_config = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = get_peft_model(copy_of_base(), LoraConfig(**lora_config), adapter_name="g0").eval()
    for g in range(1, GRAFTS):
        lora.add_adapter(f"g{g}", LoraConfig(**lora_config))
    return base, grafts, lora


VARIANTS = ("base", "graft", "graft_sparse_delta", "graft_single", "lora")


def time_generate(repeats: int, new_tokens: int, shapes: dict = SMOLLM2_135M, prompt_length: int = PROMPT_LENGTH,
                  variants: tuple[str, ...] = VARIANTS):  # fmt: skip
    """Rounds of one ``generate`` of ``1 + new_tokens`` tokens per variant of ``variants`` (the first round warms up):
    per variant, the prefill seconds and the median decode step of each round; and whether the two modes generated the
    same tokens."""
    base, grafts, lora = models(shapes)
    ids = torch.randint(3, base.config.vocab_size, (PROMPTS, prompt_length), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    names = [f"g{i % GRAFTS}" for i in range(PROMPTS)]

    def generate(model, new_tokens: int, mode: str = "exact", **kwargs):
        def run(clock: TokenClock | None = None):
            if model is grafts:
                grafts.set_mixed_batch_mode(mode)  # set before every call: the same whatever the default mode
            criteria = StoppingCriteriaList([clock] if clock is not None else [])
            with torch.inference_mode():
                return model.generate(
                    **inputs,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    stopping_criteria=criteria,
                    **kwargs,
                )

        return run

    calls = {
        "base": generate(base, 1 + new_tokens),
        "graft": generate(grafts, 1 + new_tokens, adapter_names=names),
        "graft_sparse_delta": generate(grafts, 1 + new_tokens, "sparse_delta", adapter_names=names),
        "graft_single": generate(grafts, 1 + new_tokens),
        "lora": generate(lora, 1 + new_tokens, adapter_names=names),
    }
    calls = {name: call for name, call in calls.items() if name in variants}
    prefill = {name: [] for name in calls}
    decode = {name: [] for name in calls}
    for repeat in range(repeats + 1):  # the first round warms up
        for name in rotated(list(calls), repeat):
            clock = TokenClock()
            calls[name](clock)
            if repeat:
                prefill[name].append(clock.prefill())
                decode[name].append(clock.decode_step())
    exact, fast = (generate(grafts, new_tokens, mode, adapter_names=names)() for mode in ("exact", "sparse_delta"))
    return prefill, decode, bool(torch.equal(exact, fast))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--out", default="bench_generate.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    load_before = load_average()
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "prompts": PROMPTS,
              "prompt_length": PROMPT_LENGTH, "new_tokens": args.new_tokens, "load_before": load_before}  # fmt: skip
    prefill, decode, same = time_generate(args.repeats, args.new_tokens)
    result["sparse_delta_same_tokens"] = same
    result.update(ratios("prefill", prefill))
    result.update(ratios("decode_per_token", decode))
    result["load_after"] = load_average()
    with open(args.out, "a") as handle:
        handle.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
