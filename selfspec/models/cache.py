"""One KV cache shared by the full model and its drafts, rewound by position instead of cropped.

Each layer preallocates `max_len` positions and hands attention a view of exactly the valid prefix, so the
attention math (and its rounding) is the same as with transformers' DynamicCache. Sliding-window layers
(Gemma-2/3) keep full length too, so a draft that runs ahead never overwrites entries a later verification
needs, but hand attention only what transformers' DynamicSlidingWindowLayer would: the last window - 1
cached entries plus the new ones, with `get_mask_sizes` to match. On long prompts that is a window instead
of the whole prefix on most of Gemma-3's layers, and transformers' masking then skips the sliding mask.
Every forward first rewinds all layers to the position of its first input token; layers skipped by a draft
write nothing and are simply rewound with the rest.
"""

import torch
from transformers import Cache, DynamicLayer
from transformers.cache_utils import get_layer_types_and_kwargs

from selfspec.models.devices import input_device
from selfspec.models.layouts import base_model
from selfspec.models.output_layer import model_logits


class RewindableLayer(DynamicLayer):
    def __init__(self, max_len: int, sliding_window: int | None = None):
        super().__init__()
        self.max_len, self.length = max_len, 0
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # transformers' masking picks the sliding mask's sizes by it

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers in the dtype and on the device of the first keys/values: the layer's own, under a device map."""
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.key_buffer = key_states.new_zeros(batch, heads, self.max_len, key_states.shape[-1])
        self.value_buffer = value_states.new_zeros(batch, heads, self.max_len, value_states.shape[-1])
        self.is_initialized = True
        self.rewind(self.length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, end = self.first_visible(self.length), self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.rewind(end)
        return self.key_buffer[:, :, first:end], self.value_buffer[:, :, first:end]  # (batch, kv_heads, end-first, dim)

    def first_visible(self, start: int) -> int:
        return first_visible(start, self.sliding_window)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next `update` returns, for transformers' mask functions."""
        first = self.first_visible(self.length)
        return self.length - first + query_length, first

    def rewind(self, length: int) -> None:
        self.length = length
        if self.is_initialized:
            self.keys = self.key_buffer[:, :, :length]
            self.values = self.value_buffer[:, :, :length]

    def get_seq_length(self) -> int:
        return self.length

    @torch.inference_mode()  # the buffers were made inside the forward's inference mode
    def move(self, first: int, sources: torch.Tensor) -> None:
        """Copy the entries at positions `sources` (ascending, each at or after its destination) to first, first + 1
        and on."""
        if self.is_initialized:
            sources = sources.to(self.key_buffer.device)
            end = first + len(sources)
            self.key_buffer[:, :, first:end] = self.key_buffer[:, :, sources]  # indexing copies: overlap is safe
            self.value_buffer[:, :, first:end] = self.value_buffer[:, :, sources]


def first_visible(start: int, sliding_window: int | None) -> int:
    """The first cache index attention sees for queries from `start` on: 0, or on a sliding layer the first of the
    last window - 1 entries before `start` (as DynamicSlidingWindowLayer keeps)."""
    return 0 if sliding_window is None else max(start - sliding_window + 1, 0)


class RewindableCache(Cache):
    def __init__(self, num_layers: int, max_len: int, sliding_windows: list[int | None] | None = None):
        """`sliding_windows`: per layer its window, None for full attention (default: every layer full)."""
        windows = sliding_windows or [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} sliding windows for {num_layers} layers")
        super().__init__(layers=[RewindableLayer(max_len, window) for window in windows])
        self.max_len = max_len
        self.batch = None  # the BatchCache this cache is a row of (models/batch_cache.py); None: a cache of its own
        self.followers: list[torch.Tensor] = []  # (max_len, ...) per-position buffers that `compact` moves too

    def follow(self, buffer: torch.Tensor) -> None:
        """Keep `buffer` (max_len, ...), indexed as the cache (e.g. a draft head's features), in step with the
        entries: a tree's accepted path moves in it as in the K/V."""
        self.followers.append(buffer)

    def written_at(self, cache: Cache, width: int) -> tuple[slice, int] | None:
        """Where a forward over `cache` that fed `width` tokens put this cache's entries: (their tokens in the
        forward's one sequence, first cache index); None when it fed this cache nothing (another generation's
        forward)."""
        if cache is self:
            return slice(0, width), self.get_seq_length() - width
        return self.batch.placement(self) if self.batch is not None and cache is self.batch else None

    def in_use(self, cache: Cache) -> bool:
        """Whether a forward over `cache` may belong to this cache's generation: over it, or over a cache of its
        batch (the generation has not ended: its neighbours decode beside it)."""
        return cache is self or (self.batch is not None and (cache is self.batch or getattr(cache, "batch", None)
                                                             is self.batch))

    def rewind(self, length: int) -> None:
        """Make `length` the valid prefix on every layer: the next forward writes at position `length`."""
        for layer in self.layers:
            layer.rewind(length)

    def compact(self, first: int, sources: list[int]) -> None:
        """Keep a token tree's accepted path: the entries at `sources` move to positions first.. on every layer, and
        the cache is rewound to just after them (decoding/tree.py). A path down the tree's first branch is in place
        already: nothing moves."""
        if sources != list(range(first, first + len(sources))):
            index = torch.tensor(sources)
            for layer in self.layers:
                layer.move(first, index)
            with torch.inference_mode():
                for buffer in self.followers:
                    buffer[first:first + len(sources)] = buffer[index.to(buffer.device)]
        self.rewind(first + len(sources))


def new_cache(model, max_len: int) -> RewindableCache:
    """A cache for `model` with a sliding layer wherever transformers' DynamicCache would put one."""
    config = model.config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    windows = [kwargs["sliding_window"] if kind == "sliding_attention" else None
               for kind, kwargs in zip(layer_types, layer_kwargs)]
    return RewindableCache(config.num_hidden_layers, max_len, windows)


def _inputs(model, cache: RewindableCache, input_ids: list[int], start: int) -> dict:
    """Rewind the cache to `start` and build the model inputs for positions start.."""
    if start + len(input_ids) > cache.max_len:
        raise RuntimeError(f"cache holds {cache.max_len} positions, asked to write up to {start + len(input_ids)}")
    cache.rewind(start)
    device = input_device(model)  # with a device map, accelerate's hooks move them on layer by layer
    ids = torch.tensor([input_ids], device=device)  # (1, q)
    positions = torch.arange(start, start + len(input_ids), device=device)[None]  # (1, q)
    return dict(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)


@torch.inference_mode()
def forward_hidden(model, cache: RewindableCache, input_ids: list[int], start: int) -> torch.Tensor:
    """Like `forward` without the output layer: the final (normed) hidden state of the last position (hidden,)."""
    return base_model(model)(**_inputs(model, cache, input_ids, start)).last_hidden_state[0, -1]


@torch.inference_mode()
def forward(model, cache: RewindableCache, input_ids: list[int], start: int, last_only: bool = False) -> torch.Tensor:
    """Run `input_ids` at positions start.. over the cache; return logits (len(input_ids) or 1, vocab) in fp32."""
    hidden = base_model(model)(**_inputs(model, cache, input_ids, start)).last_hidden_state[0]  # (q, hidden)
    if last_only:
        hidden = hidden[-1:]
    return model_logits(model, hidden)
