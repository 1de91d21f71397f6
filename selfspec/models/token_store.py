"""A token store: the model's own generations as a datastore to draft from (REST: He et al., NAACL 2024,
"REST: Retrieval-Based Speculative Decoding"; StoreTreeDrafter in decoding/drafters/layer_skip_tree.py drafts
from it).

The generations are one token array, and every position's next `max_n` tokens are packed into one 64-bit key, sorted:
the positions after any n-gram (n <= max_n) are one binary search away. What followed the context's longest suffix
that the store holds, counted, is a next-token distribution. experiment=train_draft writes one (`store.pt`) from the
generations its draft learns from; on disk it is a trained part of kind "store" (models/trained_parts.py): the
sequences, -1 between them, and the signature of the model that wrote them.
"""

import sys
from pathlib import Path
from weakref import WeakKeyDictionary

import numpy as np
import torch

from selfspec.models.cache_files import save_checked
from selfspec.models.trained_parts import SHIPPED, read_part, model_signature, shipped_path

KIND = "store"
TRAIN_HINT = "make one with python run.py experiment=train_draft (it writes store.pt beside head.pt)"
SEPARATOR = -1  # between sequences on disk


class TokenStore:
    """Sequences of token ids (`flat`: one array, SEPARATOR between them) over a vocabulary of `vocab_size` ids."""

    def __init__(self, flat: np.ndarray, vocab_size: int):
        self.vocab_size, self.end = vocab_size, vocab_size  # `end` stands for SEPARATOR: no context holds it
        self.bits = vocab_size.bit_length()  # ids 0..vocab_size fit
        self.max_n = 64 // self.bits  # SmolLM2's 49,152 ids: 4-grams; Gemma-3's 262,144: 3-grams
        flat = np.asarray(flat, dtype=np.int64)
        if len(flat) and (flat.max() >= vocab_size or flat.min() < SEPARATOR):
            raise ValueError(f"a token store holds ids in [0, {vocab_size}) and {SEPARATOR} between sequences")
        tokens = np.where(flat == SEPARATOR, self.end, flat).astype(np.uint64)
        self.tokens = np.concatenate([tokens, np.full(self.max_n, self.end, dtype=np.uint64)])  # (N + max_n,)
        keys = np.zeros(len(tokens), dtype=np.uint64)  # (N,): tokens[i:i + max_n], the first in the top bits
        for j in range(self.max_n):
            keys = (keys << np.uint64(self.bits)) | self.tokens[j:j + len(keys)]
        self.order = np.argsort(keys, kind="stable")  # (N,)
        self.keys = keys[self.order]
        self.unigram = self.counts(np.arange(len(keys)), 0)

    @classmethod
    def of(cls, sequences: list[list[int]], vocab_size: int) -> "TokenStore":
        return cls(flatten(sequences), vocab_size)

    def __len__(self) -> int:
        return len(self.keys)

    def counts(self, positions: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts) of the tokens n after `positions`, separators left out."""
        ids, counts = np.unique(self.tokens[positions + n], return_counts=True)
        kept = ids != self.end
        return ids[kept].astype(np.int64), counts[kept]

    def next_counts(self, context: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts): what followed the longest suffix of `context` (at most max_n tokens) that the store holds;
        the store's unigram counts where it holds none."""
        return self.longest_match(context)[1:]

    def longest_match(self, context: list[int]) -> tuple[int, np.ndarray, np.ndarray]:
        """(n, ids, counts): the longest suffix of `context` that the store holds, n tokens (at most max_n), and
        `next_counts` after it; n 0 where it holds none."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            key = 0
            for token in context[-n:]:
                key = (key << self.bits) | token
            low = key << self.bits * (self.max_n - n)
            high = low + (1 << self.bits * (self.max_n - n))
            first, last = np.searchsorted(self.keys, np.array([low, high], dtype=np.uint64))
            if last > first:
                ids, counts = self.counts(self.order[first:last], n)
                if len(ids):
                    return n, ids, counts
        return 0, *self.unigram

    def next_logits(self, context: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """(vocab_size,) the log of `next_counts`, -inf for ids it does not hold: softmax gives their shares."""
        ids, counts = self.next_counts(context)
        logits = np.full(self.vocab_size, -np.inf, dtype=np.float32)  # (vocab_size,); numpy fills on one thread,
        # where torch.full wakes its thread pool, slow while another process holds the cores
        logits[ids] = np.log(counts)
        return torch.from_numpy(logits).to(device)


def flatten(sequences: list[list[int]]) -> np.ndarray:
    return np.array([t for seq in sequences for t in (*seq, SEPARATOR)], dtype=np.int64)


def output_vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def save_token_store(path, sequences: list[list[int]], model, **info) -> None:
    """Write the store of `sequences` (token ids each, as `model` wrote them)."""
    save_checked({"kind": KIND, "state_dict": {"tokens": torch.from_numpy(flatten(sequences)).int()},
                  "model": model_signature(model), "sequences": len(sequences), **info}, Path(path))


def load_token_store(path, model, setting: str = "draft.store") -> TokenStore:
    """The store at `path` (a store.pt, or `shipped`: the package's store for this model), written by `model`."""
    saved = read_part(path, model, KIND, setting, TRAIN_HINT)
    return TokenStore(saved["state_dict"]["tokens"].numpy(), output_vocab_size(model))


_LOADED: WeakKeyDictionary = WeakKeyDictionary()  # model -> {path: its store}, shared by the strategies of a run


def loaded_token_store(model, path: str | None) -> TokenStore | None:
    """`load_token_store` once per model and path (None: no store). `shipped` where none ships for this model gives
    None after one warning."""
    if path is None:
        return None
    stores = _LOADED.setdefault(model, {})
    if path == SHIPPED and path not in stores and shipped_path(model, KIND, "draft.store") is None:
        print("selfspec: warning: draft.store=shipped: no token store ships for this model; drafting without one "
              f"({TRAIN_HINT})", file=sys.stderr)
        stores[path] = None
    if path not in stores:
        stores[path] = load_token_store(path, model)
    return stores[path]
