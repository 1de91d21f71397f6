"""The continuously batching server (serve/batcher.py): in this process, requests of different strategies and sampling
modes decode in one batch each as alone, join and leave it between steps, and a request that cannot join ends
alone; through a `run.py task=serve` subprocess, concurrent streams share the batch (/health counts it) and each
gets its reply alone, a client that disconnects leaves the batch while the others finish, and bad requests beside
them get their 4xx. One request at a time (serve.max_batch=1) and the 429 of a full queue: tests/test_serve.py."""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import httpx
import pytest

from selfspec import SelfSpeculativeDecoder
from selfspec.decoding.results import Emitted
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.serve.batcher import Batcher, DecodingFailed, drafter_pools, pool_sizes, row_length
from selfspec.settings import default_settings

from helpers import chat, plain_decoder, printable, run_settings, server

SAMPLING = default_settings().sampling
NEW_TOKENS = 64  # the in-process model's greedy replies to LONG_PROMPTS run this long without an end id
SERVE = run_settings("task=serve", "serve.max_prompt_tokens=64", f"serve.max_tokens={NEW_TOKENS}").serve
LONG_PROMPTS = ["long one", "long five", "row h", "row e"]


@pytest.fixture(scope="module")
def decoders() -> dict[str, SelfSpeculativeDecoder]:
    """The served strategy and plain decoding over one tiny float64 model, as task=serve builds them."""
    model, tokenizer = tiny_model("llama", num_layers=6).double(), byte_tokenizer()
    draft = run_settings("model=tiny_llama", "draft.hybrid_policy=adaptive").draft  # cost-aware would hardly draft
    return {"self_spec_hybrid": SelfSpeculativeDecoder(model, tokenizer, {"attn": [1, 3], "mlp": [2]}, draft,
                                                       "self_spec_hybrid"),
            "plain": SelfSpeculativeDecoder(model, tokenizer, strategy="plain")}


@contextmanager
def batcher(decoders, capacity: int):
    pools = drafter_pools(decoders.values(), SAMPLING, capacity)
    running = Batcher(decoders["plain"].model, capacity, row_length(SERVE, None, pools), pools)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def tokens(steps: Iterator[Emitted], output: list[int] | None = None) -> list[int]:
    """The output after `steps` (onto `output`, the tokens so far: a later step may roll some of them back)."""
    output = [] if output is None else output
    for emitted in steps:
        emitted.onto(output)
    return output


def alone(decoders, prompt: str, **options) -> list[int]:
    """Plain decoding's reply at batch size 1."""
    return tokens(decoders["plain"].job(prompt, max_new_tokens=NEW_TOKENS, **options).steps())


