"""The server load test's records (serve/bench.py, `make serve-bench`): one per streamed request, and per
(serve.max_batch, concurrent clients) cell the summary that its figure plots (plots/serving.py)."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfspec.errors import SelfspecError
from selfspec.records.run_dir import write_file

RERUN_BENCH = "rerun make serve-bench, or give another --out"


@dataclass
class LoadRequest:
    """One streamed request, timed by its client in seconds."""
    max_batch: int  # the server's serve.max_batch
    clients: int  # clients streaming at once
    client: int
    prompt_id: str
    sent_s: float  # when it was sent, from the cell's start
    first_token_s: float  # time to first token: from the send to the first event with tokens
    elapsed_s: float  # from the send to the stream's end
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the request's whole time, waiting and prefill included."""
        return self.new_tokens / self.elapsed_s


@dataclass
class LoadCell:
    """The requests of one (max_batch, clients) cell together."""
    max_batch: int
    clients: int
    requests: int
    new_tokens: int
    wall_s: float  # from the first send to the last stream's end
    tokens_per_s: float  # aggregate: every request's new tokens over wall_s
    first_token_p50_s: float
    first_token_p95_s: float
    request_tokens_per_s_p50: float
    request_tokens_per_s_p95: float
    mean_batch: float | None  # rows per batch step while the cell ran (the server's /health counts); None: no step


def load_cell(requests: list[LoadRequest], mean_batch: float | None) -> LoadCell:
    """The summary of one cell's requests (percentiles interpolate linearly between requests)."""
    cells = {(r.max_batch, r.clients) for r in requests}
    if len(cells) != 1:
        raise SelfspecError(f"a load-test cell takes the requests of one (max_batch, clients); got {sorted(cells)}")
    (max_batch, clients), = cells
    wall = max(r.sent_s + r.elapsed_s for r in requests) - min(r.sent_s for r in requests)
    new_tokens = sum(r.new_tokens for r in requests)
    ttft = [r.first_token_s for r in requests]
    speed = [r.tokens_per_s for r in requests]
    return LoadCell(max_batch, clients, len(requests), new_tokens, wall, new_tokens / wall, *_p50_p95(ttft), *_p50_p95(speed),
                    mean_batch)


def _p50_p95(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


def write_lines(path: Path, rows: list) -> None:
    """Dataclass rows as JSON lines, replacing the file whole (a full disk keeps the earlier one)."""
    write_file(path, "".join(json.dumps(dataclasses.asdict(row)) + "\n" for row in rows), RERUN_BENCH)


def read_cells(path: Path) -> list[LoadCell]:
    """A load test's summary.jsonl."""
    return [LoadCell(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
