"""Any checkpoint: `model=hf model.path=<folder>` of a registered architecture, a hub id from the local
cache or, online, downloaded by huggingface_hub after saying how big (the library's calls stand in here: no network),
`model=gguf model.path=<file.gguf>` converted once into the safetensors cache, `model.device=auto`, and one line for
each bad input: a directory without a config, an architecture transformers does not know, one it knows but the
layout registry does not hold, a file that is not a GGUF, a GGUF transformers cannot read, a GGUF of an unregistered
architecture, a gated or missing hub model, no network, HF_HUB_OFFLINE."""

import json
from dataclasses import replace
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from transformers import GPTJConfig, GPTJForCausalLM

from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models import checkpoints
from selfspec.models.loading import load_model
from selfspec.models.tiny import byte_tokenizer, tiny_model
from selfspec.settings import default_settings

from helpers import cfg, hf_greedy, run_py, run_settings, write_gguf

GREEDY = replace(default_settings().sampling, max_new_tokens=8)
HUB_RESPONSE = SimpleNamespace(headers={}, status_code=403, request=None)  # what the hub's errors are built from


def save_checkpoint(model, folder):
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def one_line(error: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(error.value)
    assert "\n" not in message and all(part in message for part in parts), message


def test_model_hf_composes_for_a_path():
    model = run_settings("model=hf", "model.path=/some/dir").model
    assert (model.source, model.path, model.dtype, model.device) == ("hub", "/some/dir", "float32", "auto")
    assert run_settings("model=gguf", "model.path=m.gguf").model.source == "gguf"


@pytest.mark.parametrize("family", ["qwen3", "gpt_neox", "falcon", "mixtral"])
def test_a_checkpoint_folder_of_a_registered_architecture_loads_and_decodes(family, tmp_path):
    folder = save_checkpoint(tiny_model(family, num_layers=2, hidden_size=32), tmp_path)
    loaded = load_model(cfg("hub", path=str(folder)))
    prompt = loaded.tokenizer("def f(x):").input_ids
    assert loaded.model.config.model_type == family
    assert generate(loaded.model, prompt, GenerationOptions(GREEDY)).new_tokens == hf_greedy(loaded.model, prompt, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_auto_without_cuda_runs_on_the_cpu_and_says_what_that_costs(tmp_path, capsys):
    folder = save_checkpoint(tiny_model("qwen3", num_layers=2, hidden_size=32), tmp_path)
    loaded = load_model(cfg("hub", path=str(folder), device="auto"))
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    [note] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfspec:")]
    assert note.startswith("selfspec: note: no CUDA here, so m (0.00B parameters") and "runs on the CPU" in note


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path=str(tmp_path)))
    one_line(err, f"model.path={str(tmp_path)!r} has no config.json")


def test_an_architecture_transformers_does_not_know_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama9000"}))
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path=str(tmp_path)))
    one_line(err, "model_type 'llama9000' is not an architecture this transformers knows", "llama, mistral")


def test_an_unregistered_architecture_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    folder = save_checkpoint(GPTJForCausalLM(GPTJConfig(vocab_size=259, n_embd=16, n_layer=2, n_head=2,
                                                        rotary_dim=4)), tmp_path)
    (folder / "model.safetensors").write_bytes(b"not read")  # the refusal comes from config.json alone
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path=str(folder)))
    one_line(err, "model_type 'gptj'", "has no registered layout; supported: Llama (llama)")


def test_a_gguf_file_is_converted_once_and_decodes_as_transformers_reads_it(tmp_path, capsys):
    gguf_file = write_gguf(tmp_path / "tiny-llama.gguf")
    settings = cfg("gguf", path=str(gguf_file), cache_dir=str(tmp_path / "cache"))
    loaded = load_model(settings)
    assert "converting the tiny-llama.gguf GGUF" in capsys.readouterr().err
    again = load_model(settings)
    assert "converting" not in capsys.readouterr().err  # the cache: read back, not converted again
    [cached] = (tmp_path / "cache").glob("gguf-*")  # beside it: the lock conversions of it take
    assert cached.name.startswith("gguf-tiny-llama-") and (cached / "config.json").is_file()
    prompt = loaded.tokenizer("hello world").input_ids
    assert loaded.tokenizer.decode(prompt) == "hello world"
    plain = generate(loaded.model, prompt, GenerationOptions(GREEDY)).new_tokens
    assert plain == hf_greedy(again.model, prompt, 8)
    for a, b in zip(loaded.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("content, message", [
    (None, "is not a file; give a .gguf file"),
    (b"PK\x03\x04 a zip, not a GGUF", "is not a GGUF file (it does not start with GGUF's magic bytes)"),
    (b"GGUF\x03\x00", "transformers cannot read this GGUF"),  # truncated after the magic bytes
])
def test_a_file_that_is_not_a_readable_gguf_is_refused(tmp_path, content, message):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("gguf", path=str(path), cache_dir=str(tmp_path / "cache")))
    one_line(err, f"model.path={str(path)!r}", message)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("architecture, message", [
    ("bloom", "(model_type 'bloom') has no registered layout; supported: Llama (llama)"),  # transformers reads it
    ("llama9000", "transformers cannot read this GGUF (GGUF model with architecture llama9000 is not supported"),
])
def test_a_gguf_of_an_architecture_selfspec_or_transformers_cannot_decode_is_refused(tmp_path, architecture, message):
    path = write_gguf(tmp_path / f"{architecture}.gguf", architecture)
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("gguf", path=str(path), cache_dir=str(tmp_path / "cache")))
    one_line(err, message)
    assert not (tmp_path / "cache").exists()  # refused before any conversion


