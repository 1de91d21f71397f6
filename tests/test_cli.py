"""The `selfspec` console command (installed by `pip install -e .`, i.e. `make install`) finds its configs from the
package and runs like `python run.py` from a directory outside the checkout."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # console-command subprocesses

ROOT = Path(__file__).resolve().parents[1]


def selfspec_command() -> str:
    """The installed console command: beside this Python (the venv's bin), else on PATH."""
    found = shutil.which("selfspec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert found, "no `selfspec` command: run `make install` (pip install -e .) to install it"
    return found


def run_command(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([selfspec_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_console_command_lists_the_config_groups_outside_the_checkout(tmp_path):
    result = run_command(tmp_path, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "selfspec is powered by Hydra" in result.stdout
    assert "model: gemma2, gemma3_270m, gguf, hf, llama, smollm2, tiny_gemma2, tiny_llama" in result.stdout


def test_the_console_command_runs_a_tiny_model_like_run_py(tmp_path):
    result = run_command(tmp_path, "model=tiny_llama", "logger=none", "data.name=chat", "data.limit=1",
                         "sampling.max_new_tokens=8", "hydra.run.dir=out")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(summary) == ["plain", "self_spec", "self_spec_hybrid"] and summary["self_spec"]["outputs_match_plain"] == 1.0
    assert not (ROOT / "out").exists()


def test_the_console_command_ends_a_bad_value_with_one_line(tmp_path):
    result = run_command(tmp_path, "model=tiny_llama", "draft.threshold=1.5", "hydra.run.dir=out")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "selfspec: error: draft.threshold=1.5 is outside [0, 1]"


def test_python_m_selfspec_strategies_lists_every_registered_strategy_one_a_line():
    from selfspec.decoding.strategies import REGISTRY

    result = subprocess.run([sys.executable, "-m", "selfspec", "strategies"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line.split(maxsplit=1) for line in result.stdout.splitlines()] == [
        [spec.name, spec.description] for spec in REGISTRY.values()]


def test_a_run_that_fails_on_its_prompts_after_loading_prints_only_its_error_line_on_stderr(tmp_path):
    (tmp_path / "long.jsonl").write_text(json.dumps({"question_id": "long", "turns": ["word " * 1000]}) + "\n")
    result = run_command(tmp_path, "model=tiny_llama", "logger=none", "data=jsonl", "data.path=long.jsonl",
                         "hydra.run.dir=out")
    assert result.returncode == 2
    assert result.stderr.startswith("selfspec: error: prompt 'long' is") and result.stderr.count("\n") == 1
    assert result.stdout.startswith("model:\n  name: tiny_llama")  # the resolved config goes to stdout
