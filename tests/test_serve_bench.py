"""The server load test (`make serve-bench`, serve/bench.py): a cell's summary from its requests' times, its bad
arguments, and a small run against tiny-model servers that writes records, summaries and the figure."""

import json
import signal
import subprocess
import sys

import psutil
import pytest

from selfspec.errors import SelfspecError
from selfspec.records.serve_load import LoadRequest, load_cell, read_cells
from selfspec.serve import bench


def request(sent_s: float, first_token_s: float, elapsed_s: float, new_tokens: int, clients: int = 4) -> LoadRequest:
    return LoadRequest(8, clients, 0, "p", sent_s, first_token_s, elapsed_s, new_tokens)


def test_a_cell_counts_every_token_over_the_wall_time_and_takes_percentiles():
    requests = [request(0.0, 0.1, 2.0, 40), request(0.5, 0.3, 1.0, 10), request(1.0, 0.2, 3.0, 60),
                request(2.0, 0.4, 1.0, 30)]
    cell = load_cell(requests, 3.5)
    assert (cell.max_batch, cell.clients, cell.requests, cell.new_tokens) == (8, 4, 4, 140)
    assert cell.wall_s == 4.0 and cell.tokens_per_s == 140 / 4.0  # from the first send to the last end
    assert cell.first_token_p50_s == pytest.approx(0.25) and cell.first_token_p95_s == pytest.approx(0.385)
    assert cell.request_tokens_per_s_p50 == pytest.approx(20.0)  # of 20, 10, 20 and 30 tokens/s
    assert cell.request_tokens_per_s_p95 == pytest.approx(28.5) and cell.mean_batch == 3.5


def test_a_cell_takes_the_requests_of_one_max_batch_and_clients():
    with pytest.raises(SelfspecError, match=r"one \(max_batch, clients\); got \[\]"):
        load_cell([], None)
    with pytest.raises(SelfspecError, match=r"one \(max_batch, clients\); got \[\(8, 1\), \(8, 4\)\]"):
        load_cell([request(0, 0.1, 1, 5), request(0, 0.1, 1, 5, clients=1)], None)


@pytest.mark.parametrize("arguments, words", [(["--clients", "0,4"], "'0' is not allowed; give a positive integer"),
                                              (["--max-batch", "x"], "'x' is not allowed"),
                                              (["--requests", "-1"], "--requests")])
def test_bad_arguments_end_with_the_value_and_what_is_allowed(capsys, arguments, words):
    with pytest.raises(SystemExit) as stop:
        bench.main(arguments)
    assert stop.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow  # a tiny-model server per max_batch
def test_a_small_load_test_writes_a_record_per_request_a_summary_per_cell_and_the_figure(tmp_path):
    cells = bench.bench("tiny_llama", [1, 3], [1, 3], 1, 8, tmp_path, ["warmup=false"], log=lambda *_, **__: None)
    assert [(c.max_batch, c.clients, c.requests) for c in cells] == [(1, 1, 1), (1, 3, 3), (3, 1, 1), (3, 3, 3)]
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(1 <= r["new_tokens"] <= 8 and r["first_token_s"] <= r["elapsed_s"]
                                     for r in records)
    assert read_cells(tmp_path / "summary.jsonl") == cells
    assert cells[1].mean_batch == 1.0 and cells[3].mean_batch > 1.0  # three clients share the steps of max_batch=3
    assert (tmp_path / "serve_bench.png").stat().st_size > 10_000


@pytest.mark.slow  # a run.py subprocess
def test_a_server_that_cannot_start_ends_in_one_line_naming_its_error(tmp_path):
    with pytest.raises(SelfspecError, match=r"the server ended \(exit status 2\) before answering; its last line: "
                                            r"selfspec: error: serve.max_batch=0 must be >= 1"):
        with bench.local_server(tmp_path, "model=tiny_llama", "serve.max_batch=0"):
            pass


@pytest.mark.slow  # a tiny-model server
def test_a_load_test_killed_with_sigterm_stops_its_server(tmp_path):
    script = ("import sys; from pathlib import Path; from selfspec.serve import bench\n"
              "with bench.server_process(Path(sys.argv[1]), 'model=tiny_llama', 'logger=none') as (url, server):\n"
              "    print(server.pid, flush=True); import time; time.sleep(600)\n")
    load_test = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(load_test.stdout.readline()))  # once /health answers
    load_test.send_signal(signal.SIGTERM)
    assert load_test.wait(timeout=60) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs([server], timeout=30)
    assert alive == [] and gone == [server]  # the server ended with it
