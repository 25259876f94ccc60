"""MaskTrainer with a search space (``GraftConfig(search_fraction=...)``/``search_entries``): S learned on the top
movement entries plus gamma_base only."""

from __future__ import annotations

import weakref

import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import VOCAB, clone_model, cls_dataset, fast_args, learning_graft, make_pair, scores
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Trainer

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, GraftLayer, MaskTrainer
from peft_graft.tuner import autograd


def learning_layers(model) -> dict[str, GraftLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, GraftLayer) and m.is_learning("default")}


def soft_train(model, tmp_path, steps: int = 2, **kwargs) -> MaskTrainer:
    """Train S without hardening (to compare scores), dropout off (``learning_graft``)."""
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=steps, learning_rate=1e6, **kwargs)
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16))
    trainer.train = Trainer.train.__get__(trainer)
    trainer.train()
    return trainer


def test_candidates_covering_every_eligible_entry_equal_the_dense_default(tmp_path):
    _, dense = learning_graft(region="movement", num_entries=20)
    _, capped = learning_graft(region="movement", num_entries=20, search_fraction=1.0)
    soft_train(dense, tmp_path)
    soft_train(capped, tmp_path)
    dense_layers, capped_layers = learning_layers(dense), learning_layers(capped)
    assert capped_layers.keys() == dense_layers.keys()
    for name, layer in capped_layers.items():
        candidates = layer.learner("default").search_indices
        dense_scores = dense_layers[name].learner("default").scores.detach()
        torch.testing.assert_close(
            layer.learner("default").scores.detach(), dense_scores[candidates], rtol=1e-5, atol=0
        )
        outside = torch.ones_like(dense_scores, dtype=torch.bool)
        outside[candidates] = False
        assert bool((dense_scores[outside] == -10.0).all())  # what the cap leaves out never moved (no movement there)
    assert any(bool((s > -10).any()) for s in scores(capped).values())  # S moved
    assert capped.get_region() == dense.get_region()
    assert capped.base_model.harden_region("default", 9) == dense.base_model.harden_region("default", 9) == 9
    assert capped.get_region() == dense.get_region()


def test_small_cap_keeps_state_on_the_top_movement_candidates_only():
    _, dense = learning_graft(region="movement", num_entries=20)
    _, capped = learning_graft(region="movement", num_entries=20, search_entries=50)
    _, empty = learning_graft(region="empty", search_fraction=0.01)
    eligible = sum(int(layer.learner("default").movement.numel()) for layer in learning_layers(dense).values())
    assert sum(s.numel() for s in scores(empty).values()) == round(0.01 * eligible)
    assert sum(s.numel() for s in scores(capped).values()) == 50  # gamma_base (top-20 movement) lies in the top-50
    dense_layers = learning_layers(dense)
    smallest_candidate, largest_other = float("inf"), 0.0
    for name, layer in learning_layers(capped).items():
        candidates = layer.learner("default").search_indices
        assert layer.learner("default").scores.shape == layer.learner("default").movement.shape == candidates.shape
        movement = dense_layers[name].learner("default").movement
        torch.testing.assert_close(layer.learner("default").movement, movement[candidates], rtol=0, atol=0)
        outside = torch.ones_like(movement, dtype=torch.bool)
        outside[candidates] = False
        smallest_candidate = min(smallest_candidate, float(movement[candidates].abs().min()))
        largest_other = max(largest_other, float(movement[outside].abs().max()))
    assert smallest_candidate >= largest_other
    # gamma_base is applied before any step: the rounded region is the same top-20 movement region
    assert capped.get_region() == dense.get_region() and capped.get_region().num_entries == 20


def _reference_candidates(scores, movement, base, parts, pool, *thetas):
    """The candidates forward with plain autograd ops (what the custom autograd Function replaces)."""
    gamma = torch.sigmoid(scores)
    values = gamma.index_put((base,), 1.0 - gamma[base]) * movement
    return tuple(
        t.float().reshape(-1).index_add(0, local, values[a:b]).view_as(t).to(t.dtype)
        for (a, b, local), t in zip(parts, thetas, strict=True)
    )


