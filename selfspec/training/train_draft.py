"""Train a draft made of the model's own parts plus one trained layer (`python run.py experiment=train_draft
trained_draft=feature|kangaroo`): distil the full model into it on the model's own generations (draft_data.py).

- feature (models/feature_head.py): from (h_t, embedding of x_{t+1}) predict h_{t+1}, the next final hidden state.
- kangaroo (models/kangaroo_adapter.py): from the state after `kangaroo.exit_layer` layers predict h_t.

Loss per position (objective.py): `feature_weight` x smooth-L1 between the predicted and the true state, plus
`soft_ce_weight` x the cross-entropy of the draft's distribution against the full model's, both through the model's
frozen output layer: the rows the draft scores (the draft vocabulary's where `draft.vocab_size` is set), in training
only those of the tokens the training sequences hold (`train.ce_vocab=data`: the output layer dominates a training
step, and every greedy next token is among them); validation scores with all of them. `train.targets=generated`
scores only the positions that predict the model's own continuation (what drafting sees); the prompt's positions
stay as context.
Inputs get Gaussian noise of std `feature_noise` (the head drafts on its own predictions after the first token);
with `trained_draft.chain_steps` above 1 the feature head also learns from the chains it drafts on its own predictions
(chains.py, EAGLE-3's training-time test), every step's positions scored alike.
AdamW on padded batches of sequences; a validation split by prompt (a prompt's sequences often open alike).

After every epoch checkpoint.pt (part, optimizer, history) is written whole with its sha256 (models/cache_files.py;
a damaged one starts training again after one warning line) and the best part so far by validation loss is saved
(head.pt / adapter.pt), so a rerun into the same directory (or train.resume=<dir>) goes on; validation agreement
with the full model's next token (at every position, and at the generated tokens alone: what drafting sees) and the
tokens the head's greedy chains accept are printed per epoch and logged to W&B with the losses, and the final part
is logged as a W&B artifact. Stops early after `train.max_minutes` (data included). The generations themselves are
written before their states, as a token store to draft from (store.pt, models/token_store.py).
"""

import random
import subprocess
import sys
from dataclasses import asdict
from math import nan
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.data.prompt_sets import calibration_texts
from selfspec.errors import SelfspecError
from selfspec.models.cache_files import load_checked, save_checked
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.feature_head import check_fused_layers, new_feature_head, save_feature_head
from selfspec.models.kangaroo_adapter import check_exit_layer, new_adapter, save_adapter
from selfspec.models.loading import load_model
from selfspec.models.layouts import num_layers
from selfspec.models.trained_parts import model_signature
from selfspec.records.wandb_logger import log_files, start_run
from selfspec.settings import RunSettings
from selfspec.timing import clock
from selfspec.training.draft_data import TrainingSequence, training_data
from selfspec.training.objective import batch_states, losses, validate

FILES = {"feature": "head.pt", "kangaroo": "adapter.pt"}


def train(run: RunSettings, out_dir: Path) -> Path:
    """The train_draft task; returns the path of the trained part."""
    started = clock()
    torch.manual_seed(run.seed)
    settings, kind = run.train, run.trained_draft.kind
    work_dir = resume_dir(settings.resume, out_dir)
    loaded = load_model(run.model)
    model = loaded.model.requires_grad_(False)  # frozen: gradients flow into the draft only
    exit_layer = check_exit_layer(run.kangaroo.exit_layer, num_layers(model)) if kind == "kangaroo" else None
    fused_layers = tuple(run.trained_draft.fused_layers)
    check_fused_layers(fused_layers, num_layers(model))  # before the data, which holds their states
    data_dir = Path(settings.data_dir).expanduser() if settings.data_dir else work_dir / "draft_data"
    store_path = work_dir / "store.pt"  # the generations themselves, to draft from (models/token_store.py)
    data = training_data(loaded, settings, data_dir, exit_layer, store_path, fused_layers, made_by=provenance(run))
    token_ids, weight = output_rows(model, loaded.tokenizer, run.draft.vocab_size)
    train_weight = training_rows(token_ids, weight, data, settings.ce_vocab)
    part = new_part(model, kind, exit_layer, fused_layers)
    wandb_run = start_run(run.logger, out_dir, asdict(run), job_type="train_draft")
    try:
        splits = split(data, settings.val_fraction, settings.seed)
        history = fit(part, model, splits, (train_weight, weight), run, work_dir, exit_layer, started, wandb_run)
        best = min(history, key=lambda h: h["val_loss"])
        path = work_dir / FILES[kind]
        if wandb_run is not None:
            log_files(wandb_run, f"{loaded.name}-{kind}", "model", [path, store_path], metadata=best)
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    untrained = history[0]
    print(f"\n{kind} draft for {loaded.name}: epoch {best['epoch']}, val loss {best['val_loss']:.4f} (untrained "
          f"{untrained['val_loss']:.4f}), val agreement {best['val_agreement']:.3f} (untrained "
          f"{untrained['val_agreement']:.3f}), on generated text {best.get('val_generated_agreement', nan):.3f}"
          f"{chains_accept(best)}; {sum(len(s.tokens) for s in data)} tokens, "
          f"{(clock() - started) / 60:.1f} min\nsaved: {path}, and the generations as a token store: {store_path}")
    strategy = "'strategies=[plain,self_spec_head,self_spec_tree]' draft.head" if kind == "feature" else \
        "'strategies=[plain,kangaroo]' kangaroo.adapter_path"
    print(f"benchmark it: python run.py model={run.model.name} {strategy}={path}"
          f"{f' draft.store={store_path}' if kind == 'feature' else ''}")
    return path


