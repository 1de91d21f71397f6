"""The run: its top-level options, how run.py was started, `from_config`, which types a composed config, and
`default_settings`, the config's own values for code that runs without run.py."""

from dataclasses import dataclass, field, fields
from functools import cache
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from selfspec.errors import SelfspecError
from selfspec.settings.decoding import ConstraintSettings, DraftSettings, SamplingSettings, SkipSettings
from selfspec.settings.groups import (DataSettings, HFSettings, KangarooSettings, LoggerSettings, ModelSettings,
                                      SearchSettings, ServeSettings, TrainedDraftSettings, TrainSettings)
from selfspec.settings.typed import CONF, at_least, one_of, type_error, typed

TASKS = ("evaluate", "train_draft", "serve")


@dataclass(frozen=True)
class LaunchSettings:
    """How run.py was started (Hydra's runtime config, read at the edge by `launch_settings`): a single run, or job
    `job_num` of the multirun sweep in `sweep_dir`, started by `launcher` (class name, e.g. JoblibLauncher)."""
    sweep_dir: Optional[str] = None
    job_num: Optional[int] = None
    launcher: Optional[str] = None

    @property
    def parallel(self) -> bool:
        """Jobs of the sweep may run at once: any launcher but Hydra's BasicLauncher (one job after another)."""
        return self.sweep_dir is not None and self.launcher != "BasicLauncher"


def launch_settings(hydra) -> LaunchSettings:
    """The LaunchSettings of a Hydra job from its runtime config (`HydraConfig.get()`)."""
    from hydra.types import RunMode

    if hydra.mode != RunMode.MULTIRUN:
        return LaunchSettings()
    return LaunchSettings(sweep_dir=str(hydra.sweep.dir), job_num=hydra.job.num,
                          launcher=str(hydra.launcher._target_).rpartition(".")[2])


@dataclass(kw_only=True)
class RunOptions:
    """The top-level keys of conf/config.yaml."""
    task: str
    seed: int
    strategies: list[str]
    repeats: int
    batch_size: int  # prompts decoded together (decoding/batch.py); 1: one at a time
    warmup: bool
    resume: bool  # continue the records.jsonl in the run dir (same settings) instead of moving it aside
    spec_bench_answers: bool  # also write <run dir>/model_answer/<model>-<strategy>.jsonl (Spec-Bench)

    def __post_init__(self):
        one_of("task", self.task, TASKS)
        at_least("repeats", self.repeats, 1)
        at_least("batch_size", self.batch_size, 1)


@dataclass(kw_only=True)
class RunSettings(RunOptions):
    """Everything one `python run.py ...` does, typed."""
    model: ModelSettings
    skip: SkipSettings
    searched_skip: Optional[SkipSettings]  # searched_skip.path if set, else model.searched_skip
    draft: DraftSettings
    draft_model: Optional[ModelSettings]
    sampling: SamplingSettings
    constraints: ConstraintSettings
    search: Optional[SearchSettings]
    data: DataSettings
    logger: LoggerSettings
    hf: HFSettings
    kangaroo: KangarooSettings
    trained_draft: TrainedDraftSettings
    train: TrainSettings
    launch: LaunchSettings = field(default_factory=LaunchSettings)  # set by run.py from Hydra's runtime config
    serve: Optional[ServeSettings] = None


def from_config(cfg: DictConfig) -> RunSettings:
    """The typed settings of a composed run config (unknown top-level keys, such as an experiment's own, are
    left to the experiment's interpolations)."""
    plain = _resolved(cfg)
    model = typed(ModelSettings, plain["model"], "model")
    searched = plain.get("searched_skip") or {}
    searched_skip = (typed(SkipSettings, searched, "searched_skip") if searched.get("path")
                     else model.searched_skip)
    options = typed(RunOptions, {f.name: plain.get(f.name) for f in fields(RunOptions)}, "")
    return RunSettings(
        **vars(options), model=model, skip=typed(SkipSettings, plain["skip"], "skip"), searched_skip=searched_skip,
        draft=typed(DraftSettings, plain["draft"], "draft"),
        draft_model=typed(ModelSettings, plain["draft_model"], "draft_model") if plain.get("draft_model") else None,
        sampling=typed(SamplingSettings, plain["sampling"], "sampling"),
        constraints=typed(ConstraintSettings, plain["constraints"], "constraints"),
        search=typed(SearchSettings, plain["search"], "search") if plain.get("search") else None,
        data=typed(DataSettings, plain["data"], "data"), logger=typed(LoggerSettings, plain["logger"], "logger"),
        hf=typed(HFSettings, plain["hf"], "hf"), kangaroo=typed(KangarooSettings, plain["kangaroo"], "kangaroo"),
        trained_draft=typed(TrainedDraftSettings, plain["trained_draft"], "trained_draft"),
        train=typed(TrainSettings, plain["train"], "train"),
        serve=typed(ServeSettings, plain["serve"], "serve") if plain.get("serve") else None)


def _resolved(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        raise SelfspecError(f"{error.full_key} is not set; give it on the command line ({error.full_key}=...)") from None
    except OmegaConfBaseException as error:
        raise SelfspecError(type_error(error, "")) from None


@cache
def default_settings(*overrides: str) -> RunSettings:
    """The settings of conf/config.yaml with no overrides (or these), as `python run.py` runs: the defaults of the code
    that runs without run.py (the Python API, tests, experiments/). Built once and shared: replace(), do not mutate.
    Hydra's global state is put back afterwards, so a running Hydra app (run.py) may call it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import JobRuntime

    running = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:  # the running app's job name, which initialize_config_dir sets for the whole process
        with initialize_config_dir(str(CONF), job_name=JobRuntime.instance().get("name"), version_base="1.3"):
            return from_config(compose("config", overrides=list(overrides)))
    finally:
        GlobalHydra.instance().clear()
        if running is not None:
            GlobalHydra.instance().initialize(running)
