"""Banned words with rollback and stop strings (decoding/text_rules.py): the finite-state machine on hand-written
cases, then the decoding loop under them, which every strategy must follow as plain decoding does (greedy token for
token, sampling in distribution), the emitted tokens' log-probabilities, and one-line errors."""

import dataclasses
import re
from dataclasses import replace

import pytest
import torch

from selfspec import DEFAULT_DRAFT, SelfSpeculativeDecoder
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import SelfDrafter
from selfspec.api.streaming import stream_chunks
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import decode_steps, generate
from selfspec.decoding.text_rules import OutputWatch, WordFinder, text_rules
from selfspec.errors import SelfspecError
from selfspec.models.tiny import tiny_model
from selfspec.settings import MAX_BANNED_WORDS, default_settings, make_skip_set

from helpers import chi_square_pvalue, printable, run_settings, watched_steps

GREEDY = replace(default_settings().sampling, max_new_tokens=24)


@pytest.fixture(scope="module")
def llama():
    """The llama Llama of conftest's `llama` (the Gemma-2 one runs the rollback test of plain decoding only)."""
    return tiny_model("llama", num_layers=6).double()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def watch(llama, tokenizer, banned=(), stop=(), case_sensitive=False, prompt="> ") -> OutputWatch:
    return OutputWatch(text_rules(llama, tokenizer, banned, case_sensitive, stop), ids(tokenizer, prompt))


# The finite-state machine

def test_the_first_word_to_end_wins_and_of_those_the_longest():
    finder = WordFinder(["abcd", "bc", "xbc"])
    assert finder.first("", "xxabcd") == (3, 5)  # "bc" ends before "abcd" does
    assert finder.first("x", "bc") == (-1, 2)  # "xbc" and "bc" end together: the longer, begun in the text before
    assert finder.first("", "abxd") is None


def test_case_folding_keeps_offsets():
    finder = WordFinder(["straße", "ab"], case_sensitive=False)
    assert finder.first("", "xxSTRASSE straße") == (10, 16)  # "ß".upper() is "SS": not the same word
    assert finder.first("İ", "AB") == (0, 2)  # "İ".lower() is two characters: folding keeps it as one
    assert WordFinder(["ab"], case_sensitive=True).first("", "AB") is None


def test_an_open_prefix_is_what_may_still_become_a_word():
    finder = WordFinder(["hello", "help"])
    assert finder.open_prefix("say hel") == 3 and finder.open_prefix("say h") == 1 and finder.open_prefix("yes") == 0
    assert finder.open_prefix("hello") == 0  # a whole word is no longer open (it has been caught)


def test_a_word_split_over_tokens_rolls_back_to_its_first_token(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["cat"])
    output = ids(tokenizer, "a cat")
    verdict = rules.settle(output)
    assert (verdict.kept, verdict.rolled_back, verdict.stopped) == (5, 3, False)
    assert rules.ids == output[:2] and rules.text == "a " and rules.forbidden == {2: {output[2]}}
    assert rules.forbidden_next() == {output[2]}


def test_overlapping_words_roll_back_to_the_first_completed_one(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["bcd", "abcde"])
    verdict = rules.settle(ids(tokenizer, "xabcdef"))
    assert verdict.kept == 5 and verdict.rolled_back == 3 and rules.text == "xa"  # "bcd" completes first


def test_a_word_completed_by_a_later_step_rolls_back_past_the_previous_step(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["dog"])
    assert rules.settle(ids(tokenizer, "hot d")).rolled_back == 0
    assert rules.settle(ids(tokenizer, "o")).rolled_back == 0
    verdict = rules.settle(ids(tokenizer, "gs!"))
    assert verdict.kept == 1 and verdict.rolled_back == 3 and rules.text == "hot "


def test_a_word_completed_by_a_steps_bonus_token_rolls_back_the_accepted_drafts_too(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["xyz"])
    verdict = rules.settle(ids(tokenizer, "axyz"))  # accepted drafts "axy", then the verifier's own "z"
    assert (verdict.kept, verdict.rolled_back) == (4, 3) and rules.text == "a"


