"""Training restricted to a region: entries outside the allowed set stay bit-identical after real optimizer steps."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from testing_utils import (
    TORCHRUN,
    clone_model,
    cls_dataset,
    fast_args,
    input_ids,
    learning_graft,
    make_pair,
    run_command,
    sparse_region,
)
from transformers import Trainer

from peft_graft import GraftConfig, Region, RestrictTrainingCallback, TrainingRestriction, restrict_training

SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_restriction_script.py")
ZERO3_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_deepspeed_zero3.yaml")
# accelerate launch with the example ZeRO-3 config: 2 processes, the script's accumulation and clipping
ACCELERATE_ZERO3 = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3_CONFIG]
ACCELERATE_ZERO3 += ["--num_processes", "2", "--gradient_accumulation_steps", "2", "--gradient_clipping", "0.5"]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")

OPTIMIZERS = {
    "sgd_momentum_decay": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1),
    "adamw_decay": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    # Trainer's default optimizer (optim="adamw_torch_fused")
    "adamw_fused_decay": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True),
    "adam_coupled_decay": lambda params: torch.optim.Adam(params, lr=0.05, weight_decay=0.1),
}


def flat_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone().reshape(-1) for name, param in model.named_parameters()}


def changed_entries(before: dict, after: dict, name: str) -> torch.Tensor:
    """Flat indices of ``name`` whose bits changed."""
    return (before[name].view(torch.int32) != after[name].view(torch.int32)).nonzero().reshape(-1)


def train(model, optimizer, restriction, steps: int = 3, accumulation: int = 2, max_norm: float | None = 0.5):
    model.train()
    for step in range(steps):
        for micro in range(accumulation):
            ids = input_ids(batch=2, seed=10 * step + micro)
            output = model(input_ids=ids, labels=ids if model.config.model_type != "bert" else ids[:, 0] % 3)
            (output.loss / accumulation).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        restriction.step(optimizer)
        optimizer.zero_grad()


def train_restricted(model, optimizer: str, **regions):
    """``(parameters before, parameters after, the restriction)`` of :func:`train` under ``regions``."""
    before = flat_state(model)
    with restrict_training(model, **regions) as restriction:
        train(model, OPTIMIZERS[optimizer](model.parameters()), restriction)
    return before, flat_state(model), restriction


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("arch", ["roberta_mlm", "gpt2", "bert_cls"])
def test_only_allowed_entries_change(arch, optimizer):
    """Tied tensors (RoBERTa's decoder and embeddings, GPT-2's head) and a classification head, with decay,
    momentum, gradient accumulation and clipping."""
    model = clone_model(make_pair(arch)[0])
    allowed = sparse_region(model, 0.05, seed=1)
    before, after, _ = train_restricted(model, optimizer, allowed=allowed)
    moved = 0
    for name in before:
        changed = changed_entries(before, after, name)
        assert bool(torch.isin(changed, allowed[name]).all()), name
        moved += changed.numel()
    assert moved > 0.5 * allowed.num_entries  # training did happen inside the region


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_frozen_entries_never_change(optimizer):
    model = clone_model(make_pair("roberta_mlm")[0])
    frozen = sparse_region(model, 0.02, seed=2)
    before, after, restriction = train_restricted(model, optimizer, frozen=frozen)
    for name in before:
        assert not bool(torch.isin(changed_entries(before, after, name), frozen[name]).any()), name
    assert sum(changed_entries(before, after, n).numel() for n in before) > 0.5 * sum(
        t.numel() for t in before.values()
    )
    assert restriction.extra_bytes == 8 * frozen.num_entries  # the int64 indices of the frozen entries


def test_allowed_minus_frozen_and_whole_frozen_tensors_keep_no_optimizer_state():
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    allowed = Region({name: torch.arange(0, 100)})
    frozen = Region({name: torch.arange(50, 150)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    before = flat_state(model)
    with restrict_training(model, allowed=allowed, frozen=frozen) as restriction:
        train(model, optimizer, restriction)
    after = flat_state(model)
    assert set(changed_entries(before, after, name).tolist()) <= set(range(50))
    assert all(changed_entries(before, after, n).numel() == 0 for n in before if n != name)
    params = dict(model.named_parameters())
    assert params[name] in optimizer.state and params["bert.pooler.dense.weight"] not in optimizer.state


def test_trainer_callback_with_adamw_accumulation_and_clipping(tmp_path):
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    frozen = sparse_region(model, 0.05, seed=3)
    before = flat_state(model)
    args = fast_args(
        tmp_path, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=0.05,
        weight_decay=0.1, max_grad_norm=0.5,
    )  # fmt: skip
    callback = RestrictTrainingCallback(frozen=frozen)
    Trainer(model=model, args=args, train_dataset=cls_dataset(n=24), callbacks=[callback]).train()
    after = flat_state(model)
    for name in before:
        assert not bool(torch.isin(changed_entries(before, after, name), frozen[name]).any()), name
    assert sum(changed_entries(before, after, n).numel() for n in before) > 0
    assert callback.restriction is None and all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_trainer_run_that_raises_leaves_no_restriction_behind(tmp_path):
    """The hooks were removed only by on_train_end, which a raising run never reaches: a later plain run of the
    model was then silently restricted."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    allowed = Region({"classifier.weight": torch.arange(model.get_parameter("classifier.weight").numel())})
    args = fast_args(tmp_path, max_steps=4, per_device_train_batch_size=4, learning_rate=0.05)
    bad = cls_dataset(n=16)
    bad = bad.map(lambda row, i: {"labels": 7 if i == 9 else row["labels"]}, with_indices=True)  # 3rd step raises
    callback = RestrictTrainingCallback(allowed=allowed)
    with pytest.raises(IndexError):
        Trainer(model=model, args=args, train_dataset=bad, callbacks=[callback]).train()
    assert callback.restriction is None and all(not p._post_accumulate_grad_hooks for p in model.parameters())
    before = flat_state(model)
    Trainer(model=model, args=args, train_dataset=cls_dataset(n=16)).train()
    assert changed_entries(before, flat_state(model), "bert.pooler.dense.weight").numel() > 0


