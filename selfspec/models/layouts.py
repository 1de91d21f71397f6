"""Where each decoder-only architecture keeps its parts: the layout registry, keyed by `config.model_type`.

Layer skipping, the cost meter, packed linears and the trained draft parts (Kangaroo's adapter, the feature head)
find a model's decoder layers, each layer's attention and MLP sublayers and the final norm here, never by a
hard-coded attribute path. A model whose `model_type` is not registered ends in one line naming the registered
ones and how to add one. Adding a layout: one `Layout` entry below, and its tiny model in tests/test_architectures.py.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from selfspec.errors import SelfspecError


def _always(config) -> bool:
    return True


def _never(config) -> bool:
    return False


def _no_variant_refused(config) -> str | None:
    return None


def _as_layer(config, layer: int) -> None:
    """Make `config` (of a one-layer copy of layer `layer`) give its layer 0 what layer `layer` has: Gemma's sliding or
    global attention (and rope)."""
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[layer]]


def _as_sparse_or_dense_layer(config, layer: int) -> None:
    """Qwen3-MoE: whether a layer's MLP is the sparse block follows its index; keep layer `layer`'s kind at index 0."""
    _as_layer(config, layer)
    sparse = (layer not in config.mlp_only_layers and config.num_experts > 0
              and (layer + 1) % config.decoder_sparse_step == 0)
    config.decoder_sparse_step, config.mlp_only_layers = 1, ([] if sparse else [0])


@dataclass(frozen=True)
class Layout:
    family: str  # the architecture as users name it (messages, the README's table)
    layers: str  # the nn.ModuleList of decoder layers, a dotted path from the base model (`model.base_model`)
    attention: str  # a layer's attention sublayer; it returns (output, weights)
    mlp: tuple[str, ...]  # the modules of a layer's MLP sublayer, in call order (OPT's fc1, fc2 sit in the layer)
    norm: str  # the final norm, a dotted path from the base model
    parallel_residual: Callable[[object], bool] = _never  # x + attn(x) + mlp(x) rather than one after the other
    layer_returns_tuple: bool = False  # the layer returns (hidden, weights), not hidden (Falcon)
    cache_kwarg: str = "past_key_values"  # the name a layer receives the KV cache by
    # A layer whose two sublayers are skipped may be swapped for a pass-through: false where a norm sits on the
    # residual stream itself (OPT-350m's post-norms), which must still run
    whole_layer_skip: Callable[[object], bool] = _always
    # One-layer copies (Kangaroo's adapter, the feature head) are fed `inputs_embeds`; a base model that adds learnt
    # absolute positions to them (GPT-2, OPT) would add them a second time
    trained_parts: bool = True
    as_layer: Callable[[object, int], None] = _as_layer  # set a one-layer copy's config to copy layer i
    refused: Callable[[object], str | None] = _no_variant_refused  # a variant of the block our decoding gets wrong
    # transformers 5.23's assisted generation (hf_early_exit, hf_assistant) ends in an IndexError inside the cache
    # update of GPT-2, OPT, GPT-NeoX and Falcon models: those baselines are refused there
    hf_assisted: bool = True


def _llama_like(family: str, **options) -> Layout:
    """`model.layers[i].self_attn / .mlp`, final `model.norm`, one sublayer after the other."""
    return Layout(family, layers="layers", attention="self_attn", mlp=("mlp",), norm="norm", **options)


LAYOUTS: dict[str, Layout] = {
    "llama": _llama_like("Llama"),
    "mistral": _llama_like("Mistral"),
    "mixtral": _llama_like("Mixtral"),  # the MLP sublayer is a sparse MoE block
    "qwen2": _llama_like("Qwen2"),
    "qwen3": _llama_like("Qwen3"),
    "qwen3_moe": _llama_like("Qwen3-MoE", as_layer=_as_sparse_or_dense_layer),  # dense MLPs between sparse ones
    "gemma": _llama_like("Gemma"),
    "gemma2": _llama_like("Gemma-2"),
    "gemma3_text": _llama_like("Gemma-3 (text)"),
    "phi3": _llama_like("Phi-3"),
    "olmo2": _llama_like("OLMo-2"),
    "granite": _llama_like("Granite"),
    "gpt2": Layout("GPT-2", layers="h", attention="attn", mlp=("mlp",), norm="ln_f", trained_parts=False,
                   hf_assisted=False),
    "gpt_neox": Layout("GPT-NeoX", layers="layers", attention="attention", mlp=("mlp",), norm="final_layer_norm",
                       parallel_residual=lambda config: config.use_parallel_residual, cache_kwarg="layer_past",
                       hf_assisted=False),
    "falcon": Layout("Falcon", layers="h", attention="self_attention", mlp=("mlp",), norm="ln_f",
                     parallel_residual=lambda config: config.parallel_attn or config.new_decoder_architecture,
                     layer_returns_tuple=True, cache_kwarg="layer_past",
                     refused=lambda config: "ALiBi positions (alibi=true: Falcon-RW)" if config.alibi else None,
                     hf_assisted=False),
    "opt": Layout("OPT", layers="decoder.layers", attention="self_attn", mlp=("fc1", "fc2"),
                  norm="decoder.final_layer_norm", whole_layer_skip=lambda config: config.do_layer_norm_before,
                  trained_parts=False, hf_assisted=False),
}


def describe(model) -> str:
    """One line on the model's layout, e.g. `GPT-NeoX (gpt_neox): 4 layers, parallel residual`."""
    layout = layout_of(model)
    block = "parallel residual" if layout.parallel_residual(model.config.get_text_config()) else "sequential"
    return f"{layout.family} ({model_type(model)}): {num_layers(model)} layers, {block}"


