"""What the decoding functions take as a prompt: the token ids of one prompt (batch size 1)."""

import operator

import torch

from selfspec.errors import SelfspecError


def single_prompt(prompt) -> list[int]:
    """`prompt` as a list of ints, shape (n_tokens,): a list of ints, a (n,) tensor, or a batch of one ((1, n)
    tensor or [[...]]). A batch of several prompts, an empty prompt or a non-integer id is a SelfspecError."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(row, (list, tuple)) for row in prompt):
        if len(prompt) != 1:  # speculative steps accept a different number of tokens per row: batch size 1 only
            raise SelfspecError(f"a batch of {len(prompt)} prompts was given; decoding takes one prompt at a time "
                                f"(batch size 1): call it once per prompt")
        prompt = prompt[0]
    if not isinstance(prompt, (list, tuple)):
        raise SelfspecError(f"a prompt is a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise SelfspecError("empty prompt: it must hold at least one token")
    try:
        return [operator.index(token) for token in prompt]
    except TypeError:
        bad = next(token for token in prompt if not hasattr(token, "__index__"))
        raise SelfspecError(f"a prompt is a list of token ids; {bad!r} is not an integer") from None
