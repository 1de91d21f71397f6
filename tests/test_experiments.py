"""Experiment configs compose; tiny runs of every experiment write records that `make figures` turns into figures."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from selfspec.data.prompt_sets import encode_prompt, load_prompt_set
from selfspec.decoding.costs import DraftCosts
from selfspec.decoding.draft_exit import CostAwareExit, DraftExit
from selfspec.decoding.drafters import GenerationContext, NgramDrafter, NgramTreeDrafter
from selfspec.decoding.drafters import ChainDrafter, HeadFeatures
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.feature_head import new_feature_head, save_feature_head
from selfspec.models.loading import load_model
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.plots import figures as figs
from selfspec.records import runs as runs_
from selfspec.settings import default_settings, from_config, make_skip_set

from helpers import FIGURES, pinned
import batch_throughput  # experiments/, on sys.path by conftest
import copy_replay
import head_agreement
import head_data_scaling
from random_skip_sets import random_skip_sets, skip_sets_yaml
from sample_records import TEST_RUNS, slim

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

SWEEPS = {"threshold_sweep", "skip_ratio", "sampling", "batch"}


def compose_experiment(name, *overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)


def resolved(cfg) -> dict:
    """The job's config as a run would write it to .hydra/config.yaml (no `hydra` key), resolved."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True)


def test_every_experiment_has_a_config_figures_and_a_notebook():
    assert sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")) == sorted([*runs_.EXPERIMENTS, "bench",
                                                                             "kangaroo_train", "train_draft"])
    assert set(figs.FIGURE_GROUPS) == set(runs_.EXPERIMENTS) == set(FIGURES) == set(TEST_RUNS)
    for name in runs_.EXPERIMENTS:
        assert (ROOT / "notebooks" / f"{name}.py").is_file()


@pytest.mark.parametrize("name", runs_.EXPERIMENTS)
def test_experiment_composes_and_writes_under_outputs_experiments(name):
    cfg = compose_experiment(name)
    resolved(cfg)  # every interpolation resolves (skip_ratio's table included)
    for kind in ("run", "sweep"):
        assert cfg.hydra[kind].dir.startswith(f"outputs/experiments/{name}/")
    assert bool(cfg.hydra.sweeper.params) == (name in SWEEPS)
    assert cfg.logger.kind == "none"


def test_sweep_parameters_compose_one_by_one():
    params = compose_experiment("threshold_sweep").hydra.sweeper.params
    assert params.draft == "threshold,adaptive" and len(params["draft.threshold"].split(",")) == 11
    cfg = compose_experiment("threshold_sweep", "draft=adaptive", "draft.threshold=0.3")
    assert (cfg.draft.policy, cfg.draft.threshold) == ("adaptive", 0.3)
    assert compose_experiment("sampling", "sampling=sample").sampling.temperature > 0
    cfg = compose_experiment("skip_ratio", "model=gemma3_270m", "skip_set=p50b")
    assert cfg.skip_num_layers == 18 and runs_.skipped_fraction(resolved(cfg)) == 0.5
    assert compose_experiment("search_history").search.n_trials == 40


def test_experiments_set_their_strategies_and_warmup():
    assert compose_experiment("strategies").strategies == ["plain", "self_spec_fixed", "self_spec_threshold",
                                                            "self_spec_adaptive", "self_spec_hybrid", "prompt_lookup"]
    assert compose_experiment("adaptive_trace").warmup is False


def test_skip_ratio_sets_are_the_generated_ones_and_valid():
    config = yaml.safe_load((CONF / "experiment" / "skip_ratio.yaml").read_text())
    sweep = config["hydra"]["sweeper"]["params"]["skip_set"].split(",")
    files = sorted((CONF / "experiment" / "random_skip_sets").glob("*.yaml"))
    any_checkpoint = {"hf", "gguf"}  # of any layer count: no fixed random sets (experiment=skip_ratio needs a model's)
    assert {p.stem for p in files} >= {p.stem for p in (CONF / "model").glob("*.yaml")} - any_checkpoint
    key = "random_skip_sets@random_skip_sets"
    (listed,) = [entry[key] for entry in config["defaults"] if isinstance(entry, dict) and key in entry]
    assert sorted(listed) == [p.stem for p in files]
    for path in files:
        model = path.stem
        (table,) = yaml.safe_load(path.read_text()).values()
        layers = table.pop("layers")
        rerun = f"rerun experiments/random_skip_sets.py {model} {layers}"
        assert path.read_text() == skip_sets_yaml(model, layers), rerun
        if table.pop("searched", None) is not None:  # the model's own searched set, checked below
            assert model in ("smollm2", "gemma3_270m")
        assert table == random_skip_sets(layers)
        assert sorted(table) + ["searched"] == sorted(sweep)
        for skip in table.values():
            make_skip_set(skip["attn"], skip["mlp"], layers)
    for model in ("smollm2", "gemma3_270m"):
        cfg = compose_experiment("skip_ratio", f"model={model}", "skip_set=searched")
        assert dict(cfg.skip) == {k: list(v) for k, v in cfg.model.searched_skip.items() if k in ("attn", "mlp")}


