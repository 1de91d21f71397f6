"""What one generation carries besides its prompt and drafter, built once where a request comes in (run.py, the
API, the server) and passed down to the decoding loop."""

from dataclasses import dataclass

import torch

from selfspec.decoding.text_rules import TextRules
from selfspec.settings import SamplingSettings


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingSettings
    end_ids: tuple[int, ...] = ()  # any of them ends the generation (LoadedModel.end_ids)
    generator: torch.Generator | None = None  # sampling's random numbers; None: torch's global generator
    rules: TextRules | None = None  # banned words and stop strings (decoding/text_rules.py)
    top_logprobs: int | None = None  # log-probabilities of emitted tokens, with this many alternatives; None: off
    target_gate: float | None = None  # no draft after a token the full model gave probability <= this (make_strategy:
    # draft.target_gate); None: off
