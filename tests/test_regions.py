"""Region selection is exact to the budget with deterministic ties, whatever path the selection takes."""

from __future__ import annotations

import pytest
import torch

from peft_graft import Region, global_top_k, random_region


def brute_force(tensors: dict[str, torch.Tensor], k: int, key=lambda t: t) -> Region:
    """Top-k with a full stable sort: ties to the earliest tensor, then the lowest index."""
    flat = torch.cat([key(t).reshape(-1) for t in tensors.values()])
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    region, start = {}, 0
    for name, tensor in tensors.items():
        region[name] = order[(order >= start) & (order < start + tensor.numel())] - start
        start += tensor.numel()
    return Region(region)


def tensors_with_ties(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Values on a coarse grid: many exact ties, and negative values.
    return {
        "a.weight": torch.randint(-50, 50, (300, 70), generator=generator).float() / 10,
        "a.bias": torch.randint(-50, 50, (70,), generator=generator).float() / 10,
        "b.weight": torch.randint(-50, 50, (40000,), generator=generator).float() / 10,
    }


@pytest.mark.parametrize("k", [1, 17, 500, 3000, 61_000])
@pytest.mark.parametrize("sample_size", [1 << 20, 256])  # exhaustive path, and the sampled-bound path
@pytest.mark.parametrize("key", [None, torch.abs])
def test_global_top_k_is_exact_with_ties(k, sample_size, key):
    tensors = tensors_with_ties()
    region = global_top_k(tensors, k, key=key, sample_size=sample_size)
    assert region.num_entries == k
    assert region == brute_force(tensors, k, key or (lambda t: t))


@pytest.mark.parametrize("sample_size", [1 << 20, 16])
def test_global_top_k_keeps_the_scores_dtype(sample_size):
    """Scores closer than float32 resolution (float64, or int64 above 2**24) keep their order: collected in float32,
    they would tie and the earliest would win."""
    near = torch.tensor([1.0, 1.0 + 1e-12, 0.5] * 30, dtype=torch.float64)
    ints = torch.tensor([2**25, 2**25 + 1, 3] * 30, dtype=torch.int64)
    for tensors in ({"w": near}, {"w": ints}, {"a": torch.zeros(5), "w": near}):
        for k in (1, 30, 31):
            assert global_top_k(tensors, k, sample_size=sample_size) == brute_force(tensors, k)
    assert global_top_k({"w": -near}, 1, key=torch.abs)["w"].tolist() == [1]


class Pieced(dict):
    """Tensors handed over in pieces of 777 entries (as ``scores.movement.Movement`` hands a checkpoint's), with
    sizes known without reading them; a whole tensor is never looked up."""

    def __getitem__(self, name):
        raise AssertionError("looked up a whole tensor")

    def numel(self, name: str) -> int:
        return dict.__getitem__(self, name).numel()

    def pieces(self, name: str):
        flat = dict.__getitem__(self, name).reshape(-1)
        for start in range(0, flat.numel(), 777):
            yield start, flat[start : start + 777]


@pytest.mark.parametrize("k", [1, 500, 61_000])
@pytest.mark.parametrize("sample_size", [1 << 20, 256])
def test_global_top_k_over_pieces_equals_over_whole_tensors(k, sample_size):
    tensors = tensors_with_ties()
    region = global_top_k(Pieced(tensors), k, key=torch.abs, sample_size=sample_size)
    assert region == brute_force(tensors, k, torch.abs)


def test_global_top_k_falls_back_when_the_sample_bound_is_too_high():
    # One huge outlier tensor region: the sample almost never sees the few large values of "spikes".
    tensors = {"flat": torch.zeros(100_000), "spikes": torch.zeros(1000)}
    tensors["spikes"][::10] = 1.0
    region = global_top_k(tensors, 150, sample_size=64)
    assert region == brute_force(tensors, 150)


def test_global_top_k_retries_with_a_lower_bound_when_the_sample_overestimates(monkeypatch):
    """Every sampled entry (flat index 0 mod the stride) is large and the rest small: the sample's bound collects
    only those, fewer than k, so a second pass with a lower bound runs, and the result is still exact."""
    import peft_graft.regions.selection as selection

    values = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) / 2
    stride = (values.numel() // 64) | 1
    values[::stride] = 1.0
    passes = []
    collect = selection._entries_at_least
    monkeypatch.setattr(selection, "_entries_at_least", lambda *a: passes.append(a[2]) or collect(*a))
    region = global_top_k({"w": values}, 1000, sample_size=64)
    assert len(passes) == 2 and passes[0] == 1.0
    assert region == brute_force({"w": values}, 1000)


def test_global_top_k_bad_budget():
    tensors = {"w": torch.ones(10)}
    with pytest.raises(ValueError, match="at least 1"):
        global_top_k(tensors, 0)
    with pytest.raises(ValueError, match="exceeds the 10 eligible entries"):
        global_top_k(tensors, 11)
    with pytest.raises(ValueError, match="not NaN"):
        global_top_k({"w": torch.full((10,), torch.nan)}, 3)


def test_random_region_is_exact_seeded_and_uniform():
    sizes = {"a": 1000, "b": 10, "c": 5000}
    first, again, other = (random_region(sizes, 600, seed) for seed in (3, 3, 4))
    assert first == again and first != other
    assert first.num_entries == 600
    assert all(int(first[n].max()) < sizes[n] for n in first)
    counts = torch.tensor([first[n].numel() if n in first else 0 for n in sizes], dtype=torch.float)
    expected = torch.tensor(list(sizes.values()), dtype=torch.float) * 600 / 6010
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 2)
    with pytest.raises(ValueError, match=r"must lie in \[1, 6010\]"):
        random_region(sizes, 6011, 0)


def test_region_construction_and_masks():
    region = Region({"w": torch.tensor([5, 1, 5, 3])})
    assert region["w"].tolist() == [1, 3, 5]
    masks = region.to_masks({"w": torch.Size([2, 4]), "v": torch.Size([3])})
    assert masks["w"].reshape(-1).nonzero().reshape(-1).tolist() == [1, 3, 5] and not masks["v"].any()
    assert Region.from_masks(masks) == region
    with pytest.raises(TypeError, match="must be integers"):
        Region({"w": torch.tensor([0.5])})
    with pytest.raises(ValueError, match="non-negative"):
        Region({"w": torch.tensor([-1, 2])})
    with pytest.raises(TypeError, match="must be a bool tensor"):
        Region.from_masks({"w": torch.ones(3)})


def test_region_algebra_on_disjoint_and_empty_regions():
    a = Region({"x": torch.tensor([0, 1, 2]), "y": torch.tensor([4])})
    b = Region({"x": torch.tensor([2, 3])})
    assert (a | b) == Region({"x": torch.arange(4), "y": torch.tensor([4])})
    assert (a & b) == Region({"x": torch.tensor([2])})
    assert (a - b) == Region({"x": torch.tensor([0, 1]), "y": torch.tensor([4])})
    assert a.overlap(b) == 1 / 2 and b.overlap(a) == 1 / 4
    assert a.iou(b) == 1 / 5
    empty = Region()
    assert (a & empty).num_entries == 0 and a.overlap(empty) == 0.0 and empty.iou(empty) == 0.0
