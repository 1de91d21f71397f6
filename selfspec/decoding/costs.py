"""Step costs measured on this machine, and the speedup they predict for a draft/verify trace.

Measured over one KV cache at a fixed context: c(q), a full-model forward of q tokens (the verification of q - 1
drafts); each attention and MLP sublayer's time in a 1-token step; the output layer's time, full and per reduced
draft vocabulary. A draft token with skip set S and draft vocabulary V costs d = c(1) - (S's sublayer times) -
(output(full) - output(V)), and a trace of steps that drafted k_i tokens and emitted e_i runs at
speedup = sum(e_i) c(1) / sum(k_i d + c(k_i + 1)) over plain decoding: deterministic for greedy decoding, unlike
wall-clock timing, so the search scores skip sets with it (`search.objective=cost_model`). With per-token
acceptance a, a step of k drafts emits E = (1 - a^(k+1)) / (1 - a) tokens (`speedup_at_acceptance`, `break_even`;
experiments/cost_model.py prints them). Every speedup formula of selfspec is here."""

import statistics
from dataclasses import dataclass, field

import torch

from selfspec.models.batch_cache import BatchCache, forward_batch, forward_rows_hidden
from selfspec.models.cache import forward, forward_hidden, new_cache
from selfspec.models.devices import execution_device, output_device
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.output_layer import model_logits
from selfspec.models.layouts import decoder_layers, sublayer_modules
from selfspec.models.skip import skipping
from selfspec.settings import SkipSet
from selfspec.timing import clock, timed_ms_each

CONTEXT, REPEATS = 200, 15


@dataclass
class StepCosts:
    """Milliseconds on this machine."""
    verify_ms: list[float]  # [q - 1]: c(q), a full forward of q tokens, q = 1..len
    attn_ms: list[float]  # per layer: its attention sublayer in a 1-token step
    mlp_ms: list[float]  # per layer: its MLP sublayer in a 1-token step
    output_ms: float  # the full output layer, one row
    head_ms: dict[int, float] = field(default_factory=dict)  # draft vocabulary size -> its output layer, one row

    def draft_ms(self, skip: SkipSet, vocab_size: int | None = None) -> float:
        """d: one draft token with `skip` left out and a `vocab_size`-token output layer (None: full)."""
        saved = sum(self.attn_ms[i] for i in skip.attn) + sum(self.mlp_ms[i] for i in skip.mlp)
        if vocab_size is not None:
            saved += self.output_ms - self.head_ms[vocab_size]
        return self.verify_ms[0] - saved

    def step_ms(self, drafted: int, draft_ms: float) -> float:
        """One draft/verify step: `drafted` draft tokens, then a forward of drafted + 1 tokens."""
        return drafted * draft_ms + self.verify_ms[min(drafted, len(self.verify_ms) - 1)]

    def trace_ms(self, steps: list[tuple[int, int]], draft_ms: float) -> tuple[float, float]:
        """(plain, drafting) milliseconds of a trace of (drafted k_i, emitted e_i) steps: sum(e_i) c(1) and
        sum(k_i d + c(k_i + 1)); plain / drafting is the modelled speedup (summed first over several traces)."""
        plain = sum(emitted for _, emitted in steps) * self.verify_ms[0]
        return plain, sum(self.step_ms(drafted, draft_ms) for drafted, _ in steps)

    def speedup_at_acceptance(self, acceptance: float, drafted: int, draft_ms: float) -> float:
        """Speedup of steps that draft `drafted` tokens, each accepted with probability `acceptance`."""
        return DraftCosts(tuple(self.verify_ms), draft_ms).speedup(expected_emitted(acceptance, drafted), drafted)

    def break_even(self, target: float, draft_ms: float) -> float | None:
        """The lowest acceptance (0.01 steps) at which some draft length 1..len(verify_ms) - 1 reaches `target`
        speedup; None if none does."""
        for percent in range(1, 101):
            best = max(self.speedup_at_acceptance(percent / 100, k, draft_ms) for k in range(1, len(self.verify_ms)))
            if best >= target:
                return percent / 100
        return None

    def summary(self) -> str:
        verify = ", ".join(f"{q}: {ms:.1f}" for q, ms in enumerate(self.verify_ms, 1))
        heads = "".join(f", {n}-token head {ms:.1f}" for n, ms in sorted(self.head_ms.items()))
        return (f"c(q) ms {verify}; sublayers attn {sum(self.attn_ms):.1f} + mlp {sum(self.mlp_ms):.1f}; "
                f"output layer {self.output_ms:.1f}{heads}")