def test_removing_a_restriction_mid_step_closes_the_step():
    """optimizer.step() raised after before_step: remove() writes the frozen values back and restores the
    optimizer's parameter groups (which a sparse allowed region changes for the step)."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    name = "bert.pooler.dense.weight"
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    groups = [list(group["params"]) for group in optimizer.param_groups]
    restriction = restrict_training(model, allowed=Region({name: torch.arange(10)}))
    model(input_ids=input_ids()).logits.sum().backward()
    restriction.before_step(optimizer)
    assert len(optimizer.param_groups) > len(groups)  # the sparse allowed tensor left its decayed group
    restriction.remove()
    assert [list(group["params"]) for group in optimizer.param_groups] == groups
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())

    restriction = restrict_training(model, frozen=Region({name: torch.arange(10)}))
    before = flat_state(model)
    restriction.before_step(torch.optim.SGD(model.parameters(), lr=0.5))
    with torch.no_grad():
        model.get_parameter(name).add_(1.0)  # a step that moved the whole tensor, then raised
    restriction.remove()
    assert changed_entries(before, flat_state(model), name).tolist() == list(range(10, 1024))


def test_a_graft_model_is_restricted_by_plain_parameter_names():
    """peft's wrapping (base_layer, modules_to_save) is invisible to the regions: they name plain parameters."""
    pre, finetuned, _ = make_pair("bert_cls")
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=20, task_type="SEQ_CLS"))
    for param in model.parameters():
        param.requires_grad_(True)  # train everything the restriction allows, graft tensors aside
    for module in model.modules():
        if hasattr(module, "graft_values"):
            module.graft_values.requires_grad_(False)
    region = model.base_model.get_region()
    restriction = TrainingRestriction(model, allowed=region)
    restricted = {id(entry.param) for entry in restriction.restricted}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert restricted == trainable  # body tensors by their base_layer names, the head's trained copy by its own
    head = model.base_model.model.classifier.modules_to_save["default"].weight
    partly = {id(entry.param) for entry in restriction.restricted if entry.indices is not None}
    assert id(head) not in partly  # the region holds no head entry: the head is frozen whole
    restriction.remove()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"allowed": {"nope.weight": torch.tensor([0])}}, ValueError, r"allowed names tensors the model does not have"),
        ({"frozen": Region({"classifier.weight": torch.tensor([10**6])})}, ValueError, r"fall outside \[0, 96\)"),
        ({"allowed": [1, 2]}, TypeError, "allowed must be a Region"),
        ({"allowed": Region()}, ValueError, "allowed is an empty region"),
    ],
)
def test_bad_regions_are_clear_errors(kwargs, error, match):
    pre, _, _ = make_pair("bert_cls")
    with pytest.raises(error, match=match):
        TrainingRestriction(clone_model(pre), **kwargs)


