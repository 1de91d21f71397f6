"""What a trial drafts with (`Candidate`), the space Optuna suggests it from, and the seeds tried first."""

import math
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial

from selfspec.errors import SelfspecError
from selfspec.settings import SearchSettings, SkipSet


@dataclass(frozen=True)
class Candidate:
    """What a trial drafts with: a skip set and a draft vocabulary size (None: the full output layer)."""
    skip: SkipSet
    vocab_size: int | None = None


@dataclass(frozen=True)
class SearchSpace:
    """Booleans `attn_<i>` / `mlp_<i>` for layers lo..hi-1 (layers outside are never skipped); with
    `early_exit`, an `exit_layer` in lo+1..hi from which every layer up to hi is skipped (hi: none); with more
    than one `vocab_sizes`, a categorical `draft_vocab_size`."""
    num_layers: int
    lo: int
    hi: int
    min_fraction: float = 0.0
    max_fraction: float = 1.0
    early_exit: bool = False
    vocab_sizes: tuple = (None,)

    def suggest(self, trial: optuna.Trial) -> Candidate:
        top = trial.suggest_int("exit_layer", self.lo + 1, self.hi) if self.early_exit else self.hi
        attn = [i for i in range(self.lo, top) if trial.suggest_categorical(f"attn_{i}", [False, True])]
        mlp = [i for i in range(self.lo, top) if trial.suggest_categorical(f"mlp_{i}", [False, True])]
        dropped = tuple(range(top, self.hi))
        vocab_size = (trial.suggest_categorical("draft_vocab_size", list(self.vocab_sizes))
                      if len(self.vocab_sizes) > 1 else self.vocab_sizes[0])
        return Candidate(SkipSet(tuple(attn) + dropped, tuple(mlp) + dropped), vocab_size)

    def params(self, candidate: Candidate) -> dict:
        """Trial parameters for `candidate` (layers outside the range dropped), for `study.enqueue_trial`."""
        skip = candidate.skip
        params = {**{f"attn_{i}": i in skip.attn for i in range(self.lo, self.hi)},
                  **{f"mlp_{i}": i in skip.mlp for i in range(self.lo, self.hi)}}
        if self.early_exit:
            params["exit_layer"] = self.hi
        if len(self.vocab_sizes) > 1:
            params["draft_vocab_size"] = candidate.vocab_size
        return params

    def clip(self, skip: SkipSet) -> SkipSet:
        inside = range(self.lo, self.hi)
        return SkipSet(tuple(i for i in skip.attn if i in inside), tuple(i for i in skip.mlp if i in inside))

    def reject_reason(self, candidate: Candidate) -> str | None:
        """Why `candidate` is not worth decoding (pruned unscored), or None."""
        skip = candidate.skip
        fraction = skip.fraction(self.num_layers)
        if skip.is_empty and candidate.vocab_size is None:
            return "nothing skipped"
        if fraction == 1:
            return "everything skipped"
        if fraction > self.max_fraction:
            return f"skips {fraction:.3f} > max_skip_fraction {self.max_fraction}"
        if fraction < self.min_fraction:
            return f"skips {fraction:.3f} < min_skip_fraction {self.min_fraction}"
        return None


def search_space(search: SearchSettings, layers: int, draft_vocab_size: int | None = None) -> SearchSpace:
    """The search space of `search` on a `layers`-layer model; draft_vocab_sizes null searches the draft's
    configured `draft_vocab_size` only. SearchSettings checked each value; this checks them against the model."""
    lo, hi = search.layer_range or (0, layers)
    if hi > layers:
        raise SelfspecError(f"search.layer_range={search.layer_range!r} is not allowed; use [lo, hi] with "
                            f"0 <= lo < hi <= {layers} (layers lo..hi-1 are searched) or null for all")
    low, high = search.min_skip_fraction, search.max_skip_fraction
    total = 2 * layers
    fewest, most = max(1, math.ceil(low * total - 1e-9)), min(2 * (hi - lo), math.floor(high * total + 1e-9), total - 1)
    if fewest > most:
        raise SelfspecError(f"search.min_skip_fraction={low}, max_skip_fraction={high} and layer_range [{lo}, {hi}) "
                            f"allow no skip set of the {total} sublayers; widen them")
    sizes = search.draft_vocab_sizes if search.draft_vocab_sizes is not None else (draft_vocab_size,)
    return SearchSpace(layers, lo, hi, low, high, search.early_exit, tuple(dict.fromkeys(sizes)))


def seed_candidates(space: SearchSpace, configured: SkipSet | None = None,
                    vocab_size: int | None = None) -> list[Candidate]:
    """Known-good starting points, tried first: the configured skip set and every other layer of the upper half
    (attention and MLP, the pattern Draft & Verify's searches favour), clipped to the layer range, with the
    configured draft vocabulary where the space has it (else its first); sets the space would prune are dropped."""
    layers = space.num_layers
    upper = tuple(range(layers // 2 + 1, layers - 2, 2)) or tuple(range(layers // 2, layers, 2))
    vocab = vocab_size if vocab_size in space.vocab_sizes else space.vocab_sizes[0]
    seeds = []
    for skip in (configured, SkipSet(upper, upper)):
        if skip is None:
            continue
        candidate = Candidate(space.clip(skip), vocab)
        if candidate not in seeds and space.reject_reason(candidate) is None:
            seeds.append(candidate)
    return seeds


def make_candidate(trial: FrozenTrial) -> Candidate:
    """The candidate a trial drafted with (its user attributes, set before it decoded)."""
    return Candidate(SkipSet(tuple(trial.user_attrs["attn"]), tuple(trial.user_attrs["mlp"])),
                     trial.user_attrs.get("draft_vocab_size"))
