"""Every option of every config group composes, and bad values end with a one-line message."""

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import main_in_process, run_py
from selfspec.cli import current_spellings, main

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_with(overrides):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    extra = {"skip": ["skip.path=x.yaml"] if option == "file" else [],
             "data": ["data.path=x.jsonl"] if option == "jsonl" else []}.get(group, [])
    cfg = compose_with([f"{group}={option}", *extra])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_each_model_brings_its_own_skip_set():
    for model in options("model"):
        assert model in options("skip"), f"conf/skip/{model}.yaml is missing"
        assert compose_with([f"model={model}"]).skip == compose_with([f"skip={model}"]).skip


@pytest.mark.parametrize("model", ["smollm2", "gemma3_270m"])
def test_a_models_searched_set_is_its_skip_set_written_once(model):
    shipped = compose_with([f"model={model}"]).skip
    searched = compose_with([f"model={model}", "skip=none"]).model.searched_skip  # the skip group chosen aside
    assert (searched.attn, searched.mlp) == (shipped.attn, shipped.mlp)


@pytest.mark.parametrize("overrides,message", [
    (["draft=threshold", "draft.threshold=1.5"], "draft.threshold=1.5 is outside [0, 1]"),
    (["sampling.max_new_tokens=-3"], "sampling.max_new_tokens=-3 must be >= 1"),
    (["skip.attn=[0,99]"], "skip.attn: layer id 99 is out of range; allowed: 0..5"),
    (["data=jsonl"], "data.path"),
    (["strategies=[plain,fastest]"], "strategy 'fastest' is unknown"),
    # what a new user tries: each ends in one line naming the key and what is allowed
    (["sampling.max_new_tokens=abc"], "sampling.max_new_tokens=abc is not allowed; it must be an integer"),
    (["draft.threshold=high"], "draft.threshold=high is not allowed; it must be a number"),
    (["search=optuna", "search.n_trials=-3"], "search.n_trials=-3 must be >= 1"),
    (["skip=file", "skip.path={broken}"], "skip.path='{broken}' is not valid YAML (line 2)"),
    (["task=serve", "serve.max_batch=0"], "serve.max_batch=0 must be >= 1 (1: one request decodes at a time)"),
    (["task=serve", "serve.max_batch=-1"], "serve.max_batch=-1 must be >= 1 (1: one request decodes at a time)"),
    (["task=serve", "serve.max_batch=many"], "serve.max_batch=many is not allowed; it must be an integer"),
])
def test_bad_values_end_with_one_clear_line(tmp_path, monkeypatch, capsys, overrides, message):
    broken = tmp_path / "broken.yaml"
    broken.write_text("attn: [1, 2\nmlp: ]\n")
    overrides = [o.format(broken=broken) for o in overrides]
    code, stderr = main_in_process(monkeypatch, capsys, "model=tiny_llama", "logger=none", "data.limit=1",
                                   f"hydra.run.dir={tmp_path}", *overrides)
    assert code == 2 and "Traceback" not in stderr
    (line,) = stderr.strip().splitlines()[-1:]
    assert line.startswith("selfspec: error: ") and message.format(broken=broken) in line, stderr


def test_an_unknown_group_option_ends_run_py_with_one_line(tmp_path):
    result = run_py("model=gpt5", f"hydra.run.dir={tmp_path}", timeout=300)
    assert result.returncode == 2
    assert result.stderr == f"selfspec: error: model=gpt5 is unknown; allowed: {', '.join(options('model'))}\n"


@pytest.mark.parametrize("override,message", [
    ("model=gpt5", f"model=gpt5 is unknown; allowed: {', '.join(options('model'))}"),
    ("draft=nope", "draft=nope is unknown; allowed: adaptive, cost, fixed, threshold"),
    ("sampling.temprature=0.5", "sampling.temprature is not a known key; did you mean sampling.temperature?"),
    ("hydra.run.dirr=x", "hydra.run.dirr is not a known key; did you mean hydra.run.dir?"),
    ("sampling.zzz=1", "sampling.zzz is not a known key; see conf/ for the allowed keys"),
])
def test_an_unknown_option_or_key_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys, override, message):
    code, stderr = main_in_process(monkeypatch, capsys, override, f"hydra.run.dir={tmp_path}")
    assert code == 2 and stderr == f"selfspec: error: {message}\n"


OLD_DATA_BLOCK = dict(path=None, limit=10, split="all", turns="first", max_prompt_tokens=None)  # each set's own file


@pytest.mark.parametrize("old,name", [(name, name) for name in ("humaneval", "chat", "summarize", "qa", "math",
                                                                 "translate", "retrieval")]
                         + [("humaneval_chat", ["humaneval", "chat"])])
def test_an_old_data_option_is_its_shipped_set_with_one_warning(old, name):
    overrides, warnings = current_spellings([f"data={old}", "data.split=evaluation"])
    spelled = f"[{','.join(name)}]" if isinstance(name, list) else name
    assert warnings == [f"data={old} is now data=shipped data.name={spelled}"]
    data = OmegaConf.to_container(compose_with(overrides).data)
    assert data == OLD_DATA_BLOCK | {"name": name, "split": "evaluation"}


def test_a_sweep_of_old_data_options_is_a_sweep_of_data_names():
    assert current_spellings(["-m", "data=qa,humaneval_chat"]) == (
        ["-m", "data=shipped", "data.name=qa,[humaneval,chat]"],
        ["data=qa,humaneval_chat is now data=shipped data.name=qa,[humaneval,chat]"])


def test_current_spellings_are_left_as_they_are():
    current = ["data=mix", "data=jsonl", "data=shipped", "data.name=qa", "trained_draft=kangaroo", "model=smollm2"]
    assert current_spellings(current) == (current, [])


def test_the_draft_head_group_is_trained_draft_under_its_old_name_too():
    old = ["draft_head=kangaroo", "draft_head.feature_noise=0.2"]
    assert current_spellings(old) == (
        ["trained_draft=kangaroo", "trained_draft.feature_noise=0.2"],
        ["draft_head=kangaroo is now trained_draft=kangaroo",
         "draft_head.feature_noise=0.2 is now trained_draft.feature_noise=0.2"])


@pytest.mark.parametrize("old,new", [("data=qa", "data=shipped data.name=qa"),
                                     ("draft_head=kangaroo", "trained_draft=kangaroo")])
def test_run_py_runs_an_old_spelling_as_the_new_one_after_one_warning_line(tmp_path, monkeypatch, capsys, old, new):
    monkeypatch.setattr(sys, "argv", ["run.py", old, "--cfg", "job"])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # main() sets it
    main()
    out, err = capsys.readouterr()
    assert err == f"selfspec: warning: {old} is now {new}\n"
    assert OmegaConf.create(out) == compose_with(new.split())
