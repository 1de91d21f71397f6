"""A feature-level draft head (EAGLE, Li et al., 2024) made of the model's own parts plus one trained layer.

The full model's final normed hidden state h_t (the feature its output layer scores) and the embedding of the next
token x_{t+1} are fused by one linear map and run through one decoder layer of the model's family (a copy of its
last layer and final norm to start from), which predicts h_{t+1}; the model's own output layer (or the reduced
draft vocabulary) turns it into the draft's next-token distribution. Drafting further feeds the head its own
predicted feature. The head keeps a one-layer KV cache of its own; training: training/train_draft.py.

With `fused_layers` (EAGLE-3, Li et al., 2025) the head also reads the model's states after those many layers at t,
each scaled to unit root mean square (`inner_states`), through a second linear map added to the first: the
middle layers hold what the final state, shaped to score the next token alone, has let go of. They exist only
where the full model ran, so a draft's first token reads them and the later ones, drafted on the head's own
predictions, do without.
"""

import sys
from weakref import WeakKeyDictionary

import torch
from torch import nn

from selfspec.errors import SelfspecError
from selfspec.models.cache import RewindableCache
from selfspec.models.devices import execution_device
from selfspec.models.layouts import final_norm, num_layers
from selfspec.models.packed_linear import pack_module
from selfspec.models.trained_parts import SHIPPED, one_layer_model, read_part, save_part, shipped_path

KIND = "feature"
TRAIN_HINT = "train one with python run.py experiment=train_draft trained_draft=feature"


class FeatureHead(nn.Module):
    def __init__(self, body: nn.Module, hidden_size: int, fused_layers: tuple[int, ...] = ()):
        super().__init__()
        self.fuse = nn.Linear(2 * hidden_size, hidden_size, bias=False)  # [embedding of x_{t+1}, h_t] -> layer input
        self.fused_layers = tuple(fused_layers)
        self.fuse_inner = nn.Linear(len(fused_layers) * hidden_size, hidden_size, bias=False) if fused_layers \
            else None  # the states after fused_layers layers -> added to the layer input
        self.body = body  # one decoder layer and its final norm, fed inputs_embeds

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                cache: RewindableCache | None = None, attention_mask: torch.Tensor | None = None,
                inner: torch.Tensor | None = None) -> torch.Tensor:
        """features h_t and embeds e(x_{t+1}), each (batch, q, hidden), at positions t (batch, q) -> the predicted
        h_{t+1} (batch, q, hidden), normed as the model's final hidden states are. With `cache`, over it. `inner`
        (batch, q, len(fused_layers) x hidden): `inner_states` at t, read where given (a head with fused layers)."""
        fused = self.fuse(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))  # (batch, q, hidden)
        if inner is not None and self.fuse_inner is not None:
            fused = fused + self.fuse_inner(inner.to(embeds.dtype))
        out = self.body(inputs_embeds=fused, position_ids=position_ids, past_key_values=cache,
                        use_cache=cache is not None, attention_mask=attention_mask)
        return out.last_hidden_state


def inner_states(states: list[torch.Tensor]) -> torch.Tensor:
    """The model's states after a head's fused layers, (..., hidden) each -> (..., n x hidden), each scaled to unit
    root mean square (their scale grows with depth; the fuse learns a scale of its own)."""
    return torch.cat([state * torch.rsqrt(state.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(state.dtype)
                      for state in states], dim=-1)


def check_fused_layers(fused_layers: tuple[int, ...], layers: int) -> int:
    """Refuse in one line a fused layer outside 1..layers-1 (the states after that many layers); returns layers - 1,
    the index of the last layer, which the head copies."""
    for layer in fused_layers:
        if not 1 <= layer < layers:
            raise SelfspecError(f"trained_draft.fused_layers={list(fused_layers)}: {layer} is out of range; allowed: "
                                f"1..{layers - 1} (layers before the state)")
    return layers - 1


def new_feature_head(model, fused_layers: tuple[int, ...] = ()) -> FeatureHead:
    """An untrained head for `model`, its layer a copy of the model's last one, in the model's dtype on the device
    of the model's last layer (whose output it reads); reading the states after `fused_layers` layers too."""
    last = check_fused_layers(fused_layers, num_layers(model))
    head = FeatureHead(one_layer_model(model, last, "a feature head"), model.config.get_text_config().hidden_size,
                       fused_layers)
    return head.to(device=execution_device(final_norm(model)), dtype=model.dtype)


def save_feature_head(path, head: FeatureHead, model, **info) -> None:
    save_part(path, KIND, head, model, fused_layers=list(head.fused_layers), **info)


def load_feature_head(path, model, setting: str = "draft.head") -> FeatureHead:
    """The head at `path` (a head.pt, or `shipped`: the package's head for this model), trained for `model`, ready
    to draft: in inference mode, its linears packed where the model's are."""
    saved = read_part(path, model, KIND, setting, TRAIN_HINT)
    head = new_feature_head(model, tuple(saved.get("fused_layers", ())))
    head.load_state_dict({k: v.to(model.dtype) for k, v in saved["state_dict"].items()})
    head.requires_grad_(False).eval()
    pack_module(head, model)
    return head


_LOADED: WeakKeyDictionary = WeakKeyDictionary()  # model -> {path: its head}, shared by the strategies of a run


def loaded_feature_head(model, path: str | None) -> FeatureHead | None:
    """`load_feature_head` once per model and path (None: no head). `shipped` where none ships for this model (a
    checkpoint of your own under an embedded model's config) gives None after one warning: the layer-skip draft."""
    if path is None:
        return None
    heads = _LOADED.setdefault(model, {})
    if path == SHIPPED and path not in heads and shipped_path(model, KIND, "draft.head") is None:
        print("selfspec: warning: draft.head=shipped: no feature head ships for this model; drafting without one "
              "(train one: python run.py experiment=train_draft)", file=sys.stderr)
        heads[path] = None
    if path not in heads:
        heads[path] = load_feature_head(path, model)
    return heads[path]
