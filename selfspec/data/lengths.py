"""Prompts longer than the model's context: refused in one line naming the prompt, or left-truncated to
`data.max_prompt_tokens` with a warning and a count the summary carries. Past its positions a model decodes garbage
without a word, so neither happens silently."""

import sys
from dataclasses import dataclass

from selfspec.data.formats import Prompt
from selfspec.errors import SelfspecError


@dataclass(frozen=True)
class ContextRoom:
    """How many prompt tokens the model leaves room for: its positions minus the new tokens and the longest draft
    (None: the model's config states no position limit)."""
    max_positions: int | None
    max_new_tokens: int
    draft_tokens: int

    @property
    def tokens(self) -> int | None:
        if self.max_positions is None:
            return None
        return self.max_positions - self.max_new_tokens - self.draft_tokens

    def __str__(self) -> str:
        return (f"{self.tokens} = max_position_embeddings {self.max_positions} - sampling.max_new_tokens "
                f"{self.max_new_tokens} - draft.max_tokens {self.draft_tokens}")


@dataclass
class FittedPrompts:
    ids: list[list[int]]  # each (n_tokens,), at most the room (or data.max_prompt_tokens)
    truncated: int  # prompts that were left-truncated


def context_room(model, max_new_tokens: int, draft_tokens: int) -> ContextRoom:
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return ContextRoom(positions, max_new_tokens, draft_tokens)


def fit_prompts(prompts: list[Prompt], prompt_ids: list[list[int]], room: ContextRoom,
                max_prompt_tokens: int | None = None) -> FittedPrompts:
    """Keep each prompt's last `max_prompt_tokens` tokens (when set); a prompt still longer than the room is a
    SelfspecError naming its id and length."""
    if room.tokens is not None and room.tokens < 1:
        raise SelfspecError(f"the model leaves no room for a prompt: {room}; lower sampling.max_new_tokens")
    if max_prompt_tokens is not None and room.tokens is not None and max_prompt_tokens > room.tokens:
        raise SelfspecError(f"data.max_prompt_tokens={max_prompt_tokens} is more than the model leaves room for "
                            f"({room}); set it to at most {room.tokens}")
    fitted, truncated = [], 0
    for prompt, ids in zip(prompts, prompt_ids):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids, truncated = ids[-max_prompt_tokens:], truncated + 1  # the end of a prompt is what is answered
        if room.tokens is not None and len(ids) > room.tokens:
            raise SelfspecError(f"prompt {prompt.question_id!r} is {len(ids)} tokens, longer than the model leaves "
                                f"room for ({room}); shorten it, or set data.max_prompt_tokens=N to left-truncate")
        fitted.append(ids)
    if truncated:
        print(f"selfspec: warning: {truncated} of {len(prompts)} prompts were longer than data.max_prompt_tokens="
              f"{max_prompt_tokens} and lost their first tokens (left-truncated)", file=sys.stderr)
    return FittedPrompts(fitted, truncated)


def with_truncated_count(summary: dict, truncated: int) -> dict:
    """`summary` (per strategy) with `truncated_prompts`: how many of its prompts were left-truncated."""
    for row in summary.values():
        row["truncated_prompts"] = truncated
    return summary
