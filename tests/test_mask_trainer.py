"""MaskTrainer: paper Eq. 3-4 mask training as a transformers Trainer."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from datasets import Dataset
from peft import PeftModel, get_peft_model
from testing_utils import (
    VOCAB,
    check_bf16_mask_training,
    clone_model,
    cls_dataset,
    fast_args,
    finetune_like,
    learning_graft,
    make_pair,
    scores,
)
from torch import nn
from transformers import Trainer, TrainingArguments

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, GraftLayer, MaskTrainer
from peft_graft.tuner import autograd


# ------------------------------------------------------------------------------------------ planted skill
class Probe(nn.Module):
    """A linear probe with one logit: the smallest model whose task a few parameters can solve."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 1)

    def forward(self, x, labels=None):
        logits = self.fc(x).squeeze(-1)
        loss = None if labels is None else nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        return {"loss": loss, "logits": logits}


def _probe_task(seed: int = 0, planted: int = 4):
    """A probe whose fine-tuning planted ``planted`` entries that solve the task, plus noise everywhere else."""
    torch.manual_seed(seed)
    d, n = 64, 512
    pre = Probe(d)
    with torch.no_grad():
        pre.fc.weight.mul_(0.1)
        pre.fc.bias.zero_()
    x = torch.randn(n, d)
    labels = (x[:, :planted].sum(1) > 0).long()
    finetuned = copy.deepcopy(pre)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        finetuned.fc.weight[0, :planted] += 3.0
        finetuned.fc.weight[0, planted:] += torch.randn(d - planted, generator=noise) * 2.0
        finetuned.fc.bias += torch.randn(1, generator=noise) * 2.0
    return pre, finetuned, x, labels


def test_planted_skill_is_recovered_from_an_empty_base_but_not_by_top_k_movement(tmp_path):
    """theta_ft = theta_pre + 4 planted entries (+3, they solve the task) + large noise on all other entries."""
    planted = 4
    pre, finetuned, x, labels = _probe_task(planted=planted)
    data = Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})

    def accuracy(p):
        return {"accuracy": float(((p.predictions > 0) == p.label_ids).mean())}

    def iou(region) -> float:
        found = set(region["fc.weight"].tolist()) if "fc.weight" in region else set()
        found |= {("bias", int(i)) for i in region["fc.bias"]} if "fc.bias" in region else set()
        return len(found & set(range(planted))) / len(found | set(range(planted)))

    results = {}
    for strategy in ("empty", "movement"):
        config = GraftConfig(finetuned=finetuned, num_entries=planted, region=strategy, learn_region=True)
        model = get_peft_model(copy.deepcopy(pre), config)
        args = fast_args(
            tmp_path, per_device_train_batch_size=256, max_steps=10, learning_rate=1e4, remove_unused_columns=False
        )
        trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=accuracy)
        if strategy == "movement":  # gamma_base alone: round(gamma) before any step
            results[strategy] = (iou(model.get_region()), trainer.evaluate()["eval_accuracy"])
            continue
        trainer.train()
        assert trainer.args.gradient_accumulation_steps == 2  # full batch (512 < 1024) = 2 x 256
        results[strategy] = (iou(model.get_region()), trainer.evaluate()["eval_accuracy"])
    assert results["empty"][0] >= 0.75 and results["empty"][1] >= 0.95, results
    assert results["movement"][0] <= 0.5 and results["movement"][1] <= 0.8, results


def planted_flipped_trainer(tmp_path, task, eval_dataset, compute_metrics, **fields):
    """A MaskTrainer learning from gamma_base = the 4 planted entries of ``task`` (``_probe_task``; they solve it) on
    flipped labels, so that training moves the mask away from them, evaluated every step; and that starting region."""
    pre, finetuned, x, labels = task
    masks = {"fc.weight": torch.arange(64).reshape(1, 64) < 4, "fc.bias": torch.zeros(1, dtype=torch.bool)}
    config = GraftConfig(finetuned=finetuned, region="given", given_region=masks, learn_region=True)
    model = get_peft_model(copy.deepcopy(pre), config)
    flipped = Dataset.from_dict({"x": x.tolist(), "labels": (1 - labels).tolist()})
    settings = dict(
        per_device_train_batch_size=512, max_steps=4, learning_rate=1e4, num_entries=4, remove_unused_columns=False,
        eval_strategy="steps", eval_steps=1, metric_for_best_model="accuracy",
    )  # fmt: skip
    args = fast_args(tmp_path, **{**settings, **fields})
    trainer = MaskTrainer(
        model=model, args=args, train_dataset=flipped, eval_dataset=eval_dataset, compute_metrics=compute_metrics
    )
    return trainer, model.get_region()


