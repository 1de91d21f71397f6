"""Kangaroo (Liu et al., 2024): self-speculative decoding by double early exit.

First exit: the draft runs only the target's first `exit_layer` layers (over the shared cache), then a small
trained adapter (models/kangaroo_adapter.py, with its own one-layer cache) and the target's output layer.
Second exit: drafting stops once the draft's top probability falls below the draft-exit threshold (the
`threshold` / `adaptive` policies). The full model verifies as for every drafter, so decoding stays lossless.

The adapter needs a KV entry for every position, also for tokens it never drafted (the verifier's correction
and bonus tokens). Their shallow states come from the verifying forward itself: while a generation runs, a
forward hook on layer `exit_layer - 1` copies that layer's output into a per-position buffer, and the next
draft first feeds the adapter the verified positions it has not seen. The drafter never rewrites the shared
cache below the last kept token, so the full model's entries there stay as the verifier wrote them.
"""

from functools import partial

import torch

from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import Draft, ExitPolicyDrafter, GenerationContext
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.models.cache import RewindableCache, forward_hidden
from selfspec.models.kangaroo_adapter import load_adapter
from selfspec.models.output_layer import model_logits
from selfspec.models.layouts import decoder_layers, layout_of, num_layers
from selfspec.models.skip import skipping
from selfspec.settings import make_skip_set


class KangarooDrafter(ExitPolicyDrafter):
    """The target's first `exit_layer` layers, then `adapter` (models/kangaroo_adapter.py) over its own cache."""

    def __init__(self, model, adapter, exit_layer: int, exit_policy: DraftExit):
        super().__init__(exit_policy)
        layers = num_layers(model)
        self.model, self.adapter, self.exit_layer = model, adapter, exit_layer
        self.skip = make_skip_set(range(exit_layer, layers), range(exit_layer, layers), layers)  # whole layers
        self.hook, self.cache, self.shallow = None, None, None

    def begin(self, context: GenerationContext) -> None:
        """A new generation: a fresh adapter cache, and a hook that keeps the shallow states of every forward over
        this generation's cache (the prefill's and the verifications' too)."""
        self.stop()
        super().begin(context)
        self.cache = context.cache
        self.adapter_cache = RewindableCache(1, self.cache.max_len)
        self.verified = 0  # adapter positions from the full model
        layer = decoder_layers(self.model)[self.exit_layer - 1]
        self.hook = layer.register_forward_hook(self._keep_shallow, with_kwargs=True)

    def stop(self) -> None:
        """Remove the hook and let go of the generation's cache (the hook does this itself once a forward over
        another cache runs)."""
        if self.hook is not None:
            self.hook.remove()
        self.hook, self.cache, self.shallow = None, None, None

    def _keep_shallow(self, layer, args, kwargs, output) -> None:
        """Copy layer exit_layer - 1's output (1, q, hidden) of our tokens into self.shallow at their positions."""
        layout = layout_of(self.model)
        cache = kwargs.get(layout.cache_kwarg)
        if not self.cache.in_use(cache):  # our generation has ended: another one runs
            self.stop()
            return
        if layout.layer_returns_tuple:
            output = output[0]
        written = self.cache.written_at(cache, output.shape[1])
        if written is None:  # a batch neighbour's own forward
            return
        tokens, start = written
        if self.shallow is None:
            self.shallow = output.new_zeros(self.cache.max_len, output.shape[-1])  # (max_len, hidden)
        kept = output[0, tokens]  # (q, hidden)
        self.shallow[start:start + len(kept)] = kept

    def draft(self, tokens: list[int], max_tokens: int) -> Draft:
        cache = self.cache
        # the adapter's entries from here on came from the last draft (or a banned word rolled them back): redo them
        adapted = min(self.verified, len(tokens) - 1)

        def next_logits(ids, start):
            nonlocal adapted
            forward_hidden(self.model, cache, ids, start)  # first exit; the hook keeps the shallow states
            end = start + len(ids)
            # the adapter catches up over the positions it has not seen, then reads this draft's positions
            hidden = adapter_hidden(self.adapter, self.adapter_cache, self.shallow[adapted:end], adapted)
            adapted = end
            # positions before the last token hold the prefill's or a verification's shallow states, now adapted
            self.verified = len(tokens) - 1
            return model_logits(self.model, hidden[-1:])[0]  # (vocab,)

        with torch.inference_mode():
            return self.draft_loop(next_logits, tokens, len(tokens) - 1, max_tokens,
                                   around=partial(skipping, self.model, self.skip))


@torch.inference_mode()
def adapter_hidden(adapter, cache: RewindableCache, shallow: torch.Tensor, start: int) -> torch.Tensor:
    """Run the adapter on shallow states (q, hidden) at positions start.. over its cache; return its final
    (normed) hidden states (q, hidden)."""
    cache.rewind(start)
    positions = torch.arange(start, start + len(shallow), device=shallow.device)[None]  # (1, q)
    out = adapter(inputs_embeds=shallow[None], position_ids=positions, past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0]


def build_kangaroo(inputs: StrategyInputs) -> KangarooDrafter:
    settings = inputs.kangaroo
    adapter, exit_layer = load_adapter(settings and settings.adapter_path, inputs.model,
                                       settings and settings.exit_layer)
    return KangarooDrafter(inputs.model, adapter, exit_layer, inputs.unpriced_exit_policy("kangaroo"))


STRATEGIES = (
    StrategySpec("kangaroo", "Kangaroo: the model's first layers and a trained adapter draft (kangaroo.adapter_path)",
                 build_kangaroo),
)
