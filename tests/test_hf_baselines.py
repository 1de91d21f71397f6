"""HF generate baselines: greedy equals our plain decoding, honest step records, seeded sampling, memory probe, and
the stock baseline runs nn.Linear on a copy sharing every other weight."""

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from selfspec.data.prompt_sets import encode_prompt, load_prompts
from selfspec.decoding.hf_baselines import HF_STRATEGIES, make_hf_strategy
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import Strategy, make_strategy
from selfspec.errors import SelfspecError
from selfspec.evaluation.evaluate import measure_peak_memory
from selfspec.models.loading import load_model
from selfspec.models.grouped_attention import GROUPED_SDPA, use_grouped_attention
from selfspec.models.packed_linear import PackedLinear, pack_linears, pack_output_layer
from selfspec.models.layouts import decoder_layers
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings, make_skip_set

from helpers import run_settings

DEFAULTS = default_settings()
SAMPLING = DEFAULTS.sampling  # the config's: greedy, 128 new tokens
GREEDY = replace(SAMPLING, max_new_tokens=40)
SAMPLE = replace(SAMPLING, temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=30)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=6).double()


@pytest.fixture(scope="module")
def draft():
    """A second tiny model on the same byte vocabulary."""
    return tiny_model("llama", num_layers=2, seed=1).double()


def strategies(model, settings, draft, end_ids=(), **kwargs):
    return [make_hf_strategy(name, model, GenerationOptions(settings, end_ids=end_ids),
                             draft_model=draft, **kwargs) for name in HF_STRATEGIES]


def test_greedy_outputs_equal_plain_and_steps_add_up(tiny, draft, prompt):
    """Llama and Gemma-2 (16-token sliding window, crossed here) in float64."""
    plain = Strategy("plain", tiny, GenerationOptions(GREEDY)).generate(prompt)
    for strategy in strategies(tiny, GREEDY, draft):
        result = strategy.generate(prompt)
        assert result.new_tokens == plain.new_tokens, strategy.name
        assert all(s.accepted <= s.drafted for s in result.steps)
        if strategy.name in ("hf_generate", "hf_generate_stock"):  # a forward per token after the prefill, as ours
            assert len(result.steps) == 39 and result.drafted == 0 and result.prefill_s > 0
        else:  # assisted: the prefill is the first verify forward, every token comes from a step
            assert sum(s.emitted for s in result.steps) == 40 and result.drafted > 0


def test_early_exit_reads_draft_length_from_generation_config(llama, prompt):
    for k in (1, 3):  # fixed-length drafts (threshold 0): k tokens per step
        result = make_hf_strategy("hf_early_exit", llama, GenerationOptions(GREEDY),
                                  early_exit_layer=3, num_assistant_tokens=k, confidence_threshold=0).generate(prompt)
        produced = [sum(s.emitted for s in result.steps[:i]) for i in range(len(result.steps))]
        assert [s.drafted for s in result.steps] == [min(k, 40 - n - 1) for n in produced]  # HF caps at the length
    # all layers: the draft is the full model, so every draft is accepted
    full = make_hf_strategy("hf_early_exit", llama, GenerationOptions(GREEDY), early_exit_layer=6,
                            num_assistant_tokens=4, confidence_threshold=0).generate(prompt)
    assert full.accepted == full.drafted > 0 and full.new_tokens == Strategy("plain", llama,
                                                                             GenerationOptions(GREEDY)).generate(
        prompt).new_tokens


def test_generation_configs_are_restored(llama, draft, prompt):
    llama.generation_config.num_assistant_tokens = 17
    before = (llama.generation_config.to_dict(), draft.generation_config.to_dict())
    for strategy in strategies(llama, GREEDY, draft):
        strategy.generate(prompt)
    assert (llama.generation_config.to_dict(), draft.generation_config.to_dict()) == before
    assert not hasattr(llama, "__dict__") or "_get_candidate_generator" not in llama.__dict__
    llama.generation_config.num_assistant_tokens = None


def test_eos_stops_every_strategy_where_plain_stops(tiny, draft, prompt):
    full = Strategy("plain", tiny, GenerationOptions(GREEDY)).generate(prompt).new_tokens
    eos = full[25]
    expected = full[: full.index(eos) + 1]
    assert Strategy("plain", tiny, GenerationOptions(GREEDY, end_ids=(eos,))).generate(prompt).new_tokens == expected
    for strategy in strategies(tiny, GREEDY, draft, (eos,)):
        assert strategy.generate(prompt).new_tokens == expected, strategy.name


def test_sampling_is_reproducible_and_leaves_the_global_rng_alone(llama, draft, prompt):
    for strategy in strategies(llama, SAMPLE, draft):
        state = torch.get_rng_state()
        first = strategy.generate(prompt, torch.Generator().manual_seed(3)).new_tokens
        again = strategy.generate(prompt, torch.Generator().manual_seed(3)).new_tokens
        other = strategy.generate(prompt, torch.Generator().manual_seed(4)).new_tokens
        assert torch.equal(torch.get_rng_state(), state)
        assert len(first) == 30 and first == again and first != other, strategy.name


