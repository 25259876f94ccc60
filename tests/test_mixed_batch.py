"""Mixed-graft batches (``adapter_names=[...]``, one graft or ``"__base__"`` per example, as peft's LoRA offers): each
example gets what a forward with only its graft active gives, on every layer type and head, in ``generate``, with
peft's argument checks, and with the single-graft path's guarantees (threads, nested forwards, errors).

Exactness, in the exact mode (``set_mixed_batch_mode("exact")``): a graft layer runs its base layer once per group of
examples with the group's graft written in place, so an example goes through the arithmetic of the single-graft forward
on its group's rows: each graft layer's output rows are bit-exact against that layer run with only the group's graft
active on exactly those rows (``test_each_graft_layer_is_bit_exact_per_group``). The default mode, ``"sparse_delta"``,
stays within its stated rounding bounds per layer (``test_sparse_delta_mode_stays_within_its_rounding_bound``). The
whole model is bound, not bit-exact: the modules between graft layers (attention, activations) run on the whole batch,
and CPU kernels round by tensor size (SiLU's vector body and scalar tail; matrix products' blocking), so against a
forward of each graft's examples as their own batch, or of the whole batch with one graft, the logits agree to ``RTOL``
of their largest magnitude (measured: below 1e-7 relative)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from peft import get_peft_model
from testing_utils import VOCAB, clone_model, finetune_like, input_ids, make_pair
from torch import nn

from peft_graft import GraftConfig
from peft_graft.tuner.in_place import WRITE_LOCK

NAMES = ["sst", "__base__", "trec", "sst", "news", "trec"]
RTOL = 1e-6  # the whole model against single-graft forwards (see the module docstring)


def grafts(arch: str):
    """``(pre, peft model)``: grafts "sst", "trec", "news" of other fine-tunings (and heads), "news" at scale 0.5."""
    pre, finetuned, task_type = make_pair(arch)
    model = get_peft_model(
        clone_model(pre),
        GraftConfig(finetuned=finetuned, sparsity=0.05, region="random", seed=1, task_type=task_type),
        adapter_name="sst",
    )
    for seed, name in ((2, "trec"), (3, "news")):
        config = GraftConfig(
            finetuned=finetune_like(pre, seed=seed), sparsity=0.05, region="random", seed=seed, task_type=task_type
        )
        model.add_adapter(name, config)
    model.set_scale(0.5, "news")
    model.set_adapter("sst")
    return pre, model.eval()


def batch(size: int = len(NAMES), length: int = 9) -> dict[str, torch.Tensor]:
    ids = input_ids(size, length, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as for generation
    mask[4:5, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}


def state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def unchanged(model, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def single(model, name: str, inputs: dict, rows: list[int] | None = None) -> torch.Tensor:
    """The logits of a forward with only ``name`` active (or adapters disabled for "__base__") on ``rows``."""
    inputs = inputs if rows is None else {k: v[rows] for k, v in inputs.items()}
    with torch.no_grad():
        if name == "__base__":
            with model.disable_adapter():
                return model(**inputs).logits
        active = model.active_adapter
        model.set_adapter(name)
        try:
            return model(**inputs).logits
        finally:
            model.set_adapter(active)


def check_per_example(model, inputs: dict, names: list[str], out: torch.Tensor) -> None:
    """Within RTOL of each graft's examples as their own batch and of the whole batch with only that graft."""
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        for expected in (single(model, name, inputs, rows), single(model, name, inputs)[rows]):
            assert (out[rows] - expected).abs().max() <= RTOL * expected.abs().max(), name


def test_each_example_gets_its_grafts_output(arch):
    """Encoders (a head stored whole per graft for sequence classification) and decoders (tied embeddings), padded."""
    pre, model = grafts(arch)
    inputs, before = batch(), state(model)
    with torch.no_grad():
        out = model(**inputs, adapter_names=NAMES).logits
    assert unchanged(model, before)
    assert all(layer.mixed_batch is None for layer in model.base_model.graft_layers().values())
    check_per_example(model, inputs, NAMES, out)
    with torch.no_grad():
        expected = pre(**{k: v[[1]] for k, v in inputs.items()}).logits  # "__base__": the pre-trained model
    assert (out[[1]] - expected).abs().max() <= RTOL * expected.abs().max()
    row = NAMES.index("sst")
    assert not torch.equal(out[row], single(model, "trec", inputs)[row])  # the grafts differ
    assert model.active_adapter == "sst"


def grouped(names: list[str]) -> list[int]:
    """The order the model's forward puts a mixed batch's examples in: each name's side by side, by first appearance."""
    return [i for name in dict.fromkeys(names) for i, n in enumerate(names) if n == name]


def test_each_graft_layer_is_bit_exact_per_group(arch):
    """In the exact mode, every graft layer's mixed output, per group, equals that layer run with only the group's
    graft active (adapters disabled for "__base__") on the group's rows of the same input: the mode's exactness, free
    of the rounding the modules between graft layers add by batch size. The layers see the examples grouped by graft
    (the model's forward reorders them)."""
    _, model = grafts(arch)
    model.set_mixed_batch_mode("exact")
    inputs, seen = batch(), {}
    layers = model.base_model.graft_layers()

    def record(name):
        def hook(_, args, output):
            names = list(layers[name].mixed_batch.names)  # the examples' order the layer runs with
            seen.setdefault(name, []).append((args[0].detach().clone(), output.detach().clone(), names))

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    with torch.no_grad():
        model(**inputs, adapter_names=NAMES)
    for handle in handles:
        handle.remove()
    assert set(seen) == set(layers)
    checked = set()
    for graft in dict.fromkeys(NAMES):
        for name, calls in seen.items():
            for x, output, names in calls:
                assert names == [NAMES[i] for i in grouped(NAMES)]
                rows = [i for i, n in enumerate(names) if n == graft]
                if x.shape[0] != len(NAMES):  # an input shared by the batch (position ids)
                    continue
                with torch.no_grad():
                    if graft == "__base__":
                        with model.disable_adapter():
                            expected = layers[name](x[rows].clone())
                    else:
                        model.set_adapter(graft)
                        expected = layers[name](x[rows].clone())
                assert torch.equal(output[rows], expected), (graft, name)
                checked.add(name)
    model.set_adapter("sst")
    assert len(checked) >= len(layers) - 2  # all but position embeddings, whose input the batch shares


def test_different_classification_heads_per_example():
    """A graft stores a new classification head whole (modules_to_save): each example goes through its graft's."""
    _, model = grafts("roberta_cls")
    heads = model.base_model.model.classifier.modules_to_save
    assert set(heads) == {"sst", "trec", "news"}
    with torch.no_grad():
        heads["trec"].out_proj.weight.mul_(-3)  # a clearly different head for "trec"
    inputs = batch()
    with torch.no_grad():
        out = model(**inputs, adapter_names=NAMES).logits
    check_per_example(model, inputs, NAMES, out)


