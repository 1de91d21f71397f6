"""Banned words and stop strings, matched on the output's decoded text, lossless under speculation.

The decoding loop (decoding/speculative.py) hands every emitted token to the generation's `OutputWatch`, which
decodes each token's text over a window of the tokens before it (so a token costs the same at any output length)
and follows the text with Aho-Corasick automata over the words (pyahocorasick). An automaton's state after any text
depends only on the text's last L - 1 characters (L: its longest word), so those characters are all the state the
watch keeps: a rollback, or a look-ahead over a draft, restarts the automaton from them.

Banned words roll back: when one completes, generation goes back to the token where it began, forbids that token
at that position (masked out of the full model's logits before the sampling filters) and goes on; where every token
at a position is forbidden, it goes back one more. This depends on the emitted tokens alone, and every strategy
emits tokens as plain decoding does, so greedy outputs equal plain decoding's token for token and sampled ones
follow its distribution.

Stop strings: the output ends with the token that completes the first one (api/streaming.py cuts the text before
it). A token that completes a banned word and a stop string at once rolls back.
"""

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ahocorasick

from selfspec.errors import SelfspecError
from selfspec.settings import check_banned_words

WINDOW = 4  # tokens decoded before a new one, so that its text comes out as inside the whole output


class WordFinder:
    """An Aho-Corasick automaton over `words`, matched case-insensitively unless `case_sensitive`."""

    def __init__(self, words: Sequence[str], case_sensitive: bool = True):
        self.words, self.case_sensitive = tuple(words), case_sensitive
        self.automaton = ahocorasick.Automaton()
        for word in words:
            key = self.fold(word)
            self.automaton.add_word(key, len(key))
        self.automaton.make_automaton()
        self.state_chars = max(len(self.fold(word)) for word in words) - 1

    def fold(self, text: str) -> str:
        """`text` as matched: lower-cased, one character for one (a character whose lower case is longer stays)."""
        if self.case_sensitive:
            return text
        lower = text.lower()
        return lower if len(lower) == len(text) else "".join(c if len(c.lower()) > 1 else c.lower() for c in text)

    def first(self, before: str, text: str) -> tuple[int, int] | None:
        """(start, end) in `text` of the first word that ends inside `text` (the longest of those ending first),
        following `before`; start < 0 when the word began in `before`."""
        before = before[len(before) - self.state_chars:] if self.state_chars else ""
        found = None
        for end, length in self.automaton.iter(self.fold(before + text)):
            if end < len(before):
                continue
            if found is not None and end + 1 - len(before) > found[1]:
                break
            match = (end + 1 - length - len(before), end + 1 - len(before))
            found = match if found is None or match[0] < found[0] else found
        return found

    def open_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins a word and is not one yet (it may still become one)."""
        for n in range(min(self.state_chars, len(text)), 0, -1):
            if self.automaton.match(self.fold(text[-n:])):
                return n
        return 0


@dataclass(frozen=True)
class TextRules:
    """A run's or a request's banned words and stop strings, and how to decode token ids to text."""
    decode: Callable[[list[int]], str]  # token ids -> text, special tokens left out
    vocab_size: int
    banned: WordFinder | None = None
    stop: WordFinder | None = None

    @property
    def state_chars(self) -> int:
        """The characters of text before a new token that matching reads (at least one)."""
        return max([1] + [finder.state_chars for finder in (self.banned, self.stop) if finder])

    def held_chars(self, text: str) -> int:
        """How many characters at the end of `text` may still begin a banned word or a stop string."""
        return max((finder.open_prefix(text) for finder in (self.banned, self.stop) if finder), default=0)


def text_rules(model, tokenizer, banned_words: Sequence[str] = (), case_sensitive: bool = False,
               stop: Sequence[str] = ()) -> TextRules | None:
    """The rules of `banned_words` and `stop` strings over `model`'s output; None when there are none."""
    check_banned_words(banned_words)
    stop = [s for s in stop if s]
    if not banned_words and not stop:
        return None
    vocab_size = model.get_output_embeddings().weight.shape[0]
    return TextRules(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), vocab_size,
                     WordFinder(banned_words, case_sensitive) if banned_words else None,
                     WordFinder(stop) if stop else None)


