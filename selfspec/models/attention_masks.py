"""Attention masks for forwards that transformers' own masks do not describe: token trees, and batches whose rows
sit at different lengths of one cache (each row a block as wide: a batch's forward packs blocks of different
widths, models/batch_cache.py).

Each row feeds a block of tokens at cache indices start, start + 1, ...; a block token sees the row's cache prefix,
its ancestors in the block and itself (`parents`: per block token its parent's block index, -1 for none, so a
chain is [-1, 0, 1, ...]) and sits at position start + its depth. On sliding-window layers it sees only keys within
the window by position, as transformers' sliding-window mask. The keys start at cache index `first` (a sliding
cache layer hands attention only its window, models/cache.py) and end at `key_end`.
"""

import weakref
from collections.abc import Callable

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from selfspec.models.cache import first_visible
from selfspec.models.devices import input_device


def chain(length: int) -> list[int]:
    """The block parents of a chain of `length` tokens: each sees the ones before it."""
    return list(range(-1, length - 1))


def ancestry(parents: list[int]) -> list[list[int]]:
    """Per block token the block indices it sees: its ancestors, root first, and itself."""
    seen = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; a parent must come before its child (or be -1, the root)")
        seen.append((seen[parent] if parent >= 0 else []) + [i])
    return seen


def tree_view(parents: list[int]) -> torch.Tensor:
    """(width, width) bool, True where block token j (row) sees block token i (column): its ancestors and itself."""
    width = len(parents)
    if parents == chain(width):  # a prompt or a draft chain: each token sees those before it
        return torch.ones(width, width, dtype=torch.bool).tril()
    visible = torch.zeros(width, width, dtype=torch.bool)
    for j, block_indices in enumerate(ancestry(parents)):
        visible[j, block_indices] = True
    return visible


def depths(parents: list[int]) -> torch.Tensor:
    """(width,) each block token's depth: how many ancestors it has."""
    if parents == chain(len(parents)):
        return torch.arange(len(parents))
    return torch.tensor([len(seen) - 1 for seen in ancestry(parents)])


def block_mask(parents: list[list[int]], starts: list[int], key_end: int, dtype: torch.dtype, device,
               sliding_window: int | None = None, first: int = 0) -> torch.Tensor:
    """(rows, 1, width, key_end - first) additive mask, 0 where a block token may attend and the dtype's minimum
    elsewhere; `parents`: per row its block's parents (every block `width` tokens), `starts`: per row the cache
    index of its block's first token."""
    width = block_width(parents)
    allowed = torch.zeros(len(parents), width, key_end - first, dtype=torch.bool)  # (rows, width, keys)
    query_positions = torch.zeros(len(parents), width, dtype=torch.long)
    key_positions = torch.arange(first, key_end).repeat(len(parents), 1)  # (rows, keys): a prefix key's is its index
    for row, (block, start) in enumerate(zip(parents, starts)):
        allowed[row, :, :start - first] = True
        view = tree_view(block)  # (width, width)
        allowed[row, :, start - first:start - first + width] = view
        query_positions[row] = start + view.sum(dim=1) - 1  # a token sees its ancestors and itself: depth + 1
        key_positions[row, start - first:start - first + width] = query_positions[row]
    if sliding_window is not None:
        allowed &= key_positions[:, None, :] > query_positions[:, :, None] - sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None].to(device)


def block_positions(parents: list[list[int]], starts: list[int], device) -> torch.Tensor:
    """(rows, width) position ids: start + depth per block token."""
    positions = torch.zeros(len(parents), block_width(parents), dtype=torch.long)
    for row, (block, start) in enumerate(zip(parents, starts)):
        positions[row] = start + depths(block)
    return positions.to(device)


def block_width(parents: list[list[int]]) -> int:
    """The width of every row's block."""
    widths = {len(block) for block in parents}
    if len(widths) != 1:
        raise ValueError(f"blocks of widths {sorted(widths)} in one mask; a batch's forward packs blocks of "
                         f"different widths (models/batch_cache.py)")
    return widths.pop()


def model_attention_masks(model, parents: list[list[int]], starts: list[int], key_end: int,
                          windowed_keys: bool) -> torch.Tensor | dict:
    """The mask argument the model's forward takes for blocks `parents` at `starts` (masks_by_layer_type).
    `windowed_keys`: the sliding layers hand attention their window only (one row, models/cache.py), else all keys."""
    dtype, device = model.dtype, input_device(model)

    def mask(window: int | None) -> torch.Tensor:
        first = first_visible(starts[0], window) if window is not None and windowed_keys else 0
        return block_mask(parents, starts, key_end, dtype, device, window, first)

    if model not in MODEL_WINDOWS:
        MODEL_WINDOWS[model] = mask_windows(model.config.get_text_config())
    return masks_by_layer_type(MODEL_WINDOWS[model], mask)


MODEL_WINDOWS = weakref.WeakKeyDictionary()  # model -> its mask_windows, read once: a read is dear beside a step


def mask_windows(config) -> int | dict[str, int | None] | None:
    """The masks a forward of `config`'s layers takes, as windows (None: full attention): one mask, None (Llama) or
    a window (Mistral's model-wide sliding window); or a dict, per layer type its window, for models that mix them
    (Gemma-2, Gemma-3 pick `mask[config.layer_types[i]]` per layer)."""
    if "sliding_attention" not in get_layer_types_and_kwargs(config)[0]:  # the layer types the cache is built from
        return None
    if not getattr(config, "layer_types", None):  # one window for every layer: the forward takes one mask
        return config.sliding_window
    return {"full_attention": None, "sliding_attention": config.sliding_window}


def masks_by_layer_type(windows: int | dict[str, int | None] | None,
                        mask: Callable[[int | None], torch.Tensor]) -> torch.Tensor | dict:
    """The mask argument a forward takes, from `mask(window)` and its layers' `mask_windows`."""
    if isinstance(windows, dict):
        return {layer_type: mask(window) for layer_type, window in windows.items()}
    return mask(windows)
