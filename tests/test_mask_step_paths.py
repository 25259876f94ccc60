"""Which path a linear layer learning a search space takes (issue 38): sparse products (``SparseLinearDelta``) or the
soft weight copy (``GraftedSearchSpace``), chosen per layer and batch by ``LinearPattern.sparse_is_cheaper``; both
give the same values and gradients of S to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from testing_utils import VOCAB, clone_model, finetune_like
from transformers import BertConfig, BertForSequenceClassification

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, GraftLayer
from peft_graft.tuner import autograd


def pattern(out_features: int, in_features: int, fraction: float, bias: bool = False) -> autograd.LinearPattern:
    """A linear layer's pattern with ``fraction`` of its weight (or, with ``bias``, only its bias) in the search
    space."""
    generator = torch.Generator().manual_seed(0)
    size = out_features if bias else out_features * in_features
    local = torch.randperm(size, generator=generator)[: max(1, int(fraction * size))].sort().values
    part = (0, local.numel(), local)
    return autograd.LinearPattern(None if bias else part, part if bias else None, out_features, in_features)


@pytest.mark.parametrize(
    "shape, fraction, tokens, sparse",
    [
        ((384, 384), 0.01, 32 * 64, False),  # all-MiniLM-L6-v2 at 32 x 64: the weight copy is cheaper
        ((1536, 384), 0.01, 32 * 64, False),
        ((3072, 768), 0.01, 4 * 32, True),  # RoBERTa-base's MLP at 4 x 32: the sparse products are
        ((768, 3072), 0.01, 4 * 32, True),
        ((768, 3072), 0.002, 32 * 64, True),  # a sparse layer pays even with many tokens
        ((1536, 384), 0.3, 2 * 9, False),  # a dense one never does
        ((8192, 2048), 0.01, 2 * 64, True),  # Llama-3.2-1B's MLP at 2 x 64 (BENCHMARKS.md's 1B mask step)
        ((384, 384), 0.01, 32 * 64, True),  # (bias only: no weight copy either way)
    ],
)
def test_the_cost_rule_picks_the_cheaper_path_for_the_layer_and_batch(shape, fraction, tokens, sparse):
    bias = shape == (384, 384) and sparse
    assert pattern(*shape, fraction, bias=bias).sparse_is_cheaper(tokens) is sparse


def wide_bert() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A one-block BERT classifier with MiniLM's widths (384, MLP 1536): wide enough that the rule picks the sparse
    products for its MLP at a small batch and the copy for its 384 x 384 attention projections."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=1536,
        max_position_embeddings=128,
        num_labels=2,
    )
    pre = BertForSequenceClassification(config).eval()
    return pre, finetune_like(pre)


def run(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=torch.arange(ids.shape[0]) % 2)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n and p.grad is not None}
    return out.logits.detach(), grads


def test_each_linear_layer_takes_the_cheaper_path_with_the_same_score_gradients(monkeypatch):
    """At 2 x 9 tokens the 384 x 1536 MLP layers take the sparse products and the 384 x 384 projections the weight
    copy; at 8 x 128 every layer takes the copy. Either way the logits and the gradients of S are those of each path
    forced on every layer, to fp32 rounding (logits atol 1e-5, S gradients rtol 1e-5, atol 1e-9)."""
    pre, finetuned = wide_bert()
    config = GraftConfig(
        finetuned=finetuned, num_entries=200, learn_region=True, search_fraction=0.01, task_type="SEQ_CLS"
    )
    model = get_peft_model(clone_model(pre), config).eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # both branches of Eq. 4 (gamma_base flips) matter
        for layer in model.modules():
            if isinstance(layer, GraftLayer) and layer.is_learning("default"):
                learner = layer.learner("default")
                learner.scores.copy_(torch.randn(learner.scores.shape, generator=generator) * 3)
    sparse_shapes, copied_shapes = [], []
    sparse_apply, copy_apply = autograd.SparseLinearDelta.apply, autograd.GraftedSearchSpace.apply
    monkeypatch.setattr(
        autograd.SparseLinearDelta, "apply", lambda *a: sparse_shapes.append(a[-1].shape) or sparse_apply(*a)
    )
    monkeypatch.setattr(
        autograd.GraftedSearchSpace,
        "apply",
        lambda *a: copied_shapes.extend(t.shape for t in a[5:] if t.dim() == 2) or copy_apply(*a),
    )
    for ids, sparse_expected, copied_expected in [
        (torch.randint(3, VOCAB, (2, 9), generator=generator), {(1536, 384), (384, 1536)}, {(384, 384)}),
        (torch.randint(3, VOCAB, (8, 128), generator=generator), set(), {(384, 384), (1536, 384), (384, 1536)}),
    ]:
        sparse_shapes.clear(), copied_shapes.clear()
        logits, grads = run(model, ids)
        assert set(sparse_shapes) == sparse_expected
        assert set(copied_shapes) == copied_expected
        with monkeypatch.context() as forced:
            forced.setattr(graft_layer, "GRAFT_SPARSE_LINEAR", False)
            copy_logits, copy_grads = run(model, ids)
        with monkeypatch.context() as forced:
            forced.setattr(autograd.LinearPattern, "sparse_is_cheaper", lambda self, tokens: True)
            sparse_logits, sparse_grads = run(model, ids)
        assert grads.keys() == copy_grads.keys() == sparse_grads.keys() and grads
        for other_logits, other_grads in [(copy_logits, copy_grads), (sparse_logits, sparse_grads)]:
            torch.testing.assert_close(logits, other_logits, rtol=0, atol=1e-5)
            for name in grads:
                torch.testing.assert_close(grads[name], other_grads[name], rtol=1e-5, atol=1e-9)


def test_bf16_linear_layers_keep_the_sparse_products_at_any_batch(monkeypatch):
    """In bf16 the copy rounds theta_pre + gamma * delta to bf16 and the sparse products add it in fp32: the path,
    and so the values, must not depend on the batch, so bf16 layers keep the sparse products (as before issue 38)."""
    pre, finetuned = wide_bert()
    pre, finetuned = pre.to(torch.bfloat16), finetuned.to(torch.bfloat16)
    config = GraftConfig(
        finetuned=finetuned, num_entries=200, learn_region=True, search_fraction=0.01, task_type="SEQ_CLS"
    )
    model = get_peft_model(clone_model(pre), config).eval()
    shapes = []
    apply = autograd.SparseLinearDelta.apply
    monkeypatch.setattr(autograd.SparseLinearDelta, "apply", lambda *a: shapes.append(a[-1].shape) or apply(*a))
    run(model, torch.randint(3, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0)))  # fp32: all copied
    assert set(shapes) == {(384, 384), (1536, 384), (384, 1536)}
