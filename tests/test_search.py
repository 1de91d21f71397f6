"""Skip-set search: short studies on the tiny models, resume after SIGKILL, parallel workers, bad settings."""

import dataclasses
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from optuna.trial import TrialState

from selfspec.data.prompt_sets import encode_prompt, load_prompts, split_prompts
from selfspec.decoding.costs import StepCosts, expected_speedup
from selfspec.decoding.draft_exit import make_exit_policy
from selfspec.decoding.drafters import SelfDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.evaluation.task import run
from selfspec.models.loading import load_model
from selfspec.models.skip_config import resolve_skip
from selfspec.records.prompt_records import read_jsonl
from selfspec.search import search_prompts
from selfspec.search.objective import choose_best, measure
from selfspec.search.space import Candidate, SearchSpace, search_space, seed_candidates
from selfspec.search.study import fail_dead_trials, open_storage, open_study
from selfspec.settings import DataSettings, SkipSet, from_config

from helpers import run_py

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for every test here

ROOT = Path(__file__).resolve().parents[1]
# Small and fast: 1 evaluation prompt x 8 tokens after the search; 4 search prompts (chat 1..4) x 12 tokens.
TINY = ["search=optuna", "logger=none", "data.name=chat", "data.limit=1", "sampling.max_new_tokens=8", "warmup=false",
        "search.data.limit=4", "search.max_new_tokens=12"]
# One torch thread: on a shared 2-core machine two threads wait on each other for every small matmul.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides])


def settings(*overrides):
    return from_config(config(*overrides))


def journal_study(path: Path, name: str):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    return optuna.load_study(study_name=name, storage=storage)


def mean_accepted_tokens(cfg, skip: SkipSet) -> float:
    """Emitted tokens per verification on the search prompts (chat's calibration half, 1..4), from scratch."""
    run_settings = from_config(cfg)
    loaded = load_model(run_settings.model)
    sampling = dataclasses.replace(run_settings.sampling, max_new_tokens=run_settings.search.max_new_tokens)
    # one drafter, so one exit policy, over all prompts, as in a trial
    drafter = SelfDrafter(loaded.model, skip, make_exit_policy(run_settings.draft, sampling.greedy))
    emitted = steps = 0
    for prompt in split_prompts(load_prompts("chat"), "calibration")[1:5]:
        result = generate(loaded.model, encode_prompt(loaded.tokenizer, prompt),
                          GenerationOptions(sampling, end_ids=loaded.end_ids), drafter)
        emitted += sum(s.emitted for s in result.steps)
        steps += len(result.steps)
    return emitted / steps


@pytest.mark.parametrize("model, objective, sampler", [("tiny_llama", "tokens_per_s", "tpe"),
                                                       ("tiny_gemma2", "acceptance", "gp")])
def test_short_study_writes_a_loadable_skip_set_that_reproduces_its_acceptance(tmp_path, model, objective, sampler):
    cfg = config(f"model={model}", "model.dtype=float64", "search.n_trials=4", f"search.objective={objective}",
                 f"search.sampler={sampler}", "search.n_startup_trials=2")
    summary = run(from_config(cfg), tmp_path)

    assert (tmp_path / "optuna_journal.log").is_file()
    trials = read_jsonl(tmp_path / "trials.jsonl")
    assert [t["number"] for t in trials] == [0, 1, 2, 3]
    assert [t["attn"] for t in trials[:2]] == [[3, 5], [3, 5]]  # the enqueued seeds: conf/skip/<model>.yaml, upper half
    best = yaml.safe_load((tmp_path / "best_skip.yaml").read_text())
    record = trials[best["metrics"]["trial"]]
    assert record["state"] == "COMPLETE"
    assert best["metrics"]["values"] == record["values"]

    skip, _ = resolve_skip(settings(f"model={model}", "skip=file", f"skip.path={tmp_path / 'best_skip.yaml'}").skip, 6)
    assert skip == SkipSet(tuple(record["attn"]), tuple(record["mlp"]))
    assert mean_accepted_tokens(cfg, skip) == pytest.approx(best["metrics"]["mean_accepted_tokens"], rel=1e-12)
    assert summary["self_spec"]["outputs_match_plain"] == 1.0


