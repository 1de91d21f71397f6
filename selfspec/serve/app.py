"""The FastAPI app: OpenAI-compatible /v1/chat/completions and /v1/completions (streamed as Server-Sent Events, one
event per verification step), /v1/models, /health and the page at /.

Up to serve.max_batch requests decode together: one worker thread owns the model and steps their generations in
one batch (serve/batcher.py); a request joins it at the next step and leaves when it ends or its client goes away,
and reads its own generation's steps, from which its own stream is built. Beyond the batch, requests wait in
arrival order in a bounded queue (queue.py; a full one answers 429). A streaming client that disconnects cancels
its response (sse-starlette), which takes its generation out of the batch; a waiting one leaves the queue.
serve.max_batch=1 decodes one request at a time. A request body above serve.max_body_bytes is answered 413 before
anything parses it (BodyLimit).
"""

import hmac
import json
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from selfspec.api.decoder import SelfSpeculativeDecoder
from selfspec.errors import SelfspecError
from selfspec.serve.batcher import Batcher, DecodingFailed, drafter_pools, row_length
from selfspec.serve.queue import QueueFull, RequestQueue, Ticket
from selfspec.serve.schemas import (ChatCompletionRequest, CompletionRequest, Reply, Request as Body, error,
                                    error_body)
from selfspec.settings import ConstraintSettings, SamplingSettings, ServeSettings

PAGE = Path(__file__).parent / "static" / "index.html"


