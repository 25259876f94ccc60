"""One S-sized tensor per learner from step to step (``autograd.GradientSlot``, issue 38): the forward's soft parameters
and then the gradient of S in it, the same values as with fresh tensors, and never a tensor that anything else still
refers to."""

from __future__ import annotations

import pytest
import torch
from testing_utils import VOCAB, learning_graft

from peft_graft import GraftLayer
from peft_graft.tuner import autograd


@pytest.fixture
def slots_for_every_size(monkeypatch):
    """Tiny models: every S's gradient is kept (the threshold is for vocabulary-sized ones)."""
    monkeypatch.setattr(autograd, "REUSED_BUFFER_BYTES", 0)


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


def recompute(model, on: bool) -> None:
    for module in model.modules():
        if isinstance(module, GraftLayer):
            module.recompute_soft_parameters = on


def fresh_gradients(arch: str, seeds: list[int], rebuilt: bool = False) -> dict[str, torch.Tensor]:
    """S's gradients summed over ``seeds``' batches, every tensor fresh (the threshold as shipped); ``rebuilt``: the
    soft parameters rebuilt in backward (whose gamma, flipped on gamma_base, rounds ``sigmoid'`` differently there)."""
    _, model = learning_graft(arch)
    recompute(model, rebuilt)
    for seed in seeds:
        backward(model, seed)
    return {n: learner.scores.grad.clone() for n, learner in learners(model).items()}


@pytest.mark.parametrize("rebuilt", [False, True], ids=["kept", "rebuilt"])  # soft parameters kept for backward or not
@pytest.mark.parametrize("arch", ["roberta_cls", "gpt2"])  # GPT-2: a tied LM head, two gradients for one S
def test_kept_gradients_are_the_fresh_ones_step_after_step(arch, rebuilt, slots_for_every_size):
    _, model = learning_graft(arch)
    recompute(model, rebuilt)
    reused = 0
    for seed in range(3):
        held = {n: learner._gradients.held for n, learner in learners(model).items()}
        before = {n: None if tensor is None else tensor.data_ptr() for n, tensor in held.items()}
        del held  # a reference kept here would make the slots allocate
        model.zero_grad(set_to_none=True)
        backward(model, seed)
        expected = fresh_gradients(arch, [seed], rebuilt)
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


def test_the_forward_tensor_becomes_the_gradient(slots_for_every_size):
    """Dense S: the soft parameters' tensor, lent back by the forward, holds the gradient of S after backward."""
    _, model = learning_graft("roberta_cls")
    backward(model, 0)
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    loss = model(input_ids=ids, labels=torch.tensor([0, 1])).loss
    lent = {n: learner._gradients.held.data_ptr() for n, learner in learners(model).items() if learner.is_dense}
    loss.backward()
    assert lent and all(learners(model)[n].scores.grad.data_ptr() == ptr for n, ptr in lent.items())


@pytest.mark.parametrize("keep", ["tensor", "detach"])  # detached: another tensor on the same memory
@pytest.mark.parametrize("rebuilt", [False, True], ids=["kept", "rebuilt"])
def test_soft_parameters_someone_kept_are_never_overwritten(rebuilt, keep, slots_for_every_size):
    """Soft parameters a caller still holds are not written into by the next forward or backward."""
    _, model = learning_graft("roberta_cls")
    recompute(model, rebuilt)
    backward(model, 0)
    model.zero_grad(set_to_none=True)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GraftLayer) and m.is_learning("default")}
    kept = {
        n: {attr: t if keep == "tensor" else t.detach() for attr, t in layer.soft_parameters("default").items()}
        for n, layer in layers.items()
    }
    copies = {n: {attr: t.detach().clone() for attr, t in soft.items()} for n, soft in kept.items()}
    backward(model, 1)
    for name, soft in kept.items():
        for attr, tensor in soft.items():
            assert torch.equal(tensor, copies[name][attr]), (name, attr)
    expected = fresh_gradients("roberta_cls", [1], rebuilt)
    for name, learner in learners(model).items():
        assert torch.equal(learner.scores.grad, expected[name]), name


@pytest.mark.parametrize("rebuilt", [False, True], ids=["kept", "rebuilt"])
def test_two_forwards_and_a_retained_graph_give_the_fresh_sums(rebuilt, slots_for_every_size):
    """Two forwards before one backward (the first graph holds its tensors while the second forward runs), then that
    graph's backward twice (``retain_graph``): each gradient is the fresh one."""
    _, model = learning_graft("roberta_cls")
    recompute(model, rebuilt)
    backward(model, 0)
    model.zero_grad(set_to_none=True)
    ids = [torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    labels = torch.tensor([0, 1])
    loss = sum(model(input_ids=i, labels=labels).loss for i in ids)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = fresh_gradients("roberta_cls", [1, 2], rebuilt)
    for name, learner in learners(model).items():
        torch.testing.assert_close(learner.scores.grad, 2 * expected[name], rtol=0, atol=0)


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
