"""The feature-level draft head (models/feature_head.py) as a token source: chains and trees draft from it as from
the layer-skipped model.

The head reads the full model's final hidden state at every kept position. A forward hook on the model's base keeps
each forward's final hidden states at their cache indices (the prefill's and every verification's, a tree's nodes
included); the cache follows them (`RewindableCache.follow`), so index i always holds the state of the token kept at
position i. A draft first runs the head over the kept positions it has not seen, whose last prediction gives the
first draft token; each further token costs one head step on its own prediction. A head with fused layers also keeps
the states after those layers (`inner`), for the catch-up alone.
"""

from contextlib import contextmanager

import torch

from selfspec.decoding.costs import CONTEXT, timed_ms
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters.base import ChainDrafter, GenerationContext
from selfspec.decoding.drafters.layer_skip import build_self_spec
from selfspec.decoding.registry import StrategyInputs, StrategySpec
from selfspec.models.cache import RewindableCache
from selfspec.models.devices import execution_device, input_device, output_device
from selfspec.models.draft_vocabulary import DraftVocabulary
from selfspec.models.feature_head import FeatureHead, inner_states
from selfspec.models.layouts import base_model, decoder_layers
from selfspec.models.output_layer import model_logits


class HeadFeatures:
    """A feature head as a token source, and one generation's state of it: the full model's final hidden states by
    cache index, the head's own one-layer cache, how far it holds verified inputs, and its last predicted feature."""

    def __init__(self, model, head: FeatureHead, vocab_head: DraftVocabulary | None = None):
        self.model, self.head, self.vocab_head = model, head, vocab_head
        self.hooks, self.cache, self.features, self.inner = [], None, None, None
        self.layer_states: dict[int, torch.Tensor] = {}  # fused layer -> this forward's states after it

    def begin(self, context: GenerationContext) -> None:
        self.stop()
        self.cache, self.tokens = context.cache, []
        self.head_cache = RewindableCache(1, self.cache.max_len)
        self.seen = 0  # head positions 0..seen-1 ran on verified features and kept tokens
        base, layers = base_model(self.model), decoder_layers(self.model)
        self.hooks = [base.register_forward_hook(self._keep, with_kwargs=True)]
        if self.head.fused_layers:
            self.hooks += [base.register_forward_pre_hook(lambda *_: self.layer_states.clear())]
            self.hooks += [layers[n - 1].register_forward_hook(self._layer_hook(n)) for n in self.head.fused_layers]

    def stop(self) -> None:
        """Remove the hooks and let go of the generation's cache (the hook does this itself once a forward over
        another cache runs)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.cache, self.features, self.inner = [], None, None, None

    def _layer_hook(self, layer: int):
        def keep_layer(module, args, output) -> None:
            self.layer_states[layer] = output[0] if isinstance(output, tuple) else output  # (batch, q, hidden)
        return keep_layer

    def _keep(self, base, args, kwargs, output) -> None:
        """Copy the forward's final hidden states (1, q, hidden) of our tokens to the cache indices their K/V went to."""
        cache = kwargs.get("past_key_values")
        if not self.cache.in_use(cache):
            if cache is not None:  # our generation has ended: another one runs (a forward without a cache: none)
                self.stop()
            return
        written = self.cache.written_at(cache, output.last_hidden_state.shape[1])
        if written is None:  # a batch neighbour's own forward
            return
        tokens, start = written  # the forward wrote our K/V at start..
        hidden = output.last_hidden_state[0, tokens]  # (q, hidden)
        if self.features is None:
            self.features = hidden.new_zeros(self.cache.max_len, hidden.shape[-1])  # (max_len, hidden)
            self.cache.follow(self.features)
        self.features[start:start + len(hidden)] = hidden
        if self.head.fused_layers and len(self.layer_states) == len(self.head.fused_layers):
            inner = inner_states([self.layer_states[n][0, tokens] for n in self.head.fused_layers])  # (q, n x hidden)
            if self.inner is None:
                self.inner = inner.new_zeros(self.cache.max_len, inner.shape[-1])  # (max_len, n x hidden)
                self.cache.follow(self.inner)
            self.inner[start:start + len(inner)] = inner

    @contextmanager
    def drafting(self, tokens: list[int]):
        self.tokens = tokens
        yield

    @torch.inference_mode()
    def next_logits(self, ids: list[int], start: int) -> torch.Tensor:
        """(vocab,) draft logits for the token after `ids` (at positions start..). The draft's first call (its last
        kept token) runs the head over every kept position it has not seen; later ones on its own prediction."""
        if start == len(self.tokens) - 1:  # head position j takes h_j and token j + 1: catch up to j = start - 1
            self.seen = min(self.seen, start - 1)  # a banned word's rollback may have taken back what it saw
            first, features = self.seen, self.features[self.seen:start]  # (q, hidden)
            inner = self.inner[self.seen:start][None] if self.inner is not None else None  # (1, q, n x hidden)
            ids, self.seen = self.tokens[self.seen + 1:start + 1], start
        else:
            first, features, inner = start - 1, self.predicted[None], None  # (1, hidden): unknown inner states
        device = execution_device(self.head)
        embeds = self.model.get_input_embeddings()(torch.tensor([ids], device=input_device(self.model)))
        positions = torch.arange(first, first + len(ids), device=device)[None]  # (1, q)
        self.head_cache.rewind(first)
        self.predicted = self.head(features[None].to(device), embeds.to(device), positions, self.head_cache,
                                   inner=inner.to(device) if inner is not None else None)[0, -1]
        if self.vocab_head is not None:
            return self.vocab_head.logits(self.predicted)
        return model_logits(self.model, self.predicted[None])[0]