@pytest.mark.parametrize(("arch", "use_cache"), [("gpt2", True), ("llama", True), ("gpt2", False)])
def test_generate_gives_each_example_its_grafts_tokens(arch, use_cache):
    """Greedy generation with the KV cache (each step in the batch's order: the cache is kept in it), and without
    (each step's forward with the examples grouped by graft), left padding, tied input and output embeddings
    (Llama)."""
    _, model = grafts(arch)
    inputs, before = batch(), state(model)
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=use_cache, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(**inputs, **kwargs, adapter_names=NAMES)
    assert unchanged(model, before)
    for name in dict.fromkeys(NAMES):
        rows = [i for i, n in enumerate(NAMES) if n == name]
        own = {k: v[rows] for k, v in inputs.items()}
        if name == "__base__":
            with model.disable_adapter():
                expected = model.generate(**own, **kwargs)
        else:
            model.set_adapter(name)
            expected = model.generate(**own, **kwargs)
        assert torch.equal(tokens[rows], expected), name
    model.set_adapter("sst")


def test_beam_search_repeats_each_name_per_beam():
    _, model = grafts("gpt2")
    inputs = batch(3)
    names = ["trec", "sst", "__base__"]
    kwargs = dict(max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
    tokens = model.generate(**inputs, **kwargs, adapter_names=names)
    for row, name in enumerate(names):
        own = {k: v[[row]] for k, v in inputs.items()}
        if name == "__base__":
            with model.disable_adapter():
                expected = model.generate(**own, **kwargs)
        else:
            model.set_adapter(name)
            expected = model.generate(**own, **kwargs)
        assert torch.equal(tokens[row, : expected.shape[1]], expected[0]), name


def _unregrouped(monkeypatch) -> None:
    """Mixed batches run in the examples' order (the per-layer gather and scatter)."""
    from peft_graft.tuner import mixed_batch

    monkeypatch.setattr(mixed_batch.MixedBatch, "grouped_order", lambda self: None)


def _orders_seen(model) -> list[list[str]]:
    """Hooks recording the order of names every graft layer runs with, and the list they fill."""
    seen = []
    for layer in model.base_model.graft_layers().values():
        layer.register_forward_hook(lambda module, args, out: seen.append(list(module.mixed_batch.names)))
    return seen


@pytest.mark.parametrize("mode", ["exact", "sparse_delta"])
@pytest.mark.parametrize("arch", ["bert_cls", "gpt2"])
def test_a_mixed_batch_runs_grouped_by_graft_and_answers_in_the_examples_order(arch, mode, monkeypatch):
    """The model's forward puts the examples side by side by graft (each graft layer then runs its groups on slices,
    no gather and scatter per layer) and every output back in the examples' order: logits, hidden states and GPT-2's
    cache equal, bit for bit, those of the batch run in its order; the batch's order is back after the forward."""
    _, model = grafts(arch)
    model.set_mixed_batch_mode(mode)
    inputs, before = batch(), state(model)
    seen = _orders_seen(model)
    with torch.no_grad():
        grouped_out = model(**inputs, adapter_names=NAMES, output_hidden_states=True)
    assert seen and all(names == [NAMES[i] for i in grouped(NAMES)] for names in seen)
    assert unchanged(model, before)
    _unregrouped(monkeypatch)
    seen.clear()
    with torch.no_grad():
        expected = model(**inputs, adapter_names=NAMES, output_hidden_states=True)
    assert seen and all(names == NAMES for names in seen)
    assert torch.equal(grouped_out.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(grouped_out.hidden_states, expected.hidden_states, strict=True))
    monkeypatch.undo()
    with torch.no_grad():  # a tuple output (return_dict=False)
        as_tuple = model(**inputs, adapter_names=NAMES, return_dict=False, use_cache=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], expected.logits)
    if arch == "gpt2":
        cache, expected_cache = grouped_out.past_key_values, expected.past_key_values
        assert cache.get_seq_length() == expected_cache.get_seq_length() > 0
        for got, want in zip(cache.layers, expected_cache.layers, strict=True):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_a_mixed_batch_keeps_its_order_where_grouping_could_change_the_result():
    """Labels (the loss sums over the examples in their order), a cache passed in, and a tensor argument the model's
    forward does not know as one row per example leave the batch in its order; so does a batch already grouped."""
    _, model = grafts("bert_cls")
    inputs = batch()
    seen = _orders_seen(model)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        model(**inputs, labels=labels, adapter_names=NAMES)
        assert seen and all(names == NAMES for names in seen)
        seen.clear()
        model(**inputs, adapter_names=NAMES, unknown_tensor=torch.ones(len(NAMES)))
        assert seen and all(names == NAMES for names in seen)
        seen.clear()
        names = [NAMES[i] for i in grouped(NAMES)]
        model(**inputs, adapter_names=names)
        assert seen and all(order == names for order in seen)


class Opaque:
    """An output object a mixed batch cannot reorder."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ReturnsOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return Opaque(self.out(self.emb(ids)))


def test_a_grouped_output_that_cannot_be_reordered_is_a_clear_type_error():
    torch.manual_seed(0)
    pre = ReturnsOpaque()
    model = get_peft_model(clone_plain(pre), GraftConfig(finetuned=finetune_like(pre), sparsity=0.2), "sst").eval()
    before = state(model)
    with torch.no_grad(), pytest.raises(TypeError, match=r"holds a Opaque.*grouped by graft"):
        model(input_ids(4, 5, seed=1), adapter_names=["sst", "__base__", "sst", "__base__"])
    assert unchanged(model, before)
    with torch.no_grad():  # grouped already: runs as it is
        out = model(input_ids(4, 5, seed=1), adapter_names=["sst", "sst", "__base__", "__base__"])
    assert isinstance(out, Opaque)


@pytest.mark.parametrize(("features", "bias"), [((8, 3), True), ((7, 5), False), ((16, 32), True), ((5, 33), True)])
def test_linear_by_slices_is_f_linear_on_each_groups_rows(features, bias):
    """Each group's rows written straight into the output (aligned slices) or copied there (unaligned ones) equal
    ``F.linear`` on those rows alone, bit for bit, in fp32 and fp64."""
    from peft_graft.tuner.mixed_batch import _linear_by_slices

    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        linear = nn.Linear(*features, bias=bias).to(dtype)
        x = torch.randn(7, 3, features[0], dtype=dtype)
        groups = [("a", slice(0, 2)), ("b", slice(2, 3)), ("c", slice(3, 7))]
        with torch.no_grad():
            out = _linear_by_slices(linear, {}, groups, x)
            for _, rows in groups:
                assert torch.equal(out[rows], nn.functional.linear(x[rows].clone(), linear.weight, linear.bias))


class Mixed(nn.Module):
    """Embedding, Conv1d, LayerNorm and Linear: every plain layer type a graft applies to."""

    def __init__(self):
        super().__init__()
        self.emb, self.conv = nn.Embedding(VOCAB, 8), nn.Conv1d(8, 8, 3, padding=1)
        self.norm, self.out = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.conv(self.emb(x).transpose(1, 2)).transpose(1, 2)
        return self.out(self.norm(h))


def test_plain_layer_types_and_autograd_on():
    """Custom modules through peft's PeftModel, in the exact mode: bit for bit each graft alone; with autograd on in
    eval mode, the functional forward per group."""
    torch.manual_seed(0)
    pre = Mixed()
    model = get_peft_model(clone_plain(pre), GraftConfig(finetuned=finetune_like(pre), sparsity=0.2), "sst")
    model.set_mixed_batch_mode("exact")
    model.add_adapter("trec", GraftConfig(finetuned=finetune_like(pre, seed=5), sparsity=0.2, region="random", seed=5))
    model.eval()
    x, names = input_ids(5, 7, seed=2), ["trec", "sst", "__base__", "trec", "sst"]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = model(x, adapter_names=names)
            for name in dict.fromkeys(names):
                rows = [i for i, n in enumerate(names) if n == name]
                if name == "__base__":
                    with model.disable_adapter():
                        expected = model(x[rows])
                else:
                    model.set_adapter(name)
                    expected = model(x[rows])
                assert torch.equal(out[rows], expected), (name, grad)
        model.set_adapter("sst")
    assert out.requires_grad


def clone_plain(model: nn.Module) -> nn.Module:
    copy = type(model)()
    copy.load_state_dict(model.state_dict())
    return copy


# ------------------------------------------------------------------------------------------------ argument checks
def test_argument_errors_match_peft():
    _, model = grafts("bert_cls")
    inputs = batch()
    with torch.no_grad():
        with pytest.raises(ValueError, match="Length of `adapter_names` should be the same as the number of inputs"):
            model(**inputs, adapter_names=NAMES[:-1])
        with pytest.raises(ValueError, match=r"non-existing adapter.*typo"):
            model(**inputs, adapter_names=[*NAMES[:-1], "typo"])
        with pytest.raises(TypeError, match="list of adapter names"):
            model(**inputs, adapter_names="sst")
        with pytest.raises(TypeError, match="must hold strings"):
            model(**inputs, adapter_names=[*NAMES[:-1], 3])
        model.train()
        with pytest.raises(ValueError, match="training mode"):
            model(**inputs, adapter_names=NAMES)
        model.eval()
        model.merge_adapter(["trec"])
        with pytest.raises(ValueError, match="merged adapters"):
            model(**inputs, adapter_names=NAMES)
        model.unmerge_adapter()
        assert torch.equal(model(**inputs, adapter_names=NAMES).logits, model(**inputs, adapter_names=NAMES).logits)


class TwoInputs(nn.Module):
    """A head that takes two tensors (``kind="two"``) or returns a tuple (``kind="tuple"``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.proj = kind, nn.Linear(8, 3)

    def forward(self, x, y=None):
        if self.kind == "two":
            return self.proj(x) * y
        return self.proj(x), x


class WithHead(nn.Module):
    def __init__(self, kind: str = "two"):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), TwoInputs(kind)

    def forward(self, ids):
        h = self.emb(ids)
        if self.head.kind == "two":
            return self.head(h, y=torch.ones_like(h[..., :3]))
        return self.head(h)[0]


