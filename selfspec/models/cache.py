"""One KV cache shared by the full model and its drafts, rewound by position instead of cropped.

Every layer is a full-length `StaticLayer` (sliding-window layers too: their window comes from the
attention mask, so a draft that runs ahead never overwrites entries a later verify needs). Each forward
first points every layer's write position at the first input position; entries past that position are
stale but masked out by the causal mask until they are overwritten.
"""

import torch
from transformers import Cache, StaticLayer


class RewindableCache(Cache):
    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[StaticLayer(max_cache_len=max_len) for _ in range(num_layers)])
        self.max_len = max_len

    def rewind(self, length: int) -> None:
        """Make `length` the valid prefix on every layer: the next forward writes at position `length`."""
        for layer in self.layers:
            layer.cumulative_length.fill_(length)


def new_cache(model, max_len: int) -> RewindableCache:
    return RewindableCache(model.config.get_text_config().num_hidden_layers, max_len)


@torch.inference_mode()
def forward(model, cache: RewindableCache, input_ids: list[int], start: int, last_only: bool = False) -> torch.Tensor:
    """Run `input_ids` at positions start.. over the cache; return logits (len(input_ids) or 1, vocab) in fp32."""
    if start + len(input_ids) > cache.max_len:
        raise RuntimeError(f"cache holds {cache.max_len} positions, asked to write up to {start + len(input_ids)}")
    cache.rewind(start)
    device = model.device
    ids = torch.tensor([input_ids], device=device)  # (1, q)
    positions = torch.arange(start, start + len(input_ids), device=device)[None]  # (1, q)
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1 if last_only else 0)
    return out.logits[0].float()  # (q, vocab)
