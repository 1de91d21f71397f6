"""Tiny randomly initialised models (seeded) with a byte-level tokenizer, for tests and quick runs: Llama, Gemma-2 and
Gemma-3 (text), and one of every other architecture in the layout registry (models/layouts.py), built offline from
transformers' config classes."""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)

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


def _other_architectures(hidden_size: int, sliding_window: int) -> dict[str, dict]:
    """Per `model_type`, what its config needs beyond the shared sizes: its own size names, sliding windows, experts,
    the variant of its block that the registry must handle (parallel residual, fused projections, post-norms)."""
    moe, head_dim = dict(num_experts_per_tok=2), dict(head_dim=hidden_size // 4)  # (Qwen3 and Gemma default to 128, 256)
    return {
        "llama3": dict(model_type="llama", rope_parameters=dict(  # Llama-3's RoPE scaling
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64)),
        "mistral": dict(sliding_window=sliding_window),  # one window for every layer
        "mixtral": dict(sliding_window=sliding_window, num_local_experts=4, **moe),
        "qwen2": dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1),  # mixed layers
        "qwen3": head_dim,  # q/k norms
        "qwen3_moe": dict(num_experts=4, moe_intermediate_size=hidden_size, decoder_sparse_step=2, **moe, **head_dim),
        "gemma": head_dim,
        "phi3": {},  # fused qkv and gate/up projections
        "olmo2": {},  # post-norms inside the residual branches
        "granite": dict(residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=2.0, attention_multiplier=0.25),
        "gpt2": dict(n_positions=4096),
        "gpt_neox": dict(use_parallel_residual=True, rotary_pct=0.5),
        "falcon": dict(parallel_attn=True, new_decoder_architecture=False),
        "opt": dict(ffn_dim=2 * hidden_size, word_embed_proj_dim=hidden_size, do_layer_norm_before=True),
    }


def tiny_model(family: str, num_layers: int = 4, hidden_size: int = 64, sliding_window: int = 16,
               seed: int = 0, init_std: float = 0.2):
    """A tiny model of `family`: llama, gemma2, gemma3 (text) or another key of `_other_architectures` (a model_type,
    or llama3). A large `init_std` spreads the logits, so greedy choices are not near-ties. Gemma-3's layers
    alternate as sliding, sliding, full."""
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
    others = _other_architectures(hidden_size, sliding_window)
    if family in others:
        specific = others[family]
        shared = {key: value for key, value in common.items() if key != "head_dim"}  # Falcon's is derived, read-only
        config = AutoConfig.for_model(specific.pop("model_type", family), **shared, **specific)
        return AutoModelForCausalLM.from_config(config).eval()
    raise ValueError(f"unknown tiny model family {family!r}; allowed: llama, gemma2, gemma3, {', '.join(others)}")
