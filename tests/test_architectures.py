"""Every architecture of the layout registry (models/layouts.py) on a tiny random model of it, in float32, built
offline from transformers' config classes: skipping a sublayer removes exactly its contribution (sequential,
parallel-residual and MoE blocks, OPT's inline MLP), greedy decoding equals plain decoding and transformers' own
`generate` past every sliding window, every strategy of the registry keeps greedy output (slow), sampled decoding keeps
the full model's distribution on an MoE and a parallel-residual model (slow), and what a layout cannot do is refused in
one line."""

import copy
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from selfspec.decoding.costs import sublayer_ms
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.layer_skip import SelfDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import REGISTRY, make_strategy
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.feature_head import new_feature_head, save_feature_head
from selfspec.models.kangaroo_adapter import new_adapter, save_adapter
from selfspec.models.layouts import LAYOUTS, decoder_layers, describe, layout_of, sublayer_modules
from selfspec.models.skip import skipping
from selfspec.models.tiny import tiny_model
from selfspec.models.token_store import save_token_store
from selfspec.settings import default_settings, make_skip_set
from selfspec.settings.groups import TINY_FAMILIES

from helpers import chi_square_pvalue, exact_pair_distribution, hf_greedy

WINDOW, LAYERS = 8, 4
TINY_FAMILY = {"gemma3_text": "gemma3"}  # model_type -> tiny_model family, where they differ
FAMILIES = [*(TINY_FAMILY.get(model_type, model_type) for model_type in LAYOUTS), "llama3"]  # llama3: RoPE scaling
PROMPT = list(range(3, 40)) * 2  # 74 tokens, far past the window; repeats itself, so copies have matches
DEFAULTS = default_settings()
GREEDY = replace(DEFAULTS.sampling, max_new_tokens=20)
DRAFT = replace(DEFAULTS.draft, policy="fixed", max_tokens=3, hybrid_policy="fixed", ngram_tokens=4, tree_nodes=6,
                tree_depth=3, tree_width=2, head=None)
SKIP = make_skip_set([1, 2], [0, 2], LAYERS)  # layer 2 whole
TRAINED_PART_STRATEGIES = {"kangaroo", "self_spec_head"}  # a Kangaroo adapter, a feature head: one-layer copies
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models are overhead-bound


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, num_layers=LAYERS, sliding_window=WINDOW)


