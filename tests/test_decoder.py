"""The Python API (selfspec/api/decoder.py, streaming.py) on a tiny model: lossless replies, streamed steps with their
token sources, stats as the decoding loop counts them, stop strings, one-line errors, and the README's cell."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from selfspec import DEFAULT_DRAFT, SelfSpeculativeDecoder
from selfspec.api.decoder import DEFAULT_SAMPLING
from selfspec.api.streaming import VERIFIED, stream_chunks
from selfspec.data.prompt_sets import Prompt, encode_prompt
from selfspec.decoding.text_rules import text_rules
from selfspec.errors import SelfspecError
from selfspec.models.tiny import tiny_model

from helpers import run_settings, watched_steps

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"attn": [3, 5], "mlp": [4]}
# short drafts (a random model rejects most of them); the hybrid on the adaptive exit, whose draft counts repeat
# (the cost-aware exit follows measured times, so two runs may draft differently)
DRAFT = dataclasses.replace(DEFAULT_DRAFT, max_tokens=4, hybrid_policy=None)
TEXT = "abab abab abab abab abab"  # repetitive: n-gram copies get accepted too (3 of 24 tokens)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=6).double()


@pytest.fixture(scope="module")
def plain(model, tokenizer):
    return SelfSpeculativeDecoder(model, tokenizer, strategy="plain").generate(TEXT, max_new_tokens=24)


@pytest.mark.parametrize("strategy", ["self_spec", "self_spec_hybrid", "prompt_lookup"])
def test_greedy_reply_equals_plain_decoding_and_the_strategy_loop(model, tokenizer, plain, strategy):
    decoder = SelfSpeculativeDecoder(model, tokenizer, skip=SKIP, draft=DRAFT, strategy=strategy)
    reply = decoder.generate(TEXT, max_new_tokens=24)
    sampling = dataclasses.replace(DEFAULT_SAMPLING, max_new_tokens=24)
    looped = decoder.strategy(sampling).generate(tokenizer(TEXT).input_ids)
    assert reply.token_ids == plain.token_ids == looped.new_tokens
    decoded = tokenizer.decode(reply.token_ids, skip_special_tokens=True)
    assert reply.text == decoded.removesuffix("\ufffd")  # a character cut by the length limit is left out
    assert reply.finish_reason == "length" and reply.prompt_tokens == len(tokenizer(TEXT).input_ids)
    assert reply.stats.drafted == looped.drafted and reply.stats.accepted == looped.accepted
    assert reply.stats.verify_steps == len(looped.steps)
    assert reply.stats.acceptance_rate == looped.acceptance_rate
    assert reply.stats.mean_accepted_tokens == looped.mean_accepted_tokens


def test_stream_yields_each_steps_accepted_tokens_with_their_sources(model, tokenizer, plain):
    decoder = SelfSpeculativeDecoder(model, tokenizer, skip=SKIP, draft=DRAFT, strategy="self_spec_hybrid")
    chunks = list(decoder.stream(TEXT, max_new_tokens=24))
    tokens = [token for chunk in chunks for token in chunk.tokens]
    assert [t.id for t in tokens] == plain.token_ids and "".join(c.text for c in chunks) == plain.text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[0].tokens[0].source == VERIFIED  # the prefill's token
    for chunk in chunks[1:-1]:  # one verification each: accepted drafts first, then one token of the verifier
        sources = [t.source for t in chunk.tokens]
        assert sources[-1] == VERIFIED and VERIFIED not in sources[:-1]
    sources = {t.source for t in tokens}
    assert {"model", "ngram"} <= sources <= {"model", "ngram", VERIFIED}
    stats = [c.stats for c in chunks]
    assert [s.verify_steps for s in stats[:-1]] == list(range(len(chunks) - 1))
    assert stats[-1].new_tokens == 24 and stats[-1].tokens_per_s > 0
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(stats, stats[1:]))


def test_plain_decoding_streams_one_verified_token_per_step(model, tokenizer, plain):
    chunks = list(SelfSpeculativeDecoder(model, tokenizer, strategy="plain").stream(TEXT, max_new_tokens=24))
    assert [len(c.tokens) for c in chunks[:-1]] == [1] * 24 and not chunks[-1].tokens
    assert chunks[-1].stats.acceptance_rate is None and chunks[-1].stats.mean_accepted_tokens == 1.0


def test_a_stop_string_ends_the_reply_before_it(model, tokenizer, plain):
    decoder = SelfSpeculativeDecoder(model, tokenizer, skip=SKIP, draft=DRAFT)
    stop = next(c for c in plain.text[5:] if c.isascii() and c.isprintable())
    cut = plain.text.index(stop)
    reply = decoder.generate(TEXT, max_new_tokens=24, stop=["never there", stop])
    assert reply.text == plain.text[:cut] and reply.finish_reason == "stop"
    assert reply.token_ids == plain.token_ids[:len(reply.token_ids)] and len(reply.token_ids) < 24
    streamed = [c.text for c in decoder.stream(TEXT, max_new_tokens=24, stop=[stop])]
    assert "".join(streamed) == plain.text[:cut]


def test_a_stop_string_split_across_steps_is_held_back_until_it_completes(model, tokenizer):
    rules = text_rules(model, tokenizer, stop=["abc"])
    chunks = list(stream_chunks(watched_steps(rules, tokenizer, list("xyabc")), tokenizer, (2,), rules))
    assert [c.text for c in chunks] == ["x", "y", "", "", ""] and chunks[-1].finish_reason == "stop"


def test_leaving_the_stream_closes_the_decoding_loop(model, tokenizer):
    decoder = SelfSpeculativeDecoder(model, tokenizer, skip=SKIP, draft=DRAFT)
    steps = decoder.strategy(dataclasses.replace(DEFAULT_SAMPLING, max_new_tokens=24)).steps(tokenizer(TEXT).input_ids)
    chunks = stream_chunks(steps, tokenizer, (tokenizer.eos_token_id,))
    next(chunks), next(chunks)
    chunks.close()
    assert inspect.getgeneratorstate(steps) == inspect.GEN_CLOSED


def test_sampled_replies_repeat_with_the_same_seed(model, tokenizer):
    decoder = SelfSpeculativeDecoder(model, tokenizer, skip=SKIP, draft=DRAFT)
    first, again, other = (decoder.generate(TEXT, max_new_tokens=12, temperature=0.8, top_k=50, seed=seed)
                           for seed in (1, 1, 2))
    assert first.token_ids == again.token_ids != other.token_ids


def test_chat_messages_go_through_the_chat_template_as_in_run_py(model, tokenizer):
    decoder = SelfSpeculativeDecoder(model, tokenizer, strategy="plain")
    prompt = Prompt("q", "chat", ("Hello there",), chat=True)
    assert decoder.encode([{"role": "user", "content": "Hello there"}]) == encode_prompt(tokenizer, prompt)
    assert decoder.encode([5, 6, 7]) == [5, 6, 7]


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="hf_generate"), "strategy='hf_generate' is not allowed; allowed: plain, self_spec"),
    (dict(strategy="two_model"), "strategy two_model needs a draft model"),
    (dict(skip={"attn": [99]}), "skip.attn: layer id 99 is out of range"),
    (dict(skip={"attention": [1]}), "skip: keys ['attention'] are not allowed; allowed: attn, mlp"),
    (dict(skip="missing.yaml"), "skip.path='missing.yaml' does not exist"),
])
def test_bad_decoder_options_raise_one_line_naming_the_value(model, tokenizer, kwargs, message):
    with pytest.raises(SelfspecError, match=re.escape(message)):
        SelfSpeculativeDecoder(model, tokenizer, **kwargs)


@pytest.mark.parametrize("prompt, kwargs, message", [
    ({"role": "user"}, {}, "prompt={'role': 'user'} is not allowed"),
    ([{"role": "user", "content": 3}], {}, "messages[0]="),
    ("", {}, "prompt encodes to no tokens"),
    ("hi", dict(temperature=-1.0), "temperature=-1.0 is negative"),
    ("hi", dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
])
def test_bad_requests_raise_one_line_naming_the_value(model, tokenizer, prompt, kwargs, message):
    decoder = SelfSpeculativeDecoder(model, tokenizer, strategy="plain")
    with pytest.raises(SelfspecError, match=re.escape(message)):
        decoder.generate(prompt, **kwargs)


def test_the_api_default_draft_options_are_the_configs():
    assert DEFAULT_DRAFT == run_settings("model=tiny_llama").draft


def readme_cell() -> str:
    """The Python code block of the README's "Python API" section."""
    section = ROOT.joinpath("README.md").read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # a 30-layer tiny model decodes 32 tokens twice
