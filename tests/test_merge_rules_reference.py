"""WUDI and RegMean in merge_grafts against FusionBench's own code (``fusion-bench`` 0.2.33): its merged values on a
tiny BERT's task vectors, saved by ``tests/fixtures/make_merge_reference.py`` (run in an environment of its own, as
FusionBench is no dependency), with the inputs they came from. Our grafts of the same fine-tunes, merged by our rules,
must give the reference's values within float tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from safetensors import safe_open
from transformers import BertConfig, BertForSequenceClassification

from peft_graft import GraftConfig
from peft_graft.input_statistics import input_grams
from peft_graft.merge_rules import wudi_closed_form
from peft_graft.merging import merge_grafts

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "merge_reference.safetensors"
TASKS = ("t0", "t1", "t2")


@pytest.fixture(scope="module")
def reference() -> dict:
    with safe_open(str(FIXTURE), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (no __iter__)
        metadata = handle.metadata()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        group, _, name = key.partition("/")
        groups.setdefault(group, {})[name] = tensor
    return {"metadata": metadata, **groups}


@pytest.fixture(scope="module")
def grafted(reference):
    """One full graft per task (every entry its task vector moved), of the fixture's theta_pre and task vectors."""
    config = BertConfig(**json.loads(reference["metadata"]["config"]))
    pre = BertForSequenceClassification(config).eval()
    pre.load_state_dict(reference["pre"], strict=False)
    model = None
    for t, task in enumerate(TASKS):
        finetuned = {k: v + reference[f"tau{t}"].get(k, torch.zeros_like(v)) for k, v in reference["pre"].items()}
        graft = GraftConfig(finetuned=finetuned, sparsity=1.0, task_type="SEQ_CLS")
        if model is None:
            model = get_peft_model(pre, graft, adapter_name=task)
        else:
            model.add_adapter(task, graft)
    return model.eval()


def merged_task_vector(model, adapter: str) -> dict[str, torch.Tensor]:
    """The merged body's deltas per parameter name, dense (0 off its region)."""
    out = {}
    for module, layer in model.base_model.graft_layers().items():
        for attr in layer.stored_attrs:
            parameter = getattr(layer.base_layer, attr)
            dense = torch.zeros(parameter.numel())
            entries = layer.sparse_entries(adapter, attr) if layer.has_region(adapter) else None
            if entries is not None:
                dense[entries[0].long()] = entries[1].detach()
            out[f"{module}.{attr}"] = dense.reshape(parameter.shape)
    return out


def wudi_loss(merged: torch.Tensor, taus: torch.Tensor) -> float:
    taus, merged = taus.double(), merged.double()
    return float(sum(((merged - tau) @ tau.T).square().sum() / tau.square().sum() for tau in taus))


def test_the_fixture_covers_the_body(reference, grafted):
    names = set(merged_task_vector(grafted, "t0"))
    assert names == set(reference["tau0"]) == set(reference["wudi400"]) == set(reference["regmean"])
    assert reference["metadata"]["fusion_bench"] == "0.2.33"


def test_wudi_adam_gives_the_reference_values(reference, grafted):
    """The reference's iterative form (Adam, lr 1e-5, 400 steps from the sum) on every tensor: matrices optimised,
    LayerNorm and biases the mean of the task vectors. Tolerance 1e-7 absolute (7e-9 seen; the task vectors are ~1e-2
    and each Adam step moves an entry by up to 1e-5, so one step of another sign would show)."""
    merge_grafts(grafted, list(TASKS), "wudi_adam", "wudi_adam", wudi_steps=400)
    ours = merged_task_vector(grafted, "wudi_adam")
    for name, expected in reference["wudi400"].items():
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=1e-7, msg=name)
    grafted.delete_adapter("wudi_adam")


def test_wudi_closed_form_is_the_optimum_the_reference_settles_at(reference):
    """The closed form solves what the reference's Adam approaches. The reference has no closed form and a fixed
    learning rate (1e-5), so the fixture runs it 6,000 steps on two small matrices (task vectors ~1e-3) until it
    settles: its values agree with the closed form to 5e-6 absolute (3.5e-7 seen; the entries are ~1e-3), and its loss
    is never below the closed form's."""
    for name, settled in reference["wudi6000"].items():
        taus = torch.stack([reference[f"small{t}"][name] for t in range(3)])
        ours = wudi_closed_form(taus)
        torch.testing.assert_close(ours, settled, rtol=0, atol=5e-6, msg=name)
        assert wudi_loss(ours, taus) <= wudi_loss(settled, taus) * (1 + 1e-6)
        assert (ours - taus.sum(0)).abs().max() > 1e-4  # the optimum is away from the start: the steps mattered


def test_the_two_wudi_forms_differ_at_the_reference_s_own_steps(reference, grafted):
    """At the reference's 400 steps its matrices are still far from the optimum: the closed form ("wudi") gives
    another merge, of lower loss on every matrix; LayerNorm and biases are the mean in both."""
    merge_grafts(grafted, list(TASKS), "wudi", "wudi")
    ours = merged_task_vector(grafted, "wudi")
    far = 0
    for name, iterative in reference["wudi400"].items():
        taus = torch.stack([reference[f"tau{t}"][name] for t in range(3)])
        if iterative.dim() != 2:
            torch.testing.assert_close(ours[name], iterative, rtol=0, atol=1e-7, msg=name)
            continue
        torch.testing.assert_close(ours[name], wudi_closed_form(taus), rtol=1e-5, atol=1e-7)
        assert wudi_loss(ours[name], taus) <= wudi_loss(iterative, taus)
        far += bool((ours[name] - iterative).abs().max() > 1e-3)
    assert far > 0
    grafted.delete_adapter("wudi")


def test_regmean_with_our_grams_gives_the_reference_values(reference, grafted):
    """RegMean end to end: each task's Gram matrices collected by input_grams on its graft (10 examples asked, in
    batches of 4: 12 run, as the reference's loop stops), merged with alpha 0.6; linear weights by RegMean, every
    other tensor (embeddings, LayerNorm, biases) the mean. Tolerance 1e-6 absolute (8e-8 seen; the reference solves in
    fp32 on theta_ft, we on the task vectors)."""
    alpha, examples = float(reference["metadata"]["alpha"]), int(reference["metadata"]["examples"])
    grams = {}
    for t, task in enumerate(TASKS):
        inputs = reference[f"inputs{t}"]
        batches = [{k: v[i : i + 4] for k, v in inputs.items()} for i in range(0, len(inputs["input_ids"]), 4)]
        grafted.set_adapter(task)
        grams[task] = input_grams(grafted, batches, max_examples=examples)
    assert len(grams["t0"]) == 2 * 6 + 1  # q, k, v, attention output, intermediate, output per block, and the pooler
    merge_grafts(grafted, list(TASKS), "regmean", "regmean", grams=grams, regmean_alpha=alpha)
    ours = merged_task_vector(grafted, "regmean")
    for name, expected in reference["regmean"].items():
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=1e-6, msg=name)
    grafted.delete_adapter("regmean")
