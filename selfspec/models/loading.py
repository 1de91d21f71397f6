"""Load a model and its tokenizer from a `model` config: embedded GGUF models, checkpoint folders and hub ids, GGUF
files (found or converted by models/checkpoints.py), tiny models; placed on a device or by a device map, checked
against the layout registry, linears packed.
"""

import sys
from dataclasses import dataclass

import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory, get_max_memory
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from selfspec.errors import SelfspecError
from selfspec.models.checkpoints import checkpoint_folder
from selfspec.models.layouts import decoder_layers
from selfspec.models.grouped_attention import use_grouped_attention
from selfspec.models.packed_linear import pack_linears, pack_output_layer
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.settings import DEVICE_MAP_PLANS, ModelSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel  # eval mode, in settings.dtype, on settings.device (or placed by settings.device_map)
    tokenizer: PreTrainedTokenizerBase
    end_ids: tuple[int, ...]  # every id that ends a turn (model_end_ids): generation stops after any of them


def load_model(settings: ModelSettings) -> LoadedModel:
    """Build the model `settings` describe. Attention is transformers' default (Gemma-2 gets eager: no sdpa there),
    sdpa with grouped heads read in the kernel (models/grouped_attention.py). With `settings.device_map`, accelerate
    places it (hooks move activations between devices); else it all goes to `settings.device`. With
    `settings.packed_linears`, a float32 model on the CPU gets its decoder linears and output layer packed for oneDNN
    (models/packed_linear.py)."""
    dtype, device_map = DTYPES[settings.dtype], settings.device_map
    device = _device(("cuda" if torch.cuda.is_available() else "cpu") if settings.device == "auto" else settings.device)
    _check_map_devices(device_map)
    if settings.source == "tiny":
        model = tiny_model(settings.family, settings.num_layers, settings.hidden_size, settings.sliding_window,
                           settings.seed or 0)
        model, tokenizer = model.to(dtype), byte_tokenizer()
        if device_map is not None:  # built in memory: place it as from_pretrained places a checkpoint
            model = dispatch(model, device_map, settings.offload_folder)
    else:
        folder = checkpoint_folder(settings)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, device_map=device_map,
                                                     offload_folder=settings.offload_folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    decoder_layers(model)  # an unsupported layout ends here, not inside a forward
    if device_map is None:
        model = model.to(device)
        if settings.device == "auto" and device.type == "cpu":
            _note_cpu(settings.name, model)
    use_grouped_attention(model)
    if settings.packed_linears:
        pack_linears(model)
        pack_output_layer(model)
    return LoadedModel(name=settings.name, model=model.eval(), tokenizer=tokenizer,
                       end_ids=model_end_ids(model, tokenizer))


def dispatch(model, device_map, offload_folder: str | None = None):
    """`model` (in memory) placed by `device_map` (checked by settings.check_device_map): a plan accelerate computes
    from free memory (auto, balanced, ...), one device, or a {module name: device or "disk"} dict."""
    no_split = model._no_split_modules  # a decoder layer stays whole on one device
    if device_map in DEVICE_MAP_PLANS:
        memory = (get_max_memory() if device_map == "sequential" else
                  get_balanced_memory(model, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0"))
        device_map = infer_auto_device_map(model, memory, no_split_module_classes=no_split)
    elif not isinstance(device_map, dict):
        device_map = {"": device_map}
    if "disk" in device_map.values() and offload_folder is None:
        raise SelfspecError(f"model.device_map puts {[m for m, d in device_map.items() if d == 'disk']} on disk; "
                            f"set model.offload_folder=/dir for them")
    try:
        model = dispatch_model(model, device_map, offload_dir=offload_folder)
    except ValueError as error:  # e.g. a module name the model does not have, or a module left out
        raise SelfspecError(f"model.device_map={device_map!r}: {str(error).splitlines()[0]}") from None
    model.hf_device_map = device_map
    return model


def model_end_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's `generation_config.eos_token_id` (an id or a list: Gemma's instruct models end a turn with
    <end_of_turn>, Llama-3's with <|eot_id|>), then the tokenizer's EOS, without repeats."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    return tuple(dict.fromkeys(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None))


def _note_cpu(name: str, model) -> None:
    """model.device=auto found no CUDA: say what that costs, since a large checkpoint on the CPU is slow, not broken."""
    parameters = sum(p.numel() for p in model.parameters())
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
    print(f"selfspec: note: no CUDA here, so {name} ({parameters / 1e9:.2f}B parameters, {gib:.1f} GiB in "
          f"{model.dtype}) runs on the CPU, where each step reads every weight: a 9B model takes seconds per token "
          f"and ~18 GiB of memory in bfloat16", file=sys.stderr)


def _device(name: str | int, key: str = "model.device") -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SelfspecError(f"{key}={name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SelfspecError(f"{key}={name!r} but CUDA is not available here; use cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SelfspecError(f"{key}={name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def _check_map_devices(device_map) -> None:
    """Every device a device map names exists here (settings.check_device_map checked its form)."""
    if device_map is None or device_map in DEVICE_MAP_PLANS:
        return
    for device in device_map.values() if isinstance(device_map, dict) else [device_map]:
        if device != "disk":
            _device(device, "model.device_map")
