"""theta_ft from sharded safetensors on disk: streamed shard by shard, the same graft as from the model object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from peft import get_peft_model
from testing_utils import clone_model, input_ids, make_pair

import peft_graft.scores.checkpoint as checkpoint_module
import peft_graft.scores.movement as movement_module
from peft_graft import GraftConfig
from peft_graft.baselines import wise_ft
from peft_graft.scores.checkpoint import StreamedCheckpoint, safetensors_files


def _save_sharded(model: torch.nn.Module, folder, shard: str = "20KB") -> list:
    model.save_pretrained(folder, max_shard_size=shard)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 3, "the test needs several shards"
    return shards


def _graft(pre, finetuned, **kwargs):
    config = GraftConfig(finetuned=finetuned, **{"num_entries": 300, **kwargs})
    return get_peft_model(clone_model(pre), config)


def _assert_same_graft(a, b) -> None:
    state_a = {k: v for k, v in a.state_dict().items() if "graft" in k}
    state_b = {k: v for k, v in b.state_dict().items() if "graft" in k}
    assert state_a.keys() == state_b.keys() and state_a
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        ("llama", {}),
        ("bert_cls", {"modules_to_save": ["classifier"]}),
        ("llama", {"region": "random", "seed": 3}),
        ("llama", {"learn_region": True, "search_fraction": 0.05}),
        ("llama", {"learn_region": True}),
    ],
)
def test_sharded_path_gives_the_graft_of_the_model_object(tmp_path, arch, kwargs):
    pre, finetuned, _ = make_pair(arch)
    _save_sharded(finetuned, tmp_path / "ft")
    from_disk, in_memory = _graft(pre, str(tmp_path / "ft"), **kwargs), _graft(pre, finetuned, **kwargs)
    _assert_same_graft(from_disk, in_memory)
    if not kwargs.get("learn_region"):
        ids = input_ids()
        torch.testing.assert_close(from_disk(input_ids=ids).logits, in_memory(input_ids=ids).logits, rtol=0, atol=0)


def test_bf16_shards_graft_a_bf16_base_bit_exactly(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    pre, finetuned = pre.to(torch.bfloat16), finetuned.to(torch.bfloat16)
    _save_sharded(finetuned, tmp_path / "ft", shard="10KB")
    model = _graft(pre, str(tmp_path / "ft"), num_entries=None, sparsity=1.0)  # every entry: the merge is theta_ft
    merged = model.merge_and_unload()
    for name, tensor in finetuned.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor), name


def test_one_shard_open_at_a_time_and_one_tensor_alive(tmp_path, monkeypatch):
    """Creating a graft never holds two shards open, nor theta_ft tensors of more than one shard at once."""
    pre, finetuned, _ = make_pair("llama")
    shards = _save_sharded(finetuned, tmp_path / "ft")
    open_now, most_open, opens = set(), [0], []
    alive, most_alive = {}, [0]
    real_open = checkpoint_module.safe_open

    class Counting:
        def __init__(self, file, framework):
            self.handle, self.file = real_open(file, framework), file

        def __enter__(self):
            open_now.add(self.file)
            opens.append(self.file)
            most_open[0] = max(most_open[0], len(open_now))
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            open_now.discard(self.file)
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            inner = self.inner.get_slice(key)
            if not reading[0]:  # the header pass
                return inner
            return Slice(inner)

        def get_tensor(self, key):
            return count(self.inner.get_tensor(key))

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def __getitem__(self, rows):
            return count(self.inner[rows])

    def count(tensor):
        alive[id(tensor)] = tensor.numel() * tensor.element_size()
        weakref.finalize(tensor, alive.pop, id(tensor), None)
        most_alive[0] = max(most_alive[0], sum(alive.values()))
        return tensor

    reading = [False]
    monkeypatch.setattr(checkpoint_module, "safe_open", Counting)
    monkeypatch.setattr(movement_module, "PIECE", 256)
    original_init = StreamedCheckpoint.__init__

    def init_then_count(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        reading[0] = True

    monkeypatch.setattr(StreamedCheckpoint, "__init__", init_then_count)
    _graft(pre, str(tmp_path / "ft"), learn_region=True, search_fraction=0.05)
    largest_row = max(p.numel() // p.shape[0] for p in pre.parameters() if p.dim() > 1)
    assert most_open[0] == 1
    # theta_ft is read in pieces of 256 entries (whole rows): at most two pieces are alive, never a whole tensor
    assert 0 < most_alive[0] <= 2 * 4 * max(256, largest_row) < max(p.numel() for p in pre.parameters()) * 4
    passes = len(opens) / len(shards)  # the header pass, the check pass, the region's passes, the values
    assert passes <= 10, f"{len(opens)} shard openings for {len(shards)} shards"


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft_graft import GraftConfig

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    kwargs = dict(num_entries=500, learn_region=True, search_fraction=0.001)
    small = LlamaForCausalLM(LlamaConfig.from_pretrained(sys.argv[2])).eval()
    get_peft_model(small, GraftConfig(finetuned=sys.argv[2], **kwargs))  # warm-up: lazy imports
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **json.loads(sys.argv[3]))).eval()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    before = status("VmRSS")
    get_peft_model(model, GraftConfig(finetuned=sys.argv[1], **kwargs))
    print(json.dumps({"added_bytes": status("VmHWM") - before}))
    """
)
_SIZES = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1408)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
def test_peak_memory_is_one_shard_not_a_second_model(tmp_path):
    """Measured in a fresh process: creating a graft from an 8-shard checkpoint of a 120 MB model adds one shard and a
    piece of a tensor to the peak RSS (a second model, or an fp32 movement copy, would add 120 MB or more; the
    embedding and its fp32 movement whole, 33 MB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    finetuned = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **_SIZES))
    with torch.no_grad():
        for param in finetuned.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    model_bytes = sum(p.numel() * p.element_size() for p in finetuned.parameters())
    finetuned.save_pretrained(tmp_path / "ft", max_shard_size=f"{model_bytes // 8 // 2**20 + 1}MB")
    shards = sorted((tmp_path / "ft").glob("*.safetensors"))
    del finetuned
    _, small, _ = make_pair("llama")
    small.save_pretrained(tmp_path / "small")
    command = [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "ft"), str(tmp_path / "small"), json.dumps(_SIZES)]
    # A fixed malloc mmap threshold returns every freed buffer to the system at once: glibc's default (a threshold that
    # grows with the buffers freed) keeps freed memory in its heap, which RSS would count as live.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    added = json.loads(result.stdout.strip().splitlines()[-1])["added_bytes"]
    largest_shard = max(s.stat().st_size for s in shards)
    assert len(shards) >= 6 and model_bytes > 100e6
    assert 3 * movement_module.PIECE < 8000 * 512  # the embedding is read in pieces
    # one shard mapped and one piece of theta_ft with exact_delta's temporaries (about 20 B per entry)
    bound = largest_shard + 32 * movement_module.PIECE
    assert added < min(bound, model_bytes / 3), (added / 1e6, bound / 1e6, model_bytes / 1e6)


def test_single_file_and_file_path(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    finetuned.save_pretrained(tmp_path / "ft")
    assert safetensors_files(tmp_path / "ft")[0] == [tmp_path / "ft" / "model.safetensors"]
    by_folder = _graft(pre, str(tmp_path / "ft"))
    by_file = _graft(pre, tmp_path / "ft" / "model.safetensors")
    _assert_same_graft(by_folder, _graft(pre, finetuned))
    _assert_same_graft(by_file, by_folder)


def test_checkpoint_of_the_base_model_class_is_found_under_the_prefix(tmp_path):
    """A ``LlamaModel`` checkpoint (no ``model.`` prefix) grafts a ``LlamaForCausalLM``, as from_pretrained loads it."""
    pre, finetuned, _ = make_pair("llama")
    finetuned.model.save_pretrained(tmp_path / "body", max_shard_size="20KB")
    _assert_same_graft(_graft(pre, str(tmp_path / "body")), _graft(pre, finetuned))


def test_wise_ft_streams_from_a_path(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    _save_sharded(finetuned, tmp_path / "ft")
    from_disk = wise_ft(clone_model(pre), str(tmp_path / "ft"), 0.5)
    in_memory = wise_ft(clone_model(pre), finetuned, 0.5)
    for (name, a), b in zip(from_disk.named_parameters(), in_memory.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_missing_shard_is_named(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    shards = _save_sharded(finetuned, tmp_path / "ft")
    shards[1].unlink()
    with pytest.raises(ValueError, match=f"missing: \\['{shards[1].name}'\\]"):
        _graft(pre, str(tmp_path / "ft"))


def test_index_and_shards_from_different_saves(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    _save_sharded(finetuned, tmp_path / "ft")
    index_path = tmp_path / "ft" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    shard_files = sorted(set(index["weight_map"].values()))
    moved = next(n for n in names if index["weight_map"][n] != shard_files[-1])
    index["weight_map"][moved] = shard_files[-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="different saves"):
        _graft(pre, str(tmp_path / "ft"))


def test_corrupt_or_foreign_checkpoints(tmp_path):
    pre, finetuned, _ = make_pair("llama")
    shards = _save_sharded(finetuned, tmp_path / "ft")
    shards[0].write_bytes(shards[0].read_bytes()[:100])
    with pytest.raises(ValueError, match="Cannot read the safetensors file"):
        _graft(pre, str(tmp_path / "ft"))

    bigger = type(pre)(pre.config.__class__(**{**pre.config.to_dict(), "intermediate_size": 41}))
    _save_sharded(bigger, tmp_path / "bigger")
    with pytest.raises(ValueError, match="has shape"):
        _graft(pre, str(tmp_path / "bigger"))

    other, _, _ = make_pair("bert_cls")
    other.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="'bert' model but the pre-trained model is 'llama'"):
        _graft(pre, str(tmp_path / "bert"))

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        _graft(pre, str(tmp_path / "broken"))


def test_streamed_checkpoint_reads_headers_without_tensors(tmp_path):
    _, finetuned, _ = make_pair("llama")
    shards = _save_sharded(finetuned, tmp_path / "ft")
    checkpoint = StreamedCheckpoint(*safetensors_files(tmp_path / "ft"))
    state = finetuned.state_dict()
    saved = set(json.loads((tmp_path / "ft" / "model.safetensors.index.json").read_text())["weight_map"])
    assert set(checkpoint) == saved and len(checkpoint) == len(saved) and len(shards) >= 3
    for name in saved:
        assert checkpoint.shape(name) == tuple(state[name].shape) and checkpoint.is_floating_point(name)
        assert torch.equal(checkpoint[name], state[name])
    assert "missing.weight" not in checkpoint
    with pytest.raises(KeyError):
        checkpoint["missing.weight"]
    checkpoint.close()


def test_a_checkpoint_without_safetensors_is_loaded_with_from_pretrained(tmp_path):
    """``pytorch_model.bin`` only (older checkpoints): loaded whole by transformers (``weights_only``), same graft."""
    pre, finetuned, _ = make_pair("llama")
    (tmp_path / "ft").mkdir()
    finetuned.config.save_pretrained(tmp_path / "ft")
    torch.save(finetuned.state_dict(), tmp_path / "ft" / "pytorch_model.bin")
    assert safetensors_files(tmp_path / "ft") is None
    _assert_same_graft(_graft(pre, str(tmp_path / "ft")), _graft(pre, finetuned))
