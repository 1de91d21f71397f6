"""Skip strategies that choose the skip set while decoding (decoding/skip_choice/): CLaSp's dynamic programme, the
cost-aware knapsack, SWIFT's search, the layer states they read, the sets they record, and sampled losslessness
(the every-strategy test checks them greedily)."""

import math
from dataclasses import replace

import pytest
import torch

from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.skip_choice.capture import LayerStates, StateCapture
from selfspec.decoding.skip_choice.clasp import clasp_skip_layers
from selfspec.decoding.skip_choice.drafter import ChoosingDrafter, ClaspChooser, KnapsackChooser, SwiftChooser
from selfspec.decoding.skip_choice.knapsack import SublayerPrices, fitted_lambda, knapsack_skip, sublayer_losses
from selfspec.decoding.skip_choice.swift import SwiftSearch, match_rate
from selfspec.decoding.speculative import generate
from selfspec.decoding.strategies import make_strategy
from selfspec.errors import SelfspecError
from selfspec.evaluation.evaluate import chosen_skip_sets
from selfspec.models.cache import new_cache
from selfspec.models.layouts import base_model
from selfspec.models.tiny import tiny_model
from selfspec.plots.skip_choice import plot_skip_choice, skipped_matrix
from selfspec.records.prompt_records import SkipSetRecord, append_record, read_records, skip_set_at
from selfspec.records.wandb_logger import WandbLogger
from selfspec.settings import SkipSet, default_settings, make_skip_set

import helpers
from helpers import chi_square_pvalue, exact_pair_distribution

DEFAULTS = default_settings()
GREEDY = replace(DEFAULTS.sampling, max_new_tokens=24)
DRAFT = replace(DEFAULTS.draft, policy="adaptive", max_tokens=4, head=None, store=None)


class PayingCosts:
    """Made-up costs under which drafting pays: c(q) = 10 + 0.5 q ms (the tiny model's own say it never does)."""
    rows = 1

    def costs(self, skip, head=None, alone=False) -> DraftCosts:
        return DraftCosts(tuple(10.0 + 0.5 * q for q in range(16)), 0.0 if skip is None else 1.0)

    def for_batch(self, rows: int) -> "PayingCosts":
        return self


def states_from_deltas(deltas: torch.Tensor, start: torch.Tensor) -> LayerStates:
    """Layer states whose layer i adds deltas[i] (attention and MLP half each)."""
    hidden = torch.cat([start[None], start[None] + deltas.cumsum(dim=0)])  # (layers + 1, hidden)
    return LayerStates(hidden, deltas / 2, deltas / 2)


def test_clasp_skips_the_layers_that_change_nothing():
    gen = torch.Generator().manual_seed(0)
    deltas = torch.randn(6, 16, generator=gen, dtype=torch.float64)
    deltas[[1, 4]] = 0.0
    states = states_from_deltas(deltas, torch.randn(16, generator=gen, dtype=torch.float64))
    assert clasp_skip_layers(states, 2) == (1, 4)
    assert len(clasp_skip_layers(states, 3)) == 3 and {1, 4} <= set(clasp_skip_layers(states, 3))
    assert clasp_skip_layers(states, 0) == ()


def test_knapsack_skips_free_sublayers_and_falls_back_to_plain_when_nothing_pays():
    losses = torch.full((2, 4), 0.5, dtype=torch.float64)
    losses[1, 2] = 0.0  # layer 2's MLP loses nothing when skipped
    prices = SublayerPrices(tuple(10.0 + 0.1 * q for q in range(6)), (1.0,) * 4, (1.5,) * 4)
    skip, speedup = knapsack_skip(losses, prices, lam=2.0, max_tokens=4)
    assert 2 in skip.mlp and speedup > 1.0
    assert knapsack_skip(losses + 1.0, prices, lam=50.0, max_tokens=4) == (SkipSet(), 1.0)


