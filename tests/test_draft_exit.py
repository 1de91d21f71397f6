import copy
import dataclasses

import pytest

from selfspec.decoding.costs import DraftCosts, expected_emitted
from selfspec.decoding.draft_exit import (AcceptanceTally, AdaptiveExit, CostAwareExit, DraftExit, ThresholdExit,
                                          make_exit_policy)
from selfspec.decoding.drafters.ngram import cut_copy
from selfspec.errors import SelfspecError
from selfspec.settings import default_settings

ADAPTIVE = default_settings().draft.adaptive_options  # the config's adaptive rule (conf/draft/adaptive.yaml)


def test_adaptive_rule_follows_a_hand_worked_sequence():
    """beta1 0.5, alpha 0.9, eps 0.01, beta2 0.9, gamma0 0.8, max_tokens 4; worked out by hand:
    (drafted, accepted) -> running acceptance m -> candidate -> threshold."""
    policy = AdaptiveExit(max_tokens=4, initial_threshold=0.8, beta1=0.5, target_acceptance=0.9, epsilon=0.01,
                          beta2=0.9)
    sequence = [  # drafted, accepted, m, threshold
        (4, 4, 0.5, 0.801),  # m < alpha: candidate 0.81
        (4, 4, 0.75, 0.802),  # m < alpha: candidate 0.811
        (4, 4, 0.875, 0.803),  # m < alpha: candidate 0.812
        (2, 2, 0.9375, 0.802),  # m >= alpha, stopped early: candidate 0.793
        (4, 4, 0.96875, 0.802),  # m >= alpha, ran to max_tokens: candidate 0.802 (held)
        (4, 0, 0.484375, 0.803),  # m < alpha: candidate 0.812
        (0, 0, 0.484375, 0.803),  # nothing drafted: no update
    ]
    for drafted, accepted, m, threshold in sequence:
        policy.update(drafted, accepted)
        assert policy.mean_acceptance == pytest.approx(m)
        assert policy.threshold == pytest.approx(threshold, abs=1e-12)


def test_threshold_policy_stops_below_its_threshold():
    policy = ThresholdExit(max_tokens=5, initial_threshold=0.6)
    assert policy.should_stop(0.59) and not policy.should_stop(0.6)
    policy.update(5, 0)
    assert policy.threshold == 0.6  # fixed


def test_fixed_policy_never_stops():
    assert not DraftExit(3).should_stop(0.0) and DraftExit(3).threshold == 0.0


def test_cost_aware_policy_probes_with_doubling_waits_when_drafting_does_not_pay():
    """A draft token at half a full step: at the prior acceptance 0.5 the best length (k = 1) is expected at
    1.5 * 10 / (5 + 12) = 0.88x plain, so the policy drafts only on probes, after 4, 8, 16, 32, 64, 64 steps (were
    every token accepted, 4 drafts would run at 5 * 10 / (20 + 18) = 1.32x: worth probing for)."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=5.0))
    assert policy.best_length(4) == (1, pytest.approx(15 / 17))
    plans = [policy.plan(4) for _ in range(200)]
    assert [step for step, k in enumerate(plans, 1) if k] == [4, 12, 28, 60, 124, 188]
    assert {k for k in plans if k} == {4}  # a probe may draft the longest; should_stop ends it sooner


def test_a_draft_that_cannot_pay_drafts_one_token_every_64_steps_to_meet_its_costs_again():
    """A draft token as dear as a full step: even if verification accepted every token, k drafts would emit k + 1
    tokens for 10 k + c(k + 1) ms, at most 5 * 10 / 58 = 0.86x plain. Only a 1-token probe every 64 steps."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=10.0))
    assert not policy.can_pay(4)
    plans = [policy.plan(4) for _ in range(200)]
    assert [i for i, k in enumerate(plans) if k] == [63, 127, 191] and set(plans) == {0, 1}


