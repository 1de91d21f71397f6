"""The embedded Gemma-3-270M (fp32): its shipped feature head drafts losslessly and gets its drafts accepted."""

from dataclasses import replace

import pytest

from selfspec.data.prompt_sets import encode_prompt, load_prompts
from selfspec.decoding.speculative import generate
from selfspec.models.loading import load_model
from selfspec.settings import default_settings

from helpers import run_settings, shipped_head_acceptance

pytestmark = pytest.mark.slow
SETTINGS = replace(default_settings().sampling, max_new_tokens=32)


def test_the_shipped_feature_head_drafts_losslessly_and_gets_accepted():
    gemma = load_model(run_settings("model=gemma3_270m").model)
    model = gemma.model
    prompts = [encode_prompt(gemma.tokenizer, p) for p in load_prompts("qa", limit=1) + load_prompts("math", limit=1)]
    plain = [generate(model, ids, SETTINGS, end_ids=gemma.end_ids).new_tokens for ids in prompts]
    acceptance = shipped_head_acceptance(model, prompts, SETTINGS, gemma.end_ids, plain)
    assert acceptance > 0.1  # the epoch-12 head alone: 0.33 on 7 prompts (docs/results.md); untrained ~0
