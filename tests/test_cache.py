"""The rewindable cache's sliding-window layers: what they hand attention, and lossless decoding past the window."""

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import make_strategy
from selfspec.models.attention_masks import MODEL_WINDOWS, mask_windows, model_attention_masks
from selfspec.models.cache import RewindableCache, forward, new_cache
from selfspec.models.tiny import tiny_model
from selfspec.settings import SkipSet, default_settings

from helpers import assert_cache_holds, hf_greedy, run_settings

WINDOW = 8  # shorter than every prompt here
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def model(request):
    return tiny_model(request.param, num_layers=4, sliding_window=WINDOW).double()


def handed_to_attention(cache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Record, per layer, the (keys, values) each `update` of `cache` returns to attention."""
    seen = [[] for _ in cache.layers]
    for layer, record in zip(cache.layers, seen):
        def update(*args, _update=layer.update, _record=record, **kwargs):
            _record.append(_update(*args, **kwargs))
            return _record[-1]
        layer.update = update
    return seen


def test_sliding_layers_hand_attention_what_transformers_sliding_cache_does(model, prompt):
    ours, theirs = new_cache(model, 64), DynamicCache(config=model.config)
    ours_seen, theirs_seen = handed_to_attention(ours), handed_to_attention(theirs)
    tokens = prompt + list(range(40, 46))
    assert len(prompt) > WINDOW
    start = 0
    for chunk in (prompt, tokens[len(prompt):len(prompt) + 1], tokens[len(prompt) + 1:len(prompt) + 4],
                  tokens[len(prompt) + 4:]):  # a prefill past the window, a 1-token and a 3-token step, then 2 more
        sizes = [(ours.get_mask_sizes(len(chunk), i), theirs.get_mask_sizes(len(chunk), i))
                 for i in range(len(ours.layers)) if i < len(theirs.layers)]
        assert all(a == b for a, b in sizes), sizes
        forward(model, ours, chunk, start)
        with torch.inference_mode():
            model(input_ids=torch.tensor([chunk]), past_key_values=theirs, use_cache=True)
        start += len(chunk)
    assert ours.is_sliding == theirs.is_sliding and any(ours.is_sliding) and not all(ours.is_sliding)
    for mine, ref, sliding in zip(ours_seen, theirs_seen, ours.is_sliding):
        assert len(mine) == len(ref) == 4
        for (k, v), (k_ref, v_ref) in zip(mine, ref):
            torch.testing.assert_close(k, k_ref)
            torch.testing.assert_close(v, v_ref)
        if sliding:  # the last step saw window - 1 cached keys plus its own 2, not the whole prefix
            assert mine[-1][0].shape[-2] == WINDOW + 1 < len(tokens)


def test_a_rewind_past_the_window_restores_the_cache_a_fresh_run_builds(model, prompt):
    cache = new_cache(model, 64)
    forward(model, cache, prompt, 0)
    forward(model, cache, [40, 41, 42, 43, 44], len(prompt))  # a draft, rejected after its first two tokens
    logits = forward(model, cache, [41, 50], len(prompt) + 1)  # rewinds to keep [prompt, 40]
    assert_cache_holds(model, cache, prompt + [40, 41, 50])
    fresh = new_cache(model, 64)
    expected = forward(model, fresh, prompt + [40, 41, 50], 0)[-2:]
    torch.testing.assert_close(logits, expected)


def test_rewindable_cache_takes_one_window_per_layer():
    cache = RewindableCache(3, 16, [4, None, 4])
    assert cache.is_sliding == [True, False, True]
    assert cache.get_mask_sizes(1, 0) == (1, 0)
    with pytest.raises(ValueError, match="2 sliding windows for 3 layers"):
        RewindableCache(3, 16, [4, None])


@pytest.mark.parametrize("family, windows", [("llama", None), ("mistral", 8), ("qwen2", {"full_attention": None,
                                                                                      "sliding_attention": 8}),
                                              ("gemma3", {"full_attention": None, "sliding_attention": 8})])
def test_a_models_masks_follow_its_layer_types_read_once(family, windows):
    """One mask (full, or Mistral's model-wide window), or one per layer type (Qwen2's mixed layers, Gemma-3); read
    from transformers' layer types once a model, as the read costs more than the mask."""
    model = tiny_model(family, sliding_window=8)
    assert mask_windows(model.config) == windows
    masks = model_attention_masks(model, [[-1, 0, 0]], [20], 23, windowed_keys=False)
    assert MODEL_WINDOWS[model] == windows
    if isinstance(windows, dict):
        assert set(masks) == set(windows)
        assert not torch.equal(masks["full_attention"], masks["sliding_attention"])  # keys 0..12 fall out of the window
    else:
        assert masks.shape == (1, 1, 3, 23)


@pytest.mark.parametrize("name", ["self_spec", "prompt_lookup", "prompt_lookup_tree", "self_spec_tree"])
def test_drafting_strategies_equal_plain_and_hf_generate_past_the_window(model, tokenizer, name):
    prompt = tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids  # repeats to copy
    settings = replace(default_settings().sampling, max_new_tokens=40)
    plain = generate(model, prompt, GenerationOptions(settings)).new_tokens
    assert plain == hf_greedy(model, prompt, 40)
    draft = run_settings("draft.hybrid_policy=fixed").draft  # drafts whatever this machine's costs (a loaded CI box)
    strategy = make_strategy(name, model, GenerationOptions(settings), skip=SkipSet((1,), (2,)), draft=draft)
    result = strategy.generate(prompt)
    assert result.new_tokens == plain
    assert sum(s.accepted for s in result.steps) > 0  # drafts were kept, and rejected ones rewound
    assert any(s.accepted < s.drafted for s in result.steps)
