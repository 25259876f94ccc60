"""Prompt-based classification heads: score label words with a masked or causal language model.

The paper's main setting is prompt-based fine-tuning of a masked LM (LM-BFF, Gao et al. 2021, without
demonstrations): the input is a template such as ``"<sentence> It was <mask>."`` and the class logits are the LM's
logits of the label words (e.g. ``" terrible"``, ``" great"``) at the mask. For a causal LM (appendix B.5, GPT-2) the
logits of the label words are read at the last token of the prompt (e.g. ``"Review: <sentence> Sentiment:"``).

:class:`LabelWordClassifier` wraps the language model so that it returns ``(batch, num_labels)`` logits and a
cross-entropy loss like a sequence classifier: ``Trainer``, ``MaskTrainer`` and grafts (``get_peft_model`` on the
wrapper) then work unchanged. Its parameters are exactly those of the language model, under the prefix ``lm.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import SequenceClassifierOutput

__all__ = ["PROMPT_HEADS", "LabelWordClassifier", "label_word_ids"]

PromptHead = Literal["mlm", "causal"]
PROMPT_HEADS: tuple[str, ...] = ("mlm", "causal")


def label_word_ids(tokenizer: PreTrainedTokenizerBase, label_words: Sequence[str]) -> list[int]:
    """The token id of each label word; every word must be exactly one token of ``tokenizer``.

    Leading spaces matter for byte-level BPE tokenizers (RoBERTa, GPT-2, Llama): ``" great"`` is usually one token
    where ``"great"`` is another.
    """
    if isinstance(label_words, str) or not label_words:
        raise TypeError(f"label_words must be a non-empty list of words, got {label_words!r}.")
    ids = []
    for word in label_words:
        tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            pieces = tokenizer.convert_ids_to_tokens(tokens)
            raise ValueError(
                f"label_words: {word!r} is {len(tokens)} tokens {pieces} of this tokenizer, not one. Choose words "
                "that are single tokens (with byte-level BPE tokenizers, try a leading space, e.g. ' great')."
            )
        if tokenizer.unk_token_id is not None and tokens[0] == tokenizer.unk_token_id:
            raise ValueError(
                f"label_words: {word!r} is not in the tokenizer's vocabulary (it maps to the unknown token)."
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"label_words {list(label_words)} map to repeated token ids {ids}: use distinct words.")
    return ids


class LabelWordClassifier(nn.Module):
    """A masked or causal LM read as a classifier over label words.

    Args:
        lm: A ``*ForMaskedLM`` (``head="mlm"``) or ``*ForCausalLM`` (``head="causal"``) model.
        label_token_ids: One token id per class, in class order (see :func:`label_word_ids`).
        head: ``"mlm"``: logits at the (single) mask token of each row; ``"causal"``: logits at the last non-padding
            token of each row (the next-token prediction).
        mask_token_id: The tokenizer's mask token id, required for ``head="mlm"``.
    """

    accepts_loss_kwargs = False  # the loss is ours: Trainer must not pass num_items_in_batch

    def __init__(
        self,
        lm: PreTrainedModel,
        label_token_ids: Sequence[int],
        head: PromptHead,
        mask_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if head not in PROMPT_HEADS:
            raise ValueError(f"Unknown head={head!r}: use one of {PROMPT_HEADS}.")
        if head == "mlm" and mask_token_id is None:
            raise ValueError('head="mlm" needs mask_token_id (the tokenizer has no mask token?).')
        vocab = lm.get_output_embeddings().weight.shape[0] if lm.get_output_embeddings() is not None else None
        if vocab is not None and any(not 0 <= int(i) < vocab for i in label_token_ids):
            raise ValueError(f"label_token_ids {list(label_token_ids)} fall outside the LM's vocabulary of {vocab}.")
        self.lm = lm
        self.head = head
        self.mask_token_id = mask_token_id
        self.config = lm.config
        self.register_buffer("label_token_ids", torch.as_tensor(list(label_token_ids), dtype=torch.long), False)

    @property
    def num_labels(self) -> int:
        return int(self.label_token_ids.numel())

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The position read in each row: the mask token (mlm) or the last non-padding token (causal)."""
        if self.head == "mlm":
            is_mask = input_ids == self.mask_token_id
            counts = is_mask.sum(dim=1)
            if not bool((counts == 1).all()):
                raise ValueError(
                    f"Every row needs exactly one mask token for head='mlm'; found counts {counts.tolist()}: check "
                    "the template and that truncation keeps the mask."
                )
            return is_mask.float().argmax(dim=1)
        if attention_mask is None:
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
        # Index of the last 1 of the attention mask: works for left and right padding.
        return attention_mask.shape[1] - 1 - attention_mask.flip(1).float().argmax(dim=1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        kwargs.pop("num_items_in_batch", None)
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        at = logits[rows, self.positions(input_ids, attention_mask)]  # (batch, vocab)
        class_logits = at[:, self.label_token_ids.to(at.device)]
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(class_logits.float(), labels.to(class_logits.device).long())
        return SequenceClassifierOutput(loss=loss, logits=class_logits)
