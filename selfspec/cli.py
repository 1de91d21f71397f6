"""The `selfspec` console command (pyproject [project.scripts]), `python -m selfspec` and run.py: compose the Hydra
config, build the typed settings, run the task; `selfspec strategies` lists the decoding strategies instead. Old
spellings of renamed options are rewritten first, each with one `selfspec: warning:` line. The configs ship inside
the package (selfspec/conf, a link to the checkout's conf/ that a wheel copies), so the command finds them from any
directory."""

import os
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from selfspec.errors import SelfspecError, print_warnings_as_lines

CONF = Path(__file__).resolve().parent / "conf"
# data=<option> of one prompt set (or two) -> its data.name under data=shipped
OLD_DATA_OPTIONS = {"humaneval": "humaneval", "chat": "chat", "summarize": "summarize", "qa": "qa", "math": "math",
                    "translate": "translate", "retrieval": "retrieval", "humaneval_chat": "[humaneval,chat]"}
RENAMED_GROUPS = {"draft_head": "trained_draft"}  # what experiment=train_draft trains


def main() -> None:
    if sys.argv[1:] == ["strategies"]:
        print_strategies()
        return
    overrides, renamed = current_spellings(sys.argv[1:])
    for message in renamed:
        print(f"selfspec: warning: {message}", file=sys.stderr)
    sys.argv[1:] = overrides  # what Hydra parses
    check_run_dir(overrides)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises a bad override's error here instead of printing its own
    try:
        run_task()
    except CompactHydraException as error:  # Hydra could not compose a config from the command line
        fail(composition_error(error))


def print_strategies() -> None:
    """`selfspec strategies`: every registered strategy, one a line, its name and then what it does."""
    from selfspec.decoding.strategies import REGISTRY  # imported here: Hydra's `--help` stays fast

    width = max(len(name) for name in REGISTRY)
    for spec in REGISTRY.values():
        print(f"{spec.name:<{width}}  {spec.description}")


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def run_task(cfg) -> None:
    # imported after Hydra parsed the command line: `--help` stays fast
    from selfspec.evaluation.task import run
    from selfspec.training.train_draft import train
    from selfspec.serve import serve
    from selfspec.settings import from_config, launch_settings

    tasks = {"evaluate": run, "train_draft": train, "serve": serve}
    print_warnings_as_lines()  # here, not in main(): a launcher's job runs in a process of its own
    try:
        settings = from_config(cfg)
        settings.launch = launch_settings(HydraConfig.get())
        print(OmegaConf.to_yaml(cfg, resolve=True))
        tasks[settings.task](settings, Path(HydraConfig.get().runtime.output_dir))
    except SelfspecError as error:
        fail(str(error))


def fail(message: str) -> NoReturn:
    """End the command with the message's first line as one `selfspec: error:` line and exit status 2."""
    print(f"selfspec: error: {message.splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


def composition_error(error: CompactHydraException) -> str:
    """Hydra's error about the command line as one line: an unknown group option with the group's options, an
    unknown key with the closest known one, anything else its first line."""
    from selfspec.settings.typed import unknown_key

    if isinstance(error, MissingConfigException) and error.options is not None:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option} is unknown; allowed: {', '.join(error.options)}"
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.parent_node is not None:
        return unknown_key(cause.full_key[:-len(str(cause.key))], str(cause.key), cause.parent_node)
    return str(error)


def current_spellings(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(`overrides` with every old spelling rewritten, a warning for each one rewritten)."""
    rewritten, warnings = [], []
    for override in overrides:
        new = current_spelling(override)
        if new != [override]:
            warnings.append(f"{override} is now {' '.join(new)}")
        rewritten += new
    return rewritten, warnings


def current_spelling(override: str) -> list[str]:
    """The overrides that `override` reads as now: itself, unless it names a renamed group or an old data option
    (a sweep of them, data=qa,chat, becomes a sweep of data.name)."""
    key, equals, value = override.partition("=")
    group, dot, rest = key.partition(".")
    if group in RENAMED_GROUPS:
        return [f"{RENAMED_GROUPS[group]}{dot}{rest}{equals}{value}"]
    options = value.split(",")
    if key == "data" and all(option in OLD_DATA_OPTIONS for option in options):
        return ["data=shipped", f"data.name={','.join(OLD_DATA_OPTIONS[option] for option in options)}"]
    return [override]


def check_run_dir(argv: list[str]) -> None:
    """Hydra makes the run dir before run_task() and fails with a traceback; a given hydra.run.dir is checked first."""
    from selfspec.records.run_dir import check_output_dir

    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            try:
                check_output_dir(Path(arg.split("=", 1)[1]))
            except SelfspecError as error:
                fail(str(error))
