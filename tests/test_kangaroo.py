"""Kangaroo: lossless drafting with a trained adapter, saving and loading it (training: tests/test_train_draft.py)."""

import random
from dataclasses import dataclass, replace

import pytest
import torch

from selfspec.decoding.draft_exit import AdaptiveExit, DraftExit, ThresholdExit
from selfspec.decoding.drafters import kangaroo
from selfspec.decoding.drafters.kangaroo import KangarooDrafter, adapter_hidden
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.cache import RewindableCache
from selfspec.models.kangaroo_adapter import check_exit_layer, load_adapter, new_adapter, save_adapter
from selfspec.models.output_layer import model_logits
from selfspec.models.layouts import decoder_layers
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings

from helpers import chi_square_pvalue, exact_pair_distribution

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
ADAPTIVE = default_settings().draft.adaptive_options  # the config's adaptive rule (conf/draft/adaptive.yaml)
GREEDY = replace(SAMPLING, max_new_tokens=60)
TEXTS = ["def add(a, b):\n    return", "Hello there, how are", "import numpy as np\nx = np.",
         "class Stack:\n    def push", "The quick brown fox jumps", "for i in range(10):\n    print"]


def noisy_adapter(model, exit_layer, scale=0.05, seed=0):
    """An adapter that drafts differently from the full model (the untrained one is its layer `exit_layer`)."""
    adapter = new_adapter(model, exit_layer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return adapter


def test_untrained_adapter_after_all_but_the_last_layer_drafts_like_the_full_model(tiny, prompt):
    """The adapter then is the model's last layer and final norm: every draft must be accepted, which holds only
    if the adapter's cache gets the full model's shallow states of every verified token (past gemma2's window)."""
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    result = generate(tiny, prompt, GenerationOptions(GREEDY),
                      KangarooDrafter(tiny, new_adapter(tiny, 5), 5, DraftExit(5)))
    assert result.new_tokens == plain
    assert result.acceptance_rate == 1.0 and result.mean_accepted_tokens > 5


def test_kangaroo_greedy_equals_plain_for_exit_layers_and_policies(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    rng = random.Random(0)
    policies = [DraftExit(rng.randint(1, 8)), ThresholdExit(rng.randint(1, 8), rng.random()),
                AdaptiveExit(rng.randint(1, 12), rng.random(), **ADAPTIVE), DraftExit(rng.randint(1, 8))]
    for exit_layer, policy in zip((1, 2, 4, 5), policies):
        drafter = KangarooDrafter(tiny, noisy_adapter(tiny, exit_layer, seed=exit_layer), exit_layer, policy)
        result = generate(tiny, prompt, GenerationOptions(GREEDY), drafter)
        assert result.new_tokens == plain, (exit_layer, policy)
        assert sum(s.emitted for s in result.steps) == 59 and result.drafted > 0


@dataclass
class EveryThirdStep(DraftExit):
    """Plans a draft in every third step only."""
    steps: int = 0

    def plan(self, max_tokens: int) -> int:
        self.steps += 1
        return max_tokens if self.steps % 3 == 1 else 0


def test_kangaroo_enters_its_skip_set_only_for_steps_that_draft_and_its_adapter_catches_up(tiny, prompt, monkeypatch):
    """A step that drafts nothing leaves the layers alone; the next draft feeds the adapter what it missed."""
    entered, real = [], kangaroo.skipping
    monkeypatch.setattr(kangaroo, "skipping", lambda *args: entered.append(1) or real(*args))
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    result = generate(tiny, prompt, GenerationOptions(GREEDY),
                      KangarooDrafter(tiny, new_adapter(tiny, 5), 5, EveryThirdStep(3)))
    assert result.new_tokens == plain
    drafting = [step for step in result.steps if step.drafted]
    assert len(entered) == len(drafting) < len(result.steps)
    assert all(step.accepted == step.drafted for step in drafting)  # the untrained adapter is the last layer


def test_the_hook_goes_away_when_another_generation_runs(tiny, prompt):
    drafter = KangarooDrafter(tiny, noisy_adapter(tiny, 3), 3, DraftExit(3))
    layer = decoder_layers(tiny)[2]
    hooks = len(layer._forward_hooks)  # transformers' own output-capturing hook, once a test has asked for states
    generate(tiny, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=8)), drafter)
    assert len(layer._forward_hooks) == hooks + 1
    plain = generate(tiny, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=8)))  # another cache: the hook removes itself
    assert len(layer._forward_hooks) == hooks and drafter.cache is None
    again = generate(tiny, prompt, GenerationOptions(replace(SAMPLING, max_new_tokens=8)), drafter)
    assert again.new_tokens == plain.new_tokens


@pytest.mark.slow
def test_kangaroo_sampling_matches_the_full_models_distribution():
    """As test_speculative_sampling_matches_the_full_models_distribution, with a noisy adapter after layer 0."""
    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    prompt = [5, 40, 77]
    drafter = KangarooDrafter(model, noisy_adapter(model, 1), 1, DraftExit(2))
    exact = exact_pair_distribution(model, prompt, settings)
    gen = torch.Generator().manual_seed(0)
    counts, drafted, accepted = {}, 0, 0
    for _ in range(1000):
        result = generate(model, prompt, GenerationOptions(settings, generator=gen), drafter)
        key = tuple(result.new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    assert set(counts) <= set(exact)
    assert 0.1 < accepted / drafted < 0.9
    assert chi_square_pvalue(counts, exact) > 0.001


def test_a_saved_adapter_reloads_with_identical_draft_logits(tiny, tmp_path):
    adapter = noisy_adapter(tiny, 2)
    save_adapter(tmp_path / "adapter.pt", adapter, tiny, 2, epoch=3)
    loaded, exit_layer = load_adapter(tmp_path / "adapter.pt", tiny)
    assert exit_layer == 2
    shallow = torch.randn(7, tiny.config.hidden_size, dtype=tiny.dtype, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = [model_logits(tiny, adapter_hidden(a, RewindableCache(1, 8), shallow, 0))
                  for a in (adapter, loaded, new_adapter(tiny, 2))]  # (7, vocab) each
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])


def test_bad_exit_layers_and_adapter_paths(tiny, tmp_path):
    for bad in (0, 6, -1):  # a non-integer is refused by the typed settings (tests/test_settings.py)
        with pytest.raises(SelfspecError, match=rf"kangaroo.exit_layer={bad} is out of range; allowed: 1..5"):
            check_exit_layer(bad, 6)
    assert check_exit_layer(None, 6) == 3
    with pytest.raises(SelfspecError, match="kangaroo.adapter_path is not set"):
        load_adapter(None, tiny)
    with pytest.raises(SelfspecError, match="kangaroo.adapter_path='nope.pt' does not exist"):
        load_adapter("nope.pt", tiny)
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(SelfspecError, match="junk.pt' is not a trained draft file"):
        load_adapter(tmp_path / "junk.pt", tiny)
    save_adapter(tmp_path / "adapter.pt", new_adapter(tiny, 2), tiny, 2)
    with pytest.raises(SelfspecError, match="kangaroo.exit_layer=3 but .* trained for exit layer 2"):
        load_adapter(tmp_path / "adapter.pt", tiny, exit_layer=3)
    other = tiny_model(tiny.config.model_type, num_layers=6, seed=5).double()  # same shapes, other weights
    with pytest.raises(SelfspecError, match="adapter.pt' was trained for another model"):
        load_adapter(tmp_path / "adapter.pt", other)
