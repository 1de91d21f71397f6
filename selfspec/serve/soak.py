"""The soak test of the batching server (`make soak`): 16 clients send a seeded mix of requests (serve/soak_traffic.py)
to `selfspec task=serve` (serve.max_batch=8, serve.max_queue=4: some get 429) for --duration seconds.

    python -m selfspec.serve.soak [--model tiny_llama] [--duration 150] [--clients 16] [--seed 0] [--check 60]
                                  [--out outputs/soak/<model>] [run.py overrides ...]

It prints requests, status codes, tokens/s, time to first token p50 / p95 and the server's resident memory (start,
after warm-up, end), writes <out>/answers.jsonl and <out>/summary.json, and exits 1 naming each hold that failed:
no 5xx (nor a stream's error event); every answer its expected status (200 or 429, a bad request its 4xx); memory
after warm-up (the first third, at most 60 s) grows by less than 5%; greedy answers (up to --check of them, every
kind) equal plain decoding of the same request at batch size 1 in this process; disconnects free their rows (the
batch drains when the traffic ends, and rows whose streams close leave the batch within a few steps).
"""

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil  # installed with accelerate, a dependency

from selfspec.api.decoder import SelfSpeculativeDecoder
from selfspec.data.prompt_sets import load_prompts
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.records.serve_load import write_lines
from selfspec.serve.bench import positive, server_process
from selfspec.serve.soak_traffic import GREEDY_KINDS, Answer, plan, send
from selfspec.settings import RunSettings, default_settings
from selfspec.timing import clock

MAX_GROWTH = 0.05  # memory after warm-up may grow by less than this fraction
LEAVE_STEPS = 50  # batch steps a closed stream's row may take to leave (a leaked row decodes to its end)
BACKOFF_S = 1.0  # a client's pause after a 429 (the server's Retry-After is 1 s or more)
# the tiny model in float64: a batch row's logits equal its batch-1 forward's exactly (docs/design.md)
MODEL_OVERRIDES = {"tiny_llama": ("model.dtype=float64",)}


@dataclass
class Hold:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakSummary:
    model: str
    clients: int
    max_batch: int
    max_queue: int
    seed: int
    duration_s: float
    warmup_s: float
    requests: int
    statuses: dict[str, int]  # status code -> answers ("0": the client's connection failed)
    kinds: dict[str, int]  # kind -> requests sent
    disconnects: int
    new_tokens: int
    tokens_per_s: float  # every answer's new tokens over the traffic's wall time
    first_token_p50_s: float | None
    first_token_p95_s: float | None
    rss_start_mib: float  # the server before the traffic
    rss_warm_mib: float  # after warm-up
    rss_end_mib: float  # after the traffic
    checked: int  # greedy answers compared with plain decoding
    holds: list[Hold]
    rss_samples: list[tuple[float, float]]  # (seconds, MiB) once a second during the traffic

    @property
    def failed(self) -> list[Hold]:
        return [hold for hold in self.holds if not hold.ok]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2 ** 20


async def traffic(url: str, model: str, settings: RunSettings, prompts: list[str], clients: int, duration_s: float,
                  seed: int, pid: int) -> tuple[list[Answer], list[tuple[float, float]]]:
    """Every client's answers, and the server's RSS (seconds, MiB) once a second, until `duration_s` passes (the
    requests then in flight end first)."""
    start = clock()

    async def one_client(client: httpx.AsyncClient, number: int) -> list[Answer]:
        rng, answers = random.Random(seed * 1000 + number), []
        while clock() - start < duration_s:
            planned = plan(rng, model, settings.serve, prompts)
            answers.append(await send(client, url, planned, number, clock() - start))
            if answers[-1].status == 429:
                await asyncio.sleep(BACKOFF_S)
        return answers

    async def memory() -> list[tuple[float, float]]:
        samples = []
        while clock() - start < duration_s:
            samples.append((clock() - start, rss_mib(pid)))
            await asyncio.sleep(1.0)
        return samples

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        *per_client, samples = await asyncio.gather(*(one_client(client, c) for c in range(clients)), memory())
    return [answer for answers in per_client for answer in answers], samples


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def drained(url: str, seconds: float = 60) -> bool:
    """Whether the server holds no row, running request or waiting one within `seconds`."""
    deadline = clock() + seconds
    while clock() < deadline:
        state = health(url)
        if state["batch"] == state["running"] == state["waiting"] == 0:
            return True
        time.sleep(0.1)
    return False