@pytest.mark.multiprocess
def test_ddp_two_processes_keep_frozen_entries_and_agree(tmp_path):
    run_command([*TORCHRUN, SCRIPT, str(tmp_path)], tmp_path)
    for rank in (0, 1):
        world, kept, moved, _ = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert world == "world_size=2" and kept == "kept=True" and int(moved.split("=")[1]) > 0
    first, second = load_file(tmp_path / "params0.safetensors"), load_file(tmp_path / "params1.safetensors")
    assert all(torch.equal(first[name], second[name]) for name in first)


def check_sharded_run_trains_as_one_process(tmp_path, monkeypatch, engine: str, value: str = "1", launch=TORCHRUN):
    """ddp_restriction_script.py with ALLOWED=1 in 1 process, then in 2 (``launch``) with ``engine`` set to ``value``:
    every process kept the disallowed entries bit for bit, and its gathered model is the one-process model to fp32
    rounding (rtol 1e-5, atol 1e-6)."""
    monkeypatch.setenv("ALLOWED", "1")
    (tmp_path / "one").mkdir()
    run_command([sys.executable, SCRIPT, str(tmp_path / "one")], tmp_path)
    monkeypatch.setenv(engine, value)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (tmp_path / "two").mkdir()
    run_command([*launch, SCRIPT, str(tmp_path / "two")], tmp_path)
    single = (tmp_path / "one" / "rank0.txt").read_text().split()
    assert single[0] == "world_size=1" and single[1] == "kept=True" and int(single[2].split("=")[1]) > 0
    expected = load_file(tmp_path / "one" / "params0.safetensors")
    for rank in (0, 1):
        world, kept, moved, sharded = (tmp_path / "two" / f"rank{rank}.txt").read_text().split()
        assert (world, kept, sharded) == ("world_size=2", "kept=True", "sharded=True")
        assert moved == single[2]
        params = load_file(tmp_path / "two" / f"params{rank}.safetensors")
        for name in expected:
            torch.testing.assert_close(params[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_fsdp2_keeps_disallowed_entries_on_every_shard_and_trains_as_one_process(tmp_path, monkeypatch):
    """A Trainer run sharded by FSDP2 (DTensor parameters; the hooks see each process's reduced shard) under AdamW with
    weight decay and clipping: entries outside the allowed region and inside the frozen one stay bit-identical, and
    the gathered model is the one-process model to fp32 rounding, through the copying and the sparse path."""
    check_sharded_run_trains_as_one_process(tmp_path, monkeypatch, "FSDP")


@pytest.mark.multiprocess
@needs_deepspeed
@pytest.mark.parametrize("entry_point", ["trainer_argument", "accelerate_config"])
def test_zero3_keeps_disallowed_entries_on_every_partition_and_trains_as_one_process(
    tmp_path, monkeypatch, entry_point
):
    """A Trainer run partitioned by DeepSpeed ZeRO-3 (2 CPU processes, gloo) under the Trainer's AdamW with weight
    decay and DeepSpeed's gradient clipping (which must see only allowed gradients: the global norm, 2.06 on the first
    step, is clipped to 0.5): entries outside the allowed region, inside the frozen one and of a tensor frozen whole
    stay bit-identical, and the gathered model is the one-process model to fp32 rounding. Started with
    TrainingArguments(deepspeed=<ZeRO-3 config>) under torchrun (every tensor partitioned), or by ``accelerate launch``
    with examples/accelerate_deepspeed_zero3.yaml (small tensors persist whole between steps: the values written back
    reach them)."""
    if entry_point == "trainer_argument":
        check_sharded_run_trains_as_one_process(tmp_path, monkeypatch, "DEEPSPEED")
    else:
        check_sharded_run_trains_as_one_process(tmp_path, monkeypatch, "DEEPSPEED", "accelerate", ACCELERATE_ZERO3)


@pytest.mark.multiprocess
@needs_deepspeed
def test_zero3_with_several_sub_groups_keeps_disallowed_entries_and_trains_as_one_process(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 steps its fp32 partitions one sub-group at a time (a small ``sub_group_size``), copying each
    into the model's partitions right after its inner optimizer step: the values are written back after every
    sub-group's step, so the disallowed entries of every sub-group stay bit-identical and the model is the
    one-process model to fp32 rounding."""
    monkeypatch.setenv("SUB_GROUPS", "1")
    check_sharded_run_trains_as_one_process(tmp_path, monkeypatch, "DEEPSPEED")
    for rank in (0, 1):
        assert int((tmp_path / "two" / f"sub_groups{rank}.txt").read_text()) > 2


@pytest.mark.multiprocess
@needs_deepspeed
def test_zero3_in_bf16_keeps_disallowed_entries_bit_identical(tmp_path, monkeypatch):
    """DeepSpeed's bf16 mixed precision under ZeRO-3 (bf16 partitions, fp32 copies stepped and written back): the
    disallowed entries keep their bf16 bits, and training moves others."""
    for name, value in {"ALLOWED": "1", "DEEPSPEED": "1", "BF16": "1", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(name, value)
    run_command([*TORCHRUN, SCRIPT, str(tmp_path)], tmp_path)
    for rank in (0, 1):
        world, kept, moved, sharded = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert (world, kept, sharded) == ("world_size=2", "kept=True", "sharded=True")
        assert int(moved.split("=")[1]) > 0
    assert load_file(tmp_path / "params0.safetensors")["classifier.weight"].dtype == torch.bfloat16


def test_gradient_clipping_sees_only_allowed_gradients():
    pre, _, _ = make_pair("gpt2")
    model = clone_model(pre)
    frozen = sparse_region(model, 0.3, seed=4)
    with restrict_training(model, frozen=frozen):
        ids = input_ids(batch=2)
        model(input_ids=ids, labels=ids).loss.backward()
        for name, param in model.named_parameters():
            assert not bool(param.grad.reshape(-1)[frozen[name]].any()), name


class SubclassedAdamW(torch.optim.AdamW):
    """Not one of the optimizers whose zero updates the restriction relies on: it takes the copying path."""


@pytest.mark.parametrize("optimizer", ["adamw_decay", "adamw_fused_decay", "adam_coupled_decay", "sgd_momentum_decay"])
def test_sparse_allowed_regions_skip_the_copy_and_train_as_the_copying_path(optimizer):
    """With SGD/Adam/AdamW a sparse allowed region is trained without copying the frozen side: weight decay is applied
    to the allowed entries by hand. The result matches the copying path, which any other optimizer takes."""
    pre, _, _ = make_pair("bert_cls")
    region = sparse_region(pre, 0.05, seed=4)
    fast, copying = clone_model(pre), clone_model(pre)
    before = flat_state(fast)
    restriction = restrict_training(fast, allowed=region)
    fast_optimizer = OPTIMIZERS[optimizer](fast.parameters())
    copied = []
    original_after_step = restriction.after_step

    def after_step():
        copied.extend(e.saved.numel() for e in restriction.restricted if e.saved is not None)
        original_after_step()

    restriction.after_step = after_step
    torch.manual_seed(0)  # the same dropout in both runs
    with restriction:
        train(fast, fast_optimizer, restriction)
    assert copied == []  # nothing copied around the step: not a single tensor
    slow_optimizer = OPTIMIZERS[optimizer](copying.parameters())
    slow_optimizer.__class__ = type("Copying", (type(slow_optimizer),), {})
    torch.manual_seed(0)
    with restrict_training(copying, allowed=region) as restriction:
        train(copying, slow_optimizer, restriction)
    after, reference = flat_state(fast), flat_state(copying)
    for name in before:
        changed = changed_entries(before, after, name)
        assert bool(torch.isin(changed, region[name]).all()), name
        torch.testing.assert_close(after[name], reference[name], rtol=1e-6, atol=1e-7)
    assert all(fast_optimizer.param_groups[0][k] == v for k, v in {"weight_decay": 0.1}.items())
    assert len(fast_optimizer.param_groups) == 1


def test_an_optimizer_under_a_loss_scaler_takes_the_copying_path():
    """accelerate's wrapper of an fp16 run holds a scaler: the gradients may still be scaled before the step (no
    clipping), so weight decay added by hand would be divided by the loss scale; every tensor is copied instead."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    region = sparse_region(model, 0.05, seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    wrapper = SimpleNamespace(optimizer=optimizer, scaler=object())  # as accelerate's AcceleratedOptimizer
    with restrict_training(model, allowed=region) as restriction:
        model(input_ids=input_ids()).logits.sum().backward()
        before = flat_state(model)
        restriction.before_step(wrapper)
        assert len(optimizer.param_groups) == 1 and all(e.saved is not None for e in restriction.restricted)
        optimizer.step()
        restriction.after_step()
    after = flat_state(model)
    assert all(bool(torch.isin(changed_entries(before, after, n), region[n]).all()) for n in before)


def test_adam_without_eps_takes_the_copying_path():
    """With eps=0 Adam's update of a zero gradient and zero state is 0/0: NaN written into frozen entries."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    region = sparse_region(model, 0.05, seed=4)
    before = flat_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, eps=0.0)
    with restrict_training(model, allowed=region) as restriction:
        train(model, optimizer, restriction)
    after = flat_state(model)
    for name in before:
        assert bool(torch.isin(changed_entries(before, after, name), region[name]).all()), name


def test_optimizer_state_from_before_the_restriction_takes_the_copying_path():
    """Momentum gathered before the restriction began would move frozen entries with a zero gradient: copied back."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    with restrict_training(model) as free:
        train(model, optimizer, free, steps=1)
    region = sparse_region(model, 0.05, seed=5)
    before = flat_state(model)
    with restrict_training(model, allowed=region) as restriction:
        train(model, optimizer, restriction)
    after = flat_state(model)
    for name in before:
        assert bool(torch.isin(changed_entries(before, after, name), region[name]).all()), name


def test_a_model_learning_its_region_is_refused():
    """MaskTrainer trains the scores S, which no region of model parameters describes: refused, not ignored."""
    _, model = learning_graft("bert_cls", task_type="SEQ_CLS")
    with pytest.raises(ValueError, match="MaskTrainer trains the scores S"):
        restrict_training(model, frozen=Region({"classifier.weight": torch.tensor([0])}))


def _loss(model, seed: int = 0) -> torch.Tensor:
    ids = input_ids(batch=2, seed=seed)
    return model(input_ids=ids, labels=ids[:, 0] % 3).loss


@pytest.mark.parametrize("optimizer", ["adamw_decay", "adam_coupled_decay"])
def test_a_step_a_grad_scaler_skips_changes_nothing(optimizer):
    """A ``torch.amp.GradScaler`` skips the optimizer step on inf/NaN gradients: the weight decay the restriction
    applies by hand to a sparse allowed region is skipped with it."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre)
    region = sparse_region(model, 0.05, seed=4)
    before, optim = flat_state(model), OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with restrict_training(model, allowed=region) as restriction:
        scaler.scale(_loss(model) * float("inf")).backward()
        restriction.before_step(optim)
        scaler.step(optim)
        restriction.after_step()
        scaler.update()
    after = flat_state(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not optim.state and len(optim.param_groups) == 1 and scaler.get_scale() == 2.0**7


@pytest.mark.parametrize(
    ("optimizer", "how"),
    [
        ("adam_coupled_decay", "before_step, scaler.step, after_step"),
        ("sgd_momentum_decay", "before_step, scaler.step, after_step"),
        ("adamw_decay", "step(scaler=)"),
    ],
)
def test_grad_scaler_steps_equal_unscaled_steps(optimizer, how):
    """Weight decay applied by hand (coupled: added to the gradient) acts on the unscaled gradient, as the
    optimizer's own would: a scaled run trains as an unscaled one."""
    pre, _, _ = make_pair("bert_cls")
    region = sparse_region(pre, 0.05, seed=4)
    scaled, plain = clone_model(pre).train(), clone_model(pre).train()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    runs = [(scaled, OPTIMIZERS[optimizer](scaled.parameters())), (plain, OPTIMIZERS[optimizer](plain.parameters()))]
    for model, optim in runs:
        torch.manual_seed(0)  # the same dropout in both runs
        with restrict_training(model, allowed=region) as restriction:
            for step in range(3):
                if model is plain:
                    _loss(model, step).backward()
                    restriction.step(optim)
                else:
                    scaler.scale(_loss(model, step)).backward()
                    if how == "step(scaler=)":
                        restriction.step(optim, scaler=scaler)
                    else:
                        restriction.before_step(optim)
                        scaler.step(optim)
                        restriction.after_step()
                    scaler.update()
                optim.zero_grad()
    before, after, reference = flat_state(pre), flat_state(scaled), flat_state(plain)
    for name in before:
        assert bool(torch.isin(changed_entries(before, after, name), region[name]).all()), name
        torch.testing.assert_close(after[name], reference[name], rtol=1e-6, atol=1e-7)


def test_lbfgs_steps_with_its_closure_under_the_restriction():
    """``step(optimizer, closure)``: LBFGS evaluates the closure several times per step; every gradient is masked."""
    pre, _, _ = make_pair("bert_cls")
    model = clone_model(pre).eval()
    region = sparse_region(model, 0.05, seed=4)
    before = flat_state(model)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    calls = []

    def closure():
        calls.append(None)
        optimizer.zero_grad()
        loss = _loss(model)
        loss.backward()
        return loss

    with restrict_training(model, allowed=region) as restriction:
        first = restriction.step(optimizer, closure)
    after = flat_state(model)
    assert len(calls) > 1 and torch.is_tensor(first)
    assert any(len(changed_entries(before, after, n)) for n in before)
    for name in before:
        assert bool(torch.isin(changed_entries(before, after, name), region[name]).all()), name