def test_a_row_of_a_batch_that_cannot_pay_probes_as_often_as_the_batch_would_alone():
    """A row probing alone stalls its batch's other rows for the draft forward: in a batch of 4, every 4 x 64 steps."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=10.0), rows=4)
    plans = [policy.plan(4) for _ in range(600)]
    assert [i for i, k in enumerate(plans) if k] == [255, 511]


def test_a_probe_that_meets_a_cheaper_draft_ends_the_idle_spell():
    """Drafts met at 1.5x the meter's d in a slow spell (its c(1) unmet) take the best case below the margin, 1.2:
    5 x 10 / (4 x 7.5 + 10) = 1.25x would have paid, 5 x 10 / (4 x 11.25 + 10) = 0.91x does not. The probes meet d at
    its reading again, and the policy drafts once more."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0,) * 5, draft_ms=7.5), min_best_speedup=1.2)
    for _ in range(30):
        policy.observe_draft_ms(11.25)
    policy.update(4, 4)
    assert not policy.can_pay(4)
    for step in range(64 * 40):
        if policy.plan(4) == 1:
            policy.observe_draft_ms(5.0)
            policy.update(1, 1)
        if policy.can_pay(4):
            break
    assert policy.can_pay(4) and policy.plan(4) == 4 and 63 <= step < 64 * 3  # each probe weighs as much as before


def test_cost_aware_policy_carries_what_drafting_taught_into_the_next_generation():
    """At begin() the draft in progress, the steps since the last probe and the probe back-off start afresh; the
    acceptance rates (a draft's first token's and the later tokens'), their bins and the draft cost met carry over.
    The paper's adaptive rule carries its threshold over too, as its code does."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=5.0))
    for _ in range(10):
        policy.plan(4)
        policy.should_stop(0.95)
        policy.update(1, 0)
    policy.observe_draft_ms(15.0)
    policy.plan(4)
    policy.should_stop(0.95)
    learnt = (policy.first_rate, policy.later_rate, copy.deepcopy([policy.first_bins, policy.later_bins]))
    assert policy.first_rate < 0.2 and policy.wait > 4 and policy.idle > 0 and policy.confidences
    policy.begin()
    assert (pytest.approx(policy.first_rate), pytest.approx(policy.later_rate),
            [policy.first_bins, policy.later_bins]) == learnt
    assert (policy.idle, policy.wait, policy.confidences, policy.survival, policy.emitted) == (0, 4, [], 1.0, 1.0)
    assert policy.costs.draft_ms == pytest.approx((5.0 + 15.0) / 2)
    for _ in range(30):  # a generation of long accepted copies: 0.99 on the weight of ~100 tokens
        policy.update(10, 10)
    policy.begin()  # the next one starts from its rates, each on the prior's weight of 2 tokens
    assert min(policy.first_rate, policy.later_rate) > 0.95
    assert policy.first_counts.judged == policy.later_counts.judged == 2.0
    policy.update(1, 0)
    policy.update(1, 0)
    assert policy.first_rate < 0.5  # two rejected copies of a text unlike the last are enough
    adaptive = AdaptiveExit(4, 0.8, **ADAPTIVE)
    adaptive.update(4, 0)
    threshold = adaptive.threshold
    adaptive.begin()
    assert adaptive.threshold == threshold != 0.8


def test_cost_aware_policy_verifies_at_the_width_where_c_of_q_is_cheap():
    """Copies (d = 0) at acceptance 0.5 with c(q) = 10, 13, 16, 12, 12: speedups 1.5 * 10 / 13, 1.75 * 10 / 16,
    1.875 * 10 / 12, 1.9375 * 10 / 12: a 4-token copy (a 5-token verify) beats the shorter ones."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 13.0, 16.0, 12.0, 12.0), draft_ms=0.0))
    assert policy.best_length(4) == (4, pytest.approx(19.375 / 12))
    assert policy.best_length(2) == (1, pytest.approx(15 / 13))
    assert policy.plan(3) == 3


def test_cost_aware_policy_counts_only_the_draft_tokens_verification_judged():
    policy = CostAwareExit(4, costs=DraftCosts((10.0,) * 5, draft_ms=1.0))
    policy.plan(4)
    for confidence in (0.95, 0.95, 0.15):
        policy.should_stop(confidence)
    policy.update(3, 1)  # the first accepted, the second rejected, the third never judged
    # the prior 1 of 2, decayed, + 1 of 1
    assert policy.first_counts == AcceptanceTally(pytest.approx(1.9), pytest.approx(2.8))
    assert policy.later_counts == AcceptanceTally(0.0, 1.0)  # 0 of 1
    assert policy.acceptance == policy.threshold == pytest.approx(1.9 / 3.8)
    assert policy.later_rate == pytest.approx((0.0 + 2 * 1.9 / 2.8) / (1.0 + 2))  # shrunk to the first token's
    assert policy.first_bins == [AcceptanceTally(0.0, 0.0)] * 4 + [AcceptanceTally(1.0, 1.0)]
    assert policy.later_bins == [AcceptanceTally(0.0, 0.0)] * 4 + [AcceptanceTally(0.0, 1.0)]


