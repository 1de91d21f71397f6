"""From config nodes to typed dataclasses (`typed`), the range checks the dataclasses run, and `named`, which puts
the config key in front of a core module's error; CONF, where the config's YAML files are."""

import difflib
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from selfspec.errors import SelfspecError

CONF = Path(__file__).resolve().parents[1] / "conf"  # the YAML files (selfspec/conf: a link to the checkout's conf/)
T = TypeVar("T")


def one_of(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise SelfspecError(f"{key}={value!r} is unknown; allowed: {', '.join(map(str, allowed))}")


def at_least(key: str, value, low, what: str = "") -> None:
    if value is not None and value < low:
        raise SelfspecError(f"{key}={value!r} must be >= {low}{what}")


def in_unit(key: str, value) -> None:
    if value is not None and not 0 <= value <= 1:
        raise SelfspecError(f"{key}={value!r} is outside [0, 1]")


def typed(cls: type[T], values, key: str) -> T:
    """`values` (a config node or dict) as a `cls` instance; a wrong type, an unknown key, a missing value or a
    value out of range raises one SelfspecError line that names `key`.<field>."""
    prefix = f"{key}." if key else ""
    schema = OmegaConf.structured(cls)
    _writable(schema)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, values))
    except MissingMandatoryValue as error:
        raise SelfspecError(f"{prefix}{error.full_key} is not set; it has no default") from None
    except OmegaConfBaseException as error:
        raise SelfspecError(type_error(error, prefix)) from None
    except SelfspecError as error:
        raise named_error(error, key) from None


def _writable(node: DictConfig) -> None:
    """Frozen dataclasses give read-only schema nodes; the merge must write into them."""
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            _writable(child)


@contextmanager
def named(key: str):
    """Inside the block, a SelfspecError about a field (`attn: ...`, `threshold=...`) is raised again with the
    config key in front (`skip.attn: ...`): core modules name their own parameters, the edge names the key."""
    try:
        yield
    except SelfspecError as error:
        raise named_error(error, key) from None


def named_error(error: SelfspecError, key: str) -> SelfspecError:
    message = str(error)
    if not key:
        return SelfspecError(message)
    about_a_field = re.match(r"[a-z_]+(\[\d+\])?[=:]", message)
    return SelfspecError(f"{key}{'.' if about_a_field else ': '}{message}")


def unknown_key(prefix: str, key: str, known) -> str:
    """`<prefix><key> is not a known key`, and the closest of the `known` keys beside it (a typo's fix) if any."""
    close = difflib.get_close_matches(key, [str(name) for name in known], n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else "see conf/ for the allowed keys"
    return f"{prefix}{key} is not a known key; {hint}"


def type_error(error: OmegaConfBaseException, prefix: str) -> str:
    where = f"{prefix}{error.full_key}" if error.full_key else prefix.rstrip(".") or "config"
    message = str(getattr(error, "msg", error)).splitlines()[0]
    unknown = re.match(r"Key '(.+)' not in '(\w+)'", message)
    if unknown:
        return unknown_key(prefix, unknown.group(1), error.parent_node or ())
    if "is not a ListConfig, list or tuple" in message:
        return f"{where} must be a list, e.g. {where}=['...']"
    if re.match(r"Value '.*' is not a valid bool", message):
        message = message.replace("is not a valid bool", "could not be converted to Boolean")
    wanted = re.search(r"could not be converted to (\w+)", message)
    if wanted:
        words = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "text"}
        value = re.match(r"Value '(.*?)' (of type|could not|is not)", message)
        return f"{where}={value.group(1) if value else '?'} is not allowed; it must be {words.get(wanted[1], wanted[1])}"
    return f"{where}: {message}"
