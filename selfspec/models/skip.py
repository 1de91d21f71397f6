"""Skip sets: which attention and MLP sublayers a draft leaves out.

A skipped sublayer becomes a module that returns zeros, so the residual stream passes through it;
a layer with both sublayers skipped is swapped for a pass-through layer. Every layer keeps its index,
so per-layer attributes (Gemma-2's sliding/global masks, cache slots) stay right. The swap lasts only
inside `skipping(...)`; outside it the model is the full model, with the same weights.
"""

from contextlib import contextmanager

import torch
from torch import nn

from selfspec.errors import SelfspecError
from selfspec.settings import SkipSet


SUPPORTED_FAMILIES = "Llama, Gemma-2, Gemma-3 (text) and others laid out as model.model.layers[i].self_attn / .mlp"


def decoder_layers(model) -> nn.ModuleList:
    """model.model.layers; SelfspecError naming the supported families for a model laid out otherwise."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
            isinstance(layer, SkippedLayer) or (hasattr(layer, "self_attn") and hasattr(layer, "mlp"))
            for layer in layers):
        config = getattr(model, "config", None)
        raise SelfspecError(f"model {type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) has "
                            f"no model.model.layers[i].self_attn / .mlp, which layer skipping and our decoding need; "
                            f"supported: {SUPPORTED_FAMILIES}")
    return layers


def num_layers(model) -> int:
    return len(decoder_layers(model))


class SkippedAttention(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class SkippedMLP(nn.Module):
    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


class SkippedLayer(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


_SKIPPED_ATTENTION, _SKIPPED_MLP, _SKIPPED_LAYER = SkippedAttention(), SkippedMLP(), SkippedLayer()


@contextmanager
def skipping(model, skip: SkipSet):
    """Inside the block, `model` runs with the sublayers in `skip` acting as identity."""
    layers = decoder_layers(model)
    whole = set(skip.attn) & set(skip.mlp)
    saved_layers = {i: layers[i] for i in whole}
    saved_attn = {i: layers[i].self_attn for i in skip.attn if i not in whole}
    saved_mlp = {i: layers[i].mlp for i in skip.mlp if i not in whole}
    try:
        for i in saved_layers:
            layers[i] = _SKIPPED_LAYER
        for i in saved_attn:
            layers[i].self_attn = _SKIPPED_ATTENTION
        for i in saved_mlp:
            layers[i].mlp = _SKIPPED_MLP
        yield model
    finally:
        for i, layer in saved_layers.items():
            layers[i] = layer
        for i, attn in saved_attn.items():
            layers[i].self_attn = attn
        for i, mlp in saved_mlp.items():
            layers[i].mlp = mlp