def test_pareto_study_picks_the_front_trial_with_the_highest_expected_speedup(tmp_path):
    cfg = config("model=tiny_llama", "search.n_trials=6", "search.objective=pareto", "search.sampler=random",
                 "search.max_skip_fraction=0.7", "logger=wandb", "logger.mode=disabled")
    run(from_config(cfg), tmp_path)

    study = journal_study(tmp_path / "optuna_journal.log", "tiny_llama-pareto")
    best = yaml.safe_load((tmp_path / "best_skip.yaml").read_text())["metrics"]
    front = {t.number: t.user_attrs["metrics"]["expected_speedup"] for t in study.best_trials}
    assert best["trial"] in front
    assert best["expected_speedup"] == max(front.values())
    assert best["values"] == [best["skipped_fraction"], best["mean_accepted_tokens"]]


def test_choose_best_for_pareto_ranks_the_front_by_expected_speedup():
    study = optuna.create_study(directions=["maximize", "maximize"])
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for values, speedup in (([0.1, 2.0], 1.1), ([0.3, 1.8], 1.4), ([0.2, 1.5], 9.0), ([0.5, 1.2], 1.0)):
        study.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions=dist, values=values,
                                                  user_attrs={"metrics": {"expected_speedup": speedup}}))
    assert choose_best(study, "pareto").number == 1  # trial 2 has the highest proxy but is dominated by trial 1


def test_expected_speedup_counts_a_draft_forward_as_the_unskipped_share_of_a_full_one():
    assert expected_speedup(1.0, 0.0, 0.0) == 1.0  # plain decoding
    assert expected_speedup(3.0, 4.0, 0.5) == 1.0  # 3 tokens for 1 + 4 * 0.5 forwards
    assert expected_speedup(3.0, 4.0, 0.75) == 1.5


def space_of(*overrides, draft_vocab_size=None) -> SearchSpace:
    """The search space of a 6-layer model under these search overrides (search.max_skip_fraction: 0.5)."""
    return search_space(settings("model=tiny_llama", *overrides).search, 6, draft_vocab_size)


def test_search_space_checks_and_degenerate_sets():
    space = space_of("search.layer_range=[2,6]", "search.max_skip_fraction=0.5")
    assert (space.lo, space.hi) == (2, 6)
    assert space.reject_reason(Candidate(SkipSet())) == "nothing skipped"
    assert space.reject_reason(Candidate(SkipSet(), 64)) is None  # a reduced draft vocabulary alone is a draft
    assert "max_skip_fraction" in space.reject_reason(Candidate(SkipSet((2, 3, 4, 5), (2, 3, 4))))
    assert space.reject_reason(Candidate(SkipSet((3,), (4,)))) is None
    assert SearchSpace(2, 0, 2).reject_reason(Candidate(SkipSet((0, 1), (0, 1)))) == "everything skipped"
    assert "min_skip_fraction" in space_of("search.min_skip_fraction=0.5").reject_reason(Candidate(SkipSet((3,))))
    assert space_of(draft_vocab_size=64).vocab_sizes == (64,)  # the configured draft vocabulary when none is searched
    assert space_of("search.draft_vocab_sizes=[null,64,64]").vocab_sizes == (None, 64)
    for bad in (["search.layer_range=[4,4]"], ["search.layer_range=[0,7]"], ["search.layer_range=[1]"],
                ["search.max_skip_fraction=1.5"], ["search.max_skip_fraction=-0.1"], ["search.max_skip_fraction=0.0"],
                ["search.min_skip_fraction=0.6", "search.max_skip_fraction=0.4"], ["search.early_exit=maybe"],
                ["search.draft_vocab_sizes=[]"], ["search.draft_vocab_sizes=[0]"], ["search.draft_vocab_sizes=[16k]"]):
        with pytest.raises(SelfspecError, match="search"):
            space_of(*bad)


def test_search_prompts_follow_the_evaluation_prompts(capsys):
    eval_data = DataSettings(name="chat", limit=10)
    chat = [p.question_id for p in load_prompts("chat")]
    searched = search_prompts(DataSettings(name="chat", offset=10, limit=3), eval_data)
    assert [p.question_id for p in searched] == chat[10:13]
    assert "warning" not in capsys.readouterr().out
    search_prompts(DataSettings(name="chat", offset=8, limit=4), eval_data)
    assert "2 search prompts are also evaluation prompts" in capsys.readouterr().out
    with pytest.raises(SelfspecError, match="^search.data"):
        search_prompts(DataSettings(name="chat", offset=40, limit=4))