def test_cost_aware_policy_learns_which_confidences_verification_accepts():
    """Cheap drafts (d = 1, flat c(q) = 10): untrained, a 0.1-confidence token counts as the prior 0.5 and drafting
    goes on; after steps where 0.95-confidence tokens were accepted and 0.1-confidence ones rejected, drafting goes
    on after a confident token and stops after an unsure one."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0,) * 5, draft_ms=1.0))
    policy.plan(4)
    assert not policy.should_stop(0.1)
    for _ in range(30):
        for confidences, accepted in (((0.95, 0.95, 0.1), 2), ((0.1,), 0)):  # first tokens and later ones alike
            policy.plan(4)
            for confidence in confidences:
                policy.should_stop(confidence)
            policy.update(len(confidences), accepted)
    for later in (False, True):
        assert policy.calibrated(0.95, later) > 0.8 > 0.2 > policy.calibrated(0.1, later)
    assert policy.plan(4) == 4
    assert not policy.should_stop(0.95) and not policy.should_stop(0.95) and policy.should_stop(0.1)


@pytest.mark.parametrize("make,message", [
    (lambda: ThresholdExit(4, 1.2), "threshold=1.2 is outside [0, 1]"),
    (lambda: ThresholdExit(4, -0.1), "threshold=-0.1 is outside [0, 1]"),
    (lambda: AdaptiveExit(4, 0.8, **{**ADAPTIVE, "beta2": 2.0}), "beta2=2.0 is outside [0, 1]"),
    (lambda: DraftExit(0), "max_tokens=0 must be >= 1"),
    (lambda: CostAwareExit(4, costs=DraftCosts((10.0,), 1.0)), "the cost-aware draft exit needs c(q) for q = 1 and 2 at least"),
    (lambda: CostAwareExit(4, costs=DraftCosts((10.0, 12.0), 1.0), decay=1.0), "decay=1.0 must be in (0, 1)"),
])
def test_bad_policy_settings(make, message):
    with pytest.raises(SelfspecError) as error:
        make()
    assert str(error.value) == message


def test_cost_aware_policy_follows_the_draft_cost_it_meets():
    """The meter's reading counts as one meeting: a mean of every meeting so far, then a moving average once a
    meeting's weight would fall below 1 - decay."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0), draft_ms=2.0))
    policy.observe_draft_ms(12.0)
    assert policy.costs.draft_ms == pytest.approx((2.0 + 12.0) / 2)
    policy.observe_draft_ms(5.0)
    assert policy.costs.draft_ms == pytest.approx((2.0 + 12.0 + 5.0) / 3)
    for _ in range(7):
        policy.observe_draft_ms(10.0)
    assert policy.costs.draft_ms == pytest.approx((2.0 + 12.0 + 5.0 + 7 * 10.0) / 10)
    policy.observe_draft_ms(20.0)
    assert policy.costs.draft_ms == pytest.approx(0.9 * (89.0 / 10) + 0.1 * 20.0)
    DraftExit(3).observe_draft_ms(5.0)  # the other policies ignore it


def test_cost_aware_policy_follows_each_verify_cost_it_meets_and_stops_drafting_where_it_no_longer_pays():
    """The meter read c(2) = c(1) (SmolLM2 here: its pooled medians), the loop's 2-token verify takes 2.5 c(1): a
    1-token draft that paid 2 x 10 / 12 = 1.67x at full acceptance then pays 20 / 27 = 0.74x: nothing for 63 steps,
    then only the 1-token probe of a drafter that cannot pay."""
    policy = CostAwareExit(1, costs=DraftCosts((10.0, 10.0), draft_ms=2.0))
    assert policy.can_pay(1)
    policy.observe_verify_ms(2, 25.0)
    policy.observe_verify_ms(3, 99.0)  # longer than any draft it plans: nothing to follow
    assert policy.costs.verify_ms == (10.0, pytest.approx((10.0 + 25.0) / 2))
    for _ in range(30):
        policy.observe_verify_ms(2, 25.0)
        policy.observe_verify_ms(1, 10.0)
    assert not policy.can_pay(1) and not any(policy.plan(1) for _ in range(63))
    DraftExit(3).observe_verify_ms(2, 5.0)  # the other policies ignore it


