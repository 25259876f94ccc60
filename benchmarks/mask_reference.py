"""The paper's mask-training step, rewritten to time it beside ``MaskTrainer`` (``bench_mask_step.py --search
reference``)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from mask_trainers import SPARSITY
from transformers import LlamaForCausalLM

# The paper's reference code (``--search reference``): its mask learning rate and sigmoid shift, the defaults of its
# run_graft_task.sh (lr=1e7) and Grafting.py (sigmoid_bias=10).
REFERENCE_LR = 1e7
SIGMOID_BIAS = 10.0


class ReferenceGraft:
    """The mask-training step of the paper's official code, written anew here to time it beside MaskTrainer.

    Mirrors ``graft_Trainer`` of ``src/graft_trainer.py`` in abhishekpanigrahi1996/Skill-Localization-by-grafting, set
    up as its ``Grafting.py`` does: three whole models (the working model, dropout off, every parameter requiring a
    gradient; theta_pre and theta_ft on the CPU) and, per trainable tensor, dense mask logits S in the weights' dtype
    (``create_binary_masks``: uniform in [0, 1), read through ``sigmoid(S - sigmoid_bias)``), theta_ft - theta_pre,
    and the base mask gamma_base (``create_basepatch``, ``highest_movement``: a running numpy sort of the magnitudes,
    tensor by tensor, keeping those above the k-th largest). That setup runs once, outside the step. :meth:`step` is
    one epoch of ``train_graft`` with one micro-batch: ``interpolate_model`` (per tensor, theta_pre, theta_ft and the
    model's tensor found by scanning ``named_parameters``, then ``gamma * (theta_ft - theta_pre)`` added, the
    difference made anew), forward and backward, a clone of the gradients (found by list membership of the names),
    ``zero_grad`` (under torch >= 2 it frees them; the reference's torch 1.6 zeroed them in place and kept them), the
    products with theta_ft - theta_pre, the learning-rate scaled mean over micro-batches, ``reset_model`` (theta_pre
    back, by the same scans) and the update of S by the chain rule through
    ``gamma = gamma_base + (1 - 2 gamma_base) sigmoid(S - sigmoid_bias)``.

    Knowingly different: the region is the other variants' (every tensor but the ``heads``, which hold theta_ft's
    values as with ``modules_to_save``; the shipped script also froze the embeddings and its prompt head), the loss is
    the model's own on the benchmark's batch (the reference's ``finetune`` path), the numpy sort reads bf16 weights as
    fp32 (numpy has no bf16), and the evaluation that ends each of the reference's epochs (the rounded mask on the
    training and validation sets, ``torch.save`` of S) is left out, as the other variants' steps evaluate nothing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pretrained: torch.nn.Module,
        finetuned: torch.nn.Module,
        heads: list[str] | None,
        sparsity: float = SPARSITY,
        device: str = "cpu",
    ) -> None:
        self.device = device
        self.model = model.to(device).eval().requires_grad_(True)
        self.pretrained = pretrained.to("cpu").eval().requires_grad_(False)
        self.finetuned = finetuned.to("cpu").eval().requires_grad_(False)
        heads = tuple(heads or ())
        self.names = [n for n, _ in self.model.named_parameters() if not any(f".{h}." in f".{n}" for h in heads)]
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name not in self.names:  # a head: theta_ft's, whole
                    param.copy_(self.finetuned.get_parameter(name))
            params = [self.find(self.model, name) for name in self.names]
            self.scores = [torch.rand_like(p) for p in params]
            self.directions = [self.find(self.finetuned, n) - self.find(self.pretrained, n) for n in self.names]
            self.base = self.top_movement(sparsity)
        self.grad: list[torch.Tensor] | None = None
        self.total_grad: list[torch.Tensor] | None = None

    @staticmethod
    def find(model: torch.nn.Module, name: str) -> torch.Tensor:
        """The parameter ``name`` of ``model``, by a scan of all its named parameters (the reference's look-up)."""
        found = None
        for other, param in model.named_parameters():
            if other == name:
                found = param
        return found

    def top_movement(self, sparsity: float) -> list[torch.Tensor]:
        """gamma_base: 1 where ``|theta_ft - theta_pre|`` exceeds the k-th largest magnitude (k = ``sparsity`` of the
        entries), found by sorting, tensor by tensor, its magnitudes with the best k so far (float64 numpy)."""
        k = int(sparsity * sum(s.numel() for s in self.scores))
        best = np.zeros(k)
        for direction in self.directions:
            values = np.concatenate([np.abs(direction.float().numpy().ravel()), best])
            best = -np.sort(-values)[:k]
        threshold = np.sort(best)[0]
        masks = []
        for direction, scores in zip(self.directions, self.scores, strict=True):
            mask = torch.zeros_like(scores)
            mask[(direction.abs() > threshold).to(mask.device)] = 1.0
            masks.append(mask)
        return masks

    def create_optimizer(self) -> None:
        """None: the reference updates S by hand."""

    def interpolate(self) -> None:
        """theta_pre + gamma * (theta_ft - theta_pre) into the working model (``interpolate_model``)."""
        for name, scores, base in zip(self.names, self.scores, self.base, strict=True):
            pre = self.find(self.pretrained, name).to(self.device)
            ft = self.find(self.finetuned, name).to(self.device)
            with torch.no_grad():
                for other, param in self.model.named_parameters():
                    if other == name:
                        param += (base + (1.0 - 2.0 * base) * torch.sigmoid(scores - SIGMOID_BIAS)) * (ft - pre)

    def reset(self) -> None:
        """theta_pre back into the working model (``reset_model``)."""
        for name in self.names:
            pre = self.find(self.pretrained, name).to(self.device)
            with torch.no_grad():
                for other, param in self.model.named_parameters():
                    if other == name:
                        param += pre - param

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One mask-training step of ``train_graft``: one epoch of one micro-batch, its evaluation left out."""
        self.total_grad = None  # an epoch starts with total_grad = []
        self.interpolate()
        loss = self.model(**batch).loss
        loss.backward()
        for name, param in self.model.named_parameters():
            if name in self.names and param.grad is None:
                raise RuntimeError(f"{name} got no gradient")
        self.grad = [p.grad.detach().clone() for n, p in self.model.named_parameters() if n in self.names]
        self.model.zero_grad()  # torch >= 2 frees the gradients; the reference's torch 1.6 zeroed them in place
        self.grad = [g * d.to(self.device) for g, d in zip(self.grad, self.directions, strict=True)]
        self.total_grad = [REFERENCE_LR * g for g in self.grad]  # the first (here the only) micro-batch
        self.total_grad = [g / 1.0 for g in self.total_grad]  # the mean over the epoch's micro-batches
        self.reset()
        with torch.no_grad():
            for scores, grad, base in zip(self.scores, self.total_grad, self.base, strict=True):
                shifted = scores - SIGMOID_BIAS  # d gamma / d S, its sigmoid computed twice as there
                scores -= (1.0 - 2.0 * base) * grad * torch.sigmoid(shifted) * (1.0 - torch.sigmoid(shifted))
        return loss.detach()


def reference_graft(pre: torch.nn.Module, finetuned, device: str = "cpu") -> ReferenceGraft:
    """The reference step on ``pre`` (its working model), a copy of it (theta_pre) and ``finetuned`` (a model object,
    or a checkpoint path loaded whole: the reference holds theta_ft as a model)."""
    if isinstance(finetuned, str):
        finetuned = type(pre).from_pretrained(finetuned, dtype=pre.dtype)
    heads = None if isinstance(pre, LlamaForCausalLM) else ["classifier"]
    return ReferenceGraft(pre, copy.deepcopy(pre), finetuned, heads, SPARSITY, device)
