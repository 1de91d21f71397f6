"""The server's edges, in this process (Starlette's TestClient over make_app, plain decoding of a tiny model): the API
key guards /v1 (compared in constant time), a body above serve.max_body_bytes gets 413 in OpenAI's error shape
before anything parses it (by its Content-Length, or counted when chunked), and a server bound beyond loopback
without a key says so in one `selfspec: warning:` line. Over real HTTP and in the page: tests/test_serve.py."""

import json
import warnings

import pytest
from fastapi.testclient import TestClient

from selfspec import SelfSpeculativeDecoder
from selfspec.errors import SelfspecError, format_warning
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.serve import loopback, warn_if_open
from selfspec.serve.app import make_app

from helpers import chat, run_settings

LIMIT = 4000
JSON = {"Content-Type": "application/json"}
KEY = {**JSON, "Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def client():
    settings = run_settings("task=serve", "serve.strategy=plain", "serve.max_batch=1", "serve.api_key=secret",
                            f"serve.max_body_bytes={LIMIT}", "serve.max_prompt_tokens=256", "serve.max_tokens=8")
    decoder = SelfSpeculativeDecoder(tiny_model("llama", num_layers=2), byte_tokenizer(), strategy="plain")
    app = make_app({"plain": decoder}, "tiny", settings.serve, settings.sampling, settings.constraints)
    with TestClient(app) as client:
        yield client


def body(padding: int) -> bytes:
    """A chat request whose prompt is `padding` characters long."""
    return json.dumps({"model": "tiny", "messages": chat("x" * padding), "max_tokens": 4}).encode()


def test_a_body_within_the_limit_with_the_key_is_answered(client):
    reply = client.post("/v1/chat/completions", content=body(100), headers=KEY)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("key", ["Bearer wrong", "Bearer secre", "Bearer secretx", "secret", "",
                                 "Bearer séçret".encode("latin-1")])  # a header that is not ASCII is refused too
def test_a_missing_or_wrong_key_is_refused(client, key):
    headers = {**JSON, "Authorization": key} if key else JSON
    reply = client.post("/v1/chat/completions", content=body(100), headers=headers)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_a_body_whose_content_length_is_above_the_limit_gets_413_before_it_is_read(client):
    too_big = body(LIMIT)
    reply = client.post("/v1/chat/completions", content=too_big, headers=KEY)
    assert reply.status_code == 413
    assert reply.json()["error"] == {
        "message": f"the request body ({len(too_big)} bytes) is above this server's limit of {LIMIT} bytes "
                   f"(serve.max_body_bytes)", "type": "invalid_request_error", "param": None, "code": None}


def test_a_chunked_body_above_the_limit_gets_413_once_counted(client):
    def chunks():  # no Content-Length: the bytes are counted as they arrive
        data = body(LIMIT)
        for start in range(0, len(data), 1000):
            yield data[start:start + 1000]

    reply = client.post("/v1/chat/completions", content=chunks(), headers=KEY)
    assert reply.status_code == 413 and "content-length" not in reply.request.headers
    assert reply.json()["error"]["message"] == (f"the request body (over {LIMIT} bytes) is above this server's "
                                                f"limit of {LIMIT} bytes (serve.max_body_bytes)")


def test_an_unauthenticated_body_above_the_limit_is_refused_too(client):
    assert client.post("/v1/chat/completions", content=body(LIMIT), headers=JSON).status_code == 413


@pytest.mark.parametrize("host, key, warned", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("127.0.0.2", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("myhost.example", None, True),
    ("0.0.0.0", "secret", False),
])
def test_a_server_bound_beyond_loopback_without_a_key_warns_in_one_line(host, key, warned):
    settings = run_settings("task=serve", f"serve.host={host}" if ":" not in host else f"serve.host='{host}'",
                            *([f"serve.api_key={key}"] if key else [])).serve
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_open(settings)
    lines = [format_warning(w.message, w.category, w.filename, w.lineno) for w in caught]
    assert lines == ([f"selfspec: warning: serve.host={host!r} takes requests from other machines and "
                      f"serve.api_key is not set: anyone who reaches port 8000 can use the model; set "
                      f"serve.api_key=<secret>, or serve.host=127.0.0.1 to serve this machine only\n"]
                     if warned else [])
    assert loopback(host) == (host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))


def test_max_body_bytes_below_one_is_refused():
    with pytest.raises(SelfspecError, match="max_body_bytes=0 must be >= 1"):
        run_settings("task=serve", "serve.max_body_bytes=0")