@pytest.mark.parametrize(("kind", "why"), [("two", "takes more than one tensor"), ("tuple", "returns a tuple")])
def test_a_head_stored_whole_taking_two_tensors_or_returning_a_tuple_is_a_clear_type_error(kind, why):
    """As peft refuses modules it cannot split by example: a TypeError naming the module and what is supported, also
    for a batch of one graft; the model then serves on."""
    torch.manual_seed(0)
    pre = WithHead(kind)
    copy = WithHead(kind)
    copy.load_state_dict(pre.state_dict())
    config = GraftConfig(finetuned=finetune_like(pre), sparsity=0.2, modules_to_save=["head"])
    model = get_peft_model(copy, config, "sst").eval()
    x = input_ids(3, 5, seed=2)
    for names in (["sst", "__base__", "sst"], ["sst"] * 3):
        with torch.no_grad(), pytest.raises(TypeError, match=rf"modules_to_save.*one tensor.*TwoInputs {why}"):
            model(x, adapter_names=names)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_a_region_still_learned_is_refused_and_base_is_a_reserved_name():
    pre, finetuned, task_type = make_pair("bert_cls")
    config = GraftConfig(finetuned=finetuned, sparsity=0.05, learn_region=True, task_type=task_type)
    model = get_peft_model(clone_model(pre), config).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="still learning its region"):
        model(**batch(2), adapter_names=["default", "__base__"])
    with pytest.raises(ValueError, match="'__base__' names the pre-trained model"):
        model.add_adapter("__base__", GraftConfig(finetuned=finetuned, sparsity=0.05, task_type=task_type))


def test_adapters_disabled_ignore_adapter_names_as_peft_does():
    pre, model = grafts("gpt2")
    inputs = batch()
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(**inputs, adapter_names=NAMES).logits, pre(**inputs).logits)


# ------------------------------------------------------------------------------------------------ concurrency
def test_threads_mixing_batches_and_single_graft_forwards_get_their_outputs():
    _, model = grafts("gpt2")
    inputs, before = batch(), state(model)
    with torch.no_grad():
        mixed = model(**inputs, adapter_names=NAMES).logits
        alone = model(**inputs).logits  # "sst" active

    def serve(i: int) -> bool:
        with torch.no_grad():
            if i % 2:
                return all(torch.equal(model(**inputs, adapter_names=NAMES).logits, mixed) for _ in range(10))
            return all(torch.equal(model(**inputs).logits, alone) for _ in range(10))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(serve, range(4)))
    assert unchanged(model, before)


def test_another_threads_call_during_a_mixed_batch_runs_as_it_is():
    """While a mixed batch is in effect in one thread, a call of the model from another thread (``PeftModel``'s
    direct call, which waits for the write lock at its first graft layer) neither regroups that batch nor its own
    inputs by it: it gets the active graft's output once the mixed batch ends."""
    _, model = grafts("roberta_mlm")  # a PeftModel without a task type: peft calls the model directly
    inputs = batch()
    with torch.no_grad():
        alone = model(**inputs).logits  # "sst" active
    tuner, results = model.base_model, []
    with tuner._enable_peft_forward_hooks(adapter_names=NAMES):
        worker = threading.Thread(target=lambda: results.append(torch.no_grad()(tuner.model)(**inputs).logits))
        with torch.no_grad():
            worker.start()
            worker.join(0.5)  # it waits for the lock this thread holds
        assert worker.is_alive() and tuner.mixed_batch.names == NAMES
    worker.join()
    assert torch.equal(results[0], alone)