@pytest.mark.parametrize("arch", ["roberta_cls", "gpt2"])
def test_candidate_score_gradient_matches_autograd_reference(arch, monkeypatch):
    _, model = learning_graft(arch, search_fraction=0.05)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # both branches of Eq. 4 matter
        for layer in learning_layers(model).values():
            s = layer.learner("default").scores
            s.copy_(torch.randn(s.shape, generator=generator) * 3)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    labels = torch.tensor([0, 1]) if arch == "roberta_cls" else ids

    def run():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n}

    loss, ours = run()
    monkeypatch.setattr(autograd.GraftedSearchSpace, "apply", _reference_candidates)
    reference_loss, reference = run()
    torch.testing.assert_close(loss, reference_loss)
    assert ours.keys() == reference.keys() and ours
    assert any(bool((g != 0).any()) for g in ours.values())
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-9)


def test_cap_hardening_exact_budget_saving_and_evaluation(tmp_path):
    pre, model = learning_graft(region="empty", search_entries=40)
    data = cls_dataset(16)
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=2, learning_rate=1e9, num_entries=7)
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    candidates = set()
    for layer in learning_layers(model).values():
        candidates |= {(id(layer), i) for i in layer.learner("default").search_indices.tolist()}
    layer = next(iter(learning_layers(model).values()))
    with torch.no_grad():
        layer.learner("default").scores[:3] = 1.0  # round(gamma) = these 3 candidates
    assert trainer.num_grafted_entries() == 3
    predicted = trainer.predict(data).predictions  # the hard mask it would keep: the exact budget of 7
    trainer.save_model(str(tmp_path / "mid"))  # saved as that same hard mask
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "mid").eval()
    kept = {m: set(idx.tolist()) for m, (idx, _) in trainer.kept_entries().items()}
    assert loaded.get_region().num_entries == 7 and sum(map(len, kept.values())) == 7
    with torch.no_grad():
        expected = loaded(input_ids=torch.tensor(data["input_ids"])).logits
    torch.testing.assert_close(torch.as_tensor(predicted), expected)

    trainer.train()
    assert model.get_region().num_entries == trainer.mask_report["grafted_entries"] == 7
    for module, hardened in model.base_model.graft_layers().items():
        indices = hardened.graft_indices["default"].tolist()
        assert all((id(hardened), i) in candidates for i in indices), module  # a subset of the candidates
    trainer.save_model(str(tmp_path / "final"))
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "final")
    assert loaded.get_region() == model.get_region()


def test_bad_search_spaces_give_clear_errors():
    pre, finetuned, _ = make_pair("roberta_cls")
    for bad in (0.0, 1.5, float("nan"), -0.1):
        with pytest.raises(ValueError, match="search_fraction"):
            GraftConfig(finetuned=finetuned, num_entries=5, learn_region=True, search_fraction=bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="search_entries"):
            GraftConfig(finetuned=finetuned, num_entries=5, learn_region=True, search_entries=bad)
    for field, bad in (
        ("search_fraction", "1%"),
        ("search_fraction", True),
        ("search_entries", 2.5),
        ("search_entries", [10]),
    ):
        with pytest.raises(TypeError, match=field):
            GraftConfig(finetuned=finetuned, num_entries=5, learn_region=True, **{field: bad})
    with pytest.raises(ValueError, match="learn_region=True"):
        GraftConfig(finetuned=finetuned, num_entries=5, search_entries=10)
    with pytest.raises(ValueError, match="search_entries=10000000 asks for"):
        config = GraftConfig(finetuned=finetuned, num_entries=5, learn_region=True, search_entries=10_000_000)
        get_peft_model(clone_model(pre), config)
    with pytest.raises(ValueError, match=r"search_fraction=1e-09 .*rounds to 0"):
        config = GraftConfig(finetuned=finetuned, num_entries=5, learn_region=True, search_fraction=1e-9)
        get_peft_model(clone_model(pre), config)


