"""transformers' sdpa attention without its one copy that verification pays for: grouped-query heads on the CPU.

With grouped-query attention (several query heads a key/value head) and an explicit mask, transformers' sdpa
attention feeds one query by folding the heads into the query rows, but a block of several queries (a
verification, a batch's forward) by copying every key/value head once per query head of its group (`repeat_kv`):
the whole cache, every layer, every verification. torch's kernel reads the grouped heads itself (`enable_gqa`);
transformers does not ask for it where a mask is given, as CUDA's fast kernels take no mask with it. On the CPU the
logits are the same to the bit.

`use_grouped_attention(model)` switches a model on transformers' sdpa to this, through transformers' own
registries (AttentionInterface, AttentionMaskInterface: the masks stay sdpa's).
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

GROUPED_SDPA = "selfspec_grouped_sdpa"


def grouped_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """query (batch, heads, q, dim), key and value (batch, kv_heads, keys, dim) -> ((batch, q, heads, dim), None).
    A masked block of several queries over grouped heads on the CPU runs in torch's kernel with `enable_gqa`;
    everything else is transformers' sdpa attention."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] == 1 or attention_mask is None
            or query.device.type != "cpu" or kwargs.get("position_bias") is not None or kwargs.get("softcap")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model) -> bool:
    """Switch `model` from transformers' sdpa to `grouped_sdpa_attention`; False (unchanged) for a model on another
    attention (Gemma-2's eager) or one that cannot switch."""
    if model.config._attn_implementation != "sdpa" or not model._can_set_attn_implementation():
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return True


def use_sdpa_attention(model) -> None:
    """Back to transformers' own sdpa attention (a stock copy of the model), if `use_grouped_attention` switched it."""
    if model.config._attn_implementation == GROUPED_SDPA:
        model.set_attn_implementation("sdpa")
