"""The settings of the run's other groups: model, data, search, logger, hf, kangaroo, trained_draft and train, serve."""

from dataclasses import dataclass
from typing import Any, Optional

import torch

from selfspec.errors import SelfspecError
from selfspec.settings.decoding import SkipSettings
from selfspec.settings.typed import at_least, in_unit, one_of

MODEL_SOURCES = ("smollm2", "gemma3_270m", "hub", "gguf", "tiny")  # hub: a checkpoint folder or a hub id; gguf: a file
# models/tiny.py's: one per architecture of the layout registry (models/layouts.py), llama3 with Llama-3's RoPE scaling
TINY_FAMILIES = ("llama", "gemma2", "gemma3", "llama3", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma",
                 "phi3", "olmo2", "granite", "gpt2", "gpt_neox", "falcon", "opt")
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICE_MAP_PLANS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate splits the model by memory
OBJECTIVES = ("tokens_per_s", "acceptance", "pareto", "cost_model")
SAMPLERS = ("tpe", "gp", "random")
LOGGERS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")
TURNS = ("first", "all")
FORMAT_NAMES = ("auto", "fastchat", "sharegpt", "alpaca", "gsm8k", "humaneval", "prompt")  # data/formats.py's, in detection order
SPLITS = ("all", "calibration", "evaluation")  # data.split: every prompt, the even-numbered ones, the odd-numbered ones


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
    packed_linears: bool  # decoder linears and output layer through oneDNN, weights packed once (float32 CPU only)
    family: Optional[str] = None  # tiny models: one of TINY_FAMILIES, and their shape
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    sliding_window: Optional[int] = None
    seed: Optional[int] = None
    draft_vocab_size: Optional[int] = None  # this model's draft defaults, read by the draft group
    draft_max_tokens: Optional[int] = None
    hf_early_exit_layer: Optional[int] = None  # read by the bench experiment
    searched_skip: Optional[SkipSettings] = None  # strategy self_spec_searched
    feature_head: Optional[str] = None  # read by the draft group (draft.head): shipped, or a head.pt
    token_store: Optional[str] = None  # read by the draft group (draft.store): shipped, or a store.pt

    def __post_init__(self):
        one_of("source", self.source, MODEL_SOURCES)
        one_of("dtype", self.dtype, DTYPES)
        check_device_map(self.device_map)
        if self.source in ("smollm2", "gemma3_270m", "gguf") and not self.cache_dir:
            raise SelfspecError(f"cache_dir={self.cache_dir!r}: source {self.source} needs a folder for its converted "
                                f"weights")
        if self.source == "tiny":
            one_of("family", self.family, TINY_FAMILIES)
            for name in ("num_layers", "hidden_size", "sliding_window"):
                at_least(name, getattr(self, name), 1)


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


TRAINED_DRAFT_KINDS = ("feature", "kangaroo")


@dataclass(frozen=True)
class TrainSettings:
    """The `train` block: the data and optimisation of experiment=train_draft (training/)."""
    sets: tuple[str, ...]  # training prompts: the calibration half of each of these shipped sets
    prompt_file: Optional[str]  # and every prompt of this file (any prompt-file format of data=jsonl)
    prompts_per_set: Optional[int]  # None = the whole calibration half
    self_prompts: int  # and this many user turns the model writes itself (training/self_prompts.py); 0 = none
    samples_per_prompt: int  # sequences per prompt: the greedy one, then sampled ones
    temperature: float  # of the sampled ones
    max_new_tokens: int
    generate_batch: int  # prompts per batched generate call (and per data shard)
    epochs: int
    batch_size: int  # sequences per optimiser step
    lr: float
    weight_decay: float
    val_fraction: float
    max_minutes: Optional[float]  # stop after the epoch that passes this (data included); None = all epochs
    seed: int
    resume: Optional[str]  # an earlier train_draft run dir: go on training there
    ce_vocab: str  # data: the soft CE over the tokens the training data holds | all: every row the draft scores
    targets: str  # generated: the loss scores the positions predicting the model's continuation | all: the prompt's too
    data_dir: Optional[str]  # where the generations and states go; None = <run dir>/draft_data

    def __post_init__(self):
        one_of("ce_vocab", self.ce_vocab, ("data", "all"))
        one_of("targets", self.targets, ("generated", "all"))
        for name, ok in (("epochs", self.epochs >= 1), ("max_new_tokens", self.max_new_tokens >= 1),
                         ("samples_per_prompt", self.samples_per_prompt >= 1), ("temperature", self.temperature > 0),
                         ("generate_batch", self.generate_batch >= 1), ("batch_size", self.batch_size >= 1),
                         ("lr", self.lr > 0), ("weight_decay", self.weight_decay >= 0),
                         ("val_fraction", 0 < self.val_fraction < 1),
                         ("max_minutes", self.max_minutes is None or self.max_minutes > 0),
                         ("prompts_per_set", self.prompts_per_set is None or self.prompts_per_set >= 1),
                         ("self_prompts", self.self_prompts >= 0)):
            if not ok:
                raise SelfspecError(f"{name}={getattr(self, name)!r} is out of range")