def test_a_rollback_to_the_prompt_boundary_and_past_an_exhausted_position(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["q"])
    assert rules.settle(ids(tokenizer, "q")).rolled_back == 1 and rules.ids == []
    assert rules.forbidden == {0: {ids(tokenizer, "q")[0]}}
    rules = watch(llama, tokenizer, banned=["ab"])
    rules.settle(ids(tokenizer, "xa"))
    rules.forbidden[2] = set(range(rules.rules.vocab_size)) - {ids(tokenizer, "a")[0]}  # every other token tried
    assert rules.settle(ids(tokenizer, "ab")).rolled_back == 3  # "xaab" -> "x": position 2 is exhausted
    assert rules.ids == ids(tokenizer, "x") and rules.forbidden == {1: {ids(tokenizer, "a")[0]}}


def test_a_rollback_forgets_the_forbidden_tokens_of_the_positions_after_it(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["zq"])
    rules.settle(ids(tokenizer, "xyz"))
    rules.forbidden[3] = {5}  # an earlier rollback to position 3, after the prefix "xyz"
    rules.settle(ids(tokenizer, "q"))  # "zq" began at position 2: the prefix of position 3 is gone
    assert rules.forbidden == {2: set(ids(tokenizer, "z"))}


def test_a_stop_string_ends_with_the_token_that_completes_it(llama, tokenizer):
    rules = watch(llama, tokenizer, stop=["END"])
    assert not rules.settle(ids(tokenizer, "the E")).stopped
    verdict = rules.settle(ids(tokenizer, "NDless"))
    assert verdict.stopped and verdict.kept == 2 and verdict.rolled_back == 0


def test_a_draft_ends_at_the_token_that_completes_a_word(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["cat"], stop=["!"])
    rules.settle(ids(tokenizer, "a c"))
    assert rules.draft_length(ids(tokenizer, "atty")) == 2  # "a", then "t" completes "cat"
    assert rules.draft_length(ids(tokenizer, "ow!?")) == 3 and rules.draft_length(ids(tokenizer, "ow")) == 2
    assert rules.text == "a c"  # looking ahead changes nothing


def test_the_open_tokens_are_those_that_may_still_begin_a_word(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["abc", "é"], stop=["xyz"])
    rules.settle(ids(tokenizer, "1a"))
    assert rules.open_tokens() == 1
    rules.settle(ids(tokenizer, "bx"))
    assert rules.open_tokens() == 1  # "ab" + "x" can no longer be "abc"; "x" may begin "xyz"
    rules.settle(ids(tokenizer, "é")[:1])
    assert rules.open_tokens() == 2  # and the first byte of a character, whose text is not known yet


def test_a_character_split_over_tokens_counts_once_it_completes(llama, tokenizer):
    rules = watch(llama, tokenizer, banned=["é!"])
    e_acute = ids(tokenizer, "é")
    assert len(e_acute) == 2  # one token per byte
    assert rules.settle(e_acute[:1]).rolled_back == 0 and rules.text == ""
    assert rules.settle(e_acute[1:] + ids(tokenizer, "!")).rolled_back == 3 and rules.ids == []


@pytest.mark.parametrize("words, message", [
    ([""], "banned_words[0]='' is not allowed; a banned word needs a character that is not whitespace"),
    (["ok", " \n"], "banned_words[1]=' \\n' is not allowed"),
    (["w"] * (MAX_BANNED_WORDS + 1), f"banned_words: 10001 words are too many; allowed: at most {MAX_BANNED_WORDS}"),
])
def test_bad_banned_words_end_in_one_line(llama, tokenizer, words, message):
    with pytest.raises(SelfspecError, match=re.escape(message)):
        text_rules(llama, tokenizer, words)


@pytest.mark.parametrize("overrides, message", [
    (["constraints.banned_words=['']"], "constraints.banned_words[0]='' is not allowed"),
    (["sampling.stop=END"], "sampling.stop must be a list, e.g. sampling.stop=['...']"),
    (["sampling.stop=['']"], "sampling.stop[0]='' is not allowed; a stop string is non-empty text"),
])
def test_bad_constraints_in_the_config_end_in_one_line(overrides, message):
    with pytest.raises(SelfspecError, match=re.escape(message)):
        run_settings(*overrides)


