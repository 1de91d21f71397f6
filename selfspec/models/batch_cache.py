"""One KV cache for a batch of generations, each row at its own length, and the forward that feeds every row at once.

Each layer holds (capacity, kv_heads, max_len, dim) buffers. Every generation decodes over its row as over a cache
of its own: `view(row)` is a batch-1 `RewindableCache` whose buffers are that row of the batch's (views, no copy),
so drafts, rewinds and tree compaction run per row exactly as at batch size 1. `forward_rows_hidden` then feeds
some rows one block each (the last token and its draft, or a joining row's prompt) at each row's own cache index in
one forward, packed: the blocks one after another in one sequence, so the linear layers see only the tokens fed,
never padding (a row that drafts 8 tokens beside three that draft none makes a forward of 12 tokens, not 4 x 9).
Attention runs per row (`rows_attention`): the row's queries over its own keys, under its own mask
(models/attention_masks.py: prefix, block and, on sliding-window layers, window), by the model's own attention
function, switched in through transformers' AttentionInterface for that forward. A row that leaves gives its slot
to the batch's last row (`move`), so the active rows are always the first n.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import AttentionInterface, Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from selfspec.models.attention_masks import block_positions, chain, model_attention_masks
from selfspec.models.cache import RewindableCache, RewindableLayer, new_cache
from selfspec.models.devices import input_device
from selfspec.models.layouts import base_model
from selfspec.models.output_layer import model_logits

ROWS_ATTENTION = "selfspec_rows"


@dataclass
class Feed:
    """One packed forward: cache row rows[i] gets a block of widths[i] tokens at cache index starts[i], the blocks one
    after another in the forward's one sequence. `masks`: per block its mask argument (model_attention_masks), or,
    where every block is as wide and the rows are 0..n-1 (a plain step; a draft forward of every row), one mask
    argument for all rows as a batch (`stacked`), which runs attention in one call instead of one a row."""
    rows: list[int]
    starts: list[int]
    widths: list[int]
    masks: list
    attention: str = "sdpa"  # the model's own attention implementation, which each row's attention runs
    stacked: bool = False

    @property
    def end(self) -> int:
        """The cache index just past the furthest block."""
        return max(start + width for start, width in zip(self.starts, self.widths))

    @cached_property
    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed tokens,) twice: each fed token's cache row and cache index, to write every row's keys in one op."""
        rows = [row for row, width in zip(self.rows, self.widths) for _ in range(width)]
        indices = [start + i for start, width in zip(self.starts, self.widths) for i in range(width)]
        return torch.tensor(rows), torch.tensor(indices)

    def blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """(row, cache index, first query of the sequence, width) per fed block."""
        first = 0
        for row, start, width in zip(self.rows, self.starts, self.widths):
            yield row, start, first, width
            first += width