def until(condition, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.slow  # seconds of tiny-model decoding
def test_requests_of_other_strategies_and_modes_join_the_running_batch_and_decode_as_alone(decoders):
    hybrid, plain = decoders["self_spec_hybrid"], decoders["plain"]
    reply = plain.tokenizer.decode(alone(decoders, LONG_PROMPTS[2]))
    word = next(reply[i:i + 2] for i in range(len(reply) - 1) if printable(reply[i:i + 2]))  # one it writes
    sampled = dict(temperature=0.8, seed=3)  # plain: its random draws do not depend on drafts
    jobs = [hybrid.job(LONG_PROMPTS[0], max_new_tokens=NEW_TOKENS), plain.job(LONG_PROMPTS[1], max_new_tokens=NEW_TOKENS),
            plain.job("sampled", max_new_tokens=NEW_TOKENS, **sampled),
            hybrid.job(LONG_PROMPTS[2], max_new_tokens=NEW_TOKENS, banned_words=[word], logprobs=2)]
    expected = [alone(decoders, LONG_PROMPTS[0]), alone(decoders, LONG_PROMPTS[1]),
                alone(decoders, "sampled", **sampled),
                alone(decoders, LONG_PROMPTS[2], banned_words=[word], logprobs=2)]
    with batcher(decoders, 4) as running:
        rows = [running.row(job).emitted() for job in jobs]
        outputs = [[] for _ in jobs]
        for i in (0, 1, 0, 1, 0, 1, 2, 3):  # two rows start; the others join a few steps later
            next(rows[i]).onto(outputs[i])
        hybrid_greedy = [len(running.pools["self_spec_hybrid", True, rows]) for rows in (1, 2, 4)]
        assert running.size == 4 and hybrid_greedy == [0, 2, 3]  # rows 0 and 3 joined batches of 1 and 4
        for output, row in zip(outputs, rows):
            tokens(row, output)  # the rest, as the row's reader sees it
        assert running.row_steps > running.steps  # steps verified several rows
    assert outputs == expected and len(outputs[0]) == NEW_TOKENS and outputs[3] != alone(decoders, LONG_PROMPTS[2])


@pytest.mark.slow  # seconds of tiny-model decoding
def test_a_request_that_cannot_join_ends_alone_and_the_batch_decodes_on(decoders):
    hybrid = decoders["self_spec_hybrid"]
    with batcher(decoders, 3) as running:
        rows = [running.row(hybrid.job(prompt, max_new_tokens=NEW_TOKENS)).emitted() for prompt in LONG_PROMPTS[:2]]
        outputs = [tokens([next(row)]) for row in rows]
        too_long = running.row(hybrid.job("x" * 100, max_new_tokens=NEW_TOKENS)).emitted()  # longer than the rows' cache
        with pytest.raises(DecodingFailed, match="could not join the batch: a prompt of 100 tokens"):
            next(too_long)
        assert running.size == 2
        for output, row in zip(outputs, rows):
            tokens(row, output)
    assert outputs == [alone(decoders, prompt) for prompt in LONG_PROMPTS[:2]]


@pytest.mark.slow  # seconds of tiny-model decoding
def test_a_reader_that_leaves_frees_its_row_and_drafter_for_the_next_request(decoders):
    hybrid = decoders["self_spec_hybrid"]
    with batcher(decoders, 2) as running:
        pools = {key: list(pool) for key, pool in running.pools.items()}
        rows = [running.row(hybrid.job(prompt, max_new_tokens=NEW_TOKENS)).emitted() for prompt in LONG_PROMPTS[:3]]
        outputs = [[], [], []]
        for i in (0, 1, 0, 1, 0, 1):
            next(rows[i]).onto(outputs[i])
        rows[0].close()  # row 0 leaves: the last row moves into its place
        until(lambda: running.size == 1)
        for i in (1, 2):  # the third joins in the freed row
            tokens(rows[i], outputs[i])
        until(lambda: running.size == 0)
        assert {key: sorted(map(id, pool)) for key, pool in running.pools.items()} == \
            {key: sorted(map(id, pool)) for key, pool in pools.items()}
    assert outputs[1:] == [alone(decoders, prompt) for prompt in LONG_PROMPTS[1:3]]


def test_each_row_holds_the_longest_request_and_the_widest_draft(decoders):
    pools = drafter_pools(decoders.values(), SAMPLING, 2)
    assert [len(pools["self_spec_hybrid", greedy, rows]) for greedy in (True, False) for rows in (1, 2)] == [1, 2] * 2
    assert pools["plain", True, 2] == pools["plain", False, 2] == [None, None]
    widest = max(d.max_tokens for pool in pools.values() for d in pool if d is not None)
    assert widest > 0
    assert row_length(SERVE, None, pools) == 64 + NEW_TOKENS + widest + 1
    assert row_length(SERVE, 80, pools) == 80 + widest + 1  # the model's context is the tighter bound
    assert pool_sizes(8) == [1, 2, 4, 8] and pool_sizes(6) == [1, 2, 4, 6] and pool_sizes(1) == [1]
    plain_only = {key: pool for key, pool in pools.items() if key[0] == "plain"}
    assert row_length(replace(SERVE, max_tokens=1), None, plain_only) == 64 + 1 + 1


# through the server: a tiny float64 model whose greedy replies to these prompts run 200 tokens without an EOS
LONG = ("model=tiny_llama", "model.dtype=float64", "model.seed=1", "logger=none", "draft.hybrid_policy=adaptive")
PROMPTS = ["row zero", "row one", "row two", "row three"]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with server(tmp_path_factory.mktemp("batching"), *LONG, "serve.max_prompt_tokens=512") as url:
        yield url


@pytest.fixture(scope="module")
def replies_alone() -> dict[str, list[int]]:
    """Each prompt's plain greedy reply, decoded alone in this process."""
    plain = plain_decoder(*LONG)
    replies = {p: plain.generate(chat(p), max_new_tokens=MAX_TOKENS).token_ids for p in PROMPTS}
    assert {len(reply) for reply in replies.values()} == {MAX_TOKENS}
    return replies


def health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


def open_stream(client: httpx.Client, url: str, prompt: str, **extra) -> tuple[httpx.Response, Iterator[dict]]:
    """A streaming chat request, answered: the response and its events as they come."""
    body = {"model": "tiny_llama", "messages": chat(prompt), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, **extra}
    response = client.send(client.build_request("POST", f"{url}/v1/chat/completions", json=body), stream=True)
    assert response.status_code == 200
    return response, (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))


