"""Skip sets from config: inline `{attn, mlp}` lists, or a YAML file written by the search (which may also
name the draft vocabulary size it was searched with, `draft_vocab_size`)."""

from pathlib import Path

import yaml

from selfspec.errors import SelfspecError
from selfspec.models.skip import SkipSet, make_skip_set


def skip_from_config(cfg, num_layers: int, group: str = "skip") -> SkipSet:
    """`cfg` has attn/mlp lists, or `path` to a file with attn, mlp and the num_layers it was searched on."""
    if cfg.get("path"):
        return load_skip_file(cfg["path"], num_layers, f"{group}.path")
    return make_skip_set(list(cfg.get("attn") or []), list(cfg.get("mlp") or []), num_layers)


def searched_from_config(cfg, num_layers: int) -> tuple[SkipSet, int | None]:
    """The `searched_skip` block: like `skip` (inline lists or `path`), plus its draft vocabulary size (inline
    `draft_vocab_size`, else the file's); returns (skip set, draft vocabulary size or None)."""
    vocab_size = cfg.get("draft_vocab_size")
    if cfg.get("path") and vocab_size is None:
        vocab_size = _read(cfg["path"], "searched_skip.path").get("draft_vocab_size")
    return skip_from_config(cfg, num_layers, "searched_skip"), vocab_size


def _read(path: str | Path, key: str) -> dict:
    path = Path(path).expanduser()
    if not path.is_file():
        raise SelfspecError(f"{key}={str(path)!r} does not exist; give a best_skip.yaml written by the search")
    return yaml.safe_load(path.read_text()) or {}


def load_skip_file(path: str | Path, num_layers: int, key: str = "skip.path") -> SkipSet:
    data = _read(path, key)
    if "attn" not in data or "mlp" not in data:
        raise SelfspecError(f"skip file {str(path)!r} has no 'attn'/'mlp' lists")
    searched_layers = data.get("num_layers", num_layers)
    if searched_layers != num_layers:
        raise SelfspecError(f"skip file {str(path)!r} was searched on {data.get('model', 'a model')} with "
                            f"{searched_layers} layers; this model has {num_layers}")
    return make_skip_set(data["attn"], data["mlp"], num_layers)


def write_skip_file(path: str | Path, skip: SkipSet, num_layers: int, model: str, metrics: dict,
                    vocab_size: int | None = None) -> None:
    """Write a skip set as YAML loadable by `skip=file skip.path=<path>` (and `searched_skip.path=<path>`)."""
    data = {**skip.as_dict(), **({"draft_vocab_size": vocab_size} if vocab_size else {}), "num_layers": num_layers,
            "model": model, "metrics": metrics}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
