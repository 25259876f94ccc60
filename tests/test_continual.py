"""Forget-free continual learning (ContinualGrafter): earlier tasks' grafts stay bit-identical, state saves and
resumes, bad input is a clear error."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from testing_utils import (
    TORCHRUN,
    clone_model,
    cls_dataset,
    fast_args,
    finetune_like,
    input_ids,
    make_pair,
    run_command,
    sparse_region,
)
from transformers import Trainer, TrainingArguments

from peft_graft import ContinualGrafter, GraftConfig, Region, RestrictTrainingCallback
from peft_graft.training import continual


def body_region(model, fraction: float, seed: int) -> Region:
    region = sparse_region(model, fraction, seed)
    return Region({n: idx for n, idx in region.items() if not n.startswith("classifier")})


def trainer_args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = dict(
        max_steps=3, per_device_train_batch_size=4, learning_rate=0.05, weight_decay=0.1, optim="adamw_torch"
    )
    return fast_args(tmp_path, **{**defaults, **kwargs})


def learn(learner: ContinualGrafter, name: str, region, tmp_path, seed: int) -> None:
    with learner.task(name, region) as allowed:
        callback = RestrictTrainingCallback(allowed=allowed)
        data = cls_dataset(n=16, seed=seed)
        Trainer(model=learner.model, args=trainer_args(tmp_path), train_dataset=data, callbacks=[callback]).train()


def predictions(model, adapter: str) -> torch.Tensor:
    model.set_adapter(adapter)
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids(batch=4, seed=7)).logits


def adapter_state(model, adapter: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.clone() for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()}


@pytest.fixture
def pre():
    return make_pair("bert_cls")[0]


def test_earlier_tasks_stay_bit_identical_after_later_tasks(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    regions = {name: body_region(pre, 0.05, seed) for name, seed in (("mr", 1), ("trec", 2), ("sms", 3))}
    learn(learner, "mr", regions["mr"], tmp_path, seed=1)
    after_a = learner.to_peft_model()
    state_a, logits_a = adapter_state(after_a, "mr"), predictions(after_a, "mr")
    learn(learner, "trec", regions["trec"], tmp_path, seed=2)
    learn(learner, "sms", regions["sms"], tmp_path, seed=3)

    grafts = learner.to_peft_model()
    state = adapter_state(grafts, "mr")
    assert state.keys() == state_a.keys() and all(torch.equal(state[k], state_a[k]) for k in state)
    assert torch.equal(predictions(grafts, "mr"), logits_a)
    # Later tasks trained only outside earlier regions, and infer with the union of regions up to them.
    assert learner.tasks[1].trained == regions["trec"] - regions["mr"]
    assert learner.tasks[2].trained == regions["sms"] - (regions["mr"] | regions["trec"])
    assert grafts.get_region("sms") == regions["mr"] | regions["trec"] | regions["sms"]
    assert grafts.get_region("mr") == regions["mr"] and learner.region_for("trec") == regions["mr"] | regions["trec"]
    # Each task's graft is theta_pre with the continual model's values on its union, and its own head.
    union, trained = learner.region_for("trec"), dict(learner.model.named_parameters())
    grafts.set_adapter("trec")
    merged = dict(grafts.merge_and_unload().named_parameters())
    for name, param in pre.named_parameters():
        if name.startswith("classifier"):
            assert torch.equal(merged[name], learner.tasks[1].head[name]), name
            continue
        expected = param.detach().clone().reshape(-1)
        if name in union:
            expected[union[name]] = trained[name].detach().reshape(-1)[union[name]]
        assert torch.equal(merged[name].detach().reshape(-1), expected), name


def test_save_and_resume_reproduce_the_learner(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learn(learner, "mr", body_region(pre, 0.05, 1), tmp_path, seed=1)
    learn(learner, "trec", body_region(pre, 0.05, 2), tmp_path, seed=2)
    learner.save_pretrained(tmp_path / "state")

    resumed = ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre))
    assert resumed.task_names == ["mr", "trec"] and resumed.heads == ["classifier"]
    resumed_params = dict(resumed.model.named_parameters())
    assert all(torch.equal(param, resumed_params[name]) for name, param in learner.model.named_parameters())
    grafts, again = learner.to_peft_model(), resumed.to_peft_model()
    for adapter in ("mr", "trec"):
        assert torch.equal(predictions(grafts, adapter), predictions(again, adapter))
    # The resumed learner goes on, and leaves the earlier tasks as they were.
    learn(resumed, "sms", body_region(pre, 0.05, 3), tmp_path, seed=3)
    assert torch.equal(predictions(resumed.to_peft_model(), "mr"), predictions(grafts, "mr"))


def test_memory_grows_with_entries_not_with_tasks(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    sizes = []
    for i, name in enumerate(("mr", "trec", "sms")):
        learn(learner, name, body_region(pre, 0.02, i + 1), tmp_path, seed=i)
        sizes.append(learner.nbytes)
    head = sum(p.numel() * 4 for p in pre.classifier.parameters())
    for task in learner.tasks:  # 8 bytes per region index, 4 + 4 per trained entry (fp32 value, theta_pre), a head
        assert task.nbytes == 8 * task.region.num_entries + 8 * task.trained.num_entries + head
    assert sizes[-1] == sum(t.nbytes for t in learner.tasks) + head


def test_an_interrupted_task_rolls_back_and_can_be_run_again(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learn(learner, "mr", body_region(pre, 0.05, 1), tmp_path, seed=1)
    learner.save_pretrained(tmp_path / "state")
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}

    class Interrupt(Exception):
        pass

    with pytest.raises(Interrupt), learner.task("trec", body_region(pre, 0.05, 2)) as allowed:
        with torch.no_grad():  # training got this far, then the run died
            for name in allowed:
                dict(learner.model.named_parameters())[name].view(-1)[allowed[name]] += 1.0
        raise Interrupt
    assert learner.task_names == ["mr"]
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    learn(learner, "trec", body_region(pre, 0.05, 2), tmp_path, seed=2)
    # A killed process resumes from the last saved state, on the pre-trained model, without task b.
    resumed = ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre))
    assert resumed.task_names == ["mr"]
    assert torch.equal(predictions(resumed.to_peft_model(), "mr"), predictions(learner.to_peft_model(), "mr"))


def test_training_outside_the_allowed_region_is_refused_and_rolled_back(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learn(learner, "mr", body_region(pre, 0.05, 1), tmp_path, seed=1)
    learner.save_pretrained(tmp_path / "state")
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    params = dict(learner.model.named_parameters())
    name, entries = next(iter(learner.tasks[0].trained.items()))
    # Changes to earlier tasks' entries, to the task's own entries and heads: refused, then rolled back exactly.
    refused = pytest.raises(ValueError, match="changed entries of earlier task 'mr'")
    with refused, learner.task("trec", body_region(pre, 0.05, 2)) as allowed, torch.no_grad():
        params[name].view(-1)[entries[:3]] += 1.0
        for other in allowed:
            params[other].view(-1)[allowed[other]] -= 1.0
    assert learner.task_names == ["mr"]
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    # Unrestricted training also moves entries outside every region, where theta_pre is not kept: the learner says
    # so and refuses further work; the last save resumes it.
    with pytest.raises(ValueError, match="cannot be rolled back"), learner.task("trec", body_region(pre, 0.05, 2)):
        Trainer(model=learner.model, args=trainer_args(tmp_path), train_dataset=cls_dataset(n=16)).train()
    with pytest.raises(ValueError, match="cannot be rolled back"):
        learner.start_task("trec", body_region(pre, 0.05, 2))
    resumed = ContinualGrafter.from_pretrained(tmp_path / "state", clone_model(pre))
    assert all(torch.equal(p, before[n]) for n, p in resumed.model.named_parameters())


def test_regions_from_grafts_and_saved_grafts(pre, tmp_path):
    finetuned = finetune_like(pre)
    graft = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=40, task_type="SEQ_CLS"))
    graft.save_pretrained(tmp_path / "graft")
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    assert (
        learner.start_task("mr", graft)
        - Region({n: torch.arange(p.numel()) for n, p in pre.classifier.named_parameters(prefix="classifier")})
        == graft.get_region()
    )
    learner.abort_task()
    learner.start_task("mr", str(tmp_path / "graft"))
    assert learner._running["task"].region == graft.get_region()
    learner.abort_task()
    # A graft learned on another pre-trained model is refused.
    other = make_pair("bert_cls", seed=5)[0]
    foreign = get_peft_model(other, GraftConfig(finetuned=finetune_like(other), num_entries=40, task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match="another pre-trained model"):
        learner.start_task("trec", foreign)


def test_bad_input_is_a_clear_error(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    region = body_region(pre, 0.05, 1)
    with pytest.raises(ValueError, match="region is empty"):
        learner.start_task("mr", Region())
    with pytest.raises(ValueError, match="does not have"):
        learner.start_task("mr", Region({"no.such.weight": torch.tensor([0])}))
    with pytest.raises(ValueError, match="outside the tensor"):
        learner.start_task("mr", Region({"bert.pooler.dense.bias": torch.tensor([10_000])}))
    with pytest.raises(ValueError, match="heads are trained whole"):
        learner.start_task("mr", Region({"classifier.weight": torch.tensor([0])}))
    with pytest.raises(ValueError, match="adapter_name"):
        learner.start_task("../mr", region)
    with pytest.raises(TypeError, match="must be a Region"):
        learner.start_task("mr", 3)
    with pytest.raises(ValueError, match="is not a saved graft"):
        learner.start_task("mr", str(tmp_path))
    with pytest.raises(ValueError, match="has shape"):
        wrong_head = {"classifier.weight": torch.zeros(2, 32), "classifier.bias": torch.zeros(2)}
        learner.start_task("mr", region, head=wrong_head)
    with pytest.raises(ValueError, match="no values for the head tensors"):
        learner.start_task("mr", region, head={})
    with pytest.raises(ValueError, match="no module 'head'"):
        ContinualGrafter(clone_model(pre), heads=["head"])
    tied, _, _ = make_pair("gpt2")  # its lm_head is the token embedding: it would train whole per task
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to 'transformer\.wte\.weight' outside the head"):
        ContinualGrafter(clone_model(tied), heads=["lm_head"])
    with pytest.raises(TypeError, match="plain pre-trained model"):
        ContinualGrafter(get_peft_model(clone_model(pre), GraftConfig(finetuned=finetune_like(pre), num_entries=5)))
    learner.start_task("mr", region)
    with pytest.raises(ValueError, match="still running"):
        learner.start_task("trec", region)
    with pytest.raises(ValueError, match="is running"):
        learner.save_pretrained(tmp_path / "state")
    learner.finish_task()
    with pytest.raises(ValueError, match="already learned"):
        learner.start_task("mr", region)
    with pytest.raises(ValueError, match="No task is running"):
        learner.finish_task()
    with pytest.raises(ValueError, match="No task 'qqp'"):
        learner.region_for("qqp")
    learner.save_pretrained(tmp_path / "state")
    with pytest.raises(ValueError, match="another pre-trained model"):
        ContinualGrafter.from_pretrained(tmp_path / "state", make_pair("bert_cls", seed=5)[0])
    headless = ContinualGrafter(clone_model(pre))
    headless.start_task("mr", region)
    headless.finish_task()
    with pytest.raises(ValueError, match="nothing could be trained"):
        headless.start_task("trec", region)
    with pytest.raises(ValueError, match="not a saved ContinualGrafter"):
        ContinualGrafter.from_pretrained(tmp_path, clone_model(pre))
    with pytest.raises(ValueError, match="not this learner's pre-trained model"):
        learner.to_peft_model(make_pair("bert_cls", seed=5)[0])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / continual.STATE_NAME).write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        ContinualGrafter.from_pretrained(tmp_path / "bad", clone_model(pre))


def test_an_interrupted_save_keeps_the_previous_state(pre, tmp_path, monkeypatch):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learn(learner, "mr", body_region(pre, 0.05, 1), tmp_path, seed=1)
    learner.save_pretrained(tmp_path / "state")
    saved = (tmp_path / "state" / continual.STATE_NAME).read_bytes()
    learn(learner, "trec", body_region(pre, 0.05, 2), tmp_path, seed=2)

    def killed(tensors, path, metadata=None):
        with open(path, "wb") as handle:
            handle.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(continual, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        learner.save_pretrained(tmp_path / "state")
    assert (tmp_path / "state" / continual.STATE_NAME).read_bytes() == saved
    assert [p.name for p in (tmp_path / "state").iterdir()] == [continual.STATE_NAME]


def test_task_adapters_save_and_load_as_ordinary_grafts(pre, tmp_path):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learn(learner, "mr", body_region(pre, 0.05, 1), tmp_path, seed=1)
    learn(learner, "trec", body_region(pre, 0.05, 2), tmp_path, seed=2)
    grafts = learner.to_peft_model(clone_model(pre))
    grafts.save_pretrained(tmp_path / "grafts")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "grafts" / "trec", adapter_name="trec")
    loaded.load_adapter(tmp_path / "grafts" / "mr", adapter_name="mr")
    for adapter in ("mr", "trec"):
        assert torch.equal(predictions(loaded, adapter), predictions(grafts, adapter))


def test_a_change_outside_every_region_is_caught_by_the_fingerprint(pre):
    learner = ContinualGrafter(clone_model(pre), heads=["classifier"])
    learner.start_task("mr", body_region(pre, 0.05, 1))
    with torch.no_grad():
        learner.model.bert.embeddings.word_embeddings.weight[0, 0] += 1  # not in the region (checked below)
    assert 0 not in learner._running["task"].region.get("bert.embeddings.word_embeddings.weight", torch.tensor([1]))
    with pytest.raises(ValueError, match="outside the region start_task returned"):
        learner.finish_task()
    with pytest.raises(ValueError, match="cannot be rolled back"):
        learner.abort_task()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "engine",
    [
        "FSDP",
        pytest.param(
            "DEEPSPEED",
            marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed"),
        ),
    ],
)
def test_two_tasks_under_fsdp2_or_zero3_learn_what_one_process_learns(tmp_path, monkeypatch, engine):
    """Both tasks trained by Trainers sharding the model with FSDP2, or partitioning it with DeepSpeed ZeRO-3
    (TrainingArguments(deepspeed=...); the second task's head is written into the partitioned model) on 2 processes:
    the saved learner holds the regions and theta_pre of one process bit for bit and its trained values and heads to
    fp32 rounding (rtol 1e-5, atol 1e-6); it resumes in one process, whose task adapters predict as the one-process
    learner's. Copying the sharded or partitioned model is refused. Under ZeRO-3 the learner also resumes on theta_pre
    partitioned, holding the trained model bit for bit."""
    script = os.path.join(os.path.dirname(__file__), "continual_script.py")
    (tmp_path / "one").mkdir()
    run_command([sys.executable, script, str(tmp_path / "one")], tmp_path)
    monkeypatch.setenv(engine, "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (tmp_path / "two").mkdir()
    run_command([*TORCHRUN, script, str(tmp_path / "two")], tmp_path)
    assert (tmp_path / "one" / "rank0.txt").read_text() == "sharded=False tasks=first,second to_peft_model=built"
    resumed = " resumed_partitioned=True" if engine == "DEEPSPEED" else ""  # from_pretrained on a partitioned model
    for rank in (0, 1):
        assert (tmp_path / "two" / f"rank{rank}.txt").read_text() == (
            "sharded=True tasks=first,second to_peft_model=refused" + resumed
        )
    one = load_file(tmp_path / "one" / "learner" / continual.STATE_NAME)
    two = load_file(tmp_path / "two" / "learner" / continual.STATE_NAME)
    assert one.keys() == two.keys()
    for key in one:
        if "/region/" in key or "/pretrained/" in key:
            assert torch.equal(one[key], two[key]), key
        else:
            torch.testing.assert_close(one[key], two[key], rtol=1e-5, atol=1e-6)
    pre = make_pair("bert_cls")[0]
    grafts = [
        ContinualGrafter.from_pretrained(tmp_path / run / "learner", clone_model(pre)).to_peft_model()
        for run in ("one", "two")
    ]
    for task in ("first", "second"):
        torch.testing.assert_close(predictions(grafts[1], task), predictions(grafts[0], task), rtol=1e-5, atol=1e-5)
