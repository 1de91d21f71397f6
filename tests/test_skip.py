import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache
from selfspec.models.layouts import decoder_layers
from selfspec.models.skip import SkippedLayer, skipping
from selfspec.settings import make_skip_set


def logits(model, ids):
    return forward(model, new_cache(model, 64), ids, 0)


def test_empty_skip_set_gives_exactly_the_full_logits(tiny, prompt):
    full = logits(tiny, prompt)
    with skipping(tiny, make_skip_set([], [], 6)):
        assert torch.equal(logits(tiny, prompt), full)


@pytest.mark.parametrize("attn,mlp", [([2], []), ([], [3]), ([1, 4], [4])])
def test_skipping_changes_logits_and_restores_the_model(tiny, prompt, attn, mlp):
    full = logits(tiny, prompt)
    modules = list(tiny.modules())
    with skipping(tiny, make_skip_set(attn, mlp, 6)):
        assert not torch.allclose(logits(tiny, prompt), full)
    assert list(tiny.modules()) == modules
    assert torch.equal(logits(tiny, prompt), full)


def test_skipped_sublayer_is_identity_on_the_residual(tiny, prompt):
    """Skipping attention and MLP of one layer equals swapping that layer for a pass-through."""
    with skipping(tiny, make_skip_set([3], [3], 6)):
        assert isinstance(decoder_layers(tiny)[3], SkippedLayer)
        both = logits(tiny, prompt)
    layers = decoder_layers(tiny)
    kept = layers[3]
    layers[3] = SkippedLayer()
    try:
        torch.testing.assert_close(logits(tiny, prompt), both)
    finally:
        layers[3] = kept


def test_skipped_attention_writes_nothing_into_the_cache(tiny, prompt):
    cache = new_cache(tiny, 64)
    forward(tiny, cache, prompt, 0)
    n = len(prompt)
    with skipping(tiny, make_skip_set([1, 2], [], 6)):
        forward(tiny, cache, [5], n)
    for i, layer in enumerate(cache.layers):
        written = bool(layer.key_buffer[0, :, n].abs().sum() > 0)
        assert written == (i not in (1, 2)), i


@pytest.mark.parametrize("attn,mlp,message", [
    ([6], [], "layer id 6 is out of range; allowed: 0..5"),
    ([-1], [], "layer id -1 is out of range"),
    ([], [1, 1], "layer ids [1] appear more than once"),
    (["2"], [], "'2' is not an integer"),
    ([1.5], [], "1.5 is not an integer"),
    (list(range(6)), list(range(6)), "skips all 12 sublayers"),
])
def test_bad_skip_sets_are_rejected_with_the_value(attn, mlp, message):
    with pytest.raises(SelfspecError, match="^attn: |^mlp: |^skip set") as error:
        make_skip_set(attn, mlp, 6)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
