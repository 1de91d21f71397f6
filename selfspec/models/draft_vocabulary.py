"""A reduced output layer for drafting: the draft scores only N token ids, the verifier all of them.

Tokens outside the draft vocabulary get probability 0 in the draft; verification with the full model is
unchanged, so greedy output and the sampled distribution stay the full model's (a draft token outside p's
support is rejected, and the residual covers every token the draft cannot propose). It pays where the
output layer is a large share of a step (Gemma-3-270M's 262k-token vocabulary).
"""

from collections import Counter
from dataclasses import dataclass

import torch

from selfspec.errors import SelfspecError
from selfspec.models.devices import loaded_weights
from selfspec.models.output_layer import LogitsFinish, logits_finish, output_logits


@dataclass
class DraftVocabulary:
    token_ids: torch.Tensor  # (n,) long, sorted
    weight: torch.Tensor  # (n, hidden): those rows of the output layer
    vocab_size: int
    finish: LogitsFinish = LogitsFinish()  # the model head's soft-capping or scaling

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(hidden,) final hidden state -> (vocab,) logits, -inf outside the draft vocabulary."""
        return self.rows_logits(hidden[None])[0]

    def rows_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) final hidden states -> (rows, vocab) logits, -inf outside the draft vocabulary."""
        full = torch.full((len(hidden), self.vocab_size), float("-inf"), device=self.weight.device)  # fp32
        full[:, self.token_ids] = output_logits(self.weight, hidden.to(self.weight.device), self.finish,
                                                fastest_row=True)
        return full


def draft_vocabulary(tokenizer, size: int, vocab_size: int, texts: list[str]) -> torch.Tensor:
    """The `size` draft token ids: special tokens, single ASCII characters, then the tokens most frequent in
    `texts` (calibration text: code and prose), then the lowest ids."""
    if not 0 < size <= vocab_size:
        raise SelfspecError(f"draft.vocab_size={size} is outside 1..{vocab_size} (this model's vocabulary)")
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    ascii_chars = [i for i, piece in enumerate(pieces)
                   if piece is not None and len(piece.lstrip("▁Ġ")) == 1 and piece.lstrip("▁Ġ").isascii()]
    counts = Counter(t for text in texts for t in tokenizer(text, add_special_tokens=False).input_ids)
    chosen = dict.fromkeys([*tokenizer.all_special_ids, *ascii_chars, *(t for t, _ in counts.most_common())])
    for i in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.setdefault(i)
    return torch.tensor(sorted(t for t in list(chosen)[:size] if t < vocab_size))


def make_draft_vocabulary(model, tokenizer, size: int, texts: list[str]) -> DraftVocabulary:
    """The rows of the model's output layer for the draft vocabulary (counted on `texts`, the caller's calibration
    text: data/prompt_sets.py `calibration_texts`), copied (in the model's dtype) onto the output
    layer's device."""
    with loaded_weights(model.get_output_embeddings()) as head:
        weight = head.weight  # (vocab, hidden)
        ids = draft_vocabulary(tokenizer, size, weight.shape[0], texts).to(weight.device)
        return DraftVocabulary(ids, weight.detach()[ids], weight.shape[0], logits_finish(model))