def _accuracy(p):
    return {"accuracy": float(((p.predictions > 0) == p.label_ids).mean())}


@pytest.mark.parametrize("keep_best_mask", [True, False])
def test_a_run_never_ends_worse_than_its_starting_mask(tmp_path, keep_best_mask):
    """gamma_base solves the task; training on flipped labels moves the mask away from it. With keep_best_mask the
    starting mask is a candidate, so the run returns it; without, the last (worse) mask."""
    task = _probe_task()
    correct = Dataset.from_dict({"x": task[2].tolist(), "labels": task[3].tolist()})
    trainer, start = planted_flipped_trainer(tmp_path, task, correct, _accuracy, keep_best_mask=keep_best_mask)
    model = trainer.model
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    if keep_best_mask:
        assert model.get_region() == start and after == before and trainer.mask_report["selected_step"] == 0
    else:
        assert model.get_region() != start and after < before


def test_keep_best_mask_selects_a_learned_mask_when_it_is_better(tmp_path):
    pre, finetuned, x, labels = _probe_task()
    config = GraftConfig(finetuned=finetuned, num_entries=4, learn_region=True)  # gamma_base: top-4 by noise
    model = get_peft_model(copy.deepcopy(pre), config)
    data = Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})
    args = fast_args(
        tmp_path, per_device_train_batch_size=512, max_steps=10, learning_rate=1e4, num_entries=4,
        remove_unused_columns=False, eval_strategy="steps", eval_steps=2, metric_for_best_model="accuracy",
    )  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, compute_metrics=_accuracy)
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    assert trainer.mask_report["selected_step"] > 0 and trainer.evaluate()["eval_accuracy"] > before
    assert model.get_region().num_entries == 4


def test_keep_best_mask_refuses_a_dict_of_evaluation_sets(tmp_path):
    """The Trainer evaluates a dict of sets under prefixes ``eval_<name>``: there is no one metric to select on, so
    the selection would silently keep nothing; it is refused instead."""
    task = _probe_task()
    data = Dataset.from_dict({"x": task[2].tolist(), "labels": task[3].tolist()})
    with pytest.raises(ValueError, match="keep_best_mask selects the mask on one evaluation set"):
        planted_flipped_trainer(tmp_path, task, {"dev": data, "ood": data}, _accuracy, keep_best_mask=True)
    planted_flipped_trainer(tmp_path, task, {"dev": data, "ood": data}, _accuracy, keep_best_mask=False)


# ------------------------------------------------------------------------------------------ gradient
def _reference_grafted(scores, movement, base, offsets, mode, gradients, pool, *thetas):
    """Eq. 4 with plain autograd ops (the dense formula the custom autograd Function replaces)."""
    gamma = torch.sigmoid(scores)
    gamma = gamma.index_put((base,), 1.0 - gamma[base])
    values = gamma * movement
    return tuple((t.float() + values[offsets[i] : offsets[i + 1]].view_as(t)).to(t.dtype) for i, t in enumerate(thetas))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["roberta_cls", "roberta_mlm", "gpt2"])