@dataclass
class Verdict:
    """What the rules make of a step's emitted tokens."""
    kept: int  # of the step's tokens, how many were emitted (the rest follow a rolled-back or stopping token)
    rolled_back: int = 0  # then this many tokens came off the output's end (a banned word completed)
    stopped: bool = False  # a stop string completed: the output ends here


@dataclass
class OutputWatch:
    """One generation's output under `rules`: its tokens' text, and the tokens forbidden at each output position
    (forbidden[i] holds for the output's first i tokens as they stand)."""
    rules: TextRules
    prompt_end: list[int]  # the prompt's last WINDOW tokens, which the first tokens' text is decoded after
    ids: list[int] = field(default_factory=list)  # the output's tokens
    ends: list[int] = field(default_factory=list)  # ends[i]: characters of text through ids[i]
    split: list[bool] = field(default_factory=list)  # split[i]: ids[i] ends inside a character (its text comes later)
    text: str = ""
    forbidden: dict[int, set[int]] = field(default_factory=dict)

    def forbidden_next(self) -> set[int]:
        """The tokens forbidden at the next output position."""
        return self.forbidden.get(len(self.ids), set())

    def settle(self, new: list[int]) -> Verdict:
        """Follow a step's emitted tokens; on the first that completes a banned word, roll back, and on the first
        that completes a stop string, stop."""
        for count, token in enumerate(new, 1):
            piece, split = self._piece(self.ids, token)
            start = len(self.text)  # where the token's text begins
            banned = self.rules.banned and self.rules.banned.first(self.text, piece)
            stop = self.rules.stop and self.rules.stop.first(self.text, piece)
            self._append(token, piece, split)
            if banned:
                before = len(self.ids)
                self._roll_back(self._token_at(start + banned[0]))
                return Verdict(count, before - len(self.ids))
            if stop:
                return Verdict(count, stopped=True)
        return Verdict(len(new))

    def draft_length(self, draft: list[int]) -> int:
        """How many of a chain draft's tokens to verify: through the first that completes a banned word or a stop
        string (the rest would be rolled back or cut). Not before it: with sampling, dropping a drafted token for
        its value would bias what the verifier emits there."""
        ids, text = self.ids[-WINDOW:], self.text[-self.rules.state_chars:]  # no more is read
        for count, token in enumerate(draft, 1):
            piece, _ = self._piece(ids, token)
            if any(finder and finder.first(text, piece) for finder in (self.rules.banned, self.rules.stop)):
                return count
            ids.append(token)
            text += piece
        return len(draft)

    def _piece(self, ids: list[int], token: int) -> tuple[str, bool]:
        """The text `token` adds after `ids`, and whether it ends inside a character (then its text is "" and comes
        with the token that completes the character)."""
        window = (self.prompt_end + ids[-WINDOW:])[-WINDOW:]
        before, after = self.rules.decode(window), self.rules.decode(window + [token])
        if after.endswith("\ufffd"):
            return "", True
        return after[len(before.rstrip("\ufffd")):], False

    def _append(self, token: int, piece: str, split: bool) -> None:
        self.split.append(split)
        self.ids.append(token)
        self.text += piece
        self.ends.append(len(self.text))

    def open_tokens(self) -> int:
        """How many tokens at the output's end a banned word or a stop string may still take back or cut: those
        of the text that may still begin one, and any that end inside a character."""
        return len(self.ids) - self._token_at(len(self.text) - self.rules.held_chars(self.text))

    def _token_at(self, char: int) -> int:
        """The output position of the token that began character `char` (with the bytes before it, where its first
        bytes came in tokens of their own)."""
        position = bisect.bisect_right(self.ends, char)
        while position > 0 and self.split[position - 1] and self.ends[position - 1] == char:
            position -= 1
        return position

    def _roll_back(self, position: int) -> None:
        """Take the output back to its first `position` tokens and forbid the token that stood there; where every
        token is forbidden, one position further."""
        while True:
            token = self.ids[position]
            del self.ids[position:], self.ends[position:], self.split[position:]
            self.text = self.text[:self.ends[-1] if self.ends else 0]
            self.forbidden = {i: tokens for i, tokens in self.forbidden.items() if i <= position}
            self.forbidden.setdefault(position, set()).add(token)
            if len(self.forbidden[position]) < self.rules.vocab_size:
                return
            if position == 0:
                raise SelfspecError("the banned words forbid every token at the output's first position")
            position -= 1
