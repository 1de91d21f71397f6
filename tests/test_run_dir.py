"""The run directory's files: whole-line records, atomic rewrites, a full disk, a torn last line (one
`selfspec: warning:` line), settings that must match for resume=true, and an earlier run's files and log kept."""

import errno
import json
import logging
import os
import warnings
from pathlib import Path

import pytest

from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.evaluation import summarize as summarize_cli
from selfspec.records import run_dir
from selfspec.records.prompt_records import read_jsonl
from selfspec.records.run_dir import append_line, check_output_dir, differing_keys, open_run_dir, write_file

SETTINGS = {"seed": 0, "resume": False, "data": {"name": "chat", "limit": 2}, "logger": {"kind": "none"},
            "sampling": {"max_new_tokens": 24}}


def disk_full(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_records_are_appended_as_whole_lines(tmp_path):
    path = tmp_path / "records.jsonl"
    for i in range(3):
        append_line(path, json.dumps({"i": i}))
    assert path.read_text() == '{"i": 0}\n{"i": 1}\n{"i": 2}\n'


def test_a_full_disk_ends_in_one_line_and_keeps_the_lines_before(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    append_line(path, '{"i": 0}')
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", disk_full)
        with pytest.raises(SelfspecError, match=r"cannot write .*records.jsonl: the disk is full; what was written "
                                                r"before is kept") as error:
            append_line(path, '{"i": 1}')
    assert "\n" not in str(error.value)
    assert path.read_text() == '{"i": 0}\n'


def test_a_short_write_is_cut_off_again(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    append_line(path, '{"i": 0}')
    real_write = os.write
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))  # room for 3 bytes only
        with pytest.raises(SelfspecError, match="the disk is full"):
            append_line(path, '{"i": 1}')
    assert path.read_text() == '{"i": 0}\n'


def test_a_failed_rewrite_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_file(path, '{"old": 1}')
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", disk_full)
        with pytest.raises(SelfspecError, match="summary.json: the disk is full"):
            write_file(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_torn_last_line_is_skipped_with_a_warning_but_a_bad_whole_line_is_an_error(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"i": 0}\n{"i": 1}\n{"i": 2, "tex')
    with pytest.warns(SelfspecWarning, match="records.jsonl:3: skipped a torn last line"):
        assert read_jsonl(path) == [{"i": 0}, {"i": 1}]
    path.write_text('{"i": 0}\n{"i": 1\n')  # a whole line that is not JSON: corrupt, not torn
    with pytest.raises(SelfspecError, match="records.jsonl:2: not a JSON line"):
        read_jsonl(path)
    path.write_text('{"i": 0}\n{"i": 1}')  # whole JSON without its newline: kept
    assert read_jsonl(path) == [{"i": 0}, {"i": 1}]


def test_resume_cuts_a_torn_tail_off_before_appending(tmp_path):
    open_run_dir(tmp_path, SETTINGS, resume=False)
    records = tmp_path / "records.jsonl"
    records.write_text('{"i": 0}\n{"i": 1, "te')
    with pytest.warns(SelfspecWarning, match="dropped a torn last line"):
        assert open_run_dir(tmp_path, {**SETTINGS, "resume": True}, resume=True)
    append_line(records, '{"i": 1}')
    assert read_jsonl(records) == [{"i": 0}, {"i": 1}]


def test_an_entry_points_warning_is_one_selfspec_warning_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it; put back after the test
    records = tmp_path / "records.jsonl"
    records.write_text('{"strategy": "pl')
    with pytest.warns(SelfspecWarning) as caught, pytest.raises(SystemExit):
        summarize_cli.main([str(tmp_path)])  # python -m selfspec.summarize: the torn line was its only one
    shown = warnings.formatwarning(caught[0].message, caught[0].category, caught[0].filename, caught[0].lineno)
    assert shown == f"selfspec: warning: {records}:1: skipped a torn last line (an interrupted write)\n"
    other = warnings.formatwarning(UserWarning("not ours"), UserWarning, "lib.py", 3)
    assert other.startswith("lib.py:3: UserWarning: not ours")  # other packages' warnings print as Python has them
    assert capsys.readouterr().err == f"selfspec: error: {records} holds no records yet; nothing to summarize\n"


def test_resume_refuses_records_of_other_settings_naming_the_keys(tmp_path):
    open_run_dir(tmp_path, SETTINGS, resume=False)
    (tmp_path / "records.jsonl").write_text('{"i": 0}\n')
    other = {**SETTINGS, "data": {"name": "chat", "limit": 3}, "sampling": {"max_new_tokens": 24}, "seed": 1}
    with pytest.raises(SelfspecError) as error:
        open_run_dir(tmp_path, other, resume=True)
    message = str(error.value)
    assert "was written with other settings: seed=0 (now 1); data.limit=2 (now 3)" in message and "\n" not in message
    assert (tmp_path / "records.jsonl").read_text() == '{"i": 0}\n'  # nothing touched
    assert json.loads((tmp_path / "settings.json").read_text()) == SETTINGS


def test_resume_without_stored_settings_is_refused(tmp_path):
    (tmp_path / "records.jsonl").write_text('{"i": 0}\n')
    with pytest.raises(SelfspecError, match="has no settings.json beside it"):
        open_run_dir(tmp_path, SETTINGS, resume=True)


def test_logger_and_resume_keys_may_differ_on_resume():
    assert differing_keys(SETTINGS, {**SETTINGS, "resume": True, "logger": {"kind": "wandb"}}) == []
    assert differing_keys(SETTINGS, {**SETTINGS, "new_key": 1}) == ['new_key="unset" (now 1)']


def test_a_rerun_without_resume_keeps_the_earlier_runs_files(tmp_path):
    open_run_dir(tmp_path, SETTINGS, resume=False)
    for name, text in (("records.jsonl", "old records\n"), ("summary.json", "{}"), ("summary.md", "old")):
        (tmp_path / name).write_text(text)
    (tmp_path / "model_answer").mkdir()
    assert not open_run_dir(tmp_path, {**SETTINGS, "seed": 5}, resume=False)
    kept = {p.name: p for p in tmp_path.iterdir()}
    moved = [name for name in kept if name != "settings.json"]
    assert len(moved) == 5 and all("-20" in name for name in moved)  # <stem>-<date>-<time><suffix>
    old_records = next(p for name, p in kept.items() if name.startswith("records-"))
    assert old_records.read_text() == "old records\n"
    old_settings = next(p for name, p in kept.items() if name.startswith("settings-"))
    assert json.loads(old_settings.read_text()) == SETTINGS
    assert json.loads((tmp_path / "settings.json").read_text())["seed"] == 5


def test_a_rerun_keeps_the_earlier_runs_log_and_logs_into_a_new_one(tmp_path):
    log = tmp_path / "selfspec.log"
    handler = logging.FileHandler(log)  # as Hydra opens the job log before the run begins
    logging.getLogger().addHandler(handler)
    try:
        open_run_dir(tmp_path, SETTINGS, resume=False)
        assert [p.name for p in tmp_path.glob("selfspec*.log")] == ["selfspec.log"]  # a first run's own log stays
        logging.getLogger().warning("the earlier run")
        open_run_dir(tmp_path, {**SETTINGS, "seed": 5}, resume=False)
        logging.getLogger().warning("this run")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    (kept,) = [p for p in tmp_path.glob("selfspec-*.log")]
    assert kept.read_text() == "the earlier run\n" and log.read_text() == "this run\n"


def test_an_output_directory_under_a_file_or_read_only_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SelfspecError, match=r"afile is a file, not a folder; choose another with hydra.run.dir"):
        check_output_dir(tmp_path / "afile" / "run")
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)  # as root, chmod cannot make one
    with pytest.raises(SelfspecError, match=r"is not writable \(.* is read-only\)"):
        check_output_dir(tmp_path / "new" / "run")
    monkeypatch.undo()
    check_output_dir(tmp_path / "new" / "run")
    assert not Path(tmp_path / "new").exists()  # checking makes nothing