@pytest.mark.slow
def test_threshold_sweep_and_adaptive_trace_records(tiny_outputs):
    runs = runs_.load_runs(runs_.latest(tiny_outputs, "threshold_sweep"))
    assert sorted((run.draft_policy, run.draft_threshold) for run in runs) == [
        ("adaptive", 0.3), ("adaptive", 0.9), ("threshold", 0.3), ("threshold", 0.9)]
    for run in runs:
        assert {r.strategy for r in run.records} == {"plain", "self_spec"}
        assert run.model == "tiny_llama" and len({r.question_id for r in run.records}) == 2
    (trace,) = runs_.load_runs(runs_.latest(tiny_outputs, "adaptive_trace"))
    steps = [s for r in trace.records if r.strategy == "self_spec" for s in r.steps]
    assert steps and trace.draft_policy == "adaptive"
    assert steps[0].threshold == 0.8  # no warm-up moved it before the first recorded step
    assert len({s.threshold for s in steps}) > 1  # the adaptive policy moved it


@pytest.mark.slow
def test_make_figures_writes_every_figure_of_the_tiny_runs(tiny_outputs, tmp_path, capsys):
    out = tmp_path / "figures"
    figs.main(["--outputs", str(tiny_outputs), "--out", str(out)])  # python -m selfspec.figures
    lines = capsys.readouterr().out.splitlines()
    for name, figures in FIGURES.items():
        for figure in figures:
            assert (out / f"{figure}.png").stat().st_size > 10_000 and (out / f"{figure}.pdf").is_file()
            assert f"{out / figure}.{{png,pdf}} <- {runs_.latest(tiny_outputs, name)}" in lines
    assert len(lines) == sum(map(len, FIGURES.values()))


@pytest.mark.slow
def test_slimmed_records_still_make_every_figure(tiny_outputs, tmp_path):
    slim(tiny_outputs, tmp_path)
    size = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert size < 200_000
    for name, make in figs.FIGURE_GROUPS.items():
        assert sorted(make(runs_.latest(tmp_path, name))) == sorted(FIGURES[name])
    batch = runs_.load_runs(runs_.latest(tmp_path, "batch"))
    assert not any(r.steps for run in batch for r in run.records)  # its figures read no steps


def test_shipped_sample_records_make_every_figure_and_stay_small():
    size = sum(p.stat().st_size for p in runs_.SAMPLE_RECORDS.rglob("*") if p.is_file())
    assert size < 200_000, f"notebooks/sample_records is {size} bytes"
    for name, make in figs.FIGURE_GROUPS.items():
        assert sorted(make(runs_.latest(runs_.SAMPLE_RECORDS, name))) == sorted(FIGURES[name])


@pytest.mark.slow
def test_batch_sweep_reads_each_jobs_batch_size(tiny_outputs):
    runs = runs_.load_runs(runs_.latest(tiny_outputs, "batch"))
    assert [run.batch_size for run in runs] == [1, 4]
    assert {r.batch_size for r in runs[1].records} == {4}  # 7 prompts, 4 at a time, the last 3 joining as rows end
    assert all(len(r.batch_group) == 7 and 2 <= len(r.batch_neighbours) <= 6 for r in runs[1].records)
    assert all(r.batch_neighbours == [] and r.batch_group == [] for r in runs[0].records)


