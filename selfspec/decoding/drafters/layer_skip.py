"""Draft & Verify's drafter: the target model itself with a skip set, over the target's own cache."""

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, ExitPolicyDrafter
from selfspec.models.cache import forward, forward_hidden
from selfspec.models.draft_head import DraftHead
from selfspec.models.skip import skipping
from selfspec.settings import SkipSet


class SelfDrafter(ExitPolicyDrafter):
    """The target model with `skip` sublayers left out; with a `head`, the draft scores only that reduced
    vocabulary. Draft entries land in the shared cache, where the verification overwrites them."""

    def __init__(self, model, skip: SkipSet, exit_policy: DraftExit, head: DraftHead | None = None):
        super().__init__(exit_policy)
        self.model, self.skip, self.head = model, skip, head

    def next_logits(self, ids: list[int], start: int):
        """(vocab,) logits of the last of `ids`, run at positions start.. over the shared cache."""
        cache = self.context.cache
        if self.head is None:
            return forward(self.model, cache, ids, start, last_only=True)[-1]
        return self.head.logits(forward_hidden(self.model, cache, ids, start))

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        with skipping(self.model, self.skip):
            return self.draft_loop(self.next_logits, tokens, len(tokens) - 1, max_tokens)
