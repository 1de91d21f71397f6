"""Grouped-query attention read in the kernel (models/grouped_attention.py): a masked block of several queries no
longer copies the key/value heads, and every forward gives the logits of transformers' own sdpa attention."""

import copy

import pytest
import torch
from transformers.integrations import sdpa_attention

from selfspec.models.batch_cache import BatchCache, forward_batch
from selfspec.models.cache import forward
from selfspec.models.grouped_attention import GROUPED_SDPA, use_grouped_attention
from selfspec.models.tiny import tiny_model

PROMPTS = [[5, 40, 77], list(range(3, 23)), list(range(100, 131))]


@pytest.fixture
def copied_heads(monkeypatch) -> list[tuple]:
    """The shapes of every key/value tensor transformers' sdpa attention copies per query head (repeat_kv)."""
    shapes, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv",
                        lambda states, n: shapes.append(states.shape) or repeat_kv(states, n))
    return shapes


def batch_logits(model) -> list[torch.Tensor]:
    """Three rows past an 8-token sliding window, fed a chain, one token and a token tree in one forward."""
    batch = BatchCache(model, 3, 48)
    for row, prompt in enumerate(PROMPTS):
        forward(model, batch.view(row), prompt, 0)
    blocks, parents = [[7, 8, 9], [10], [11, 12, 13, 14]], [[-1, 0, 1], [-1], [-1, 0, 0, 1]]
    return forward_batch(model, batch, blocks, [len(prompt) for prompt in PROMPTS], parents)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_masked_block_reads_the_grouped_heads_and_gives_sdpas_logits(family, copied_heads):
    stock = tiny_model(family, sliding_window=8).double()
    grouped = copy.deepcopy(stock)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    expected = batch_logits(stock)
    assert copied_heads  # transformers copies the heads for the 3- and 4-token blocks
    copied_heads.clear()
    for row, logits in enumerate(batch_logits(grouped)):
        torch.testing.assert_close(logits, expected[row], rtol=1e-12, atol=1e-12)
    assert not copied_heads


def test_a_model_off_sdpa_keeps_its_attention():
    model = tiny_model("gemma2")  # eager: Gemma-2's soft-capped attention has no sdpa
    assert not use_grouped_attention(model) and model.config._attn_implementation == "eager"
