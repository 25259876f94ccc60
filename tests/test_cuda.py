"""The CUDA paths: bf16/fp16 grafts on a GPU, unmerged inference, MaskTrainer, a streamed checkpoint.

Skipped without a GPU (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from testing_utils import check_bf16_mask_training, clone_model, input_ids, make_pair

import peft_graft.tuner.layer as graft_layer
from peft_graft import GraftConfig

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