@pytest.mark.parametrize("deltas", [False, True])
@pytest.mark.parametrize("nested_names", [None, ["news"] * len(NAMES), NAMES[::-1]])
def test_a_forward_nested_in_a_mixed_batch_sees_the_state_it_asks_for(nested_names, deltas, monkeypatch):
    """A hook calling the model inside a mixed forward: without adapter_names it gets the model's ordinary output
    (the active graft), with its own adapter_names those (other grafts, or the same in another order: the nested batch
    leaves the outer batch's buffers alone); and a mixed forward nested in an ordinary one. ``deltas``: every linear
    layer on the delta path of the default mode."""
    if deltas:
        from peft_graft.tuner import sparse_delta

        monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    _, model = grafts("gpt2")
    inputs, before = batch(), state(model)
    extra = {} if nested_names is None else {"adapter_names": nested_names}
    with torch.no_grad():
        expected_inner = model(**inputs, **extra).logits
        expected_outer = model(**inputs, adapter_names=NAMES).logits
    seen = []

    def hook(*_):
        if not seen:  # the nested forward runs this hook too
            seen.append(None)
            seen[0] = model(**inputs, **extra).logits

    handle = model.get_base_model().transformer.h[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            outer = model(**inputs, adapter_names=NAMES).logits
        assert torch.equal(seen[0], expected_inner) and torch.equal(outer, expected_outer)
        seen.clear()
        extra = {"adapter_names": NAMES}  # a mixed batch nested in an ordinary forward
        with torch.no_grad():
            outer = model(**inputs).logits
        assert torch.equal(seen[0], expected_outer) and torch.equal(outer, single(model, "sst", inputs))
    finally:
        handle.remove()
    assert unchanged(model, before)


def test_an_error_inside_a_mixed_forward_restores_the_base_bit_for_bit():
    _, model = grafts("llama")
    inputs, before = batch(), state(model)
    calls = []

    def failing(*_):
        calls.append(None)
        if len(calls) == 2:  # after the first group of a graft layer ran
            raise RuntimeError("boom")

    layer = model.base_model.graft_layers()["model.layers.1.mlp.up_proj"]
    handle = layer.base_layer.register_forward_pre_hook(failing)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(**inputs, adapter_names=NAMES)
    handle.remove()
    assert unchanged(model, before)
    assert model.base_model.__dict__.get("mixed_batch") is None and not WRITE_LOCK._is_owned()
    with torch.no_grad():  # the model serves on as before
        check_per_example(model, inputs, NAMES, model(**inputs, adapter_names=NAMES).logits)
    assert threading.active_count() >= 1


# ------------------------------------------------------------------------------------------------ "sparse_delta" mode
def _rounding_bound(x: torch.Tensor, base: torch.Tensor, grafted: torch.Tensor, y: torch.Tensor, transposed: bool):
    """The documented bound of a sparse-delta output against the exact one, per output (float64)."""
    u = torch.finfo(y.dtype).eps / 2
    n = x.shape[-1]
    gamma = n * u / (1 - n * u)
    weights = (
        (base.double().abs() + grafted.double().abs()).T
        if not transposed
        else base.double().abs() + grafted.double().abs()
    )
    return 2 * gamma * (x.double().abs() @ weights) + u * y.double().abs()


def _assert_layer_norm_within_bound(layer, x: torch.Tensor, output: torch.Tensor, overrides: dict, expected):
    """A "sparse_delta" LayerNorm output against the exact one: bit for bit at the features whose weight and bias the
    graft leaves; elsewhere within ``4 u ((|x| + |mean|) rstd |weight| + |bias|) + u |y|`` (LayerNormColumns)."""
    base = layer.base_layer
    weight, bias = overrides.get("weight", base.weight), overrides.get("bias", base.bias)
    changed = (weight != base.weight) | (bias != base.bias)
    assert torch.equal(output[..., ~changed], expected[..., ~changed])
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    rstd = (x.var(-1, unbiased=False, keepdim=True) + base.eps).rsqrt()
    u = torch.finfo(torch.float32).eps / 2
    bound = 4 * u * ((x.abs() + mean.abs()) * rstd * weight.double().abs() + bias.double().abs())
    bound = bound + u * expected.double().abs()
    assert ((output.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_delta_mode_stays_within_its_rounding_bound(arch, dtype, monkeypatch):
    """The default mode, ``"sparse_delta"`` (a model that never set one): each linear graft layer runs once per batch
    plus each group's sparse delta: its output rows (those of "__base__" too: one product over the whole batch) differ
    from the exact per-group path by no more than the documented rounding bound; LayerNorms, run once too, only at the
    features a graft changes, within theirs; the other layers stay bit-exact; the logits stay within 10 RTOL of the
    exact mode's (``set_mixed_batch_mode("exact")``, which never takes the delta path); the base is left untouched."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    taken = []  # the layers that took the delta path
    original = sparse_delta._joined_for

    def joined_for(layer, *args, **kwargs):
        joined = original(layer, *args, **kwargs)
        if joined is not None:
            taken.append(layer)
        return joined

    monkeypatch.setattr(sparse_delta, "_joined_for", joined_for)
    _, model = grafts(arch)
    model.to(dtype)  # float64: the deltas too, or the bound (u of the output's dtype) fails
    inputs, before = batch(), state(model)
    layers = model.base_model.graft_layers()
    seen = {}

    def record(name):
        def hook(_, args, output):
            names = list(layers[name].mixed_batch.names)  # the examples' order the layer runs with
            seen.setdefault(name, (args[0].detach().clone(), output.detach().clone(), names))

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    with torch.no_grad():
        fast = model(**inputs, adapter_names=NAMES).logits
    for handle in handles:
        handle.remove()
    assert unchanged(model, before)
    linear = {name for name, layer in layers.items() if sparse_delta.linear_shape(layer.base_layer) is not None}
    assert linear and {id(layers[name]) for name in linear} <= {id(layer) for layer in taken}
    taken.clear()
    model.set_mixed_batch_mode("exact")
    with torch.no_grad():
        exact = model(**inputs, adapter_names=NAMES).logits
    assert not taken  # the exact mode never takes it
    assert (fast - exact).abs().max() <= 10 * RTOL * exact.abs().max()
    for graft in dict.fromkeys(NAMES):
        for name, (x, output, names) in seen.items():
            if x.shape[0] != len(NAMES):
                continue
            rows = [i for i, n in enumerate(names) if n == graft]
            layer = layers[name]
            with torch.no_grad():
                if graft == "__base__":
                    with model.disable_adapter():
                        expected = layer(x[rows].clone())
                else:
                    model.set_adapter(graft)
                    expected = layer(x[rows].clone())
            with torch.no_grad():
                overrides = {} if graft == "__base__" else layer.effective_parameters([graft])
            if isinstance(layer.base_layer, nn.LayerNorm):
                _assert_layer_norm_within_bound(layer, x[rows], output[rows], overrides, expected)
                continue
            if name not in linear:
                assert torch.equal(output[rows], expected), (graft, name)
                continue
            shape = sparse_delta.linear_shape(layer.base_layer)
            base = layer.base_layer.weight
            grafted = overrides.get("weight", base)
            bound = _rounding_bound(x[rows], base, grafted, expected, shape[2])
            if layer.base_layer.bias is not None:
                bias = overrides.get("bias", layer.base_layer.bias)
                bound = bound + 2 * torch.finfo(expected.dtype).eps * (
                    bias.double().abs() + layer.base_layer.bias.double().abs()
                )
            assert ((output[rows].double() - expected.double()).abs() <= bound).all(), (graft, name)
    model.set_adapter("sst")


@pytest.mark.parametrize("transposed", [False, True])
def test_layer_delta_adds_every_pair_once_whatever_the_padding(transposed):
    """``LayerDelta`` gives each example its graft's row of the joined tables, padded to the graft with the most
    entries: grafts of 4 (two on one output row) and 1 weight entries, one also changing a bias entry, and an example
    without a graft. Its deltas add exactly each graft's products to its examples (float64 reference) and leave every
    other output bit for bit, and an infinite input under a padded slot changes nothing (``x * 0`` would be NaN). Its
    forward is the base layer's product onto each example's bias: bit for bit the base layer's output wherever no
    entry of the example's graft reaches, within rounding of the float64 reference elsewhere; grafts changing the bias
    alone (no weight table) change those bias entries only."""
    from types import SimpleNamespace

    from transformers.pytorch_utils import Conv1D

    from peft_graft.tuner import sparse_delta

    out_features, in_features, tokens = 5, 6, 3
    torch.manual_seed(0)
    base = Conv1D(out_features, in_features) if transposed else nn.Linear(in_features, out_features)
    nn.init.normal_(base.bias)
    layer = SimpleNamespace(base_layer=base)
    entries = {  # per graft: (row, column, delta) of its weight entries
        0: [(0, 1, 0.5), (0, 4, -2.0), (3, 2, 1.5), (4, 5, 0.25)],
        1: [(2, 3, 3.0)],
    }

    def flat(row, column):
        return column * out_features + row if transposed else row * in_features + column

    values = []  # per graft, as graft_values gives them: (flat indices, base values there, deltas or bias values)
    for g in (0, 1):
        at, deltas = torch.tensor([flat(r, c) for r, c, _ in entries[g]]), torch.tensor([d for *_, d in entries[g]])
        values.append({"weight": (at, torch.zeros(len(at)), deltas)})
    values[1]["bias"] = (torch.tensor([2]), base.bias.data[2:3].clone(), torch.tensor([-1.0]))
    joined = sparse_delta._joined(values, ("linear", sparse_delta.linear_shape(base)))
    graft = (1, 0, 2, 1)  # example 2 has no graft (number 2, after the grafts): a row of padding only
    delta = sparse_delta._layer_delta(layer, joined, graft, torch.tensor(graft), sparse_delta.linear_shape(base))
    assert delta.padding is not None and delta.weight.shape == (4, 4)
    x = torch.randn(4, tokens, in_features)
    touched = torch.zeros(4, tokens, out_features, dtype=torch.bool)  # outputs a weight entry reaches
    expected = torch.zeros(4, tokens, out_features, dtype=torch.float64)  # the deltas
    for example, g in enumerate(graft):
        for row, column, d in entries.get(g, []):
            expected[example, :, row] += x[example, :, column].double() * d
            touched[example, :, row] = True
    infinite = x.clone()
    infinite[0, :, 0] = float("inf")  # example 0 (graft 1) pads 3 slots, which point at column 0
    infinite[2, :, 0] = float("inf")  # and example 2 (none) 4
    out = torch.randn(4, tokens, out_features)
    added = delta.add_deltas(out.clone(), infinite)
    assert torch.isfinite(added).all() and torch.equal(added[~touched], out[~touched])
    assert torch.allclose(added[touched].double(), out[touched].double() + expected[touched], rtol=1e-6, atol=1e-6)

    with torch.no_grad():
        plain, fast = base(x), delta.forward(base, x)
        weight = base.weight.double() if transposed else base.weight.double().t()
        reference = x.double() @ weight + base.bias.double()
    reference = reference.double() + expected
    moved = touched.clone()
    for example, g in enumerate(graft):
        if g == 1:  # its bias entry
            reference[example, :, 2] += -1.0 - base.bias.double()[2]
            moved[example, :, 2] = True
    assert torch.equal(fast[~moved], plain[~moved])
    assert torch.allclose(fast.double(), reference, rtol=1e-6, atol=1e-6)

    # grafts changing the bias alone (no weight table), one of them the second: each changes its bias entries only
    biases = [{"bias": (torch.tensor([1]), base.bias.data[1:2].clone(), torch.tensor([2.0]))} for _ in range(2)]
    biases[1]["bias"] = (torch.tensor([3, 4]), base.bias.data[3:5].clone(), torch.tensor([-1.0, 0.5]))
    graft = (1, 2, 0)
    shape = sparse_delta.linear_shape(base)
    delta = sparse_delta._layer_delta(
        layer, sparse_delta._joined(biases, ("linear", shape)), graft, torch.tensor(graft), shape
    )
    with torch.no_grad():
        fast = delta.forward(base, x[:3])
        expected = plain[:3].double().clone()
    for example, changes in ((0, {3: -1.0, 4: 0.5}), (2, {1: 2.0})):
        for row, value in changes.items():
            expected[example, :, row] += value - base.bias.double()[row]
    moved = torch.zeros_like(fast, dtype=torch.bool)
    moved[0, :, 3:5] = moved[2, :, 1] = True
    assert torch.equal(fast[~moved], plain[:3][~moved])
    assert torch.allclose(fast.double(), expected, rtol=1e-6, atol=1e-6)


def test_sparse_delta_mode_keeps_the_exact_path_for_dense_grafts():
    """Above SPARSE_DELTA_MAX_WORK (the test grafts hold 5% of each tensor) every layer keeps the exact path: the
    logits equal the exact mode's bit for bit. An unknown mode is a ValueError naming the modes."""
    _, model = grafts("bert_cls")
    inputs = batch()
    model.set_mixed_batch_mode("exact")
    with torch.no_grad():
        exact = model(**inputs, adapter_names=NAMES).logits
        model.set_mixed_batch_mode("sparse_delta")
        fast = model(**inputs, adapter_names=NAMES).logits
    assert torch.equal(fast, exact)
    with pytest.raises(ValueError, match="'exact', 'sparse_delta'"):
        model.set_mixed_batch_mode("fast")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sparse_delta_mode_generates_the_exact_modes_tokens(arch, monkeypatch):
    """Greedy generation in the "sparse_delta" mode, called without ``torch.no_grad()`` (``generate`` turns autograd
    off only after the mixed batch is set up): prefill and every decoding step take the delta path on the linear graft
    layers (GPT-2's Conv1D, Llama's tied output embedding), and the tokens and each step's logits are the exact mode's
    to rounding; the base is left untouched."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    lengths = []
    original = sparse_delta.LayerDelta.forward
    monkeypatch.setattr(
        sparse_delta.LayerDelta, "forward", lambda self, base, x: lengths.append(x.shape[1]) or original(self, base, x)
    )
    _, model = grafts(arch)
    inputs, before = batch(), state(model)
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    model.set_mixed_batch_mode("exact")
    with torch.no_grad():
        exact = model.generate(**inputs, **kwargs, adapter_names=NAMES)
    assert not lengths
    model.set_mixed_batch_mode("sparse_delta")
    fast = model.generate(**inputs, **kwargs, adapter_names=NAMES)  # as users call it: autograd off inside only
    assert unchanged(model, before)
    assert set(lengths) == {inputs["input_ids"].shape[1], 1}  # prefill, then one token per step
    assert torch.equal(fast.sequences, exact.sequences)
    for step_fast, step_exact in zip(fast.logits, exact.logits, strict=True):
        assert (step_fast - step_exact).abs().max() <= 10 * RTOL * step_exact.abs().max()


def test_sparse_delta_mode_takes_the_exact_path_while_autograd_is_on(monkeypatch):
    """With autograd on (eval mode), the "sparse_delta" mode runs every layer on the exact path, as the single-graft
    forward does then: no delta is built or added, the logits equal the exact mode's bit for bit, and gradients reach
    the input embeddings. Without autograd, every layer's delta is built in one call."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    added, prepared = [], []
    for owner, name in ((sparse_delta.LayerDelta, "forward"), (sparse_delta.LayerNormColumns, "forward")):
        spied = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, spied=spied: added.append(1) or spied(*a))
    original = sparse_delta.prepare
    monkeypatch.setattr(
        sparse_delta, "prepare", lambda layers, *a: prepared.append(len(layers)) or original(layers, *a)
    )
    _, model = grafts("bert_cls")
    inputs = batch()
    embeddings = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_()
    model.set_mixed_batch_mode("exact")
    exact = model(inputs_embeds=embeddings, attention_mask=inputs["attention_mask"], adapter_names=NAMES).logits
    model.set_mixed_batch_mode("sparse_delta")
    fast = model(inputs_embeds=embeddings, attention_mask=inputs["attention_mask"], adapter_names=NAMES).logits
    assert not added and not prepared and torch.equal(fast, exact)
    fast.sum().backward()
    assert embeddings.grad is not None and embeddings.grad.abs().sum() > 0
    with torch.no_grad():
        model(inputs_embeds=embeddings, attention_mask=inputs["attention_mask"], adapter_names=NAMES)
    assert added and prepared == [len(model.base_model.graft_layers())]


def test_sparse_delta_mode_takes_the_exact_path_under_autocast(monkeypatch):
    """Under CPU autocast (which casts a linear layer's inputs) the linear layers of the "sparse_delta" mode take the
    exact path: no ``LayerDelta`` runs, and the logits equal the exact mode's under the same autocast bit for bit."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    added = []
    original = sparse_delta.LayerDelta.forward
    monkeypatch.setattr(
        sparse_delta.LayerDelta, "forward", lambda self, base, x: added.append(1) or original(self, base, x)
    )
    _, model = grafts("bert_cls")
    inputs = batch()
    model.set_mixed_batch_mode("exact")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        exact = model(**inputs, adapter_names=NAMES).logits
        model.set_mixed_batch_mode("sparse_delta")
        fast = model(**inputs, adapter_names=NAMES).logits
    assert exact.dtype == torch.bfloat16 and torch.equal(fast, exact) and not added
    with torch.no_grad():
        model(**inputs, adapter_names=NAMES)
    assert added


def test_sparse_delta_mode_chooses_per_call_by_tokens(monkeypatch):
    """A layer's call takes the delta path only where graft density x tokens per example is within
    SPARSE_DELTA_MAX_WORK: with grafts of 5% and a bound of 0.1, a decoding step (1 token) takes it and the 9-token
    prefill does not; the tokens are the exact mode's."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 0.1)
    lengths = []
    original = sparse_delta.LayerDelta.forward
    monkeypatch.setattr(
        sparse_delta.LayerDelta, "forward", lambda self, base, x: lengths.append(x.shape[1]) or original(self, base, x)
    )
    _, model = grafts("llama")
    inputs = batch()
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    model.set_mixed_batch_mode("exact")
    with torch.no_grad():
        exact = model.generate(**inputs, **kwargs, adapter_names=NAMES)
    assert not lengths
    with torch.no_grad():
        model.set_mixed_batch_mode("sparse_delta")
        fast = model.generate(**inputs, **kwargs, adapter_names=NAMES)
    assert lengths and set(lengths) == {1}
    assert torch.equal(fast, exact)


def test_sparse_delta_mode_reuses_its_deltas_until_a_graft_or_the_base_changes(monkeypatch):
    """The "sparse_delta" mode builds each graft's delta on a linear layer once, kept with its in-place plan, and
    reuses it for later batches (any order of names); it builds again the deltas of a graft whose scale changed, and
    those of a layer where a base value under an entry changed, even through ``.data`` (no version counter moves):
    every linear graft layer's output follows the exact mode's, example by example."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    built = []  # the plans a delta was built from
    original = sparse_delta.graft_values
    monkeypatch.setattr(sparse_delta, "graft_values", lambda plan, *a: built.append(plan) or original(plan, *a))
    _, model = grafts("bert_cls")
    inputs = batch()
    linear = {
        name: layer
        for name, layer in model.base_model.graft_layers().items()
        if sparse_delta.linear_shape(layer.base_layer) is not None
    }
    outputs = {}
    for name, layer in linear.items():
        layer.register_forward_hook(lambda _, args, out, name=name: outputs.__setitem__(name, out.detach().clone()))

    def both(names):
        runs = []
        for mode in ("exact", "sparse_delta"):
            model.set_mixed_batch_mode(mode)
            with torch.no_grad():
                model(**inputs, adapter_names=names)
            runs.append(dict(outputs))
        for name, exact in runs[0].items():  # per example: each row to its own scale
            error = (runs[1][name] - exact).abs().flatten(1).amax(1)
            assert (error <= 1e-5 * exact.abs().flatten(1).amax(1)).all(), name
        return len(built)

    first = both(NAMES)
    assert first > 0
    assert both(NAMES[::-1]) == first  # reused: same grafts, other order
    model.set_scale(0.8, "news")
    after_scale = both(NAMES)
    with torch.no_grad():
        news = {id(layer.in_place_plan(("news",))) for layer in model.base_model.graft_layers().values()}
    assert after_scale > first and {id(plan) for plan in built[first:]} <= news
    with torch.no_grad():  # the in-place plans are those of forwards without autograd
        layer = next(layer for layer in linear.values() if layer.in_place_plan(("sst",)) is not None)
        plan = layer.in_place_plan(("sst",))
    parameters, attr, entries, _, _ = next(write for write in plan.writes if write[1] == "weight")
    parameters[attr].data.view(-1)[entries[0][0]] += 1e3  # under an entry: "sst" replaces it by its value
    assert both(NAMES) > after_scale
    assert {id(plan) for plan in built[after_scale:]} <= {id(plan) for plan in layer._in_place_plans.values()}


@pytest.mark.parametrize("packed", [False, True])
def test_sparse_delta_mode_serves_graft_values_written_through_data(packed, monkeypatch, tmp_path):
    """A graft's values written through ``.data`` (no version counter moves) are served at once by the
    "sparse_delta" mode, as by the exact mode and the graft alone: its deltas there are built again, not the old ones
    served (unpacked and packed grafts); later batches reuse them."""
    from peft import PeftModel

    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    pre, model = grafts("bert_cls")
    if packed:
        model.save_pretrained(tmp_path)
        model = PeftModel.from_pretrained(clone_model(pre), tmp_path / "trec", adapter_name="trec")
        model.load_adapter(tmp_path / "news", adapter_name="news")
        model.load_adapter(tmp_path / "sst", adapter_name="sst")
        model.eval()
    inputs = batch()
    model.set_mixed_batch_mode("sparse_delta")
    with torch.no_grad():
        model(**inputs, adapter_names=NAMES)  # every graft's deltas built
    stored = {}  # a packed graft's values: one store for every layer
    for layer in model.base_model.graft_layers().values():
        values = layer.packed["trec"].tensors["values"] if packed else layer.graft_values.get("trec")
        if values is not None:
            stored[values.data_ptr()] = values
    assert len(stored) == (1 if packed else len(model.base_model.graft_layers()))
    for values in stored.values():
        values.data.mul_(-3.0)  # through .data: no version counter moves
    model.set_mixed_batch_mode("exact")
    with torch.no_grad():
        exact = model(**inputs, adapter_names=NAMES).logits
    model.set_mixed_batch_mode("sparse_delta")
    with torch.no_grad():
        fast = model(**inputs, adapter_names=NAMES).logits
    assert (fast - exact).abs().max() <= 10 * RTOL * exact.abs().max()
    rebuilt = []
    original = sparse_delta.graft_values
    monkeypatch.setattr(sparse_delta, "graft_values", lambda plan, *a: rebuilt.append(plan) or original(plan, *a))
    with torch.no_grad():
        again = model(**inputs, adapter_names=NAMES).logits
    assert not rebuilt and torch.equal(again, fast)
    check_per_example(model, inputs, NAMES, exact)  # the exact mode served the new values (this unpacks the grafts)


@pytest.mark.parametrize("arch", ["bert_cls", "llama"])
def test_sparse_delta_mode_reuses_its_buffers_in_place(arch, monkeypatch):
    """The default mode keeps each layer's per-example tables, and the intermediate results the model's layers share,
    between batches and writes them in place: after the first batch of a shape, batches of the same grafts in any order
    allocate nothing the caches keep (the same tensors, at the same addresses, as many), and their logits are bit for
    bit those of a model whose caches are dropped before every batch (built anew). Another batch size or set of grafts
    replaces them: as many. Buffers made under ``torch.inference_mode()`` are written outside it."""
    from peft_graft.tuner import sparse_delta
    from peft_graft.tuner.mixed_batch import SCRATCH

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    (_, warm), (_, cold) = grafts(arch), grafts(arch)
    inputs = batch()

    def kept() -> dict[int, int]:
        """Every tensor the mode keeps: each layer's, and the intermediate results its layers share."""
        held = [t for layer in warm.base_model.graft_layers().values() for t in sparse_delta.cached_tensors(layer)]
        held += [t for pool in warm.base_model.__dict__[SCRATCH].values() for t in pool.flat.values()]
        return {id(t): t.data_ptr() for t in held}

    def logits(model, names):
        with torch.no_grad():
            return model(**{k: v[: len(names)] for k, v in inputs.items()}, adapter_names=names).logits

    def same_as_cold(names):
        out = logits(warm, names)
        for layer in cold.base_model.graft_layers().values():
            sparse_delta.forget_joined(layer)
        assert torch.equal(out, logits(cold, names)), names

    same_as_cold(NAMES)
    first = kept()
    assert first
    orders = [NAMES[::-1], NAMES[1:] + NAMES[:1], ["trec", "sst", "news", "__base__", "trec", "sst"], NAMES]
    for names in orders:
        same_as_cold(names)
        assert kept() == first, names  # the same tensors at the same addresses, none added
    for names in (["trec", "__base__", "sst", "trec"], ["trec"] * 6, NAMES):
        same_as_cold(names)
        assert len(kept()) <= len(first), names  # replaced, not added
    before = kept()
    with torch.inference_mode():  # buffers written under inference mode, then outside it (serve_grafts uses it)
        in_inference = warm(**inputs, adapter_names=NAMES[::-1]).logits
    assert torch.equal(in_inference, logits(warm, NAMES[::-1])) and kept() == before
    for layer in cold.base_model.graft_layers().values():
        sparse_delta.forget_joined(layer)
    with torch.inference_mode():  # buffers made under inference mode, written outside it
        cold(**inputs, adapter_names=NAMES)
    assert torch.equal(logits(cold, NAMES[::-1]), in_inference)


def test_sparse_delta_mode_builds_once_after_a_nan_is_written_under_an_entry(monkeypatch):
    """A base value under an entry changed to NaN (through ``.data``) makes the layer's values be built again once;
    later batches reuse them (a NaN compared unequal to itself, and every batch built them again)."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    rebuilt = []
    original = sparse_delta._joined_for

    def joined_for(layer, holders, kind, rebuild=False):
        rebuilt.extend([layer] if rebuild else [])
        return original(layer, holders, kind, rebuild)

    monkeypatch.setattr(sparse_delta, "_joined_for", joined_for)
    _, model = grafts("bert_cls")
    model.set_mixed_batch_mode("sparse_delta")
    with torch.no_grad():
        model(**batch(), adapter_names=NAMES)
        layer = next(
            layer
            for layer in model.base_model.graft_layers().values()
            if sparse_delta.linear_shape(layer.base_layer) is not None and layer.in_place_plan(("sst",)) is not None
        )
        plan = layer.in_place_plan(("sst",))
    parameters, attr, entries, _, _ = next(write for write in plan.writes if write[1] == "weight")
    parameters[attr].data.view(-1)[entries[0][0]] = float("nan")
    for expected in ([layer], [layer], [layer]):  # built again on the first batch after the write only
        with torch.no_grad():
            model(**batch(), adapter_names=NAMES)
        assert rebuilt == expected


def test_sparse_delta_mode_frees_a_deleted_grafts_joined_values(monkeypatch):
    """Each layer keeps the last batch's joined values (every graft's deltas there, copied); deleting a graft drops
    them at once, so its values are freed then, not at the layer's next sparse-delta batch (which may never come)."""
    import gc
    import weakref

    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold 5% of each tensor
    _, model = grafts("bert_cls")
    model.set_mixed_batch_mode("sparse_delta")
    with torch.no_grad():
        model(**batch(), adapter_names=NAMES)
    joined = [
        weakref.ref(layer.__dict__[sparse_delta._JOINED][1])
        for layer in model.base_model.graft_layers().values()
        if layer.__dict__.get(sparse_delta._JOINED, (None, None))[1] is not None
    ]
    assert joined
    model.delete_adapter("news")
    gc.collect()
    assert all(ref() is None for ref in joined)
    with torch.no_grad():  # the remaining grafts still serve their examples
        names = [name if name != "news" else "__base__" for name in NAMES]
        fast = model(**batch(), adapter_names=names).logits
        model.set_mixed_batch_mode("exact")
        exact = model(**batch(), adapter_names=names).logits
    assert (fast - exact).abs().max() <= 10 * RTOL * exact.abs().max()


def _layer_outputs(model, names, inputs, mode: str) -> dict[str, torch.Tensor]:
    """Every graft layer's output in a mixed batch of ``names`` in ``mode``."""
    outputs = {}
    handles = [
        layer.register_forward_hook(lambda _, args, out, name=name: outputs.__setitem__(name, out.detach().clone()))
        for name, layer in model.base_model.graft_layers().items()
    ]
    model.set_mixed_batch_mode(mode)
    try:
        with torch.no_grad():
            model(**inputs, adapter_names=names)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def test_sparse_delta_mode_runs_vector_layers_once_per_batch_where_that_is_exact(monkeypatch):
    """In the "sparse_delta" mode, a layer whose grafted tensors are vectors runs once for the whole batch with a copy
    per example, its graft's values written in, where that gave the exact path's outputs on its first call: Llama's
    RMSNorms (their output bit for bit the exact mode's, in later batches too). The linear layers take the exact path
    here, so that every layer sees the exact mode's inputs."""
    arch = "llama"
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 0)  # linear layers exact: the same inputs everywhere
    _, model = grafts(arch)
    inputs, before = batch(), state(model)
    vectors = {
        name: layer
        for name, layer in model.base_model.graft_layers().items()
        if sparse_delta._kind(layer.base_layer) is not None and sparse_delta._kind(layer.base_layer)[0] == "vector"
    }
    assert vectors
    calls = []
    original = sparse_delta.ExampleParameters.forward

    def forward(self, layer, *args):
        calls.append(layer)
        return original(self, layer, *args)

    monkeypatch.setattr(sparse_delta.ExampleParameters, "forward", forward)
    for names in (NAMES, NAMES[::-1]):  # the first batch checks each layer, the second runs what the check chose
        exact = _layer_outputs(model, names, inputs, "exact")
        fast = _layer_outputs(model, names, inputs, "sparse_delta")
        for name in vectors:
            assert torch.equal(fast[name], exact[name]), name
    verdicts = {layer.__dict__.get(sparse_delta.EXACT_WITH_EXAMPLE_PARAMETERS) for layer in vectors.values()}
    assert verdicts == {True}
    assert {id(layer) for layer in calls} == {id(layer) for layer in vectors.values()}
    assert unchanged(model, before)


