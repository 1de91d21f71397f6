"""Skip sets from settings: inline `{attn, mlp}` lists, or a YAML file written by the search (which may also
name the draft vocabulary size it was searched with, `draft_vocab_size`). Errors name the settings field
(`attn`, `path`, ...); the caller prefixes its config key (`skip.`, `searched_skip.`)."""

from pathlib import Path

import yaml

from selfspec.errors import SelfspecError
from selfspec.settings import SkipSet, SkipSettings, make_skip_set


def resolve_skip(skip: SkipSettings, num_layers: int) -> tuple[SkipSet, int | None]:
    """(skip set, draft vocabulary size or None): inline lists, or the file at `skip.path` (its own
    draft_vocab_size unless the settings give one)."""
    if not skip.path:
        return make_skip_set(skip.attn, skip.mlp, num_layers), skip.draft_vocab_size
    data = _read(skip.path)
    return _file_skip_set(data, skip.path, num_layers), skip.draft_vocab_size or data.get("draft_vocab_size")


def _read(path: str | Path) -> dict:
    path = Path(path).expanduser()
    if not path.is_file():
        raise SelfspecError(f"path={str(path)!r} does not exist; give a best_skip.yaml written by the search")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        raise SelfspecError(f"path={str(path)!r} is not valid YAML"
                            + (f" (line {where.line + 1})" if where else "") + "; give a best_skip.yaml") from None
    if not isinstance(data, dict):
        raise SelfspecError(f"path={str(path)!r} holds no mapping; give a best_skip.yaml with attn and mlp lists")
    return data


def _file_skip_set(data: dict, path: str, num_layers: int) -> SkipSet:
    if not isinstance(data.get("attn"), list) or not isinstance(data.get("mlp"), list):
        raise SelfspecError(f"path={path!r}: the file has no 'attn'/'mlp' lists")
    searched_layers = data.get("num_layers", num_layers)
    if searched_layers != num_layers:
        raise SelfspecError(f"path={path!r} was searched on {data.get('model', 'a model')} with "
                            f"{searched_layers} layers; this model has {num_layers}")
    return make_skip_set(data["attn"], data["mlp"], num_layers)


def write_skip_file(path: str | Path, skip: SkipSet, num_layers: int, model: str, metrics: dict,
                    vocab_size: int | None = None) -> None:
    """Write a skip set as YAML loadable by `skip=file skip.path=<path>` (and `searched_skip.path=<path>`)."""
    data = {**skip.as_dict(), **({"draft_vocab_size": vocab_size} if vocab_size else {}), "num_layers": num_layers,
            "model": model, "metrics": metrics}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
