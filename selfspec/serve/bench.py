"""The server under load (`make serve-bench`): concurrent streaming clients against `selfspec task=serve` on
loopback, one request at a time (serve.max_batch=1) beside continuous batching (the default, 8).

    python -m selfspec.serve.bench [--model tiny_llama] [--clients 1,4,8,16] [--max-batch 1,8] [--requests 2]
                                   [--max-tokens 64] [--out outputs/serve_bench/<model>] [run.py overrides ...]

For each max_batch a server starts (its log: <out>/server-<max_batch>/server.log) and answers one warm-up request;
then for each number of clients N, N clients stream --requests chat requests each, one after another (the chat
prompt set's first turns, greedy, --max-tokens new tokens at most), each timed from its send: its first event with
tokens (time to first token), its end, its new tokens. Per cell (max_batch, N): aggregate tokens/s (all new tokens
over the time from the first send to the last end), time to first token and each request's tokens/s at p50 and p95,
and the batch's mean size (the server's /health step counts). Writes <out>/requests.jsonl (a record per request),
<out>/summary.jsonl (one per cell), <out>/serve_bench.png, and prints the table. Speeds depend on the machine and
what else runs on it: compare cells of one run.
"""

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

import selfspec
from selfspec.data.prompt_sets import load_prompts
from selfspec.errors import SelfspecError
from selfspec.records.run_dir import replacing
from selfspec.records.serve_load import RERUN_BENCH, LoadCell, LoadRequest, load_cell, write_lines
from selfspec.timing import clock

CHECKOUT = Path(selfspec.__file__).resolve().parents[1]  # where `python -m selfspec` imports this selfspec from


@contextmanager
def local_server(out_dir: Path, *overrides: str, startup_s: float = 600) -> Iterator[str]:
    """`python -m selfspec task=serve <overrides>` in a subprocess on a free loopback port, its output in
    out_dir/server.log; yields its base URL once /health answers, and stops it afterwards."""
    with server_process(out_dir, *overrides, startup_s=startup_s) as (url, _):
        yield url


