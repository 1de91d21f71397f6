"""Training a draft (experiment=train_draft): the model's own generations in reusable shards, distillation that lowers
the validation loss, checkpoints that resume exactly, reproducibility from a seed, and run.py end to end."""

import json
from dataclasses import replace

import pytest
import torch

from selfspec.data.prompt_sets import encode_prompt
from selfspec.errors import SelfspecError
from selfspec.models.loading import LoadedModel
from selfspec.models.tiny import tiny_model
from selfspec.training.draft_data import TrainingSequence, generate_sequences, sequence_states, train_prompts
from selfspec.training.objective import batch_states, losses
from selfspec.training.train_draft import fit, new_part, split, training_rows

from helpers import main_in_process, run_py, run_settings

TINY_RUN = ["model=tiny_llama", "model.dtype=float64", "logger=none"]  # every run.py call here starts with these
SMALL = ["train.sets=[chat]", "train.prompts_per_set=4", "train.samples_per_prompt=2", "train.max_new_tokens=12",
         "train.generate_batch=3", "train.val_fraction=0.25", "train.lr=3e-3", "train.batch_size=2"]


def settings(kind, *overrides):
    return run_settings(*TINY_RUN, "experiment=train_draft", f"trained_draft={kind}", "kangaroo.exit_layer=2", *SMALL,
                        *overrides)


def training_data(model, tokenizer, run, data_dir, exit_layer):
    loaded = LoadedModel("tiny", model, tokenizer, ())
    sequences, prompt_lengths = generate_sequences(loaded, train_prompts(run.train), run.train, data_dir)
    return sequences, sequence_states(model, sequences, prompt_lengths, exit_layer, data_dir, run.train.generate_batch,
                                      tuple(run.trained_draft.fused_layers))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=4, hidden_size=32).double()


@pytest.mark.parametrize("kind,overrides", [("feature", []), ("kangaroo", []), ("feature", ["train.targets=generated"]),
                                            ("feature", ["trained_draft.chain_steps=3"]),
                                            ("feature", ["trained_draft.fused_layers=[1,2]"])])
def test_training_lowers_the_validation_loss_and_keeps_the_best(model, tokenizer, tmp_path, kind, overrides):
    run = settings(kind, "train.epochs=3", *overrides)
    exit_layer = 2 if kind == "kangaroo" else None
    sequences, data = training_data(model, tokenizer, run, tmp_path / "data", exit_layer)
    assert len(sequences) == 8 and all(len(s) > 12 for s in sequences)  # 4 prompts x (greedy + 1 sampled)
    assert len({tuple(s) for s in sequences}) > 4  # the sampled ones differ from the greedy ones
    assert all(d.final.shape == (len(d.tokens), 32) and (d.shallow is not None) == (kind == "kangaroo") for d in data)
    fused = tuple(run.trained_draft.fused_layers)
    assert all(d.inner.shape == (len(d.tokens), 32 * len(fused)) if fused else d.inner is None for d in data)
    prompts = [encode_prompt(tokenizer, p) for p in train_prompts(run.train)]
    assert all(d.tokens[:d.prompt_length].tolist() in prompts and d.prompt_length < len(d.tokens) for d in data)
    rows = training_rows(torch.arange(model.config.vocab_size), model.lm_head.weight.detach(), data, "data")
    history = fit(new_part(model, kind, exit_layer, fused), model, split(data, run.train.val_fraction, run.train.seed),
                  (rows, model.lm_head.weight.detach()), run, tmp_path, exit_layer, 0.0)
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    saved = torch.load(tmp_path / ("head.pt" if kind == "feature" else "adapter.pt"), weights_only=True)
    assert saved["kind"] == kind and saved["val_loss"] == min(h["val_loss"] for h in history)
    assert saved.get("fused_layers", []) == list(fused) and ("fuse_inner.weight" in saved["state_dict"]) == bool(fused)
    assert saved["made_by"]["data"]["sets"] == ["chat"]
    assert all(0 <= h["val_generated_agreement"] <= 1 for h in history)
    assert saved["val_generated_agreement"] == min(history, key=lambda h: h["val_loss"])["val_generated_agreement"]
    assert all(0 <= h["val_chain"] <= 4 for h in history) if kind == "feature" else "val_chain" not in saved


