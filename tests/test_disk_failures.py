"""Full and read-only disks outside run.py's records: the search's SQLite and journal storage, trials.jsonl and
best_skip.yaml, the figures, W&B's offline files and the server's run folder. Each failure ends in one line, what
was written before reads back whole, and a rerun completes the work. A full disk is real where SQLite can make
one (max_page_count) and an ENOSPC from os.write elsewhere; a read-only database is opened with SQLite's mode=ro
(tests may run as root, where chmod stops no write)."""

import dataclasses
import errno
import os
import sqlite3
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from hydra import compose, initialize_config_dir
from optuna.trial import TrialState

from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.models.loading import load_model
from selfspec.plots import figures
from selfspec.records import run_dir, wandb_logger
from selfspec.records.prompt_records import read_jsonl
from selfspec.search import search_skip_set
from selfspec.settings import LoggerSettings, from_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for every test here

ROOT = Path(__file__).resolve().parents[1]
TINY = ["search=optuna", "logger=none", "model=tiny_llama", "data.name=chat", "data.limit=1", "warmup=false",
        "search.data.limit=4", "search.max_new_tokens=12"]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def settings(n_trials: int, storage: str | None = None):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        run = from_config(compose("config", overrides=[*TINY, f"search.n_trials={n_trials}"]))
    return dataclasses.replace(run, search=dataclasses.replace(run.search, storage=storage))


@pytest.fixture(scope="module")
def loaded():
    return load_model(settings(1).model)


def stored(storage: str) -> list:
    return optuna.load_study(study_name="tiny_llama-tokens_per_s", storage=storage).trials


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_under_a_sqlite_study_ends_in_one_line_and_a_rerun_completes_it(tmp_path, loaded):
    db = tmp_path / "study.db"
    storage = f"sqlite:///{db}"
    search_skip_set(settings(3, storage), loaded, tmp_path)
    before = [(t.number, t.state, t.params, t.values) for t in stored(storage)]
    best, logged = (tmp_path / "best_skip.yaml").read_text(), read_jsonl(tmp_path / "trials.jsonl")
    pages = sqlite3.connect(db).execute("PRAGMA page_count").fetchone()[0]

    def no_room_to_grow(connection, record):  # SQLite's own "database or disk is full" once the file would grow
        connection.execute(f"PRAGMA max_page_count = {pages}")

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", no_room_to_grow)
    try:
        with pytest.raises(SelfspecError, match=rf"cannot write the study's storage {storage}: the disk is full; "
                                                r"the trials it holds are kept .*rerun the same command") as error:
            search_skip_set(settings(20, storage), loaded, tmp_path)
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", no_room_to_grow)
    assert "\n" not in str(error.value)
    after = stored(storage)
    assert [(t.number, t.state, t.params, t.values) for t in after[:3]] == before
    assert (tmp_path / "best_skip.yaml").read_text() == best
    assert read_jsonl(tmp_path / "trials.jsonl")[:3] == logged

    search_skip_set(settings(6, storage), loaded, tmp_path)  # room again: the same command resumes
    resumed = stored(storage)
    assert sum(t.state in FINISHED for t in resumed) == 6
    assert [(t.number, t.state, t.params, t.values) for t in resumed[:3]] == before


def test_a_read_only_sqlite_study_still_gives_its_best_trial_but_no_new_one(tmp_path, loaded):
    db = tmp_path / "study.db"
    search_skip_set(settings(3, f"sqlite:///{db}"), loaded, tmp_path)
    (tmp_path / "best_skip.yaml").unlink()
    read_only = f"sqlite:///file:{db}?mode=ro&uri=true"
    found = search_skip_set(settings(3, read_only), loaded, tmp_path)  # finished: only reads
    assert (tmp_path / "best_skip.yaml").is_file() and found.skip.attn
    with pytest.raises(SelfspecError, match=r"cannot write the study's storage .*study.db.*: the database is "
                                            r"read-only; the trials it holds are kept"):
        search_skip_set(settings(5, read_only), loaded, tmp_path)
    assert sum(t.state in FINISHED for t in stored(f"sqlite:///{db}")) == 3


def test_a_full_disk_cuts_a_journal_append_off_and_the_study_resumes(tmp_path, loaded, monkeypatch):
    journal = tmp_path / "optuna_journal.log"
    search_skip_set(settings(3), loaded, tmp_path)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    before = [(t.number, t.params, t.values) for t in stored(storage)]
    text = journal.read_text()
    real_write = os.write
    writes = []

    def fills_up(fd, data):  # room for a few appends, then a short write of 5 bytes, then none at all
        writes.append(len(data))
        if len(writes) < 6:
            return real_write(fd, data)
        if len(writes) == 6:
            return real_write(fd, bytes(data[:5]))
        disk_full()

    with monkeypatch.context() as patch:
        patch.setattr(run_dir.os, "write", fills_up)
        with pytest.raises(SelfspecError, match=rf"cannot write the study's storage {journal}: the disk is full; "
                                                r"the trials it holds are kept .*rerun the same command"):
            search_skip_set(settings(20), loaded, tmp_path)
    assert journal.read_text().startswith(text) and journal.read_text().endswith("\n")  # whole lines only
    assert [(t.number, t.params, t.values) for t in stored(storage)[:3]] == before

    search_skip_set(settings(6), loaded, tmp_path)
    resumed = stored(optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))))
    assert sum(t.state in FINISHED for t in resumed) == 6
    assert [(t.number, t.params, t.values) for t in resumed[:3]] == before
    assert [t["number"] for t in read_jsonl(tmp_path / "trials.jsonl")][:3] == [0, 1, 2]