def test_seed_candidates_follow_the_upper_half_the_layer_range_and_the_draft_vocabulary():
    assert seed_candidates(SearchSpace(32, 0, 32)) == [Candidate(SkipSet(tuple(range(17, 30, 2)),
                                                                         tuple(range(17, 30, 2))))]
    assert seed_candidates(SearchSpace(6, 0, 6), SkipSet((3, 5), (4,))) == [Candidate(SkipSet((3, 5), (4,))),
                                                                           Candidate(SkipSet((3, 5), (3, 5)))]
    assert seed_candidates(SearchSpace(6, 4, 6), SkipSet((3, 5), (4,))) == [Candidate(SkipSet((5,), (4,))),
                                                                           Candidate(SkipSet((5,), (5,)))]
    assert seed_candidates(SearchSpace(6, 0, 6, max_fraction=0.1)) == []  # 4 of 12 sublayers is over the bound
    vocab = SearchSpace(6, 0, 6, vocab_sizes=(None, 64))
    assert [c.vocab_size for c in seed_candidates(vocab, SkipSet((3,), ()), 64)] == [64, 64]
    assert [c.vocab_size for c in seed_candidates(vocab, SkipSet((3,), ()), 99)] == [None, None]


def test_step_costs_price_skipped_sublayers_the_draft_head_and_the_verification():
    costs = StepCosts(verify_ms=[10.0, 12.0, 15.0], attn_ms=[1.0, 0.5, 0.25], mlp_ms=[2.0, 3.0, 4.0], output_ms=3.0,
                      head_ms={64: 0.5})
    assert costs.draft_ms(SkipSet()) == 10.0
    assert costs.draft_ms(SkipSet((0, 2), (1,))) == 10.0 - 1.0 - 0.25 - 3.0
    assert costs.draft_ms(SkipSet((1,), ()), 64) == 10.0 - 0.5 - (3.0 - 0.5)
    assert costs.step_ms(0, 7.0) == 10.0  # a plain step
    assert costs.step_ms(2, 7.0) == 2 * 7.0 + 15.0
    assert costs.step_ms(5, 7.0) == 5 * 7.0 + 15.0  # beyond the measured sizes: the largest one


def test_step_costs_price_a_trace_and_the_acceptance_a_draft_needs():
    costs = StepCosts(verify_ms=[10.0, 12.0, 15.0], attn_ms=[], mlp_ms=[], output_ms=0.0)
    # steps (drafted, emitted): (2, 3) costs 2 d + c(3), (1, 1) costs d + c(2), (0, 1) costs c(1)
    assert costs.trace_ms([(2, 3), (1, 1), (0, 1)], 2.0) == (5 * 10.0, (4.0 + 15.0) + (2.0 + 12.0) + 10.0)
    # a = 0.5, k = 2: E = 1 + 0.5 + 0.25 tokens for 2 d + c(3) = 19 ms, plain 17.5 ms
    assert costs.speedup_at_acceptance(0.5, 2, 2.0) == pytest.approx(17.5 / 19.0)
    assert costs.speedup_at_acceptance(0.9, 1, 0.0) == pytest.approx(19.0 / 12.0)  # n-gram drafts cost nothing
    # k = 1 breaks even at (1 + a) 10 >= 2.05 + 12, a >= 0.405; k = 2 needs a >= 0.577
    assert costs.break_even(1.0, 2.05) == 0.41
    assert costs.break_even(5.0, 2.05) is None  # even a = 1 gives at most 30 / 19.1


