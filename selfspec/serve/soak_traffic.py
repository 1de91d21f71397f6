"""The soak test's traffic (serve/soak.py): a mix of requests drawn from a seed, and the client that sends one and
records what came back.

Each client draws its requests from its own `random.Random`, so a seed fixes every client's sequence of requests;
how many of them a run sends depends on the machine's speed. Greedy kinds are compared with plain decoding
afterwards; `disconnect` streams read a few events and close; `bad` requests expect their 4xx; any request that is
not bad may get 429 (the queue is full) and nothing else but 200.
"""

import json
import random
from dataclasses import dataclass

import httpx

from selfspec.settings import ServeSettings
from selfspec.timing import clock

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# kind -> weight in the mix
KINDS = {"chat_stream": 3, "chat_whole": 2, "completion_stream": 2, "completion_whole": 2, "sampled": 1,
         "disconnect": 2, "banned_words": 2, "stop": 2, "logprobs": 2, "long_prompt": 1, "bad": 2}
GREEDY_KINDS = {"chat_stream", "chat_whole", "completion_stream", "completion_whole", "banned_words", "stop",
                "logprobs", "long_prompt"}
BANNED = ["e", "o", "th", "an", "the", "in"]  # words the tiny model's bytes and SmolLM2's English both produce
STOPS = [".", "\n", "e", "the", ","]


@dataclass
class Planned:
    """One request to send: `body` is JSON, or text sent as is (a bad request's broken JSON)."""
    kind: str
    path: str
    body: dict | str
    expect: int  # the status it should get (429 is allowed too, unless it is a bad request)
    read_events: int | None = None  # disconnect: close the stream after this many events with tokens
    bad_size: int = 0  # a body above serve.max_body_bytes: this many bytes of padding


@dataclass
class Answer:
    """What one request got, timed by its client in seconds."""
    client: int
    kind: str
    path: str
    body: dict | str
    expect: int
    sent_s: float  # from the traffic's start
    status: int  # the HTTP status; 0: the client's connection failed
    elapsed_s: float = 0.0  # to the end of the response, or to the disconnect
    first_token_s: float | None = None  # streams: to the first event with tokens
    new_tokens: int = 0  # usage.completion_tokens, or the tokens a disconnected stream read
    text: str = ""
    token_ids: list[int] | None = None  # streams: the reply's ids (retracted ones taken off)
    logprobs: list[float] | None = None  # each reply token's log-probability, when asked for
    finish_reason: str | None = None
    disconnected: bool = False
    error: str | None = None  # a stream's error event, a 5xx's message or the client's transport error


