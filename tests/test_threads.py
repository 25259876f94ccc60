"""Model-level state changes against forwards: a change made from another thread while one thread serves waits for
the forward (which sees one state throughout, and the base tensors stay bit-identical), and a change made from a hook
inside the forward is refused, unless it is undone around a nested forward.

Deterministic: the serving forward pauses in a hook until the changing thread either waits for the lock (correct) or
has finished its change (the bug these tests catch), so no timing decides the outcome."""

from __future__ import annotations

import copy
import threading
import time
from contextlib import ExitStack

import pytest
import torch
from peft import get_peft_model
from testing_utils import clone_model, input_ids, make_pair

from peft_graft import GraftConfig
from peft_graft.tuner import in_place

DEADLINE = 60.0  # seconds: only reached if the code under test deadlocks


class ContendedLock:
    """``in_place.WRITE_LOCK``, noting when a thread has to wait for it."""

    def __init__(self, lock) -> None:
        self.lock, self.contended = lock, threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        self.contended.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def graft(task_type: str | None = "CAUSAL_LM"):
    pre, finetuned, _ = make_pair("gpt2")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))
    model.add_adapter("other", GraftConfig(finetuned=finetuned, sparsity=0.02, region="random", task_type=task_type))
    return pre, finetuned, model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids()).logits


def base_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "graft_" not in n}


def forward_while(model, change, monkeypatch) -> tuple[torch.Tensor, list[BaseException]]:
    """One forward of ``model``, during which another thread runs ``change()`` (started from a hook after the first
    block): the forward goes on once that thread waits for the lock or has finished."""
    spy = ContendedLock(in_place.WRITE_LOCK)
    monkeypatch.setattr(in_place, "WRITE_LOCK", spy)
    done, errors = threading.Event(), []

    def run_change() -> None:
        try:
            change()
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            done.set()

    changer = threading.Thread(target=run_change, daemon=True)

    def pause(*_) -> None:
        if changer.ident is None:
            changer.start()
            deadline = time.monotonic() + DEADLINE
            while not (spy.contended.wait(0.005) or done.is_set()):
                assert time.monotonic() < deadline, "the changing thread neither waited nor finished"

    hook = model.get_base_model().transformer.h[0].register_forward_hook(pause)
    try:
        out = logits(model)
    finally:
        hook.remove()
    changer.join(DEADLINE)
    assert not changer.is_alive(), "the change never got the lock"
    return out, errors


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_set_adapter_from_another_thread_waits_for_the_forward(monkeypatch, task_type):
    _, _, model = graft(task_type)
    default, before = logits(model), base_state(model)
    model.set_adapter("other")
    other = logits(model)
    model.set_adapter("default")
    out, errors = forward_while(model, lambda: model.set_adapter("other"), monkeypatch)
    assert not errors and torch.equal(out, default)
    assert torch.equal(logits(model), other)
    assert all(torch.equal(p, before[n]) for n, p in base_state(model).items())


def _reference(model, change):
    """The logits after ``change(copy)`` on a copy of ``model``, with no forward running."""
    twin = copy.deepcopy(model)
    result = change(twin)
    return logits(result if isinstance(result, torch.nn.Module) else twin)


