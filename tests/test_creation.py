"""Creating a graft: what a learnable graft with a search space holds is what the simple algorithm gives (whole-tensor
deltas, one stable sort of every entry), and it reads theta_ft about as often as the top-k graft does."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from testing_utils import clone_model, make_pair

import peft_graft.scores.movement as movement_module
from peft_graft import GraftConfig, Region
from peft_graft.parameter_layout import build_layout
from peft_graft.regions import global_top_k, top_k_movement
from peft_graft.scores import eligible_tensors, exact_movement

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_delta(pre: torch.Tensor, finetuned: torch.Tensor) -> torch.Tensor:
    """The fp32 delta of every entry, the simple way: the rounded difference, stepped an ulp towards theta_ft while
    ``pre + delta`` misses it (at most 4 times), the rounded difference where no step reaches it."""
    base, target = pre.float(), finetuned.to(pre.dtype)
    rounded = delta = finetuned.float() - base
    for _ in range(4):
        applied = (base + delta).to(pre.dtype)
        wrong = applied != target
        direction = torch.where(applied < target, torch.inf, -torch.inf)
        delta = torch.where(wrong, torch.nextafter(delta, direction), delta)
    return torch.where((base + delta).to(pre.dtype) != target, rounded, delta)


def reference_top(movements: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """The ``k`` entries of largest ``|movement|`` by one stable sort of all of them (ties: earlier tensor, then lower
    index): tensor name -> sorted flat indices."""
    flat = torch.cat([m.abs() for m in movements.values()])
    top = torch.sort(flat, descending=True, stable=True).indices[:k]
    out, start = {}, 0
    for name, m in movements.items():
        mine = top[(top >= start) & (top < start + m.numel())] - start
        if mine.numel():
            out[name] = mine.sort().values
        start += m.numel()
    return out


def planted_pair():
    """A tiny Llama and a fine-tune whose largest movements tie across tensors and signs, with an entry no fp32 delta
    reproduces (a weight shrunk from 1000 to 1e-6)."""
    pre, finetuned, _ = make_pair("llama")
    with torch.no_grad():
        ties = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
        for i, name in enumerate(ties):
            pre_p, ft_p = pre.get_parameter(name).view(-1), finetuned.get_parameter(name).view(-1)
            pre_p[3 : 3 + 2 * i + 1] = 1.0
            ft_p[3 : 3 + 2 * i + 1] = 1.25 if i % 2 else 0.75
        name = "model.layers.1.self_attn.o_proj.weight"
        pre.get_parameter(name).view(-1)[7] = 1000.0
        finetuned.get_parameter(name).view(-1)[7] = 1e-6
    return pre, finetuned


def expected_learning(pre, finetuned, config: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Per module, ``(search indices, movement, gamma_base positions)`` of S, and gamma_base by tensor, computed the
    simple way."""
    layout = build_layout(pre)
    state = finetuned.state_dict()
    movements = {
        name: reference_delta(layout.tensors[name].parameter.detach(), state[name]).reshape(-1)
        for name in eligible_tensors(layout)
    }
    total = sum(m.numel() for m in movements.values())
    k = config.get("num_entries") or round(config["sparsity"] * total)
    size = config.get("search_entries") or round(config["search_fraction"] * total)
    region = reference_top(movements, k)
    search = reference_top(movements, size)
    out = {}
    for module, attrs in layout.stored.items():
        space, indices, base = layout.index_space(module), [], []
        for attr in attrs:
            name = layout.by_site[(module, attr)].name
            chosen = torch.cat([search.get(name, region.get(name, torch.empty(0))), region.get(name, torch.empty(0))])
            chosen = chosen.to(torch.int64).unique()
            indices.append(chosen + space.start(attr))
            base.append(region.get(name, torch.empty(0, dtype=torch.int64)) + space.start(attr))
        indices, base = torch.cat(indices), torch.cat(base)
        if indices.numel():
            flat = torch.cat([movements[layout.by_site[(module, a)].name] for a in attrs])
            out[module] = (indices, flat[indices], torch.searchsorted(indices, base))
    return out, region


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@pytest.mark.parametrize("source", ["model", "folder"])
@pytest.mark.parametrize(
    "search",
    [
        {"num_entries": 4, "search_fraction": 0.01},  # the region among the search space's entries
        {"num_entries": 40, "search_entries": 25},  # a search space smaller than the region
        {"sparsity": 1e-3, "search_fraction": 0.05},
    ],
)
def test_learnable_graft_holds_what_the_simple_algorithm_gives(tmp_path, source, search):
    pre, finetuned = planted_pair()
    if source == "folder":
        finetuned.save_pretrained(tmp_path / "ft")
    given = finetuned if source == "model" else str(tmp_path / "ft")
    config = dict(search, learn_region=True, score_init=-3.0, score_init_width=2.0, seed=5)
    model = get_peft_model(clone_model(pre), GraftConfig(finetuned=given, **config))
    expected, region = expected_learning(pre, finetuned, config)
    learners = model.base_model.region_learners("default")
    assert learners.keys() == expected.keys()
    for module, learner in learners.items():
        indices, movement, base = expected[module]
        assert torch.equal(learner.search_indices, indices), module
        assert torch.equal(bits(learner.movement), bits(movement)), module
        assert torch.equal(learner.base_region, base), module
        generator = torch.Generator().manual_seed(5 * 1_000_003 + zlib.crc32(module.encode()))
        scores = torch.full((indices.numel(),), -3.0).add_(torch.rand(indices.numel(), generator=generator), alpha=2.0)
        assert torch.equal(learner.scores.detach(), scores), module
    assert model.get_region() == Region(region)  # S starts at gamma_base
    hard = {k: v for k, v in search.items() if k in ("num_entries", "sparsity")}
    topk = get_peft_model(clone_model(pre), GraftConfig(finetuned=given, **hard))
    assert topk.get_region() == Region(region)  # the same gamma_base as the top-k graft of that size
    unreachable = "model.layers.1.self_attn.o_proj"
    if unreachable in learners:  # the shrunk weight's theta_ft is kept exactly
        assert torch.equal(learners[unreachable].unreachable[0], torch.tensor([7]))


