"""One linear layer's forward and backward with a search space, on its two paths (``bench_mask_step.py --layers``):
the soft weight copy and the sparse products, against the base layer."""

from __future__ import annotations

import time

import torch
from mask_trainers import LinearPattern

from peft_graft.tuner import autograd

LAYER_SHAPES = [(384, 384), (1536, 384), (384, 1536), (768, 768), (3072, 768), (768, 3072)]  # (out, in)
LAYER_TOKENS = [32, 128, 512, 2048]
LAYER_FRACTIONS = [0.002, 0.01, 0.05]


def layer_costs(out_features: int, in_features: int, tokens: int, fraction: float, repeats: int) -> dict[str, float]:
    """CPU seconds (best of ``repeats``) of one fp32 linear layer's forward and backward with a search space of
    ``fraction`` of its weight and bias: the frozen base layer (input gradient only), and what the soft weight copy
    (``GraftedSearchSpace``) and the sparse products (``SparseLinearDelta``) add to it."""
    from torch.nn import functional as F

    from peft_graft.parameter_layout import FlatIndexSpace

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    space = FlatIndexSpace(["weight", "bias"], [weight.numel(), bias.numel()])
    count = max(1, int(fraction * space.size))
    indices = torch.randperm(space.size, generator=generator)[:count].sort().values
    parts = dict((attr, (p.start, p.stop, local)) for attr, local, p in space.split(indices))
    scores = torch.zeros(count, requires_grad=True)
    movement, base = torch.randn(count, generator=generator) * 1e-3, torch.arange(0, count, 97)
    pattern = LinearPattern(parts.get("weight"), parts.get("bias"), out_features, in_features)
    x = torch.randn(tokens, in_features, generator=generator, requires_grad=True)
    grad = torch.randn(tokens, out_features, generator=generator)
    pool = autograd.BufferPool()

    def base_layer():
        F.linear(x, weight, bias).backward(grad)

    def soft_copy():
        tensors = {"weight": weight, "bias": bias}
        thetas = [tensors[attr] for attr in parts]
        soft = autograd.GraftedSearchSpace.apply(scores, movement, base, list(parts.values()), pool, *thetas)
        tensors.update(zip(parts, soft, strict=True))
        F.linear(x, tensors["weight"], tensors["bias"]).backward(grad)

    def sparse_products():
        delta = autograd.SparseLinearDelta.apply(x, scores, movement, base, pattern)
        (F.linear(x, weight, bias) + delta).backward(grad)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
            x.grad = scores.grad = None
        return min(times)

    costs = {"base": best(base_layer), "copy": best(soft_copy), "sparse": best(sparse_products)}
    costs["copy"] -= costs["base"]
    costs["sparse"] -= costs["base"]
    costs["rule_sparse"] = pattern.sparse_is_cheaper(tokens)
    return costs


def time_layers(repeats: int) -> list[dict]:
    """:func:`layer_costs` over the grid, printed with the path the rule picks and its cost over the cheaper one."""
    torch.set_num_threads(1)
    print("one fp32 linear layer, forward + backward, CPU ms (best of the repeats, one thread)")
    print(f"  {'out x in':>11} {'tokens':>6} {'share':>6} {'base':>9} {'+copy':>8} {'+sparse':>8}  rule    regret")
    rows = []
    for fraction in LAYER_FRACTIONS:
        for tokens in LAYER_TOKENS:
            for out_features, in_features in LAYER_SHAPES:
                costs = layer_costs(out_features, in_features, tokens, fraction, repeats)
                picked = costs["sparse"] if costs["rule_sparse"] else costs["copy"]
                cheaper = min(costs["sparse"], costs["copy"])
                regret = (picked - cheaper) / (costs["base"] + cheaper)
                row = {"out": out_features, "in": in_features, "tokens": tokens, "fraction": fraction, **costs}
                rows.append({**row, "regret": regret})
                print(
                    f"  {out_features:>5}x{in_features:<5} {tokens:>6} {fraction:>6.3f} {1e3 * costs['base']:>8.2f} "
                    f"{1e3 * costs['copy']:>+8.2f} {1e3 * costs['sparse']:>+8.2f}  "
                    f"{'sparse' if costs['rule_sparse'] else 'copy':<6} {100 * regret:>6.1f}%",
                    flush=True,
                )
    return rows