def test_a_torn_journal_tail_is_cut_off_on_opening_so_the_next_append_stays_readable(tmp_path, loaded):
    journal = tmp_path / "optuna_journal.log"
    search_skip_set(settings(2), loaded, tmp_path)
    whole = journal.read_text()
    with open(journal, "a") as f:
        f.write('{"op_code":5,"worker_id":"x","trial_id":1,"par')  # a writer killed mid-line
    with pytest.warns(SelfspecWarning, match="optuna_journal.log: dropped a torn last line"):
        search_skip_set(settings(4), loaded, tmp_path)
    assert journal.read_text().startswith(whole)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    assert sum(t.state in FINISHED for t in stored(storage)) == 4


def test_a_failed_best_skip_write_keeps_the_earlier_file_whole(tmp_path, loaded, monkeypatch):
    search_skip_set(settings(2), loaded, tmp_path)
    best = (tmp_path / "best_skip.yaml").read_text()

    def half_then_full(path, *args, **kwargs):
        Path(path).write_text("attn: [1,")
        disk_full()

    monkeypatch.setattr("selfspec.search.write_skip_file", half_then_full)
    with pytest.raises(SelfspecError, match=r"cannot write .*best_skip.yaml: the disk is full"):
        search_skip_set(settings(2), loaded, tmp_path)
    assert (tmp_path / "best_skip.yaml").read_text() == best
    assert not list(tmp_path.glob(".best_skip*"))


def test_a_figure_the_disk_cannot_hold_leaves_no_half_file_and_one_line_naming_the_folder(tmp_path, monkeypatch,
                                                                                         capsys):
    import matplotlib

    matplotlib.use("Agg")
    made = figures.make_figures(tmp_path / "outputs", tmp_path / "figures", log=lambda line: None)
    png = tmp_path / "figures" / "sampling.png"
    earlier = png.read_bytes()
    real_savefig = matplotlib.figure.Figure.savefig

    def half_then_full(fig, path, **kwargs):
        real_savefig(fig, path, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(100)  # what a disk filling mid-write leaves
        disk_full()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_then_full)
    with pytest.raises(SelfspecError, match=rf"cannot write {png}: the disk is full; .*choose another folder with "
                                            rf"--out \(figures in {tmp_path / 'figures'} before are kept\)"):
        figures.save_figure(made["sampling"], tmp_path / "figures", "sampling")
    assert png.read_bytes() == earlier
    assert sorted(p.name for p in (tmp_path / "figures").iterdir() if p.name.startswith(".")) == []

    with pytest.raises(SystemExit) as exit_:
        figures.main(["--outputs", str(tmp_path / "outputs"), "--out", str(tmp_path / "figures")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"selfspec: error: cannot write {tmp_path / 'figures'}")


def test_an_evaluation_whose_wandb_folder_is_read_only_warns_once_and_writes_its_records(tmp_path, monkeypatch):
    from selfspec.evaluation.task import run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "data.name=chat", "data.limit=2", "warmup=false",
                                           "sampling.max_new_tokens=8", "logger=wandb", "logger.mode=offline"])
    (tmp_path / "wandb").mkdir()  # an earlier run's, read-only now
    real_access = os.access
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: not str(path).endswith("wandb")
                        and real_access(path, mode))
    with pytest.warns(SelfspecWarning, match="W&B is off for this run") as warned:
        summary = run(from_config(cfg), tmp_path)
    assert sum("W&B is off" in str(w.message) for w in warned) == 1
    assert len(read_jsonl(tmp_path / "records.jsonl")) == 2 * len(summary)  # every prompt of every strategy
    assert not any((tmp_path / "wandb").iterdir())


def test_a_wandb_folder_that_cannot_be_written_is_one_warning_and_no_run(tmp_path, monkeypatch):
    logger = LoggerSettings(kind="wandb", mode="offline")
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)  # as root, chmod cannot make one
    with pytest.warns(SelfspecWarning, match=rf"W&B is off for this run: its files in {tmp_path / 'wandb'} cannot be "
                                             r"written .*; the records are written as usual"):
        assert wandb_logger.make_logger(logger, {}, tmp_path) is None
    monkeypatch.undo()

    import wandb

    monkeypatch.setattr(wandb, "init", disk_full)  # the disk fills while W&B makes its offline run
    with pytest.warns(SelfspecWarning, match=r"W&B is off for this run: .*\(No space left on device\)"):
        assert wandb_logger.start_run(logger, tmp_path) is None


def test_a_server_whose_run_folder_is_read_only_stops_in_one_line_before_loading_the_model(tmp_path, monkeypatch):
    from selfspec import serve
    from selfspec.models import loading

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        served = from_config(compose("config", overrides=["task=serve", "model=tiny_llama", "logger=none"]))
    monkeypatch.setattr(loading, "load_model", lambda *a: pytest.fail("the model loaded before the folder was checked"))
    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)
    with pytest.raises(SelfspecError, match=rf"output directory {tmp_path} is not writable"):
        serve.serve(served, tmp_path)


def test_a_load_test_summary_the_disk_cannot_hold_keeps_the_earlier_one(tmp_path, monkeypatch):
    from selfspec.records.serve_load import LoadCell, read_cells, write_lines

    path = tmp_path / "summary.jsonl"
    cell = LoadCell(1, 4, 8, 256, 2.0, 128.0, 0.1, 0.2, 30.0, 40.0, 1.0)  # a cell of 8 requests
    write_lines(path, [cell])
    monkeypatch.setattr(run_dir.os, "write", disk_full)
    with pytest.raises(SelfspecError, match=r"summary.jsonl: the disk is full; .*rerun make serve-bench"):
        write_lines(path, [cell, cell])
    monkeypatch.undo()
    assert read_cells(path) == [cell] and sorted(p.name for p in tmp_path.iterdir()) == ["summary.jsonl"]
