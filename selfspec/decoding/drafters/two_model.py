"""Classic speculative decoding: a separate, smaller model sharing the target's tokenizer, with its own cache."""

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, ExitPolicyDrafter, GenerationContext
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.errors import SelfspecError
from selfspec.models.cache import forward, new_cache


class ModelDrafter(ExitPolicyDrafter):
    def __init__(self, model, exit_policy: DraftExit):
        super().__init__(exit_policy)
        self.model = model
        self.cached_tokens: list[int] = []  # what the draft model's own cache holds

    def begin(self, context: GenerationContext) -> None:
        super().begin(context)
        self.cache, self.cached_tokens = new_cache(self.model, context.cache.max_len), []

    def next_logits(self, ids: list[int], start: int):
        return forward(self.model, self.cache, ids, start, last_only=True)[-1]  # (vocab,)

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        cached = _common_prefix(self.cached_tokens, tokens, limit=len(tokens) - 1)
        draft = self.draft_loop(self.next_logits, tokens, cached, max_tokens)
        if draft.tokens:  # an empty draft ran nothing
            self.cached_tokens = tokens + draft.tokens[:-1]
        return draft


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


def build_two_model(inputs: StrategyInputs) -> ModelDrafter:
    if inputs.draft_model is None:
        raise SelfspecError("strategy two_model needs a draft model: set draft_model=<option>, "
                            "e.g. draft_model=tiny_llama")
    return ModelDrafter(inputs.draft_model, inputs.unpriced_exit_policy("two_model"))


STRATEGIES = (
    StrategySpec("two_model", "classic speculative decoding: a separate, smaller draft model (draft_model)",
                 build_two_model),
)
