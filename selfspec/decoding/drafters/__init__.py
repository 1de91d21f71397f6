"""Drafters propose tokens for the full model to verify; each follows the `Drafter` protocol (base.py).

`SelfDrafter` (layer_skip.py) is Draft & Verify: the target with a skip set, over the target's own cache.
`ModelDrafter` (two_model.py) is classic speculative decoding with a separate small model and its own cache.
`NgramDrafter` (ngram.py) copies from the context (prompt lookup); `HybridDrafter` (hybrid.py) takes such a copy
when there is one and a model draft otherwise; `KangarooDrafter` (kangaroo.py) drafts by double early exit;
`HeadDrafter` (feature_head.py) drafts with a trained feature-level head on the model's last hidden state.
Token trees (decoding/tree.py): `NgramTreeDrafter` (ngram_tree.py) merges several copies into a trie;
`SelfTreeDrafter` (layer_skip_tree.py) branches the layer-skip draft where it is unsure, `HeadTreeDrafter` the head's,
`StoreTreeDrafter` a token store's (the model's own generations, models/token_store.py).
Each module also lists the strategies it implements, in its `STRATEGIES` (decoding/registry.py).
"""

from selfspec.decoding.drafters.base import (Draft, Drafter, DraftForward, ExitPolicyDrafter, GenerationContext,
                                            cut_at_end)
from selfspec.decoding.drafters.feature_head import HeadDrafter
from selfspec.decoding.drafters.hybrid import HybridDrafter
from selfspec.decoding.drafters.kangaroo import KangarooDrafter
from selfspec.decoding.drafters.layer_skip import SelfDrafter
from selfspec.decoding.drafters.layer_skip_tree import HeadTreeDrafter, SelfTreeDrafter, StoreTreeDrafter
from selfspec.decoding.drafters.ngram import NGRAM, NgramDrafter, ngram_continuation, ngram_matches
from selfspec.decoding.drafters.ngram_tree import NgramTreeDrafter
from selfspec.decoding.drafters.two_model import ModelDrafter

__all__ = ["Draft", "Drafter", "DraftForward", "ExitPolicyDrafter", "GenerationContext", "HeadDrafter",
           "HeadTreeDrafter", "HybridDrafter", "KangarooDrafter", "ModelDrafter", "NGRAM", "NgramDrafter",
           "NgramTreeDrafter", "SelfDrafter", "SelfTreeDrafter", "StoreTreeDrafter", "cut_at_end", "ngram_continuation", "ngram_matches"]