def test_cost_model_objective_prices_each_step_of_the_trace():
    """measure(...) with costs: modelled_speedup = emitted x c(1) / sum(k d + c(k + 1)) over the real steps."""
    run_settings = settings("model=tiny_llama", "model.dtype=float64")
    loaded = load_model(run_settings.model)
    sampling = dataclasses.replace(run_settings.sampling, max_new_tokens=12)
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in load_prompts("chat")[1:3]]
    costs = StepCosts([10.0 + q for q in range(13)], [1.0] * 6, [2.0] * 6, 3.0)
    skip = SkipSet((3, 5), (4,))
    metrics = measure(loaded.model, prompt_ids, sampling, Candidate(skip), run_settings.draft,
                      loaded.end_ids, 0, 6, costs=costs)
    d = 10.0 - 2 * 1.0 - 2.0
    drafter = SelfDrafter(loaded.model, skip, make_exit_policy(run_settings.draft, True))
    emitted = modelled = 0.0
    for index, ids in enumerate(prompt_ids):
        generator = torch.Generator().manual_seed(index)
        for step in generate(loaded.model, ids,
                             GenerationOptions(sampling, end_ids=loaded.end_ids, generator=generator), drafter).steps:
            emitted += step.emitted
            modelled += step.drafted * d + 10.0 + step.drafted
    assert metrics["modelled_speedup"] == pytest.approx(emitted * 10.0 / modelled, rel=1e-12)


