import sys
from pathlib import Path

import pytest
import torch

from selfspec.models.tiny import byte_tokenizer, tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (wandb_history)
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session", params=["llama", "gemma2"])
def tiny(request):
    """A 6-layer tiny model in float64 (no rounding near-ties); gemma2 has a 16-token sliding window."""
    return tiny_model(request.param, num_layers=6).double()


@pytest.fixture
def prompt(tokenizer):
    return tokenizer("def fibonacci(n):\n    ").input_ids
