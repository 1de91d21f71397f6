"""The feature-level draft head: it reads the full model's states of exactly the kept tokens (chains and trees, past
gemma2's window), decodes losslessly, samples exactly, and is refused for another model or a damaged shipped file."""

import json
from dataclasses import replace

import pytest
import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import ChainDrafter, HeadFeatures, TreeDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models import trained_parts
from selfspec.models.cache import RewindableCache
from selfspec.models.cache_files import file_sha256
from selfspec.models.feature_head import (inner_states, load_feature_head, loaded_feature_head, new_feature_head,
                                         save_feature_head)
from selfspec.models.grouped_attention import use_grouped_attention
from selfspec.models.tiny import tiny_model
from selfspec.models.trained_parts import ship_part
from selfspec.settings import default_settings

from helpers import chi_square_pvalue, exact_pair_distribution

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
GREEDY = replace(SAMPLING, max_new_tokens=40)
CLOSE = dict(rtol=1e-4, atol=1e-5)  # gemma2's norms compute in float32 even in a float64 model; a state at the
# wrong position differs by about 1


def noisy_head(model, scale=0.05, seed=0, fused_layers=()):
    head = new_feature_head(model, fused_layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return head.eval()


class CheckedFeatures(HeadFeatures):
    """At each draft's first head step: the kept states (final, and after the head's fused layers) equal a fresh
    forward of the full model over the kept tokens, and the head's prediction equals the head run afresh over the
    whole sequence (no cache). With `oracle`, the draft then takes the full model's own next-token logits with its
    top two swapped at every other position, so that trees accept paths off their first branch, which move."""
    checks = 0

    def __init__(self, model, head, oracle=False):
        super().__init__(model, head)
        self.oracle = oracle

    def next_logits(self, ids, start):
        logits = super().next_logits(ids, start)
        with torch.inference_mode():
            if start == len(self.tokens) - 1:
                self.history = list(self.tokens)
                kept = torch.tensor([self.tokens[:-1]])  # (1, start)
                out = self.model.model(kept, output_hidden_states=True)
                truth = out.last_hidden_state[0]  # (start, hidden)
                torch.testing.assert_close(self.features[:start], truth, **CLOSE)
                inner = None
                if self.head.fused_layers:
                    fused = [out.hidden_states[n][0] for n in self.head.fused_layers]  # (start, hidden) each
                    inner = inner_states(fused)  # (start, n x hidden)
                    torch.testing.assert_close(self.inner[:start], inner, **CLOSE)
                    inner = inner[None]
                embeds = self.model.get_input_embeddings()(torch.tensor([self.tokens[1:]]))
                afresh = self.head(truth[None], embeds, torch.arange(start)[None], inner=inner)[0, -1]
                torch.testing.assert_close(self.predicted, afresh, **CLOSE)
                self.checks += 1
            else:
                self.history += ids
            if self.oracle:
                logits = self.model(torch.tensor([self.history])).logits[0, -1].float()
                if len(self.history) % 2:
                    top = logits.topk(2).indices
                    logits[top] = logits[top.flip(0)]
        return logits


@pytest.mark.parametrize("layout", ["llama", "gemma2"])
@pytest.mark.parametrize("fused_layers", [(), (2, 4)])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_head_reads_the_states_of_exactly_the_kept_tokens_and_decodes_losslessly(layout, fused_layers, tree,
                                                                                    monkeypatch):
    """Past gemma2's 16-token window; a tree branches at every position (`branch_below` 1), and its drafts' top
    two are swapped at every other position, so accepted paths leave the first branch and their states move. A model
    of its own: the check's output_hidden_states leaves transformers' capturing hooks on every layer."""
    tiny = tiny_model(layout, num_layers=6).double()
    use_grouped_attention(tiny)
    features = CheckedFeatures(tiny, noisy_head(tiny, fused_layers=fused_layers), oracle=True)
    drafter = TreeDrafter(features, DraftExit(3), nodes=8, depth=3, width=2, branch_below=1.0) if tree \
        else ChainDrafter(features, DraftExit(3))
    compact, moved = RewindableCache.compact, []

    def counted(cache, first, sources):
        moved.append(sources != list(range(first, first + len(sources))))
        compact(cache, first, sources)
    monkeypatch.setattr(RewindableCache, "compact", counted)
    prompt = [5, 40, 77, 9, 120, 33]
    result = generate(tiny, prompt, GenerationOptions(GREEDY), drafter)
    assert result.new_tokens == generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    assert features.checks >= 8 and result.accepted >= 8
    assert sum(moved) >= (8 if tree else 0)


@pytest.mark.slow
def test_head_sampling_matches_the_full_models_distribution():
    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    prompt = [5, 40, 77]
    drafter = ChainDrafter(HeadFeatures(model, noisy_head(model, 0.3)), DraftExit(2))
    exact = exact_pair_distribution(model, prompt, settings)
    gen = torch.Generator().manual_seed(0)
    counts, drafted, accepted = {}, 0, 0
    for _ in range(1000):
        result = generate(model, prompt, GenerationOptions(settings, generator=gen), drafter)
        key = tuple(result.new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    assert set(counts) <= set(exact)
    assert drafted > 0 and accepted / drafted < 0.95  # an untrained head's top-3 rarely meets the model's: the residual
    # sampling after rejections carries the distribution here (test_every_strategy and the tree tests accept drafts)
    assert chi_square_pvalue(counts, exact) > 0.001


def test_a_saved_head_reloads_with_identical_predictions(tiny, tmp_path):
    head = noisy_head(tiny)
    save_feature_head(tmp_path / "head.pt", head, tiny, epoch=3)
    loaded = load_feature_head(tmp_path / "head.pt", tiny)
    features, embeds = torch.randn(1, 5, 64, dtype=tiny.dtype), torch.randn(1, 5, 64, dtype=tiny.dtype)
    positions = torch.arange(5)[None]
    with torch.inference_mode():
        torch.testing.assert_close(loaded(features, embeds, positions), head(features, embeds, positions))


def test_heads_are_refused_for_another_model_or_kind_in_one_line(tiny, tmp_path):
    other = tiny_model("llama", num_layers=6, seed=7).double()
    save_feature_head(tmp_path / "head.pt", new_feature_head(other), other)
    with pytest.raises(SelfspecError, match="trained for another model") as error:
        load_feature_head(tmp_path / "head.pt", tiny)
    assert "\n" not in str(error.value)
    with pytest.raises(SelfspecError, match="does not exist"):
        load_feature_head(tmp_path / "missing.pt", tiny)
    (tmp_path / "junk.pt").write_text("not a head")
    with pytest.raises(SelfspecError, match="is not a trained draft file"):
        load_feature_head(tmp_path / "junk.pt", tiny)
    with pytest.raises(SelfspecError, match="no feature draft ships for this model"):
        load_feature_head("shipped", tiny)
    assert loaded_feature_head(tiny, "shipped") is None  # the default of a model without one: the layer-skip draft


def test_a_shipped_head_is_found_by_its_model_and_checked_against_its_sha256(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(trained_parts, "SHIPPED_DIR", tmp_path)
    head = noisy_head(tiny)
    save_feature_head(tmp_path / "head.pt", head, tiny, epoch=3, made_by={"command": "python run.py ..."})
    ship_part(tmp_path / "head.pt", "tiny-feature", tmp_path)
    info = json.loads((tmp_path / "tiny-feature.json").read_text())
    assert info["model"] == trained_parts.model_signature(tiny) and info["epoch"] == 3 and info["made_by"]
    assert info["sha256"] == file_sha256(tmp_path / "tiny-feature.pt")
    loaded = load_feature_head("shipped", tiny)
    assert torch.equal(loaded.fuse.weight, head.fuse.weight.half().to(tiny.dtype))  # shipped in float16
    assert not torch.equal(loaded.fuse.weight, head.fuse.weight)
    (tmp_path / "tiny-feature.json").write_text(json.dumps(info | {"sha256": "0" * 64}))
    with pytest.raises(SelfspecError, match="does not match its sha256"):
        load_feature_head("shipped", tiny)
