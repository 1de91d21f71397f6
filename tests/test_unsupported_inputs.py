"""Models of an unregistered architecture and batches of prompts end in one line naming what is supported, not a
traceback."""

from dataclasses import replace

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, GPTJConfig, GPTJForCausalLM

from selfspec.api.decoder import DEFAULT_DRAFT, DEFAULT_SAMPLING
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import NAMES, make_strategy
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.models.skip import skipping
from selfspec.models.tiny import byte_tokenizer
from selfspec.settings import ModelSettings, SkipSet

GREEDY = replace(DEFAULT_SAMPLING, max_new_tokens=8)
DRAFT = replace(DEFAULT_DRAFT, policy="fixed", max_tokens=4, ngram_tokens=4)
SUPPORTED = "supported: Llama (llama), Mistral (mistral), "
HOW_TO_ADD = "to add one, give LAYOUTS in selfspec/models/layouts.py"


def gptj():  # transformer.h[i].attn / .mlp, parallel residual: a layout like GPT-2's, but not registered
    return GPTJForCausalLM(GPTJConfig(vocab_size=259, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                      rotary_dim=4)).eval()


def bloom():  # transformer.h[i].self_attention / .mlp with ALiBi positions
    return BloomForCausalLM(BloomConfig(vocab_size=259, hidden_size=16, n_layer=2, n_head=2)).eval()


def one_line_naming_the_supported_families(error: pytest.ExceptionInfo, model_class: str) -> None:
    message = str(error.value)
    assert len(message.splitlines()) == 1 and SUPPORTED in message and model_class in message
    assert HOW_TO_ADD in message and "OPT (opt)" in message


@pytest.mark.parametrize("build", [gptj, bloom])
def test_a_model_of_another_layout_is_refused_by_every_entry_point_in_one_line(build):
    model = build()
    name = type(model).__name__
    with pytest.raises(SelfspecError) as err:
        with skipping(model, SkipSet(attn=(0,))):
            pass
    one_line_naming_the_supported_families(err, name)
    with pytest.raises(SelfspecError) as err:
        generate(model, [5, 6, 7], GenerationOptions(GREEDY))
    one_line_naming_the_supported_families(err, name)
    for strategy in [n for n in NAMES if not n.startswith("hf_") or n == "hf_early_exit"]:
        with pytest.raises(SelfspecError) as err:
            make_strategy(strategy, model, GenerationOptions(GREEDY, end_ids=(2,)), skip=SkipSet(attn=(0,)),
                          draft=DRAFT, draft_model=model)
        one_line_naming_the_supported_families(err, name)


def test_a_checkpoint_of_another_layout_is_refused_at_load(tmp_path):
    gptj().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(SelfspecError) as err:
        load_model(ModelSettings(name="m", source="hub", path=str(tmp_path), dtype="float32", device="cpu",
                                  packed_linears=True))
    one_line_naming_the_supported_families(err, "model_type 'gptj'")


@pytest.mark.parametrize("name", ["plain", "self_spec", "hf_generate"])
def test_a_batch_of_prompts_ends_in_one_line_and_a_batch_of_one_decodes_like_a_list(tiny, prompt, name):
    strategy = make_strategy(name, tiny, GenerationOptions(GREEDY, end_ids=(2,)), skip=SkipSet(attn=(1,)),
                             draft=DRAFT)
    for batch in ([prompt, prompt], torch.tensor([prompt, prompt])):
        with pytest.raises(SelfspecError, match=r"^a batch of 2 prompts was given; decoding takes one prompt at a "
                                                r"time \(batch size 1\)"):
            strategy.generate(batch)
    expected = strategy.generate(prompt).new_tokens
    assert strategy.generate(torch.tensor([prompt])).new_tokens == expected
    assert strategy.generate(torch.tensor(prompt)).new_tokens == expected


@pytest.mark.parametrize("prompt, message", [
    ([], "empty prompt"),
    ([[]], "empty prompt"),
    ([5, "6"], "'6' is not an integer"),
    ([5, 6.0], "6.0 is not an integer"),
    ("hello", "a prompt is a list of token ids, got str"),
])
def test_a_prompt_that_is_not_token_ids_ends_in_one_line(tiny, prompt, message):
    with pytest.raises(SelfspecError, match=message):
        generate(tiny, prompt, GenerationOptions(GREEDY))