def event_tokens(events) -> list[int]:
    return [token[0] for event in events if event["choices"] for token in event["selfspec"]["tokens"]]


@pytest.mark.slow
def test_concurrent_streams_decode_in_one_batch_and_each_gets_its_reply_alone(url, replies_alone):
    before = health(url)
    with httpx.Client(timeout=600) as client:
        streams = [open_stream(client, url, prompt, **extra)
                   for prompt, extra in zip(PROMPTS, ({}, {"strategy": "plain"}, {"logprobs": True}, {}))]
        firsts = [next(events) for _, events in streams]  # each has joined the batch: its prefill ran
        during = health(url)
        replies = [event_tokens([first, *events]) for first, (_, events) in zip(firsts, streams)]
    after = health(url)
    assert during["batch"] == 4 and during["running"] == 4 and during["max_batch"] == 8
    assert replies == [replies_alone[p] for p in PROMPTS]
    steps, rows = after["steps"] - before["steps"], after["row_steps"] - before["row_steps"]
    assert rows >= 2 * steps  # on average each step verified two rows or more


@pytest.mark.slow
def test_a_client_that_disconnects_leaves_the_batch_and_the_others_finish(url, replies_alone):
    with httpx.Client(timeout=600) as client:
        streams = [open_stream(client, url, prompt) for prompt in PROMPTS[:3]]
        started = [[next(events) for _ in range(3)] for _, events in streams]
        streams[0][0].close()  # the first row leaves: the last one moves into its place
        until(lambda: health(url)["batch"] == 2)
        replies = [event_tokens([*first, *events]) for first, (_, events) in zip(started[1:], streams[1:])]
    assert replies == [replies_alone[p] for p in PROMPTS[1:3]]
    until(lambda: health(url)["running"] == health(url)["batch"] == 0)


BAD = [({"temperature": 3}, "temperature"), ({"max_tokens": 5000}, "max_tokens=5000 is above this server's limit"),
       ({"messages": chat("x" * 600)}, "tokens are above this server's limit 512 (serve.max_prompt_tokens)")]


@pytest.mark.slow
def test_bad_requests_beside_decoding_ones_get_their_4xx_and_the_others_finish(url, replies_alone):
    with httpx.Client(timeout=600) as client:
        streams = [open_stream(client, url, prompt) for prompt in PROMPTS[:2]]
        firsts = [next(events) for _, events in streams]
        for fields, words in BAD:
            response = client.post(f"{url}/v1/chat/completions",
                                   json={"model": "tiny_llama", "messages": chat("hi"), **fields})
            assert response.status_code == 400 and words in response.json()["error"]["message"]
        assert health(url)["batch"] == 2
        replies = [event_tokens([first, *events]) for first, (_, events) in zip(firsts, streams)]
    assert replies == [replies_alone[p] for p in PROMPTS[:2]]
