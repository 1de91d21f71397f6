"""Losslessness of every registered strategy: greedy decoding equals plain decoding token for token, on the tiny Llama
and Gemma-2. The strategies come from the registry, so a new one is checked here without touching this file; the
HF generate baselines are HF's own decoding (tests/test_hf_baselines.py). With banned words on, every strategy rolls
back where plain decoding does. The strategies that take a feature head
(draft.head) draft with an untrained one here, and the hybrid and tree again with the layer-skip draft; the tree
and store_tree take a token store (draft.store) of the model's own outputs."""

from dataclasses import replace

import pytest

from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.drafters import SkippedModel
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import REGISTRY, make_strategy
from selfspec.decoding.text_rules import text_rules
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.feature_head import new_feature_head, save_feature_head
from selfspec.models.kangaroo_adapter import new_adapter, save_adapter
from selfspec.models.tiny import tiny_model
from selfspec.models.token_store import save_token_store
from selfspec.settings import default_settings, make_skip_set

from helpers import printable

DEFAULTS = default_settings()  # the config run.py composes
GREEDY = replace(DEFAULTS.sampling, max_new_tokens=24)
DRAFT = replace(DEFAULTS.draft, policy="adaptive", max_tokens=4, ngram_size=2, ngram_tokens=6, hybrid_policy="cost",
                tree_nodes=6, tree_depth=4, tree_width=3, tree_branch_below=0.6, head=None)
TEXTS = ["def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib", "The cat sat on the mat. The cat sat on"]


class PayingCosts:
    """Stands in for the CostMeter: made-up costs under which drafting pays (a draft token 1 ms, c(q) = 10 + 0.5 (q - 1)
    ms); a tiny model's measured costs on a CPU say it never does, and the cost-aware policies would not draft."""
    rows = 1

    def costs(self, skip, head=None, alone=False) -> DraftCosts:
        return DraftCosts(tuple(10.0 + 0.5 * q for q in range(16)), 0.0 if skip is None else 1.0)

    def costs_of(self, key, measure_draft_ms) -> DraftCosts:
        return self.costs(key)

    def for_batch(self, rows: int) -> "PayingCosts":
        return self


@pytest.fixture(scope="module")
def drafting_inputs(tiny, tokenizer, tmp_path_factory):
    """What any strategy may need, for one tiny model: a second tiny model to draft, an untrained Kangaroo adapter and
    feature head (their drafts are poor: the output must not change), a token store of the model's own outputs for
    the texts, a searched skip set with a reduced draft vocabulary, and costs."""
    adapter_path = tmp_path_factory.mktemp("kangaroo") / "adapter.pt"
    save_adapter(adapter_path, new_adapter(tiny, 3), tiny, 3)
    head_path, store_path = adapter_path.with_name("head.pt"), adapter_path.with_name("store.pt")
    save_feature_head(head_path, new_feature_head(tiny), tiny)
    save_token_store(store_path, [generate(tiny, tokenizer(text).input_ids, GenerationOptions(GREEDY)).new_tokens for text in TEXTS], tiny)
    return dict(skip=make_skip_set([1], [2], 6), draft=replace(DRAFT, head=str(head_path), store=str(store_path)),
                draft_model=tiny_model("llama", num_layers=2, seed=1).double(),
                kangaroo=replace(DEFAULTS.kangaroo, adapter_path=str(adapter_path)),
                searched=(make_skip_set([2, 4], [3], 6), make_draft_vocabulary(tiny, tokenizer, 64, TEXTS)),
                costs=PayingCosts())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", [spec.name for spec in REGISTRY.values() if not spec.hf_baseline])
def test_every_strategy_matches_plain(name, tiny, tokenizer, prompt, drafting_inputs):
    strategy = make_strategy(name, tiny, GenerationOptions(GREEDY), **drafting_inputs)
    drafted = 0
    for ids in (prompt, *(tokenizer(text).input_ids for text in TEXTS)):
        result = strategy.generate(ids)
        assert result.new_tokens == generate(tiny, ids, GenerationOptions(GREEDY)).new_tokens, tokenizer.decode(ids)
        drafted += result.drafted
    assert drafted > 0 or strategy.drafter is None  # a strategy that never drafted would pass by decoding plainly


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", [spec.name for spec in REGISTRY.values() if not spec.hf_baseline])
def test_every_strategy_matches_plain_in_a_batch(name, tiny, tokenizer, prompt, drafting_inputs):
    """Three prompts of different lengths decode together (decoding/batch.py): each row equals its batch-1 plain
    decoding, whatever its neighbours draft and accept."""
    strategy = make_strategy(name, tiny, GenerationOptions(GREEDY), **drafting_inputs)
    prompts = [prompt, *(tokenizer(text).input_ids for text in TEXTS)]
    results = strategy.generate_batch(prompts)
    for ids, result in zip(prompts, results):
        assert result.new_tokens == generate(tiny, ids, GenerationOptions(GREEDY)).new_tokens, tokenizer.decode(ids)
    assert sum(result.drafted for result in results) > 0 or strategy.drafter is None


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["self_spec_hybrid", "self_spec_tree"])
def test_layer_skip_hybrid_and_tree_match_plain(name, tiny, tokenizer, prompt, drafting_inputs):
    """Without draft.head, the strategies that mix copies and a model draft take the layer-skip draft."""
    strategy = make_strategy(name, tiny, GenerationOptions(GREEDY), **drafting_inputs | {"draft": DRAFT})
    assert isinstance(strategy.drafter.fallback.source, SkippedModel)
    for ids in (prompt, *(tokenizer(text).input_ids for text in TEXTS)):
        assert strategy.generate(ids).new_tokens == generate(tiny, ids, GenerationOptions(GREEDY)).new_tokens, tokenizer.decode(ids)


@pytest.fixture
def banned_rules(tiny, tokenizer, prompt):
    """Banned words that plain decoding of the prompts produces (two characters each), and a stop string that no
    output holds (its check runs on every draft)."""
    words = []
    for ids in (prompt, *(tokenizer(text).input_ids for text in TEXTS)):
        text = tokenizer.decode(generate(tiny, ids, GenerationOptions(GREEDY)).new_tokens)
        words += [pair for pair in (text[i:i + 2] for i in range(len(text) - 1)) if printable(pair)][:2]
    return text_rules(tiny, tokenizer, words, stop=["never in a random model's output"])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", [spec.name for spec in REGISTRY.values() if not spec.hf_baseline])
def test_every_strategy_matches_plain_under_banned_words(name, tiny, tokenizer, prompt, drafting_inputs, banned_rules):
    strategy = make_strategy(name, tiny, GenerationOptions(GREEDY, rules=banned_rules), **drafting_inputs)
    rollbacks = 0
    for ids in (prompt, *(tokenizer(text).input_ids for text in TEXTS)):
        plain = generate(tiny, ids, GenerationOptions(GREEDY, rules=banned_rules))
        assert strategy.generate(ids).new_tokens == plain.new_tokens, tokenizer.decode(ids)
        rollbacks += plain.rollbacks
    assert rollbacks >= 3
