"""Caches that cannot be left broken (models/cache_files.py): a writer that fails or is killed midway leaves the
earlier file whole and at most a leftover that the next writer removes; a damaged entry (truncated, changed) is found
by its sha256 and made again after one warning line, or refused in one line where it cannot be made again; two
processes converting the same GGUF both end with its weights, converted once."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from selfspec.errors import SelfspecError, SelfspecWarning
from selfspec.models import cache_files
from selfspec.models.cache_files import file_damage, load_checked, save_checked, write_checked
from selfspec.models.checkpoints import checkpoint_folder
from selfspec.models.feature_head import load_feature_head, new_feature_head, save_feature_head
from selfspec.models.tiny import tiny_model
from selfspec.records.wandb_logger import log_files
from selfspec.training.draft_data import sequence_states
from selfspec.training.train_draft import resume

from helpers import cfg, write_gguf

TESTS = Path(__file__).parent
# A process converting a GGUF that says it is ready (`written`.ready), waits for `go` to start, pauses `pause` s once
# the weights are written (the tokenizer not yet), then prints the digest of the weights it loads from its folder.
CONVERTER = """
import sys, time
from pathlib import Path
from transformers import AutoModelForCausalLM, PreTrainedModel
from selfspec.models.checkpoints import checkpoint_folder
from helpers import cfg
from test_cache_integrity import digest
gguf, cache, go, written, pause = sys.argv[1:6]
save = PreTrainedModel.save_pretrained
def slow_save(self, *args, **kwargs):
    save(self, *args, **kwargs)
    Path(written).touch()
    time.sleep(float(pause))
PreTrainedModel.save_pretrained = slow_save
Path(written + ".ready").touch()
while not Path(go).exists():
    time.sleep(0.02)
folder = checkpoint_folder(cfg("gguf", path=gguf, cache_dir=cache))
print(digest(AutoModelForCausalLM.from_pretrained(folder)))
"""


def digest(model) -> str:
    """sha256 of a model's weights, in name order."""
    state = model.state_dict()
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()


def gguf_digest(gguf: Path) -> str:
    return digest(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32))