class BadRequest(Exception):
    """A 4xx answered in OpenAI's error shape."""
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class BodyLimit:
    """ASGI middleware: a request body above `max_bytes` is answered 413 in OpenAI's error shape, at once when its
    Content-Length says so, else (a chunked body) as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error(413, self.too_large(f"{declared} bytes"))(scope, receive, send)
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI answers an HTTPException raised while it reads the body
                raise HTTPException(413, self.too_large(f"over {self.max_bytes} bytes"))
            return message

        await self.app(scope, counted, send)

    def too_large(self, size: str) -> str:
        return (f"the request body ({size}) is above this server's limit of {self.max_bytes} bytes "
                f"(serve.max_body_bytes)")


def make_app(decoders: dict[str, SelfSpeculativeDecoder], model_name: str, serve: ServeSettings,
             sampling: SamplingSettings, constraints: ConstraintSettings) -> FastAPI:
    """`decoders`: strategy name -> decoder over the one model; requests use serve.strategy unless they name
    another (`"strategy": "plain"`); `sampling` and `constraints`: the defaults of what a request leaves out."""
    model = next(iter(decoders.values())).model
    context_length = getattr(model.config, "max_position_embeddings", None)
    pools = drafter_pools(decoders.values(), sampling, serve.max_batch)
    batcher = Batcher(model, serve.max_batch, row_length(serve, context_length, pools), pools)
    queue = RequestQueue(serve.max_batch, serve.max_queue)

    @asynccontextmanager
    async def decoding(_):
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="selfspec", docs_url=None, redoc_url=None, lifespan=decoding)
    app.add_middleware(BodyLimit, max_bytes=serve.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        where = ".".join(str(part) for part in first["loc"] if part != "body") or "body"
        value = "" if first["type"] == "missing" else f" (got {json.dumps(first.get('input'), default=str)[:60]})"
        return error(400, f"{where}: {first['msg']}{value}", param=where)

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        kind = "authentication_error" if exc.status == 401 else "invalid_request_error"
        return error(exc.status, str(exc), exc.param, exc.code, kind)

    @app.exception_handler(QueueFull)
    async def queue_full(_, exc: QueueFull):
        return error(429, f"{exc}: serve.max_batch={queue.max_running} requests decode at a time and "
                          f"serve.max_queue={queue.max_waiting} wait", code="queue_full", kind="rate_limit_error",
                     headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(DecodingFailed)
    async def decoding_failed(_, exc: DecodingFailed):
        return error(500, str(exc), kind="server_error")

    def authorize(request: Request) -> None:
        sent, expected = request.headers.get("authorization", "").encode(), f"Bearer {serve.api_key}".encode()
        if serve.api_key and not hmac.compare_digest(sent, expected):  # in constant time: no timing hints
            raise BadRequest(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                             code="invalid_api_key")

    @app.get("/")
    async def page():
        return FileResponse(PAGE)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "strategy": serve.strategy, "strategies": list(decoders),
                "running": queue.running, "waiting": queue.waiting, "max_queue": queue.max_waiting,
                "batch": batcher.size, "max_batch": serve.max_batch, "steps": batcher.steps,
                "row_steps": batcher.row_steps, "auth": serve.api_key is not None}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "selfspec"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        return await respond(body, body.prompt, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(body, [{"role": m.role, "content": m.text} for m in body.messages], request, chat=True)

    async def respond(body: Body, prompt, request: Request, chat: bool):
        if body.model != model_name:
            raise BadRequest(404, f"model={body.model!r} is not served here; allowed: {model_name}", "model",
                             "model_not_found")
        name = body.strategy or serve.strategy
        if name not in decoders:
            raise BadRequest(400, f"strategy={name!r} is not served here; allowed: {', '.join(decoders)}", "strategy")
        decoder = decoders[name]
        try:
            ids = decoder.encode(prompt)
            max_tokens = check_length(len(ids), body.max_tokens or sampling.max_new_tokens)
            job = decoder.job(ids, max_new_tokens=max_tokens, temperature=_or(body.temperature, sampling.temperature),
                              top_p=_or(body.top_p, sampling.top_p), top_k=_or(body.top_k, sampling.top_k),
                              repetition_penalty=sampling.repetition_penalty, seed=body.seed,
                              stop=body.stops if body.stop is not None else sampling.stop,
                              banned_words=_or(body.banned_words, constraints.banned_words),
                              case_sensitive=_or(body.case_sensitive, constraints.case_sensitive),
                              logprobs=body.top_logprobs_count)
        except SelfspecError as exc:
            raise BadRequest(400, str(exc).splitlines()[0]) from None
        reply = Reply(chat, model_name, name, len(ids), body.top_logprobs_count is not None,
                      lambda token_ids: decoder.tokenizer.decode(token_ids))
        ticket = queue.take()
        chunks = decoder.chunks(batcher.row(job).emitted(), job)  # its row joins the batch at the first chunk
        if body.stream:
            return EventSourceResponse(events(chunks, reply, ticket), sep="\n",
                                       background=BackgroundTask(ticket.release))
        try:
            return await whole(chunks, reply, ticket, request)
        finally:
            ticket.release()

    def check_length(prompt_tokens: int, max_tokens: int) -> int:
        if max_tokens > serve.max_tokens:
            raise BadRequest(400, f"max_tokens={max_tokens} is above this server's limit {serve.max_tokens} "
                                  f"(serve.max_tokens)", "max_tokens")
        if context_length and prompt_tokens + max_tokens > context_length:
            raise BadRequest(400, f"the prompt's {prompt_tokens} tokens plus max_tokens={max_tokens} exceed the "
                                  f"model's context of {context_length} tokens", "max_tokens",
                             "context_length_exceeded")
        if prompt_tokens > serve.max_prompt_tokens:
            raise BadRequest(400, f"the prompt's {prompt_tokens} tokens are above this server's limit "
                                  f"{serve.max_prompt_tokens} (serve.max_prompt_tokens)", code="context_length_exceeded")
        return max_tokens

    async def events(chunks, reply: Reply, ticket: Ticket):
        async with ticket.turn():
            try:
                first, stats = True, None
                async for chunk in iterate_in_threadpool(chunks):
                    yield json.dumps(reply.event(chunk, first))
                    first, stats = False, chunk.stats
                yield json.dumps(reply.usage_event(stats))
            except DecodingFailed as failure:  # the response has started: the error is its last event
                yield json.dumps(error_body(str(failure), kind="server_error"))
            finally:
                chunks.close()  # takes its row out of the batch; no `next` runs now: iterate_in_threadpool waited
        yield "[DONE]"

    async def whole(chunks, reply: Reply, ticket: Ticket, request: Request) -> dict:
        tokens = []
        async with ticket.turn():
            try:
                while True:  # the last chunk has a finish_reason
                    chunk = await run_in_threadpool(next, chunks)
                    chunk.onto(tokens)
                    if chunk.finish_reason is not None:
                        return reply.whole(tokens, chunk.finish_reason, chunk.stats)
                    if await request.is_disconnected():
                        return {}  # nobody reads the answer: stop decoding here
            finally:
                chunks.close()

    return app


def _or(value, default):
    return default if value is None else value