@dataclass(frozen=True)
class TrainedDraftSettings:
    """The `trained_draft` group: which draft experiment=train_draft trains, and its loss."""
    kind: str  # feature | kangaroo
    feature_weight: float  # x smooth-L1 between predicted and true final hidden states
    soft_ce_weight: float  # x cross-entropy against the full model's next-token distribution
    feature_noise: float  # std of the Gaussian noise on the draft's input states while training
    chain_steps: int  # the feature head also learns from chains of this many steps on its own predictions; 1 = none
    fused_layers: tuple[int, ...]  # the feature head also reads the model's states after these many layers (EAGLE-3)

    def __post_init__(self):
        one_of("kind", self.kind, TRAINED_DRAFT_KINDS)
        for name in ("feature_weight", "soft_ce_weight", "feature_noise"):
            at_least(name, getattr(self, name), 0)
        at_least("chain_steps", self.chain_steps, 1)
        if self.kind == "kangaroo" and self.fused_layers:
            raise SelfspecError(f"fused_layers={list(self.fused_layers)}: the Kangaroo adapter reads its exit layer's "
                                f"state alone; allowed: []")
        if self.kind == "kangaroo" and self.chain_steps != 1:
            raise SelfspecError(f"chain_steps={self.chain_steps}: the Kangaroo adapter drafts on the model's own "
                                f"shallow layers, not on its own predictions; allowed: 1")


@dataclass(kw_only=True)
class KangarooSettings:
    """The `kangaroo` group: the adapter the `kangaroo` strategy drafts with, and the exit layer it is trained at."""
    adapter_path: Optional[str] = None
    exit_layer: Optional[int] = None  # layers before the adapter; None: half the model's layers


@dataclass(kw_only=True)
class ServeSettings:
    """The `serve` group: the OpenAI-compatible server of `task=serve` (selfspec/serve/)."""
    host: str
    port: int
    strategy: str  # what requests decode with (the page's toggle and `"strategy": "plain"` add plain decoding)
    max_batch: int  # requests decoding together (serve/batcher.py); 1: one at a time
    max_queue: int  # requests waiting beyond the max_batch decoding ones; one more is answered 429
    max_tokens: int  # the most new tokens a request may ask for
    max_prompt_tokens: int  # the longest prompt a request may send (with max_tokens: the batch's cache per row)
    max_body_bytes: int  # the largest request body; a larger one is answered 413 before it is parsed
    api_key: Optional[str] = None  # set: /v1 requests need `Authorization: Bearer <api_key>`

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise SelfspecError(f"port={self.port!r} is outside [1, 65535]")
        at_least("max_batch", self.max_batch, 1, " (1: one request decodes at a time)")
        at_least("max_queue", self.max_queue, 0)
        at_least("max_tokens", self.max_tokens, 1)
        at_least("max_prompt_tokens", self.max_prompt_tokens, 1)
        at_least("max_body_bytes", self.max_body_bytes, 1)