def test_fitted_lambda_reproduces_the_acceptance_met():
    losses = torch.tensor([[0.1, 0.2], [0.3, 0.0]], dtype=torch.float64)
    lam = fitted_lambda(SkipSet((1,), (0,)), losses, 0.6)
    assert abs(math.exp(-lam * 0.5) - 0.6) < 1e-9
    assert fitted_lambda(SkipSet((), (1,)), losses, 0.6) is None


def test_sublayer_losses_are_zero_for_sublayers_that_add_nothing():
    gen = torch.Generator().manual_seed(0)
    states = states_from_deltas(torch.randn(3, 8, generator=gen, dtype=torch.float64),
                                torch.randn(8, generator=gen, dtype=torch.float64))
    states.attn[1] = 0.0
    losses = sublayer_losses(states)
    assert losses.shape == (2, 3) and float(losses[0, 1]) < 1e-12 and bool((losses[1] > 1e-6).all())


@pytest.mark.usefixtures("one_thread")
def test_captured_layer_states_are_the_full_models_hidden_states(tiny, prompt):
    capture = StateCapture(tiny)
    capture.arm()
    with torch.inference_mode():
        out = base_model(tiny)(input_ids=torch.tensor([prompt]), output_hidden_states=True,
                               past_key_values=new_cache(tiny, len(prompt)), use_cache=True)
    capture.disarm()
    states = capture.states(len(prompt) - 1)
    layers = states.attn.shape[0]
    for i in range(layers):  # HF's last entry is after the final norm; ours leaves the last layer
        torch.testing.assert_close(states.hidden[i], out.hidden_states[i][0, -1].float())
    assert capture.states(len(prompt)) is None and not capture.handles


@pytest.mark.usefixtures("one_thread")
def test_swift_scores_the_full_model_perfectly_on_its_own_greedy_output(tiny, prompt):
    generated = generate(tiny, prompt, GenerationOptions(GREEDY)).new_tokens
    tokens = prompt + generated
    assert match_rate(tiny, SkipSet(), tokens, len(generated) - 1) == 1.0
    search = SwiftSearch(tiny, 6, 4, candidates=3, window=8)
    assert all(len(s.attn) + len(s.mlp) == 4 for s in search.proposals(make_skip_set([1, 2], [3, 4], 6)))
    best = search.best(SkipSet(), tokens)  # the incumbent (nothing skipped) scores best and wins ties
    assert best == SkipSet()


def strategy(model, strategy_name, **skip_strategy):
    draft = replace(DRAFT, skip_strategy=replace(DRAFT.skip_strategy, **skip_strategy))
    return make_strategy(strategy_name, model, GenerationOptions(GREEDY), skip=make_skip_set([1], [2], 6), draft=draft,
                         costs=PayingCosts())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name, chooser", [("swift", SwiftChooser), ("clasp", ClaspChooser),
                                           ("knapsack", KnapsackChooser)])
def test_skip_strategy_makes_self_spec_choose_and_record_its_sets(tiny, prompt, name, chooser):
    made = strategy(tiny, "self_spec", name=name, rechoose_every=1, search_steps=3)
    assert isinstance(made.drafter, ChoosingDrafter) and isinstance(made.drafter.chooser, chooser)
    made.generate(prompt)
    chosen = made.drafter.chosen
    assert chosen[0].step == 0 and chosen[0].skip == make_skip_set([1], [2], 6)
    assert len(chosen) > 1 and [c.step for c in chosen] == sorted(c.step for c in chosen)
    if name == "clasp":  # round(0.45 * 6) whole layers
        assert all(len(c.skip.attn) == 3 and c.skip.attn == c.skip.mlp for c in chosen[1:])
    if name == "swift":
        assert all(c.step <= 3 for c in chosen)


def test_static_self_spec_is_the_plain_layer_skip_drafter(tiny):
    assert not isinstance(strategy(tiny, "self_spec").drafter, ChoosingDrafter)


