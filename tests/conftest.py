import os
import shutil
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from filelock import FileLock

from selfspec.models.grouped_attention import use_grouped_attention
from selfspec.models.tiny import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (helpers, wandb_history)
sys.path.insert(0, str(ROOT / "experiments"))  # experiment scripts (sample_records, random_skip_sets)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one thread a worker (and its run.py subprocesses)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch):
    """No test asks the Hugging Face hub: HF_HUB_OFFLINE for this process and the run.py processes it starts (a test
    of the download path turns it off and stands in for the hub)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are overhead-bound: a second thread only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session", params=["llama", "gemma2"])
def tiny(request):
    """A 6-layer tiny model in float64 (no rounding near-ties); gemma2 has a 16-token sliding window. Its attention is
    load_model's: the Llama's grouped heads are read in the kernel (models/grouped_attention.py)."""
    model = tiny_model(request.param, num_layers=6).double()
    use_grouped_attention(model)
    return model


@pytest.fixture
def prompt(tokenizer):
    return tokenizer("def fibonacci(n):\n    ").input_ids


@pytest.fixture(scope="session")
def tiny_outputs(tmp_path_factory) -> Path:
    """Every experiment run once on the tiny Llama (sample_records.TEST_RUNS), shared by the test modules and by
    pytest-xdist's workers: the first worker to ask runs them into their common temporary folder, the others wait
    for it (the tests only read the runs)."""
    from sample_records import TEST_RUNS, run_experiments  # imported only by the tests that need the runs

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one folder above each worker's own
    outputs, done = shared / "tiny_outputs", shared / "tiny_outputs.done"
    with FileLock(shared / "tiny_outputs.lock"):
        if not done.is_file():
            shutil.rmtree(outputs, ignore_errors=True)  # a worker that failed half-way left part of the runs
            run_experiments(outputs, TEST_RUNS, jobs=2)
            done.touch()
    return outputs