# ------------------------------------------------------------------------------------------ saved-tensor hooks
@pytest.mark.parametrize("arch", ["roberta_cls", "gpt2"])
def test_dense_soft_parameters_are_recomputed_not_kept_for_backward(arch, monkeypatch):
    """With ``recompute_soft_parameters`` (``MaskTrainingArguments``), the layer's ops do not keep the dense soft
    parameters alive until backward; the gradient of S is unchanged."""
    _, model = learning_graft(arch)
    for layer in model.base_model.graft_layers().values():
        layer.recompute_soft_parameters = True
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in learning_layers(model).values():
            s = layer.learner("default").scores
            s.copy_(torch.randn(s.shape, generator=generator) * 3)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    labels = torch.tensor([0, 1]) if arch == "roberta_cls" else ids
    made = []
    soft_parameters = GraftLayer.soft_parameters

    def recording(self, adapter_name, *args, **kwargs):
        out = soft_parameters(self, adapter_name, *args, **kwargs)
        if torch.is_grad_enabled():
            made.extend(weakref.ref(t) for t in out.values())
        return out

    monkeypatch.setattr(GraftLayer, "soft_parameters", recording)

    def run():
        made.clear()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        alive = sum(ref() is not None for ref in made)
        loss.backward()
        return alive, {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n}

    taken = []
    take = autograd.RECOMPUTED_GAMMA.take
    monkeypatch.setattr(autograd.RECOMPUTED_GAMMA, "take", lambda scores: taken.append(take(scores)) or taken[-1])
    alive, ours = run()
    assert made and alive == 0
    hits = sum(t is not None for t in taken)
    assert hits >= len(taken) // 2 > 0  # most layers' backward reused the gamma of the recomputation
    for layer in model.base_model.graft_layers().values():
        layer.recompute_soft_parameters = False  # the default
    taken.clear()
    kept, reference = run()
    assert kept > 0 and not taken  # without the hooks F.linear & co. keep them, and the backward needs no gamma
    assert ours.keys() == reference.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-10)


class _CountedOp(TorchDispatchMode):
    """Counts the calls of one ATen operator (any overload) while active."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", [False, True])
def test_kept_soft_parameters_take_one_sigmoid_per_layer_and_step(recompute, monkeypatch):
    """Keeping the soft parameters (the default), each dense layer's forward keeps ``sigmoid'(S) * delta`` too: its
    backward computes no sigmoid again. Rebuilding them (``recompute_soft_parameters``) keeps nothing: backward
    computes sigmoid again in the rebuilds."""
    monkeypatch.setattr(graft_layer, "GRAFT_EMBEDDING_ROWS", False)  # every layer through GraftedTensors
    _, model = learning_graft("roberta_cls")
    layers = learning_layers(model)
    for layer in model.base_model.graft_layers().values():
        layer.recompute_soft_parameters = recompute
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    with _CountedOp(torch.ops.aten.sigmoid) as forward:
        loss = model(input_ids=ids, labels=torch.tensor([0, 1])).loss
    with _CountedOp(torch.ops.aten.sigmoid) as backward:
        loss.backward()
    assert forward.calls == len(layers) > 0
    if recompute:  # a rebuild per saved tensor (a weight and a bias: two), the last one's gamma reused
        assert backward.calls >= len(layers)
    else:
        assert backward.calls == 0
    assert all(layer.learner("default").scores.grad.abs().sum() > 0 for layer in layers.values())


@pytest.mark.parametrize("search_fraction", [0.05, None])
def test_soft_parameter_outputs_are_reused_across_steps_only_once_released(search_fraction):
    """The search space's outputs, and dense S's while the layers keep them (the default), come from the learner's
    ``BufferPool``: the same memory each step once a backward released it, and the same gradients."""
    _, model = learning_graft("roberta_cls", search_fraction=search_fraction)
    model.train()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    labels = torch.tensor([0, 1])
    layers = learning_layers(model).values()
    layer = next(
        m
        for m in layers
        if (search_fraction is None or m.learner("default").search_indices.numel())
        and not isinstance(m.base_layer, nn.Embedding)
    )

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    first = grads()
    pointers = [b.data_ptr() for b in layer.learner("default")._pool.buffers.values()]
    assert pointers and not layer.learner("default")._pool.busy  # released by the backward
    second = grads()
    assert [b.data_ptr() for b in layer.learner("default")._pool.buffers.values()] == pointers  # reused
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)

    # A forward whose graph gets no backward keeps its buffers: later forwards use fresh tensors, still exact.
    model(input_ids=ids, labels=labels)
    assert layer.learner("default")._pool.busy
    third = grads()
    assert all(torch.equal(first[n], third[n]) for n in first)


def test_dense_bf16_soft_parameters_take_no_fp32_buffer():
    """Soft parameters in bf16 are cast copies: no fp32 output buffer is kept for them between steps."""
    _, model = learning_graft("roberta_cls", dtype=torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    learners = [layer.learner("default") for layer in learning_layers(model).values()]
    assert learners and all(learner.scores.grad is not None for learner in learners)
    assert not any(learner._pool.buffers for learner in learners)