def test_score_gradient_matches_autograd_reference(arch, dtype, monkeypatch):
    _, model = learning_graft(arch, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # scores spread over sigmoid's range, so that both branches of Eq. 4 matter
        for layer in model.modules():
            if isinstance(layer, GraftLayer) and layer.is_learning("default"):
                s = layer.learner("default").scores
                s.copy_(torch.randn(s.shape, generator=generator) * 3)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    labels = torch.tensor([0, 1]) if arch == "roberta_cls" else ids

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n}

    ours = grads()
    monkeypatch.setattr(autograd.GraftedTensors, "apply", _reference_grafted)
    monkeypatch.setattr(graft_layer, "GRAFT_EMBEDDING_ROWS", False)  # embeddings through the reference too
    reference = grads()
    assert ours.keys() == reference.keys() and ours
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("search_fraction", [None, 0.3])
@pytest.mark.parametrize("arch", ["roberta_cls", "roberta_mlm", "gpt2", "llama"])
def test_embedding_lookups_graft_only_the_rows_a_batch_uses(arch, search_fraction, monkeypatch):
    """``GraftedRows`` (padding row, tied matrices, gamma_base flips) gives the whole-matrix values and gradients."""
    _, model = learning_graft(arch, num_entries=300, search_fraction=search_fraction)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, GraftLayer) and layer.is_learning("default"):
                layer.learner("default").scores.copy_(
                    torch.randn(layer.learner("default").scores.shape, generator=generator)
                )
    ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    ids[:, -2:] = model.config.pad_token_id or 0  # RoBERTa: the embeddings' padding_idx, whose row gets no gradient
    labels = torch.tensor([0, 1]) if arch == "roberta_cls" else ids
    calls = []
    apply = autograd.GraftedRows.apply
    monkeypatch.setattr(autograd.GraftedRows, "apply", lambda *a: calls.append(int(a[6].sum())) or apply(*a))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n and p.grad is not None}
        return out.logits.detach(), grads

    logits, grads = run()
    assert calls and sum(calls) > 0  # the embeddings took the row path, with gamma_base entries among their rows
    monkeypatch.setattr(graft_layer, "GRAFT_EMBEDDING_ROWS", False)
    reference_logits, reference = run()
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-6)
    assert grads.keys() == reference.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["roberta_cls", "llama", "bert_cls"])
def test_linear_layers_learn_a_search_space_with_sparse_products(arch, dtype, monkeypatch):
    """``SparseLinearDelta`` (weights and biases, gamma_base flips, a tied LM head) gives the values and gradients of
    the dense soft weights, and the linear layers never build a soft copy of their weight."""
    pre, finetuned, task_type = make_pair(arch)
    pre, finetuned = pre.to(dtype), finetuned.to(dtype)
    search = {"num_entries": 300, "learn_region": True, "search_fraction": 0.3, "task_type": task_type}
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, **search)).eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, GraftLayer) and layer.is_learning("default"):
                learner = layer.learner("default")
                learner.scores.copy_(torch.randn(learner.scores.shape, generator=generator))
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    labels = torch.tensor([0, 1]) if arch.endswith("_cls") else ids
    calls, copies = [], []
    monkeypatch.setattr(autograd.LinearPattern, "sparse_is_cheaper", lambda self, tokens: True)  # tiny layers: copy
    apply, search = autograd.SparseLinearDelta.apply, autograd.GraftedSearchSpace.apply
    monkeypatch.setattr(autograd.SparseLinearDelta, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    monkeypatch.setattr(autograd.GraftedSearchSpace, "apply", lambda *a: copies.append(a[-1].shape) or search(*a))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "graft_learning" in n and p.grad is not None}
        return out.logits.detach().float(), grads

    logits, grads = run()
    assert calls and any(p.bias_slice for p in calls) == (arch != "llama")
    assert all(len(shape) == 1 for shape in copies)  # only LayerNorm/RMSNorm vectors are still copied whole
    monkeypatch.setattr(graft_layer, "GRAFT_SPARSE_LINEAR", False)
    reference_logits, reference = run()
    assert grads.keys() == reference.keys() and grads
    if dtype == torch.float32:
        torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-9)
    else:  # bf16: the copy path rounds theta_pre + gamma * delta to bf16, the sparse path adds it in fp32
        torch.testing.assert_close(logits, reference_logits, rtol=0.05, atol=0.05)
        for name in grads:
            cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), reference[name].flatten(), dim=0)
            assert cosine > 0.98, (name, float(cosine))


def test_gradient_accumulation_gives_the_full_batch_step(tmp_path):
    data = cls_dataset(16)
    results = []
    for per_device in (16, 4):
        _, model = learning_graft(region="empty")
        args = fast_args(tmp_path, per_device_train_batch_size=per_device, max_steps=1, learning_rate=1e3)
        trainer = MaskTrainer(model=model, args=args, train_dataset=data)
        assert trainer.args.gradient_accumulation_steps == 16 // per_device
        assert args.gradient_accumulation_steps == 1  # the caller's args are left as they were (reusable)
        trainer.args.num_entries = None
        before = scores(model)
        trainer.train = Trainer.train.__get__(trainer)  # keep the soft state to compare S
        trainer.train()
        results.append({k: v - before[k] for k, v in scores(model).items()})
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-4, atol=1e-9)
    assert any(v.abs().max() > 0 for v in results[0].values())