def new_part(model, kind: str, exit_layer: int | None, fused_layers: tuple[int, ...] = ()):
    """An untrained part of `kind`, trainable (float32 weights stay as the model's dtype)."""
    part = new_feature_head(model, fused_layers) if kind == "feature" else new_adapter(model, exit_layer)
    return part.requires_grad_(True)


def resume_dir(resume, out_dir: Path) -> Path:
    if resume is None:
        return out_dir
    resume = Path(resume).expanduser()
    if not (resume / "checkpoint.pt").is_file():
        raise SelfspecError(f"train.resume={str(resume)!r} holds no checkpoint.pt; pass the directory of an earlier "
                            f"train_draft run")
    return resume


def output_rows(model, tokenizer, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (n,), their rows (n, hidden)): the output layer's rows the draft scores (those of
    draft.vocab_size's tokens, else all)."""
    if vocab_size:
        head = make_draft_vocabulary(model, tokenizer, vocab_size, calibration_texts())
        return head.token_ids.cpu(), head.weight
    weight = model.get_output_embeddings().weight.detach()
    return torch.arange(weight.shape[0]), weight


def training_rows(token_ids: torch.Tensor, weight: torch.Tensor, data: list[TrainingSequence],
                  ce_vocab: str) -> torch.Tensor:
    """(m, hidden): of the scoring rows `weight` (n, hidden) of `token_ids` (n,), those the training loss scores
    with: the rows of the tokens the training sequences hold (ce_vocab=data), else all."""
    if ce_vocab == "all":
        return weight
    in_data = torch.isin(token_ids, torch.cat([s.tokens for s in data]))  # (n,)
    return weight[in_data.to(weight.device)]


def by_prompt(sequences: list[TrainingSequence]) -> list[list[TrainingSequence]]:
    """The sequences grouped by prompt, in order of first appearance."""
    groups: dict[tuple, list] = {}
    for seq in sequences:
        groups.setdefault(tuple(seq.tokens[:seq.prompt_length].tolist()), []).append(seq)
    return list(groups.values())


def split(sequences: list[TrainingSequence], val_fraction: float, seed: int) -> tuple[list, list]:
    """(train, val) by prompt: a prompt's sequences all fall on one side, prompts shuffled with `seed`; about
    `val_fraction` of the prompts, at least one, validate."""
    groups = by_prompt(sequences)
    if len(groups) < 2:
        raise SelfspecError(f"training needs at least 2 different prompts (train and validation), got {len(groups)}")
    random.Random(seed).shuffle(groups)
    n_val = min(max(1, round(val_fraction * len(groups))), len(groups) - 1)
    return [s for group in groups[n_val:] for s in group], [s for group in groups[:n_val] for s in group]


