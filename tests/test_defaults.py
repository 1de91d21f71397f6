"""One home per default, the YAML under conf/: the Python API's defaults are run.py's resolved config, and no
settings dataclass restates a value that the config always sets."""

import dataclasses

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from selfspec import DEFAULT_DRAFT, SelfSpeculativeDecoder
from selfspec.decoding.draft_exit import make_exit_policy
from selfspec.models.tiny import tiny_model
from selfspec.settings import (DataSettings, DraftSettings, HFSettings, KangarooSettings, LoggerSettings, ModelSettings,
                               RunOptions, SamplingSettings, SearchSettings, ServeSettings, SkipSettings,
                               TrainedDraftSettings, TrainSettings, default_settings)

from helpers import CONF, run_settings


def test_the_api_decodes_with_run_py_s_draft_and_sampling_settings(tokenizer, monkeypatch):
    resolved = run_settings()
    assert default_settings() == resolved
    # the API takes any model: the draft options of a model without draft defaults of its own, not SmolLM2's head
    # and token store
    assert DEFAULT_DRAFT == default_settings("model=hf").draft == run_settings("model=hf").draft
    own = ("head", "vocab_size", "store")
    assert all(getattr(DEFAULT_DRAFT, name) is None is not getattr(resolved.draft, name) for name in own)
    assert dataclasses.replace(resolved.draft, **dict.fromkeys(own)) == DEFAULT_DRAFT
    decoder = SelfSpeculativeDecoder(tiny_model("llama", num_layers=2), tokenizer, strategy="plain")
    used = []
    strategy = decoder.strategy
    monkeypatch.setattr(decoder, "strategy", lambda sampling: used.append(sampling) or strategy(sampling))
    decoder.generate("Hi")
    list(decoder.stream("Hi", max_new_tokens=2))
    assert used == [resolved.sampling, dataclasses.replace(resolved.sampling, max_new_tokens=2)]


def test_default_settings_leave_a_running_hydra_app_as_it_was(tmp_path):
    (tmp_path / "app.yaml").write_text("x: 1\n")
    resolved = run_settings()
    default_settings.cache_clear()
    with initialize_config_dir(str(tmp_path), job_name="app", version_base="1.3"):
        assert default_settings() == resolved
        assert compose("app") == {"x": 1}
    assert not GlobalHydra.instance().is_initialized()


def test_the_adaptive_rule_under_another_draft_option_takes_conf_draft_adaptive_yaml_s_values():
    fixed = run_settings("draft=fixed").draft
    assert fixed.beta1 is None  # draft=fixed sets none of them
    adaptive = make_exit_policy(fixed, greedy=True, policy="adaptive")
    assert fixed.adaptive_options == run_settings("draft=adaptive").draft.adaptive_options
    assert {name: getattr(adaptive, name) for name in fixed.adaptive_options} == fixed.adaptive_options


def options(group: str) -> list:
    """The options of a config group as the YAML writes them (null options left out)."""
    return [node for path in sorted((CONF / group).glob("*.yaml")) if (node := OmegaConf.load(path))]


def written_nodes() -> dict[type, list]:
    """Every config node that each settings dataclass types, as written."""
    config, models = OmegaConf.load(CONF / "config.yaml"), options("model")
    return {SamplingSettings: options("sampling"),
            DraftSettings: [OmegaConf.merge(config.draft, node) for node in options("draft")],
            ModelSettings: models + options("draft_model"),
            SkipSettings: options("skip") + [config.searched_skip] + [m.searched_skip for m in models
                                                                       if "searched_skip" in m],
            DataSettings: options("data") + [search.data for search in options("search")],
            SearchSettings: options("search"), LoggerSettings: options("logger"), HFSettings: [config.hf],
            KangarooSettings: options("kangaroo"), TrainSettings: [config.train],
            TrainedDraftSettings: options("trained_draft"),
            ServeSettings: options("serve"), RunOptions: [config]}


def test_no_settings_field_restates_a_value_that_the_config_always_sets():
    checked = []
    for cls, nodes in written_nodes().items():
        always_set = set.intersection(*(set(node) for node in nodes))
        for field in dataclasses.fields(cls):
            if field.name in always_set:
                checked.append(f"{cls.__name__}.{field.name}")
                assert field.default in (dataclasses.MISSING, None), checked[-1]
                assert field.default_factory is dataclasses.MISSING, checked[-1]
    assert {"SamplingSettings.temperature", "DraftSettings.hybrid_policy", "TrainSettings.lr",
            "ModelSettings.packed_linears", "RunOptions.resume", "HFSettings.confidence_threshold",
            "TrainedDraftSettings.kind", "DraftSettings.head"} <= set(checked)