class FakeHub:
    """huggingface_hub's model_info and snapshot_download as the hub would answer: no network here. The download
    writes `checkpoint` into a snapshot folder, as snapshot_download returns one."""

    def __init__(self, monkeypatch, tmp_path, model_type="qwen3", error=None):
        self.calls, self.snapshot, self.model_type, self.error = [], tmp_path, model_type, error
        monkeypatch.setattr(checkpoints.HfApi, "model_info", self.model_info)
        monkeypatch.setattr(checkpoints, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def model_info(self, repo, files_metadata=False, timeout=None):
        self.calls.append(("model_info", repo))
        if self.error is not None:
            raise self.error
        sizes = {"config.json": 700, "tokenizer.json": 2 ** 20, "model-00001-of-00002.safetensors": 2 ** 30,
                 "model-00002-of-00002.safetensors": 2 ** 29, "model.safetensors.index.json": 9000,
                 "original/consolidated.00.pth": 3 * 2 ** 30, "pytorch_model.bin": 2 ** 31, "tiny-q4_k_m.gguf": 2 ** 28}
        return SimpleNamespace(config={"model_type": self.model_type},
                               siblings=[SimpleNamespace(rfilename=name, size=size) for name, size in sizes.items()])

    def snapshot_download(self, repo, allow_patterns):
        self.calls.append(("snapshot_download", repo, sorted(allow_patterns)))
        return str(save_checkpoint(tiny_model(self.model_type, num_layers=2, hidden_size=32), self.snapshot))


def test_an_uncached_hub_id_is_downloaded_by_the_library_after_saying_how_big(monkeypatch, tmp_path, capsys):
    hub = FakeHub(monkeypatch, tmp_path)
    loaded = load_model(cfg("hub", path="someone/tiny-qwen3"))
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfspec:")]
    assert said == ["selfspec: downloading someone/tiny-qwen3 from the Hugging Face hub: 5 files, 1.50 GiB, into the "
                    "Hugging Face cache"]
    assert hub.calls == [("model_info", "someone/tiny-qwen3"),
                         ("snapshot_download", "someone/tiny-qwen3",
                          ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "tokenizer.json"])]
    assert loaded.model.config.model_type == "qwen3"


def test_weights_without_safetensors_are_fetched_as_bin():
    assert checkpoints.checkpoint_files({"config.json": 1, "pytorch_model.bin": 2, "sub/x.bin": 3}) == {
        "config.json": 1, "pytorch_model.bin": 2}


@pytest.mark.parametrize("error, message", [
    (GatedRepoError("403", response=HUB_RESPONSE), "is gated: accept its terms on https://huggingface.co/someone/m and log in"),
    (RepositoryNotFoundError("404", response=HUB_RESPONSE), "is neither a local directory nor a model on the Hugging Face hub"),
    (ConnectionError("no route to host"), "could not be reached (ConnectionError: no route to host); set HF_HUB_OFFLINE"),
])
def test_hub_errors_end_in_one_line_and_download_nothing(monkeypatch, tmp_path, error, message):
    hub = FakeHub(monkeypatch, tmp_path, error=error)
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path="someone/m"))
    one_line(err, "model.path='someone/m'", message)
    assert [call[0] for call in hub.calls] == ["model_info"]


def test_an_unregistered_hub_model_is_refused_before_its_download(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path, model_type="gptj")
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path="someone/gptj"))
    one_line(err, "(model_type 'gptj') has no registered layout")
    assert [call[0] for call in hub.calls] == ["model_info"]


def test_hf_hub_offline_keeps_the_offline_message_and_never_asks_the_hub(monkeypatch, tmp_path):
    hub = FakeHub(monkeypatch, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SelfspecError) as err:
        load_model(cfg("hub", path="someone/m"))
    one_line(err, "is not in the local Hugging Face cache (offline: HF_HUB_OFFLINE is set)")
    assert hub.calls == []


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_in_the_local_cache_loads_without_asking_the_hub(monkeypatch, tmp_path, offline):
    hub = FakeHub(monkeypatch, tmp_path / "unused")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--cached"  # the Hugging Face cache's layout
    save_checkpoint(tiny_model("gpt2", num_layers=2, hidden_size=32), repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    loaded = load_model(cfg("hub", path="someone/cached"))
    assert loaded.model.config.model_type == "gpt2" and hub.calls == []


@pytest.mark.slow
def test_run_py_ends_in_one_line_and_exit_2_for_an_unregistered_checkpoint_and_decodes_a_registered_one(tmp_path):
    gptj = save_checkpoint(GPTJForCausalLM(GPTJConfig(vocab_size=259, n_embd=16, n_layer=2, n_head=2, rotary_dim=4)),
                           tmp_path / "gptj")
    result = run_py("model=hf", f"model.path={gptj}", "logger=none", out_dir=tmp_path / "run1", timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("selfspec: error: model.path=")
    assert "(model_type 'gptj') has no registered layout" in result.stderr
    neox = save_checkpoint(tiny_model("gpt_neox", num_layers=2, hidden_size=32), tmp_path / "neox")
    result = run_py("model=hf", f"model.path={neox}", "logger=none", "data.limit=1", "sampling.max_new_tokens=8",
                    "skip.attn=[1]", "strategies=[plain,self_spec,self_spec_tree]", out_dir=tmp_path / "run2",
                    timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert [summary[name]["outputs_match_plain"] for name in ("plain", "self_spec", "self_spec_tree")] == [1.0] * 3
