"""One KV cache for a batch of generations, each row at its own length, and the forward that feeds every row at once.

Each layer holds (capacity, kv_heads, max_len, dim) buffers. Every generation decodes over its row as over a cache
of its own: `view(row)` is a batch-1 `RewindableCache` whose buffers are that row of the batch's (views, no copy),
so prefills, drafts, rewinds and tree compaction run per row exactly as at batch size 1. `forward_batch` then feeds
rows 0..n-1 one block each (the last token and its draft) at each row's own cache index in one forward; the rows'
blocks are padded to the widest and an explicit mask (models/attention_masks.py) keeps each row to its own prefix,
block and, on sliding-window layers, window. A row that leaves gives its slot to the batch's last row (`move`), so
the active rows are always the first n and the forward slices the buffers instead of copying them.
"""

import torch
from transformers import Cache

from selfspec.models.attention_masks import block_positions, chain, model_attention_masks
from selfspec.models.cache import RewindableCache, RewindableLayer, new_cache
from selfspec.models.devices import input_device
from selfspec.models.layouts import base_model
from selfspec.models.output_layer import model_logits


class BatchLayer(RewindableLayer):
    """A layer of the batch cache: writes each row's block at that row's start, returns every key up to the end of
    the furthest block (the mask says which each row sees)."""

    def __init__(self, max_len: int):
        super().__init__(max_len)
        self.starts: list[int] = []  # per fed row, the cache index of its block (BatchCache.feed)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, width = key_states.shape[0], key_states.shape[-2]  # key_states: (rows, kv_heads, width, dim)
        for row, start in enumerate(self.starts):
            self.key_buffer[row, :, start:start + width] = key_states[row]
            self.value_buffer[row, :, start:start + width] = value_states[row]
        end = max(self.starts) + width
        return self.key_buffer[:rows, :, :end], self.value_buffer[:rows, :, :end]


class BatchCache(Cache):
    def __init__(self, model, capacity: int, max_len: int):
        """Room for `capacity` generations of up to `max_len` positions each (prompt, output and a draft's block)."""
        layers = len(new_cache(model, 1).layers)
        super().__init__(layers=[BatchLayer(max_len) for _ in range(layers)])
        self.model, self.capacity, self.max_len = model, capacity, max_len
        self.starts: list[int] = []  # per fed row, the cache index of its block in the running forward
        forward_batch(model, self, [[0]] * capacity, [0] * capacity)  # allocates the buffers (rows, ..., max_len)
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

    def placement(self, view: RewindableCache) -> tuple[int, int] | None:
        """(row, cache index of its block) of `view`'s generation in the running forward; None: not fed."""
        row = next((row for row, candidate in enumerate(self.views) if candidate is view), None)
        return None if row is None or row >= len(self.starts) else (row, self.starts[row])

    def feed(self, starts: list[int]) -> None:
        """The next forward feeds rows 0..len(starts)-1, each at its start ([]: the forward is over)."""
        self.starts = list(starts)
        for layer in self.layers:
            layer.starts = self.starts

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.starts, default=0)


@torch.inference_mode()
def forward_batch_hidden(model, cache: BatchCache, blocks: list[list[int]], starts: list[int],
                         parents: list[list[int]] | None = None) -> torch.Tensor:
    """Feed rows 0..len(blocks)-1 of `cache`: row r's token ids blocks[r] at cache indices starts[r].., a chain or,
    with parents[r], a tree (models/attention_masks.py). Returns the final (normed) hidden states
    (rows, widest block, hidden); a row's positions past its own block are padding."""
    parents = parents or [chain(len(block)) for block in blocks]
    width = max(map(len, blocks))
    if max(starts) + width > cache.max_len:
        raise RuntimeError(f"cache holds {cache.max_len} positions, asked to write up to {max(starts) + width}")
    device = input_device(model)
    ids = torch.zeros(len(blocks), width, dtype=torch.long)  # (rows, width), right-padded
    for row, block in enumerate(blocks):
        ids[row, :len(block)] = torch.tensor(block)
    cache.feed(starts)
    try:
        return base_model(model)(input_ids=ids.to(device), position_ids=block_positions(parents, starts, device),
                                 attention_mask=model_attention_masks(model, parents, starts, max(starts) + width,
                                                                      windowed_keys=False),
                                 past_key_values=cache, use_cache=True).last_hidden_state
    finally:
        cache.feed([])


@torch.inference_mode()
def forward_batch(model, cache: BatchCache, blocks: list[list[int]], starts: list[int],
                  parents: list[list[int]] | None = None) -> list[torch.Tensor]:
    """`forward_batch_hidden` through the output layer: per row its block's fp32 logits (len(blocks[r]), vocab)."""
    hidden = forward_batch_hidden(model, cache, blocks, starts, parents)  # (rows, width, hidden)
    logits = model_logits(model, torch.cat([hidden[row, :len(block)] for row, block in enumerate(blocks)]))
    return list(logits.split([len(block) for block in blocks]))