# The decoding loop

def plain_words(llama, tokenizer, prompt_ids: list[int], count: int = 2) -> list[str]:
    """`count` two-character words from plain decoding's output: words the model does produce."""
    text = tokenizer.decode(generate(llama, prompt_ids, GenerationOptions(GREEDY)).new_tokens)
    pairs = [text[i:i + 2] for i in range(len(text) - 1) if printable(text[i:i + 2])]
    assert len(pairs) >= count, text
    return pairs[:count]


def test_plain_decoding_rolls_back_and_never_emits_a_banned_word(tiny, tokenizer, prompt):
    words = plain_words(tiny, tokenizer, prompt)
    rules = text_rules(tiny, tokenizer, words)
    result = generate(tiny, prompt, GenerationOptions(GREEDY, rules=rules))
    text = tokenizer.decode(result.new_tokens)
    assert result.rollbacks >= 1 and not any(word.lower() in text.lower() for word in words)
    assert len(result.new_tokens) == GREEDY.max_new_tokens


def test_stop_strings_end_generation_inside_a_draft(llama, tokenizer, prompt):
    plain = generate(llama, prompt, GenerationOptions(GREEDY)).new_tokens
    stop = tokenizer.decode(plain[9:11])
    rules = text_rules(llama, tokenizer, stop=[stop])
    drafter = SelfDrafter(llama, make_skip_set([1], [2], 6), DraftExit(5))
    result = generate(llama, prompt, GenerationOptions(GREEDY, rules=rules), drafter)
    assert result.new_tokens == plain[:11] and result.drafted > 0


def test_logprobs_are_plain_decodings_whichever_strategy_drafted(llama, tokenizer, prompt):
    sampling = replace(GREEDY, temperature=0.9, top_k=20)
    drafter = SelfDrafter(llama, make_skip_set([1], [2], 6), DraftExit(3))

    def logprobs(drafter):
        emitted = list(decode_steps(llama, prompt,
                                    GenerationOptions(sampling, generator=torch.Generator().manual_seed(0), top_logprobs=3),
                                    drafter))
        tokens = [t for e in emitted for t in e.tokens]
        return tokens, [lp for e in emitted for lp in e.logprobs]

    tokens, drafted = logprobs(drafter)
    # plain decoding's log-probabilities of the same tokens: one forward over them
    from selfspec.decoding.sampling import logits_processor, scores
    from selfspec.models.cache import forward, new_cache

    logits = forward(llama, new_cache(llama, 64), prompt + tokens[:-1], 0)[len(prompt) - 1:]  # (n, vocab)
    reference = torch.log_softmax(scores(logits, prompt + tokens, len(prompt), logits_processor(sampling)), dim=-1)
    for row, token, got in zip(reference, tokens, drafted):
        assert got.logprob == pytest.approx(float(row[token]), abs=1e-9)
        values, top = row.topk(3)
        assert [t for t, _ in got.top] == top.tolist() and [v for _, v in got.top] == pytest.approx(values.tolist())


def test_the_api_replies_without_the_word_and_counts_the_rollbacks(llama, tokenizer, prompt):
    words = plain_words(llama, tokenizer, prompt, 1)
    decoder = SelfSpeculativeDecoder(llama, tokenizer, skip={"attn": [1], "mlp": [2]},
                                     draft=dataclasses.replace(DEFAULT_DRAFT, max_tokens=4), strategy="self_spec")
    reply = decoder.generate(prompt, max_new_tokens=24, banned_words=[w.upper() for w in words], logprobs=2)
    plain = generate(llama, prompt, GenerationOptions(GREEDY, rules=text_rules(llama, tokenizer, words)))
    assert reply.token_ids == plain.new_tokens and reply.stats.rollbacks == plain.rollbacks >= 1
    assert len(reply.logprobs) == len(reply.token_ids) and all(len(lp.top) == 2 for lp in reply.logprobs)
    chunks = list(decoder.stream(prompt, max_new_tokens=24, banned_words=words))
    rolled_back = [t for c in chunks for t in c.rolled_back]
    assert rolled_back and {t.source for t in rolled_back} == {"rolled_back"}
    assert not any(c.retracted for c in chunks)  # what may still be rolled back is held back
    assert [t.id for c in chunks for t in c.tokens] == plain.new_tokens
    with pytest.raises(SelfspecError, match=re.escape("logprobs=21 is not allowed; allowed: 0..20")):
        decoder.generate(prompt, logprobs=21)


