"""run.py with the inputs a user brings: public prompt files, prompts too long for the model. Each ends
with a result or one `selfspec: error:` line, never a traceback."""

import json
from pathlib import Path

import pytest
from helpers import main_in_process, run_py

pytestmark = pytest.mark.slow  # run.py in a subprocess

SPEC_BENCH = Path(__file__).parent / "data" / "spec_bench_question.jsonl"
# every run.py call here starts with these
TINY_RUN = ["model=tiny_llama", "logger=none", "sampling.max_new_tokens=8", "warmup=false"]


def error_line(result) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("selfspec: error: "), result.stderr[-3000:]
    return line


def test_spec_bench_questions_decode_and_a_long_prompt_is_truncated_and_counted(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(SPEC_BENCH.read_text().splitlines()[0] + "\n"
                       + json.dumps({"question_id": "long", "turns": ["word " * 1000]}) + "\n")
    result = run_py(*TINY_RUN, "data=jsonl", f"data.path={prompts}", "data.max_prompt_tokens=256",
                    out_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "selfspec: warning: 1 of 2 prompts were longer than data.max_prompt_tokens=256" in result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["plain"]["truncated_prompts"] == 1 and summary["self_spec"]["n_prompts"] == 2


@pytest.mark.parametrize("file_text, overrides, message", [
    ('{"question_id": "long", "turns": ["' + "word " * 1000 + '"]}\n', [], "prompt 'long' is 50"),
    ('{"text": "hi", "label": 1}\n', [], "no prompt format fits fields ['label', 'text']"),
    ('{"turns": ["hi"]}\n', ["data.format=alpaca"], "format alpaca needs instruction; found fields ['turns']"),
])
def test_bad_prompt_files_end_in_one_error_line(tmp_path, monkeypatch, capsys, file_text, overrides, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(file_text)
    code, stderr = main_in_process(monkeypatch, capsys, *TINY_RUN, "data=jsonl", f"data.path={prompts}", *overrides,
                                   f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("selfspec: error: ") and message in stderr