def variant(family: str, **config) -> torch.nn.Module:
    """The tiny `family` model with other block settings (a post-norm OPT, a sequential GPT-NeoX, ...)."""
    base = tiny_model(family, num_layers=LAYERS, sliding_window=WINDOW)
    changed = copy.deepcopy(base.config)
    for key, value in config.items():
        setattr(changed, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(changed).eval()


def logits(model, ids=PROMPT[:30]):
    return forward(model, new_cache(model, 64), ids, 0)  # (q, vocab)


def zeroed(output):
    """A sublayer's output with its contribution zeroed: (hidden, weights) or hidden."""
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


def logits_with_zeroed(model, sublayers: list[tuple[int, str]]) -> torch.Tensor:
    """The reference for a skip: the full model with each (layer, kind) sublayer's output replaced by zeros."""
    layers = decoder_layers(model)
    handles = [sublayer_modules(model, layers[i], kind)[-1].register_forward_hook(lambda m, args, out: zeroed(out))
               for i, kind in sublayers]
    try:
        return logits(model)
    finally:
        for handle in handles:
            handle.remove()


def test_every_registered_architecture_has_a_tiny_model():
    for model_type in LAYOUTS:
        family = TINY_FAMILY.get(model_type, model_type)
        assert family in TINY_FAMILIES
        assert tiny_model(family, num_layers=2).config.model_type == model_type


def assert_skips_contribute_nothing(model) -> None:
    """Skipping equals the full model with those sublayers' outputs zeroed: attention alone, the MLP alone (MoE blocks,
    OPT's fc1/fc2), both of one layer (a pass-through where the layout allows)."""
    full = logits(model)
    for attn, mlp in (([1], []), ([], [2]), ([2], [2])):
        with skipping(model, make_skip_set(attn, mlp, LAYERS)):
            skipped = logits(model)
        reference = logits_with_zeroed(model, [(i, "attn") for i in attn] + [(i, "mlp") for i in mlp])
        torch.testing.assert_close(skipped, reference)
        assert not torch.allclose(skipped, full)
    torch.testing.assert_close(logits(model), full)  # the model is whole again


def test_a_skipped_sublayer_contributes_exactly_nothing(model):
    assert_skips_contribute_nothing(model)


@pytest.mark.parametrize("family, config", [
    ("opt", dict(do_layer_norm_before=False)),  # OPT-350m: norms on the residual stream, so no whole-layer swap
    ("gpt_neox", dict(use_parallel_residual=False)),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # Falcon-40B: two norms, parallel
    ("falcon", dict(parallel_attn=False)),
], ids=["opt_post_norm", "neox_sequential", "falcon_new_decoder", "falcon_sequential"])
def test_a_skipped_sublayer_contributes_nothing_in_other_block_variants(family, config):
    assert_skips_contribute_nothing(variant(family, **config))


def test_greedy_decoding_equals_plain_and_hf_generate_past_the_window(model):
    plain = generate(model, PROMPT, GenerationOptions(GREEDY)).new_tokens
    assert plain == hf_greedy(model, PROMPT, GREEDY.max_new_tokens)
    for name in ("self_spec_fixed", "self_spec_tree", "prompt_lookup_tree"):
        result = make_strategy(name, model, GenerationOptions(GREEDY), skip=SKIP, draft=DRAFT).generate(PROMPT)
        assert result.new_tokens == plain and result.drafted > 0, name


@pytest.mark.parametrize("family, config, said", [
    ("gpt_neox", {}, "GPT-NeoX (gpt_neox): 4 layers, parallel residual"),
    ("gpt_neox", dict(use_parallel_residual=False), "GPT-NeoX (gpt_neox): 4 layers, sequential"),
    ("falcon", {}, "Falcon (falcon): 4 layers, parallel residual"),
    ("falcon", dict(parallel_attn=False), "Falcon (falcon): 4 layers, sequential"),
    ("gemma3", {}, "Gemma-3 (text) (gemma3_text): 4 layers, sequential"),
])
def test_describe_says_the_family_and_block(family, config, said):
    assert describe(variant(family, **config)) == said


def test_the_cost_meter_times_every_sublayer(model):
    cache = new_cache(model, len(PROMPT) + 2)
    forward(model, cache, PROMPT, 0)
    attn, mlp = sublayer_ms(model, lambda: forward(model, cache, [5], len(PROMPT)))
    assert len(attn) == len(mlp) == LAYERS and min(attn + mlp) > 0


@pytest.mark.parametrize("family", [model_type for model_type, layout in LAYOUTS.items() if not layout.trained_parts])
def test_trained_parts_are_refused_in_one_line_where_a_one_layer_copy_cannot_compute_as_the_layer(family):
    model = tiny_model(family, num_layers=2)
    for build, what in ((lambda: new_adapter(model, 1), "a Kangaroo adapter"),
                        (lambda: new_feature_head(model), "a feature head")):
        with pytest.raises(SelfspecError, match=f"^{what} is not supported for {LAYOUTS[family].family} models") as err:
            build()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", [model_type for model_type, layout in LAYOUTS.items() if not layout.hf_assisted])
def test_hf_assisted_generation_baselines_are_refused_in_one_line_where_transformers_fails(family):
    model = tiny_model(family, num_layers=2)
    for name in ("hf_early_exit", "hf_assistant"):
        with pytest.raises(SelfspecError, match=f"^strategy {name} \\(transformers' assisted generation\\) fails on "
                                                f"{LAYOUTS[family].family} models") as err:
            make_strategy(name, model, GenerationOptions(GREEDY), skip=SKIP, draft=DRAFT, draft_model=model)
        assert "\n" not in str(err.value)


def test_a_falcon_with_alibi_positions_is_refused_in_one_line():
    with pytest.raises(SelfspecError, match=r"^model FalconForCausalLM: Falcon with ALiBi positions \(alibi=true: "
                                            r"Falcon-RW\) is not supported; supported: Llama") as err:
        generate(variant("falcon", alibi=True), PROMPT, GenerationOptions(GREEDY))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_every_strategy_keeps_greedy_output(model, tokenizer, tmp_path):
    """Every registered strategy but HF's own decodes as plain decoding; the trained-part strategies with an
    untrained adapter and head where the layout allows them, else they are refused in one line; the token store
    (every layout: it has no layer) holds the model's own output for another prompt."""
    plain = generate(model, PROMPT, GenerationOptions(GREEDY)).new_tokens
    save_token_store(tmp_path / "store.pt", [generate(model, PROMPT[1:], GenerationOptions(GREEDY)).new_tokens], model)
    draft = replace(DRAFT, store=str(tmp_path / "store.pt"))
    inputs = dict(skip=SKIP, draft=draft, costs=None, draft_model=tiny_model("llama", num_layers=2, seed=1),
                  searched=(make_skip_set([3], [1], LAYERS), make_draft_vocabulary(model, tokenizer, 64, ["def f(x): x"])))
    trained = layout_of(model).trained_parts
    if trained:
        save_adapter(tmp_path / "adapter.pt", new_adapter(model, 2), model, 2)
        save_feature_head(tmp_path / "head.pt", new_feature_head(model), model)
        inputs |= dict(kangaroo=replace(DEFAULTS.kangaroo, adapter_path=str(tmp_path / "adapter.pt")),
                       draft=replace(draft, head=str(tmp_path / "head.pt")))
    for name in (spec.name for spec in REGISTRY.values() if not spec.hf_baseline):
        if name in TRAINED_PART_STRATEGIES and not trained:
            with pytest.raises(SelfspecError):
                make_strategy(name, model, GenerationOptions(GREEDY), **inputs)
            continue
        result = make_strategy(name, model, GenerationOptions(GREEDY), **inputs).generate(PROMPT)
        assert result.new_tokens == plain, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_neox"])  # an MoE and a parallel-residual model
def test_speculative_sampling_keeps_the_full_models_distribution(family):
    """Chi-square goodness of fit of (token 2, token 3), both decided inside one speculative step, against the exact
    distribution of plain sampling (as tests/test_decoding.py on the tiny Llama)."""
    model = tiny_model(family, num_layers=2, hidden_size=32, seed=3, init_std=0.3)
    settings = replace(DEFAULTS.sampling, temperature=1.0, top_k=3, max_new_tokens=3)
    prompt = [5, 40, 77]
    drafter = SelfDrafter(model, make_skip_set([], [1], 2), DraftExit(2))
    exact = exact_pair_distribution(model, prompt, settings)
    generator = torch.Generator().manual_seed(0)
    counts, drafted, accepted = {}, 0, 0
    for _ in range(1000):
        result = generate(model, prompt, GenerationOptions(settings, generator=generator), drafter)
        key = tuple(result.new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    assert set(counts) <= set(exact)
    assert 0.1 < accepted / drafted < 0.9  # both acceptance and rejection are exercised
    assert chi_square_pvalue(counts, exact) > 0.001
