"""Property-based tests of the decoding core (hypothesis): whatever a drafter proposes, a chain or a tree of any
shape, its tokens right, wrong or adversarial (end ids, past max_new_tokens, over banned words and stop strings),
greedy decoding emits plain decoding's tokens and leaves the cache holding exactly them, alone and in a batch."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from selfspec.decoding.batch import generate_batch
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import Draft, NgramDrafter, NgramTreeDrafter, SelfDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.text_rules import text_rules
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings, make_skip_set

from helpers import decode_checking_cache, printable

GREEDY = default_settings().sampling
LAYERS = 3
MAX_NEW = 20  # the longest output a case asks for
NODES = 6  # the chosen drafter's node budget (its max_tokens)
PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def model(request):
    """A 3-layer tiny model in float64; gemma2 slides over 8 tokens, fewer than a prompt and its output."""
    return tiny_model(request.param, num_layers=LAYERS, hidden_size=32, sliding_window=8).double()


# A drafter whose drafts hypothesis chooses

KINDS = ["right"] * 5 + ["wrong", "end", "late"]  # right first: failures shrink towards right drafts


@st.composite
def draft_plans(draw, nodes: int) -> tuple[bool, list[int], list[str], list[int]]:
    """(chain?, parents, per node its kind, per node a random token): up to `nodes` nodes, each parent before its
    child (-1: the root)."""
    chain, n = draw(st.booleans()), draw(st.integers(0, nodes))
    parents = list(range(-1, n - 1)) if chain else [draw(st.integers(-1, i - 1)) for i in range(n)]
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    return chain, parents, kinds, draw(st.lists(st.integers(0, 258), min_size=n, max_size=n))


class ChosenDrafter:
    """Drafts what hypothesis chooses (`draft_plans`): a chain or a tree of up to `nodes` tokens, each either
    right (the next token of a reference the node's path follows: plain decoding's output with or without the
    rules, so right drafts run on past end ids, max_new_tokens and into banned words), wrong (a random token), an
    end id, or late (the reference's token one position on). With `obey_depth` False it ignores the depth the loop
    asks for, so drafts run past max_new_tokens; with it, a chain stops at that depth and a deeper tree node hangs
    from the root instead."""
    threshold = 0.0

    def __init__(self, data, references: list[list[int]], end_ids: tuple[int, ...], obey_depth: bool,
                 nodes: int = NODES):
        self.data, self.references, self.end_ids = data, references, end_ids
        self.obey_depth, self.nodes = obey_depth, nodes
        self.updates: list[tuple[int, int, list[int] | None]] = []

    @property
    def max_tokens(self) -> int:
        return self.nodes

    def begin(self, context):
        self.context = context

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        chain, parents, kinds, randoms = self.data.draw(draft_plans(self.nodes), label="draft")
        depth_cap = max_tokens if self.obey_depth else self.nodes
        if chain:
            parents = parents[:depth_cap]
        draft, paths = Draft(parents=None if chain else []), {-1: []}
        for i, parent in enumerate(parents):
            if len(paths[parent]) >= depth_cap:
                parent = -1
            paths[i] = paths[parent] + [i]
            context = tokens + [draft.tokens[j] for j in paths[parent]]
            draft.tokens.append(self.token(context, kinds[i], randoms[i]))
            if not chain:
                draft.parents.append(parent)
        return draft

    def token(self, context: list[int], kind: str, random: int) -> int:
        if kind == "end" and self.end_ids:
            return self.end_ids[random % len(self.end_ids)]
        offset = {"right": 0, "late": 1}.get(kind)
        for reference in self.references if offset is not None else []:
            at = len(context) + offset
            if at < len(reference) and reference[:len(context)] == context:
                return reference[at]
        return random

    def update(self, drafted: int, accepted: int, path: list[int] | None = None, source: str = "model"):
        self.updates.append((drafted, accepted, path))

    def observe_verify_ms(self, tokens: int, ms: float):
        pass


# Random cases: a prompt, its plain output without rules, and options that bite on that output

prompt_texts = st.text(alphabet="abcdef (){}:=+\n", min_size=1, max_size=14)


def reference(model, prompt: list[int], penalty: float) -> list[int]:
    """The prompt and plain decoding's output after it, with no end ids or rules, longer than any case asks for."""
    settings = replace(GREEDY, max_new_tokens=MAX_NEW + NODES + 1, repetition_penalty=penalty)
    return prompt + generate(model, prompt, GenerationOptions(settings)).new_tokens


def draw_words(data, tokenizer, output: list[int], label: str) -> list[str]:
    """Up to two words of 1-3 printable characters that occur in `output`'s text."""
    text = tokenizer.decode(output)
    found = sorted({text[i:i + n] for n in (1, 2, 3) for i in range(len(text) - n + 1) if printable(text[i:i + n])})
    if not found:
        return []
    return data.draw(st.lists(st.sampled_from(found), max_size=2, unique=True), label=label)


def draw_options(data, model, tokenizer, outputs: list[list[int]], max_new: int = MAX_NEW,
                 penalty: float = 1.0) -> GenerationOptions:
    """Greedy options with a random length, end ids, banned words, stop strings and target gate, the end ids and
    words taken from `outputs` (plain outputs without rules) so that they occur."""
    n = data.draw(st.integers(1, max_new), label="max_new_tokens")
    seen = sorted({token for output in outputs for token in output[:n]})
    end_ids = tuple(data.draw(st.lists(st.sampled_from(seen), max_size=2, unique=True), label="end_ids"))
    banned = draw_words(data, tokenizer, outputs[0][:n], "banned_words")
    stop = draw_words(data, tokenizer, outputs[-1][:n], "stop")
    rules = text_rules(model, tokenizer, banned, data.draw(st.booleans(), label="case_sensitive"), stop)
    gate = data.draw(st.sampled_from([None] * 5 + [0.0, 0.05, 0.2, 1.0]), label="target_gate")  # 1.0: never drafts
    return GenerationOptions(replace(GREEDY, max_new_tokens=n, repetition_penalty=penalty), end_ids=end_ids,
                             rules=rules, target_gate=gate)


def draw_case(data, model, tokenizer) -> tuple[list[int], GenerationOptions, list[list[int]]]:
    """(prompt, options, references for the chosen drafter without the expected output)."""
    prompt = tokenizer(data.draw(prompt_texts, label="prompt")).input_ids
    penalty = data.draw(st.sampled_from([1.0, 1.3]), label="repetition_penalty")
    full = reference(model, prompt, penalty)
    return prompt, draw_options(data, model, tokenizer, [full[len(prompt):]], penalty=penalty), [full]


# The properties

def note_coverage(options: GenerationOptions, result) -> None:
    """What a case exercised, for `pytest --hypothesis-show-statistics`."""
    rules, steps = options.rules, result.steps
    event(f"banned words: {bool(rules and rules.banned)}, stop strings: {bool(rules and rules.stop)}")
    event(f"finish: {result.finish_reason}, rolled back: {result.rollbacks > 0}")
    event(f"trees: {any(s.tree_size for s in steps)}, chains: {any(s.drafted and not s.tree_size for s in steps)}")
    event(f"most accepted in a step: {min(max([s.accepted for s in steps], default=0), 3)}")
    event(f"accepted drafts cut (end id or length): {bool(steps) and steps[-1].emitted <= steps[-1].accepted}")


@settings(max_examples=40, **PROPERTY)
@given(data=st.data())
def test_greedy_output_equals_plain_decoding_whatever_is_drafted(model, tokenizer, data):
    """Under any draft, with random end ids, lengths, banned words and stop strings: the output, its finish reason
    and its rollbacks are plain decoding's; every step keeps at most the drafted depth and emits at most one token
    past what it accepted, and the drafter is told each drafting step's depth and accepted count; without rules,
    the prefill and the steps' emitted tokens are the whole output."""
    prompt, options, references = draw_case(data, model, tokenizer)
    plain = generate(model, prompt, options)
    drafter = ChosenDrafter(data, [prompt + plain.new_tokens] + references, options.end_ids,
                            data.draw(st.booleans(), label="obey_depth"))
    result = generate(model, prompt, options, drafter)
    note_coverage(options, result)
    assert result.new_tokens == plain.new_tokens
    assert (result.finish_reason, result.rollbacks) == (plain.finish_reason, plain.rollbacks)
    for step in result.steps:
        depth = step.tree_depth if step.tree_size else step.drafted
        assert step.accepted <= depth and step.emitted <= step.accepted + 1
    if options.rules is None:
        assert 1 + sum(step.emitted for step in result.steps) == len(result.new_tokens)
    assert [update[:2] for update in drafter.updates] == [(s.tree_depth if s.tree_size else s.drafted, s.accepted)
                                                       for s in result.steps if s.drafted]


@settings(max_examples=30, **PROPERTY)
@given(data=st.data())
def test_the_cache_holds_exactly_the_emitted_tokens_after_every_step(model, tokenizer, data):
    """Under any draft, and after rollbacks and stops: after every step the cache holds the keys and values of
    exactly the output so far but its last token (which the next step feeds), and the output is plain decoding's."""
    prompt, options, references = draw_case(data, model, tokenizer)
    plain = generate(model, prompt, options).new_tokens
    drafter = ChosenDrafter(data, [prompt + plain] + references, options.end_ids,
                            data.draw(st.booleans(), label="obey_depth"))
    assert decode_checking_cache(model, prompt, options, drafter) == plain


def row_drafter(data, model, kind: str, references: list[list[int]], end_ids: tuple[int, ...]):
    """A drafter of `kind` for a batch row, its parameters drawn: None (plain decoding) or a real or chosen one."""
    if kind == "chosen":
        return ChosenDrafter(data, references, end_ids, data.draw(st.booleans(), label="obey_depth"))
    if kind == "ngram":
        return NgramDrafter(model, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)))
    if kind == "ngram_tree":
        return NgramTreeDrafter(model, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)),
                                data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3)))
    if kind == "self":
        skip = data.draw(st.sampled_from([([1], [2]), ([0], []), ([2], [1])]))  # rows with one skip set draft together
        return SelfDrafter(model, make_skip_set(*skip, LAYERS), DraftExit(data.draw(st.integers(1, 5))))
    return None


