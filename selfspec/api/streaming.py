"""From decoding steps to streamed text: each verification step's tokens with their text and where they came from,
running statistics, and stop strings (the text ends before the first one; tokens whose text may begin one are held
back to the next step).

Token sources: the drafter's own (`model`: a layer-skip, Kangaroo or second-model draft; `ngram`: copied from the
context) for accepted draft tokens, `verified` for the token the full model chose itself (the prefill's first
token, a correction after a rejected draft, the bonus token after a fully accepted one, every plain-decoding token).
"""

import dataclasses
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field

from selfspec.decoding.results import StepRecord
from selfspec.timing import clock

VERIFIED = "verified"


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

    def add(self, new: list[int], step: StepRecord | None) -> None:
        self.new_tokens += len(new)
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
    source: str  # "model" | "ngram" (an accepted draft token) | "verified" (the full model's own choice)


@dataclass
class Chunk:
    """What one verification step (or the prefill) added to the reply; the last chunk has a finish_reason."""
    tokens: list[Token]
    stats: DecodingStats  # the whole generation so far
    finish_reason: str | None = None  # "stop" (EOS or a stop string) | "length" (max_new_tokens)

    @property
    def text(self) -> str:
        return "".join(token.text for token in self.tokens)


def token_sources(new: list[int], step: StepRecord | None) -> list[str]:
    """Where each of a step's new tokens came from: its accepted draft tokens first, then the verifier's."""
    if step is None:
        return [VERIFIED] * len(new)
    return [step.source if i < step.accepted else VERIFIED for i in range(len(new))]


@dataclass
class _Reply:
    """Decoded text of the new tokens so far and the tokens not yet handed out."""
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already handed out
    held: list[Token] = field(default_factory=list)

    def add(self, token_id: int, source: str, tokenizer) -> None:
        """A new token; its text is what it adds to the decoded reply ("" while it ends inside a character, whose
        text then comes with the token that completes it)."""
        self.ids.append(token_id)
        text = tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = "" if text.endswith("\ufffd") else text[len(self.text):]
        self.text += piece
        self.held.append(Token(token_id, piece, source))

    def take(self, end: int) -> list[Token]:
        """The held tokens whose text ends by character `end` (a token that may begin a stop string waits)."""
        taken = []
        while self.held and self.sent + len(self.held[0].text) <= end:
            taken.append(self.held.pop(0))
            self.sent += len(taken[-1].text)
        return taken

    def cut(self, end: int) -> list[Token]:
        """The held tokens up to character `end` (a stop string's start), the last one's text cut there."""
        taken = []
        while self.held and self.sent < end:
            taken.append(self.held.pop(0))
            taken[-1].text = taken[-1].text[: end - self.sent]
            self.sent += len(taken[-1].text)
        return taken


def stream_chunks(steps: Generator[tuple[list[int], StepRecord | None], None, None], tokenizer,
                  end_ids: tuple[int, ...], stop: Sequence[str] = ()) -> Iterator[Chunk]:
    """One Chunk per decoding step, then a last one with the finish reason; ends the generation (closes `steps`)
    at the first stop string. A character the generation ends inside of is left out of the text."""
    start, stats, reply = clock(), DecodingStats(), _Reply()
    stop = [s for s in stop if s]
    try:
        for new, step in steps:
            stats.add(new, step)
            for token_id, source in zip(new, token_sources(new, step)):
                reply.add(token_id, source, tokenizer)
            stats.elapsed_s = clock() - start
            found = [i for i in (reply.text.find(s, reply.sent) for s in stop) if i >= 0]
            if found:
                yield Chunk(reply.cut(min(found)), dataclasses.replace(stats), "stop")
                return
            yield Chunk(reply.take(len(reply.text) - _stop_prefix(reply.text, stop)), dataclasses.replace(stats))
    finally:
        steps.close()
    finish = "stop" if reply.ids and reply.ids[-1] in end_ids else "length"
    yield Chunk(reply.take(len(reply.text)), dataclasses.replace(stats), finish)


def _stop_prefix(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that begins a stop string (held back: the stop may follow)."""
    return max((n for s in stop for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)
