"""peft_graft.serving.load_grafts: grafts of tasks with different numbers of classes on one base, in mixed batches,
each task's logits those of its graft alone, the padded classes never winning; tiny random BERT and RoBERTa."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model
from testing_utils import SMALL, VOCAB, finetune_like, input_ids
from transformers import BertConfig, BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

from peft_graft import GraftConfig
from peft_graft.serving import load_grafts, pad_logit

CLASSES = {"binary": 2, "three": 3, "five": 5}
# BERT's head is one Linear ("classifier"); RoBERTa's is dense + out_proj: only out_proj has a row per class.
ARCHITECTURES = {
    "bert": (BertForSequenceClassification, BertConfig, ""),
    "roberta": (RobertaForSequenceClassification, RobertaConfig, "out_proj"),
}


def _model(arch: str, num_labels: int, seed: int = 0):
    model_class, config_class, _ = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_class(config_class(vocab_size=VOCAB, hidden_size=32, num_labels=num_labels, **SMALL)).eval()


def _graft_folders(arch: str, root, classes: dict[str, int]) -> dict[str, str]:
    """A graft per task, its head (a new one per task) stored whole, all on the same pre-trained body."""
    body = _model(arch, 2).base_model.state_dict()
    folders = {}
    for seed, (task, num_labels) in enumerate(classes.items(), 1):
        pre = _model(arch, num_labels, seed)
        pre.base_model.load_state_dict(body)
        finetuned = finetune_like(pre, scale=0.05, seed=seed)
        config = GraftConfig(finetuned=finetuned, sparsity=0.05, modules_to_save=["classifier"], task_type="SEQ_CLS")
        get_peft_model(pre, config).save_pretrained(root / task)
        folders[task] = str(root / task)
    return folders


def _base(arch: str, num_labels: int):
    model = _model(arch, num_labels, seed=99)
    model.base_model.load_state_dict(_model(arch, 2).base_model.state_dict())
    return model


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_mixed_batch_gives_each_task_its_grafts_logits_and_padded_classes_never_win(arch, tmp_path):
    folders = _graft_folders(arch, tmp_path, CLASSES)
    model = load_grafts(_base(arch, max(CLASSES.values())), folders).eval()
    inputs = input_ids(batch=6, seed=3)
    names = ["binary", "three", "five", "five", "binary", "three"]
    with torch.no_grad():
        mixed = model(input_ids=inputs, adapter_names=names).logits
    assert mixed.shape == (6, 5)
    minimum = pad_logit(torch.float32)
    assert minimum == torch.finfo(torch.float32).min
    for task, num_labels in CLASSES.items():
        rows = [i for i, name in enumerate(names) if name == task]
        alone = PeftModel.from_pretrained(_base(arch, num_labels), folders[task]).eval()
        with torch.no_grad():
            expected = alone(input_ids=inputs[rows]).logits
        got = mixed[rows]
        torch.testing.assert_close(got[:, :num_labels], expected, rtol=0, atol=1e-6 * expected.abs().max().item())
        assert torch.equal(got[:, num_labels:], torch.full_like(got[:, num_labels:], minimum))  # the padded classes
        assert torch.equal(got.argmax(-1), got[:, :num_labels].argmax(-1))
        assert torch.equal(got.softmax(-1)[:, num_labels:], torch.zeros_like(got[:, num_labels:]))
        if num_labels == 2:  # two real classes: the row's softmax is the task's, bit for bit
            assert torch.equal(got.softmax(-1)[:, :2], got[:, :2].softmax(-1))
    _, _, output_layer = ARCHITECTURES[arch]
    head = model.base_model.model.classifier.modules_to_save["binary"]
    assert head.get_submodule(output_layer).weight.shape[0] == 5


def test_a_graft_head_larger_than_the_bases_is_refused_with_both_shapes(tmp_path):
    folders = _graft_folders("bert", tmp_path, {"three": 3})
    message = (
        r"three/adapter_model.safetensors': base_model.model.classifier.bias has shape \(3,\), the base model's "
        r"classifier.bias \(2,\): only a head with fewer output rows.*num_labels"
    )
    with pytest.raises(ValueError, match=message):
        load_grafts(_base("bert", 2), folders)


def test_the_original_graft_file_is_checked_before_its_padded_copy(tmp_path):
    """The padded copy gets its own checksum, so the original's is verified first: a changed byte is refused."""
    folders = _graft_folders("bert", tmp_path, {"binary": 2})
    weights = tmp_path / "binary" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the checksum"):
        load_grafts(_base("bert", 3), folders)


def test_no_graft_is_a_value_error():
    with pytest.raises(ValueError, match="at least one graft"):
        load_grafts(_base("bert", 2), {})
