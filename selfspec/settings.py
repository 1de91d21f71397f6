"""Typed settings, built once from the Hydra config at the edge (`from_config`); the rest of selfspec takes these.

Each config group has a dataclass here. The YAML files under conf/ hold the values, so fields that every option
of a group sets have no default here; optional fields default to None ("not set"). OmegaConf checks the types
(`typed`), each dataclass checks its ranges in `__post_init__`, and any bad value ends as one SelfspecError line
that names the full key and what is allowed. Only this module and the entry points import OmegaConf.
It is longer than our usual ~300 lines on purpose: the whole config schema reads in one file.
"""

import re
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Optional, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from selfspec.errors import SelfspecError

MODEL_SOURCES = ("smollm2", "gemma3_270m", "hub", "tiny")
TINY_FAMILIES = ("llama", "gemma2")
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICE_MAP_PLANS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate splits the model by memory
POLICIES = ("fixed", "threshold", "adaptive", "cost")
OBJECTIVES = ("tokens_per_s", "acceptance", "pareto", "cost_model")
SAMPLERS = ("tpe", "gp", "random")
LOGGERS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")
TASKS = ("evaluate", "kangaroo_train", "serve")
TURNS = ("first", "all")
FORMAT_NAMES = ("auto", "fastchat", "sharegpt", "alpaca", "gsm8k", "humaneval", "prompt")  # data/formats.py's, in detection order
SPLITS = ("all", "calibration", "evaluation")  # data.split: every prompt, the even-numbered ones, the odd-numbered ones
T = TypeVar("T")


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128

    def __post_init__(self):
        if self.temperature < 0:
            raise SelfspecError(f"temperature={self.temperature} is negative; allowed: 0 (greedy) or > 0")
        if self.top_k < 0:
            raise SelfspecError(f"top_k={self.top_k} is negative; allowed: 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise SelfspecError(f"top_p={self.top_p} is outside (0, 1]")
        if self.repetition_penalty <= 0:
            raise SelfspecError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.max_new_tokens < 1:
            raise SelfspecError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SkipSet:
    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.attn and not self.mlp

    def fraction(self, num_layers: int) -> float:
        """Share of the 2 x num_layers sublayers that are skipped."""
        return (len(self.attn) + len(self.mlp)) / (2 * num_layers)

    def as_dict(self) -> dict:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}


def make_skip_set(attn, mlp, num_layers: int) -> SkipSet:
    """Validate layer ids (integers in [0, num_layers), no duplicates, not everything) into a SkipSet."""
    checked = {}
    for kind, ids in (("attn", attn), ("mlp", mlp)):
        ids = list(ids or [])
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise SelfspecError(f"{kind}: layer id {i!r} is not an integer; allowed: 0..{num_layers - 1}")
            if not 0 <= i < num_layers:
                raise SelfspecError(f"{kind}: layer id {i} is out of range; allowed: 0..{num_layers - 1}")
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise SelfspecError(f"{kind}: layer ids {duplicates} appear more than once")
        checked[kind] = tuple(sorted(ids))
    if len(checked["attn"]) == len(checked["mlp"]) == num_layers:
        raise SelfspecError(f"skip set skips all {2 * num_layers} sublayers; keep at least one")
    return SkipSet(**checked)


def default_threshold(greedy: bool) -> float:
    """The starting draft-exit threshold when `draft.threshold` is null: the paper code's 0.8 for greedy decoding,
    0.5 for sampling."""
    return 0.8 if greedy else 0.5