def test_a_slow_spell_moves_every_cost_with_the_plain_step():
    """Plain steps met at twice the measured c(1): d and the wider verifies, met less often, move with them, so a
    draft that did not pay still does not (had c(1) alone moved, 2 x 20 / (9 + 10) would read 2.1x)."""
    policy = CostAwareExit(1, costs=DraftCosts((10.0, 10.0), draft_ms=9.0), min_speedup=1.1)
    assert not policy.can_pay(1)  # 2 x 10 / 19 = 1.05x at best
    for _ in range(50):
        policy.observe_verify_ms(1, 20.0)
    assert policy.costs.verify_ms[0] == pytest.approx(20.0, rel=0.01)
    assert policy.costs.draft_ms / policy.costs.verify_ms[0] == pytest.approx(0.9)
    assert policy.costs.verify_ms[1] == pytest.approx(policy.costs.verify_ms[0])
    assert not policy.can_pay(1)


def test_a_drafter_whose_best_case_is_within_the_margin_only_meets_its_costs_again():
    """d = 0.85 c(1), c flat (SmolLM2's layer-skip draft by the meter here): were every token accepted, 4 drafts would
    run 5 x 10 / (4 x 8.5 + 10) = 1.14x. Without a margin the policy drafts once drafts are accepted, and probes once
    they are not; with min_best_speedup 1.2 it does neither, but for a 1-token probe every 64 steps."""
    costs = DraftCosts((10.0,) * 5, draft_ms=8.5)
    plain = CostAwareExit(4, costs=costs)
    margin = CostAwareExit(4, costs=costs, min_best_speedup=1.2)
    assert plain.can_pay(4) and not margin.can_pay(4)
    for _ in range(20):
        for policy in (plain, margin):
            policy.update(4, 4)
    assert plain.plan(4) == 4 and margin.plan(4) == 0
    for _ in range(20):
        plain.update(4, 0)
    assert sum(plain.plan(4) > 0 for _ in range(100)) >= 2  # probes
    assert [k for k in (margin.plan(4) for _ in range(100)) if k] == [1]
    cheap = CostAwareExit(4, costs=DraftCosts((10.0,) * 5, draft_ms=5.0), min_best_speedup=1.2)
    assert cheap.can_pay(4)  # 5 x 10 / 30 = 1.67x at best: the margin leaves it


def test_make_exit_policy_passes_the_configured_margin():
    draft = dataclasses.replace(default_settings().draft, min_best_speedup=1.3)
    policy = make_exit_policy(draft, greedy=True, policy="cost", costs=DraftCosts((10.0, 10.0), 1.0))
    assert policy.min_best_speedup == 1.3


def shaped_after_two_drafts(verify_ms: tuple[float, ...]) -> tuple[CostAwareExit, tuple[list[int], list[int]]]:
    """A 2-token chain (each calibrated at the prior 0.5: P(accepted) 0.5 and 0.25, so E = 1.75 tokens) and two
    offered leaves of probability 0.3: `a` beside the first chain token (gain 0.3), `b` beside the second (0.5 x 0.3
    = 0.15). d = 1 ms, so the chain alone runs at 1.75 x 10 / (2 + c(3) = 14) = 1.09x plain."""
    policy = CostAwareExit(4, costs=DraftCosts(verify_ms, 1.0))
    assert policy.plan(2) == 2
    policy.should_stop(0.9)
    policy.should_stop(0.9)
    return policy, policy.shape_tree([-1, 0], ["a", "b"], [0.3, 0.3], max_nodes=8)


def test_cost_aware_tree_adds_a_branch_only_where_the_wider_verify_pays():
    # c(4) dips below c(3): a: 20.5 / (2 + 11) = 1.58x; a and b: 22 / (2 + 30) = 0.69x -> a only, beside the root
    assert shaped_after_two_drafts((10.0, 12.0, 14.0, 11.0, 30.0))[1] == ([0], [-1])
    # c(4) dear: a: 20.5 / 22 = 0.93x < 1.09x -> no branch
    assert shaped_after_two_drafts((10.0, 12.0, 14.0, 20.0, 30.0))[1] == ([], [])
    # c(4) dear but c(5) cheap: a alone 20.5 / 21 = 0.98x does not pay, a and b 22 / 13 = 1.69x do
    assert shaped_after_two_drafts((10.0, 12.0, 14.0, 19.0, 11.0))[1] == ([0, 1], [-1, 0])
    # c(q) measured up to q = 4 only: at most 3 nodes, the chain's 2 and a
    assert shaped_after_two_drafts((10.0, 12.0, 14.0, 11.0))[1] == ([0], [-1])