def test_cost_model_study_with_early_exit_and_draft_vocabulary_feeds_self_spec_searched(tmp_path):
    cfg = config("model=tiny_llama", "model.dtype=float64", "search.n_trials=8", "search.objective=cost_model",
                 "search.early_exit=true", "search.draft_vocab_sizes=[null,64]", "search.n_startup_trials=4",
                 "search.max_skip_fraction=0.7")
    run(from_config(cfg), tmp_path)

    trials = read_jsonl(tmp_path / "trials.jsonl")
    assert {t["draft_vocab_size"] for t in trials} <= {None, 64}
    study = journal_study(tmp_path / "optuna_journal.log", "tiny_llama-cost_model")
    for trial in study.trials:
        top = trial.params.get("exit_layer", 6)
        assert set(range(top, 6)) <= set(trial.user_attrs["attn"]) & set(trial.user_attrs["mlp"])
    early = [t for t in study.trials if t.params.get("exit_layer", 6) < 6]
    assert early, "no trial tried an early exit"
    best = yaml.safe_load((tmp_path / "best_skip.yaml").read_text())
    assert best["metrics"]["values"] == [best["metrics"]["modelled_speedup"]]
    assert best.get("draft_vocab_size") == study.trials[best["metrics"]["trial"]].user_attrs["draft_vocab_size"]

    def evaluation(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose("config", overrides=["model=tiny_llama", "model.dtype=float64", "logger=none",
                                                "data.name=chat", "data.limit=1", "sampling.max_new_tokens=8",
                                                "strategies=[plain,self_spec_searched]", *overrides])
    (tmp_path / "eval").mkdir()
    summary = run(from_config(evaluation(f"searched_skip.path={tmp_path / 'best_skip.yaml'}")), tmp_path / "eval")
    assert summary["self_spec_searched"]["outputs_match_plain"] == 1.0
    with pytest.raises(SelfspecError, match="ships none"):
        run(from_config(evaluation()), tmp_path)


def test_fail_dead_trials_marks_only_trials_of_dead_local_workers(tmp_path):
    storage, _ = open_storage(settings().search, tmp_path)
    study = open_study(storage, "journal", "s", "acceptance", "tiny", 6, optuna.pruners.NopPruner())
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    for worker in (f"{host}:{dead.pid}", f"{host}:{os.getpid()}", f"elsewhere:{dead.pid}", None):
        trial = study.ask()
        if worker:
            trial.set_user_attr("worker", worker)
    assert fail_dead_trials(study, storage) == 1
    assert [t.state for t in study.trials] == [TrialState.FAIL] + [TrialState.RUNNING] * 3


def test_a_study_is_tied_to_its_model(tmp_path):
    storage, _ = open_storage(dataclasses.replace(settings().search, storage=str(tmp_path / "j.log")), tmp_path)
    open_study(storage, "j.log", "s", "acceptance", "tiny_llama", 6, None)
    with pytest.raises(SelfspecError, match="num_layers"):
        open_study(storage, "j.log", "s", "acceptance", "tiny_llama", 8, None)


@pytest.mark.parametrize("override, message", [
    ("search.objective=speed", "search.objective='speed' is unknown"),
    ("search.sampler=cmaes", "search.sampler='cmaes' is unknown"),
    ("search.max_skip_fraction=1.5", "search.max_skip_fraction=1.5 is outside [0, 1]"),
    ("search.storage=sqlite:////no/such/dir/study.db", "cannot be opened"),
    ("search.storage=/no/such/dir/journal.log", "cannot be opened"),
    ("search.layer_range=[3,9]", "search.layer_range=[3, 9] is not allowed"),
])
def test_bad_search_settings_raise_one_line_errors(tmp_path, override, message):
    with pytest.raises(SelfspecError) as error:
        run(from_config(config("model=tiny_llama", override)), tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_run_py_reports_bad_search_settings_in_one_line(tmp_path):
    proc = run_py(*TINY, "model=tiny_llama", "search.objective=speed", f"hydra.run.dir={tmp_path}", wait=False, env=ENV)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("selfspec: error: search.objective='speed' is unknown")


@pytest.mark.slow
def test_a_killed_study_resumes_with_its_finished_trials(tmp_path):
    command = ["model=tiny_llama", "search.n_trials=16", f"hydra.run.dir={tmp_path}"]
    first = run_py(*TINY, *command, wait=False, env=ENV)
    deadline = time.monotonic() + 90
    while not ((tmp_path / "trials.jsonl").is_file() and len(read_jsonl(tmp_path / "trials.jsonl")) >= 3):
        assert first.poll() is None and time.monotonic() < deadline, "the search ended or stalled before 3 trials"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = journal_study(tmp_path / "optuna_journal.log", "tiny_llama-tokens_per_s").trials
    finished = {t.number: t.params for t in before if t.state in (TrialState.COMPLETE, TrialState.PRUNED)}
    killed = [t.number for t in before if t.state == TrialState.RUNNING and "worker" in t.user_attrs]
    assert 3 <= len(finished) < 16
    logged = read_jsonl(tmp_path / "trials.jsonl")
    assert len(finished) - 1 <= len(logged) <= len(finished)  # a kill between a trial's end and its line: one line

    second = run_py(*TINY, *command, wait=False, env=ENV)
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr[-2000:]
    after = journal_study(tmp_path / "optuna_journal.log", "tiny_llama-tokens_per_s").trials
    assert [t.number for t in after] == list(range(len(after)))
    assert all(after[n].params == params and after[n].state in (TrialState.COMPLETE, TrialState.PRUNED)
               for n, params in finished.items())
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in after) == 16
    assert all(after[n].state == TrialState.FAIL for n in killed)  # killed inside the objective
    assert all(not t.params for t in after if t.state == TrialState.RUNNING)  # killed while sampling: ignored
    lines = read_jsonl(tmp_path / "trials.jsonl")
    assert lines[:len(logged)] == logged  # the first run's lines, kept
    assert len(lines) == len(logged) + 16 - len(finished)  # and one more for each trial the second run ran
    assert (tmp_path / "best_skip.yaml").is_file()


@pytest.mark.slow
def test_two_workers_share_one_journal_study(tmp_path):
    journal = tmp_path / "shared.log"
    workers = [run_py(*TINY, "model=tiny_llama", "search.n_trials=10", f"search.storage={journal}",
                      "search.study_name=shared", f"search.seed={i}", f"hydra.run.dir={tmp_path / str(i)}", wait=False,
                      env=ENV) for i in (0, 1)]
    for worker in workers:
        _, stderr = worker.communicate(timeout=150)
        assert worker.returncode == 0, stderr[-2000:]

    trials = journal_study(journal, "shared").trials
    finished = [t.number for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert [t.number for t in trials] == list(range(len(trials)))
    assert 10 <= len(finished) <= 11  # MaxTrialsCallback stops both; one trial in flight may overshoot
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    records = [r for i in (0, 1) for r in read_jsonl(tmp_path / str(i) / "trials.jsonl")]
    assert sorted(r["number"] for r in records) == finished  # every trial ran in exactly one worker
    by_number = {r["number"]: r for r in records}
    for r in records:
        if len(r["attn"]) + len(r["mlp"]) > 6:  # over max_skip_fraction 0.5 of 12 sublayers: pruned unscored
            assert r["state"] == "PRUNED" and "max_skip_fraction" in r["pruned"] and r["metrics"] is None
        if r["duplicate_of"] is not None and r["state"] == "COMPLETE":  # a repeated skip set reuses its values
            assert r["values"] == by_number[r["duplicate_of"]]["values"]
