"""Skip sets: which attention and MLP sublayers a draft leaves out.

A skipped sublayer becomes a module that contributes zeros, so the residual stream passes by it, in sequential and
parallel-residual layers alike (x + attn(x) + mlp(x) loses just that term). Where a layout's MLP is several modules
called in the layer (OPT's fc1, fc2), every one but the last passes its input on and the last returns zeros. A layer
with both sublayers skipped is swapped for a pass-through layer where its layout allows (models/layouts.py). Every
layer keeps its index, so per-layer attributes (Gemma-2's sliding/global masks, cache slots) stay right. The swap
lasts only inside `skipping(...)`; outside it the model is the full model, with the same weights.
"""

from contextlib import contextmanager

import torch
from torch import nn

from selfspec.models.layouts import decoder_layers, layout_of
from selfspec.settings import SkipSet


class SkippedAttention(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None  # (output, attention weights), as every attention returns


class SkippedMLP(nn.Module):
    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


class PassedOn(nn.Module):
    """An inner module of a skipped MLP (OPT's fc1): hands its input to the next, which returns zeros."""

    def forward(self, hidden_states):
        return hidden_states


class SkippedLayer(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class SkippedTupleLayer(nn.Module):
    """A skipped layer of a layout whose layers return (hidden, attention weights) (Falcon)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states, None


_SKIPPED_ATTENTION, _SKIPPED_MLP, _PASSED_ON = SkippedAttention(), SkippedMLP(), PassedOn()
_SKIPPED_LAYER, _SKIPPED_TUPLE_LAYER = SkippedLayer(), SkippedTupleLayer()


@contextmanager
def skipping(model, skip: SkipSet):
    """Inside the block, `model` runs with the sublayers in `skip` contributing nothing."""
    layout, layers = layout_of(model), decoder_layers(model)
    whole = set(skip.attn) & set(skip.mlp) if layout.whole_layer_skip(model.config.get_text_config()) else set()
    skipped_layer = _SKIPPED_TUPLE_LAYER if layout.layer_returns_tuple else _SKIPPED_LAYER
    last = len(layout.mlp) - 1
    swaps = [(i, layout.attention, _SKIPPED_ATTENTION) for i in skip.attn if i not in whole]
    swaps += [(i, name, _SKIPPED_MLP if j == last else _PASSED_ON)
              for i in skip.mlp if i not in whole for j, name in enumerate(layout.mlp)]
    saved_layers = {i: layers[i] for i in whole}
    saved = [(i, name, getattr(layers[i], name)) for i, name, _ in swaps]
    try:
        for i in saved_layers:
            layers[i] = skipped_layer
        for i, name, replacement in swaps:
            setattr(layers[i], name, replacement)
        yield model
    finally:
        for i, layer in saved_layers.items():
            layers[i] = layer
        for i, name, module in saved:
            setattr(layers[i], name, module)