class BatchLayer(RewindableLayer):
    """A layer of the batch cache: writes each fed block at its row's start, returns every row's keys up to the end
    of the furthest block (rows_attention takes each row's own)."""

    def __init__(self, capacity: int, max_len: int):
        super().__init__(max_len)
        self.capacity = capacity
        self.feed: Feed | None = None  # the running forward's (BatchCache.feed)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """(capacity, kv_heads, max_len, dim) buffers in the dtype and on the device of the first keys/values."""
        self.dtype, self.device = key_states.dtype, key_states.device
        heads = key_states.shape[1]
        self.key_buffer = key_states.new_zeros(self.capacity, heads, self.max_len, key_states.shape[-1])
        self.value_buffer = value_states.new_zeros(self.capacity, heads, self.max_len, value_states.shape[-1])
        self.is_initialized = True
        self.rewind(self.length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        token_rows, indices = (index.to(self.key_buffer.device) for index in self.feed.slots)
        self.key_buffer[token_rows, :, indices] = key_states[0].transpose(0, 1)  # (packed tokens, kv_heads, dim)
        self.value_buffer[token_rows, :, indices] = value_states[0].transpose(0, 1)
        rows, end = max(self.feed.rows) + 1, self.feed.end
        return self.key_buffer[:rows, :, :end], self.value_buffer[:rows, :, :end]


def rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, feed: Feed, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, packed tokens, dim), key and value (rows, kv_heads, keys, dim) -> ((1, packed tokens, heads,
    dim), None): each fed block's queries attend to its own row's keys under its own mask, by the model's own
    attention function (`feed.attention`; the modeling module's eager attention where that is eager)."""
    own = ALL_ATTENTION_FUNCTIONS.get_interface(feed.attention, sys.modules[type(module).__module__]
                                                .eager_attention_forward)
    if feed.stacked:  # the blocks as a batch of rows 0..n-1, each as wide: (n, heads, width, dim)
        rows, width = len(feed.rows), feed.widths[0]
        output, _ = own(module, query[0].unflatten(1, (rows, width)).transpose(0, 1), key, value,
                        layer_mask(module, feed.masks[0]), **kwargs)  # (n, width, heads, dim)
        return output.flatten(0, 1)[None], None
    outputs = []
    for (row, start, first, width), mask in zip(feed.blocks(), feed.masks):
        output, _ = own(module, query[:, :, first:first + width], key[row:row + 1, :, :start + width],
                        value[row:row + 1, :, :start + width], layer_mask(module, mask), **kwargs)
        outputs.append(output)  # (1, width, heads, dim)
    return torch.cat(outputs, dim=1), None


def layer_mask(module, mask: torch.Tensor | dict) -> torch.Tensor:
    """The mask of `module`'s layer from a mask argument: itself, or its layer type's (Gemma-2, Gemma-3)."""
    return mask[module.config.layer_types[module.layer_idx]] if isinstance(mask, dict) else mask


AttentionInterface.register(ROWS_ATTENTION, rows_attention)


@contextmanager
def attention_by_rows(model) -> Iterator[str]:
    """`rows_attention` for the forwards inside; yields the model's own attention implementation."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = ROWS_ATTENTION
    try:
        yield own
    finally:
        config._attn_implementation = own


class BatchCache(Cache):
    def __init__(self, model, capacity: int, max_len: int):
        """Room for `capacity` generations of up to `max_len` positions each (prompt, output and a draft's block)."""
        layers = len(new_cache(model, 1).layers)
        super().__init__(layers=[BatchLayer(capacity, max_len) for _ in range(layers)])
        self.model, self.capacity, self.max_len = model, capacity, max_len
        self.running: Feed | None = None  # the running forward's
        forward_rows_hidden(model, self, [0], [[0]], [0])  # allocates the buffers (capacity, ..., max_len)
        self.views = [self._view(row) for row in range(capacity)]  # views[row]: the generation in that row

    def _view(self, row: int) -> RewindableCache:
        view = new_cache(self.model, self.max_len)
        view.batch = self
        self._point(view, row)
        return view

    def _point(self, view: RewindableCache, row: int) -> None:
        for layer, batch_layer in zip(view.layers, self.layers):
            layer.key_buffer = batch_layer.key_buffer[row:row + 1]  # (1, kv_heads, max_len, dim), shared storage
            layer.value_buffer = batch_layer.value_buffer[row:row + 1]
            layer.dtype, layer.device, layer.is_initialized = batch_layer.dtype, batch_layer.device, True
            layer.rewind(layer.length)

    def view(self, row: int) -> RewindableCache:
        """Row `row` as a batch-1 cache, rewound to empty: a new generation decodes over it."""
        view = self.views[row]
        view.rewind(0)
        view.followers.clear()
        return view

    @torch.inference_mode()
    def move(self, source: int, destination: int) -> None:
        """Copy row `source`'s entries (its valid prefix) into row `destination`; its generation's view follows them
        there."""
        length = self.views[source].get_seq_length()
        for layer in self.layers:
            layer.key_buffer[destination, :, :length] = layer.key_buffer[source, :, :length]
            layer.value_buffer[destination, :, :length] = layer.value_buffer[source, :, :length]
        self.views[source], self.views[destination] = self.views[destination], self.views[source]
        self._point(self.views[destination], destination)
        self._point(self.views[source], source)

    def placement(self, view: RewindableCache) -> tuple[slice, int] | None:
        """(its block's tokens in the running forward's sequence, cache index of its block) of `view`'s generation;
        None: not fed."""
        row = next((row for row, candidate in enumerate(self.views) if candidate is view), None)
        for fed, start, first, width in self.running.blocks() if self.running is not None else ():
            if fed == row:
                return slice(first, first + width), start
        return None

    def feed(self, feed: Feed | None) -> None:
        """The next forward's blocks (None: the forward is over)."""
        self.running = feed
        for layer in self.layers:
            layer.feed = feed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.running.starts, default=0) if self.running is not None else 0


@torch.inference_mode()
def forward_rows_hidden(model, cache: BatchCache, rows: list[int], blocks: list[list[int]], starts: list[int],
                        parents: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Feed cache rows `rows` in one packed forward: row rows[i] the token ids blocks[i] at cache indices starts[i]..,
    a chain or, with parents[i], a tree (models/attention_masks.py). Returns per fed row the final (normed) hidden
    states of its block (len(blocks[i]), hidden)."""
    parents = parents or [chain(len(block)) for block in blocks]
    widths = [len(block) for block in blocks]
    stacked = len(set(widths)) == 1 and list(rows) == list(range(len(rows)))
    feed = Feed(list(rows), list(starts), widths, [], stacked=stacked)
    if feed.end > cache.max_len:
        raise RuntimeError(f"cache holds {cache.max_len} positions, asked to write up to {feed.end}")
    device = input_device(model)
    ids = torch.tensor([[token for block in blocks for token in block]], device=device)  # (1, packed tokens)
    positions = torch.cat([block_positions([tree], [start], device) for tree, start in zip(parents, starts)], dim=1)
    feed.masks = ([model_attention_masks(model, parents, starts, feed.end, windowed_keys=False)] if stacked
                  else [model_attention_masks(model, [tree], [start], start + len(tree), windowed_keys=False)
                        for tree, start in zip(parents, starts)])
    with attention_by_rows(model) as own:
        feed.attention = own
        cache.feed(feed)
        try:
            hidden = base_model(model)(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                                       feed=cache.running).last_hidden_state[0]  # (packed tokens, hidden)
        finally:
            cache.feed(None)
    return list(hidden.split(widths))


@torch.inference_mode()
def forward_batch(model, cache: BatchCache, blocks: list[list[int]], starts: list[int],
                  parents: list[list[int]] | None = None, last_only: list[int] = ()) -> list[torch.Tensor]:
    """Rows 0..len(blocks)-1 in one packed forward (`forward_rows_hidden`) through the output layer: per row its
    block's fp32 logits (len(blocks[r]), vocab), or for the rows in `last_only` (prefills) its last token's (1,
    vocab)."""
    hidden = forward_rows_hidden(model, cache, list(range(len(blocks))), blocks, starts, parents)
    hidden = [row_hidden[-1:] if row in last_only else row_hidden for row, row_hidden in enumerate(hidden)]
    logits = model_logits(model, torch.cat(hidden))
    return list(logits.split([len(row_hidden) for row_hidden in hidden]))