@pytest.mark.parametrize("kind,first", [("feature", 3), ("kangaroo", 4)])
def test_the_generated_positions_are_those_that_score_generated_tokens(model, kind, first):
    """A 10-token sequence whose last 5 the model generated: the head's position j scores token j + 2 (it predicts
    h_{j+1}), the adapter's position j token j + 1 (it predicts h_j)."""
    sequence = TrainingSequence(torch.arange(10), 5, torch.randn(10, 32, dtype=torch.float64),
                                torch.randn(10, 32, dtype=torch.float64))
    exit_layer = 2 if kind == "kangaroo" else None
    states = batch_states(new_part(model, kind, exit_layer), model, [sequence], 0.0)
    assert states.generated[0].nonzero().flatten().tolist() == list(range(first, states.mask.shape[1]))


def test_validation_holds_out_whole_prompts():
    """5 prompts x 3 sequences: every prompt's sequences fall on one side, one prompt in 5 validates, and the seed
    picks which; a single prompt cannot be split."""
    sequences = [TrainingSequence(torch.tensor([p, p + 1, 9, s]), 2, torch.zeros(4, 1)) for p in range(5)
                 for s in range(3)]
    train, val = split(sequences, 0.2, seed=0)
    held_out, trained_on = ({int(s.tokens[0]) for s in side} for side in (val, train))
    assert len(val) == 3 and len(held_out) == 1 and len(train) == 12 and not held_out & trained_on
    assert len({int(split(sequences, 0.2, seed)[1][0].tokens[0]) for seed in range(10)}) > 1
    with pytest.raises(SelfspecError, match="at least 2 different prompts"):
        split(sequences[:3], 0.2, seed=0)


def test_targets_generated_scores_the_generated_positions_alone(model):
    """Loss on generated positions only: the same per-position losses as over all positions, at exactly those."""
    sequence = TrainingSequence(torch.arange(10), 5, torch.randn(10, 32, dtype=torch.float64))
    head, weights = new_part(model, "feature", None), settings("feature").trained_draft
    weight = model.lm_head.weight.detach()
    states = batch_states(head, model, [sequence], 0.0)
    loss, agree, generated = losses(states, model, weight, weights)
    only, only_agree, only_generated = losses(states, model, weight, weights, generated_only=True)
    assert len(loss) == 9 and len(only) == 6 and bool(only_generated.all())
    assert torch.allclose(only, loss[generated]) and torch.equal(only_agree, agree[generated])


def test_chain_steps_score_every_step_of_the_chains(model):
    """Chains of 3 steps over 9 head positions score 9 + 8 + 7 positions (step s from position s - 1 on), the first
    9 exactly as teacher forcing alone does."""
    sequence = TrainingSequence(torch.arange(10), 5, torch.randn(10, 32, dtype=torch.float64))
    head, weights = new_part(model, "feature", None), settings("feature").trained_draft
    weight = model.lm_head.weight.detach()
    forced, _, _ = losses(batch_states(head, model, [sequence], 0.0), model, weight, weights)
    chained, _, generated = losses(batch_states(head, model, [sequence], 0.0, steps=3), model, weight, weights)
    assert len(forced) == 9 and len(chained) == 24 and generated.sum() == 6 + 6 + 6
    assert torch.allclose(chained[:9], forced) and not torch.allclose(chained[9:17], forced[1:])


def test_training_scores_the_rows_of_the_tokens_its_data_holds(model, tokenizer, tmp_path):
    _, data = training_data(model, tokenizer, settings("feature"), tmp_path / "data", None)
    weight = model.lm_head.weight.detach()  # (vocab, hidden)
    held = torch.unique(torch.cat([d.tokens for d in data]))
    rows = training_rows(torch.arange(len(weight)), weight, data, "data")
    assert len(held) < len(weight) and torch.equal(rows, weight[held])
    not_held = next(i for i in range(len(weight)) if i not in held)
    draft_vocab = torch.tensor([held[0], held[1], not_held])  # a draft vocabulary's rows: those held alone
    assert torch.equal(training_rows(draft_vocab, weight[draft_vocab], data, "data"), weight[held[:2]])
    assert training_rows(torch.arange(len(weight)), weight, data, "all") is weight