def test_batch_throughput_measures_every_batch_size_in_one_process(capsys):
    """Every batch size and strategy decodes the same prompts (the script fails where an output differs from plain
    decoding at batch size 1), and the table has a row per batch size with plain's ratio to batch 1."""
    batch_throughput.main(["model=tiny_llama", "data.limit=1", "sampling.max_new_tokens=8",
                           "strategies=[plain,self_spec_hybrid]"])
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [row[0] for row in rows] == ["1", "2", "4", "8"]
    assert rows[0][1].endswith("(1.00 of batch 1)") and rows[0][3] == "-"
    assert all(len(row) == 4 for row in rows)  # batch size, plain, self_spec_hybrid, plain in fixed batches


def test_head_data_scaling_trains_a_head_per_share_for_the_same_steps(capsys, tmp_path, monkeypatch):
    """Shares of 8 training prompts (the same 2 held out for each): half of them passed over twice an epoch, so both
    heads take the same optimiser steps; each head and the results land in the output folder."""
    monkeypatch.setattr(head_data_scaling, "OUTPUTS", tmp_path / "out")
    head_data_scaling.main(["model=tiny_llama", "model.dtype=float64", f"train.data_dir={tmp_path / 'data'}",
                            "train.sets=[chat]", "train.prompts_per_set=10", "train.samples_per_prompt=1",
                            "train.max_new_tokens=6", "train.generate_batch=5", "train.val_fraction=0.2",
                            "train.epochs=1", "shares=0.5,1"])
    out = capsys.readouterr().out
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| 0.5 ") or
            line.startswith("| 1 ")]
    assert [row[:2] for row in rows] == [["0.5", "4"], ["1", "8"]] and [row[3] for row in rows] == ["2", "1"]
    assert "validation: 2 prompts" in out
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / "0.5" / "head.pt").is_file() and (run_dir / "1" / "head.pt").is_file()
    assert [r["share"] for r in json.loads((run_dir / "results.json").read_text())] == [0.5, 1.0]
    for bad in ("shares=0,1", "shares=half"):
        with pytest.raises(SelfspecError, match=f"{bad}: shares are numbers in"):
            head_data_scaling.main(["model=tiny_llama", bad])


def test_copy_replay_steps_as_the_decoding_loop_does():
    """Replayed over plain decoding's output, each copier (a trie and a chain, cost-aware, its costs pinned) drafts as
    many nodes and emits as many tokens as in the live loop, step for step: to max_new_tokens, and to an end id."""
    model = tiny_model("llama", num_layers=4).double()
    prompt = byte_tokenizer()("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib").input_ids
    settings = replace(default_settings().sampling, max_new_tokens=40)
    costs = DraftCosts(tuple(10.0 + 0.3 * q for q in range(11)), 0.0)

    def copiers():
        return (NgramTreeDrafter(model, 3, 10, 10, 3, pinned(CostAwareExit(10, costs=costs))),
                NgramDrafter(model, 3, 10, pinned(CostAwareExit(10, costs=costs))))

    full = generate(model, prompt, GenerationOptions(settings)).new_tokens
    for end_ids in ((), (full[30],)):
        output = generate(model, prompt, GenerationOptions(settings, end_ids=end_ids)).new_tokens
        assert len(output) == 40 if not end_ids else len(output) <= 31
        for live, replayed in zip(copiers(), copiers()):
            steps = [(step.emitted, step.drafted) for step in generate(model, prompt,
                                                                       GenerationOptions(settings, end_ids=end_ids),
                                                                       live).steps]
            context = GenerationContext(None, settings, end_ids=end_ids)
            assert copy_replay.replay(replayed, context, prompt, output) == steps
            assert sum(drafted > 0 for _, drafted in steps) >= 3