def one_of(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise SelfspecError(f"{key}={value!r} is unknown; allowed: {', '.join(map(str, allowed))}")


def at_least(key: str, value, low, what: str = "") -> None:
    if value is not None and value < low:
        raise SelfspecError(f"{key}={value!r} must be >= {low}{what}")


def in_unit(key: str, value) -> None:
    if value is not None and not 0 <= value <= 1:
        raise SelfspecError(f"{key}={value!r} is outside [0, 1]")


@dataclass(kw_only=True)
class SkipSettings:
    """A skip set: inline `attn`/`mlp` layer ids, or `path` to a best_skip.yaml written by the search (which may
    also carry `draft_vocab_size`). Layer ids are checked against the model once it is loaded (models/skip.py)."""
    attn: list[int] = field(default_factory=list)
    mlp: list[int] = field(default_factory=list)
    path: Optional[str] = None
    draft_vocab_size: Optional[int] = None  # searched_skip only: the draft vocabulary it was searched with


def check_device_map(value) -> None:
    """null, a plan accelerate computes (auto, ...), one device, or a {module name: device or "disk"} dict."""
    allowed = (f"allowed: null (all on model.device), {', '.join(DEVICE_MAP_PLANS)}, a device (cpu, cuda, cuda:N, N) "
               f"or a {{module: device or disk}} map in YAML")
    if value is None or value in DEVICE_MAP_PLANS:
        return
    if isinstance(value, dict):
        bad = [device for module, device in value.items() if not isinstance(module, str) or
               not (device == "disk" or _is_device(device))]
        if value and not bad:
            return
        raise SelfspecError(f"device_map={value!r} is not allowed"
                            f"{f' (device {bad[0]!r})' if bad else ' (empty)'}; {allowed}")
    if not _is_device(value):
        raise SelfspecError(f"device_map={value!r} is not allowed; {allowed}")


def _is_device(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0  # a CUDA index
    try:
        return isinstance(value, str) and torch.device(value).type != "meta"
    except RuntimeError:
        return False


@dataclass(kw_only=True)
class ModelSettings:
    """The `model` group (and `draft_model`): where the weights come from and where they run."""
    name: str
    source: str
    path: Optional[str] = None
    dtype: str
    device: str
    cache_dir: Optional[str] = None  # embedded GGUF models are converted once into <cache_dir>/<source>
    # Spread the model over devices with accelerate (checkpoints larger than one device); null = all on `device`.
    device_map: Any = None  # auto | balanced | balanced_low_0 | sequential | a device | {module: device or disk}
    offload_folder: Optional[str] = None  # where a device map's "disk" modules are kept
    packed_linears: bool = True  # decoder linears through oneDNN, weights packed once (float32 on the CPU only)
    family: Optional[str] = None  # tiny models: llama | gemma2, and their shape
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    sliding_window: Optional[int] = None
    seed: Optional[int] = None
    draft_vocab_size: Optional[int] = None  # this model's draft defaults, read by the draft group
    draft_max_tokens: Optional[int] = None
    hf_early_exit_layer: Optional[int] = None  # read by the bench experiment
    searched_skip: Optional[SkipSettings] = None  # strategy self_spec_searched

    def __post_init__(self):
        one_of("source", self.source, MODEL_SOURCES)
        one_of("dtype", self.dtype, DTYPES)
        check_device_map(self.device_map)
        if self.source in ("smollm2", "gemma3_270m") and not self.cache_dir:
            raise SelfspecError(f"cache_dir={self.cache_dir!r}: source {self.source} needs a folder for its converted "
                                f"weights")
        if self.source == "tiny":
            one_of("family", self.family, TINY_FAMILIES)
            for name in ("num_layers", "hidden_size", "sliding_window"):
                at_least(name, getattr(self, name), 1)


@dataclass(kw_only=True)
class DraftSettings:
    """The `draft` group: the draft-exit policy (fixed | threshold | adaptive | cost) and the drafters' own options."""
    policy: str
    max_tokens: int
    threshold: Optional[float] = None  # threshold, adaptive (its start); None: default_threshold below
    beta1: Optional[float] = None  # adaptive only; None: the paper's value (decoding/draft_exit.py)
    target_acceptance: Optional[float] = None
    epsilon: Optional[float] = None
    beta2: Optional[float] = None
    vocab_size: Optional[int] = None  # draft over this many token ids; None: the whole vocabulary
    ngram_size: int
    ngram_tokens: int
    target_gate: Optional[float] = None
    hybrid_policy: Optional[str] = "cost"  # self_spec_hybrid's and the tree strategies' policy; None: `policy`
    tree_nodes: int  # token-tree strategies (`*_tree`): most nodes per tree, longest branch, most children per node,
    tree_depth: int
    tree_width: int
    tree_branch_below: float  # and the layer-skip draft branches where its top probability is below this

    def __post_init__(self):
        one_of("policy", self.policy, POLICIES)
        if self.hybrid_policy is not None:
            one_of("hybrid_policy", self.hybrid_policy, POLICIES)
        at_least("max_tokens", self.max_tokens, 1)
        for name in ("threshold", "beta1", "target_acceptance", "epsilon", "beta2", "target_gate"):
            in_unit(name, getattr(self, name))
        at_least("vocab_size", self.vocab_size, 1)
        at_least("ngram_size", self.ngram_size, 1)
        at_least("ngram_tokens", self.ngram_tokens, 1)
        for name in ("tree_nodes", "tree_depth", "tree_width"):
            at_least(name, getattr(self, name), 1)
        in_unit("tree_branch_below", self.tree_branch_below)

    @property
    def adaptive_options(self) -> dict:
        """The adaptive rule's parameters that the config sets (the rest keep AdaptiveExit's defaults)."""
        names = ("beta1", "target_acceptance", "epsilon", "beta2")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(kw_only=True)
class DataSettings:
    """The `data` group: one prompt set or several (`name` a list), `limit` prompts of each."""
    name: Any  # a prompt-set name or a list of them
    path: Optional[str] = None
    limit: Optional[int] = None
    split: str = "all"  # shipped sets: all | calibration (prompts 1, 3, 5, ...) | evaluation (2, 4, ...); jsonl: all
    offset: int = 0  # prompts of the split skipped at the start of each set (search.data: after the evaluation prompts)
    turns: str = "first"  # first: decode each prompt's first turn | all: every turn, on the strategy's own answers
    format: str = "auto"  # jsonl: the records' format (prompt_formats.py), auto = detected per file
    max_prompt_tokens: Optional[int] = None  # left-truncate longer prompts to this many tokens; None = refuse them

    def __post_init__(self):
        at_least("limit", self.limit, 1, " (prompts per set), or null for all")
        one_of("turns", self.turns, TURNS)
        one_of("split", self.split, SPLITS)
        at_least("offset", self.offset, 0)
        one_of("format", self.format, FORMAT_NAMES)
        at_least("max_prompt_tokens", self.max_prompt_tokens, 1, ", or null to refuse prompts too long for the model")
        if not self.names or not all(isinstance(n, str) for n in self.names):
            raise SelfspecError(f"name={self.name!r} is not allowed; give a prompt-set name or a list of them")

    @property
    def names(self) -> list[str]:
        return list(self.name) if isinstance(self.name, (list, tuple)) else [self.name]


@dataclass(kw_only=True)
class SearchSettings:
    """The `search` group: the Optuna study of skip sets (selfspec/search/)."""
    n_trials: int
    objective: str
    sampler: str
    seed: Optional[int] = None
    n_startup_trials: int
    storage: Optional[str] = None
    study_name: Optional[str] = None
    layer_range: Optional[list[int]] = None
    min_skip_fraction: float
    max_skip_fraction: float
    early_exit: bool
    draft_vocab_sizes: Optional[list[Optional[int]]] = None
    prune_p: float
    enqueue_seeds: bool
    max_new_tokens: int
    data: DataSettings
    heartbeat_interval: int  # RDB storages: seconds between a running trial's heartbeats
    grace_period: int  # RDB storages: a trial without a heartbeat for this long is failed (and retried)
    max_retry: int  # times a trial failed by the heartbeat is run again

    def __post_init__(self):
        at_least("n_trials", self.n_trials, 1, " (trials in the study in total)")
        at_least("heartbeat_interval", self.heartbeat_interval, 1, " seconds")
        at_least("grace_period", self.grace_period, self.heartbeat_interval + 1, " seconds (above heartbeat_interval)")
        at_least("max_retry", self.max_retry, 0)
        one_of("objective", self.objective, OBJECTIVES)
        one_of("sampler", self.sampler, SAMPLERS)
        at_least("n_startup_trials", self.n_startup_trials, 0)
        for name in ("min_skip_fraction", "max_skip_fraction", "prune_p"):
            in_unit(name, getattr(self, name))
        at_least("max_new_tokens", self.max_new_tokens, 2)
        if self.layer_range is not None and (len(self.layer_range) != 2 or not 0 <= self.layer_range[0] < self.layer_range[1]):
            raise SelfspecError(f"layer_range={self.layer_range!r} is not allowed; use [lo, hi] with 0 <= lo < hi "
                                f"(layers lo..hi-1 are searched) or null for all")
        if self.draft_vocab_sizes is not None and (not self.draft_vocab_sizes
                                                   or any(n is not None and n < 1 for n in self.draft_vocab_sizes)):
            raise SelfspecError(f"draft_vocab_sizes={self.draft_vocab_sizes!r} is not allowed; use a list of positive "
                                f"token counts, null for the full vocabulary, e.g. [null, 16384]")


@dataclass(kw_only=True)
class LoggerSettings:
    """The `logger` group: W&B (offline unless mode=online) or none; local records are always written."""
    kind: str
    mode: str = "offline"
    project: str = "selfspec"
    name: Optional[str] = None
    group: Optional[str] = None  # W&B run group (a sweep or a study)

    def __post_init__(self):
        one_of("kind", self.kind, LOGGERS)
        one_of("mode", self.mode, WANDB_MODES)


@dataclass(kw_only=True)
class HFSettings:
    """The `hf` block: the HF generate baselines (decoding/hf_baselines.py)."""
    early_exit_layer: Optional[int] = None  # hf_early_exit drafts with the first N layers; None: 3/4 of them
    num_assistant_tokens: int
    confidence_threshold: float

    def __post_init__(self):
        at_least("early_exit_layer", self.early_exit_layer, 1)
        at_least("num_assistant_tokens", self.num_assistant_tokens, 1)
        if not 0 <= self.confidence_threshold < 1:
            raise SelfspecError(f"confidence_threshold={self.confidence_threshold!r} is outside [0, 1); "
                                f"0 drafts a fixed length")


@dataclass(frozen=True)
class TrainSettings:
    """The `kangaroo.train` block (its defaults are the API's, for code that trains without the config)."""
    sets: tuple[str, ...] = ("humaneval", "chat", "summarize")
    prompts_per_set: Optional[int] = 32  # from the calibration half of each set; None = all of it
    max_new_tokens: int = 64
    epochs: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    hard_label_weight: float = 0.0
    val_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name, ok in (("epochs", self.epochs >= 1), ("max_new_tokens", self.max_new_tokens >= 1),
                         ("lr", self.lr > 0), ("weight_decay", self.weight_decay >= 0),
                         ("hard_label_weight", self.hard_label_weight >= 0),
                         ("val_fraction", 0 < self.val_fraction < 1),
                         ("prompts_per_set", self.prompts_per_set is None or self.prompts_per_set >= 1)):
            if not ok:
                raise SelfspecError(f"{name}={getattr(self, name)!r} is out of range")


@dataclass(kw_only=True)
class KangarooSettings:
    """The `kangaroo` group: the adapter the `kangaroo` strategy drafts with, and its training."""
    adapter_path: Optional[str] = None
    exit_layer: Optional[int] = None  # layers before the adapter; None: half the model's layers
    resume: Optional[str] = None
    train: TrainSettings


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
class ServeSettings:
    """The `serve` group: the OpenAI-compatible server of `task=serve` (selfspec/serve/)."""
    host: str
    port: int
    strategy: str  # what requests decode with (the page's toggle and `"strategy": "plain"` add plain decoding)
    max_queue: int  # requests waiting behind the running one; one more is answered 429
    max_tokens: int  # the most new tokens a request may ask for
    api_key: Optional[str] = None  # set: /v1 requests need `Authorization: Bearer <api_key>`

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise SelfspecError(f"port={self.port!r} is outside [1, 65535]")
        at_least("max_queue", self.max_queue, 0)
        at_least("max_tokens", self.max_tokens, 1)


@dataclass(kw_only=True)
class RunOptions:
    """The top-level keys of conf/config.yaml."""
    task: str
    seed: int
    strategies: list[str]
    repeats: int
    warmup: bool
    resume: bool = False  # continue the records.jsonl in the run dir (same settings) instead of moving it aside
    spec_bench_answers: bool = False  # also write <run dir>/model_answer/<model>-<strategy>.jsonl (Spec-Bench)

    def __post_init__(self):
        one_of("task", self.task, TASKS)
        at_least("repeats", self.repeats, 1)


@dataclass(kw_only=True)
class RunSettings(RunOptions):
    """Everything one `python run.py ...` does, typed."""
    model: ModelSettings
    skip: SkipSettings
    searched_skip: Optional[SkipSettings]  # searched_skip.path if set, else model.searched_skip
    draft: DraftSettings
    draft_model: Optional[ModelSettings]
    sampling: SamplingSettings
    search: Optional[SearchSettings]
    data: DataSettings
    logger: LoggerSettings
    hf: HFSettings
    kangaroo: KangarooSettings
    launch: LaunchSettings = field(default_factory=LaunchSettings)  # set by run.py from Hydra's runtime config
    serve: Optional[ServeSettings] = None


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
        raise SelfspecError(_type_error(error, prefix)) from None
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


def _type_error(error: OmegaConfBaseException, prefix: str) -> str:
    where = f"{prefix}{error.full_key}" if error.full_key else prefix.rstrip(".") or "config"
    message = str(getattr(error, "msg", error)).splitlines()[0]
    unknown = re.match(r"Key '(.+)' not in '(\w+)'", message)
    if unknown:
        return f"{prefix}{unknown.group(1)} is not a known key; see conf/ for the allowed keys"
    if re.match(r"Value '.*' is not a valid bool", message):
        message = message.replace("is not a valid bool", "could not be converted to Boolean")
    wanted = re.search(r"could not be converted to (\w+)", message)
    if wanted:
        words = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "text"}
        value = re.match(r"Value '(.*?)' (of type|could not|is not)", message)
        return f"{where}={value.group(1) if value else '?'} is not allowed; it must be {words.get(wanted[1], wanted[1])}"
    return f"{where}: {message}"


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
        search=typed(SearchSettings, plain["search"], "search") if plain.get("search") else None,
        data=typed(DataSettings, plain["data"], "data"), logger=typed(LoggerSettings, plain["logger"], "logger"),
        hf=typed(HFSettings, plain["hf"], "hf"), kangaroo=typed(KangarooSettings, plain["kangaroo"], "kangaroo"),
        serve=typed(ServeSettings, plain["serve"], "serve") if plain.get("serve") else None)


def _resolved(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        raise SelfspecError(f"{error.full_key} is not set; give it on the command line ({error.full_key}=...)") from None
    except OmegaConfBaseException as error:
        raise SelfspecError(_type_error(error, "")) from None
