"""model.device_map and model.dtype: accelerate-placed models (split, offloaded) and bfloat16 decode as plain decoding.

No GPU here: the splits are CPU plus disk offload, which puts accelerate's hooks (AlignDevicesHook, weights loaded
at each forward) in the path just as a GPU split does.
"""

from dataclasses import replace

import pytest
import torch

from selfspec.data.prompt_sets import calibration_texts
from selfspec.decoding.draft_exit import DraftExit
from selfspec.decoding.drafters import KangarooDrafter, SelfDrafter
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models import output_layer
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.kangaroo_adapter import new_adapter
from selfspec.models.loading import load_model
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.settings import ModelSettings, default_settings, make_skip_set, typed

from helpers import run_settings

SAMPLING = default_settings().sampling  # the config's: greedy, 128 new tokens
GREEDY = replace(SAMPLING, max_new_tokens=32)
LAYERS = 6
# Layers 1, 2 and 4 and the output layer live on "disk": meta tensors, loaded by their hooks at each forward.
OFFLOADED = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk",
             **{f"model.layers.{i}": "disk" if i in (1, 2, 4) else "cpu" for i in range(LAYERS)}}
SKIPS = [make_skip_set([2], [2], LAYERS),  # a whole offloaded layer swapped out: layer 3's hook takes over
         make_skip_set([1, 5], [4], LAYERS),  # sublayers of offloaded layers, and the last layer's attention
         make_skip_set([5], [5], LAYERS)]  # the last layer: the final norm's hook takes over


def settings(**overrides) -> ModelSettings:
    return typed(ModelSettings, dict(name="m", source="tiny", family="llama", num_layers=LAYERS, hidden_size=64,
                                     sliding_window=16, seed=0, dtype="float32", device="cpu",
                                     packed_linears=True) | overrides, "model")


@pytest.fixture(scope="module")
def prompt():
    return byte_tokenizer()("def fibonacci(n):\n    ").input_ids


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    """A tiny Gemma-3 saved as a checkpoint: the source=hub path, placed by from_pretrained(device_map=...)."""
    folder = tmp_path_factory.mktemp("gemma3")
    tiny_model("gemma3", num_layers=LAYERS).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def self_spec(model, prompt, skip, head=None, sampling=GREEDY):
    drafter = SelfDrafter(model, skip, DraftExit(4), head)
    return generate(model, prompt, GenerationOptions(sampling), drafter), drafter


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("device_map", ["cpu", "auto"])
def test_one_device_maps_decode_as_plain(one_thread, prompt, family, device_map):
    plain = generate(load_model(settings(family=family)).model, prompt, GenerationOptions(GREEDY)).new_tokens
    model = load_model(settings(family=family, device_map=device_map)).model
    assert model.hf_device_map == {"": "cpu"}  # auto: everything fits in this machine's memory
    for skip in SKIPS:
        assert self_spec(model, prompt, skip)[0].new_tokens == plain


def offloaded_models(source, tmp_path, checkpoint):
    """(plain model, the same weights with OFFLOADED's layers on disk)."""
    where = dict(source="hub", path=checkpoint, family=None) if source == "hub" else dict(family=source)
    plain = load_model(settings(**where)).model
    offloaded = load_model(settings(**where, device_map=OFFLOADED, offload_folder=str(tmp_path))).model
    return plain, offloaded


@pytest.mark.parametrize("source", ["llama",  # tiny models through dispatch_model; a Gemma-3 checkpoint through
                                    pytest.param("gemma2", marks=pytest.mark.slow),  # from_pretrained
                                    pytest.param("hub", marks=pytest.mark.slow)])
def test_disk_offloaded_layers_with_skipping_decode_as_plain(one_thread, prompt, tmp_path, gemma3_checkpoint,
                                                              source):
    plain_model, model = offloaded_models(source, tmp_path, gemma3_checkpoint)
    layers = model.model.layers
    assert layers[2].mlp.up_proj.weight.device.type == "meta" and model.lm_head.weight.device.type == "meta"
    loads = []  # the offloaded layer 4's weight loads, one per forward through it
    hook = layers[4]._hf_hook
    pre_forward = hook.pre_forward
    hook.pre_forward = lambda module, *args, **kwargs: (loads.append(1), pre_forward(module, *args, **kwargs))[1]
    plain = generate(plain_model, prompt, GenerationOptions(GREEDY)).new_tokens
    head = make_draft_vocabulary(model, byte_tokenizer(), 64, calibration_texts())  # the offloaded rows, copied
    assert head.weight.device.type == "cpu" and torch.equal(head.weight, plain_model.lm_head.weight[head.token_ids])
    accepted = 0
    for skip, draft_vocabulary in zip(SKIPS, (head, None, None)):  # every forward of an offloaded layer reads the disk
        result = self_spec(model, prompt, skip, draft_vocabulary)[0]
        assert result.new_tokens == plain
        accepted += sum(step.accepted for step in result.steps)
    assert accepted > 0 and len(loads) > len(plain)  # drafts were used, and layer 4 ran through its hook
    assert layers[2].mlp.up_proj.weight.device.type == "meta"  # skipping restored the hooked layer, offloaded