def expected_emitted(acceptance: float, drafted: int, first: float | None = None) -> float:
    """E = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a): the tokens a step of k drafts emits when each draft token
    is accepted with probability a (given the ones before it); with the first token's own rate a1 (`first`),
    E = 1 + a1 (1 + a + ... + a^(k-1))."""
    first = acceptance if first is None else first
    return 1 + first * sum(acceptance ** i for i in range(drafted))


@dataclass(frozen=True)
class DraftCosts:
    """What a step costs one drafter on this machine, in milliseconds: c(q) and d."""
    verify_ms: tuple[float, ...]  # [q - 1]: c(q), q = 1..len
    draft_ms: float  # d: one draft token (0 for copies from the context)

    def step_ms(self, drafted: int, nodes: int | None = None) -> float:
        """`drafted` draft tokens, then a verify of `nodes` draft nodes plus the last token (a tree's leaves cost no
        draft forward; None: the chain's `drafted`)."""
        return drafted * self.draft_ms + self.verify_ms[drafted if nodes is None else nodes]

    def speedup(self, emitted: float, drafted: int, nodes: int | None = None) -> float:
        """A step that drafts `drafted` tokens (verifies `nodes`, None: those) and emits `emitted` on average, over
        plain decoding (c(1) a token)."""
        return emitted * self.verify_ms[0] / self.step_ms(drafted, nodes)


class CostMeter:
    """c(q) and the draft-token costs of one model on this machine, each measured on first use and kept, so the
    strategies of a run share one measurement.

    In a batch of B rows (decoding/batch.py) one packed forward verifies every row's block: c_B(q) is one forward of a
    q-token block beside B - 1 one-token rows (`for_batch`). A row pays its share of a plain step, c_B(1) / B, plus its
    widening, c_B(q) - c_B(1) (`batch_row_prices`); a layer-skip chain's draft token, drafted by all rows in one
    forward, costs d_B / B, other drafters' d. As B grows a row's plain step gets cheaper and its widening does not,
    so the cost-aware exit drafts less, and at last nothing."""

    def __init__(self, model, max_q: int, repeats: int = 7, rows: int = 1):
        self.model, self.max_q, self.repeats, self.rows = model, max_q, repeats, rows
        self.verify_ms: tuple[float, ...] | None = None
        self.draft_ms: dict[tuple, float] = {}
        self.batches: dict[int, CostMeter] = {1: self}

    def for_batch(self, rows: int) -> "CostMeter":
        """The meter of a row in a batch of `rows` (`batch_row_prices` and the drafts' costs in a batch)."""
        if rows not in self.batches:
            meter = CostMeter(self.model, self.max_q, self.repeats, rows)
            meter.batches = self.batches
            self.batches[rows] = meter
        return self.batches[rows]

    def _measure_verify(self) -> None:
        if self.verify_ms is None:
            measured = (measure_verify_ms(self.model, self.max_q, self.repeats) if self.rows == 1 else
                        batch_row_prices(measure_batch_verify_ms(self.model, self.max_q, self.rows, self.repeats),
                                         self.rows))
            self.verify_ms = tuple(nondecreasing(measured))

    def costs(self, skip: SkipSet | None, head: DraftVocabulary | None = None, alone: bool = False) -> DraftCosts:
        """The costs of drafting with `skip` (and `head`); skip None: copies, which cost nothing to draft. In a
        batch, the rows' draft tokens run together (d_B / B) unless `alone` (a tree drafter: d)."""
        self._measure_verify()
        if skip is None:
            return self.costs_of(None, lambda: 0.0)
        if self.rows == 1 or alone:
            first = self.batches[1]
            return first.costs_of((skip, id(head)), lambda: measure_draft_ms(self.model, skip, head, self.repeats,
                                                                             first.verify_ms[0]), self.verify_ms)
        return self.costs_of((skip, id(head)), lambda: measure_batch_draft_ms(self.model, skip, head, self.rows,
                                                                             self.verify_ms[0], self.repeats))

    def costs_of(self, key, measure_draft_ms, verify_ms: tuple[float, ...] | None = None) -> DraftCosts:
        """The costs of the drafter `key`, its draft token timed by `measure_draft_ms()` (milliseconds) once; with
        this meter's c(q) (or `verify_ms`: a batch row's, for a draft timed alone)."""
        self._measure_verify()
        if key not in self.draft_ms:
            self.draft_ms[key] = measure_draft_ms()
        return DraftCosts(verify_ms or self.verify_ms, self.draft_ms[key])

    def summary(self) -> str:
        """What was measured, for the run's log: c(q) and each drafter's d ("" when nothing was)."""
        if self.verify_ms is None:
            return ""
        verify = ", ".join(f"{q}: {ms:.1f}" for q, ms in enumerate(self.verify_ms, 1))
        drafts = "".join(f"; d {ms:.1f} ms {describe_drafter(key)}" for key, ms in self.draft_ms.items() if key)
        per_row = f" (a row of {self.rows}: c_B(1) / B + c_B(q) - c_B(1))" if self.rows > 1 else ""
        return f"cost model: c(q) ms{per_row} {verify}{drafts}"


