"""The dense gradient of S taken back between steps (``autograd.GradientSlot``, issue 38): the same gradients as fresh
tensors, and never a tensor that anything else still refers to."""

from __future__ import annotations

import pytest
import torch
from testing_utils import VOCAB, learning_graft

from peft_graft import GraftLayer
from peft_graft.tuner import autograd


@pytest.fixture
def slots_for_every_size(monkeypatch):
    """Tiny models: every S's gradient is kept (the threshold is for vocabulary-sized ones)."""
    monkeypatch.setattr(autograd, "REUSED_GRADIENT_BYTES", 0)


def learners(model) -> dict[str, torch.nn.Module]:
    return {
        n: m.learner("default")
        for n, m in model.named_modules()
        if isinstance(m, GraftLayer) and m.is_learning("default")
    }


def backward(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    labels = ids if model.config.model_type == "gpt2" else torch.tensor([0, 1])
    model(input_ids=ids, labels=labels).loss.backward()


def fresh_gradients(arch: str, seeds: list[int]) -> dict[str, torch.Tensor]:
    """S's gradients summed over ``seeds``' batches, every tensor fresh (the threshold as shipped)."""
    _, model = learning_graft(arch)
    for seed in seeds:
        backward(model, seed)
    return {n: learner.scores.grad.clone() for n, learner in learners(model).items()}


@pytest.mark.parametrize("arch", ["roberta_cls", "gpt2"])  # GPT-2: a tied LM head, two gradients for one S
def test_kept_gradients_are_the_fresh_ones_step_after_step(arch, slots_for_every_size):
    _, model = learning_graft(arch)
    reused = 0
    for seed in range(3):
        held = {n: learner._gradients.held for n, learner in learners(model).items()}
        before = {n: None if tensor is None else tensor.data_ptr() for n, tensor in held.items()}
        del held  # a reference kept here would make the slots allocate
        model.zero_grad(set_to_none=True)
        backward(model, seed)
        expected = fresh_gradients(arch, [seed])
        for name, learner in learners(model).items():
            assert torch.equal(learner.scores.grad, expected[name]), (seed, name)
            reused += learner.scores.grad.data_ptr() == before[name]
    assert reused > 0  # the slots did give their tensors back


@pytest.mark.parametrize("keep", ["tensor", "detach", "data", "numpy", "view"])
def test_a_gradient_someone_kept_is_never_overwritten(keep, slots_for_every_size):
    """Kept as the tensor, or as another tensor or array on its memory, which the tensor's own reference count does
    not show."""
    take = {
        "tensor": lambda g: g,
        "detach": lambda g: g.detach(),
        "data": lambda g: g.data,
        "numpy": lambda g: g.numpy(),
        "view": lambda g: g.view(-1),
    }[keep]
    _, model = learning_graft("roberta_cls")
    backward(model, 0)
    kept = {n: torch.as_tensor(take(learner.scores.grad)) for n, learner in learners(model).items()}
    copies = {n: g.clone() for n, g in kept.items()}
    model.zero_grad(set_to_none=True)
    backward(model, 1)
    expected = fresh_gradients("roberta_cls", [1])
    for name, learner in learners(model).items():
        assert torch.equal(kept[name], copies[name]), name  # untouched
        assert learner.scores.grad.data_ptr() != kept[name].data_ptr()
        assert torch.equal(learner.scores.grad, expected[name]), name


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulated_gradients_are_the_sum(set_to_none, slots_for_every_size):
    """Two batches without zeroing in between (gradient accumulation), after a step whose tensors are kept."""
    _, model = learning_graft("roberta_cls")
    backward(model, 0)
    model.zero_grad(set_to_none=set_to_none)
    backward(model, 1)
    backward(model, 2)
    expected = fresh_gradients("roberta_cls", [1, 2])
    for name, learner in learners(model).items():
        torch.testing.assert_close(learner.scores.grad, expected[name], rtol=0, atol=0)


def test_small_or_non_cpu_gradients_are_not_kept():
    """As shipped, the tiny model's S are far below the threshold: no slot holds anything, no hook is added."""
    _, model = learning_graft("roberta_cls")
    backward(model, 0)
    for learner in learners(model).values():
        assert learner._gradients.held is None and learner._gradients.hooked is None


def test_a_model_with_kept_gradients_pickles_and_copies_without_them(slots_for_every_size):
    import copy
    import io

    _, model = learning_graft("roberta_cls")
    backward(model, 0)
    assert any(learner._gradients.held is not None for learner in learners(model).values())
    torch.save(model, io.BytesIO())  # the slot's weakref and hook are not pickled
    copied = copy.deepcopy(model)
    assert all(learner._gradients.held is None for learner in learners(copied).values())
    copied.zero_grad(set_to_none=True)
    backward(copied, 1)
    expected = fresh_gradients("roberta_cls", [1])
    for name, learner in learners(copied).items():
        assert torch.equal(learner.scores.grad, expected[name]), name
