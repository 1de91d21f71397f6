"""With logger.kind=wandb (offline) a run's final files are logged as W&B artifacts: the evaluation's records and
summary, the search's best_skip.yaml and trials.jsonl, a trained Kangaroo adapter."""

import base64
import hashlib
from pathlib import Path

import pytest
import torch
import wandb
from wandb_history import artifacts

from selfspec.evaluation.task import run
from selfspec.models.loading import load_model
from selfspec.search import search_skip_set
from selfspec.training.train_draft import train

from helpers import run_settings

WANDB = ["model=tiny_llama", "model.dtype=float64", "logger=wandb", "logger.mode=offline", "data.name=chat",
         "data.limit=1", "sampling.max_new_tokens=8", "warmup=false"]


@pytest.fixture(autouse=True)
def wandb_dirs(tmp_path, monkeypatch, one_thread):
    """W&B stages artifact files under its data dir (default: the user's): keep them in the test's folder."""
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def logged(out_dir: Path) -> dict[str, dict]:
    """The artifacts of the one W&B run in out_dir, less the ones W&B makes for logged tables."""
    wandb.teardown()  # finish() can return before the W&B service has written the run file; this waits for it
    (run_dir,) = (out_dir / "wandb").glob("offline-run-*")
    return {name: a for name, a in artifacts(run_dir).items() if a["type"] != "run_table"}


def md5(path: Path) -> str:
    """W&B's manifest digest: base64 of the file's MD5."""
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def test_an_evaluation_logs_its_records_and_summary(tmp_path):
    run(run_settings(*WANDB, "strategies=[plain,self_spec]"), tmp_path)
    found = logged(tmp_path)
    assert {name: a["type"] for name, a in found.items()} == {"tiny_llama-chat-records": "records",
                                                              "tiny_llama-chat-summary": "summary"}
    assert set(found["tiny_llama-chat-records"]["files"]) == {"records.jsonl", "settings.json"}
    assert set(found["tiny_llama-chat-summary"]["files"]) == {"summary.json", "summary.md"}
    for a in found.values():  # the final files, as the run left them
        assert all(digest == md5(tmp_path / name) for name, digest in a["files"].items())


def test_a_search_logs_its_best_skip_set_and_trials(tmp_path):
    settings = run_settings(*WANDB, "search=optuna", "search.objective=acceptance", "search.n_trials=2",
                            "search.data.limit=2", "search.max_new_tokens=8")
    search_skip_set(settings, load_model(settings.model), tmp_path)
    found = logged(tmp_path)
    assert list(found) == ["tiny_llama-acceptance-best_skip"]
    best = found["tiny_llama-acceptance-best_skip"]
    assert best["type"] == "skip-config" and set(best["files"]) == {"best_skip.yaml", "trials.jsonl"}
    assert best["files"]["best_skip.yaml"] == md5(tmp_path / "best_skip.yaml")


@pytest.mark.parametrize("kind,file", [("feature", "head.pt"), ("kangaroo", "adapter.pt")])
def test_draft_training_logs_its_losses_best_part_and_token_store(tmp_path, kind, file):
    settings = run_settings(*WANDB, "experiment=train_draft", f"trained_draft={kind}", "train.sets=[chat]",
                            "train.prompts_per_set=3", "train.samples_per_prompt=1", "train.max_new_tokens=8",
                            "kangaroo.exit_layer=4", "train.epochs=1")
    part = train(settings, tmp_path)
    found = logged(tmp_path)
    assert list(found) == [f"tiny_llama-{kind}"]
    model = found[f"tiny_llama-{kind}"]
    assert model["type"] == "model" and model["files"] == {file: md5(part), "store.pt": md5(tmp_path / "store.pt")}
    assert model["metadata"]["val_loss"] == torch.load(part, weights_only=True)["val_loss"]
