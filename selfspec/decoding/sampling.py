"""Sampling settings and the logits -> distribution -> token functions shared by drafting and verification.

The filters are transformers' own logits processors; this module only decides which to apply and feeds
each row the token history it would have had in plain decoding.
"""

import torch
from transformers import (LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from selfspec.settings import SamplingSettings


def logits_processor(settings: SamplingSettings) -> LogitsProcessorList:
    """The filters plain decoding applies, in transformers' order; greedy keeps only the repetition penalty."""
    processors = LogitsProcessorList()
    if settings.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.greedy:
        return processors
    if settings.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k > 0 and settings.top_p < 1.0:
        processors.append(TopPWithinTopK(settings.top_k, settings.top_p))
    elif settings.top_k > 0:
        processors.append(TopKLogitsWarper(settings.top_k))
    elif settings.top_p < 1.0:
        processors.append(TopPLogitsWarper(settings.top_p))
    return processors


class TopPWithinTopK(LogitsProcessor):
    """transformers' TopKLogitsWarper then TopPLogitsWarper, with top-p run on the top-k columns only.

    Top-p sorts its whole input: over a large vocabulary (Gemma-3's 262k tokens) most of a step's filtering, paid per
    verified row and per sampled draft token. After top-k every other score is -inf, so top-p over the top-k columns
    cuts the same tokens. As TopKLogitsWarper, every token tied with the k-th score is kept; a row with fewer than k
    finite scores (a token store's counts) keeps its tied -inf ones at -inf without sorting the whole row."""

    def __init__(self, top_k: int, top_p: float):
        self.top_k, self.top_p = top_k, TopPLogitsWarper(top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        values, columns = scores.topk(min(self.top_k, scores.shape[-1]))  # (rows, k), largest first
        kth = values[:, -1:]  # (rows, 1)
        width = int(torch.count_nonzero((scores >= kth) & (scores > float("-inf")), dim=-1).max())
        if width > values.shape[-1]:  # ties with the k-th score
            values, columns = scores.topk(width)
            values = values.masked_fill(values < kth, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter(1, columns, self.top_p(input_ids, values))


def history_ids(tokens: list[int], first_len: int, rows: int, device) -> torch.Tensor:
    """(rows, first_len + rows - 1): row j holds tokens[:first_len + j], right-padded with its own first
    token (a repeat that the set-based repetition penalty ignores)."""
    width = first_len + rows - 1
    ids = torch.full((rows, width), tokens[0], dtype=torch.long)
    for j in range(rows):
        ids[j, : first_len + j] = torch.tensor(tokens[: first_len + j])
    return ids.to(device)


def scores(logits: torch.Tensor, tokens: list[int], first_len: int, processor: LogitsProcessorList) -> torch.Tensor:
    """Filtered scores (rows, vocab) for rows predicting positions first_len, first_len + 1, ..."""
    if not processor:
        return logits
    return processor(history_ids(tokens, first_len, logits.shape[0], logits.device), logits.clone())


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a (vocab,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def kept_q(probs: torch.Tensor) -> torch.Tensor:
    """A draft token's q (vocab,) as the draft keeps it until verification: sparse over its nonzero entries where
    that is smaller (a sparse entry holds a 64-bit index beside its value; after top-k at most k of Gemma-3's 262k
    are nonzero), else probs itself."""
    nonzero, value_bytes = int(torch.count_nonzero(probs)), probs.element_size()
    return probs.to_sparse() if nonzero * (8 + value_bytes) < probs.numel() * value_bytes else probs


def one_hot_q(tokens: list[int], vocab_size: int, device) -> list[torch.Tensor]:
    """Each token's q (vocab,) for deterministic drafts (copies, tables, pools), sparse: sampled verification accepts
    x with probability p(x), else resamples from p without x."""
    return [torch.sparse_coo_tensor([[token]], [1.0], (vocab_size,), device=device, is_coalesced=True,
                                    check_invariants=True) for token in tokens]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to resample after rejecting a draft token; p itself if p == q. q dense or sparse."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for draft tokens x drawn from q."""
    return (p_x / q_x).clamp(max=1.0)