def test_cost_aware_tree_learns_each_branch_kind_from_the_accepted_path():
    policy, _ = shaped_after_two_drafts((10.0, 12.0, 14.0, 19.0, 11.0))  # tree: chain 0 -> 1, a = 2 (root), b = 3 (0)
    policy.update_tree([2])  # a accepted: the first chain token was judged and rejected, b's parent was not accepted
    assert policy.branch_counts == {"a": AcceptanceTally(1.0, 1.0)}
    assert policy.first_rate == pytest.approx(0.9 / 2.8)  # the chain: its first token judged and rejected
    assert policy.later_counts == AcceptanceTally(0.0, 0.0)  # its second never judged
    assert policy.branch_probability("a", 0.3) == pytest.approx((1 + 0.6) / 3)
    policy, _ = shaped_after_two_drafts((10.0, 12.0, 14.0, 19.0, 11.0))
    policy.update_tree([0, 3])  # b accepted after the first chain token: a was judged too, and rejected
    assert policy.branch_counts == {"a": AcceptanceTally(0.0, 1.0), "b": AcceptanceTally(1.0, 1.0)}
    assert policy.first_rate == pytest.approx(1.9 / 2.8)  # the chain: its first token accepted, its second rejected
    assert policy.later_counts == AcceptanceTally(0.0, 1.0)


def test_the_probe_of_a_drafter_that_cannot_pay_counts_its_steps_across_generations():
    """Answers shorter than 64 steps (SmolLM2's qa: 7-37) still see the probe, every 64 steps over all of them."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=10.0))
    plans = []
    for _ in range(10):
        policy.begin()
        plans += [policy.plan(4) for _ in range(20)]
    assert [i for i, k in enumerate(plans) if k] == [63, 127, 191]


def test_a_copy_that_starts_right_is_priced_as_going_on_right():
    """Copies (d = 0, each verified token 0.1 c(1) more) whose first token is right 1 time in 4 and then right to the
    end: a1 -> 0.26 and a -> 0.85 (1, shrunk to a1), so a 4-token copy emits 1 + 0.26 (1 + 0.85 + 0.72 + 0.61) = 1.83
    tokens for c(5) = 14 ms, 1.31x plain, the best length, and the whole copy is drafted. One rate for both (4 of 7
    judged tokens: 0.57) would cut it after 3 tokens (2.09 tokens for 13 ms, 1.60x, against 2.19 for 14 ms at 4)."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0, 11.0, 12.0, 13.0, 14.0), draft_ms=0.0))
    for _ in range(30):
        for accepted in (0, 0, 4, 0):
            policy.update(4, accepted)
    assert policy.first_rate == pytest.approx(0.26, abs=0.01) and policy.later_rate == pytest.approx(0.85, abs=0.01)
    assert policy.best_length(4)[0] == 4 and cut_copy(policy, [11, 12, 13, 14]) == [11, 12, 13, 14]
    one_rate = [policy.costs.speedup(expected_emitted(4 / 7, k), k) for k in range(1, 5)]
    assert one_rate.index(max(one_rate)) + 1 == 3


def test_the_later_tokens_rate_follows_the_first_tokens_where_no_later_token_is_judged():
    """Drafts whose second token was rejected, then 1-token drafts that are accepted: nothing judges a later token
    any more, so its rate, shrunk to the first token's, comes back up with it instead of staying where it was."""
    policy = CostAwareExit(4, costs=DraftCosts((10.0,) * 5, draft_ms=1.0))
    for _ in range(10):
        policy.update(3, 1)
    assert policy.later_rate < 0.3
    for _ in range(40):
        policy.update(1, 1)
    assert policy.first_rate > 0.95 and policy.later_rate > 0.9


def test_a_tree_whose_first_token_alone_does_not_pay_is_drafted_for_its_siblings():
    """Copies (d = 0) at a first-token rate of 1 in 10, c(q) = 10, 12, 12.5, 13: no chain pays alone; with a sibling
    beside its first token accepted 3 times in 5, a 1-token chain and the sibling (a 3-token verify) do."""
    policy = CostAwareExit(3, costs=DraftCosts((10.0, 12.0, 12.5, 13.0), draft_ms=0.0))
    policy.first_counts = AcceptanceTally(1.0, 10.0)
    assert policy.best_length(3)[1] < 1.0 and policy.plan(3) == 0
    assert policy.best_length(3, [0.6, 0.0]) == (1, pytest.approx(1.7 * 10 / 12.5))
    assert policy.plan(3, [0.6, 0.0]) == 3
