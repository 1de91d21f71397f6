"""`python run.py task=serve` as a subprocess on a free local port: the openai client and httpx stream replies equal
to plain greedy decoding, 16 concurrent clients, the queue (429, a disconnect frees it), every bad request's 4xx,
a body above serve.max_body_bytes (413), the API key, and the page in headless Chromium (the screenshot lands in
outputs/test_artifacts/), where a reply of HTML and script shows as text."""

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from selfspec import SelfSpeculativeDecoder

from helpers import chat, plain_decoder, printable, server, stream_events

pytestmark = pytest.mark.slow  # run.py server subprocesses

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "outputs" / "test_artifacts"
# the served hybrid on the adaptive exit: on a random tiny model drafting never pays, so the cost-aware exit would
# (rightly) draft almost nothing and the page would show no accepted draft tokens
# in float64: a batch's forward rounds as a forward of one row does, so replies equal plain decoding's exactly
TINY = ("model=tiny_llama", "model.dtype=float64", "logger=none", "draft.hybrid_policy=adaptive")
LONG = (*TINY, "model.seed=1")  # its greedy reply to "a long reply" runs 300 tokens without an EOS


@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory):
    with server(tmp_path_factory.mktemp("serve"), *TINY) as url:
        yield url


@pytest.fixture(scope="module")
def plain():
    return plain_decoder(*TINY)


def test_the_openai_client_streams_a_chat_reply_equal_to_plain_greedy_decoding(tiny_url, plain):
    client = OpenAI(base_url=f"{tiny_url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="tiny_llama", messages=chat("Hello, server"), stream=True,
                                                 max_tokens=24, temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.generate(chat("Hello, server"), max_new_tokens=24).text
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 24
    stats = last.model_extra["selfspec"]["stats"]
    assert stats["verify_steps"] + 1 == sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None)
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["mean_accepted_tokens"] >= 1 and stats["tokens_per_s"] > 0


def test_each_event_carries_one_steps_tokens_and_sources(tiny_url, plain):
    with httpx.Client() as client:
        events = stream_events(client, tiny_url, {"model": "tiny_llama", "messages": chat("abab abab abab abab"),
                                                  "max_tokens": 24, "temperature": 0})
    tokens = [token for event in events if event["choices"] for token in event["selfspec"]["tokens"]]
    assert [t[0] for t in tokens] == plain.generate(chat("abab abab abab abab"), max_new_tokens=24).token_ids
    assert {t[2] for t in tokens} <= {"model", "ngram", "verified"} and "verified" in {t[2] for t in tokens}
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["prompt_tokens"] > 0


def test_plain_completions_models_and_health_answer(tiny_url, plain):
    body = {"model": "tiny_llama", "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "strategy": "plain"}
    reply = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=600).json()
    assert reply["object"] == "text_completion" and reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["text"] == plain.generate("def f(x):", max_new_tokens=16).text
    assert reply["selfspec"]["stats"]["acceptance_rate"] is None  # plain decoding drafts nothing
    assert [m["id"] for m in httpx.get(f"{tiny_url}/v1/models").json()["data"]] == ["tiny_llama"]
    health = httpx.get(f"{tiny_url}/health").json()
    assert health["status"] == "ok" and health["strategy"] == "self_spec_hybrid" and health["running"] == 0
    assert health["batch"] == 0 and health["max_batch"] == 8 and health["steps"] >= 1


def banned_word(plain: SelfSpeculativeDecoder, content: str, max_tokens: int) -> str:
    """A two-character word of plain greedy decoding's reply: one that the model does produce."""
    text = plain.generate(chat(content), max_new_tokens=max_tokens).text
    return next(text[i:i + 2] for i in range(len(text) - 1) if printable(text[i:i + 2]))


def test_banned_words_roll_back_in_streams_and_whole_replies_as_in_plain_decoding(tiny_url, plain):
    word = banned_word(plain, "Hello, server", 24)
    expected = plain.generate(chat("Hello, server"), max_new_tokens=24, banned_words=[word])
    body = {"model": "tiny_llama", "messages": chat("Hello, server"), "max_tokens": 24, "temperature": 0,
            "banned_words": [word]}
    with httpx.Client() as client:
        events = stream_events(client, tiny_url, body)
        whole = client.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=600).json()
    tokens = [t[0] for e in events if e["choices"] for t in e["selfspec"]["tokens"]]
    assert tokens == expected.token_ids and expected.stats.rollbacks >= 1
    assert sum(len(e["selfspec"]["rolled_back"]) for e in events if e["choices"]) >= len(word)
    assert events[-1]["selfspec"]["stats"]["rollbacks"] == expected.stats.rollbacks
    assert whole["choices"][0]["message"]["content"] == expected.text and word.lower() not in expected.text.lower()


