"""Packed decoder linears (models/packed_linear.py): same math as nn.Linear, swapped in at load where they apply,
and decoding over them stays lossless."""

import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import make_strategy
from selfspec.models.kangaroo_adapter import new_adapter
from selfspec.models.loading import load_model
from selfspec.models import output_layer
from selfspec.models.output_layer import model_logits, output_logits
from selfspec.models.packed_linear import PackedLinear, pack_linears
from selfspec.models.layouts import decoder_layers
from selfspec.models.tiny import tiny_model
from selfspec.settings import SkipSet, default_settings

from helpers import cfg, hf_greedy, run_settings


def linears(model) -> list[nn.Module]:
    return [m for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, (nn.Linear, PackedLinear))]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (1, 3, 48), (3, 7, 48)])  # 21 rows: padded to 24
def test_a_packed_linear_computes_what_the_linear_does(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x))
    assert packed(x).shape == (*shape[:-1], 80)
    state = packed.state_dict()  # the dense weight, as nn.Linear's own state dict has it
    assert state.keys() == linear.state_dict().keys()
    for key, value in linear.state_dict().items():
        assert torch.equal(state[key], value)


def test_a_rows_product_does_not_depend_on_the_rows_beside_it_or_their_padding():
    torch.manual_seed(0)
    packed, x = PackedLinear(nn.Linear(48, 80)), torch.randn(300, 48)
    with torch.inference_mode():
        every_row = packed(x)
        for rows in (1, 16, 17, 21, 40, 129, 299):  # unpadded up to 16, then padded to 20, 24, 40, 160, 320
            assert torch.equal(packed(x[:rows]), every_row[:rows])


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_back_the_linear_it_replaced(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    dense = packed.to_linear()
    assert type(dense) is nn.Linear and torch.equal(dense.weight, linear.weight)
    assert dense.weight.data_ptr() != linear.weight.data_ptr() and dense.bias is packed.bias  # bias shared
    x = torch.randn(3, 48)
    torch.testing.assert_close(dense(x), linear(x), rtol=0, atol=0)


def test_a_packed_linear_refuses_to_train_and_says_how_to_run_it():
    packed = PackedLinear(nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"torch\.no_grad\(\), or load it with model\.packed_linears=false"):
        packed(x)
    with torch.no_grad():
        assert packed(x).shape == (2, 8)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_load_packs_every_decoder_linear_of_a_float32_cpu_model_and_keeps_its_logits(family):
    packed = load_model(cfg(family=family)).model
    dense = load_model(cfg(family=family, packed_linears=False)).model
    assert linears(packed) and all(type(m) is PackedLinear for m in linears(packed))
    assert all(type(m) is nn.Linear for m in linears(dense))
    assert type(packed.get_output_embeddings()) is nn.Linear  # the output layer stays (often tied to the embedding)
    assert packed.get_output_embeddings().packed_weight is not None  # beside a packed copy of its weight
    assert not hasattr(dense.get_output_embeddings(), "packed_weight")
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [dict(dtype="bfloat16"), dict(device_map="cpu")])
def test_models_packing_does_not_apply_to_stay_dense(overrides):
    model = load_model(cfg(**overrides)).model
    assert all(type(m) is nn.Linear for m in linears(model))
    assert pack_linears(model) == 0


def test_a_kangaroo_adapter_copies_the_dense_weights_of_a_packed_layer():
    packed, dense = load_model(cfg()).model, load_model(cfg(packed_linears=False)).model
    copied, reference = new_adapter(packed, 2).state_dict(), new_adapter(dense, 2).state_dict()
    assert copied.keys() == reference.keys()
    assert all(torch.equal(copied[key], reference[key]) for key in reference)


@pytest.mark.parametrize("name", ["plain", "self_spec_fixed", "self_spec_hybrid", "self_spec_tree"])
def test_greedy_decoding_over_packed_linears_equals_hf_generate_on_the_same_model(name, tokenizer, prompt):
    model = tiny_model("llama", num_layers=6)  # float32: packing applies
    assert pack_linears(model) == 6 * 7
    draft = run_settings("model=tiny_llama", "draft.max_tokens=4").draft
    sampling = replace(default_settings().sampling, max_new_tokens=40)
    strategy = make_strategy(name, model, GenerationOptions(sampling), skip=SkipSet(attn=(1, 3), mlp=(2,)),
                             draft=draft)
    assert strategy.generate(prompt).new_tokens == hf_greedy(model, prompt, 40)


def test_the_packed_output_layer_scores_each_row_alike_whatever_the_rows_and_trains_through_the_dense_one():
    packed, dense = load_model(cfg()).model, load_model(cfg(packed_linears=False)).model
    torch.manual_seed(0)
    hidden = torch.randn(16, packed.config.hidden_size)
    with torch.inference_mode():
        logits = model_logits(packed, hidden)  # (16, vocab)
        torch.testing.assert_close(logits, model_logits(dense, hidden), rtol=1e-4, atol=1e-4)
        for rows in (1, 2, 5, 9):  # a row's logits do not depend on how many rows are scored with it
            assert torch.equal(model_logits(packed, hidden[:rows]), logits[:rows])
    trained = hidden[:3].clone().requires_grad_()  # a draft head's training backpropagates through the output layer
    model_logits(packed, trained).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


@pytest.mark.parametrize("slow", ["gemv", "two_row_gemm"])
def test_a_drafts_single_row_takes_the_faster_product_timed_once_per_shape(monkeypatch, slow):
    """Where one product is made slower, a draft head's single row takes the other, chosen on first use and kept
    for that shape; a verification's single row (no fastest_row) is always the two-row product."""
    calls = []
    real = getattr(output_layer, slow)

    def slowed(weight, hidden):
        calls.append(slow)
        time.sleep(0.005)
        return real(weight, hidden)

    monkeypatch.setattr(output_layer, slow, slowed)
    monkeypatch.setattr(output_layer, "_ONE_ROW", {})
    torch.manual_seed(0)
    weight, hidden = torch.randn(300, 16), torch.randn(1, 16)
    logits = output_logits(weight, hidden, fastest_row=True)  # (1, 300)
    timed = len(calls)
    torch.testing.assert_close(logits, (hidden @ weight.T).float(), rtol=1e-5, atol=1e-5)
    for _ in range(3):
        output_logits(weight, hidden, fastest_row=True)
    assert timed == len(calls) == 6  # timed in 6 rounds, the first untimed; since then only the other one ran
    other = "two_row_gemm" if slow == "gemv" else "gemv"
    assert output_layer._ONE_ROW[((300, 16), torch.float32, "cpu")].__name__ == other
    output_logits(weight, hidden)  # verification's row: the two-row product
    assert len(calls) == 6 + (slow == "two_row_gemm")