def write_plain_records(folder: Path, overrides: list[str]):
    """Plain decoding of the prompts `overrides` select (over data=mix), written as a run writes its records to
    folder/records.jsonl: (the loaded model, the prompts, the rows)."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        settings = from_config(compose("config", overrides=["data=mix", *overrides]))
    loaded = load_model(settings.model)
    prompts = load_prompt_set(settings.data)
    rows = [{"strategy": "plain", "question_id": p.question_id, "category": p.category, "turn": 0,
             "output_ids": generate(loaded.model, encode_prompt(loaded.tokenizer, p),
                                    GenerationOptions(settings.sampling, end_ids=loaded.end_ids)).new_tokens} for p in prompts]
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return loaded, prompts, rows


def test_copy_replay_tables_both_copiers_per_category_for_each_variant(capsys, tmp_path):
    overrides = ["model=tiny_llama", "data.limit=1", "sampling.max_new_tokens=12"]
    _, prompts, rows = write_plain_records(tmp_path, overrides)
    copy_replay.main(tmp_path, [*overrides, "--", "draft.tree_depth=2", "--", "draft.ngram_size=1"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| variant"))
    assert header.strip("| ").split(" | ")[2:] == ["all", *sorted({p.category for p in prompts})]
    table = [line.strip("| ").split(" | ") for line in lines if line.startswith("| draft.")]
    assert [row[:2] for row in table] == [[f"draft.{variant}", f"`{copier}`"] for variant in
                                          ("tree_depth=2", "ngram_size=1")
                                          for copier in ("prompt_lookup_tree", "self_spec_hybrid")]
    for row in table:
        assert len(row) == len(header.strip("| ").split(" | "))
        assert all(float(cell.split(" (")[1].rstrip(")")) >= 1.0 for cell in row[2:])  # tokens per verification
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(row | {"strategy": "self_spec"}) + "\n" for row in rows))
    with pytest.raises(SystemExit, match="holds no plain decoding"):
        copy_replay.main(tmp_path, overrides)
    with pytest.raises(SystemExit, match="records.jsonl does not exist"):
        copy_replay.main(tmp_path / "missing", overrides)


@pytest.mark.parametrize("fused_layers", [(), (2,)])
def test_head_agreement_predicts_each_token_as_the_live_head_drafts_it_first(fused_layers):
    """At every position the live head drafted a first token (a chain of 1 at every step), the offline reading
    predicts that token there, and not the next position's: the states and tokens it reads line up as live."""
    model = tiny_model("llama", num_layers=4).double()
    head = new_feature_head(model, fused_layers).eval()
    prompt = byte_tokenizer()("def fib(n):\n    return fib(n - 1) + fib(n - 2)\n").input_ids
    settings = replace(default_settings().sampling, max_new_tokens=24)
    drafter = ChainDrafter(HeadFeatures(model, head), DraftExit(1))
    firsts, draft = {}, drafter.draft  # context length: the draft's first token

    def recording_draft(tokens, most):
        drafted = draft(tokens, most)
        if drafted.tokens:
            firsts[len(tokens)] = drafted.tokens[0]
        return drafted

    drafter.draft = recording_draft
    output = generate(model, prompt, GenerationOptions(settings), drafter).new_tokens
    first = len(prompt) + 1  # the prefill gives the first output token
    predicted = head_agreement.head_predictions(model, head, None, prompt + output, first, top=1)[:, 0]
    assert len(predicted) == len(output) - 1 and len(firsts) >= 10
    assert all(predicted[length - first] == token for length, token in firsts.items())
    assert any(predicted[length - first + 1] != token for length, token in firsts.items()
               if length - first + 1 < len(predicted))


def test_head_agreement_tables_each_head_per_category(capsys, tmp_path):
    overrides = ["model=tiny_llama", "data.limit=1", "sampling.max_new_tokens=12"]
    loaded, prompts, rows = write_plain_records(tmp_path, overrides)
    heads = [tmp_path / "a.pt", tmp_path / "b.pt"]
    for path, fused_layers in zip(heads, [(), (1,)]):
        save_feature_head(path, new_feature_head(loaded.model, fused_layers), loaded.model)
    head_agreement.main(tmp_path, [str(path) for path in heads], overrides)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| head"))
    assert header.strip("| ").split(" | ")[1:] == ["all", *sorted({p.category for p in prompts})]
    table = [line.strip("| ").split(" | ") for line in lines if line.startswith(f"| {tmp_path}")]
    assert [row[0] for row in table] == [str(path) for path in heads]
    for row in table:
        shares = [tuple(float(x) for x in cell.rstrip(")").split(" (")) for cell in row[1:]]
        assert len(shares) == len(header.strip("| ").split(" | ")) - 1
        assert all(0.0 <= top1 <= top3 <= 1.0 for top1, top3 in shares)
    with pytest.raises(SelfspecError, match="does not exist"):
        head_agreement.main(tmp_path, [str(tmp_path / "none.pt")], overrides)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(row | {"strategy": "self_spec"}) + "\n" for row in rows))
    with pytest.raises(SystemExit, match="holds no plain decoding"):
        head_agreement.main(tmp_path, [str(heads[0])], overrides)
