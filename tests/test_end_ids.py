"""End of turn as the model defines it: every strategy, and every draft, stops at any of the model's end ids."""

from dataclasses import replace

from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import GenerationContext, KangarooDrafter, ModelDrafter, NgramDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import Strategy, make_strategy
from selfspec.models.cache import new_cache
from selfspec.models.kangaroo_adapter import new_adapter
from selfspec.models.loading import load_model, model_end_ids
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.settings import ModelSettings, make_skip_set

GREEDY = replace(DEFAULT_SAMPLING, max_new_tokens=42)
DRAFT = replace(DEFAULT_DRAFT, policy="fixed", max_tokens=6, ngram_tokens=8)


def two_end_ids(tokens: list[int]) -> tuple[tuple[int, ...], list[int]]:
    """Two ids the model emits, the later-emitted one first (a loop stopping only at end_ids[0] overshoots), and
    the tokens up to the first of either."""
    late, early = tokens[40], tokens[20]
    first = min(tokens.index(late), tokens.index(early))
    assert tokens.index(late) != tokens.index(early)
    return (late, early), tokens[:first + 1]


def test_end_ids_are_the_generation_configs_then_the_tokenizers_eos_without_repeats():
    model, tokenizer = tiny_model("llama", num_layers=1, hidden_size=16), byte_tokenizer()  # tokenizer eos: 2
    for configured, expected in (([107, 2], (107, 2)), ((1, 5), (1, 5, 2)), (9, (9, 2)), (None, (2,))):
        model.generation_config.eos_token_id = configured
        assert model_end_ids(model, tokenizer) == expected


def test_a_checkpoint_whose_generation_config_lists_two_end_ids_loads_both(tmp_path):
    model = tiny_model("llama", num_layers=1, hidden_size=16)
    model.generation_config.eos_token_id = [2, 106]  # Gemma instruct: <eos> and <end_of_turn>
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(ModelSettings(name="m", source="hub", path=str(tmp_path), dtype="float32", device="cpu",
                                       packed_linears=True))
    assert loaded.end_ids == (2, 106)


def test_every_strategy_stops_at_the_first_of_either_end_id(prompt):
    tiny = tiny_model("llama", num_layers=4).double()  # float64: no near-ties between strategies
    end_ids, expected = two_end_ids(generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens)
    skip = make_skip_set([1], [2], 4)
    strategies = [make_strategy(name, tiny, GenerationOptions(GREEDY, end_ids=end_ids), skip=skip,
                                draft=DRAFT, draft_model=tiny)  # a perfect draft model:
                  for name in ("plain", "self_spec", "prompt_lookup", "self_spec_hybrid", "two_model",  # end ids land
                               "hf_generate", "hf_prompt_lookup")]  # inside accepted drafts
    kangaroo = KangarooDrafter(tiny, new_adapter(tiny, 3), 3, DraftExit(6))
    strategies.append(Strategy("kangaroo", tiny, GenerationOptions(GREEDY, end_ids=end_ids), kangaroo))
    for strategy in strategies:
        assert strategy.generate(prompt).new_tokens == expected, strategy.name


def test_drafts_end_at_the_first_of_either_end_id(tiny, prompt):
    """A draft by the full model itself is the plain continuation; a copy repeats the context: both must stop after
    the first end id in them, whichever id it is."""
    continuation = generate(tiny, prompt,
                            GenerationOptions(replace(DEFAULT_SAMPLING, max_new_tokens=11))).new_tokens
    region = continuation[1:]  # what a full-model draft after prompt + continuation[0] proposes
    end_ids = (region[7], region[3])
    first = min(region.index(i) for i in end_ids)
    drafter = ModelDrafter(tiny, DraftExit(10))
    drafter.begin(GenerationContext(new_cache(tiny, 200), GREEDY, None, end_ids))
    assert drafter.draft(prompt + continuation[:1], 10).tokens == region[:first + 1]

    copier = NgramDrafter(tiny, ngram_size=2, num_tokens=10)
    copier.begin(GenerationContext(new_cache(tiny, 200), GREEDY, None, (24, 22)))
    assert copier.draft([10, 11, 20, 21, 22, 23, 24, 25, 30, 10, 11], 10).tokens == [20, 21, 22]