def seeded_fit(model, data, run, folder):
    torch.manual_seed(0)  # as run.py's seed before the part is made
    folder.mkdir(exist_ok=True)
    weight = model.lm_head.weight.detach()
    splits = split(data, run.train.val_fraction, run.train.seed)
    part = new_part(model, "feature", None, tuple(run.trained_draft.fused_layers))
    return fit(part, model, splits, (weight, weight), run, folder, None, 0.0)


def test_shards_are_reused_and_training_resumes_exactly_and_reproducibly(model, tokenizer, tmp_path):
    """The data shards of a first run are read back, not made again; 2 epochs, then a rerun asking for 4, end
    exactly where 4 epochs in one go end; the same seed gives the same head."""
    run = settings("feature", "train.epochs=4")
    _, data = training_data(model, tokenizer, run, tmp_path / "data", None)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "data").iterdir()}
    _, again = training_data(model, tokenizer, run, tmp_path / "data", None)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "data").iterdir()} == stamps
    assert all(torch.equal(x.final, y.final) for x, y in zip(data, again))
    full = seeded_fit(model, data, run, tmp_path / "straight")
    first = seeded_fit(model, data, settings("feature", "train.epochs=2"), tmp_path / "stopped")
    resumed = seeded_fit(model, data, run, tmp_path / "stopped")
    assert resumed[:3] == first and resumed == full
    seeded_fit(model, data, run, tmp_path / "again")
    straight, stopped, twice = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)["state_dict"]
                                for d in ("straight", "stopped", "again"))
    assert all(torch.equal(straight[k], stopped[k]) and torch.equal(straight[k], twice[k]) for k in straight)
    with pytest.raises(SelfspecError, match="loss on all positions, this run with .* loss on generated positions"):
        seeded_fit(model, data, settings("feature", "train.epochs=5", "train.targets=generated"), tmp_path / "stopped")
    with pytest.raises(SelfspecError, match=r"fused_layers=\[2\]: the checkpoint .* was trained with \[\]"):
        seeded_fit(model, data, settings("feature", "train.epochs=5", "trained_draft.fused_layers=[2]"),
                   tmp_path / "stopped")


