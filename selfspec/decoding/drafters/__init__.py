"""Drafters propose tokens for the full model to verify; each follows the `Drafter` protocol (base.py).

A `ChainDrafter` (base.py) or a `TreeDrafter` (layer_skip_tree.py) drafts from a token source: the layer-skipped
model (`SkippedModel`, layer_skip.py; `SelfDrafter` is its chain, which batches), the feature head (`HeadFeatures`,
feature_head.py) or the token store (`StoreSource`, layer_skip_tree.py; `StoreTreeDrafter` its tree). The copiers
(`NgramDrafter`, ngram.py; `NgramTreeDrafter`, ngram_tree.py) share one n-gram matcher. `HybridDrafter` (hybrid.py)
takes a copy where there is one, else a model draft; `ModelDrafter` (two_model.py) drafts with a separate model,
`KangarooDrafter` (kangaroo.py) by double early exit. `TokenRecyclingDrafter` (token_recycling.py) and
`LookaheadDrafter` (lookahead.py) draft trees from what the full model's verify forwards scored. Each module lists
the strategies it implements (`STRATEGIES`).
"""

from selfspec.decoding.drafters.base import (ChainDrafter, Draft, Drafter, DraftForward, ExitPolicyDrafter,
                                            GenerationContext, TokenSource, cut_at_end)
from selfspec.decoding.drafters.feature_head import HeadFeatures
from selfspec.decoding.drafters.hybrid import HybridDrafter
from selfspec.decoding.drafters.kangaroo import KangarooDrafter
from selfspec.decoding.drafters.layer_skip import SelfDrafter, SkippedModel
from selfspec.decoding.drafters.layer_skip_tree import StoreSource, StoreTreeDrafter, TreeDrafter
from selfspec.decoding.drafters.lookahead import LookaheadDrafter
from selfspec.decoding.drafters.ngram import NGRAM, NgramDrafter, ngram_matches
from selfspec.decoding.drafters.ngram_tree import NgramTreeDrafter
from selfspec.decoding.drafters.token_recycling import TokenRecyclingDrafter
from selfspec.decoding.drafters.two_model import ModelDrafter

__all__ = ["ChainDrafter", "Draft", "Drafter", "DraftForward", "ExitPolicyDrafter", "GenerationContext",
           "HeadFeatures", "HybridDrafter", "KangarooDrafter", "LookaheadDrafter", "ModelDrafter", "NGRAM",
           "NgramDrafter", "NgramTreeDrafter", "SelfDrafter", "SkippedModel", "StoreSource", "StoreTreeDrafter",
           "TokenRecyclingDrafter", "TokenSource", "TreeDrafter", "cut_at_end", "ngram_matches"]
