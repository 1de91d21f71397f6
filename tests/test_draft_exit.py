import pytest

from selfspec.decoding.draft_exit import AdaptiveExit, DraftExit, ThresholdExit
from selfspec.errors import SelfspecError


def test_adaptive_rule_follows_a_hand_worked_sequence():
    """beta1 0.5, alpha 0.9, eps 0.01, beta2 0.9, gamma0 0.8, max_tokens 4; worked out by hand:
    (drafted, accepted) -> running acceptance m -> candidate -> threshold."""
    policy = AdaptiveExit(max_tokens=4, initial_threshold=0.8)
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


@pytest.mark.parametrize("make,message", [
    (lambda: ThresholdExit(4, 1.2), "threshold=1.2 is outside [0, 1]"),
    (lambda: ThresholdExit(4, -0.1), "threshold=-0.1 is outside [0, 1]"),
    (lambda: AdaptiveExit(4, 0.8, beta2=2.0), "beta2=2.0 is outside [0, 1]"),
    (lambda: DraftExit(0), "max_tokens=0 must be >= 1"),
])
def test_bad_policy_settings(make, message):
    with pytest.raises(SelfspecError) as error:
        make()
    assert str(error.value) == message