def fit(part, model, splits: tuple[list, list], rows: tuple[torch.Tensor, torch.Tensor], run: RunSettings,
        work_dir: Path, exit_layer: int | None, started: float, wandb_run=None) -> list[dict]:
    """Train (or go on training) up to train.epochs epochs on `splits`, (training, validation) sequences; returns
    the history, one dict per epoch (epoch 0: the untrained part). `rows`: the output-layer rows the training loss
    scores with (train.ce_vocab) and those validation scores with (all the draft scores)."""
    settings, weights, kind = run.train, run.trained_draft, run.trained_draft.kind
    train_weight, weight = rows
    train_set, val = splits
    optimizer = torch.optim.AdamW(part.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    checkpoint_path, part_path = work_dir / "checkpoint.pt", work_dir / FILES[kind]
    validation = f"split by prompt, loss on {settings.targets} positions"  # comparable across a resume only if equal
    history = resume(checkpoint_path, part, optimizer, model, kind, exit_layer, validation)

    def save(path, row):
        extra = dict(**{k: v for k, v in row.items() if k != "train_loss"}, made_by=provenance(run))
        if kind == "feature":
            save_feature_head(path, part, model, **extra)
        else:
            save_adapter(path, part, model, exit_layer, **extra)

    if not history:
        history = [{"epoch": 0, "train_loss": None,
                    **validate(part, model, val, weight, weights, settings.batch_size, settings.targets)}]
        save(part_path, history[0])
        print(f"epoch 0 (untrained): {described(history[0])}")
    done = history[-1]["epoch"]
    batches = (len(train_set) + settings.batch_size - 1) // settings.batch_size
    bar = tqdm(total=settings.epochs * batches, initial=min(done, settings.epochs) * batches, desc="train", unit="batch")
    for epoch in range(done + 1, settings.epochs + 1):
        if settings.max_minutes is not None and clock() - started > 60 * settings.max_minutes:
            bar.write(f"train.max_minutes={settings.max_minutes} reached: stopping after epoch {epoch - 1}")
            break
        part.train()
        generator = torch.Generator().manual_seed(settings.seed + epoch)
        order = torch.randperm(len(train_set), generator=generator).tolist()
        total = 0.0
        for i in range(0, len(order), settings.batch_size):
            batch = [train_set[j] for j in order[i:i + settings.batch_size]]
            states = batch_states(part, model, batch, weights.feature_noise, generator, weights.chain_steps)
            loss, _, _ = losses(states, model, train_weight, weights, settings.targets == "generated")
            loss = loss.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += (value := loss.item())
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{value:.3f}")
        row = {"epoch": epoch, "train_loss": total / batches,
               **validate(part, model, val, weight, weights, settings.batch_size, settings.targets)}
        if row["val_loss"] < min(h["val_loss"] for h in history):
            save(part_path, row)
        history.append(row)
        save_checked({"state_dict": part.state_dict(), "optimizer": optimizer.state_dict(), "history": history,
                      "kind": kind, "exit_layer": exit_layer, "fused_layers": list(getattr(part, "fused_layers", ())),
                      "model": model_signature(model),
                      "validation": validation}, checkpoint_path)
        if wandb_run is not None:
            wandb_run.log(row)
        bar.write(f"epoch {epoch}: train loss {row['train_loss']:.4f}, {described(row)}")
    bar.close()
    return history


def described(row: dict) -> str:
    return (f"val loss {row['val_loss']:.4f}, val agreement {row['val_agreement']:.3f} "
            f"(on generated text {row['val_generated_agreement']:.3f}{chains_accept(row)})")


def chains_accept(row: dict) -> str:
    return f", its chains accept {row['val_chain']:.3f} tokens" if "val_chain" in row else ""


def resume(path: Path, part, optimizer, model, kind: str, exit_layer: int | None, validation: str) -> list[dict]:
    """Load the checkpoint into part and optimizer; return its history ([] when there is none, or it is damaged:
    training starts again)."""
    saved = load_checked(path, "the training checkpoint")  # load_state_dict moves it to the part
    if saved is None:
        return []
    if saved.get("kind") != kind or saved["exit_layer"] != exit_layer or saved["model"] != model_signature(model):
        raise SelfspecError(f"trained_draft={kind}: the checkpoint {path} was trained as {saved.get('kind')} "
                            f"(exit layer {saved['exit_layer']}) for {saved['model']['model_type']}; use another output directory")
    fused_layers = list(getattr(part, "fused_layers", ()))
    if saved.get("fused_layers", []) != fused_layers:
        raise SelfspecError(f"trained_draft.fused_layers={fused_layers}: the checkpoint {path} was trained with "
                            f"{saved.get('fused_layers', [])}; use another output directory")
    if saved.get("validation") != validation:  # its best-so-far losses would not compare with this run's
        raise SelfspecError(f"the checkpoint {path} was validated with {saved.get('validation', 'a split by sequence')}"
                            f", this run with {validation}: use another output directory")
    part.load_state_dict(saved["state_dict"])
    optimizer.load_state_dict(saved["optimizer"])
    print(f"train_draft: resuming from {path} after epoch {saved['history'][-1]['epoch']}")
    return saved["history"]


def provenance(run: RunSettings) -> dict:
    """How the part was made: the command line, the training data settings and the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    return {"command": " ".join(["python run.py", *sys.argv[1:]]), "data": asdict(run.train), "commit": commit}