def head_draft_ms(model, head: FeatureHead, vocab_head: DraftVocabulary | None) -> float:
    """d of the head: one head step after a CONTEXT-position head context, and its (draft) output layer."""
    features = HeadFeatures(model, head, vocab_head)
    features.head_cache, features.seen = RewindableCache(1, CONTEXT + 2), 0
    features.tokens = [5] * (CONTEXT + 1)
    hidden = model.config.get_text_config().hidden_size
    features.features = torch.zeros(CONTEXT, hidden, dtype=model.dtype, device=execution_device(head))
    if head.fused_layers:
        features.inner = features.features.new_zeros(CONTEXT, len(head.fused_layers) * hidden)
    features.next_logits([5], CONTEXT)  # the head's context: CONTEXT positions
    return timed_ms(lambda: features.next_logits([5], CONTEXT + 1), output_device(model))


def head_exit_policy(inputs: StrategyInputs, policy: str) -> DraftExit:
    """A fresh `policy`; the cost-aware one priced with the head's measured draft-token cost."""
    costs = None
    if policy == "cost":
        head, vocab_head = inputs.feature_head, inputs.draft_vocabulary
        costs = inputs.costs.costs_of(("feature_head", id(head), id(vocab_head)),
                                      lambda: head_draft_ms(inputs.model, head, vocab_head))
    return inputs.make_exit_policy(policy, costs)


def model_drafter(inputs: StrategyInputs, policy: str) -> ChainDrafter:
    """The model draft of the strategies that mix it with copies: the feature head's chain where `draft.head` is
    set, else the layer-skip draft."""
    if inputs.feature_head is None:
        return build_self_spec(inputs, policy)
    return ChainDrafter(HeadFeatures(inputs.model, inputs.feature_head, inputs.draft_vocabulary),
                        head_exit_policy(inputs, policy))


def build_self_spec_head(inputs: StrategyInputs) -> ChainDrafter:
    inputs.require_feature_head("self_spec_head")
    return model_drafter(inputs, inputs.draft.policy)


STRATEGIES = (
    StrategySpec("self_spec_head", "a trained feature-level head on the model's last hidden state drafts "
                 "(draft.head), under draft.policy", build_self_spec_head),
)
