"""Batched decoding (decoding/batch.py, models/batch_cache.py): the batch's forward gives each row the logits it
would get alone, rows never see each other's padding, rows leave and join between steps, and sampled rows keep the
full model's distribution. Every registered strategy in a batch: tests/test_every_strategy.py."""

from dataclasses import replace

import pytest
import torch

from selfspec.api.decoder import DEFAULT_DRAFT
from selfspec.decoding.batch import DecodingBatch, generate_batch
from selfspec.decoding.costs import CostMeter, batch_row_prices, nondecreasing
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import HybridDrafter, NgramDrafter, SelfDrafter
from selfspec.decoding.drafters import base as drafters_base
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import make_strategy
from selfspec.errors import SelfspecError
from selfspec.models.attention_masks import block_mask
from selfspec.models.batch_cache import BatchCache, forward_batch
from selfspec.models.cache import forward, new_cache
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings, make_skip_set

from helpers import chi_square_pvalue, exact_pair_distribution

SAMPLING = default_settings().sampling
GREEDY = replace(SAMPLING, max_new_tokens=30)
PROMPTS = [[5, 40, 77], list(range(3, 23)), [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], list(range(100, 131))]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_the_batch_forward_gives_each_row_its_own_logits(family):
    """Rows at lengths 3..31 (past the 8-token sliding window), one a chain and one a token tree, in one forward:
    each row's logits equal its batch-1 forward's."""
    model = tiny_model(family, sliding_window=8).double()
    batch = BatchCache(model, 3, 48)
    prompts, alone = PROMPTS[:2] + PROMPTS[3:], []
    for row, prompt in enumerate(prompts):
        forward(model, batch.view(row), prompt, 0)
        alone.append(new_cache(model, 48))
        forward(model, alone[-1], prompt, 0)
    blocks, parents = [[7, 8, 9], [10], [11, 12, 13, 14]], [[-1, 0, 1], [-1], [-1, 0, 0, 1]]  # row 2: a tree
    starts = [len(prompt) for prompt in prompts]
    logits = forward_batch(model, batch, blocks, starts, parents)
    for row in range(2):
        torch.testing.assert_close(logits[row], forward(model, alone[row], blocks[row], starts[row]))
    # the tree: each node's logits are those of its path fed as a chain
    torch.testing.assert_close(logits[2][[0, 1, 3]], forward(model, alone[2], [11, 12, 14], starts[2]))
    torch.testing.assert_close(logits[2][2], forward(model, alone[2], [11, 13], starts[2])[1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_as_wide_run_as_a_batch_and_each_gets_its_own_logits(family):
    """Every row a 2-token chain at its own length (attention in one call, the rows as a batch): each row's logits
    equal its batch-1 forward's."""
    model = tiny_model(family, sliding_window=8).double()
    batch = BatchCache(model, 3, 48)
    alone = []
    for row, prompt in enumerate(PROMPTS[1:]):
        forward(model, batch.view(row), prompt, 0)
        alone.append(new_cache(model, 48))
        forward(model, alone[-1], prompt, 0)
    blocks, starts = [[7, 8], [9, 10], [11, 12]], [len(prompt) for prompt in PROMPTS[1:]]
    for row, logits in enumerate(forward_batch(model, batch, blocks, starts)):
        torch.testing.assert_close(logits, forward(model, alone[row], blocks[row], starts[row]))


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_a_prompt_fed_beside_another_rows_draft_is_its_prefill(family):
    """A joining row's prefill in a step's forward: a 31-token prompt (past the 8-token sliding window) beside a
    row's 3-token chain gives the last position's logits of its batch-1 prefill, and cache entries on which the next
    token's logits agree too."""
    model = tiny_model(family, sliding_window=8).double()
    batch, alone, prompt = BatchCache(model, 2, 48), new_cache(model, 48), PROMPTS[3]
    forward(model, batch.view(0), PROMPTS[1], 0)
    joining = batch.view(1)
    logits = forward_batch(model, batch, [[7, 8, 9], prompt], [len(PROMPTS[1]), 0], last_only=[1])
    assert [len(row) for row in logits] == [3, 1]
    torch.testing.assert_close(logits[1], forward(model, alone, prompt, 0, last_only=True))
    torch.testing.assert_close(forward(model, joining, [42], len(prompt)), forward(model, alone, [42], len(prompt)))


def test_the_batch_forward_feeds_only_the_rows_tokens_never_padding(tiny):
    """A 5-token block beside two 1-token blocks: the layers see 7 tokens, not 3 rows x 5."""
    batch = BatchCache(tiny, 3, 48)
    for row, prompt in enumerate(PROMPTS[:3]):
        forward(tiny, batch.view(row), prompt, 0)
    shapes = []
    hook = tiny.model.layers[0].register_forward_hook(lambda module, args, output: shapes.append(args[0].shape))
    try:
        logits = forward_batch(tiny, batch, [[7, 8, 9, 10, 11], [12], [13]], [len(p) for p in PROMPTS[:3]])
    finally:
        hook.remove()
    assert shapes == [(1, 7, tiny.config.hidden_size)]
    assert [len(row) for row in logits] == [5, 1, 1]


def test_a_mask_for_rows_of_different_widths_is_refused():
    with pytest.raises(ValueError, match=r"blocks of widths \[1, 2\] in one mask"):
        block_mask([[-1], [-1, 0]], [3, 5], 7, torch.float32, "cpu")


@pytest.mark.parametrize("neighbours", [[], [PROMPTS[1]], [PROMPTS[3], PROMPTS[2], PROMPTS[1]]])
def test_a_rows_output_does_not_depend_on_its_neighbours(tiny, neighbours):
    """The same prompt beside no, one or three neighbours of other lengths, each drafting its own way, and rows
    that end (an end id) before the others: it decodes what it decodes alone."""
    prompt = PROMPTS[0]
    end_ids = (generate(tiny, PROMPTS[1], GenerationOptions(GREEDY)).new_tokens[4],)  # the second neighbour leaves after 5 tokens
    prompts = [*neighbours[:1], prompt, *neighbours[1:]]
    drafters = [SelfDrafter(tiny, make_skip_set([1], [2], 6), DraftExit(3)),
                HybridDrafter(NgramDrafter(tiny, 2, 5), SelfDrafter(tiny, make_skip_set([3], [], 6), DraftExit(2))),
                None, NgramDrafter(tiny, 1, 4)][:len(prompts)]
    results = generate_batch(tiny, prompts, GenerationOptions(GREEDY, end_ids=end_ids), drafters=drafters)
    for ids, result in zip(prompts, results):
        assert result.new_tokens == generate(tiny, ids, GenerationOptions(GREEDY, end_ids=end_ids)).new_tokens
        assert len(result.new_tokens) <= 5 or ids != PROMPTS[1]


def test_generations_join_and_leave_between_steps(tiny):
    """A continuously batching server's pattern: rows start at different steps and a consumer removes one half-way;
    the others decode as alone."""
    settings = replace(GREEDY, max_new_tokens=12)
    batch = DecodingBatch(tiny, 3, 64)
    first = batch.add(PROMPTS[0], GenerationOptions(settings), SelfDrafter(tiny, make_skip_set([1], [], 6), DraftExit(3)))
    second = batch.add(PROMPTS[1], GenerationOptions(settings))
    outputs = {id(first): [], id(second): []}
    for step in range(6):
        if step == 2:
            late = batch.add(PROMPTS[2], GenerationOptions(settings), NgramDrafter(tiny, 1, 4))
            outputs[id(late)] = []
        if step == 3:
            batch.remove(first)  # its client went away: its slot goes to the last row
        for generation, emitted in batch.step():
            emitted.onto(outputs[id(generation)])
    while batch.rows:
        for generation, emitted in batch.step():
            emitted.onto(outputs[id(generation)])
    assert outputs[id(second)] == generate(tiny, PROMPTS[1], GenerationOptions(settings)).new_tokens
    assert outputs[id(late)] == generate(tiny, PROMPTS[2], GenerationOptions(settings)).new_tokens
    assert outputs[id(first)] == generate(tiny, PROMPTS[0], GenerationOptions(settings)).new_tokens[:len(outputs[id(first)])]


def test_fewer_rows_than_prompts_refill_as_rows_end(tiny):
    """Five prompts through two rows: a prompt waits until a row ends (one ends early at an end id) and takes its
    drafter; each decodes what it decodes alone, and its neighbours are the prompts in the batch while it was."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[0][::-1]]
    end_ids = (generate(tiny, PROMPTS[0], GenerationOptions(GREEDY)).new_tokens[3],)  # the second prompt ends after 4 tokens
    drafters = [SelfDrafter(tiny, make_skip_set([1], [2], 6), DraftExit(3)), NgramDrafter(tiny, 1, 4)]
    results = generate_batch(tiny, prompts, GenerationOptions(GREEDY, end_ids=end_ids), drafters=drafters, rows=2)
    alone = [generate(tiny, ids, GenerationOptions(GREEDY, end_ids=end_ids)).new_tokens for ids in prompts]
    assert [r.new_tokens for r in results] == alone
    assert len(results[1].new_tokens) == 4 and len(results[0].new_tokens) > 4
    assert results[0].batch_neighbours[:2] == [1, 2]  # the third prompt joined when the second ended
    assert 2 not in results[1].batch_neighbours  # it waited for the second prompt's row
    for i, result in enumerate(results):
        assert result.batch_neighbours and all(i in results[j].batch_neighbours for j in result.batch_neighbours)
    with pytest.raises(SelfspecError, match="3 drafters for a batch of 2 rows"):
        generate_batch(tiny, prompts, GenerationOptions(GREEDY), drafters=drafters + [None], rows=2)


def test_sampled_rows_keep_the_full_models_distribution_in_a_mixed_batch():
    """Two sampled rows, one drafting with a skipped sublayer and one with copies or the skip draft, beside a greedy
    neighbour that never leaves the batch before them: each sampled row's (token 2, token 3) fits its exact
    distribution."""
    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    prompts = [[5, 40, 77], [173, 238, 48, 35, 124]]
    exact = [exact_pair_distribution(model, prompt, settings) for prompt in prompts]
    skip = make_skip_set([], [1], 2)
    drafters = [SelfDrafter(model, skip, DraftExit(2)), HybridDrafter(NgramDrafter(model, 2, 2),
                                                                      SelfDrafter(model, skip, DraftExit(2)))]
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    counts, drafted, accepted = [{}, {}], 0, 0
    for _ in range(1000):
        for row, result in enumerate(generate_batch(model, prompts, GenerationOptions(settings), drafters=drafters,
                                                    generators=generators)):
            key = tuple(result.new_tokens[1:3])
            counts[row][key] = counts[row].get(key, 0) + 1
            drafted, accepted = drafted + result.drafted, accepted + result.accepted
    assert 0.1 < accepted / drafted < 0.9  # both acceptance and rejection are exercised
    for row in range(2):
        assert set(counts[row]) <= set(exact[row])
        assert chi_square_pvalue(counts[row], exact[row]) > 0.001


def test_a_batch_row_measures_its_share_of_the_batch_verify(tiny):
    meter = CostMeter(tiny, 3, repeats=1)
    batch = meter.for_batch(4)
    assert meter.for_batch(4) is batch and batch.for_batch(1) is meter
    costs = batch.costs(make_skip_set([1], [], 6))
    assert len(costs.verify_ms) == 3 and min(costs.verify_ms) > 0
    skip = make_skip_set([1], [], 6)
    assert batch.draft_ms and batch.costs(skip, alone=True).draft_ms == meter.draft_ms[(skip, id(None))]
    assert "a row of 4" in batch.summary()


def test_a_batch_rows_cost_aware_policies_know_the_batchs_rows(tiny):
    strategy = make_strategy("self_spec_hybrid", tiny, GenerationOptions(default_settings().sampling),
                             skip=make_skip_set([1], [], 6),
                             draft=replace(DEFAULT_DRAFT, policy="cost", hybrid_policy="cost"),
                             costs=CostMeter(tiny, 3, repeats=1))
    assert strategy.drafter.fallback.exit_policy.rows == 1
    for drafter in strategy.drafters(4):
        assert drafter.fallback.exit_policy.rows == drafter.ngram.exit_policy.rows == 4


def test_a_batch_row_pays_its_share_of_a_plain_step_and_its_own_widening():
    forward_ms = [40.0, 48.0, 44.0, 38.0]  # c_4(q): a plain batch step 40 ms, one row widened to 2 tokens 48, to 3 44
    assert batch_row_prices(forward_ms, 4) == [10.0, 18.0, 14.0, 10.0]  # q = 4 timed faster than 1: noise, no saving
    assert batch_row_prices(forward_ms[:3], 1) == forward_ms[:3]  # a batch of one: c(q) itself


def test_measured_prices_never_fall_as_the_block_widens():
    assert nondecreasing([10.0, 14.0, 12.0, 13.0, 20.0]) == pytest.approx([10.0, 13.0, 13.0, 13.0, 20.0])
    assert nondecreasing([12.4, 20.1, 14.1, 18.7, 22.7]) == pytest.approx([12.4, 17.1, 17.1, 18.7, 22.7], abs=0.05)
    assert nondecreasing([5.0, 3.0, 1.0]) == pytest.approx([3.0, 3.0, 3.0])
    assert nondecreasing([1.0, 2.0]) == [1.0, 2.0]


def test_the_cache_grows_with_the_batch_and_no_more(tiny):
    cache = BatchCache(tiny, 3, 40)
    one = new_cache(tiny, 40)
    forward(tiny, one, [5], 0)
    for batch_layer, layer in zip(cache.layers, one.layers):
        assert batch_layer.key_buffer.shape == (3, *layer.key_buffer.shape[1:])


def test_bad_batches_end_in_one_line(tiny):
    with pytest.raises(SelfspecError, match="empty batch"):
        generate_batch(tiny, [], GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="empty prompt"):
        generate_batch(tiny, [[5, 6], []], GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="at least one generation"):
        DecodingBatch(tiny, 0, 16)
    batch = DecodingBatch(tiny, 1, 64)
    batch.add([5, 6], GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="batch is full"):
        batch.add([5, 6], GenerationOptions(GREEDY))
    with pytest.raises(SelfspecError, match="need 34 cache positions; the batch holds 16"):
        DecodingBatch(tiny, 1, 16).add([5, 6, 7], GenerationOptions(GREEDY))


def test_rows_drafting_with_one_skip_set_run_their_draft_forwards_together(tiny):
    """Three layer-skip rows drafting 3 tokens each: their prefills run in one forward, then a step makes 3 draft
    forwards and 1 verify forward, not 3 x 3 + 1."""
    settings = replace(GREEDY, max_new_tokens=10)
    batch = DecodingBatch(tiny, 3, 64)
    prompts = PROMPTS[:3]
    for prompt in prompts:
        batch.add(prompt, GenerationOptions(settings), SelfDrafter(tiny, make_skip_set([1], [2], 6), DraftExit(3)))
    forwards = []
    hook = tiny.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        joined = batch.step()
        emitted = batch.step()
    finally:
        hook.remove()
    assert [e.step for _, e in joined] == [None] * 3  # the prefills
    assert [e.step.drafted for _, e in emitted] == [3, 3, 3]
    assert len(forwards) == 1 + 4


def test_a_joining_rows_prefill_runs_in_the_steps_one_forward(tiny):
    """Two rows decode plainly and a third joins: the next step makes one forward, which verifies the two and runs
    the third's prefill, and emits a token for each of the three; every row decodes as it would alone."""
    settings = replace(GREEDY, max_new_tokens=8)
    batch = DecodingBatch(tiny, 3, 64)
    rows = [batch.add(prompt, GenerationOptions(settings)) for prompt in PROMPTS[:2]]
    outputs = {id(row): [] for row in rows}
    for _ in range(3):
        for generation, emitted in batch.step():
            emitted.onto(outputs[id(generation)])
    late = batch.add(PROMPTS[3], GenerationOptions(settings))
    outputs[id(late)] = []
    forwards = []
    hook = tiny.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        emitted = batch.step()
    finally:
        hook.remove()
    assert len(forwards) == 1
    assert [(generation, len(e.tokens), e.step is None) for generation, e in emitted] == [
        (rows[0], 1, False), (rows[1], 1, False), (late, 1, True)]
    for generation, e in emitted:
        e.onto(outputs[id(generation)])
    while batch.rows:
        for generation, e in batch.step():
            e.onto(outputs[id(generation)])
    for generation, prompt in zip([*rows, late], [*PROMPTS[:2], PROMPTS[3]]):
        assert outputs[id(generation)] == generate(tiny, prompt, GenerationOptions(settings)).new_tokens


def test_a_row_pays_for_its_draft_forwards_split_among_the_rows_that_ran_them(tiny, monkeypatch):
    """Two layer-skip rows, one drafting 3 tokens and one 1: their first draft forward is shared, the next two are
    the first row's alone. The clock ticks a second a reading: the first row's loop reads 0 and 3 (the second's
    reads 1 and 2), so the policies learn 3000 / 3 ms x (1/2 + 1 + 1) / 3 and 1000 ms x 1/2 a draft token."""
    observed = [[], []]

    class Recording(DraftExit):
        def __init__(self, row, max_tokens):
            super().__init__(max_tokens)
            self.row = row

        def observe_draft_ms(self, per_token_ms):
            observed[self.row].append(per_token_ms)

    ticks = iter(range(1000))
    monkeypatch.setattr(drafters_base, "clock", lambda *device: next(ticks))
    batch = DecodingBatch(tiny, 2, 64)
    skip = make_skip_set([1], [2], 6)
    for row, (prompt, max_tokens) in enumerate(zip(PROMPTS[:2], (3, 1))):
        batch.add(prompt, GenerationOptions(replace(GREEDY, max_new_tokens=10)), SelfDrafter(tiny, skip, Recording(row, max_tokens)))
    batch.step()  # the prefills
    batch.step()
    assert observed[0] == [pytest.approx(3000 / 3 * (0.5 + 1 + 1) / 3)] and observed[1] == [pytest.approx(500)]