async def disconnect_probe(url: str, model: str, prompt: str, rows: int, max_tokens: int) -> tuple[int, int]:
    """`rows` plain streams read one event each and close: (rows in the batch when they closed, batch steps until
    the batch was empty again)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "strategy": "plain"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        responses = [await client.send(client.build_request("POST", f"{url}/v1/chat/completions", json=body),
                                       stream=True) for _ in range(rows)]
        for response in responses:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break
        closing = health(url)
        for response in responses:
            await response.aclose()
    drained(url)
    return closing["batch"], health(url)["steps"] - closing["steps"]


def compare(answer: Answer, plain: SelfSpeculativeDecoder, settings: RunSettings) -> str | None:
    """Why `answer` differs from plain decoding of its request at batch size 1 in this process; None: it does not."""
    body = answer.body
    prompt = body.get("messages") or body["prompt"]
    logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") is True else body.get("logprobs")
    stop = body.get("stop", settings.sampling.stop)
    expected = plain.generate(prompt, max_new_tokens=body["max_tokens"], temperature=0,
                              repetition_penalty=settings.sampling.repetition_penalty,
                              stop=[stop] if isinstance(stop, str) else list(stop),
                              banned_words=body.get("banned_words", settings.constraints.banned_words),
                              case_sensitive=settings.constraints.case_sensitive,
                              logprobs=logprobs)
    if answer.text != expected.text or answer.finish_reason != expected.finish_reason:
        return f"text {answer.text[:40]!r} ({answer.finish_reason}) != plain's {expected.text[:40]!r} " \
               f"({expected.finish_reason})"
    if answer.token_ids is not None and answer.token_ids != expected.token_ids:
        return f"token ids {answer.token_ids[:8]} != plain's {expected.token_ids[:8]}"
    if answer.logprobs is not None and not np.allclose(answer.logprobs, [lp.logprob for lp in expected.logprobs],
                                                       atol=1e-4):
        return "log-probabilities differ from plain's"
    return None


def checked_sample(answers: list[Answer], most: int, seed: int) -> list[Answer]:
    """Up to `most` complete greedy 200 answers, drawn round the greedy kinds so that each kind is checked."""
    rng = random.Random(seed)
    by_kind = {kind: [a for a in answers if a.kind == kind and a.status == 200 and not a.error] for kind in
               sorted(GREEDY_KINDS)}
    for group in by_kind.values():
        rng.shuffle(group)
    ordered = [group[i] for i in range(max(map(len, by_kind.values()), default=0)) for group in by_kind.values()
               if i < len(group)]
    return ordered[:most]


def judge(answers: list[Answer], rss: tuple[float, float, float], mismatches: list[str], checked: int,
          drain_ok: bool, probe: tuple[int, int]) -> list[Hold]:
    """The soak's holds from what it measured."""
    server_errors = [a for a in answers if a.status >= 500 or (a.status == 200 and a.error)]
    unexpected = [a for a in answers if a.status != a.expect and not (a.status == 429 and a.expect == 200)]
    growth = rss[2] / rss[1] - 1
    rows, steps = probe
    return [
        Hold("no 5xx", not server_errors, f"{len(server_errors)} of {len(answers)} answers 5xx or a stream error"
             + (f", first: {server_errors[0].error}" if server_errors else "")),
        Hold("expected statuses", not unexpected, f"{len(unexpected)} answers not 200/429 or their 4xx" +
             (f", first: {unexpected[0].kind} got {unexpected[0].status} ({unexpected[0].error}), "
              f"expected {unexpected[0].expect}" if unexpected else "")),
        Hold("memory growth < 5%", growth < MAX_GROWTH,
             f"{rss[1]:.0f} MiB after warm-up -> {rss[2]:.0f} MiB at the end ({100 * growth:+.1f}%)"),
        Hold("greedy equals plain", checked > 0 and not mismatches,
             f"{checked - len(mismatches)} of {checked} checked equal" + (f"; {mismatches[0]}" if mismatches else "")),
        Hold("disconnect frees its row", drain_ok and rows >= 1 and steps <= LEAVE_STEPS,
             f"drained after the traffic: {drain_ok}; {rows} rows of closed streams left within {steps} steps "
             f"(at most {LEAVE_STEPS})"),
    ]