# ------------------------------------------------------------------------------------------ hard mask and saving
def test_hard_mask_evaluation_equals_the_saved_graft(tmp_path):
    pre, model = learning_graft(region="empty")
    data = cls_dataset(16)
    args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=2, learning_rate=1e6)
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    layer = next(m for m in model.modules() if isinstance(m, GraftLayer) and m.is_learning("default"))
    with torch.no_grad():
        layer.learner("default").scores[:5] = 1.0  # 5 entries in round(gamma), the rest soft but far from 0.5
        layer.learner("default").scores[5:40] = -0.5
    predicted = trainer.predict(data).predictions
    trainer.save_model(str(tmp_path / "mid"))
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "mid").eval()
    assert loaded.get_region().num_entries == 5
    with torch.no_grad():
        expected = loaded(input_ids=torch.tensor(data["input_ids"])).logits
    torch.testing.assert_close(torch.as_tensor(predicted), expected)
    soft = trainer.model.eval()(input_ids=torch.tensor(data["input_ids"])).logits.detach()
    assert not torch.allclose(soft, expected)  # the soft gamma differs: evaluation really used the hard mask

    trainer.train()
    assert not any(isinstance(m, GraftLayer) and m.is_learning("default") for m in model.modules())
    trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final" / "graft_scores.safetensors").exists()  # only the sparse graft
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "final").eval()
    assert loaded.get_region() == model.get_region()
    torch.testing.assert_close(
        torch.as_tensor(trainer.predict(data).predictions),
        loaded(input_ids=torch.tensor(data["input_ids"])).logits.detach(),
    )


