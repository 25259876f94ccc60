"""The CUDA paths: bf16/fp16 grafts on a GPU, unmerged inference, MaskTrainer, a streamed checkpoint, packed grafts
and mixed-graft batches.

Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import check_bf16_mask_training, clone_model, cls_dataset, fast_args, input_ids, make_pair

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig, MaskTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_gpu(arch: str, dtype: torch.dtype):
    pre, finetuned, task_type = make_pair(arch)
    return pre.to("cuda", dtype), finetuned.to("cuda", dtype), task_type


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "roberta_cls"])
def test_graft_merges_and_unmerges_bit_exactly_on_the_gpu(arch, dtype):
    pre, finetuned, task_type = _on_gpu(arch, dtype)
    config = GraftConfig(finetuned=finetuned, num_entries=None, sparsity=0.3, task_type=task_type)
    model = get_peft_model(clone_model(pre).to("cuda"), config)
    region = model.get_region()
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    ids = input_ids().cuda()
    with torch.inference_mode():
        unmerged = model(input_ids=ids).logits
    model.merge_adapter()
    with torch.inference_mode():
        merged_logits = model(input_ids=ids).logits
    merged = {n: p.detach().clone() for n, p in model.base_model.model.named_parameters() if "graft" not in n}
    model.unmerge_adapter()
    torch.testing.assert_close(unmerged, merged_logits)
    tuned, original = dict(finetuned.named_parameters()), dict(pre.named_parameters())
    for name, indices in region.items():
        key = next(k for k in merged if k.replace("base_layer.", "") == name)
        assert torch.equal(merged[key].view(-1)[indices], tuned[name].view(-1)[indices]), name
    restored = {n.replace("base_layer.", ""): p for n, p in model.base_model.model.named_parameters()}
    for name, param in original.items():
        if name in restored:
            assert torch.equal(restored[name], param), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_inference_equals_the_functional_forward_on_the_gpu(dtype, monkeypatch):
    pre, finetuned, _ = _on_gpu("llama", dtype)
    model = get_peft_model(clone_model(pre).to("cuda"), GraftConfig(finetuned=finetuned, num_entries=300))
    ids = input_ids().cuda()
    with torch.inference_mode():
        in_place = model(input_ids=ids).logits
    monkeypatch.setattr(graft_layer, "GRAFT_IN_PLACE_INFERENCE", False)
    with torch.inference_mode():
        functional = model(input_ids=ids).logits
    assert torch.equal(in_place, functional)
    for name, param in pre.named_parameters():  # the base is unchanged after the in-place forward
        assert torch.equal(model.get_submodule("base_model.model").get_parameter(_stored(model, name)), param)


def _stored(model, name: str) -> str:
    names = [n for n, _ in model.get_submodule("base_model.model").named_parameters()]
    return next(n for n in names if n.replace("base_layer.", "") == name)


@pytest.mark.parametrize("search", [{}, {"search_entries": 200}])
def test_mask_training_on_a_bf16_gpu_model(tmp_path, search):
    check_bf16_mask_training(tmp_path, search, device="cuda")


def test_mask_training_with_an_exact_budget_evaluates_its_masks_on_the_gpu(tmp_path):
    """The masks evaluated during training (the starting one, then the exact top-k by S) and the kept one: entries
    ranked on the CPU must reach the GPU model with their indices on its device."""
    pre, finetuned, task_type = _on_gpu("roberta_cls", torch.float32)
    config = GraftConfig(finetuned=finetuned, num_entries=20, learn_region=True, task_type=task_type)
    model = get_peft_model(clone_model(pre).to("cuda"), config)
    args = fast_args(tmp_path, use_cpu=False, per_device_train_batch_size=8, max_steps=2, learning_rate=1e6,
                     num_entries=20, eval_strategy="steps", eval_steps=1, metric_for_best_model="loss")  # fmt: skip
    trainer = MaskTrainer(model=model, args=args, train_dataset=cls_dataset(16), eval_dataset=cls_dataset(8, seed=1))
    trainer.train()
    assert trainer.mask_report["selected_step"] in (0, 1, 2) and model.get_region().num_entries == 20
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    kept = model.peft_config["default"].region_provenance["selection_value"]  # the kept mask's eval_loss in training
    assert trainer.evaluate()["eval_loss"] == pytest.approx(kept, rel=1e-5)


def test_streamed_checkpoint_onto_a_gpu_base(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    finetuned.to(torch.bfloat16).save_pretrained(tmp_path / "ft", max_shard_size="10KB")
    base = clone_model(pre).to("cuda", torch.bfloat16)
    from_disk = get_peft_model(base, GraftConfig(finetuned=str(tmp_path / "ft"), num_entries=300))
    from_memory = get_peft_model(
        clone_model(pre).to("cuda", torch.bfloat16),
        GraftConfig(finetuned=finetuned.to("cuda", torch.bfloat16), num_entries=300),
    )
    a, b = from_disk.state_dict(), from_memory.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def saved_grafts(request, tmp_path_factory):
    """``(pre, folder, dtype)``: grafts "a" (movement) and "b" (random region, another fine-tune) of a base in
    ``dtype``, saved under ``folder`` (a graft records theta_pre in its base's dtype: it loads onto that base only)."""
    dtype = request.param
    pre, finetuned, task_type = make_pair("roberta_cls")
    pre, finetuned = pre.to(dtype), finetuned.to(dtype)
    model = get_peft_model(
        clone_model(pre), GraftConfig(finetuned=finetuned, num_entries=300, task_type=task_type), adapter_name="a"
    )
    other = make_pair("roberta_cls", seed=3)[1].to(dtype)
    model.add_adapter("b", GraftConfig(finetuned=other, num_entries=300, region="random", seed=2, task_type=task_type))
    folder = tmp_path_factory.mktemp("grafts")
    model.save_pretrained(folder)
    return pre, folder, dtype


def _load_on_gpu(pre, folder, dtype: torch.dtype, trainable: bool) -> PeftModel:
    base = clone_model(pre).to("cuda", dtype)
    model = PeftModel.from_pretrained(base, folder / "a", adapter_name="a", is_trainable=trainable)
    model.load_adapter(folder / "b", adapter_name="b", is_trainable=trainable)
    return model.eval()


def _packed_layers(model, name: str) -> list:
    return [layer for layer in model.base_model.graft_layers().values() if name in layer.packed]


def test_grafts_loaded_onto_a_gpu_base_are_packed_there_and_give_the_unpacked_outputs(saved_grafts):
    pre, folder, dtype = saved_grafts
    model, unpacked = _load_on_gpu(pre, folder, dtype, False), _load_on_gpu(pre, folder, dtype, True)
    for name in ("a", "b"):
        layers = _packed_layers(model, name)
        assert layers and not _packed_layers(unpacked, name)
        assert all(t.device.type == "cuda" for t in layers[0].packed[name].tensors.values())
    ids = input_ids(4).cuda()
    for name in ("a", "b"):
        model.base_model.set_adapter(name, inference_mode=True)
        unpacked.base_model.set_adapter(name, inference_mode=True)
        with torch.inference_mode():
            assert torch.equal(model(input_ids=ids).logits, unpacked(input_ids=ids).logits), name
    names = ["a", "__base__", "b", "a"]
    for served in (model, unpacked):  # the default mode's scatter_add_ is not deterministic on CUDA: bit for bit, exact
        served.base_model.set_mixed_batch_mode("exact")
    with torch.inference_mode():
        assert torch.equal(
            model(input_ids=ids, adapter_names=names).logits, unpacked(input_ids=ids, adapter_names=names).logits
        )
    before = {n: p.clone() for n, p in model.named_parameters()}
    model.base_model.set_adapter("a", inference_mode=True)
    model.merge_adapter()
    model.unmerge_adapter()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert _packed_layers(model, "a")


def test_a_graft_packed_on_the_cpu_unpacks_when_moved_to_the_gpu_and_gives_the_gpu_outputs(saved_grafts):
    pre, folder, _ = saved_grafts
    model = PeftModel.from_pretrained(clone_model(pre), folder / "a", adapter_name="a").eval()
    assert _packed_layers(model, "a")
    model.to("cuda")
    assert not _packed_layers(model, "a")
    on_gpu = PeftModel.from_pretrained(clone_model(pre).to("cuda"), folder / "a", adapter_name="a").eval()
    ids = input_ids(4).cuda()
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, on_gpu(input_ids=ids).logits)


