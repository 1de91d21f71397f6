"""Tiny randomly initialised models (seeded) with a byte-level tokenizer, for tests and quick runs."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2; bytes follow
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (ids 3..258) plus pad/bos/eos, with a minimal chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", chat_template=CHAT_TEMPLATE)


def tiny_model(family: str, num_layers: int = 4, hidden_size: int = 64, sliding_window: int = 16,
               seed: int = 0, init_std: float = 0.2):
    """A tiny Llama, Gemma-2 or Gemma-3 (text) model. A large `init_std` spreads the logits, so greedy choices are not
    near-ties. Gemma-3's layers alternate as sliding, sliding, full."""
    common = dict(vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=hidden_size,
                  intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=4096,
                  initializer_range=init_std, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if family == "gemma2":
        config = Gemma2Config(**common, sliding_window=sliding_window, query_pre_attn_scalar=hidden_size // 4)
        return Gemma2ForCausalLM(config).eval()
    if family == "gemma3":
        layer_types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)]
        config = Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=layer_types,
                                  query_pre_attn_scalar=hidden_size // 4)
        return Gemma3ForCausalLM(config).eval()
    raise ValueError(f"unknown tiny model family {family!r}; allowed: llama, gemma2, gemma3")