def test_top_k_within_an_earlier_top_k_and_the_strided_sample_give_the_simple_top_k():
    pre, finetuned = planted_pair()
    layout = build_layout(pre)
    movement, _ = exact_movement(finetuned.state_dict(), layout, eligible_tensors(layout), only_moved=True)
    plain = {
        name: reference_delta(layout.tensors[name].parameter.detach(), finetuned.state_dict()[name])
        for name in movement
    }
    for k in (1, 3, 6, 50, 400):
        expected = Region(reference_top({n: m.reshape(-1) for n, m in plain.items()}, k))
        assert top_k_movement(movement, k) == expected
        assert top_k_movement(movement, k, within=top_k_movement(movement, 3 * k)) == expected
        assert top_k_movement(movement, k, within=top_k_movement(movement, k)) == expected
        assert top_k_movement(movement, k, within=top_k_movement(movement, max(1, k // 2))) == expected  # too small
        assert global_top_k(movement, k, key=torch.abs, sample_size=64) == expected  # sampled through gather
        assert global_top_k(plain, k, key=torch.abs, sample_size=64) == expected
        assert top_k_movement(plain, k, within=top_k_movement(plain, 2 * k)) == expected  # tensors, no gather


def counted_deltas(monkeypatch) -> list[int]:
    """Entries each call of ``exact_delta`` differences, recorded in the returned list."""
    counts, original = [], movement_module.exact_delta

    def counting(pre, finetuned):
        counts.append(pre.numel())
        return original(pre, finetuned)

    monkeypatch.setattr(movement_module, "exact_delta", counting)
    return counts


def test_movement_gather_differences_only_the_wanted_entries(monkeypatch):
    pre, finetuned = planted_pair()
    layout = build_layout(pre)
    movement, _ = exact_movement(finetuned.state_dict(), layout, eligible_tensors(layout), only_moved=True)
    name = "model.layers.0.mlp.up_proj.weight"
    wanted = torch.tensor([900, 5, 37, 1000])
    counts = counted_deltas(monkeypatch)
    expected = reference_delta(layout.tensors[name].parameter.detach(), finetuned.state_dict()[name]).reshape(-1)
    assert torch.equal(bits(movement.gather(name, wanted)), bits(expected[wanted]))
    assert torch.equal(bits(movement.gather(name, wanted[:2])), bits(expected[wanted[:2]]))
    assert sum(counts) == 4 + 2  # nothing kept unless asked (a strided sample would be kept for nothing)
    movement.keep_gathered = True
    counts.clear()
    assert torch.equal(bits(movement.gather(name, wanted)), bits(expected[wanted]))
    assert sum(counts) == 4
    for some in (torch.tensor([1000, 5, 5]), torch.tensor([], dtype=torch.int64)):  # among the last gather's
        assert torch.equal(bits(movement.gather(name, some)), bits(expected[some]))
    assert sum(counts) == 4
    again = torch.tensor([5, 6])  # 6 is new: both are differenced, and the next gather starts from them
    assert torch.equal(bits(movement.gather(name, again)), bits(expected[again]))
    assert torch.equal(bits(movement.gather(name, torch.tensor([6]))), bits(expected[[6]]))
    assert sum(counts) == 6


def test_learnable_graft_differences_theta_ft_about_as_often_as_the_top_k_graft(monkeypatch):
    """Both pass over every entry twice (the exactness check, the top-k); the learnable graft differences its search
    space's entries once more (their values), and nothing else: no pass for the region among them, nor for the
    values of the region and of S."""
    pre, finetuned = planted_pair()
    counts = counted_deltas(monkeypatch)
    get_peft_model(clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=10))
    top_k = sum(counts)
    counts.clear()
    config = GraftConfig(finetuned=finetuned, num_entries=10, learn_region=True, search_entries=300)
    get_peft_model(clone_model(pre), config)
    assert top_k < sum(counts) <= top_k + 300


def test_creation_benchmark_pairs_the_two_creations(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_creation

    row = bench_creation.measure("llama-0.4m", 3, str(tmp_path))
    assert [len(row["times_s"][v]) for v in ("topk", "learnable")] == [3, 3]
    ratios = sorted(a / b for a, b in zip(row["times_s"]["learnable"], row["times_s"]["topk"], strict=True))
    assert row["learnable_over_topk"] == round(ratios[1], 3)  # the median of the paired ratios
    assert "| llama-0.4m | 0.4M |" in bench_creation.markdown([row])[2]