CHANGES = {
    "merge_adapter": lambda m: m.merge_adapter(),
    "set_scale": lambda m: m.set_scale(0.5),
    "delete the active adapter": lambda m: m.delete_adapter("default"),
    "merge_and_unload": lambda m: m.merge_and_unload(),
    "unload": lambda m: m.unload(),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_state_changes_from_another_thread_wait_for_the_forward(monkeypatch, name):
    pre, _, model = graft()
    default, before = logits(model), base_state(model)
    expected_after = _reference(model, CHANGES[name])
    result = []
    out, errors = forward_while(model, lambda: result.append(CHANGES[name](model)), monkeypatch)
    assert not errors and torch.equal(out, default)  # the forward ran in the state it began in
    after = result[0] if isinstance(result[0], torch.nn.Module) else model
    assert torch.equal(logits(after), expected_after)
    if name == "merge_adapter":
        model.unmerge_adapter()
    if name == "unload":
        before = dict(pre.named_parameters())
    if name != "merge_and_unload":
        assert all(torch.equal(p, before[n]) for n, p in base_state(after).items())  # theta_pre, bit for bit


def test_unmerge_from_another_thread_waits_for_a_merged_forward(monkeypatch):
    """(Also harmless before the lock: a merged and an unmerged layer give the same output.)"""
    _, _, model = graft()
    default, before = logits(model), base_state(model)
    model.merge_adapter()
    out, errors = forward_while(model, model.unmerge_adapter, monkeypatch)
    assert not errors and torch.equal(out, default)
    assert all(torch.equal(p, before[n]) for n, p in base_state(model).items())


def test_add_adapter_from_another_thread_waits_for_the_forward(monkeypatch):
    """Creating a graft reads theta_pre from the base tensors, which hold theta_ft while a forward runs."""
    _, finetuned, model = graft()
    default = logits(model)

    def add(m):
        m.add_adapter("third", GraftConfig(finetuned=finetuned, sparsity=0.02, task_type="CAUSAL_LM"))
        m.set_adapter("third")

    expected = _reference(model, add)
    out, errors = forward_while(model, lambda: add(model), monkeypatch)
    assert not errors and torch.equal(out, default)
    assert torch.equal(logits(model), expected)


def test_load_adapter_from_another_thread_waits_for_the_forward(monkeypatch, tmp_path):
    """Loading new values into the adapter being served."""
    _, _, model = graft()
    default = logits(model)
    changed = copy.deepcopy(model)
    for layer in changed.base_model.graft_layers().values():
        if "default" in layer.graft_values:
            layer.graft_values["default"].data.mul_(0.5)
    changed.save_pretrained(tmp_path)
    expected = logits(changed)
    assert not torch.equal(expected, default)
    out, errors = forward_while(model, lambda: model.load_adapter(str(tmp_path), "default"), monkeypatch)
    assert not errors and torch.equal(out, default)
    assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("moment", ["entered", "left"])
def test_disable_adapter_from_another_thread_waits_for_the_forward(monkeypatch, moment):
    pre, _, model = graft()
    default, base = logits(model), logits(pre)
    with ExitStack() as stack:
        if moment == "entered":
            out, errors = forward_while(model, lambda: stack.enter_context(model.disable_adapter()), monkeypatch)
            assert not errors and torch.equal(out, default)
            assert torch.equal(logits(model), base)
        else:
            stack.enter_context(model.disable_adapter())
            out, errors = forward_while(model, stack.close, monkeypatch)
            assert not errors and torch.equal(out, base)
    assert torch.equal(logits(model), default)


def _in_a_hook(model, action):
    """Run ``action()`` from a hook after the first block of ``model``'s next forward."""

    def hook(*_):
        action()

    return model.get_base_model().transformer.h[0].register_forward_hook(hook)


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_switching_adapters_in_a_hook_without_switching_back_is_refused(task_type):
    _, _, model = graft(task_type)
    default = logits(model)
    hook = _in_a_hook(model, lambda: model.set_adapter("other"))
    with pytest.raises(ValueError, match="changed during its forward"):
        logits(model)
    hook.remove()
    model.set_adapter("default")
    assert torch.equal(logits(model), default)


@pytest.mark.parametrize("name", ["merge_adapter", "delete_adapter", "unload", "add_adapter"])
def test_structural_changes_in_a_hook_are_refused(name):
    _, finetuned, model = graft()
    default, before = logits(model), base_state(model)
    actions = {
        "merge_adapter": model.merge_adapter,
        "delete_adapter": lambda: model.delete_adapter("other"),
        "unload": model.unload,
        "add_adapter": lambda: model.add_adapter("third", GraftConfig(finetuned=finetuned, task_type="CAUSAL_LM")),
    }
    hook = _in_a_hook(model, actions[name])
    with pytest.raises(ValueError, match="cannot run inside a forward"):
        logits(model)
    hook.remove()
    assert sorted(model.peft_config) == ["default", "other"]
    assert torch.equal(logits(model), default)
    assert all(torch.equal(p, before[n]) for n, p in base_state(model).items())
