"""Losslessness: self-speculative (and two-model) decoding reproduces plain decoding exactly."""

import copy
import random
from dataclasses import replace

import pytest
import torch
from helpers import (chi_square_pvalue, decode_checking_cache, exact_pair_distribution, hf_greedy, pinned,
                     run_settings)

from selfspec.data.prompt_sets import calibration_texts
from selfspec.decoding.costs import CostMeter, DraftCosts, paced_ms
from selfspec.decoding.draft_exit import AdaptiveExit, CostAwareExit, DraftExit, ThresholdExit
from selfspec.decoding.drafters import (GenerationContext, HybridDrafter, ModelDrafter, NgramDrafter, NgramTreeDrafter,
                                        SelfDrafter, ngram_matches)
from selfspec.decoding.drafters import layer_skip
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import make_strategy
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache
from selfspec.models.tiny import tiny_model
from selfspec.settings import default_settings, make_skip_set
from selfspec.timing import timed_ms_each

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
GREEDY = replace(SAMPLING, max_new_tokens=60)
ADAPTIVE = default_settings().draft.adaptive_options  # the config's adaptive rule (conf/draft/adaptive.yaml)


def random_setup(rng, layers=6):
    skip = make_skip_set(rng.sample(range(layers), rng.randint(0, 3)), rng.sample(range(layers), rng.randint(0, 3)),
                         layers)
    policy = rng.choice([DraftExit(rng.randint(1, 8)), ThresholdExit(rng.randint(1, 8), rng.random()),
                         AdaptiveExit(rng.randint(1, 12), rng.random(), **ADAPTIVE), random_cost_aware(rng)])
    return skip, policy


def random_cost_aware(rng, max_tokens=None):
    """A cost-aware policy over made-up costs, kept as given: c(q) from 10 ms up by random steps, d from free to
    dear."""
    verify = [10.0]
    for _ in range(8):
        verify.append(verify[-1] + rng.uniform(-1, 4))
    return pinned(CostAwareExit(max_tokens or rng.randint(1, 8), costs=DraftCosts(tuple(verify), rng.uniform(0, 8))))


def test_plain_greedy_equals_hf_generate_past_the_sliding_window(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY))
    assert len(plain.new_tokens) == 60  # > prompt + sliding window of 16 for gemma2
    assert plain.new_tokens == hf_greedy(tiny, prompt, 60)
    assert plain.acceptance_rate is None and plain.mean_accepted_tokens == 1.0