def supported() -> str:
    return ", ".join(f"{layout.family} ({model_type})" for model_type, layout in LAYOUTS.items())


def model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def layout_of(model) -> Layout:
    """The registered layout of `model`; SelfspecError in one line for an architecture outside the registry."""
    layout = registered(model_type(model), f"model {type(model).__name__}")
    variant = layout.refused(model.config)
    if variant is not None:  # (its forward over our cache fails inside attention, untested for losslessness)
        raise SelfspecError(f"model {type(model).__name__}: {layout.family} with {variant} is not supported; "
                            f"supported: {supported()}")
    return layout


def registered(kind: str | None, what: str) -> Layout:
    """The layout of model_type `kind`; else one line saying that `what` (the model, a checkpoint) is not supported."""
    if kind not in LAYOUTS:
        raise SelfspecError(f"{what} (model_type {kind!r}) has no registered layout; supported: {supported()}; to add "
                            f"one, give LAYOUTS in selfspec/models/layouts.py its decoder layers, attention and MLP "
                            f"sublayers and final norm")
    return LAYOUTS[kind]


def base_model(model) -> nn.Module:
    """The decoder without its output layer: its forward gives `last_hidden_state`, the final normed states."""
    return model.base_model


def decoder_layers(model) -> nn.ModuleList:
    """The model's decoder layers, in order (one-line SelfspecError for an unregistered architecture)."""
    return _attribute(base_model(model), layout_of(model).layers)


def num_layers(model) -> int:
    return len(decoder_layers(model))


def final_norm(model) -> nn.Module:
    return _attribute(base_model(model), layout_of(model).norm)


def sublayer_modules(model, layer: nn.Module, kind: str) -> tuple[nn.Module, ...]:
    """The modules of `layer`'s attention (`kind` "attn") or MLP ("mlp") sublayer, in call order."""
    layout = layout_of(model)
    return tuple(getattr(layer, name) for name in ((layout.attention,) if kind == "attn" else layout.mlp))


def require_trained_parts(model, what: str) -> None:
    """`what` (a Kangaroo adapter, a feature head) needs a one-layer copy of the model: refused in one line where the
    layout cannot give one that computes as the model's own layer."""
    layout = layout_of(model)
    if not layout.trained_parts:
        raise SelfspecError(f"{what} is not supported for {layout.family} models: its base model adds learnt "
                            f"absolute positions to the inputs of a one-layer copy; use the layer-skip or copying "
                            f"strategies")


def require_hf_assisted(model, strategy: str) -> None:
    """HF's assisted generation (strategy hf_early_exit, hf_assistant): refused in one line where it fails."""
    layout = layout_of(model)
    if not layout.hf_assisted:
        raise SelfspecError(f"strategy {strategy} (transformers' assisted generation) fails on {layout.family} models "
                            f"in transformers 5.23; compare with hf_generate or hf_prompt_lookup")


def _attribute(root: nn.Module, path: str):
    for name in path.split("."):
        root = getattr(root, name)
    return root
