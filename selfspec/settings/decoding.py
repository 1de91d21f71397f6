"""The decoding settings: sampling, skip sets and the `draft` group (draft-exit policy and drafter options)."""

from dataclasses import dataclass, field
from functools import cache
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from selfspec.errors import SelfspecError
from selfspec.settings.skip_strategy import SkipStrategySettings
from selfspec.settings.typed import CONF, at_least, in_unit, one_of

POLICIES = ("fixed", "threshold", "adaptive", "cost")
MAX_BANNED_WORDS = 10_000
ADAPTIVE_RULE = ("beta1", "target_acceptance", "epsilon", "beta2")  # the adaptive draft exit's parameters


@dataclass(frozen=True)
class SamplingSettings:
    """The `sampling` group; code that runs without run.py takes default_settings().sampling (greedy, 128 tokens)."""
    temperature: float  # 0 means greedy
    top_k: int  # 0 means off
    top_p: float
    repetition_penalty: float
    max_new_tokens: int
    stop: tuple[str, ...]  # the output ends with the token that completes one of these; its text before it

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))  # OmegaConf gives a list
        for index, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise SelfspecError(f"stop[{index}]={text!r} is not allowed; a stop string is non-empty text")
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


def check_banned_words(words) -> None:
    """At most MAX_BANNED_WORDS words, each with a character that is not whitespace."""
    if len(words) > MAX_BANNED_WORDS:
        raise SelfspecError(f"banned_words: {len(words)} words are too many; allowed: at most {MAX_BANNED_WORDS}")
    for index, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            raise SelfspecError(f"banned_words[{index}]={word!r} is not allowed; a banned word needs a character "
                                f"that is not whitespace")


@dataclass(frozen=True)
class ConstraintSettings:
    """The `constraints` keys: words the output may not contain (decoding/text_rules.py)."""
    banned_words: tuple[str, ...]
    case_sensitive: bool

    def __post_init__(self):
        object.__setattr__(self, "banned_words", tuple(self.banned_words))  # OmegaConf gives a list
        check_banned_words(self.banned_words)


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


@dataclass(kw_only=True)
class SkipSettings:
    """A skip set: inline `attn`/`mlp` layer ids, or `path` to a best_skip.yaml written by the search (which may
    also carry `draft_vocab_size`). Layer ids are checked against the model once it is loaded (models/skip.py)."""
    attn: list[int] = field(default_factory=list)
    mlp: list[int] = field(default_factory=list)
    path: Optional[str] = None
    draft_vocab_size: Optional[int] = None  # searched_skip only: the draft vocabulary it was searched with


@dataclass(kw_only=True)
class DraftSettings:
    """The `draft` group: the draft-exit policy (fixed | threshold | adaptive | cost) and the drafters' own options."""
    policy: str
    max_tokens: int
    threshold: Optional[float] = None  # threshold, adaptive (its start); None: default_threshold below
    beta1: Optional[float] = None  # the adaptive rule's; None: conf/draft/adaptive.yaml's (adaptive_options)
    target_acceptance: Optional[float] = None
    epsilon: Optional[float] = None
    beta2: Optional[float] = None
    vocab_size: Optional[int] = None  # draft over this many token ids; None: the whole vocabulary
    ngram_size: int
    ngram_tokens: int
    target_gate: Optional[float] = None
    min_best_speedup: float  # the cost-aware exit drafts only with a drafter whose best case beats plain by this
    hybrid_policy: Optional[str]  # self_spec_hybrid's and the tree strategies' policy; None: `policy`
    tree_nodes: int  # token-tree strategies (`*_tree`): most nodes per tree, longest branch, most children per node,
    tree_depth: int
    tree_width: int
    tree_branch_below: float  # and the layer-skip draft branches where its top probability is below this
    head: Optional[str]  # a trained feature head (head.pt, or shipped): self_spec_head's, and hybrid's and trees' draft
    store: Optional[str] = None  # a token store (store.pt, or shipped): self_spec_tree's draft where nothing is copied
    recycling_nodes: int  # token_recycling: its tree template's nodes, levels and candidates kept per token
    recycling_depth: int
    recycling_width: int
    lookahead_window: int  # lookahead: W window columns, N-grams (N - 1 Jacobi levels), G pool n-grams verified
    lookahead_ngram: int
    lookahead_candidates: int
    skip_strategy: SkipStrategySettings = field(default_factory=SkipStrategySettings)  # conf/skip_strategy/

    def __post_init__(self):
        one_of("policy", self.policy, POLICIES)
        if self.hybrid_policy is not None:
            one_of("hybrid_policy", self.hybrid_policy, POLICIES)
        at_least("max_tokens", self.max_tokens, 1)
        for name in ("threshold", *ADAPTIVE_RULE, "target_gate"):
            in_unit(name, getattr(self, name))
        at_least("vocab_size", self.vocab_size, 1)
        at_least("ngram_size", self.ngram_size, 1)
        at_least("ngram_tokens", self.ngram_tokens, 1)
        at_least("min_best_speedup", self.min_best_speedup, 1.0)
        for name in ("tree_nodes", "tree_depth", "tree_width", "recycling_nodes", "recycling_depth", "recycling_width",
                     "lookahead_window", "lookahead_candidates"):
            at_least(name, getattr(self, name), 1)
        in_unit("tree_branch_below", self.tree_branch_below)
        at_least("lookahead_ngram", self.lookahead_ngram, 2)

    @property
    def adaptive_options(self) -> dict:
        """The adaptive rule's parameters: the config's, or where the draft option sets none (draft=fixed with strategy
        self_spec_adaptive, say) the adaptive option's, conf/draft/adaptive.yaml."""
        return {name: adaptive_option()[name] if getattr(self, name) is None else getattr(self, name)
                for name in ADAPTIVE_RULE}


@cache
def adaptive_option() -> DictConfig:
    """conf/draft/adaptive.yaml as written (its max_tokens, an interpolation, is never read here)."""
    return OmegaConf.load(CONF / "draft" / "adaptive.yaml")
