"""Trained draft parts (a Kangaroo adapter, a feature-level draft head): one decoder layer built from the model's own,
and on disk: what model a part fits, written whole with its sha256 beside it (models/cache_files.py), read back with
one-line errors (a damaged file among them), and the heads that ship with the package.

A file holds the part's state dict, its `kind`, the signature of the model it was trained for and what its trainer
adds (epoch, losses, how it was made). A shipped head lies in selfspec/models/heads/ as `<name>.pt` with `<name>.json`
beside it: how it was made (command, data, commit) and the file's sha256, checked before it is loaded.
"""

import hashlib
import json
from pathlib import Path

import copy

import torch
from transformers import AutoModel

from selfspec.errors import SelfspecError
from selfspec.models.cache_files import file_sha256, refuse_damaged, replace, save_checked
from selfspec.models.devices import loaded_weights
from selfspec.models.layouts import decoder_layers, final_norm, layout_of, num_layers, require_trained_parts

SHIPPED_DIR = Path(__file__).parent / "heads"
SHIPPED = "shipped"  # the setting value that picks the shipped head of the loaded model


def one_layer_model(model, layer: int, what: str) -> torch.nn.Module:
    """A one-layer base model of the target's family, a copy of the target's layer `layer` (its attention kind and
    rope included) and final norm, in float32 on the CPU (the caller moves it). It has no embedding: it is only ever
    fed `inputs_embeds`. `what` names the part in the one-line refusal of a layout that cannot give one."""
    require_trained_parts(model, what)
    config = copy.deepcopy(model.config.get_text_config())
    config.num_hidden_layers, config.vocab_size, config.pad_token_id = 1, 1, None
    layout_of(model).as_layer(config, layer)  # e.g. Gemma's sliding or global attention, Qwen3-MoE's sparse MLP
    body = AutoModel.from_config(config)
    embedding = next(name for name, child in body.named_children() if child is body.get_input_embeddings())
    setattr(body, embedding, None)  # (a one-row vocabulary above keeps the model from allocating a real one)
    with loaded_weights(decoder_layers(model)[layer]) as source, loaded_weights(final_norm(model)) as norm:
        decoder_layers(body)[0].load_state_dict(source.state_dict())
        final_norm(body).load_state_dict(norm.state_dict())
    return body


def model_signature(model) -> dict:
    """What a trained part must match: family, sizes and a hash of a few output-layer rows (rounded to bfloat16, so
    the same weights loaded in another dtype still match)."""
    config = model.config.get_text_config()
    with loaded_weights(model.get_output_embeddings()) as head:
        rows = head.weight[:16].detach().to(torch.bfloat16).float().cpu()
    return {"model_type": config.model_type, "num_layers": num_layers(model), "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "weights": hashlib.sha1(rows.numpy().tobytes()).hexdigest()[:16]}


def describe(signature: dict) -> str:
    return (f"{signature['model_type']}, {signature['num_layers']} layers, hidden {signature['hidden_size']}, "
            f"vocab {signature['vocab_size']}, weights {signature['weights']}")


def save_part(path: Path, kind: str, module: torch.nn.Module, model, **info) -> None:
    """Write a trained part of `kind` for `model` (`info`: e.g. epoch, val_loss, exit_layer)."""
    save_checked({"kind": kind, "state_dict": module.state_dict(), "model": model_signature(model), **info}, path)


def ship_part(path: Path, name: str, shipped_dir: Path = SHIPPED_DIR) -> Path:
    """Copy the trained part at `path` into `shipped_dir` as `<name>.pt`, its weights in float16 (half the size; a
    load casts them to the model's dtype), with `<name>.json` beside it: kind, model, sha256 and what the trainer
    recorded (epoch, validation loss and agreement, command, data settings, commit). Returns the .pt path."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    saved["state_dict"] = {k: v.half() if v.is_floating_point() else v for k, v in saved["state_dict"].items()}
    out = shipped_dir / f"{name}.pt"
    digest = replace(out, lambda handle: torch.save(saved, handle))  # its sha256 goes into the .json
    info = {k: v for k, v in saved.items() if k != "state_dict"} | {"sha256": digest}
    replace(shipped_dir / f"{name}.json", lambda handle: handle.write((json.dumps(info, indent=1) + "\n").encode()))
    return out


def shipped_path(model, kind: str, setting: str) -> Path | None:
    """The shipped part of `kind` trained for `model` (found by its signature), checked against its sha256; None
    when none ships for it."""
    signature = model_signature(model)
    for info_file in sorted(SHIPPED_DIR.glob("*.json")):
        info = json.loads(info_file.read_text())
        if info["kind"] == kind and info["model"] == signature:
            path = info_file.with_suffix(".pt")
            if not path.is_file() or file_sha256(path) != info["sha256"]:
                raise SelfspecError(f"{setting}=shipped: {path} is missing or does not match its sha256 in "
                                    f"{info_file.name}; reinstall selfspec")
            return path
    return None


def read_part(path, model, kind: str, setting: str, train_hint: str) -> dict:
    """The saved dict of a `kind` part at `path` (a file, or `shipped`), refused in one line unless it is one and
    was trained for `model`."""
    if path is None:
        raise SelfspecError(f"{setting} is not set; {train_hint}")
    file = shipped_path(model, kind, setting) if path == SHIPPED else Path(path).expanduser()
    if file is None:
        raise SelfspecError(f"{setting}=shipped: no {kind} draft ships for this model ({describe(model_signature(model))})"
                            f"; {train_hint}")
    if not file.is_file():
        raise SelfspecError(f"{setting}={str(path)!r} does not exist; {train_hint}")
    refuse_damaged(file, f"{setting}={str(path)!r}", f"{train_hint}, or copy it whole with its {file.name}.sha256")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)  # load_state_dict moves it
        saved_kind, state, trained_for = saved.get("kind", "kangaroo"), saved["state_dict"], saved["model"]
    except Exception as error:  # any unreadable file: torch's own messages span many lines
        raise SelfspecError(f"{setting}={str(path)!r} is not a trained draft file ({type(error).__name__})") from None
    if saved_kind != kind:
        raise SelfspecError(f"{setting}={str(path)!r} holds a {saved_kind} draft, not a {kind} one")
    signature = model_signature(model)
    if trained_for != signature:
        raise SelfspecError(f"{setting}={str(path)!r} was trained for another model ({describe(trained_for)}), not "
                            f"this {describe(signature)}")
    return saved