def test_exact_budget_logging_and_best_mask(tmp_path, caplog):
    _, model = learning_graft(region="movement", num_entries=20)
    data = cls_dataset(16)
    args = fast_args(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=4,
        learning_rate=1e6,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        select_on_train=True,
        metric_for_best_model="train_plus_eval_loss",
        num_entries=7,
    )
    trainer = MaskTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    with caplog.at_level(logging.INFO, logger="peft_graft.training.mask"):
        trainer.train()
    assert model.get_region().num_entries == 7
    assert trainer.mask_report["grafted_entries"] == 7 and trainer.mask_report["grafted_entries_rounded"] >= 1
    history = trainer.state.log_history
    train_logs = [h for h in history if "loss" in h]
    assert train_logs and all({"grafted_entries", "fraction_of_parameters"} <= h.keys() for h in train_logs)
    evals = [h for h in history if "eval_train_plus_eval_loss" in h]
    assert [h["step"] for h in evals] == [0, 2, 4]  # gamma_base, evaluated when training begins, then every 2 steps
    assert evals[0]["eval_grafted_entries"] == 20  # gamma_base whole; the budget of 7 applies to learned masks
    assert trainer.state.best_model_checkpoint is not None
    assert (tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors").exists()
    assert "Loading the best mask" in caplog.text
    assert "by round(gamma), 7 kept" in caplog.text


@pytest.mark.parametrize("search", [{}, {"search_entries": 30}], ids=["dense", "search_space"])
def test_resume_from_checkpoint_ends_with_the_same_mask(tmp_path, search):
    data = cls_dataset(16)

    def run(output_dir, max_steps, resume=None, search=search):
        _, model = learning_graft(region="empty", **search)
        args = fast_args(
            tmp_path,
            output_dir=str(output_dir),
            per_device_train_batch_size=4,
            mask_batch_size=8,
            max_steps=max_steps,
            learning_rate=1e9,
            save_strategy="steps",
            save_steps=2,
        )
        trainer = MaskTrainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return model.get_region(), trainer

    full, _ = run(tmp_path / "full", 4)
    run(tmp_path / "interrupted", 2)  # "interrupted" after step 2: its checkpoint-2 holds S
    resumed, trainer = run(tmp_path / "resumed", 4, resume=str(tmp_path / "interrupted" / "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert full.num_entries > 0 and resumed == full
    if search:  # scores of another search space do not fit
        with pytest.raises(ValueError, match="same GraftConfig"):
            run(
                tmp_path / "other",
                4,
                resume=str(tmp_path / "interrupted" / "checkpoint-2"),
                search={"search_entries": 31},
            )


# ------------------------------------------------------------------------------------------ heads
@pytest.mark.parametrize("arch", ["roberta_mlm", "gpt2"])
def test_language_model_heads_train(tmp_path, arch):
    _, model = learning_graft(arch, region="empty")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (8, 9), generator=g)
    labels = ids.clone()
    if arch == "roberta_mlm":  # prompt style: the loss on one (label word) position only
        labels[:, :-2] = -100
        labels[:, -1] = -100
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    args = fast_args(tmp_path, per_device_train_batch_size=4, max_steps=2, learning_rate=1e6, logging_steps=1)
    trainer = MaskTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert trainer.mask_report["grafted_entries"] == model.get_region().num_entries


def test_l1_penalty_shrinks_the_region(tmp_path):
    data = cls_dataset(16)
    sizes = []
    for penalty in (0.0, 1e-2):
        _, model = learning_graft(region="empty")
        args = fast_args(tmp_path, per_device_train_batch_size=8, max_steps=3, learning_rate=1e9, l1_penalty=penalty)
        trainer = MaskTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        sizes.append(trainer.mask_report["grafted_entries"])
    assert sizes[0] > 0 and sizes[1] < sizes[0]


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_gives_clear_errors(tmp_path):
    pre, model = learning_graft()
    data = cls_dataset(16)
    args = fast_args(tmp_path, max_steps=1)
    with pytest.raises(TypeError, match="needs a graft PeftModel"):
        MaskTrainer(model=pre, args=args, train_dataset=data)
    _, finetuned, _ = make_pair("roberta_cls")
    fixed = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=5, task_type="SEQ_CLS"))
    with pytest.raises(ValueError, match="no theta_ft attached"):
        MaskTrainer(model=fixed, args=args, train_dataset=data)
    with pytest.raises(TypeError, match="MaskTrainingArguments"):
        MaskTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=data)
    with pytest.raises(ValueError, match="num_entries=0"):
        fast_args(tmp_path, num_entries=0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        MaskTrainer(
            model=model,
            args=fast_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, mask_batch_size=8),
            train_dataset=data,
        )
    with pytest.raises(ValueError, match="does not support FSDP v1"):  # FSDP2 works: test_mask_trainer_fsdp.py
        MaskTrainer(model=model, args=fast_args(tmp_path, fsdp=True, fsdp_config={"version": 1}), train_dataset=data)
    unlabeled = Dataset.from_dict({"input_ids": data["input_ids"]})
    with pytest.raises(ValueError, match="no labels"):
        MaskTrainer(model=model, args=args, train_dataset=unlabeled).train()
    assert any(m.is_learning("default") for m in model.modules() if isinstance(m, GraftLayer))  # nothing lost


def test_uneven_global_batch_warns(tmp_path, caplog):
    _, model = learning_graft()
    with caplog.at_level(logging.WARNING, logger="peft_graft.training.mask"):
        args = fast_args(tmp_path, per_device_train_batch_size=4, max_steps=1)
        trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(10))
    assert "not a multiple" in caplog.text and trainer.args.gradient_accumulation_steps == 3
    _, model = learning_graft()
    assert MaskTrainer(model=model, args=args, train_dataset=cls_dataset(4)).args.gradient_accumulation_steps == 1


@pytest.mark.parametrize("mask_dropout", [False, True])
def test_mask_training_runs_with_dropout_off_by_default(tmp_path, mask_dropout):
    """With the default, a step equals the step of the same model with every dropout probability set to 0."""
    data = cls_dataset(16)
    learned = []
    for dropout in (0.1, 0.0):
        pre, finetuned, task_type = make_pair("roberta_cls")
        config = GraftConfig(finetuned=finetuned, num_entries=20, learn_region=True, task_type=task_type)
        model = get_peft_model(clone_model(pre), config)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
        args = fast_args(tmp_path, max_steps=1, learning_rate=1e3, mask_dropout=mask_dropout)
        trainer = MaskTrainer(model=model, args=args, train_dataset=data)
        trainer.train = Trainer.train.__get__(trainer)  # keep the soft state to compare S
        trainer.train()
        learned.append(scores(model))
    same = all(torch.equal(learned[0][name], learned[1][name]) for name in learned[0])
    assert same is not mask_dropout


