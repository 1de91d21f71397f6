"""load_model: tiny and hub models, config errors, the embedded GGUF models and their safetensors cache.

The GGUF models are cached under the default ~/.cache/selfspec, so only the first run converts (~20 s + ~60 s);
tests that load them are marked slow.
"""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.errors import SelfspecError
from selfspec.models import checkpoints
from selfspec.models.grouped_attention import GROUPED_SDPA
from selfspec.models.loading import load_model
from selfspec.models.tiny import byte_tokenizer, tiny_model

from helpers import cfg


@pytest.mark.parametrize("family, dtype, attn", [("llama", "float32", GROUPED_SDPA), ("gemma2", "bfloat16", "eager")])
def test_tiny_model_has_requested_shape_dtype_and_attention(family, dtype, attn):
    lm = load_model(cfg(family=family, num_layers=5, dtype=dtype))
    assert lm.name == "m" and not lm.model.training
    assert len(lm.model.model.layers) == 5
    assert lm.model.dtype == getattr(torch, dtype)
    assert lm.model.config._attn_implementation == attn
    assert lm.tokenizer.decode(lm.tokenizer("hi").input_ids) == "hi"


def test_hub_source_loads_a_local_directory_in_the_requested_dtype(tmp_path):
    tiny_model("llama", num_layers=2, hidden_size=32).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    lm = load_model(cfg("hub", path=str(tmp_path), dtype="float64"))
    assert len(lm.model.model.layers) == 2 and lm.model.dtype == torch.float64


@pytest.mark.parametrize("overrides, named", [
    (dict(source="pytorch_hub"), "'pytorch_hub'"),
    (dict(dtype="fp32"), "'fp32'"),
    (dict(family="gptj"), "'gptj'"),
    (dict(device="tpu:x"), "'tpu:x'"),
    (dict(source="hub", path="meta-llama/Llama-2-7b-chat-hf"), "'meta-llama/Llama-2-7b-chat-hf'"),
    (dict(source="hub", path="/no/such/dir"), "'/no/such/dir'"),
    (dict(source="hub", path=None), "model.path=None"),
])
def test_bad_config_values_raise_a_one_line_error_naming_them(overrides, named):
    with pytest.raises(SelfspecError) as err:
        load_model(cfg(**overrides))
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_request_without_cuda_is_a_config_error():
    with pytest.raises(SelfspecError, match="'cuda'.*not available"):
        load_model(cfg(device="cuda"))


@pytest.fixture
def fake_gguf(monkeypatch):
    """Make `from_pretrained(..., gguf_file=...)` return a tiny model instantly, so conversion logic runs in ms."""
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, gguf_file=None, **kw:
                        tiny_model("llama", num_layers=2, hidden_size=32) if gguf_file else real_model(*a, **kw))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, gguf_file=None, **kw:
                        byte_tokenizer() if gguf_file else real_tok(*a, **kw))


def test_conversion_is_atomic_and_runs_once(fake_gguf, tmp_path, monkeypatch, capsys):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if the process died after the model, before the tokenizer, was written
    with monkeypatch.context() as m:
        m.setattr(type(byte_tokenizer()), "save_pretrained", killed)
        with pytest.raises(KeyboardInterrupt):
            load_model(cfg("smollm2", cache_dir=str(tmp_path)))
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2.lock"]  # no half cache, no staging left behind

    load_model(cfg("smollm2", cache_dir=str(tmp_path)))
    assert "converting the smollm2 GGUF" in capsys.readouterr().err
    lm = load_model(cfg("smollm2", cache_dir=str(tmp_path)))
    assert "converting" not in capsys.readouterr().err
    assert len(lm.model.model.layers) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [".smollm2.lock", "smollm2"]


@pytest.fixture(scope="module")
def smollm2():  # dense linears: compared bit for bit with the GGUF model's (packed ones: test_packed_linear.py)
    return load_model(cfg("smollm2", packed_linears=False))  # converts on the very first run only


@pytest.mark.slow
def test_smollm2_loads_from_cache_quickly(smollm2, capsys):
    start = time.perf_counter()
    lm = load_model(cfg("smollm2"))
    assert time.perf_counter() - start < 10  # from GGUF it takes ~20 s
    assert "converting" not in capsys.readouterr().err
    assert len(lm.model.model.layers) == 30 and lm.model.dtype == torch.float32
    assert lm.tokenizer.chat_template and lm.tokenizer.eos_token_id == 2


@pytest.mark.slow  # dequantises the GGUF again
def test_smollm2_cache_gives_the_gguf_models_logits_and_tokens(smollm2):
    folder, gguf_file = checkpoints._gguf_location("smollm2", staging=None)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file).eval()
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                   add_generation_prompt=True, tokenize=False)
    ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == gguf_tok(prompt, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(smollm2.model(ids).logits, gguf_model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_gemma3_270m_loads():  # ~60 s on the very first run (GGUF conversion), ~3 s after
    lm = load_model(cfg("gemma3_270m"))
    assert len(lm.model.model.layers) == 18 and lm.model.config.vocab_size == 262144
    assert type(lm.model).__name__ == "Gemma3ForCausalLM"