def test_a_stream_holds_back_only_what_may_still_begin_a_banned_word(llama, tokenizer):
    steps = watched_steps(text_rules(llama, tokenizer, ["abc"]), tokenizer, ["xa", "b", "y", "ab", "c"])
    chunks = list(stream_chunks(steps, tokenizer, (2,), text_rules(llama, tokenizer, ["abc"])))
    assert [c.text for c in chunks] == ["x", "", "aby", "", "", ""]
    assert [t.text for t in chunks[4].rolled_back] == ["a", "b", "c"] and chunks[4].retracted == 0


def most_likely_printable_pair(model, tokenizer, prompt: list[int], top_k: int) -> tuple[int, int]:
    """The likeliest (t1, t2) within the top k of each that are printable characters."""
    from selfspec.models.cache import forward, new_cache

    def top(context):
        logits = forward(model, new_cache(model, 64), context, 0, last_only=True)[0]
        return [t for t in logits.topk(top_k).indices.tolist() if printable(tokenizer.decode([t]))]

    for x in top(prompt):
        for y in top(prompt + [x]):
            return x, y
    raise AssertionError("no printable pair in the top k: pick another model seed")


def banned_pair_distribution(llama, prompt, settings, x: int, y: int) -> dict:
    """Exact P(t1, t2) when the word (x, y) is banned: plain sampling, and where t1 t2 = x y a rollback to t1 with
    x forbidden there."""
    from selfspec.decoding.sampling import logits_processor, scores
    from selfspec.models.cache import forward, new_cache

    processor = logits_processor(settings)

    def dist(context, forbidden=None):
        logits = forward(llama, new_cache(llama, 64), context, 0, last_only=True)
        if forbidden is not None:
            logits = logits.clone()
            logits[0, forbidden] = float("-inf")
        return torch.softmax(scores(logits, context, len(context), processor)[0], dim=-1)

    p1 = dist(prompt)
    p1_masked = dist(prompt, x)
    exact = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            if (t1, t2) != (x, y):
                exact[(t1, t2)] = exact.get((t1, t2), 0.0) + float(p1[t1] * p2[t2])
    rolled = float(p1[x] * dist(prompt + [x])[y])
    for t1 in p1_masked.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            exact[(t1, t2)] = exact.get((t1, t2), 0.0) + rolled * float(p1_masked[t1] * p2[t2])
    return exact


@pytest.mark.slow
def test_sampling_with_a_banned_word_follows_plain_decodings_distribution(tokenizer):
    model = tiny_model("llama", num_layers=4, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(GREEDY, temperature=1.0, top_k=3, max_new_tokens=2)
    prompt = ids(tokenizer, "Say it: ")
    x, y = most_likely_printable_pair(model, tokenizer, prompt, settings.top_k)
    rules = text_rules(model, tokenizer, [tokenizer.decode([x, y])], case_sensitive=True)
    exact = banned_pair_distribution(model, prompt, settings, x, y)
    drafter = SelfDrafter(model, make_skip_set([1], [2], 4), DraftExit(2))
    generator = torch.Generator().manual_seed(0)
    counts, rollbacks = {}, 0
    for _ in range(1000):
        result = generate(model, prompt, GenerationOptions(settings, generator=generator, rules=rules), drafter)
        counts[tuple(result.new_tokens)] = counts.get(tuple(result.new_tokens), 0) + 1
        rollbacks += result.rollbacks
    assert (x, y) not in counts and set(counts) <= set(exact)
    assert rollbacks > 50  # the banned word is one the model often produces
    assert chi_square_pvalue(counts, exact) > 0.001