def test_bad_skip_strategy_settings_say_which_key():
    with pytest.raises(SelfspecError, match=r"skip_strategy\.skip_fraction=2\.0 is outside"):
        default_settings("draft.skip_strategy.skip_fraction=2")
    assert default_settings("skip_strategy=knapsack").draft.skip_strategy.name == "knapsack"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["self_spec_swift", "self_spec_clasp", "self_spec_knapsack"])
def test_sampled_skip_strategies_match_the_full_models_distribution(name):
    """Chi-square goodness of fit of (token 2, token 3) against plain sampling's exact distribution."""
    model = tiny_model("llama", num_layers=2, hidden_size=32, seed=3, init_std=0.3).double()
    settings = replace(DEFAULTS.sampling, temperature=1.0, top_k=3, max_new_tokens=3)
    prompt = [5, 40, 77]
    draft = replace(DRAFT, policy="fixed", max_tokens=2,
                    skip_strategy=replace(DRAFT.skip_strategy, rechoose_every=1, search_steps=1, candidates=1))
    made = make_strategy(name, model, GenerationOptions(settings), skip=make_skip_set([], [1], 2), draft=draft,
                         costs=PayingCosts())
    exact = exact_pair_distribution(model, prompt, settings)
    gen = torch.Generator().manual_seed(0)
    counts, drafted = {}, 0
    for _ in range(1000):
        result = made.generate(prompt, gen)
        key = tuple(result.new_tokens[1:3])
        counts[key] = counts.get(key, 0) + 1
        drafted += result.drafted
    assert set(counts) <= set(exact) and drafted > 0
    assert chi_square_pvalue(counts, exact) > 0.001


class LoggedRun:
    """Stands in for a W&B run: keeps what is logged."""

    def __init__(self):
        self.rows = []

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row):
        self.rows.append(row)


@pytest.mark.usefixtures("one_thread")
def test_chosen_sets_reach_the_records_and_wandb(tiny, prompt, tmp_path):
    made = strategy(tiny, "self_spec_clasp")
    result = made.generate(prompt)
    sets = chosen_skip_sets(made)
    assert sets[0] == SkipSetRecord(0, [1], [2]) and len(sets) == len(made.drafter.chosen) > 1
    record = replace(helpers.record("self_spec_clasp", "q1"), steps=result.steps, skip_sets=sets)
    append_record(tmp_path / "records.jsonl", record)
    append_record(tmp_path / "records.jsonl", helpers.record("self_spec", "q1"))  # a record without sets
    back = read_records(tmp_path / "records.jsonl")
    assert back[0].skip_sets == sets and back[1].skip_sets == []
    run = LoggedRun()
    WandbLogger(run).log_prompt(0, back[0])
    steps = [row for row in run.rows if "self_spec_clasp/verify_step" in row]
    skipped = [row["self_spec_clasp/step_skipped_sublayers"] for row in steps]
    assert len(skipped) == len(result.steps) and skipped[0] == 2 and skipped[-1] == 6  # 3 whole layers after
    assert skip_set_at(sets, 0) == sets[0] and skip_set_at([], 0) is None


def test_the_figure_shows_each_strategys_skipped_sublayers_per_step():
    steps = [helpers.RecordedStep(drafted=2, accepted=1, emitted=2, threshold=0.5) for _ in range(3)]
    base = replace(helpers.record("self_spec_clasp", "q1"), steps=steps)
    clasp = replace(base, skip_sets=[SkipSetRecord(0, [1], []), SkipSetRecord(2, [0, 2], [2])])
    knapsack = replace(base, strategy="self_spec_knapsack", skip_sets=[SkipSetRecord(0, [], [1])])
    assert skipped_matrix(clasp, 3) == [[0, 0, 1], [1, 1, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 1]]
    fig = plot_skip_choice([clasp, knapsack, helpers.record("plain", "q1")])
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["self_spec_clasp", "self_spec_knapsack"]
    with pytest.raises(SelfspecError, match="no record holds skip sets"):
        plot_skip_choice([helpers.record("plain", "q1")])