@pytest.mark.slow
def test_run_py_trains_resumes_and_benchmarks_a_feature_head_and_its_token_store(tmp_path):
    train = ["experiment=train_draft", *SMALL, f"hydra.run.dir={tmp_path / 'train'}"]
    result = run_py(*TINY_RUN, *train, "train.epochs=1", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    head, store = tmp_path / "train" / "head.pt", tmp_path / "train" / "store.pt"
    assert head.is_file() and f"draft.head={head} draft.store={store}" in result.stdout
    saved = torch.load(store, weights_only=True)  # the generations, without their prompts, -1 after each
    generated = sum(1 for token in saved["state_dict"]["tokens"].tolist() if token == -1)
    assert saved["kind"] == "store" and generated == saved["sequences"] > 0 and "commit" in saved["made_by"]
    assert "generate: 100%" in result.stderr and "train: 100%" in result.stderr and "epoch 1:" in result.stdout
    result = run_py(*TINY_RUN, *train[:-1], "train.epochs=2", f"train.resume={tmp_path / 'train'}",
                    f"hydra.run.dir={tmp_path / 'resume'}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "after epoch 1" in result.stdout and "epoch 2:" in result.stdout
    result = run_py(*TINY_RUN, "data.name=chat", "data.limit=2", "sampling.max_new_tokens=24",
                    "strategies=[plain,self_spec_head,self_spec_tree,store_tree]", f"draft.head={head}",
                    f"draft.store={store}", f"hydra.run.dir={tmp_path / 'eval'}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert list(summary) == ["plain", "self_spec_head", "self_spec_tree", "store_tree"]
    assert all(summary[name]["outputs_match_plain"] == 1.0 for name in summary)


@pytest.mark.slow
def test_run_py_trains_and_benchmarks_kangaroo(tmp_path):
    result = run_py(*TINY_RUN, "experiment=kangaroo_train", *SMALL, "train.epochs=1", "kangaroo.exit_layer=4",
                    f"train.data_dir={tmp_path / 'shared'}", f"hydra.run.dir={tmp_path / 'train'}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(p.name for p in (tmp_path / "shared").iterdir())
    shared = [name for name in written if name.endswith(".pt")]  # states shards per exit layer, then tokens
    assert shared[-2:] == ["tokens-0000.pt", "tokens-0001.pt"] and shared[0] == "states-final-4-0000.pt"
    assert all(name.startswith("states-final-4-") for name in shared[:-2])
    assert sorted(shared + [f"{name}.sha256" for name in shared]) == written  # each shard with its sha256 beside it
    assert not (tmp_path / "train" / "draft_data").exists()
    adapter = tmp_path / "train" / "adapter.pt"
    assert adapter.is_file() and f"kangaroo.adapter_path={adapter}" in result.stdout
    result = run_py(*TINY_RUN, "data.name=chat", "data.limit=2", "sampling.max_new_tokens=24",
                    "strategies=[plain,kangaroo]", f"kangaroo.adapter_path={adapter}",
                    f"hydra.run.dir={tmp_path / 'eval'}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["kangaroo"]["outputs_match_plain"] == 1.0 and summary["kangaroo"]["acceptance_rate"] is not None


@pytest.mark.parametrize("overrides,message", [
    (["strategies=[plain,kangaroo]", "kangaroo.adapter_path=nope.pt"], "kangaroo.adapter_path='nope.pt' does not exist"),
    (["strategies=[plain,self_spec_head]"], "strategy self_spec_head needs draft.head="),
    (["experiment=train_draft", "trained_draft=kangaroo", "kangaroo.exit_layer=9"],
     "kangaroo.exit_layer=9 is out of range; allowed: 1..5"),
    (["experiment=train_draft", "trained_draft.fused_layers=[2,6]"],
     "trained_draft.fused_layers=[2, 6]: 6 is out of range; allowed: 1..5 (layers before the state)"),
    (["experiment=train_draft", "trained_draft.fused_layers=[0]"],
     "trained_draft.fused_layers=[0]: 0 is out of range; allowed: 1..5 (layers before the state)"),
    (["experiment=train_draft", "trained_draft=kangaroo", "trained_draft.fused_layers=[2]"],
     "fused_layers=[2]: the Kangaroo adapter reads its exit layer's state alone; allowed: []"),
    (["experiment=train_draft", "train.resume=nowhere"], "train.resume='nowhere' holds no checkpoint.pt"),
    (["experiment=train_draft", "train.epochs=0"], "epochs=0 is out of range"),
    (["experiment=train_draft", "train.targets=prompt"], "targets='prompt' is unknown; allowed: generated, all"),
    (["experiment=train_draft", "train.self_prompts=-1"], "self_prompts=-1 is out of range"),
    (["experiment=train_draft", "trained_draft=kangaroo", "trained_draft.chain_steps=2"],
     "chain_steps=2: the Kangaroo adapter drafts on the model's own shallow layers, not on its own predictions; "
     "allowed: 1"),
    (["task=fly"], "task='fly' is unknown; allowed: evaluate, train_draft"),
])
def test_bad_training_values_end_with_one_clear_line(tmp_path, monkeypatch, capsys, overrides, message):
    code, stderr = main_in_process(monkeypatch, capsys, *TINY_RUN, "data.limit=1", f"hydra.run.dir={tmp_path}",
                                   *overrides)
    assert code == 2 and message in stderr.strip().splitlines()[-1] and "Traceback" not in stderr
