"""From decoding steps to streamed text: each verification step's tokens with their text and where they came from,
running statistics, stop strings (the text ends before the first one) and banned words (decoding/text_rules.py).
Tokens whose text may still begin a stop string or a banned word are held back until it cannot; tokens that a
banned word rolled back are handed out apart, as `rolled_back`, and were never part of the text.

Token sources: the drafter's own (`model`: a layer-skip, Kangaroo, feature-head or second-model draft; `ngram`:
copied from the context; `store`: from the token store of the model's own generations) for accepted draft tokens, `verified` for the token the full model chose itself (the prefill's first
token, a correction after a rejected draft, the bonus token after a fully accepted one, every plain-decoding token).
"""

import collections
import dataclasses
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

from selfspec.decoding.results import Emitted, StepRecord, TokenLogprob
from selfspec.decoding.text_rules import TextRules
from selfspec.timing import clock

VERIFIED = "verified"
ROLLED_BACK = "rolled_back"  # the source of a token a banned word took back


@dataclass
class DecodingStats:
    """One generation's counts so far."""
    new_tokens: int = 0
    elapsed_s: float = 0.0  # wall time since the generation started, prefill included
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens added by verification steps (every new token but the prefill's)
    verify_steps: int = 0  # full-model forwards after the prefill
    draft_steps: int = 0  # verification steps that checked a draft (the others decoded one token plainly)
    rollbacks: int = 0  # times a banned word completed and the output was rolled back

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Tokens emitted per verification, bonus token included (plain decoding: 1.0)."""
        return self.emitted / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def add(self, emitted: Emitted) -> None:
        self.new_tokens += len(emitted.tokens) - emitted.rolled_back
        self.rollbacks += emitted.rolled_back > 0
        step = emitted.step
        if step is not None:
            self.drafted, self.accepted = self.drafted + step.drafted, self.accepted + step.accepted
            self.emitted, self.verify_steps = self.emitted + step.emitted, self.verify_steps + 1
            self.draft_steps += step.drafted > 0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_tokens": self.mean_accepted_tokens, "tokens_per_s": self.tokens_per_s}


@dataclass
class Token:
    id: int
    text: str  # the text this token adds ("" for a special token or the first bytes of a split character)
    source: str  # "model" | "ngram" | "store" (an accepted draft token) | "verified" (the model's own) | "rolled_back"
    logprob: TokenLogprob | None = None  # when the generation was asked for log-probabilities


@dataclass
class Chunk:
    """What one verification step (or the prefill) added to the reply; the last chunk has a finish_reason."""
    tokens: list[Token]
    stats: DecodingStats  # the whole generation so far
    finish_reason: str | None = None  # "stop" (EOS or a stop string) | "length" (max_new_tokens)
    rolled_back: list[Token] = field(default_factory=list)  # tokens a banned word took back (never in the text)
    retracted: int = 0  # of those, how many earlier chunks had handed out (only when a rollback reaches that far)

    @property
    def text(self) -> str:
        return "".join(token.text for token in self.tokens)

    def onto(self, reply: list[Token]) -> None:
        """Take the retracted tokens off the end of `reply` (the tokens handed out so far), then add this chunk's."""
        del reply[len(reply) - self.retracted:]
        reply += self.tokens


def token_sources(new: list[int], step: StepRecord | None) -> list[str]:
    """Where each of a step's new tokens came from: its accepted draft tokens first, then the verifier's."""
    if step is None:
        return [VERIFIED] * len(new)
    return [step.source if i < step.accepted else VERIFIED for i in range(len(new))]


@dataclass
class _Reply:
    """The reply's tokens so far with their decoded text, and how many of them (and characters) are handed out."""
    tokens: list[Token] = field(default_factory=list)
    text: str = ""
    released: int = 0  # tokens handed out
    sent: int = 0  # characters of `text` handed out

    def add(self, token: Token, tokenizer) -> None:
        """A new token; its text is what it adds to the decoded reply ("" while it ends inside a character, whose
        text then comes with the token that completes it)."""
        self.tokens.append(token)
        text = tokenizer.decode([t.id for t in self.tokens], skip_special_tokens=True)
        token.text = "" if text.endswith("\ufffd") else text[len(self.text):]
        self.text += token.text

    def roll_back(self, count: int) -> tuple[list[Token], int]:
        """Take the last `count` tokens off; returns them (as rolled-back tokens) and how many were handed out."""
        removed = self.tokens[len(self.tokens) - count:] if count else []
        del self.tokens[len(self.tokens) - len(removed):]
        self.text = self.text[:len(self.text) - sum(len(t.text) for t in removed)]
        retracted = max(0, self.released - len(self.tokens))
        self.released -= retracted
        self.sent = min(self.sent, len(self.text))
        return [dataclasses.replace(t, source=ROLLED_BACK) for t in removed], retracted

    def take(self, end: int) -> list[Token]:
        """The held tokens before token `end` (the ones after it may still begin a stop string or a banned word)."""
        taken = self.tokens[self.released:end]
        self.released, self.sent = max(self.released, end), self.sent + sum(len(t.text) for t in taken)
        return taken

    def cut(self, end: int) -> list[Token]:
        """The held tokens up to character `end` (a stop string's start), the last one's text cut there."""
        taken = []
        while self.released < len(self.tokens) and self.sent < end:
            token = self.tokens[self.released]
            taken.append(dataclasses.replace(token, text=token.text[: end - self.sent]))
            self.released, self.sent = self.released + 1, self.sent + len(taken[-1].text)
        return taken


def stream_chunks(steps: Generator[Emitted, None, None], tokenizer, end_ids: tuple[int, ...],
                  rules: TextRules | None = None) -> Iterator[Chunk]:
    """One Chunk per decoding step, then a last one with the finish reason; ends the generation (closes `steps`)
    at the first stop string. A character the generation ends inside of is left out of the text."""
    start, stats, reply = clock(), DecodingStats(), _Reply()
    stop = rules.stop.words if rules is not None and rules.stop is not None else ()
    try:
        for emitted in steps:
            stats.add(emitted)
            logprobs = emitted.logprobs or [None] * len(emitted.tokens)
            for token_id, source, logprob in zip(emitted.tokens, token_sources(emitted.tokens, emitted.step),
                                                 logprobs):
                reply.add(Token(token_id, "", source, logprob), tokenizer)
            rolled_back, retracted = reply.roll_back(emitted.rolled_back)
            stats.elapsed_s = clock() - start
            found = [i for i in (reply.text.find(s, reply.sent) for s in stop) if i >= 0]
            if found or emitted.stopped:
                end = min(found, default=len(reply.text))
                yield Chunk(reply.cut(end), dataclasses.replace(stats), "stop", rolled_back, retracted)
                return
            yield Chunk(reply.take(len(reply.tokens) - emitted.open_tokens), dataclasses.replace(stats), None,
                        rolled_back, retracted)
    finally:
        steps.close()
    finish = "stop" if reply.tokens and reply.tokens[-1].id in end_ids else "length"
    yield Chunk(reply.take(len(reply.tokens)), dataclasses.replace(stats), finish)


def row_steps(steps: Iterator[tuple[int, Emitted]], rows: int) -> list[Generator[Emitted, None, None]]:
    """A batch's (row, Emitted) steps as one Emitted stream per row; each stream advances the batch as far as its
    row needs (the other rows' steps wait in their queues)."""
    queues = [collections.deque() for _ in range(rows)]

    def row(index: int) -> Generator[Emitted, None, None]:
        while True:
            while not queues[index]:
                taken = next(steps, None)
                if taken is None:
                    return
                queues[taken[0]].append(taken[1])
            yield queues[index].popleft()

    return [row(index) for index in range(rows)]


def interleaved(streams: list[Iterator[Chunk]]) -> Iterator[tuple[int, Chunk]]:
    """(stream index, Chunk) from every stream in turn, one chunk each, until all have ended."""
    live = dict(enumerate(streams))
    while live:
        for index in list(live):
            chunk = next(live[index], None)
            if chunk is None:
                del live[index]
            else:
                yield index, chunk
