"""Property-based tests of the Region set algebra (union, intersection, difference, sizes, overlap, masks).

Regions are drawn over a few parameter names with flat indices in a small range, so that random regions overlap
often; the raw input given to the constructor may be unsorted, contain duplicates, use any integer dtype, and name
parameters with no entries. Every result is checked against a plain Python model: a set of ``(name, index)`` pairs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peft_graft import Region

NAMES = ("a.weight", "b.bias", "c")
SIZE = 8  # indices lie in range(SIZE): every name's tensor has SIZE entries
SHAPES = {"a.weight": torch.Size([2, 4]), "b.bias": torch.Size([SIZE]), "c": torch.Size([2, 2, 2])}
UNIVERSE = Region({name: torch.arange(SIZE) for name in NAMES})
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)

FAST = settings(max_examples=100, deadline=None)

# -- strategies ------------------------------------------------------------------------------------------------------

# name -> list of indices, possibly empty, unsorted and with duplicates; any subset of the names.
raw_indices = st.dictionaries(
    st.sampled_from(NAMES), st.lists(st.integers(0, SIZE - 1), max_size=2 * SIZE), max_size=len(NAMES)
)


def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


@st.composite
def raw_tensors(draw) -> dict[str, torch.Tensor]:
    """Constructor input: tensors of any integer dtype (a name may map to an empty tensor)."""
    return {name: as_tensor(values, draw(st.sampled_from(INT_DTYPES))) for name, values in draw(raw_indices).items()}


regions = raw_tensors().map(Region)
nonempty_regions = regions.filter(lambda r: r.num_entries > 0)


def model(region: Region) -> set[tuple[str, int]]:
    """The region as a plain set of ``(name, flat index)`` entries."""
    return {(name, i) for name, idx in region.items() for i in idx.tolist()}


def raw_model(raw: dict[str, torch.Tensor]) -> set[tuple[str, int]]:
    return {(name, i) for name, idx in raw.items() for i in idx.tolist()}


def assert_canonical(region: Region) -> None:
    """Every entry is a non-empty, 1-D, sorted, unique, non-negative int64 CPU tensor."""
    assert isinstance(region, Region)
    assert len(region) == len(list(region)) == len(region.keys())
    for name, idx in region.items():
        assert name in region
        assert isinstance(idx, torch.Tensor)
        assert idx.dtype == torch.int64
        assert idx.dim() == 1
        assert idx.device.type == "cpu"
        assert idx.numel() > 0, f"{name!r} is present with no entries"
        assert bool((idx[1:] > idx[:-1]).all()), f"{name!r} indices are not strictly increasing: {idx}"
        assert int(idx[0]) >= 0
    assert region.num_entries == sum(int(idx.numel()) for idx in region.values())


def snapshot(region: Region) -> dict[str, torch.Tensor]:
    return {name: idx.clone() for name, idx in region.items()}


# -- construction and canonical form ---------------------------------------------------------------------------------


@FAST
@given(raw_tensors())
def test_constructor_is_canonical_and_keeps_exactly_the_given_entries(raw):
    region = Region(raw)
    assert_canonical(region)
    assert model(region) == raw_model(raw)
    # A name with no entries is absent.
    assert set(region) == {name for name, idx in raw.items() if idx.numel()}


@FAST
@given(raw_indices, st.data(), st.sampled_from(INT_DTYPES), st.sampled_from(INT_DTYPES))
def test_equality_is_independent_of_order_duplicates_dtype_and_name_order(raw, data, dtype1, dtype2):
    canonical = {name: sorted(set(values)) for name, values in raw.items()}
    shuffled = {}
    for name in data.draw(st.permutations(list(raw))):  # another name order
        values = raw[name]
        if values:  # extra duplicates, then another index order
            values = values + data.draw(st.lists(st.sampled_from(values), max_size=SIZE))
        shuffled[name] = data.draw(st.permutations(values))
    a = Region({n: as_tensor(v, dtype1) for n, v in canonical.items()})
    b = Region({n: as_tensor(v, dtype2) for n, v in shuffled.items()})
    assert a == b
    assert b == a
    assert (a != b) is False


@FAST
@given(regions, regions)
def test_equality_matches_set_equality(a, b):
    assert (a == b) == (model(a) == model(b))
    assert (a != b) == (model(a) != model(b))
    assert a == a


@FAST
@given(raw_tensors())
def test_region_does_not_alias_its_input(raw):
    region = Region(raw)
    before = snapshot(region)
    for idx in raw.values():
        if idx.numel():
            idx.fill_(0)
    raw.clear()
    assert region == Region(before)


# -- the algebra agrees with Python sets and yields canonical regions ------------------------------------------------


@FAST
@given(regions, regions)
def test_operations_match_the_set_model_and_are_canonical(a, b):
    ma, mb = model(a), model(b)
    for result, expected in ((a | b, ma | mb), (a & b, ma & mb), (a - b, ma - mb), (b - a, mb - ma)):
        assert_canonical(result)
        assert model(result) == expected
    assert a.union(b) == a | b
    assert a.intersection(b) == a & b
    assert a.difference(b) == a - b


@FAST
@given(regions, regions)
def test_operations_do_not_mutate_their_operands(a, b):
    sa, sb = snapshot(a), snapshot(b)
    _ = (a | b, a & b, a - b, b - a, a.overlap(b), a.iou(b))
    assert a == Region(sa)
    assert b == Region(sb)
    assert set(a) == set(sa) and set(b) == set(sb)


# -- lattice laws ----------------------------------------------------------------------------------------------------


@FAST
@given(regions, regions)
def test_union_is_commutative(a, b):
    assert a | b == b | a


@FAST
@given(regions, regions)
def test_intersection_is_commutative(a, b):
    assert a & b == b & a


@FAST
@given(regions, regions, regions)
def test_union_is_associative(a, b, c):
    assert (a | b) | c == a | (b | c)


@FAST
@given(regions, regions, regions)
def test_intersection_is_associative(a, b, c):
    assert (a & b) & c == a & (b & c)


@FAST
@given(regions)
def test_idempotence(r):
    assert r | r == r
    assert r & r == r


@FAST
@given(regions, regions)
def test_absorption(a, b):
    assert a | (a & b) == a
    assert a & (a | b) == a


@FAST
@given(regions, regions, regions)
def test_intersection_distributes_over_union(a, b, c):
    assert a & (b | c) == (a & b) | (a & c)


@FAST
@given(regions, regions, regions)
def test_union_distributes_over_intersection(a, b, c):
    assert a | (b & c) == (a | b) & (a | c)


@FAST
@given(regions)
def test_empty_region_is_identity_for_union_and_annihilator_for_intersection(r):
    empty = Region()
    assert r | empty == r == empty | r
    assert r & empty == empty == empty & r
    assert r - empty == r
    assert empty - r == empty


@FAST
@given(regions)
def test_universe_is_identity_for_intersection_and_absorbing_for_union(r):
    assert r & UNIVERSE == r
    assert r | UNIVERSE == UNIVERSE


# -- De Morgan relative to a universe --------------------------------------------------------------------------------


@FAST
@given(regions, regions)
def test_de_morgan_complement_of_union(a, b):
    assert UNIVERSE - (a | b) == (UNIVERSE - a) & (UNIVERSE - b)


@FAST
@given(regions, regions)
def test_de_morgan_complement_of_intersection(a, b):
    assert UNIVERSE - (a & b) == (UNIVERSE - a) | (UNIVERSE - b)


@FAST
@given(regions)
def test_complement_is_an_involution_and_partitions_the_universe(r):
    complement = UNIVERSE - r
    assert UNIVERSE - complement == r
    assert (r & complement).num_entries == 0
    assert r | complement == UNIVERSE


# -- difference laws -------------------------------------------------------------------------------------------------


@FAST
@given(regions, regions)
def test_difference_is_disjoint_from_subtrahend(a, b):
    assert (a - b) & b == Region()
    assert ((a - b) & b).num_entries == 0
    assert len((a - b) & b) == 0


@FAST
@given(regions, regions)
def test_difference_and_intersection_partition_the_minuend(a, b):
    assert (a - b) | (a & b) == a
    assert ((a - b) & (a & b)).num_entries == 0
    assert (a - b).num_entries + (a & b).num_entries == a.num_entries


@FAST
@given(regions, regions)
def test_difference_laws(a, b):
    assert a - a == Region()
    assert a - b == a - (a & b)
    assert (a - b) - b == a - b
    assert (a | b) - b == a - b
    assert a - (a - b) == a & b


@FAST
@given(regions, regions, regions)
def test_difference_de_morgan_within_a(a, b, c):
    assert a - (b | c) == (a - b) & (a - c)
    assert a - (b & c) == (a - b) | (a - c)


# -- sizes, overlap and IoU ------------------------------------------------------------------------------------------


@FAST
@given(regions, regions)
def test_num_entries_inclusion_exclusion(a, b):
    assert (a | b).num_entries == a.num_entries + b.num_entries - (a & b).num_entries


@FAST
@given(regions, regions)
def test_sizes_are_monotone(a, b):
    assert (a & b).num_entries <= min(a.num_entries, b.num_entries)
    assert (a | b).num_entries >= max(a.num_entries, b.num_entries)
    assert (a - b).num_entries <= a.num_entries


@FAST
@given(regions, regions)
def test_overlap_and_iou_lie_in_unit_interval(a, b):
    for value in (a.overlap(b), b.overlap(a), a.iou(b), b.iou(a)):
        assert isinstance(value, float)
        assert 0.0 <= value <= 1.0


@FAST
@given(regions, regions)
def test_overlap_and_iou_match_their_definitions(a, b):
    inter, union = len(model(a) & model(b)), len(model(a) | model(b))
    assert a.overlap(b) == pytest.approx(inter / b.num_entries if b.num_entries else 0.0)
    assert a.iou(b) == pytest.approx(inter / union if union else 0.0)


@FAST
@given(regions, regions)
def test_iou_is_symmetric(a, b):
    assert a.iou(b) == b.iou(a)


@FAST
@given(nonempty_regions)
def test_self_overlap_and_self_iou_are_one(r):
    assert r.iou(r) == 1.0
    assert r.overlap(r) == 1.0


@FAST
@given(regions, regions)
def test_overlap_is_one_exactly_for_a_covered_non_empty_region(a, b):
    # overlap(a, b) = |a & b| / |b| is 1 iff b is non-empty and contained in a.
    assert (a.overlap(b) == 1.0) == (b.num_entries > 0 and b - a == Region())
    assert (a.iou(b) == 1.0) == (a.num_entries > 0 and a == b)
    assert (a.iou(b) == 0.0) == ((a & b).num_entries == 0)


@FAST
@given(regions)
def test_overlap_and_iou_with_empty_region_are_zero(r):
    empty = Region()
    assert r.overlap(empty) == 0.0
    assert empty.overlap(r) == 0.0
    assert r.iou(empty) == 0.0
    assert empty.iou(r) == 0.0


# -- masks -----------------------------------------------------------------------------------------------------------


@FAST
@given(regions)
def test_round_trip_through_masks(r):
    masks = r.to_masks(SHAPES)
    assert set(masks) == set(SHAPES)
    for name, mask in masks.items():
        assert mask.dtype == torch.bool
        assert mask.shape == SHAPES[name]
        assert int(mask.sum()) == (r[name].numel() if name in r else 0)
    back = Region.from_masks(masks)
    assert_canonical(back)
    assert back == r


@FAST
@given(st.dictionaries(st.sampled_from(NAMES), st.lists(st.booleans(), min_size=SIZE, max_size=SIZE)))
def test_masks_round_trip_through_region(bits):
    masks = {name: torch.tensor(values, dtype=torch.bool).reshape(SHAPES[name]) for name, values in bits.items()}
    region = Region.from_masks(masks)
    assert_canonical(region)
    assert region.num_entries == sum(int(m.sum()) for m in masks.values())
    assert set(region) == {name for name, m in masks.items() if bool(m.any())}  # all-False masks are absent
    back = region.to_masks({name: SHAPES[name] for name in masks})
    assert set(back) == set(masks)
    for name, mask in masks.items():
        assert torch.equal(back[name], mask)


@FAST
@given(regions, regions)
def test_mask_algebra_matches_region_algebra(a, b):
    ma, mb = a.to_masks(SHAPES), b.to_masks(SHAPES)
    assert Region.from_masks({n: ma[n] | mb[n] for n in SHAPES}) == a | b
    assert Region.from_masks({n: ma[n] & mb[n] for n in SHAPES}) == a & b
    assert Region.from_masks({n: ma[n] & ~mb[n] for n in SHAPES}) == a - b


# -- example-based edge cases ----------------------------------------------------------------------------------------


def test_empty_region_algebra():
    empty = Region()
    assert empty == Region({}) == Region(None)
    assert len(empty) == 0 and list(empty) == [] and empty.num_entries == 0
    for result in (empty | empty, empty & empty, empty - empty):
        assert result == empty
        assert len(result) == 0
    assert empty.overlap(empty) == 0.0
    assert empty.iou(empty) == 0.0
    assert empty.to_masks({"a.weight": torch.Size([2, 3])})["a.weight"].sum() == 0
    assert Region.from_masks({}) == empty


def test_names_with_no_entries_are_absent():
    r = Region({"a.weight": torch.empty(0, dtype=torch.int64), "b.bias": torch.tensor([3, 1, 3])})
    assert "a.weight" not in r
    assert list(r) == ["b.bias"]
    assert r == Region({"b.bias": torch.tensor([1, 3])})
    with pytest.raises(KeyError):
        r["a.weight"]
    assert Region({"a.weight": torch.empty(0, dtype=torch.int32)}) == Region()
    assert Region.from_masks({"c": torch.zeros(2, 2, dtype=torch.bool)}) == Region()


def test_names_present_in_only_one_side():
    a = Region({"a.weight": torch.tensor([0, 2, 5]), "c": torch.tensor([1])})
    b = Region({"b.bias": torch.tensor([4]), "c": torch.tensor([1, 7])})

    union = a | b
    assert set(union) == {"a.weight", "b.bias", "c"}
    assert union["a.weight"].tolist() == [0, 2, 5]
    assert union["b.bias"].tolist() == [4]
    assert union["c"].tolist() == [1, 7]

    inter = a & b
    assert set(inter) == {"c"}  # names on one side only vanish
    assert inter["c"].tolist() == [1]

    diff = a - b
    assert set(diff) == {"a.weight"}  # "c" is emptied, so absent
    assert diff["a.weight"].tolist() == [0, 2, 5]
    assert set(b - a) == {"b.bias", "c"}
    assert (b - a)["c"].tolist() == [7]

    assert a.overlap(b) == pytest.approx(1 / 3)
    assert b.overlap(a) == pytest.approx(1 / 4)
    assert a.iou(b) == b.iou(a) == pytest.approx(1 / 6)


def test_disjoint_names_have_no_overlap():
    a = Region({"a.weight": torch.tensor([0, 1])})
    b = Region({"b.bias": torch.tensor([0, 1])})
    assert a != b
    assert (a & b) == Region()
    assert a - b == a and b - a == b
    assert (a | b).num_entries == 4
    assert a.overlap(b) == 0.0 and a.iou(b) == 0.0


def test_results_are_int64_for_narrow_input_dtypes():
    a = Region({"c": torch.tensor([7, 1, 1], dtype=torch.uint8)})
    b = Region({"c": torch.tensor([1, 3], dtype=torch.int16)})
    for result in (a, b, a | b, a & b, a - b):
        assert_canonical(result)
    assert (a | b)["c"].tolist() == [1, 3, 7]
    assert math.isclose(a.iou(b), 1 / 3)


def test_algebra_takes_a_mapping_of_indices_and_refuses_anything_else():
    a = Region({"c": torch.tensor([1, 2])})
    assert a | {"c": torch.tensor([3])} == Region({"c": torch.tensor([1, 2, 3])})
    assert a & {"c": [2, 9]} == Region({"c": torch.tensor([2])})
    assert a.overlap({"c": [2]}) == 1.0
    for other in ([1, 2], 3, None):
        with pytest.raises(TypeError, match="Region algebra needs a Region"):
            a.union(other)
    with pytest.raises(TypeError):
        a | 3


def test_masks_of_a_shape_too_small_for_the_region_are_refused():
    region = Region({"w": torch.tensor([1, 11])})
    assert region.to_masks({"w": torch.Size([3, 4])})["w"].reshape(-1).nonzero().reshape(-1).tolist() == [1, 11]
    with pytest.raises(ValueError, match=r"'w' reach flat index 11, outside its shape \(2, 4\)"):
        region.to_masks({"w": torch.Size([2, 4])})