@settings(max_examples=25, **PROPERTY)
@given(data=st.data())
def test_a_batch_of_random_rows_gives_each_prompt_its_batch_size_1_output(model, tokenizer, data):
    """Prompts of random lengths in a batch of random width (rows free up and take the next prompt), each row with
    its own drafter (plain, chosen, n-gram chain or tree, layer-skip), under shared random end ids, length, banned
    words and stop strings: each prompt's output is plain decoding's at batch size 1."""
    prompts = [tokenizer(text).input_ids
               for text in data.draw(st.lists(prompt_texts, min_size=2, max_size=4), label="prompts")]
    references = [reference(model, prompt, 1.0) for prompt in prompts]
    options = draw_options(data, model, tokenizer, [ref[len(p):] for p, ref in zip(prompts, references)], 12)
    plain = [generate(model, prompt, options).new_tokens for prompt in prompts]
    rows = data.draw(st.integers(1, len(prompts)), label="rows")
    kinds = data.draw(st.lists(st.sampled_from(["chosen", "self", "ngram", "ngram_tree", None]), min_size=rows,
                               max_size=rows), label="drafters")
    expected = [prompt + output for prompt, output in zip(prompts, plain)]
    drafters = [row_drafter(data, model, kind, expected + references, options.end_ids) for kind in kinds]
    results = generate_batch(model, prompts, options, drafters, rows=rows)
    event(f"rows: {rows} for {len(prompts)} prompts; drafted: {sum(result.drafted > 0 for result in results)}")
    assert [result.new_tokens for result in results] == plain