def describe_drafter(key) -> str:
    """A CostMeter key in words: a layer-skip draft (skip set, vocabulary head) or another drafter's name."""
    if isinstance(key[0], SkipSet):
        return f"with {len(key[0].attn) + len(key[0].mlp)} sublayers skipped"
    return f"with the {key[0].replace('_', ' ')}"


def expected_speedup(mean_accepted_tokens: float, drafted_per_step: float, skipped_fraction: float) -> float:
    """Tokens per cycle over the cycle's cost in full forwards: each draft forward costs (1 - skipped_fraction),
    the verification one. A proxy; memory-bound GPUs verify k tokens at about the cost of one."""
    return mean_accepted_tokens / (1 + drafted_per_step * (1 - skipped_fraction))


def timed_ms(step, device: torch.device | str = "cpu", repeats: int = REPEATS) -> float:
    """Median milliseconds of `step()` (running on `device`) after one untimed call."""
    return timed_ms_each([step], device, repeats)[0]


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence to `values` in least squares (pool adjacent violators): a forward of more
    tokens never costs less, and medians that say so are noise (they would make a shorter draft look dearer)."""
    pools: list[list[float]] = []  # [mean, count] of each run of pooled values
    for value in values:
        pools.append([value, 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (mean, count), (last, n) = pools[-2], pools.pop()
            pools[-1] = [(mean * count + last * n) / (count + n), count + n]
    return [mean for mean, count in pools for _ in range(count)]


CONTEXT_IDS = [5 + i % 100 for i in range(CONTEXT)]  # the context every cost is measured after


def _context_cache(model, max_q: int):
    cache = new_cache(model, CONTEXT + max_q)
    forward(model, cache, CONTEXT_IDS, 0)
    return cache


def _batch_context_cache(model, rows: int, max_q: int) -> BatchCache:
    """A batch cache of `rows` rows, each holding the CONTEXT-token context, with room for max_q more tokens."""
    cache = BatchCache(model, rows, CONTEXT + max_q)
    for row in range(rows):
        forward(model, cache.view(row), CONTEXT_IDS, 0)
    return cache


def measure_verify_ms(model, max_q: int, repeats: int = REPEATS, cache=None) -> list[float]:
    """c(1..max_q): median milliseconds of a q-token forward of the full model after a CONTEXT-token context."""
    cache = cache or _context_cache(model, max_q)
    return timed_ms_each([lambda q=q: forward(model, cache, [5] * q, CONTEXT) for q in range(1, max_q + 1)],
                         output_device(model), repeats)


def measure_batch_verify_ms(model, max_q: int, rows: int, repeats: int = REPEATS) -> list[float]:
    """c_B(1..max_q): median milliseconds of one forward of `rows` rows (B), each after a CONTEXT-token context, one
    a q-token block and the others one token each."""
    cache = _batch_context_cache(model, rows, max_q)
    steps = [lambda q=q: forward_batch(model, cache, [[5] * q] + [[5]] * (rows - 1), [CONTEXT] * rows)
             for q in range(1, max_q + 1)]
    return timed_ms_each(steps, output_device(model), repeats)


def batch_row_prices(forward_ms: list[float], rows: int) -> list[float]:
    """A batch row's price of a q-token block, q = 1..len(forward_ms), from c_B(q) (`forward_ms`):
    c_B(1) / B + c_B(q) - c_B(1), the widening never below nothing (a wider forward timed faster is noise)."""
    return [forward_ms[0] / rows + max(ms - forward_ms[0], 0.0) for ms in forward_ms]


def measure_batch_draft_ms(model, skip: SkipSet, head: DraftVocabulary | None, rows: int, plain_ms: float,
                           repeats: int = REPEATS) -> float:
    """d_B / B: a row's share of one forward that drafts a token in each of `rows` rows after CONTEXT-token
    contexts, paced by a plain forward of the rows (`paced_ms`; `plain_ms`: c_B(1) / B as the meter read it)."""
    cache = _batch_context_cache(model, rows, 1)

    def draft_tokens():
        with skipping(model, skip), torch.inference_mode():
            hidden = torch.cat(forward_rows_hidden(model, cache, list(range(rows)), [[5]] * rows,
                                                   [CONTEXT] * rows))  # (rows, hidden)
            return model_logits(model, hidden) if head is None else head.rows_logits(hidden)
    return paced_ms(draft_tokens, lambda: forward_batch(model, cache, [[5]] * rows, [CONTEXT] * rows), plain_ms,
                    output_device(model), repeats)


def measure_draft_ms(model, skip: SkipSet, head: DraftVocabulary | None = None, repeats: int = REPEATS,
                     plain_ms: float | None = None) -> float:
    """d: one draft token with the skip set (and draft vocabulary) after a CONTEXT-token context; with `plain_ms`
    (c(1) as the meter read it), paced by a plain step (`paced_ms`)."""
    cache = _context_cache(model, 1)

    def draft_token():
        with skipping(model, skip):
            if head is None:
                forward(model, cache, [5], CONTEXT, last_only=True)
            else:
                head.logits(forward_hidden(model, cache, [5], CONTEXT))
    if plain_ms is None:
        return timed_ms(draft_token, output_device(model), repeats)
    return paced_ms(draft_token, lambda: forward(model, cache, [5], CONTEXT), plain_ms, output_device(model), repeats)


def paced_ms(step, plain_step, plain_ms: float, device: torch.device | str, repeats: int) -> float:
    """`step()`'s milliseconds at the pace `plain_ms` was read at: its time over `plain_step()`'s, the two timed in
    turns (a slow spell falls on both), times `plain_ms`."""
    step_ms, plain_step_ms = timed_ms_each([step, plain_step], device, repeats)
    return step_ms / plain_step_ms * plain_ms


def measure_step_costs(model, max_q: int, heads: dict[int, DraftVocabulary] | None = None) -> StepCosts:
    """c(1..max_q), per-sublayer and output-layer costs of `model` at a CONTEXT-token context."""
    cache = _context_cache(model, max_q)
    verify = measure_verify_ms(model, max_q, cache=cache)
    attn, mlp = sublayer_ms(model, lambda: forward(model, cache, [5], CONTEXT))
    hidden = forward_hidden(model, cache, [5], CONTEXT)  # (hidden,)
    with torch.inference_mode():
        output = timed_ms(lambda: model_logits(model, hidden[None]), output_device(model))
        head_ms = {n: timed_ms(lambda: head.logits(hidden), output_device(model)) for n, head in (heads or {}).items()}
    return StepCosts(verify, attn, mlp, output, head_ms)


def sublayer_ms(model, step) -> tuple[list[float], list[float]]:
    """Median milliseconds each layer's attention and MLP take inside `step()` (timed by forward hooks: from the
    sublayer's first module's start to its last one's end)."""
    sublayers = [(kind, i, sublayer_modules(model, layer, kind), execution_device(layer))
                 for i, layer in enumerate(decoder_layers(model)) for kind in ("attn", "mlp")]
    times = {(kind, i): [] for kind, i, _, _ in sublayers}
    started = {}
    handles = []
    for kind, i, modules, device in sublayers:  # each layer's clock waits for its own device
        handles.append(modules[0].register_forward_pre_hook(
            lambda m, args, key=(kind, i), device=device: started.__setitem__(key, clock(device))))
        handles.append(modules[-1].register_forward_hook(
            lambda m, args, out, key=(kind, i), device=device: times[key].append(clock(device) - started[key])))
    try:
        for _ in range(REPEATS + 1):
            step()
    finally:
        for handle in handles:
            handle.remove()
    median = {key: 1000 * statistics.median(values[1:]) for key, values in times.items()}
    layers = len(decoder_layers(model))
    return [median[("attn", i)] for i in range(layers)], [median[("mlp", i)] for i in range(layers)]
