"""Request bodies of the OpenAI-compatible endpoints (pydantic checks types and ranges: a bad field is a 400), the
error body in OpenAI's shape, and the response and stream-event bodies."""

import time
import uuid
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from selfspec.api.decoder import MAX_TOP_LOGPROBS
from selfspec.api.streaming import Chunk, DecodingStats, Token
from selfspec.settings import MAX_BANNED_WORDS


class Request(BaseModel):
    """What both endpoints take. Fields OpenAI defines and we do not use (user, logit_bias, ...) are ignored;
    temperature, top_p and top_k default to the server's `sampling` settings."""
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # an extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    n: int = Field(1, ge=1, le=1)  # one choice per request
    strategy: str | None = None  # an extension: "plain" decodes without drafts (the page's toggle)
    # extensions: words the reply may not contain (decoding rolls back where one completes); default: the server's
    banned_words: list[str] | None = Field(None, max_length=MAX_BANNED_WORDS)
    case_sensitive: bool | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def top_logprobs_count(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class CompletionRequest(Request):
    """POST /v1/completions: the prompt is raw text."""
    prompt: str = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's, with this many alternatives

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(Request):
    """POST /v1/chat/completions: the messages go through the tokenizer's chat template, as run.py's chat prompts."""
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    """OpenAI's error response: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(message, param, code, kind), status_code=status, headers=headers)


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, stats: DecodingStats) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": prompt_tokens + stats.new_tokens}


class Reply:
    """The response and stream-event bodies of one request, chat or text completion; with log-probabilities in
    OpenAI's shapes when the request asked for them (`decode`: a token id's text, for the alternatives)."""

    def __init__(self, chat: bool, model: str, strategy: str, prompt_tokens: int, logprobs: bool = False,
                 decode=None):
        self.chat, self.model, self.strategy, self.prompt_tokens = chat, model, strategy, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.logprobs, self.decode, self.offset = logprobs, decode, 0  # offset: characters sent so far

    def _body(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, tokens: list[Token], finish_reason: str | None, first: bool = False,
                whole: bool = False) -> dict:
        text = "".join(t.text for t in tokens)
        logprobs = self._logprobs(tokens)
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, tokens: list[Token]) -> dict | None:
        """OpenAI's logprobs of a choice: chat {"content": [{token, logprob, bytes, top_logprobs}]}, completions
        {tokens, token_logprobs, top_logprobs, text_offset}."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{**_entry(t.text, t.logprob.logprob),
                                 "top_logprobs": [_entry(self.decode([i]), v) for i, v in t.logprob.top]}
                                for t in tokens]}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.text)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob.logprob for t in tokens],
                "top_logprobs": [{self.decode([i]): v for i, v in t.logprob.top} for t in tokens],
                "text_offset": offsets}

    def event(self, chunk: Chunk, first: bool) -> dict:
        """One step's chunk; `selfspec` carries its tokens as [id, text, source], the tokens a banned word rolled
        back as [id, text] (`retracted`: how many of them earlier events had sent) and the stats so far."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        tokens = [[t.id, t.text, t.source] for t in chunk.tokens]
        return self._body(kind, [self._choice(chunk.tokens, chunk.finish_reason, first)],
                          selfspec={"tokens": tokens, "rolled_back": [[t.id, t.text] for t in chunk.rolled_back],
                                    "retracted": chunk.retracted, "stats": chunk.stats.as_dict()})

    def usage_event(self, stats: DecodingStats) -> dict:
        """The last event before [DONE]: usage and the decoding stats (as OpenAI's stream_options.include_usage)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._body(kind, [], usage=usage(self.prompt_tokens, stats),
                          selfspec={"strategy": self.strategy, "stats": stats.as_dict()})

    def whole(self, tokens: list[Token], finish_reason: str, stats: DecodingStats) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return self._body(kind, [self._choice(tokens, finish_reason, whole=True)],
                          usage=usage(self.prompt_tokens, stats),
                          selfspec={"strategy": self.strategy, "stats": stats.as_dict()})


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