def converter(gguf: Path, cache: Path, go: Path, written: Path, pause: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    return subprocess.Popen([sys.executable, "-c", CONVERTER, str(gguf), str(cache), str(go), str(written),
                             str(pause)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < end
        time.sleep(0.05)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp-*"))


def test_a_writer_that_fails_midway_leaves_the_earlier_file_whole_and_nothing_beside(tmp_path):
    path = tmp_path / "part.pt"
    save_checked({"weights": torch.arange(5.0)}, path)

    def failing(handle):
        handle.write(b"half a file")
        raise KeyboardInterrupt  # as a process stopped in the middle of torch.save
    with pytest.raises(KeyboardInterrupt):
        write_checked(path, failing)
    assert leftovers(tmp_path) == [] and file_damage(path) is None
    assert torch.equal(load_checked(path, "the part")["weights"], torch.arange(5.0))


def test_a_killed_writer_leaves_the_earlier_file_whole_and_the_next_write_removes_its_leftover(tmp_path):
    path, written = tmp_path / "part.pt", tmp_path / "written"
    save_checked({"weights": torch.arange(5.0)}, path)
    script = ("import sys, time; from pathlib import Path; from selfspec.models.cache_files import write_checked\n"
              "def write(handle):\n"
              "    handle.write(b'half'); handle.flush(); Path(sys.argv[2]).touch(); time.sleep(60)\n"
              "write_checked(Path(sys.argv[1]), write)")
    writer = subprocess.Popen([sys.executable, "-c", script, str(path), str(written)],
                              env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    wait_for(written, writer)
    [leftover] = leftovers(tmp_path)
    assert cache_files.remove_leftovers(tmp_path) is None and leftovers(tmp_path) == [leftover]  # its writer lives
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert torch.equal(load_checked(path, "the part")["weights"], torch.arange(5.0))
    save_checked({"weights": torch.ones(2)}, path)
    assert leftovers(tmp_path) == [] and torch.equal(load_checked(path, "the part")["weights"], torch.ones(2))


def test_a_damaged_training_shard_warns_once_and_is_made_again_with_the_same_states(tmp_path):
    model = tiny_model("llama", num_layers=2, hidden_size=32).double()
    sequences = [[1, 5, 7, 9], [1, 4, 4], [1, 8]]
    first = sequence_states(model, sequences, [1, 1, 1], None, tmp_path, 2)
    shard = tmp_path / "states-final-0000.pt"
    shard.write_bytes(shard.read_bytes()[:-100])  # cut off, as a full disk or a copy cut short leaves it
    with pytest.warns(SelfspecWarning, match=r"the training states shard .*states-final-0000.pt is damaged "
                                             r"\(states-final-0000.pt \(\d+ bytes\) does not match its sha256\)"):
        again = sequence_states(model, sequences, [1, 1, 1], None, tmp_path, 2)
    assert file_damage(shard) is None
    assert all(torch.equal(a.final, b.final) for a, b in zip(first, again))


def test_a_damaged_training_checkpoint_warns_and_training_starts_again(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checked({"history": [{"epoch": 3}]}, path)
    (tmp_path / "checkpoint.pt.sha256").unlink()  # killed between the checkpoint and its checksum
    with pytest.warns(SelfspecWarning, match="the training checkpoint .* is damaged .*checkpoint.pt.sha256 is missing"):
        assert resume(path, None, None, None, "feature", None, "split by prompt") == []


def test_a_damaged_trained_head_is_refused_in_one_line_and_never_logged(tmp_path):
    model = tiny_model("llama", num_layers=2, hidden_size=32).double()
    path = tmp_path / "head.pt"
    save_feature_head(path, new_feature_head(model), model)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed: torch.load would read it without a word
    path.write_bytes(bytes(data))
    with pytest.raises(SelfspecError, match=r"draft.head=.*head.pt' is damaged \(head.pt .* does not match its "
                                            r"sha256\); train one .*, or copy it whole with its head.pt.sha256") as err:
        load_feature_head(path, model)
    assert "\n" not in str(err.value)
    with pytest.raises(SelfspecError, match="head.pt is damaged .* before logging it as the W&B artifact tiny-feature"):
        log_files(None, "tiny-feature", "model", [path])


def test_a_damaged_gguf_conversion_warns_and_is_converted_again_with_the_gguf_weights(tmp_path, capsys):
    gguf = write_gguf(tmp_path / "tiny.gguf")
    settings = cfg("gguf", path=str(gguf), cache_dir=str(tmp_path / "cache"))
    folder = checkpoint_folder(settings)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.warns(SelfspecWarning, match=r"the tiny.gguf GGUF's safetensors in .* is damaged \(model.safetensors "
                                             r"\(1000 bytes\) does not match its sha256\); making it again"):
        assert checkpoint_folder(settings) == folder
    assert capsys.readouterr().err.count("converting the tiny.gguf GGUF") == 2
    assert digest(AutoModelForCausalLM.from_pretrained(folder)) == gguf_digest(gguf)
    assert leftovers(tmp_path / "cache") == []


def test_a_conversion_killed_midway_leaves_no_cache_and_the_next_run_converts_and_cleans_up(tmp_path):
    gguf, cache = write_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache"
    (tmp_path / "go").touch()
    killed = converter(gguf, cache, tmp_path / "go", tmp_path / "written", pause=600)
    wait_for(tmp_path / "written", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    [staging] = leftovers(cache)
    assert not any(p.name.startswith("gguf-") for p in cache.iterdir())  # no half cache
    folder = checkpoint_folder(cfg("gguf", path=str(gguf), cache_dir=str(cache)))
    assert leftovers(cache) == [] and cache_files.folder_damage(folder) is None
    assert digest(AutoModelForCausalLM.from_pretrained(folder)) == gguf_digest(gguf)


def test_two_processes_converting_the_same_gguf_at_once_both_get_its_weights_from_one_conversion(tmp_path):
    gguf, cache, go = write_gguf(tmp_path / "tiny.gguf"), tmp_path / "cache", tmp_path / "go"
    processes = [converter(gguf, cache, go, tmp_path / f"written-{i}", pause=2) for i in range(2)]
    for i, process in enumerate(processes):
        wait_for(tmp_path / f"written-{i}.ready", process)
    go.touch()  # both start at once; the first pauses 2 s mid-conversion, so the second finds it under way
    outputs = [p.communicate(timeout=600) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    errs = "".join(err for _, err in outputs)
    assert errs.count("selfspec: converting the tiny.gguf GGUF") == 1 and errs.count("selfspec: waiting for") == 1
    assert [out.strip() for out, _ in outputs] == [gguf_digest(gguf)] * 2
    assert sum(p.name.startswith("gguf-") for p in cache.iterdir()) == 1 and leftovers(cache) == []
