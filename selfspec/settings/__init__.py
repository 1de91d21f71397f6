"""Typed settings, built once from the Hydra config at the edge (`from_config`); the rest of selfspec takes these.

Each config group has a dataclass here. The YAML files under conf/ hold the values, so fields that every option
of a group sets have no default here; optional fields default to None ("not set"). OmegaConf checks the types
(`typed`), each dataclass checks its ranges in `__post_init__`, and any bad value ends as one SelfspecError line
that names the full key and what is allowed. Only this package and the entry points import OmegaConf. Code that
runs without run.py (the Python API, tests, experiments/) takes its defaults from `default_settings()`: the same
config, composed with no overrides, so every default has one home, the YAML.

typed.py: config node -> dataclass, and the range checks; decoding.py: sampling, skip sets, the `draft` group;
groups.py: the run's other groups; config.py: the run's top-level options, `from_config` and `default_settings`.
"""

from selfspec.settings.config import (LaunchSettings, RunOptions, RunSettings, default_settings, from_config,
                                      launch_settings)
from selfspec.settings.decoding import (MAX_BANNED_WORDS, POLICIES, ConstraintSettings, DraftSettings,
                                        SamplingSettings, SkipSet, SkipSettings, check_banned_words,
                                        default_threshold, make_skip_set)
from selfspec.settings.groups import (DEVICE_MAP_PLANS, FORMAT_NAMES, DataSettings, HFSettings, KangarooSettings,
                                      LoggerSettings, ModelSettings, SearchSettings, ServeSettings,
                                      TrainedDraftSettings, TrainSettings)
from selfspec.settings.typed import named, named_error, typed

__all__ = ["DEVICE_MAP_PLANS", "FORMAT_NAMES", "MAX_BANNED_WORDS", "POLICIES", "ConstraintSettings", "DataSettings",
           "DraftSettings", "HFSettings", "KangarooSettings", "LaunchSettings", "LoggerSettings", "ModelSettings",
           "RunOptions", "RunSettings", "SamplingSettings", "SearchSettings", "ServeSettings", "SkipSet",
           "SkipSettings", "TrainSettings", "TrainedDraftSettings", "check_banned_words", "default_settings",
           "default_threshold", "from_config", "launch_settings", "make_skip_set", "named", "named_error", "typed"]