@pytest.mark.parametrize("arch", ["bert_cls", "gpt2"])
def test_sparse_delta_mode_runs_layer_norms_once_per_batch(arch, monkeypatch):
    """In the "sparse_delta" mode an ``nn.LayerNorm`` runs once for the whole batch and recomputes only the features
    where an example's graft changes its weight or bias: every LayerNorm takes that path, its outputs are the exact
    mode's bit for bit at the other features and within the documented bound at those (linear layers exact here, so
    that each LayerNorm sees the exact mode's inputs)."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 0)
    calls = []
    original = sparse_delta.LayerNormColumns.forward
    monkeypatch.setattr(
        sparse_delta.LayerNormColumns, "forward", lambda self, norm, *a: calls.append(norm) or original(self, norm, *a)
    )
    _, model = grafts(arch)
    inputs, before = batch(), state(model)
    layers = model.base_model.graft_layers()
    norms = {name: layer for name, layer in layers.items() if isinstance(layer.base_layer, nn.LayerNorm)}
    assert norms
    seen = {}  # each LayerNorm's input

    def record(name):
        def hook(_, args, output):
            seen.setdefault(name, args[0].detach().clone())

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in norms.items()]
    fast = _layer_outputs(model, NAMES, inputs, "sparse_delta")
    for handle in handles:
        handle.remove()
    assert {id(layer) for layer in calls} == {id(layer) for layer in norms.values()}
    names = [NAMES[i] for i in grouped(NAMES)]  # the order the layers run the examples in
    for graft in dict.fromkeys(NAMES):
        rows = [i for i, n in enumerate(names) if n == graft]
        for name, layer in norms.items():
            x = seen[name][rows]
            with torch.no_grad():
                if graft == "__base__":
                    with model.disable_adapter():
                        expected = layer(x.clone())
                    overrides = {}
                else:
                    model.set_adapter(graft)
                    expected = layer(x.clone())
                    overrides = layer.effective_parameters([graft])
            _assert_layer_norm_within_bound(layer, x, fast[name][rows], overrides, expected)
    model.set_adapter("sst")
    assert unchanged(model, before)


def test_layer_norm_columns_follow_per_example_layer_norms():
    """``LayerNormColumns`` from joined grafts (two weight and one bias entry, one bias entry, none; and an example
    without a graft), in batches with and without examples left alone: each example's output is that of
    ``F.layer_norm`` with its graft's weight and bias (float64 reference) at the features its graft changes, and the
    kernel's output bit for bit elsewhere."""
    from peft_graft.tuner import sparse_delta

    torch.manual_seed(0)
    layer = nn.Module()
    layer.base_layer = norm = nn.LayerNorm(6)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    norm.requires_grad_(False)
    w, b = norm.weight, norm.bias
    values = [  # per graft, as graft_values gives them: (flat indices, base values there, grafted values)
        {
            "weight": (torch.tensor([1, 4]), w[[1, 4]], torch.tensor([3.0, -2.0])),
            "bias": (torch.tensor([4]), b[[4]], torch.tensor([0.5])),
        },
        {"bias": (torch.tensor([2]), b[[2]], torch.tensor([-1.5]))},
        {},  # a graft without entries here
    ]
    joined = sparse_delta._joined(values, ("layer_norm", 6))
    for graft in ((0, 1, 3, 2, 0), (1, 0, 1, 0, 0)):  # example 2 of the first has no graft here (number 3)
        columns = sparse_delta._layer_norm_columns(layer, joined, graft, torch.tensor(graft))
        assert (columns.empty is None) == (graft[2] != 3)
        x = torch.randn(5, 64, 6)
        out = columns.forward(layer, x, exact=None)
        kernel = norm(x)
        changed = [[1, 4], [2], [], []]
        for example, g in enumerate(graft):
            kept = [feature for feature in range(6) if feature not in changed[g]]
            assert torch.equal(out[example][:, kept], kernel[example][:, kept]), (graft, example)  # bit for bit
            weight, bias = w.double().clone(), b.double().clone()
            for attr, tensor in (("weight", weight), ("bias", bias)):
                if g < 3 and attr in values[g]:
                    tensor[values[g][attr][0]] = values[g][attr][2].double()
            expected = torch.nn.functional.layer_norm(x[example].double(), (6,), weight, bias, norm.eps)
            torch.testing.assert_close(out[example].double(), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_columns_leave_low_precision_inputs_to_the_exact_path():
    """Below fp32 the LayerNorm kernel returns its mean and rstd rounded to the input's dtype: such inputs take the
    exact path."""
    from peft_graft.tuner import sparse_delta

    columns = sparse_delta.LayerNormColumns(
        torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), torch.zeros(2, 1), None, features=4
    )
    layer = nn.Module()
    layer.base_layer = nn.LayerNorm(4)
    sentinel = torch.full((2, 3, 4), 7.0)
    assert columns.forward(layer, torch.randn(2, 3, 4, dtype=torch.bfloat16), lambda: sentinel) is sentinel
    assert columns.forward(layer, torch.randn(2, 3, 4), lambda: sentinel) is not sentinel


def test_sparse_delta_mode_keeps_the_exact_path_for_a_vector_layer_whose_check_fails(monkeypatch):
    """A vector layer whose per-example output differs from the exact path's on its first call (here made to differ)
    keeps the exact path from then on: its outputs are the exact mode's, bit for bit."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 0)
    original = torch.func.functional_call
    monkeypatch.setattr(torch.func, "functional_call", lambda *a, **k: original(*a, **k) + 1.0)
    _, model = grafts("llama")
    inputs = batch()
    vectors = [
        name
        for name, layer in model.base_model.graft_layers().items()
        if sparse_delta._kind(layer.base_layer) is not None and sparse_delta._kind(layer.base_layer)[0] == "vector"
    ]
    for names in (NAMES, NAMES[::-1]):
        exact = _layer_outputs(model, names, inputs, "exact")
        fast = _layer_outputs(model, names, inputs, "sparse_delta")
        assert all(torch.equal(fast[name], exact[name]) for name in vectors)
    layers = model.base_model.graft_layers()
    assert all(layers[name].__dict__[sparse_delta.EXACT_WITH_EXAMPLE_PARAMETERS] is False for name in vectors)
