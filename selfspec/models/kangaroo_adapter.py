"""The trainable part of a Kangaroo draft: one decoder layer of the target's family on top of its first layers.

The draft reads the target's hidden state after `exit_layer` layers (the shallow state), runs it through the
adapter (a one-layer base model of the same family with its own final norm) and scores it with the target's
own frozen output layer. The adapter starts as a copy of the target's layer `exit_layer` and final norm, so an
untrained adapter is exactly "the first exit_layer + 1 layers"; training only has to improve on early exit.
"""

import copy
import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from selfspec.errors import SelfspecError
from selfspec.models.devices import execution_device, loaded_weights
from selfspec.models.skip import decoder_layers, num_layers


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
    norm, in the target's dtype, on the device its input comes from. It has no embedding: it is only ever fed
    `inputs_embeds`."""
    config = copy.deepcopy(model.config.get_text_config())
    config.num_hidden_layers, config.vocab_size, config.pad_token_id = 1, 1, None
    if getattr(config, "layer_types", None):  # Gemma: keep the copied layer's sliding/global attention and rope
        config.layer_types = [config.layer_types[exit_layer]]
    adapter = AutoModel.from_config(config)
    adapter.embed_tokens = None  # (a one-row vocabulary above keeps the model from allocating a real one)
    with loaded_weights(decoder_layers(model)[exit_layer]) as layer, loaded_weights(model.model.norm) as norm:
        adapter.layers[0].load_state_dict(layer.state_dict())
        adapter.norm.load_state_dict(norm.state_dict())
    return adapter.to(device=adapter_device(model, exit_layer), dtype=model.dtype).eval()


def adapter_device(model, exit_layer: int) -> torch.device:
    """The device of layer exit_layer - 1, whose output the adapter reads (under a device map, not model.device)."""
    return execution_device(decoder_layers(model)[exit_layer - 1])


def model_signature(model) -> dict:
    """What an adapter must match: family, sizes and a hash of a few output-layer rows (rounded to bfloat16, so
    the same weights loaded in another dtype still match)."""
    config = model.config.get_text_config()
    with loaded_weights(model.get_output_embeddings()) as head:
        rows = head.weight[:16].detach().to(torch.bfloat16).float().cpu()
    return {"model_type": config.model_type, "num_layers": num_layers(model), "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "weights": hashlib.sha1(rows.numpy().tobytes()).hexdigest()[:16]}


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: a killed process never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_adapter(path: Path, adapter: nn.Module, model, exit_layer: int, **info) -> None:
    """Write the adapter's weights with what it was trained for (`info`: e.g. epoch, val_loss)."""
    save_atomic({"state_dict": adapter.state_dict(), "exit_layer": exit_layer, "model": model_signature(model),
                 **info}, path)


def load_adapter(path, model, exit_layer: int | None = None) -> tuple[nn.Module, int]:
    """(adapter, exit_layer) from `kangaroo.adapter_path`; it must be trained for this model (and this exit layer
    when one is configured)."""
    if path is None:
        raise SelfspecError("strategy kangaroo needs kangaroo.adapter_path=<adapter.pt>; "
                            "train one with python run.py experiment=kangaroo_train")
    file = Path(path).expanduser()
    if not file.is_file():
        raise SelfspecError(f"kangaroo.adapter_path={str(path)!r} does not exist; "
                            f"train one with python run.py experiment=kangaroo_train")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)  # load_state_dict moves it
        state, trained_for, trained_exit = saved["state_dict"], saved["model"], saved["exit_layer"]
    except Exception as error:  # any unreadable file: torch's own messages span many lines
        raise SelfspecError(f"kangaroo.adapter_path={str(path)!r} is not a Kangaroo adapter file "
                            f"({type(error).__name__})") from None
    if exit_layer is not None:
        check_exit_layer(exit_layer, num_layers(model))
    signature = model_signature(model)
    if trained_for != signature:
        raise SelfspecError(f"kangaroo.adapter_path={str(path)!r} was trained for another model "
                            f"({_describe(trained_for)}), not this {_describe(signature)}")
    if exit_layer is not None and exit_layer != trained_exit:
        raise SelfspecError(f"kangaroo.exit_layer={exit_layer} but kangaroo.adapter_path={str(path)!r} was "
                            f"trained for exit layer {trained_exit}; set kangaroo.exit_layer=null or retrain")
    adapter = new_adapter(model, trained_exit)
    adapter.load_state_dict(state)
    return adapter, trained_exit


def _describe(signature: dict) -> str:
    return (f"{signature['model_type']}, {signature['num_layers']} layers, hidden {signature['hidden_size']}, "
            f"vocab {signature['vocab_size']}, weights {signature['weights']}")