def test_a_mixed_graft_batch_on_the_gpu_equals_each_graft_alone(saved_grafts):
    pre, folder, dtype = saved_grafts
    model = _load_on_gpu(pre, folder, dtype, False)
    ids, names = input_ids(4).cuda(), ["b", "a", "__base__", "b"]
    with torch.inference_mode():
        mixed = model(input_ids=ids, adapter_names=names).logits
        alone = {}  # each graft over the whole batch (the same kernels as the mixed batch), the base last
        for name in ("a", "b"):
            model.base_model.set_adapter(name, inference_mode=True)
            alone[name] = model(input_ids=ids).logits
        with model.disable_adapter():
            alone["__base__"] = model(input_ids=ids).logits
    # Within rounding: the mixed batch runs each group's rows as their own product (other kernel shapes).
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for row, name in enumerate(names):
        expected = alone[name][row]
        assert (mixed[row] - expected).abs().max() <= rtol * expected.abs().max(), f"row {row} ({name})"
    assert not torch.equal(alone["a"], alone["__base__"]) and not torch.equal(alone["b"], alone["__base__"])


def _synchronisations(run) -> int:
    """How many times ``run()`` makes the host wait for the GPU (torch's sync debug mode, counted)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_the_sparse_delta_mode_on_the_gpu_follows_the_exact_mode_and_waits_for_the_gpu_once_per_batch(
    saved_grafts, monkeypatch
):
    """The "sparse_delta" mode on the GPU: every row within rounding of the exact mode's, with the delta path taken on
    the linear layers; building a batch's deltas makes the host wait for the GPU once (the base values of every layer
    read back at once, the indices sent from pinned memory) beyond what a single-graft forward waits, not several
    times per layer."""
    from peft_graft.tuner import sparse_delta

    monkeypatch.setattr(sparse_delta, "SPARSE_DELTA_MAX_WORK", 1e9)  # the tiny grafts hold a large share of a tensor
    pre, folder, dtype = saved_grafts
    model = _load_on_gpu(pre, folder, dtype, False)
    ids, names = input_ids(4).cuda(), ["b", "a", "__base__", "b"]
    added = []
    original = sparse_delta.LayerDelta.forward
    monkeypatch.setattr(
        sparse_delta.LayerDelta, "forward", lambda self, base, x: added.append(1) or original(self, base, x)
    )
    outputs = {}
    model.base_model.set_mixed_batch_mode("exact")
    with torch.inference_mode():
        exact = model(input_ids=ids, adapter_names=names).logits
        model.base_model.set_adapter("a", inference_mode=True)
        model(input_ids=ids)  # its in-place plans built
        single = _synchronisations(lambda: model(input_ids=ids))
        model.base_model.set_mixed_batch_mode("sparse_delta")
        model(input_ids=ids, adapter_names=names)  # each graft's deltas built, kept for the next batches
        added.clear()
        mixed = _synchronisations(lambda: outputs.setdefault("fast", model(input_ids=ids, adapter_names=names).logits))
    assert added  # the delta path ran
    assert mixed <= single + 1, (mixed, single)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for row in range(len(names)):
        expected = exact[row]
        assert (outputs["fast"][row] - expected).abs().max() <= rtol * expected.abs().max(), row