def test_kangaroo_adapter_reads_offloaded_layers(one_thread, prompt, tmp_path):
    plain_model, model = offloaded_models("llama", tmp_path, None)
    adapter = new_adapter(model, 3)  # reads layer 2's output, which is offloaded
    adapter_from_disk = new_adapter(model, 2)  # its weights come from the offloaded layer 2
    for exit_layer, a in ((3, adapter), (2, adapter_from_disk)):
        reference = new_adapter(plain_model, exit_layer).state_dict()
        assert all(torch.equal(value, reference[key]) for key, value in a.state_dict().items())
    plain = generate(plain_model, prompt, GenerationOptions(GREEDY)).new_tokens
    assert generate(model, prompt, GenerationOptions(GREEDY), KangarooDrafter(model, adapter, 3, DraftExit(3))).new_tokens == plain


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bfloat16_stays_bfloat16_through_drafting_and_verification(one_thread, prompt, monkeypatch, family):
    model = load_model(settings(family=family, dtype="bfloat16", device_map="auto")).model
    seen = []  # (weight dtype, hidden dtype) of every output-layer product, the model's and the draft head's

    def spy(weight, hidden, finish=output_layer.LogitsFinish(), **options):
        seen.append((weight.dtype, hidden.dtype))
        logits = real(weight, hidden, finish, **options)
        assert torch.equal(logits.to(torch.bfloat16).float(), logits)  # computed in bf16, upcast only at the end
        return logits
    real = output_layer.output_logits
    monkeypatch.setattr(output_layer, "output_logits", spy)
    monkeypatch.setattr("selfspec.models.draft_vocabulary.output_logits", spy)
    head = make_draft_vocabulary(model, byte_tokenizer(), 64, calibration_texts())
    assert head.weight.dtype == torch.bfloat16
    for sampling in (GREEDY, replace(SAMPLING, temperature=1.0, max_new_tokens=32)):
        result, drafter = self_spec(model, prompt, make_skip_set([2], [3], LAYERS), head, sampling)
        assert len(result.new_tokens) == 32 and sum(step.drafted for step in result.steps) > 0
        cache = drafter.context.cache
        assert {layer.keys.dtype for layer in cache.layers} == {layer.values.dtype for layer in cache.layers} == {
            torch.bfloat16}
    assert len(seen) > 80 and set(seen) == {(torch.bfloat16, torch.bfloat16)}

    adapter = new_adapter(model, 3)
    assert {p.dtype for p in adapter.parameters()} == {torch.bfloat16}
    kangaroo = KangarooDrafter(model, adapter, 3, DraftExit(3))
    assert len(generate(model, prompt, GenerationOptions(GREEDY), kangaroo).new_tokens) == 32
    assert kangaroo.shallow.dtype == kangaroo.adapter_cache.layers[0].keys.dtype == torch.bfloat16


@pytest.mark.parametrize("value, named", [("gpu", "'gpu'"), ("disk", "'disk'"), ({"lm_head": "tpu"}, "'tpu'"),
                                          ({}, "{}"), (True, "True")])
def test_a_bad_device_map_is_one_line_naming_it_and_what_is_allowed(value, named):
    with pytest.raises(SelfspecError) as err:
        settings(device_map=value)
    message = str(err.value)
    assert message.startswith("model.device_map=") and named in message and "auto" in message
    assert "\n" not in message


def test_device_map_is_a_model_key_on_the_command_line():
    assert run_settings("model=tiny_llama", "model.device_map=auto").model.device_map == "auto"
    with pytest.raises(SelfspecError, match=r"^model\.device_map='gpu' is not allowed; allowed: .*auto"):
        run_settings("model=tiny_llama", "model.device_map=gpu")


@pytest.mark.parametrize("overrides, match", [
    (dict(device_map={"model.layers.0": "cpu"}), r"model\.device_map=.*lm_head"),  # modules left without a device
    (dict(device_map={**OFFLOADED}), r"on disk; set model\.offload_folder"),
])
def test_a_device_map_that_cannot_place_the_model_is_one_line(overrides, match):
    with pytest.raises(SelfspecError, match=match) as err:
        load_model(settings(**overrides))
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_map_without_cuda_is_a_config_error():
    with pytest.raises(SelfspecError, match=r"model\.device_map='cuda:0' but CUDA is not available"):
        load_model(settings(device_map="cuda:0"))
