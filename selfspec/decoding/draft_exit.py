"""Draft-exit policies: when to stop drafting and verify.

`fixed` drafts `max_tokens` tokens; `threshold` stops after a draft token whose draft probability (the
draft distribution's top probability) falls below a fixed threshold; `adaptive` is Draft & Verify's rule,
which moves that threshold after every verification towards a target acceptance rate; `cost` drafts only as far as
drafting pays on this machine (CostAwareExit below).
"""

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from selfspec.decoding.costs import DraftCosts, expected_emitted
from selfspec.errors import SelfspecError
from selfspec.settings import DraftSettings, default_threshold


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise SelfspecError(f"{name}={value} is outside [0, 1]")


@dataclass
class DraftExit:
    """Fixed draft length: never stops early. Every policy's parameters come from the draft settings
    (make_exit_policy below)."""
    max_tokens: int

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SelfspecError(f"max_tokens={self.max_tokens} must be >= 1")

    @property
    def threshold(self) -> float:
        return 0.0

    def begin(self) -> None:
        """A new generation starts. The threshold and adaptive exits carry their state over (the paper's code
        does), and so does what the cost-aware exit learnt."""

    def plan(self, max_tokens: int, siblings: Sequence[float] = ()) -> int:
        """The most tokens to draft this step (0: do not draft); called before each draft. `siblings`: a tree's
        other first-level nodes, P(accepted) each, which only the cost-aware exit prices."""
        return max_tokens

    def should_stop(self, confidence: float) -> bool:
        return False

    def observe_draft_ms(self, per_token_ms: float) -> None:
        """What a draft token took in the draft just made (the cost-aware policy learns from it)."""

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        """What the verification of the last step took, `tokens` tokens (the last token and the drafts) through the
        full model and the loop's own work on them (the cost-aware policy learns from it)."""

    def update(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class ThresholdExit(DraftExit):
    """Stop after a draft token whose confidence is below a fixed threshold."""
    initial_threshold: float

    def __post_init__(self):
        super().__post_init__()
        _check_unit("threshold", self.initial_threshold)
        self.current = self.initial_threshold

    @property
    def threshold(self) -> float:
        return self.current

    def should_stop(self, confidence: float) -> bool:
        return confidence < self.current


@dataclass
class AdaptiveExit(ThresholdExit):
    """Draft & Verify's adaptive threshold (their code's `auto_parameters`, one update per verification)."""
    beta1: float  # smoothing of the acceptance rate
    target_acceptance: float  # alpha
    epsilon: float
    beta2: float  # smoothing of the threshold
    mean_acceptance: float = field(default=0.0, init=False)

    def __post_init__(self):
        super().__post_init__()
        for name in ("beta1", "target_acceptance", "epsilon", "beta2"):
            _check_unit(name, getattr(self, name))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.mean_acceptance = self.beta1 * self.mean_acceptance + (1 - self.beta1) * accepted / drafted
        if self.mean_acceptance < self.target_acceptance:
            candidate = self.current + self.epsilon
        elif drafted == self.max_tokens:
            candidate = self.current
        else:
            candidate = self.current - self.epsilon
        self.current = self.beta2 * self.current + (1 - self.beta2) * candidate


CONFIDENCE_BINS = 5  # equal-width bins of draft confidence, calibrated separately
PRIOR_TOKENS = 2.0  # the acceptance prior's weight: 1 of 2 at the start, the last generation's rate at a begin()
FIRST_WAIT, LAST_WAIT = 4, 64  # steps without drafting before a probe; doubled after each probe that did not pay


@dataclass
class AcceptanceTally:
    """Draft tokens verification accepted, of those it judged; both decayed, so that recent steps weigh most."""
    accepted: float = 0.0
    judged: float = 0.0

    def add(self, accepted: float, judged: float) -> None:
        self.accepted += accepted
        self.judged += judged

    def scale(self, factor: float) -> None:
        self.accepted *= factor
        self.judged *= factor

    def rate_towards(self, prior: float, weight: float) -> float:
        """accepted / judged, shrunk to `prior` as if `weight` more tokens had been judged at that rate."""
        return (self.accepted + weight * prior) / (self.judged + weight)


@dataclass(kw_only=True)
class CostAwareExit(DraftExit):
    """`draft=cost`: draft only as far as drafting pays on this machine, and not at all when it does not.

    The costs are measured at the start (costs.CostMeter): c(q), a q-token forward of the full model, and d, one
    draft token. The policy then follows both as the decoding loop meets them, its own work included
    (`observe_draft_ms`, `observe_verify_ms`), which the meter's bare forwards leave out. A step that drafts k
    tokens, the first accepted with probability a1 and each later one with probability a given the ones before it,
    emits E(k) = 1 + a1 (1 + a + ... + a^(k-1)) tokens for k d + c(k + 1) ms, where plain decoding spends E(k) c(1).
    The two rates differ: a copy that starts right tends to go on right, and one rate for both would cut copies
    short. Before each draft the policy estimates a1 and a from what verification accepted lately and drafts only if
    some k beats plain decoding by `min_speedup`; otherwise it drafts nothing and probes again after 4, 8, ..., 64
    steps, so a drafter that stops paying costs at most a probe now and then (and one that would not beat plain
    decoding by `min_best_speedup` even if every token were accepted drafts only a 1-token probe every 64 steps:
    `can_pay`). While drafting, each token's draft confidence, calibrated online against verification in confidence
    bins (a draft's first token apart from the later ones), gives the chance that the draft so far survives;
    drafting stops as soon as no longer draft is expected to raise the step's speedup. Copies from the context count
    as confidence 1.0, calibrated by the copying drafter's own policy.

    Token trees: the planned draft is the tree's chain; the tree drafters offer more nodes (runner-up tokens,
    other copies), each with a key for its kind and a prior, and `shape_tree` keeps those whose expected accepted
    tokens pay for the wider verify c(q); `update_tree` learns per key how often such a node is accepted once its
    parent is (decayed more slowly, so a kind that stopped paying drifts back to its prior and is tried again).
    """
    costs: DraftCosts
    min_speedup: float = 1.02  # draft only where the expected speedup over plain decoding is at least this
    min_best_speedup: float = 1.0  # and only with a drafter whose best case (every draft token accepted) is at least
    # this: draft.min_best_speedup (make_exit_policy; 1.2); 1.0 adds no margin to min_speedup
    decay: float = 0.9  # weight of the history at each verification (about the last ten steps count)
    rows: int = 1  # the rows of the batch its drafter drafts a row of: that many times fewer can't-pay probes
    # a draft's first tokens, from the prior 1 of 2
    first_counts: AcceptanceTally = field(default_factory=lambda: AcceptanceTally(PRIOR_TOKENS / 2, PRIOR_TOKENS),
                                          init=False)
    # the tokens after a draft's first that verification judged (each after an accepted one); later_rate: its prior
    later_counts: AcceptanceTally = field(default_factory=AcceptanceTally, init=False)
    # per confidence bin (confidence_bin): a draft's first tokens, and its later ones
    first_bins: list[AcceptanceTally] = field(
        default_factory=lambda: [AcceptanceTally() for _ in range(CONFIDENCE_BINS)], init=False)
    later_bins: list[AcceptanceTally] = field(
        default_factory=lambda: [AcceptanceTally() for _ in range(CONFIDENCE_BINS)], init=False)
    confidences: list[float] = field(default_factory=list, init=False)  # of the draft in progress
    survival: float = field(default=1.0, init=False)  # P(every token of the draft so far is accepted)
    emitted: float = field(default=1.0, init=False)  # expected tokens the step emits if drafting stops now
    idle: int = field(default=0, init=False)  # steps since drafting last paid or was probed
    wait: int = field(default=FIRST_WAIT, init=False)
    unpaid: int = field(default=0, init=False)  # steps in a row that could not pay (can_pay), across generations
    branch_decay: float = 0.97  # weight of a tree node kind's history at each verification (about 30 steps)
    branch_counts: dict[Hashable, AcceptanceTally] = field(default_factory=dict, init=False)  # per tree node kind
    branches: list[tuple[int, Hashable]] = field(default_factory=list, init=False)  # the last tree's nodes after
    # its chain: (parent, key)
    draft_met: int = field(default=0, init=False)  # how often the loop met d since the meter (or a probe) read it
    verify_met: Counter[int] = field(default_factory=Counter, init=False)  # q -> how often it met c(q)

    def __post_init__(self):
        super().__post_init__()
        if len(self.costs.verify_ms) < 2:
            raise SelfspecError("the cost-aware draft exit needs c(q) for q = 1 and 2 at least")
        if not 0.0 < self.decay < 1.0:
            raise SelfspecError(f"decay={self.decay} must be in (0, 1)")

    def begin(self) -> None:
        """A new generation starts: the draft in progress, the count of idle steps and the probe back-off start
        afresh, and the acceptance rate learnt so far becomes the new generation's prior, with the prior's weight
        (2 tokens): a drafter that paid drafts from the first step, and where the new text is unlike the last
        (copies of code, then a role-play), the first rejections pull the estimate down at once. A drafter that did
        not pay probes the new text after 4 steps: the last text's back-off can be longer than a whole answer, and
        would keep it from drafting again. The later tokens' own counts keep at most the same weight; the confidence
        bins, each tree node kind's rate and the costs carry over."""
        self.first_counts = AcceptanceTally(PRIOR_TOKENS * self.first_rate, PRIOR_TOKENS)
        if self.later_counts.judged:
            self.later_counts.scale(min(1.0, PRIOR_TOKENS / self.later_counts.judged))
        self.confidences, self.survival, self.emitted, self.idle, self.branches = [], 1.0, 1.0, 0, []
        self.wait = FIRST_WAIT

    @property
    def threshold(self) -> float:
        """Recorded with every step in the threshold's place: the acceptance rate the policy estimates."""
        return self.acceptance

    @property
    def acceptance(self) -> float:
        """Of every draft token verification judged, first or later."""
        first, later = self.first_counts, self.later_counts
        return (first.accepted + later.accepted) / (first.judged + later.judged)

    @property
    def first_rate(self) -> float:
        """a1: P(verification accepts a draft's first token)."""
        return self.first_counts.accepted / self.first_counts.judged

    @property
    def later_rate(self) -> float:
        """a: P(verification accepts a later draft token, given the ones before it), shrunk to the first token's rate
        (the prior's weight, 2 tokens): where later tokens are seldom judged (1-token drafts), it follows the first
        token's rate instead of keeping a stale value that no longer draft would correct."""
        return self.later_counts.rate_towards(self.first_rate, PRIOR_TOKENS)

    def longest(self, max_tokens: int) -> int:
        return min(max_tokens, self.max_tokens, len(self.costs.verify_ms) - 1)

    def best_length(self, max_tokens: int, siblings: Sequence[float] = ()) -> tuple[int, float]:
        """The draft length k in 1..max_tokens with the best expected speedup at the estimated acceptance. A tree's
        `siblings`: P(accepted) of the nodes it can add beside the draft's first token, each counted (the likeliest
        first) at the wider verify it costs, where it pays."""
        siblings, speedups = sorted(siblings, reverse=True), {}
        for k in range(1, self.longest(max_tokens) + 1):
            chain = expected_emitted(self.later_rate, k, self.first_rate)
            speedups[k] = max(self.costs.speedup(chain + sum(siblings[:m]), k, k + m)
                              for m in range(min(len(siblings), len(self.costs.verify_ms) - 1 - k) + 1))
        return max(speedups.items(), key=lambda pair: pair[1])

    def can_pay(self, max_tokens: int) -> bool:
        """Whether some draft length would beat plain decoding by `min_best_speedup` (and `min_speedup`) if
        verification accepted every draft token. A drafter that cannot only probes (`plan`): where even its best case
        is close to plain decoding, it pays only at an acceptance near 1, and the estimate, drafted on where it runs
        high, loses more than it wins."""
        least = max(self.min_speedup, self.min_best_speedup)
        return any(self.costs.speedup(k + 1, k) >= least for k in range(1, self.longest(max_tokens) + 1))

    def plan(self, max_tokens: int, siblings: Sequence[float] = ()) -> int:
        """The most tokens to draft this step (should_stop ends the draft sooner): 0 when no draft length is
        expected to pay (a tree's with the `siblings` of its first token: best_length), except every `wait` steps (a
        probe, so that the estimate can recover). A drafter that cannot pay at all (`can_pay`) drafts a single token
        every 64 such steps in a row, counted across generations (answers are often shorter), so that it meets its
        costs again: idle, it meets only c(1), which moves every cost alike, so costs met in a slow spell while it
        drafted would keep it idle for good. What it met before is stale by then, so the probe's reading weighs as
        much (`followed`). In a batch of B `rows` it comes every 64 B steps, so that the batch probes as often as one
        generation alone: a row that probes alone stalls every row for its draft forward."""
        self.confidences, self.survival, self.emitted, self.branches = [], 1.0, 1.0, []
        if not self.can_pay(max_tokens):
            self.unpaid += 1
            if self.unpaid < LAST_WAIT * self.rows:
                return 0
            self.unpaid = 0
            self.draft_met = 0  # d and c(2), met 64 steps ago or more: the probe's reading weighs as much
            self.verify_met.pop(2, None)
            return 1
        self.unpaid = 0
        if self.best_length(max_tokens, siblings)[1] >= self.min_speedup:
            self.idle, self.wait = 0, FIRST_WAIT
            return self.longest(max_tokens)
        self.idle += 1
        if self.idle < self.wait:
            return 0
        self.idle, self.wait = 0, min(2 * self.wait, LAST_WAIT)
        return self.longest(max_tokens)

    def should_stop(self, confidence: float) -> bool:
        """After a draft token of this confidence: stop unless drafting further raises the expected speedup."""
        self.survival *= self.calibrated(confidence, later=bool(self.confidences))
        self.confidences.append(confidence)
        self.emitted += self.survival
        drafted, a = len(self.confidences), self.later_rate
        now = self.costs.speedup(self.emitted, drafted)
        later = (self.costs.speedup(self.emitted + self.survival * (expected_emitted(a, extra) - 1), drafted + extra)
                 for extra in range(1, self.longest(self.max_tokens) - drafted + 1))
        return max(later, default=0.0) <= now

    def observe_draft_ms(self, per_token_ms: float) -> None:
        """d as drafting meets it, the loop's own work included (`followed`)."""
        self.draft_met += 1
        self.costs = dataclasses.replace(self.costs,
                                         draft_ms=self.followed(self.draft_met, self.costs.draft_ms, per_token_ms))

    def observe_verify_ms(self, tokens: int, ms: float) -> None:
        """c(tokens) as verification meets it, the loop's own work included (`followed`), each q apart. c(1), met at
        every step that drafts nothing, is the machine's pace: where it moves, every cost moves with it, so that the
        costs met less often (d, a wider verify) keep their ratio to a plain step, the only thing a speedup reads;
        else a slow spell would make drafting look cheap."""
        if tokens > len(self.costs.verify_ms):
            return
        verify_ms = list(self.costs.verify_ms)
        self.verify_met[tokens] += 1
        if tokens > 1:
            verify_ms[tokens - 1] = self.followed(self.verify_met[tokens], verify_ms[tokens - 1], ms)
            self.costs = dataclasses.replace(self.costs, verify_ms=tuple(verify_ms))
            return
        pace = self.followed(self.verify_met[1], verify_ms[0], ms) / verify_ms[0]
        self.costs = DraftCosts(tuple(pace * c for c in verify_ms), pace * self.costs.draft_ms)

    def followed(self, times_met: int, estimate: float, met_ms: float) -> float:
        """A cost's estimate after the loop met it at `met_ms`, the `times_met`-th time: the meter's reading counts as
        one meeting, so the first meetings replace it fast (a mean of all so far), since the meter's bare forwards
        leave out the loop's own work, and then a moving average (`decay`) follows."""
        weight = max(1 / (times_met + 1), 1 - self.decay)
        return (1 - weight) * estimate + weight * met_ms

    def calibrated(self, confidence: float, later: bool) -> float:
        """P(verification accepts a draft token of this confidence, a draft's first (`later` False) or a later one
        after accepted ones): its bin's rate, shrunk to the rate of its place in the draft."""
        bins = self.later_bins if later else self.first_bins
        return bins[confidence_bin(confidence)].rate_towards(self.later_rate if later else self.first_rate, 2)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        tested = min(drafted, accepted + 1)  # tokens after the first rejected one were never judged
        for counts in (self.first_counts, self.later_counts, *self.first_bins, *self.later_bins):
            counts.scale(self.decay)
        self.first_counts.add(accepted > 0, 1)
        self.later_counts.add(max(accepted - 1, 0), tested - 1)
        for i, confidence in enumerate(self.confidences[:tested]):
            bins = self.later_bins if i > 0 else self.first_bins
            bins[confidence_bin(confidence)].add(i < accepted, 1)
        self.confidences = []  # an update without a draft before it (a resumed run's replay) moves only the rate

    def branch_probability(self, key: Hashable, prior: float) -> float:
        """P(verification accepts a tree node of kind `key` once its parent is accepted): its kind's rate, shrunk
        to `prior` (the drafter's guess, e.g. a runner-up's draft probability)."""
        return self.branch_counts.get(key, AcceptanceTally()).rate_towards(prior, 2)

    def shape_tree(self, parents: list[int], keys: list[Hashable], priors: list[float], max_nodes: int
                   ) -> tuple[list[int], list[int]]:
        """Which offered nodes join the chain just drafted (the k tokens should_stop saw, nodes 0..k-1): node j of
        the offer has tree index k + j and parent `parents[j]` (-1 the root, a chain node or an earlier offered
        node). Nodes join one at a time, the one adding most expected accepted tokens (P(parent accepted) x
        `branch_probability`) first, a node only after its parent and its earlier offered siblings (which keeps
        sampled-without-replacement siblings in their draw order); then the count that maximises the expected
        speedup with c(nodes + 1) is kept, none when no extra node pays. At most `max_nodes` nodes in all.
        Returns (the offered indices kept, in tree order; their parents in the tree)."""
        k = len(self.confidences)
        reach = {-1: 1.0}  # tree index -> P(that node is accepted)
        for i, confidence in enumerate(self.confidences):
            reach[i] = reach[i - 1] * self.calibrated(confidence, later=i > 0)
        order, gains = [], []
        room = min(max_nodes, len(self.costs.verify_ms) - 1) - k
        while len(order) < room:
            ready, seen = [], set()
            for j in range(len(parents)):
                if k + j in reach or parents[j] in seen:
                    continue
                seen.add(parents[j])  # the first offered child of each parent not yet in the tree
                if parents[j] in reach:
                    ready.append(j)
            if not ready:
                break
            gain = {j: reach[parents[j]] * self.branch_probability(keys[j], priors[j]) for j in ready}
            best = max(ready, key=gain.get)  # the earliest offered among equals
            reach[k + best] = gain[best]
            order.append(best)
            gains.append(gain[best])
        speedups = [self.costs.speedup(self.emitted + sum(gains[:m]), k, k + m) for m in range(len(order) + 1)]
        kept = order[:speedups.index(max(speedups))]  # the fewest nodes among equal speedups
        index = {i: i for i in range(-1, k)} | {k + j: k + n for n, j in enumerate(kept)}
        tree_parents = [index[parents[j]] for j in kept]
        self.branches = [(parent, keys[j]) for parent, j in zip(tree_parents, kept)]
        return kept, tree_parents

    def update_tree(self, path: list[int]) -> None:
        """Verification accepted the tree nodes `path` (root first) of the tree shape_tree shaped: the chain's part
        updates the acceptance rate and confidence bins as a chain does; every offered node whose parent was
        accepted was judged, and counts for its kind."""
        k = len(self.confidences)
        accepted = set(path)
        self.update(k, sum(1 for i in path if i < k))
        for counts in self.branch_counts.values():
            counts.scale(self.branch_decay)
        for node, (parent, key) in enumerate(self.branches, start=k):
            if parent == -1 or parent in accepted:
                self.branch_counts.setdefault(key, AcceptanceTally()).add(node in accepted, 1)
        self.branches = []


def confidence_bin(confidence: float) -> int:
    """The calibration bin of a draft confidence (draft probability) in [0, 1]."""
    return min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)


def make_exit_policy(draft: DraftSettings, greedy: bool, policy: str | None = None,
                     costs: DraftCosts | None = None, max_tokens: int | None = None, rows: int = 1) -> DraftExit:
    """A fresh draft-exit policy from the `draft` settings; `policy` overrides their kind and `max_tokens` their
    draft.max_tokens. Policy `cost` needs the drafter's `costs` on this machine (cost_model.CostMeter), and the
    `rows` of the batch it drafts a row of."""
    policy = policy or draft.policy
    max_tokens = max_tokens or draft.max_tokens
    threshold = draft.threshold if draft.threshold is not None else default_threshold(greedy)
    if policy == "fixed":
        return DraftExit(max_tokens)
    if policy == "threshold":
        return ThresholdExit(max_tokens, threshold)
    if policy == "adaptive":
        return AdaptiveExit(max_tokens, threshold, **draft.adaptive_options)
    if policy == "cost":
        if costs is None:
            raise SelfspecError("draft.policy=cost needs the measured costs of its drafter")
        return CostAwareExit(max_tokens, costs=costs, min_best_speedup=draft.min_best_speedup, rows=rows)
    raise SelfspecError(f"draft.policy={policy!r} is unknown; allowed: fixed, threshold, adaptive, cost")