def test_self_speculative_greedy_equals_plain_for_random_skip_sets(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    rng = random.Random(0)
    for _ in range(12):
        skip, policy = random_setup(rng)
        result = generate(tiny, prompt, GenerationOptions(GREEDY), SelfDrafter(tiny, skip, policy))
        assert result.new_tokens == plain, (skip, policy)
        assert sum(s.emitted for s in result.steps) == 59  # the prefill emits the first token


def test_greedy_equality_with_repetition_penalty(tiny, prompt):
    settings = replace(SAMPLING, max_new_tokens=40, repetition_penalty=1.3)
    plain = generate(tiny, prompt, GenerationOptions(settings)).new_tokens
    out = tiny.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=40, do_sample=False, repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert plain == out
    for skip in ([1], [4]):
        result = generate(tiny, prompt, GenerationOptions(settings),
                          SelfDrafter(tiny, make_skip_set(skip, skip, 6), DraftExit(5)))
        assert result.new_tokens == plain


def test_eos_inside_a_draft_and_length_reached_mid_draft(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    eos = plain[25]  # some token the model emits: generation must stop at its first occurrence
    expected = plain[: plain.index(eos) + 1]
    perfect = ModelDrafter(tiny, DraftExit(8))  # drafts with the full model: every draft accepted, EOS inside a draft
    for drafter in (perfect, SelfDrafter(tiny, make_skip_set([2], [3], 6), DraftExit(8))):
        result = generate(tiny, prompt, GenerationOptions(GREEDY, end_ids=(eos,)), drafter)
        assert result.new_tokens == expected
        assert hf_greedy(tiny, prompt, 60, eos=eos) == expected
    for n in (1, 2, 13, 17):  # 8-token drafts would overshoot these lengths
        short = replace(SAMPLING, max_new_tokens=n)
        result = generate(tiny, prompt, GenerationOptions(short), perfect)
        assert result.new_tokens == plain[:n]
        assert max(s.drafted for s in result.steps or [DraftExit()]) <= 8 if result.steps else n == 1


def test_two_model_speculative_greedy_equals_plain(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    family = "gemma2" if tiny.config.model_type == "gemma2" else "llama"
    small = tiny_model(family, num_layers=2, seed=1).double()
    for policy in (DraftExit(3), ThresholdExit(6, 0.3), AdaptiveExit(6, 0.8, **ADAPTIVE)):
        assert generate(tiny, prompt, GenerationOptions(GREEDY), ModelDrafter(small, policy)).new_tokens == plain
    assert generate(tiny, prompt, GenerationOptions(GREEDY), ModelDrafter(tiny, DraftExit(4))).acceptance_rate == 1.0


def test_cache_holds_exactly_the_kept_tokens_after_every_step(tiny, prompt):
    options = GenerationOptions(replace(SAMPLING, max_new_tokens=40))
    drafter = SelfDrafter(tiny, make_skip_set([1, 3], [2], 6), DraftExit(5))
    assert decode_checking_cache(tiny, prompt, options, drafter) == generate(tiny, prompt, options).new_tokens


def test_forward_logits_equal_the_models_own_head(tiny, prompt):
    """Our output layer (W @ hidden.T, one row computed as two; Gemma-2's soft-capping) is the model's head."""
    for rows in (1, 3):
        expected = tiny(torch.tensor([prompt[:rows]])).logits[0].float()  # (rows, vocab)
        torch.testing.assert_close(forward(tiny, new_cache(tiny, 16), prompt[:rows], 0), expected)


def test_the_first_ngram_match_copies_after_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 2, 7, 1, 2]
    assert ngram_matches(tokens, 2, 3, limit=1) == [(2, [4, 5, 2])]  # (1, 2) last seen before 4
    assert ngram_matches(tokens, 2, 10, limit=1) == [(2, [4, 5, 2, 7, 1, 2])]
    assert ngram_matches([3, 2, 8, 6, 2], 2, 4, limit=1) == [(1, [8, 6, 2])]  # no 2-gram match: falls back to (2,)
    assert ngram_matches([1, 2, 3], 2, 4, limit=1) == []


def test_hybrid_and_prompt_lookup_greedy_equal_plain(tiny, tokenizer):
    prompt = tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids  # repeats to copy
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    rng = random.Random(1)
    for _ in range(4):
        skip, policy = random_setup(rng)
        ngram = NgramDrafter(tiny, rng.randint(1, 3), rng.randint(1, 10))
        costly = NgramDrafter(tiny, rng.randint(1, 3), 8, random_cost_aware(rng, 8))
        for drafter in (ngram, HybridDrafter(ngram, SelfDrafter(tiny, skip, policy)),
                        HybridDrafter(costly, SelfDrafter(tiny, skip, random_cost_aware(rng)))):
            result = generate(tiny, prompt, GenerationOptions(GREEDY), drafter)
            assert result.new_tokens == plain, (skip, policy, drafter)
            assert "ngram" in {s.source for s in result.steps}


def test_cost_aware_hybrid_copies_past_the_model_drafts_length(tiny, tokenizer):
    """Each part of the hybrid drafts up to its own cap: with a flat c(q), copies run to 10 tokens where the
    layer-skip draft stops at 4."""
    prompt = tokenizer("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids
    flat = (10.0,) * 11
    copier = NgramDrafter(tiny, 2, 10, pinned(CostAwareExit(10, costs=DraftCosts(flat, 0.0))))
    drafter = HybridDrafter(copier, SelfDrafter(tiny, make_skip_set([1], [2], 6),
                                                pinned(CostAwareExit(4, costs=DraftCosts(flat, 1.0)))))
    result = generate(tiny, prompt, GenerationOptions(GREEDY), drafter)
    assert result.new_tokens == generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    assert max(s.drafted for s in result.steps if s.source == "ngram") > 4
    assert max(s.drafted for s in result.steps if s.source == "model") <= 4


@pytest.mark.parametrize("tree", [False, True])
def test_failed_one_token_matches_do_not_stop_the_copies_of_longer_ones(tiny, tree):
    """A copier learns its rate apart per match length: copies after 1-token matches that verification keeps
    rejecting stop being drafted, while a copy after a 2-token match is drafted at once, step after step (with one
    rate for both it would wait for a probe)."""
    policy = pinned(CostAwareExit(5, costs=DraftCosts(tuple(10.0 + 2 * q for q in range(9)), 0.0)))  # +20% a token
    copier = NgramTreeDrafter(tiny, 2, 8, 5, 3, policy) if tree else NgramDrafter(tiny, 2, 5, policy)
    copier.begin(GenerationContext(new_cache(tiny, 32), GREEDY))
    one_token_match, two_token_match = [5, 6, 9, 7, 8, 6], [5, 6, 9, 7, 8, 5, 6]
    drafted = []
    for _ in range(30):
        draft = copier.draft(one_token_match, 5)
        drafted.append(bool(draft.tokens))
        if draft.tokens:
            copier.update(len(draft.tokens), 0, [] if tree else None)
    assert drafted[0] and sum(drafted[-16:]) <= 2  # idle but for probes
    assert all(copier.draft(two_token_match, 5).tokens[:1] == [9] for _ in range(3))
    assert copier.threshold == 0.5  # the 2-token matches' rate: its prior, untouched by the 1-token failures


def test_the_loop_tells_the_drafter_what_each_verify_took(tiny, prompt):
    """After every step at batch size 1: the tokens it verified and the milliseconds its record keeps."""
    observed = []

    class Recording(DraftExit):
        def observe_verify_ms(self, tokens, ms):
            observed.append((tokens, ms))

    result = generate(tiny, prompt, GenerationOptions(GREEDY),
                      SelfDrafter(tiny, make_skip_set([1], [2], 6), Recording(3)))
    assert observed == [(step.drafted + 1, pytest.approx(1000 * step.verify_s)) for step in result.steps]
    assert max(tokens for tokens, _ in observed) == 4


def test_a_drafter_that_observes_verifications_sees_every_steps_scores_and_path(tiny, prompt):
    """observe_verification: told every step, drafted or not; the scores' rows follow the draft, and greedy, the
    accepted path's last row argmax is the full model's own next token."""
    seen = []

    class Observing(SelfDrafter):
        def observe_verification(self, verification):
            seen.append(verification)

    result = generate(tiny, prompt, GenerationOptions(GREEDY),
                      Observing(tiny, make_skip_set([1], [2], 6), ThresholdExit(3, 0.0)))
    assert len(seen) == len(result.steps)
    for verification, step in zip(seen, result.steps):
        assert verification.target.shape[0] == 1 + len(verification.draft.tokens) == 1 + step.drafted
        assert verification.path == list(range(step.accepted))
        assert int(verification.target[len(verification.path)].argmax()) == verification.next_token


def test_a_cost_aware_drafter_that_does_not_pay_drafts_only_on_probes(tiny, prompt):
    """Wide verifies three times a plain step's cost: drafting would pay only at acceptances near 1, so the policy
    drafts on its probes alone; and a draft token dearer than 10 plain steps is never even probed."""
    plain = generate(tiny, prompt, GenerationOptions(GREEDY))
    skip = make_skip_set([1], [2], 6)
    dear_verify = pinned(CostAwareExit(4, costs=DraftCosts((10.0, 30.0, 30.0, 30.0, 30.0), draft_ms=0.5)))
    result = generate(tiny, prompt, GenerationOptions(GREEDY), SelfDrafter(tiny, skip, dear_verify))
    assert result.new_tokens == plain.new_tokens
    assert [i for i, step in enumerate(result.steps) if step.drafted] == [3, 11, 27]
    dear_draft = pinned(CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=100.0)))
    result = generate(tiny, prompt, GenerationOptions(GREEDY), SelfDrafter(tiny, skip, dear_draft))
    assert result.new_tokens == plain.new_tokens and not any(step.drafted for step in result.steps)


def test_a_layer_skip_drafter_swaps_its_sublayers_only_for_steps_that_draft(tiny, prompt, monkeypatch):
    """Entering a skip set swaps modules, work an idle step need not do: a step whose policy plans no draft leaves
    the layers alone."""
    entered, real = [], layer_skip.skipping
    monkeypatch.setattr(layer_skip, "skipping", lambda *args: entered.append(1) or real(*args))
    dear_verify = pinned(CostAwareExit(4, costs=DraftCosts((10.0, 30.0, 30.0, 30.0, 30.0), draft_ms=0.5)))
    result = generate(tiny, prompt, GenerationOptions(GREEDY),
                      SelfDrafter(tiny, make_skip_set([1], [2], 6), dear_verify))
    assert len(entered) == sum(1 for step in result.steps if step.drafted) == 3


def test_costs_are_timed_round_after_round_so_a_slow_spell_falls_on_every_q(monkeypatch):
    calls, now = [], iter(range(100))
    monkeypatch.setattr("selfspec.timing.clock", lambda device: next(now))  # each reading 1 s after the last
    steps = [lambda q=q: calls.append(q) for q in (1, 2, 3)]
    assert timed_ms_each(steps, "cpu", repeats=2) == [1000.0] * 3
    assert calls == [1, 2, 3] * 3  # one untimed round, then two timed ones, every step in each


def test_a_draft_timed_in_turns_with_a_plain_step_keeps_its_ratio_through_a_slow_spell(monkeypatch):
    """A draft token takes 1.5 plain steps; in the last four of the seven timed rounds the machine runs 4x slower.
    Timed alone its median would read the slow spell (6 s); paced, it reads 1.5 x the meter's c(1)."""
    now, rounds = [0.0], []
    monkeypatch.setattr("selfspec.timing.clock", lambda device: now[0])

    def spell():
        return 4.0 if len(rounds) > 4 else 1.0

    def draft():
        rounds.append("draft")
        now[0] += 1.5 * spell()

    def plain():
        now[0] += 1.0 * spell()
    assert paced_ms(draft, plain, 40.0, "cpu", repeats=7) == pytest.approx(60.0)


def test_cost_aware_strategies_share_one_measurement_and_equal_plain(tiny, prompt):
    draft = run_settings("draft=cost", "draft.max_tokens=4").draft
    meter = CostMeter(tiny, 11, repeats=1)
    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    skip = make_skip_set([1], [2], 6)
    strategies = [make_strategy(name, tiny, GenerationOptions(GREEDY), skip=skip, draft=draft, costs=meter)
                  for name in ("self_spec", "self_spec_cost", "self_spec_hybrid")]
    assert len(meter.verify_ms) == 11 and meter.draft_ms.keys() == {(skip, id(None)), None}  # None: copies
    assert meter.draft_ms[None] == 0.0
    summary = meter.summary()
    assert summary.startswith("cost model: c(q) ms 1: ") and summary.endswith(" ms with 2 sublayers skipped")
    assert CostMeter(tiny, 3).summary() == ""  # nothing measured yet
    hybrid = strategies[2].drafter
    assert hybrid.ngram.exit_policy.costs == DraftCosts(meter.verify_ms, 0.0)  # copies cost nothing to draft
    assert hybrid.fallback.exit_policy.costs.draft_ms == meter.draft_ms[(skip, id(None))]  # until drafting measures it
    assert (hybrid.ngram.max_tokens, hybrid.ngram.exit_policy.max_tokens, hybrid.fallback.max_tokens) == (10, 10, 4)
    assert all(s.generate(prompt).new_tokens == plain for s in strategies)
    adaptive = run_settings("draft=cost", "draft.max_tokens=4", "draft.hybrid_policy=adaptive").draft
    hybrid = make_strategy("self_spec_hybrid", tiny, GenerationOptions(GREEDY), skip=skip, draft=adaptive,
                           costs=meter).drafter
    assert (hybrid.ngram.max_tokens, hybrid.ngram.exit_policy, hybrid.max_tokens) == (4, None, 4)
    with pytest.raises(SelfspecError, match="draft.policy=cost is for the layer-skip and copying drafters; "
                                            "strategy two_model takes"):
        make_strategy("two_model", tiny, GenerationOptions(GREEDY), skip=skip, draft=draft, draft_model=tiny,
                      costs=meter)


def test_target_gate_at_one_never_drafts_and_at_zero_changes_nothing(tiny, prompt):
    plain = generate(tiny, prompt, GenerationOptions(GREEDY))
    skip = make_skip_set([1], [2], 6)
    closed = generate(tiny, prompt, GenerationOptions(GREEDY, target_gate=1.0), SelfDrafter(tiny, skip, DraftExit(3)))
    assert closed.new_tokens == plain.new_tokens
    assert closed.drafted == 0 and len(closed.steps) == len(plain.steps) == closed.gated_steps
    ungated = generate(tiny, prompt, GenerationOptions(GREEDY),
                       SelfDrafter(tiny, skip, AdaptiveExit(6, 0.8, **ADAPTIVE)))
    open_gate = generate(tiny, prompt, GenerationOptions(GREEDY, target_gate=0.0),
                         SelfDrafter(tiny, skip, AdaptiveExit(6, 0.8, **ADAPTIVE)))
    assert open_gate.new_tokens == ungated.new_tokens == plain.new_tokens and open_gate.gated_steps == 0
    assert [(s.drafted, s.accepted) for s in open_gate.steps] == [(s.drafted, s.accepted) for s in ungated.steps]


def test_target_gate_drafts_only_after_confident_steps(tiny, prompt):
    gate = 0.2
    result = generate(tiny, prompt, GenerationOptions(GREEDY, target_gate=gate),
                      SelfDrafter(tiny, make_skip_set([1], [], 6), DraftExit(3)))
    assert result.new_tokens == generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    for before, step in zip(result.steps, result.steps[1:]):
        assert step.gated == (before.target_confidence <= gate) and (step.drafted == 0 or not step.gated)
    assert 0 < result.gated_steps < len(result.steps)
    with pytest.raises(SelfspecError, match=r"target_gate=1.5 is outside \[0, 1\]"):
        generate(tiny, prompt, GenerationOptions(GREEDY, target_gate=1.5),
                 SelfDrafter(tiny, make_skip_set([1], [], 6), DraftExit(3)))


def test_a_drafting_strategy_takes_draft_target_gate_and_plain_ignores_it(tiny, prompt):
    closed = replace(default_settings().draft, policy="fixed", target_gate=1.0)
    skip = make_skip_set([1], [2], 6)
    gated, plain = (make_strategy(name, tiny, GenerationOptions(GREEDY), skip=skip, draft=closed)
                    for name in ("self_spec", "plain"))
    assert gated.options.target_gate == 1.0 and plain.options.target_gate is None
    result = gated.generate(prompt)
    assert result.drafted == 0 and result.gated_steps == len(result.steps) > 0


def test_empty_prompt_is_rejected(tiny):
    with pytest.raises(SelfspecError, match="empty prompt"):
        generate(tiny, [], GenerationOptions(GREEDY))


def perturbed_copy(model):
    """A second model over the same vocabulary whose distributions overlap the target's only partly."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.5 * torch.randn(other.lm_head.weight.shape, generator=torch.Generator().manual_seed(1),
                                                     dtype=torch.float64))
    return other


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["self", "two_model", "hybrid"])
def test_speculative_sampling_matches_the_full_models_distribution(drafter_kind):
    """Chi-square goodness of fit of (token 2, token 3), both decided inside one speculative step, against
    the exact distribution of plain sampling. The draft differs strongly from the target, so rejections and
    residual resampling happen often. The hybrid's prompt was picked so that the first new token often has an
    earlier occurrence to copy after (one-hot q) and the layer-skip draft covers the rest."""
    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    prompt = [173, 238, 48, 35, 124] if drafter_kind == "hybrid" else [5, 40, 77]
    skip_drafter = SelfDrafter(model, make_skip_set([], [1], 2), DraftExit(2))
    drafter = {"self": skip_drafter, "two_model": ModelDrafter(perturbed_copy(model), DraftExit(2)),
               "hybrid": HybridDrafter(NgramDrafter(model, 2, 2), skip_drafter)}[drafter_kind]
    exact = exact_pair_distribution(model, prompt, settings)
    gen = torch.Generator().manual_seed(0)
    n, counts, drafted, accepted, sources = 2000, {}, 0, 0, set()
    for _ in range(n):
        result = generate(model, prompt, GenerationOptions(settings, generator=gen), drafter)
        key = tuple(result.new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
        sources |= {s.source for s in result.steps}
    assert set(counts) <= set(exact)
    assert 0.1 < accepted / drafted < 0.9  # both acceptance and rejection are exercised
    assert chi_square_pvalue(counts, exact) > 0.001
    if drafter_kind == "hybrid":
        assert {"ngram", "model"} <= sources


def test_reduced_draft_vocabulary_keeps_greedy_output(tiny, prompt, tokenizer):
    from selfspec.models.draft_vocabulary import make_draft_vocabulary

    plain = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    head = make_draft_vocabulary(tiny, tokenizer, 64, calibration_texts())
    assert len(head.token_ids) == 64
    for skip in ([], [2]):
        result = generate(tiny, prompt, GenerationOptions(GREEDY),
                          SelfDrafter(tiny, make_skip_set(skip, [], 6), DraftExit(4), head))
        assert result.new_tokens == plain and result.drafted > 0


@pytest.mark.slow
def test_speculative_sampling_with_a_reduced_draft_vocabulary_is_exact():
    """The draft can propose only 40 of 259 tokens; the residual must supply the rest."""
    from selfspec.models.draft_vocabulary import make_draft_vocabulary
    from selfspec.models.tiny import byte_tokenizer

    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(SAMPLING, temperature=1.0, top_k=3, max_new_tokens=3)
    head = make_draft_vocabulary(model, byte_tokenizer(), 40, calibration_texts())
    drafter = SelfDrafter(model, make_skip_set([], [], 2), DraftExit(2), head)
    exact = exact_pair_distribution(model, [5, 40, 77], settings)
    gen = torch.Generator().manual_seed(1)
    n, counts = 2000, {}
    for _ in range(n):
        key = tuple(generate(model, [5, 40, 77], GenerationOptions(settings, generator=gen), drafter).new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    assert chi_square_pvalue(counts, exact) > 0.001


def test_bad_draft_vocabulary_size(tiny, tokenizer):
    from selfspec.models.draft_vocabulary import make_draft_vocabulary

    with pytest.raises(SelfspecError, match=r"draft.vocab_size=0 is outside 1..259"):
        make_draft_vocabulary(tiny, tokenizer, 0, calibration_texts())