@contextmanager
def server_process(out_dir: Path, *overrides: str, startup_s: float = 600) -> Iterator[tuple[str, subprocess.Popen]]:
    """local_server's base URL and its process (whose memory serve/soak.py reads). A SIGTERM to this process (a
    `kill`, a job scheduler's time limit) stops the server too, as Ctrl-C does."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "server.log"
    command = [sys.executable, "-m", "selfspec", "task=serve", "serve.host=127.0.0.1", f"serve.port={port}",
               f"hydra.run.dir={out_dir}", *overrides]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=CHECKOUT, stdout=log, stderr=subprocess.STDOUT)
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            deadline = clock() + startup_s
            while not _healthy(url):
                if process.poll() is not None:
                    last = (log_path.read_text().strip().splitlines() or ["(no output)"])[-1]
                    raise SelfspecError(f"the server ended (exit status {process.returncode}) before answering; "
                                        f"its last line: {last} (log: {log_path})")
                if clock() > deadline:
                    raise SelfspecError(f"the server did not answer /health within {startup_s:.0f} s (log: {log_path})")
                time.sleep(0.5)
            yield url, process
        finally:
            process.terminate()
            process.wait(timeout=30)
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, _frame) -> None:
    sys.exit(128 + signum)  # SystemExit: the `finally` that stops the server runs


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
                     ) -> tuple[float, float, int]:
    """One streamed greedy chat request: (seconds to its first event with tokens, seconds to its end, new tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start, first, new_tokens = clock(), None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise SelfspecError(f"the server answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise SelfspecError(f"a stream ended with an error: {event['error']['message']}")
            if first is None and event["choices"] and event["selfspec"]["tokens"]:
                first = clock()
            if event.get("usage"):
                new_tokens = event["usage"]["completion_tokens"]
    end = clock()
    if first is None or new_tokens is None:
        raise SelfspecError("a stream ended without tokens or usage")
    return first - start, end - start, new_tokens


async def run_cell(url: str, model: str, max_batch: int, clients: int, prompts: list[tuple[str, str]],
                   requests: int, max_tokens: int) -> list[LoadRequest]:
    """`clients` clients at once, each streaming `requests` requests one after another; client c's r-th request
    takes prompt (c * requests + r) of `prompts` ((id, text) pairs), round the list."""
    start = clock()

    async def one_client(client: httpx.AsyncClient, c: int) -> list[LoadRequest]:
        done = []
        for r in range(requests):
            prompt_id, text = prompts[(c * requests + r) % len(prompts)]
            sent = clock() - start
            ttft, elapsed, new_tokens = await stream_one(client, url, model, text, max_tokens)
            done.append(LoadRequest(max_batch, clients, c, prompt_id, sent, ttft, elapsed, new_tokens))
        return done

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        per_client = await asyncio.gather(*(one_client(client, c) for c in range(clients)))
    return [request for done in per_client for request in done]


def measure(url: str, max_batch: int, clients: int, prompts: list[tuple[str, str]], requests: int,
            max_tokens: int, cell_s: float) -> tuple[list[LoadRequest], LoadCell]:
    """One cell's requests and summary; SelfspecError if it runs past `cell_s` seconds."""
    health = httpx.get(f"{url}/health").json()
    try:
        done = asyncio.run(asyncio.wait_for(run_cell(url, health["model"], max_batch, clients, prompts, requests,
                                                     max_tokens), cell_s))
    except TimeoutError:
        raise SelfspecError(f"max_batch={max_batch} with {clients} clients ran past {cell_s:.0f} s; "
                            f"ask for fewer --requests or --max-tokens, or a longer --cell-s") from None
    after = httpx.get(f"{url}/health").json()
    steps = after["steps"] - health["steps"]
    return done, load_cell(done, (after["row_steps"] - health["row_steps"]) / steps if steps else None)


def bench(model: str, clients: list[int], max_batches: list[int], requests: int, max_tokens: int, out: Path,
          overrides: list[str], cell_s: float = 600, log=print) -> list[LoadCell]:
    """Every (max_batch, clients) cell, a server per max_batch; writes the records and the figure into `out`."""
    prompts = [(p.question_id, p.turns[0]) for p in load_prompts("chat")]
    out.mkdir(parents=True, exist_ok=True)
    records, cells = [], []
    log("| model | max_batch | clients | requests | tokens/s | TTFT p50 / p95 (s) | tokens/s per request p50 / p95 "
        "| mean batch |\n|---|---|---|---|---|---|---|---|")
    for max_batch in max_batches:
        with local_server(out / f"server-{max_batch}", f"model={model}", "logger=none",
                          f"serve.max_batch={max_batch}", f"serve.max_queue={max(clients)}", *overrides) as url:
            warm = [(p, t[:200]) for p, t in prompts[:1]]
            measure(url, max_batch, 1, warm, 1, min(max_tokens, 8), cell_s)  # lazy initialisation, not timed
            for n in clients:
                done, cell = measure(url, max_batch, n, prompts, requests, max_tokens, cell_s)
                records += done
                cells.append(cell)
                batch = f"{cell.mean_batch:.2f}" if cell.mean_batch is not None else "-"
                log(f"| {model} | {max_batch} | {n} | {cell.requests} | {cell.tokens_per_s:.1f} | "
                    f"{cell.first_token_p50_s:.2f} / {cell.first_token_p95_s:.2f} | "
                    f"{cell.request_tokens_per_s_p50:.1f} / {cell.request_tokens_per_s_p95:.1f} | {batch} |",
                    flush=True)
    write_lines(out / "requests.jsonl", records)
    write_lines(out / "summary.jsonl", cells)
    save_figure(cells, model, out / "serve_bench.png")
    return cells


def save_figure(cells: list[LoadCell], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from selfspec.plots import STYLE, plot_serve_load

    with replacing(path, RERUN_BENCH) as temporary:  # no half figure on a full disk
        plot_serve_load(cells, model=model, date=time.strftime("%Y-%m-%d")).savefig(temporary, dpi=STYLE["savefig.dpi"])


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give a positive integer")
    return int(text)


def counts(text: str) -> list[int]:
    """"1,4,8" as [1, 4, 8]: positive integers."""
    return [positive(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.serve.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_llama", help="a model config (default: tiny_llama; smollm2 for "
                                                                 "real figures)")
    parser.add_argument("--clients", type=counts, default=[1, 4, 8, 16], help="default: 1,4,8,16")
    parser.add_argument("--max-batch", type=counts, default=[1, 8], help="serve.max_batch values (default: 1,8)")
    parser.add_argument("--requests", type=positive, default=2, help="requests per client (default: 2)")
    parser.add_argument("--max-tokens", type=positive, default=64, help="new tokens per request (default: 64)")
    parser.add_argument("--cell-s", type=float, default=600, help="seconds a cell may take (default: 600)")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/serve_bench/<model>")
    parser.add_argument("overrides", nargs="*", help="run.py overrides for the servers, e.g. serve.strategy=...")
    args = parser.parse_args(argv)
    try:
        bench(args.model, args.clients, args.max_batch, args.requests, args.max_tokens,
              args.out or Path("outputs") / "serve_bench" / args.model, args.overrides, args.cell_s)
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