def soak(model: str, duration_s: float, clients: int, seed: int, check: int, out: Path, overrides: list[str],
         log=print) -> SoakSummary:
    """Start a server, run the traffic, check the answers; writes <out>/answers.jsonl and summary.json."""
    server_overrides = [f"model={model}", *MODEL_OVERRIDES.get(model, ()), "logger=none", "serve.max_batch=8",
                        "serve.max_queue=4", *overrides]
    settings = default_settings(*server_overrides)
    prompts = [p.turns[0] for p in load_prompts("chat")]
    warmup_s = min(60.0, duration_s / 3)
    with server_process(out / "server", *server_overrides) as (url, process):
        name, rss_start = health(url)["model"], rss_mib(process.pid)
        start = clock()
        answers, samples = asyncio.run(traffic(url, name, settings, prompts, clients, duration_s, seed, process.pid))
        wall_s = clock() - start
        drain_ok = drained(url)
        probe = asyncio.run(disconnect_probe(url, name, prompts[0], min(4, settings.serve.max_batch),
                                             settings.serve.max_tokens))
        rss_end = rss_mib(process.pid)
    rss_warm = next((mib for t, mib in samples if t >= warmup_s), samples[-1][1])
    loaded = load_model(settings.model)
    plain = SelfSpeculativeDecoder(loaded.model, loaded.tokenizer, strategy="plain")
    sample = checked_sample(answers, check, seed)
    mismatches = [f"{a.kind}: {why}" for a in sample if (why := compare(a, plain, settings))]
    ttft = [a.first_token_s for a in answers if a.first_token_s is not None]
    percentiles = [float(v) for v in np.percentile(ttft, [50, 95])] if ttft else [None, None]
    new_tokens = sum(a.new_tokens for a in answers if a.status == 200)
    summary = SoakSummary(
        name, clients, settings.serve.max_batch, settings.serve.max_queue, seed, duration_s, warmup_s, len(answers),
        count(str(a.status) for a in answers), count(a.kind for a in answers), sum(a.disconnected for a in answers),
        new_tokens, new_tokens / wall_s, *percentiles, rss_start, rss_warm, rss_end, len(sample),
        judge(answers, (rss_start, rss_warm, rss_end), mismatches, len(sample), drain_ok, probe),
        samples)
    out.mkdir(parents=True, exist_ok=True)
    write_lines(out / "answers.jsonl", answers)
    (out / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1) + "\n")
    print_summary(summary, log)
    return summary


def count(values) -> dict[str, int]:
    counts = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


def print_summary(s: SoakSummary, log=print) -> None:
    ttft = "-" if s.first_token_p50_s is None else f"{s.first_token_p50_s:.2f} / {s.first_token_p95_s:.2f}"
    statuses = ", ".join(f"{code}: {n}" for code, n in s.statuses.items())
    log(f"| model | clients | max_batch | seconds | requests | status codes | disconnects | tokens/s | "
        f"TTFT p50 / p95 (s) | RSS start / warm / end (MiB) |\n|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {s.model} | {s.clients} | {s.max_batch} | {s.duration_s:.0f} | {s.requests} | {statuses} | "
        f"{s.disconnects} | {s.tokens_per_s:.1f} | {ttft} | {s.rss_start_mib:.0f} / {s.rss_warm_mib:.0f} / "
        f"{s.rss_end_mib:.0f} |")
    log("kinds: " + ", ".join(f"{kind} {n}" for kind, n in s.kinds.items()))
    for hold in s.holds:
        log(f"{'ok  ' if hold.ok else 'FAIL'} {hold.name}: {hold.detail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m selfspec.serve.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_llama", help="a model config (default: tiny_llama; smollm2 for "
                                                                 "real figures)")
    parser.add_argument("--duration", type=positive, default=150, help="seconds of traffic (default: 150)")
    parser.add_argument("--clients", type=positive, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="the traffic mix's seed (default: 0)")
    parser.add_argument("--check", type=positive, default=60, help="greedy answers compared with plain decoding "
                                                                   "(default: 60)")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/soak/<model>")
    parser.add_argument("overrides", nargs="*", help="run.py overrides for the server, e.g. serve.strategy=...")
    args = parser.parse_args(argv)
    try:
        summary = soak(args.model, args.duration, args.clients, args.seed, args.check,
                       args.out or Path("outputs") / "soak" / args.model, args.overrides)
    except SelfspecError as error:
        print(f"selfspec: error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    if summary.failed:
        print(f"selfspec: error: the soak failed {len(summary.failed)} of {len(summary.holds)} holds: " +
              "; ".join(f"{h.name} ({h.detail})" for h in summary.failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