def test_logprobs_in_openais_shapes_are_plain_decodings(tiny_url, plain):
    expected = plain.generate(chat("Hello, server"), max_new_tokens=12, logprobs=3)
    client = OpenAI(base_url=f"{tiny_url}/v1", api_key="unused")
    reply = client.chat.completions.create(model="tiny_llama", messages=chat("Hello, server"), max_tokens=12,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    assert [len(c.top_logprobs) for c in content] == [3] * 12 and content[0].top_logprobs[0].logprob >= content[0].logprob
    streamed = list(client.chat.completions.create(model="tiny_llama", messages=chat("Hello, server"), max_tokens=12,
                                                   temperature=0, logprobs=True, stream=True))
    logprobs = [c.logprob for e in streamed if e.choices and e.choices[0].logprobs for c in e.choices[0].logprobs.content]
    assert logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    body = {"model": "tiny_llama", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    completion = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=600).json()["choices"][0]
    reference = plain.generate("def f(x):", max_new_tokens=8, logprobs=2)
    assert completion["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in reference.logprobs], abs=1e-5)
    assert all(1 <= len(top) <= 2 for top in completion["logprobs"]["top_logprobs"])  # keyed by text: bytes may share one
    assert completion["logprobs"]["text_offset"][0] == 0 and "".join(completion["logprobs"]["tokens"]) == completion["text"]


def test_sixteen_concurrent_streaming_clients_are_all_answered_correctly(tiny_url, plain):
    prompts = [f"client {i} asks" for i in range(16)]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[int, str]:
        body = {"model": "tiny_llama", "messages": chat(prompt), "max_tokens": 8, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{tiny_url}/v1/chat/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
            text = "".join(c["delta"].get("content", "") for line in lines
                           for c in json.loads(line.removeprefix("data: "))["choices"])
            return response.status_code, text

    async def all_of_them():
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    answers = asyncio.run(all_of_them())
    assert [status for status, _ in answers] == [200] * 16
    assert [text for _, text in answers] == [plain.generate(chat(p), max_new_tokens=8).text for p in prompts]


BAD_REQUESTS = [  # (path, body, status, words in the message)
    ("/v1/chat/completions", {"model": "gpt-4", "messages": chat("hi")}, 404, "model='gpt-4' is not served"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "max_tokens": 5000}, 400,
     "max_tokens=5000 is above this server's limit 1024"),
    ("/v1/completions", {"model": "tiny_llama", "prompt": "x" * 4100, "max_tokens": 8}, 400,
     "exceed the model's context"),
    ("/v1/chat/completions", '{"model": "tiny_llama", "messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "n": 2}, 400, "n:"),
    ("/v1/chat/completions", {"model": "tiny_llama"}, 400, "messages: Field required"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "strategy": "x"}, 400, "strategy='x'"),
    ("/v1/completions", {"model": "tiny_llama", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny_llama", "prompt": "hi", "banned_words": [" "]}, 400,
     "banned_words[0]=' ' is not allowed"),
    ("/v1/completions", {"model": "tiny_llama", "prompt": "hi", "banned_words": ["w"] * 10001}, 400, "banned_words"),
    ("/v1/completions", {"model": "tiny_llama", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny_llama", "messages": chat("hi"), "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs=true"),
    ("/v1/embeddings", {"model": "tiny_llama"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, words", BAD_REQUESTS, ids=[words for *_, words in BAD_REQUESTS])
def test_each_bad_request_gets_an_openai_shaped_4xx(tiny_url, path, body, status, words):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{tiny_url}{path}", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    problem = response.json()["error"]
    assert words in problem["message"] and problem["type"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_above_serve_max_body_bytes_gets_413_in_openais_shape(tiny_url, chunked):
    content = json.dumps({"model": "tiny_llama", "messages": chat("x" * 2 ** 20)}).encode()
    sent = (content[start:start + 2 ** 16] for start in range(0, len(content), 2 ** 16)) if chunked else content
    response = httpx.post(f"{tiny_url}/v1/chat/completions", content=sent,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 413
    problem = response.json()["error"]
    assert "limit of 1048576 bytes (serve.max_body_bytes)" in problem["message"]
    assert problem["type"] == "invalid_request_error"


KEY = {"Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def guarded_url(tmp_path_factory):
    """One request decodes at a time (serve.max_batch=1), one more may wait; /v1 needs the API key."""
    with server(tmp_path_factory.mktemp("guarded"), *LONG, "serve.max_batch=1", "serve.max_queue=1",
                "serve.api_key=secret") as url:
        yield url


def test_the_api_key_guards_the_api_but_not_the_page(guarded_url):
    refused = httpx.get(f"{guarded_url}/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{guarded_url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{guarded_url}/v1/models", headers=KEY).status_code == 200
    assert httpx.get(f"{guarded_url}/").status_code == 200 and httpx.get(f"{guarded_url}/health").json()["auth"]


def test_one_at_a_time_a_full_queue_answers_429_and_disconnects_free_the_queue(guarded_url):
    def start(client: httpx.Client, prompt: str, max_tokens: int) -> httpx.Response:
        body = {"model": "tiny_llama", "messages": chat(prompt), "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        response = client.send(client.build_request("POST", f"{guarded_url}/v1/chat/completions", json=body),
                               stream=True)
        assert response.status_code == 200
        return response

    def health() -> dict:
        return httpx.get(f"{guarded_url}/health").json()

    def until(condition, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.1)

    with httpx.Client(headers=KEY, timeout=600) as a_client, httpx.Client(headers=KEY, timeout=600) as b_client, \
            httpx.Client(headers=KEY, timeout=600) as c_client:
        running = start(a_client, "a long reply", 300)
        a_lines = running.iter_lines()
        progress = []
        for line in a_lines:  # a few steps, to know its speed
            if line.startswith("data: {"):
                progress.append(json.loads(line[6:])["selfspec"]["stats"])
                if len(progress) == 5:
                    break
        waiting = start(b_client, "waits", 8)
        until(lambda: health()["waiting"] == 1)
        assert health()["batch"] == 1 and health()["running"] == 1  # serve.max_batch=1: one at a time
        full = httpx.post(f"{guarded_url}/v1/chat/completions", headers=KEY,
                          json={"model": "tiny_llama", "messages": chat("one too many"), "max_tokens": 8})
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["code"] == "queue_full"

        waiting.close()  # a waiting client leaves: its place frees up
        until(lambda: health()["waiting"] == 0)
        queued = start(c_client, "gets in", 8)
        until(lambda: health()["waiting"] == 1)

        closed_at = time.monotonic()
        running.close()  # the running client leaves: its generation stops at the next step
        lines = [line for line in queued.iter_lines() if line.startswith("data: {")]
        waited = time.monotonic() - closed_at
    stats = progress[-1]
    left_s = (300 - stats["new_tokens"]) / stats["tokens_per_s"]  # what the first reply still needed
    assert waited < left_s / 3, (waited, left_s)
    text = "".join(c["delta"].get("content", "") for line in lines for c in json.loads(line[6:])["choices"])
    assert text == plain_decoder(*LONG).generate(chat("gets in"), max_new_tokens=8).text
    until(lambda: not health()["running"] and health()["waiting"] == 0)


def browser_paths() -> tuple[str, str]:
    """Debian's chromium and chromedriver (nothing is downloaded at run time); apt-get installs them when missing,
    as `make install` does, and a failed install fails the test."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
            done = subprocess.run(command, capture_output=True, text=True)
            assert done.returncode == 0, f"{' '.join(command)} failed: {done.stderr[-2000:]}"
    return shutil.which("chromium"), shutil.which("chromedriver")


@contextmanager
def headless_chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot_page(url: str, prompt: str, max_tokens: int, path: Path):
    """Compare the served strategy with plain decoding on the page; returns the two panes' (classes, colours, text)
    and saves a screenshot."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with headless_chromium() as driver:
        driver.get(f"{url}/")
        WebDriverWait(driver, 60).until(lambda d: "strategy" in d.find_element(By.ID, "served").text)
        for element_id, value in (("prompt", prompt), ("max_tokens", str(max_tokens))):
            field = driver.find_element(By.ID, element_id)
            field.clear()
            field.send_keys(value)
        driver.find_element(By.ID, "compare").click()
        stats = lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".stats")]  # noqa: E731
        WebDriverWait(driver, 600).until(lambda d: len(stats(d)) == 2 and "x plain" in stats(d)[0])
        panes = []
        for pane in driver.find_elements(By.CSS_SELECTOR, ".pane"):
            spans = pane.find_elements(By.CSS_SELECTOR, ".reply span")
            reply = pane.find_element(By.CSS_SELECTOR, ".reply")
            panes.append(({s.get_attribute("class") for s in spans},
                          {s.value_of_css_property("background-color") for s in spans},
                          driver.execute_script("return arguments[0].textContent", reply)))
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
        return panes, stats(driver)


def test_the_page_streams_replies_with_tokens_coloured_by_source_in_headless_chromium(tiny_url):
    panes, stats = screenshot_page(tiny_url, "abab abab abab abab", 48, ARTIFACTS / "serve_page.png")
    (spec_classes, spec_colours, spec_text), (plain_classes, _, plain_text) = panes
    assert {"src-model", "src-verified"} <= spec_classes <= {"src-model", "src-ngram", "src-verified"}
    assert plain_classes == {"src-verified"} and len(spec_colours) == len(spec_classes)  # one background per source
    assert spec_text == plain_text and spec_text  # lossless, as the page shows it
    assert "tokens/s" in stats[0] and "acceptance" in stats[0] and "done" in stats[1]
    assert (ARTIFACTS / "serve_page.png").stat().st_size > 10_000


def test_smollm2_streamed_greedy_reply_equals_run_py_plain_greedy_output(tmp_path):
    run = subprocess.run([sys.executable, "run.py", "data.name=chat", "data.limit=1", "strategies=[plain]",
                          "sampling.max_new_tokens=16", "logger=none", "warmup=false",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "records.jsonl").read_text().splitlines()[0])
    prompt = json.loads((ROOT / "selfspec" / "data" / "prompts" / "chat.jsonl").read_text().splitlines()[0])["turns"][0]
    (tmp_path / "serve").mkdir()
    with server(tmp_path / "serve", "logger=none", "warmup=false", "serve.max_batch=1") as url, \
            httpx.Client() as client:  # one request: no batch sizes above one to measure costs for
        events = stream_events(client, url, {"model": "smollm2", "messages": chat(prompt), "max_tokens": 16,
                                             "temperature": 0})
    tokens = [token for event in events if event["choices"] for token in event["selfspec"]["tokens"]]
    assert [t[0] for t in tokens] == record["output_ids"]
    streamed = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert streamed and record["output_text"].startswith(streamed)


def test_the_page_strikes_through_the_tokens_a_banned_word_rolled_back(tiny_url, plain):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    prompt = "abab abab abab abab"
    word = banned_word(plain, prompt, 32)
    expected = plain.generate(chat(prompt), max_new_tokens=32, banned_words=[word])
    with headless_chromium() as driver:
        driver.get(f"{tiny_url}/")
        WebDriverWait(driver, 60).until(lambda d: "strategy" in d.find_element(By.ID, "served").text)
        for element_id, value in (("prompt", prompt), ("max_tokens", "32"), ("banned", word)):
            field = driver.find_element(By.ID, element_id)
            field.clear()
            field.send_keys(value)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 600).until(lambda d: "done" in d.find_element(By.CSS_SELECTOR, ".stats").text)
        spans = driver.find_elements(By.CSS_SELECTOR, ".reply span")
        struck = [s for s in spans if s.get_attribute("class") == "src-rolled_back"]
        kept = "".join(driver.execute_script("return arguments[0].textContent", s) for s in spans if s not in struck)
        assert struck and all("line-through" in s.value_of_css_property("text-decoration") for s in struck)
        assert kept == expected.text
        driver.save_screenshot(str(ARTIFACTS / "serve_page_rollback.png"))


MARKUP = ["<script>window.ran = 1</script>", "<b>bold</b>", '<img src="x" onerror="window.ran = 2">', " &amp; done"]


def markup_events():
    """A reply whose tokens are HTML and script, streamed in the served events' shape (serve/schemas.py)."""
    stats = {"tokens_per_s": 10.0, "acceptance_rate": 0.5, "mean_accepted_tokens": 1.5, "new_tokens": len(MARKUP),
             "verify_steps": len(MARKUP) - 1}
    for index, text in enumerate(MARKUP):
        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
                                     "selfspec": {"tokens": [[index, text, "verified"]], "rolled_back": [],
                                                  "retracted": 0, "stats": stats}}) + "\n\n"
    yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(MARKUP)},
                                 "selfspec": {"strategy": "plain", "stats": stats}}) + "\n\n"
    yield "data: [DONE]\n\n"


@contextmanager
def markup_server():
    """The page (serve/static/index.html) beside a stand-in API that streams `markup_events`, on a free port."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    from selfspec.serve.app import PAGE

    async def health(_):
        return JSONResponse({"model": "stand-in", "strategy": "plain", "auth": False})

    async def completions(_):
        return StreamingResponse(markup_events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/", lambda _: FileResponse(PAGE)), Route("/health", health),
                            Route("/v1/chat/completions", completions, methods=["POST"])])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


def test_the_page_shows_a_reply_of_html_and_script_as_text_and_runs_none_of_it():
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with markup_server() as url, headless_chromium() as driver:
        driver.get(f"{url}/")
        WebDriverWait(driver, 60).until(lambda d: "strategy" in d.find_element(By.ID, "served").text)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 60).until(lambda d: "done" in d.find_element(By.CSS_SELECTOR, ".stats").text)
        reply = driver.find_element(By.CSS_SELECTOR, ".reply")
        assert driver.execute_script("return arguments[0].textContent", reply) == "".join(MARKUP)
        assert reply.find_elements(By.CSS_SELECTOR, "script, b, img") == []
        assert driver.execute_script("return window.ran") is None