def test_bad_names_and_settings_raise(llama):
    with pytest.raises(SelfspecError, match="hf_generate, hf_generate_stock, hf_prompt_lookup, hf_early_exit, "
                                            "hf_assistant"):
        make_hf_strategy("hf_beam", llama, GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="draft model"):
        make_hf_strategy("hf_assistant", llama, GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="outside 1..6"):
        make_hf_strategy("hf_early_exit", llama, GenerationOptions(GREEDY), early_exit_layer=7)
    assert make_hf_strategy("hf_early_exit", llama, GenerationOptions(GREEDY)).early_exit_layer == 4  # 3/4 of 6 layers


def counting_calls(modules) -> list[int]:
    """A one-item list counting the forwards of `modules` (forward hooks that stay on: the modules are a test's own)."""
    count = [0]
    for module in modules:
        module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_stock_generate_runs_dense_linears_sharing_the_rest_and_equals_hf_generate(family, tokenizer, prompt):
    model = tiny_model(family, num_layers=6)  # float32: packing applies (gemma2: its 16-token window is crossed)
    use_grouped_attention(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)] if pack_linears(model) else []
    assert pack_output_layer(model)
    hf, stock = (make_strategy(name, model, GenerationOptions(GREEDY),
                               skip=make_skip_set([], [], 6), draft=DEFAULTS.draft)
                 for name in ("hf_generate", "hf_generate_stock"))
    assert hf.model is model and stock.model is not model and len(packed) == 6 * 7
    dense = [m for layer in decoder_layers(stock.model) for m in layer.modules() if type(m) is nn.Linear]
    assert len(dense) == len(packed) and not any(isinstance(m, PackedLinear) for m in stock.model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(packed)  # the model stays packed
    assert stock.model.get_output_embeddings().packed_weight is None  # stock: the dense output layer, sdpa attention
    assert model.get_output_embeddings().packed_weight is not None
    attention = {"llama": ("sdpa", GROUPED_SDPA), "gemma2": ("eager", "eager")}[family]
    assert (stock.model.config._attn_implementation, model.config._attn_implementation) == attention
    # memory: the dense weights are the copy's only new tensors; embeddings, norms, biases and buffers are shared
    shared = {id(t) for t in (*model.parameters(), *model.buffers())}
    new = [t for t in (*stock.model.parameters(), *stock.model.buffers()) if id(t) not in shared]
    assert sorted(t.numel() for t in new) == sorted(m.in_features * m.out_features for m in packed)
    dense_calls, packed_calls = counting_calls(dense), counting_calls(packed)
    prompts = (prompt, tokenizer("The cat sat on the mat. The cat sat on").input_ids)
    stock_tokens = [stock.generate(ids).new_tokens for ids in prompts]
    assert dense_calls[0] > 0 and packed_calls[0] == 0  # the stock baseline ran nn.Linear only
    assert [hf.generate(ids).new_tokens for ids in prompts] == stock_tokens
    assert packed_calls[0] == dense_calls[0]  # hf_generate ran the packed ones, as many times


def test_stock_generate_is_hf_generate_where_nothing_is_packed(llama):
    assert make_hf_strategy("hf_generate_stock", llama, GenerationOptions(GREEDY)).model is llama  # float64: never packed


def test_self_speculation_holds_no_second_copy_of_the_weights(tokenizer):
    model = tiny_model("llama", num_layers=4, hidden_size=512)  # ~39 MB of float32 weights
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ids = tokenizer("def fibonacci(n):\n    ").input_ids
    settings = replace(SAMPLING, max_new_tokens=24)
    self_spec = make_strategy("self_spec_fixed", model, GenerationOptions(settings),
                              skip=make_skip_set([1], [2], 4),
                              draft=run_settings("draft=fixed", "draft.max_tokens=4").draft)
    self_spec.generate(ids)  # warm-up: lazy allocations that later runs reuse
    result, grown_mb = measure_peak_memory(lambda: self_spec.generate(ids))
    assert len(result.new_tokens) == 24 and grown_mb < 0.25 * weights_mb
    copied, copy_mb = measure_peak_memory(lambda: copy.deepcopy(model))  # the control: a copy shows up
    assert copy_mb > 0.9 * weights_mb
    del copied


@pytest.mark.slow
def test_smollm2_early_exit_drafts_and_matches_plain():
    loaded = load_model(run_settings("model=smollm2").model)
    model, end_ids = loaded.model, loaded.end_ids
    ids = encode_prompt(loaded.tokenizer, load_prompts("humaneval", limit=1)[0])
    settings = replace(SAMPLING, max_new_tokens=24)
    plain = Strategy("plain", model, GenerationOptions(settings, end_ids=end_ids)).generate(ids).new_tokens
    for k in (1, 3):
        result = make_hf_strategy("hf_early_exit", model,
                                  GenerationOptions(settings, end_ids=end_ids),
                                  early_exit_layer=28, num_assistant_tokens=k, confidence_threshold=0).generate(ids)
        assert result.new_tokens == plain
        assert max(s.drafted for s in result.steps) == k and 0 < result.accepted < result.drafted
    assert make_hf_strategy("hf_generate", model, GenerationOptions(settings, end_ids=end_ids)).generate(ids).new_tokens == plain
