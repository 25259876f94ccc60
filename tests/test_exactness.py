"""Grafts reproduce theta_ft bit for bit on every grafted entry: apply, merge, unmerge, save/load, harden, combine.

theta_ft comes from a real few-step AdamW fine-tune (whose fp32 deltas miss the target by an ulp in a few percent of
entries when rounded naively) plus entries that fine-tuning shrank towards 0 (no fp32 delta reproduces those at all),
on fp32, bf16 and fp16 bases.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import clone_model, input_ids, make_llama

from peft_graft import GraftConfig, GraftLayer
from peft_graft.scores import exact_delta

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHRUNK = 50  # entries of the first MLP matrix that fine-tuning shrinks to a thousandth


def adamw_finetune(pre: torch.nn.Module, steps: int = 3) -> torch.nn.Module:
    """A copy of ``pre`` after ``steps`` real AdamW steps of its language-modelling loss, then with ``SHRUNK`` entries
    shrunk (``w_ft = w_pre * 1e-3``), one set to 0 and one sign-flipped."""
    finetuned = clone_model(pre).train()
    optimizer = torch.optim.AdamW(finetuned.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        ids = input_ids(4, 12, seed=step)
        finetuned(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        weight = finetuned.model.layers[0].mlp.up_proj.weight.view(-1)
        weight[:SHRUNK] = pre.model.layers[0].mlp.up_proj.weight.view(-1)[:SHRUNK] * 1e-3
        weight[SHRUNK] = 0.0
        weight[SHRUNK + 1] = -weight[SHRUNK + 1] * 0.5
    return finetuned.eval()


def pair(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    pre = make_llama().eval()
    finetuned = adamw_finetune(pre)
    return pre.to(dtype), finetuned.to(dtype)


def grafted_entries(model: PeftModel, adapter: str = "default"):
    """``(tensor name, flat indices)`` of every grafted entry, by the base model's parameter names."""
    return [(name, indices) for name, indices in model.get_region(adapter).items() if indices.numel()]


def applied_parameters(model: PeftModel) -> dict[str, torch.Tensor]:
    """The parameters an unmerged forward uses, by base-model parameter name."""
    out = {}
    for module_name, layer in model.base_model.graft_layers().items():
        for attr, value in layer.effective_parameters(layer.active_adapters).items():
            out[f"{module_name}.{attr}" if module_name else attr] = value.detach()
    return out


def assert_exact(values: dict[str, torch.Tensor], reference: torch.nn.Module, region, what: str) -> None:
    for name, indices in region:
        got = values[name].reshape(-1)[indices.to(torch.int64)]
        want = reference.get_parameter(name).detach().reshape(-1)[indices.to(torch.int64)]
        bad = (
            got.view(torch.int16 if got.element_size() == 2 else torch.int32)
            != want.view(torch.int16 if want.element_size() == 2 else torch.int32)
        ).sum()
        assert bad == 0, f"{what}: {int(bad)} of {indices.numel()} entries of {name} differ from theta_ft"


def base_values(model: PeftModel) -> dict[str, torch.Tensor]:
    base = model.get_base_model()
    names = {n.replace(".base_layer", "") for n, _ in base.named_parameters() if "graft_" not in n}
    return {n: base.get_parameter(_wrapped(base, n)).detach().clone() for n in names if _wrapped(base, n)}


def _wrapped(base: torch.nn.Module, name: str) -> str | None:
    module, _, attr = name.rpartition(".")
    try:
        owner = base.get_submodule(module)
    except AttributeError:
        return None
    if isinstance(owner, GraftLayer):
        return f"{module}.base_layer.{attr}"
    return name if hasattr(owner, attr) else None


def test_naive_fp32_deltas_miss_and_exact_delta_reports_what_cannot_be_reached():
    pre, finetuned = pair(torch.float32)
    w_pre = pre.model.layers[0].mlp.up_proj.weight.detach()
    w_ft = finetuned.model.layers[0].mlp.up_proj.weight.detach()
    naive = (w_pre + (w_ft - w_pre)) != w_ft
    assert naive.view(-1)[:SHRUNK].sum() > SHRUNK // 2  # the premise: rounding in fp32 misses most shrunk entries
    delta, unreachable = exact_delta(w_pre, w_ft)
    reached = (w_pre + delta) == w_ft
    assert torch.equal(reached, ~unreachable)
    assert unreachable.view(-1)[:SHRUNK].all() and not unreachable.all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_merge_unmerge_reproduce_theta_ft_on_every_grafted_entry(dtype, tmp_path):
    pre, finetuned = pair(dtype)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.2)).eval()
    region = grafted_entries(model)
    config = model.peft_config["default"]
    if dtype == torch.float32:
        assert config.exact_entries, "the shrunk entries need theta_ft stored exactly"
        stored = sum(config.exact_entries.values())
        assert stored < 0.1 * sum(config.grafted_modules.values())  # the others take 8 bytes an entry
    pre_values = base_values(model)

    assert_exact(applied_parameters(model), finetuned, region, "unmerged forward")
    model.merge_adapter()
    assert_exact(base_values(model), finetuned, region, "merge_adapter")
    model.unmerge_adapter()
    for name, value in base_values(model).items():
        assert torch.equal(value, pre_values[name]), f"unmerge changed {name}"

    model.save_pretrained(tmp_path / "graft")
    loaded = PeftModel.from_pretrained(clone_model(pre), tmp_path / "graft").eval()
    assert grafted_entries(loaded)[0][1].numel() and len(grafted_entries(loaded)) == len(region)
    assert_exact(applied_parameters(loaded), finetuned, region, "loaded graft")
    merged = loaded.merge_and_unload()
    assert_exact({n: p.detach() for n, p in merged.named_parameters()}, finetuned, region, "merge_and_unload")
    with torch.no_grad():
        assert torch.equal(merged(input_ids()).logits, model(input_ids()).logits)


def test_whole_graft_merges_to_exactly_theta_ft():
    pre, finetuned = pair(torch.float32)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=1.0))
    merged = model.merge_and_unload()
    for name, value in finetuned.state_dict().items():
        assert torch.equal(merged.state_dict()[name], value), name


def test_hardened_learned_region_and_combined_adapter_are_exact():
    pre, finetuned = pair(torch.float32)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=400, learn_region=True))
    model.base_model.harden_region(num_entries=400)
    region = grafted_entries(model)
    assert sum(model.peft_config["default"].exact_entries.values()) > 0
    assert_exact(applied_parameters(model), finetuned, region, "hardened region")

    other = get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, sparsity=0.05))
    other.add_adapter("b", GraftConfig(finetuned=finetuned, num_entries=300, region="random", seed=3))
    other.base_model.add_combined_adapter(["default", "b"], "union", combination="first")
    other.set_adapter("union")
    assert_exact(applied_parameters(other), finetuned, grafted_entries(other, "union"), "combined adapter")
