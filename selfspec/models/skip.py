"""Skip sets: which attention and MLP sublayers a draft leaves out.

A skipped sublayer becomes a module that returns zeros, so the residual stream passes through it;
a layer with both sublayers skipped is swapped for a pass-through layer. Every layer keeps its index,
so per-layer attributes (Gemma-2's sliding/global masks, cache slots) stay right. The swap lasts only
inside `skipping(...)`; outside it the model is the full model, with the same weights.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.errors import SelfspecError


@dataclass(frozen=True)
class SkipSet:
    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.attn and not self.mlp

    def fraction(self, num_layers: int) -> float:
        """Share of the 2 x num_layers sublayers that are skipped."""
        return (len(self.attn) + len(self.mlp)) / (2 * num_layers)

    def as_dict(self) -> dict:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}


def make_skip_set(attn, mlp, num_layers: int) -> SkipSet:
    """Validate layer ids (integers in [0, num_layers), no duplicates, not everything) into a SkipSet."""
    checked = {}
    for kind, ids in (("attn", attn), ("mlp", mlp)):
        ids = list(ids or [])
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise SelfspecError(f"{kind}: layer id {i!r} is not an integer; allowed: 0..{num_layers - 1}")
            if not 0 <= i < num_layers:
                raise SelfspecError(f"{kind}: layer id {i} is out of range; allowed: 0..{num_layers - 1}")
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise SelfspecError(f"{kind}: layer ids {duplicates} appear more than once")
        checked[kind] = tuple(sorted(ids))
    if len(checked["attn"]) == len(checked["mlp"]) == num_layers:
        raise SelfspecError(f"skip set skips all {2 * num_layers} sublayers; keep at least one")
    return SkipSet(**checked)


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
