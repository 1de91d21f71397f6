"""Multi-turn prompts as Spec-Bench evaluates them (data.turns=all): turn i is asked after every earlier user turn
and the decoding strategy's own answer to it, through the tokenizer's chat template."""

from selfspec.data.prompt_sets import Prompt, as_token_ids
from selfspec.errors import SelfspecError


def answer_text(tokenizer, token_ids: list[int]) -> str:
    """An answer as Spec-Bench keeps it for the next turn and its answer files: special tokens (EOS, end of turn)
    removed, surrounding white space stripped."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def conversation(prompt: Prompt, turn: int, answers: list[str]) -> list[dict]:
    """The chat messages that ask turn `turn`: each earlier user turn followed by its answer in `answers`."""
    messages = []
    for question, answer in zip(prompt.turns[:turn], answers, strict=True):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": prompt.turns[turn]}]


def encode_turn(tokenizer, prompt: Prompt, turn: int, answers: list[list[int]]) -> list[int]:
    """Token ids, shape (n_tokens,), that ask turn `turn` of `prompt` given the strategy's answers (token ids) to the
    turns before it; the assistant's generation prompt ends them."""
    texts = [answer_text(tokenizer, ids) for ids in answers]
    encoded = tokenizer.apply_chat_template(conversation(prompt, turn, texts), add_generation_prompt=True,
                                            tokenize=True)
    return as_token_ids(encoded)


def check_multi_turn(tokenizer, prompts: list[Prompt], model_name: str) -> None:
    """SelfspecError when a prompt has several turns but the tokenizer has no chat template to hold the conversation."""
    several = next((p for p in prompts if len(p.turns) > 1), None)
    if several is not None and not (several.chat and getattr(tokenizer, "chat_template", None)):
        raise SelfspecError(f"data.turns=all: prompt {several.question_id!r} has {len(several.turns)} turns, but "
                            f"model {model_name}'s tokenizer has no chat template to hold a conversation; "
                            f"use data.turns=first or a chat model")
