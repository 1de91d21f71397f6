"""The full model's layer states during a verification forward, captured by forward hooks on the decoder layers.

The hooks are armed only between a draft and its verification (the skipped draft forwards run before arming), so
only the full model's forward is captured, and no other forward pays for them."""

from dataclasses import dataclass

import torch

from selfspec.models.layouts import decoder_layers, sublayer_modules


@dataclass
class LayerStates:
    """The full model's states at one token: layer boundaries and what each sublayer added."""
    hidden: torch.Tensor  # (layers + 1, hidden): hidden[0] enters layer 0, hidden[i + 1] leaves layer i
    attn: torch.Tensor  # (layers, hidden): each attention sublayer's output
    mlp: torch.Tensor  # (layers, hidden): each MLP sublayer's output


def _first(value) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


class StateCapture:
    """Hooks that keep the last full forward's layer inputs, outputs and sublayer outputs, all rows."""

    def __init__(self, model):
        self.model = model
        self.handles = []
        self.seen: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> (rows, hidden)

    def arm(self) -> None:
        """Capture the next full forward (idempotent)."""
        if self.handles:
            return
        self.seen = {}
        for i, layer in enumerate(decoder_layers(self.model)):
            self.handles.append(layer.register_forward_hook(self._keep_layer(i), with_kwargs=True))
            for kind in ("attn", "mlp"):
                module = sublayer_modules(self.model, layer, kind)[-1]
                self.handles.append(module.register_forward_hook(self._keep(kind, i)))

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _keep_layer(self, i: int):
        def hook(module, args, kwargs, output):
            entering = args[0] if args else kwargs["hidden_states"]
            self.seen["in", i] = entering.detach().reshape(-1, entering.shape[-1])  # (rows, hidden)
            self.seen["out", i] = _first(output).detach().reshape(-1, entering.shape[-1])
        return hook

    def _keep(self, kind: str, i: int):
        def hook(module, args, output):
            value = _first(output).detach()
            self.seen[kind, i] = value.reshape(-1, value.shape[-1])  # (rows, hidden)
        return hook

    def states(self, row: int) -> LayerStates | None:
        """The captured forward's states at `row` (None: nothing complete was captured there)."""
        layers = len(decoder_layers(self.model))
        keys = [(kind, i) for i in range(layers) for kind in ("in", "out", "attn", "mlp")]
        if any(key not in self.seen or self.seen[key].shape[0] <= row for key in keys):
            return None
        pick = lambda kind, i: self.seen[kind, i][row].float().cpu()  # (hidden,)
        hidden = torch.stack([pick("in", 0)] + [pick("out", i) for i in range(layers)])
        return LayerStates(hidden, torch.stack([pick("attn", i) for i in range(layers)]),
                           torch.stack([pick("mlp", i) for i in range(layers)]))
