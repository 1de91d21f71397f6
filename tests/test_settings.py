"""Typed settings: built once from the composed config; a bad value is one SelfspecError line naming its key."""

import pytest

from selfspec.errors import SelfspecError
from selfspec.settings import DraftSettings, ModelSettings, RunSettings, SamplingSettings, SkipSettings, named

from helpers import run_settings


def test_the_default_run_is_typed_through_and_through():
    settings = run_settings()
    assert isinstance(settings, RunSettings)
    assert isinstance(settings.model, ModelSettings) and isinstance(settings.draft, DraftSettings)
    assert isinstance(settings.sampling, SamplingSettings) and settings.sampling.max_new_tokens == 128
    assert settings.search is None and settings.draft_model is None
    assert settings.searched_skip == settings.model.searched_skip  # the model's shipped searched set


def test_searched_skip_path_wins_over_the_models_set():
    settings = run_settings("searched_skip.path=x.yaml")
    assert settings.searched_skip == SkipSettings(path="x.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["sampling.max_new_tokens=abc"], "sampling.max_new_tokens=abc is not allowed; it must be an integer"),
    (["draft.threshold=high"], "draft.threshold=high is not allowed; it must be a number"),
    (["search=optuna", "search.n_trials=-3"], "search.n_trials=-3 must be >= 1"),
    (["draft.threshold=1.5"], "draft.threshold=1.5 is outside [0, 1]"),
    (["draft.min_best_speedup=0.9"], "draft.min_best_speedup=0.9 must be >= 1.0"),
    (["sampling.temperature=-1"], "sampling.temperature=-1.0 is negative"),
    (["warmup=maybe"], "warmup=maybe is not allowed; it must be true or false"),
    (["kangaroo.exit_layer=2.5"], "kangaroo.exit_layer=2.5 is not allowed; it must be an integer"),
    (["skip.attn=[a]"], "skip.attn[0]=a is not allowed; it must be an integer"),
    (["+sampling.tempreature=1"], "sampling.tempreature is not a known key; did you mean sampling.temperature?"),
    (["data=jsonl"], "data.path is not set"),
    (["model.dtype=fp8"], "model.dtype='fp8' is unknown; allowed: float32, bfloat16, float16, float64"),
    (["logger.mode=cloud"], "logger.mode='cloud' is unknown; allowed: offline, online, disabled"),
    (["search=optuna", "search.objective=speed"], "search.objective='speed' is unknown"),
])
def test_a_bad_value_is_one_line_naming_its_key(overrides, message):
    with pytest.raises(SelfspecError) as error:
        run_settings(*overrides)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_named_puts_the_config_key_in_front_of_a_core_error():
    with pytest.raises(SelfspecError, match=r"^searched_skip\.attn: layer id 9"), named("searched_skip"):
        raise SelfspecError("attn: layer id 9 is out of range")
    with pytest.raises(SelfspecError, match=r"^skip: skip set skips all"), named("skip"):
        raise SelfspecError("skip set skips all 12 sublayers; keep at least one")