def test_uniform_score_start_is_seeded_and_in_range():
    def start(**config):
        _, model = learning_graft(score_init=-10.0, **config)
        return scores(model)

    uniform = start(score_init_width=1.0)
    assert all(bool(((s >= -10.0) & (s < -9.0)).all()) and s.unique().numel() > 1 for s in uniform.values())
    again, other = start(score_init_width=1.0), start(score_init_width=1.0, seed=1)
    assert all(torch.equal(uniform[n], again[n]) for n in uniform)
    assert not all(torch.equal(uniform[n], other[n]) for n in uniform)
    assert all(bool((s == -10.0).all()) for s in start().values())  # the default: a constant start
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="score_init_width"):
            GraftConfig(score_init_width=bad)


# ------------------------------------------------------------------------------------------ bad runs
def test_non_finite_loss_or_learning_rate_stops_with_the_step_named(tmp_path):
    for rate in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
            fast_args(tmp_path, learning_rate=rate)
    _, model = learning_graft(region="empty")
    before = scores(model)
    calls = []

    def nan_on_second_step(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        loss = nn.functional.cross_entropy(outputs.logits, labels)
        return loss * float("nan") if len(calls) == 2 else loss

    args = fast_args(tmp_path, per_device_train_batch_size=8, mask_batch_size=8, max_steps=3, learning_rate=1e9)
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(8), compute_loss_func=nan_on_second_step)
    with pytest.raises(ValueError, match="Mask training step 2: the loss is nan"):
        trainer.train()
    after = scores(model)
    assert all(torch.isfinite(s).all() for s in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # step 1 ran; step 2 changed nothing


def test_resuming_from_another_runs_or_a_truncated_checkpoint_is_refused(tmp_path):
    data = cls_dataset(16)

    def run(output_dir, finetuned_seed=1, num_entries=None, resume=None):
        pre, _, task_type = make_pair("roberta_cls")
        finetuned = finetune_like(pre, seed=finetuned_seed)
        model = get_peft_model(
            clone_model(pre),
            GraftConfig(finetuned=finetuned, num_entries=20, learn_region=True, task_type=task_type),
        )
        args = fast_args(
            tmp_path, output_dir=str(output_dir), per_device_train_batch_size=8, mask_batch_size=8, max_steps=2,
            learning_rate=1e9, save_strategy="steps", save_steps=2, num_entries=num_entries,
        )  # fmt: skip
        MaskTrainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)

    run(tmp_path / "first")
    checkpoint = tmp_path / "first" / "checkpoint-2"
    with pytest.raises(ValueError, match="scores of another mask-training run"):
        run(tmp_path / "other_ft", finetuned_seed=5, resume=str(checkpoint))
    with pytest.raises(ValueError, match="scores of another mask-training run"):
        run(tmp_path / "other_budget", num_entries=10, resume=str(checkpoint))
    scores_file = checkpoint / "graft_scores.safetensors"
    scores_file.write_bytes(scores_file.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"graft_scores\.safetensors cannot be read"):
        run(tmp_path / "truncated", resume=str(checkpoint))


@pytest.mark.parametrize("search", [{}, {"search_entries": 200}])
def test_mask_training_over_a_bf16_model_keeps_fp32_scores_and_merges_to_theta_ft(tmp_path, search):
    """A bf16 base (issue 14): S is fp32, training runs (dense S or a search space), and the learned region merges
    into the bf16 model as theta_ft bit for bit."""
    check_bf16_mask_training(tmp_path, search)


@pytest.mark.parametrize("setting", [None, True, False])
def test_recompute_soft_parameters_reaches_every_graft_layer(setting, tmp_path):
    """``MaskTrainingArguments.recompute_soft_parameters``: None (off without FSDP2, see the FSDP tests), True or
    False, set on every graft layer; anything else is refused."""
    _, model = learning_graft()
    MaskTrainer(model=model, args=fast_args(tmp_path, recompute_soft_parameters=setting), train_dataset=cls_dataset())
    assert {layer.recompute_soft_parameters for layer in model.base_model.graft_layers().values()} == {bool(setting)}
    with pytest.raises(TypeError, match="recompute_soft_parameters must be True, False or None, got 'yes'"):
        fast_args(tmp_path, recompute_soft_parameters="yes")
