"""The trainable part of a Kangaroo draft: one decoder layer of the target's family on top of its first layers.

The draft reads the target's hidden state after `exit_layer` layers (the shallow state), runs it through the
adapter (a one-layer base model of the same family with its own final norm) and scores it with the target's
own frozen output layer. The adapter starts as a copy of the target's layer `exit_layer` and final norm, so an
untrained adapter is exactly "the first exit_layer + 1 layers"; training only has to improve on early exit.
"""

from pathlib import Path

import torch
from torch import nn

from selfspec.errors import SelfspecError
from selfspec.models.devices import execution_device
from selfspec.models.layouts import decoder_layers, num_layers
from selfspec.models.trained_parts import one_layer_model, read_part, save_part

KIND = "kangaroo"


def check_exit_layer(exit_layer: int | None, layers: int) -> int:
    """`kangaroo.exit_layer` as a layer count in 1..layers-1; None = half the layers (see conf/kangaroo)."""
    if exit_layer is None:
        return layers // 2
    if not 1 <= exit_layer < layers:
        raise SelfspecError(f"kangaroo.exit_layer={exit_layer!r} is out of range; allowed: 1..{layers - 1} "
                            f"(layers kept before the adapter)")
    return exit_layer


def new_adapter(model, exit_layer: int) -> nn.Module:
    """A one-layer base model of the target's family, initialised from the target's layer `exit_layer` and final
    norm, in the target's dtype, on the device its input comes from."""
    adapter = one_layer_model(model, exit_layer, "a Kangaroo adapter")
    return adapter.to(device=adapter_device(model, exit_layer), dtype=model.dtype).eval()


def adapter_device(model, exit_layer: int) -> torch.device:
    """The device of layer exit_layer - 1, whose output the adapter reads (under a device map, not model.device)."""
    return execution_device(decoder_layers(model)[exit_layer - 1])


def save_adapter(path: Path, adapter: nn.Module, model, exit_layer: int, **info) -> None:
    """Write the adapter's weights with what it was trained for (`info`: e.g. epoch, val_loss)."""
    save_part(path, KIND, adapter, model, exit_layer=exit_layer, **info)


def load_adapter(path, model, exit_layer: int | None = None) -> tuple[nn.Module, int]:
    """(adapter, exit_layer) from `kangaroo.adapter_path`; it must be trained for this model (and this exit layer
    when one is configured)."""
    saved = read_part(path, model, KIND, "kangaroo.adapter_path",
                      "train one with python run.py experiment=train_draft trained_draft=kangaroo")
    trained_exit = saved["exit_layer"]
    if exit_layer is not None:
        check_exit_layer(exit_layer, num_layers(model))
        if exit_layer != trained_exit:
            raise SelfspecError(f"kangaroo.exit_layer={exit_layer} but kangaroo.adapter_path={str(path)!r} was "
                                f"trained for exit layer {trained_exit}; set kangaroo.exit_layer=null or retrain")
    adapter = new_adapter(model, trained_exit)
    adapter.load_state_dict(saved["state_dict"])
    return adapter, trained_exit