def plan(rng: random.Random, model: str, serve: ServeSettings, prompts: list[str]) -> Planned:
    """The next request of a client drawing from `rng`: a kind by its weight in KINDS, then its fields."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    if kind == "bad":
        return bad_request(rng, model, serve)
    chat = {"chat_stream": True, "chat_whole": True, "completion_stream": False,
            "completion_whole": False}.get(kind, rng.random() < 0.5)
    text = rng.choice(prompts)[:300]
    if kind == "long_prompt":  # about 3/4 of serve.max_prompt_tokens for a byte tokenizer, a few hundred for BPE
        text = " ".join(prompts)[:serve.max_prompt_tokens * 3 // 4]
    body = {"model": model, "max_tokens": rng.randint(8, 48), "temperature": 0,
            "stream": kind.endswith("stream") or kind == "disconnect" or rng.random() < 0.5,
            **({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})}
    if kind == "sampled":
        body |= {"temperature": rng.choice([0.7, 1.0]), "top_p": 0.9, "seed": rng.randrange(2 ** 31)}
    elif kind == "disconnect":
        body["max_tokens"] = serve.max_tokens  # it would decode long after its client left
    elif kind == "banned_words":
        body["banned_words"] = rng.sample(BANNED, 2)
    elif kind == "stop":
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    elif kind == "logprobs":
        top = rng.randint(0, 3)
        body |= {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top}
    return Planned(kind, CHAT if chat else COMPLETIONS, body, 200, rng.randint(1, 4) if kind == "disconnect" else None)


def bad_request(rng: random.Random, model: str, serve: ServeSettings) -> Planned:
    """One of the requests the server must refuse, with its 4xx."""
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    choices = [
        (CHAT, {"model": "gpt-4", **hi}, 404),
        (CHAT, {"model": model, **hi, "temperature": 3}, 400),
        (CHAT, {"model": model, **hi, "max_tokens": serve.max_tokens + 1}, 400),
        (COMPLETIONS, {"model": model, "prompt": " x" * (serve.max_prompt_tokens + 1), "max_tokens": 8}, 400),
        (CHAT, '{"model": "' + model + '", "messages": [', 400),
        (CHAT, {"model": model}, 400),
        (CHAT, {"model": model, **hi, "top_logprobs": 2}, 400),
        (COMPLETIONS, {"model": model, "prompt": "hi", "banned_words": [" "]}, 400),
        ("/v1/embeddings", {"model": model}, 404),
    ]
    if rng.random() < 0.1:  # rarely: a 1 MiB body costs the client more than the server
        return Planned("bad", CHAT, {"model": model, **hi}, 413, bad_size=serve.max_body_bytes + 1)
    path, body, status = rng.choice(choices)
    return Planned("bad", path, body, status)


async def send(client: httpx.AsyncClient, url: str, planned: Planned, number: int, sent_s: float) -> Answer:
    """Send `planned` as client `number` and record the answer; a transport error is status 0, not an exception."""
    answer = Answer(number, planned.kind, planned.path, planned.body, planned.expect, sent_s, 0)
    start = clock()
    try:
        body = planned.body if isinstance(planned.body, str) else json.dumps(planned.body)
        if planned.bad_size:
            body = json.dumps({**planned.body, "padding": "x" * planned.bad_size})
        request = client.build_request("POST", url + planned.path, content=body,
                                       headers={"Content-Type": "application/json"})
        response = await client.send(request, stream=True)
        try:
            answer.status = response.status_code
            if response.status_code == 200 and isinstance(planned.body, dict) and planned.body.get("stream"):
                await read_stream(response, answer, planned.read_events, start)
            else:
                read_whole(json.loads(await response.aread() or b"{}"), answer)
        finally:
            await response.aclose()
    except (httpx.TransportError, json.JSONDecodeError) as failure:
        answer.error = f"{type(failure).__name__}: {failure}"
    answer.elapsed_s = clock() - start
    return answer


async def read_stream(response: httpx.Response, answer: Answer, read_events: int | None, start: float) -> None:
    """A stream's events into `answer`: the reply's tokens as `Chunk.onto` builds them; with `read_events`, leave
    after that many events with tokens."""
    tokens, events = [], 0  # tokens: (id, text, logprob)
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            answer.error = event["error"]["message"]
            break
        if event.get("usage"):
            answer.new_tokens = event["usage"]["completion_tokens"]
            continue
        choice, extra = event["choices"][0], event["selfspec"]
        del tokens[len(tokens) - extra["retracted"]:]
        tokens += zip([t[0] for t in extra["tokens"]], [t[1] for t in extra["tokens"]], event_logprobs(choice)
                      or [None] * len(extra["tokens"]))
        answer.finish_reason = choice["finish_reason"]
        if extra["tokens"]:
            events += 1
            answer.first_token_s = answer.first_token_s or clock() - start
        if read_events is not None and events == read_events:
            answer.disconnected, answer.new_tokens = True, len(tokens)
            break
    answer.token_ids, answer.text = [t[0] for t in tokens], "".join(t[1] for t in tokens)
    answer.logprobs = [t[2] for t in tokens] if tokens and tokens[0][2] is not None else None


def event_logprobs(choice: dict) -> list[float] | None:
    """A choice's token log-probabilities, chat or completions shape; None when not asked for."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    return [c["logprob"] for c in logprobs["content"]] if "content" in logprobs else logprobs["token_logprobs"]


def read_whole(reply: dict, answer: Answer) -> None:
    """A whole reply (or an error body) into `answer`."""
    if "error" in reply:
        answer.error = reply["error"]["message"] if answer.status >= 500 else None
        return
    choice = reply["choices"][0]
    answer.text = choice["message"]["content"] if "message" in choice else choice["text"]
    answer.finish_reason, answer.new_tokens = choice["finish_reason"], reply["usage"]["completion_tokens"]
    answer.logprobs = event_logprobs(choice)