def test_the_readme_cell_runs_on_a_saved_tiny_model_and_streams_the_plain_greedy_reply(tmp_path, tokenizer, capsys):
    cell = readme_cell()
    assert len(cell.strip().splitlines()) == 5
    model = tiny_model("llama", num_layers=30, hidden_size=32)
    for layer in (3, 4, 5, 6, 7, 8, 26, 28):  # the cell's skipped sublayers add nothing: drafts pass, the test is fast
        model.model.layers[layer].self_attn.o_proj.weight.data.zero_()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    exec(cell, {"path": str(tmp_path)})
    printed = capsys.readouterr().out
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    plain = SelfSpeculativeDecoder(saved, tokenizer, strategy="plain")
    reply = plain.generate([{"role": "user", "content": "Write a haiku."}], max_new_tokens=32)
    assert printed and printed == reply.text


def test_from_pretrained_loads_an_embedded_config_with_its_skip_set_and_decodes_losslessly():
    decoder = SelfSpeculativeDecoder.from_pretrained("tiny_llama")
    settings = run_settings("model=tiny_llama")
    plain = SelfSpeculativeDecoder(decoder.model, decoder.tokenizer, strategy="plain")
    assert decoder.name == "self_spec_tree"
    skip = decoder.strategy(DEFAULT_SAMPLING).drafter.fallback.source.skip  # the tree over the layer-skip draft
    assert (list(skip.attn), list(skip.mlp)) == (list(settings.skip.attn), list(settings.skip.mlp))
    assert decoder.generate(TEXT, max_new_tokens=16).token_ids == plain.generate(TEXT, max_new_tokens=16).token_ids


def test_an_unknown_request_option_is_one_line_naming_it(model, tokenizer):
    decoder = SelfSpeculativeDecoder(model, tokenizer, strategy="plain")
    with pytest.raises(SelfspecError, match=r"^max_tokens is not an option of generate; allowed: max_new_tokens, "):
        decoder.generate("hi", max_tokens=4)


@pytest.mark.slow  # loads the embedded SmolLM2 and decodes 64 tokens
def test_the_readme_quickstart_runs_on_the_embedded_model(capsys):
    readme = ROOT.joinpath("README.md").read_text()
    quickstart = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert len(quickstart.strip().splitlines()) <= 6 and "from_pretrained(" in quickstart
    exec(quickstart, {})
    text, rate = capsys.readouterr().out.rsplit(" ", 1)
    assert text.strip() and 0.0 <= float(rate) <= 1.0
