"""Train a Kangaroo adapter (`python run.py experiment=kangaroo_train`): distil the full model into the draft
"first exit_layer layers + adapter + the model's own output layer", on the model's own greedy generations.

1. Collect: greedy generations for the training prompts (the calibration half of each prompt set: `make bench`
   reports on the evaluation half), then one full forward per sequence gives, per position, the hidden state after
   `exit_layer` layers (the adapter's input) and the final normed hidden state (the teacher). One file per
   sequence under <dir>/kangaroo_data/, so a killed run keeps what it collected.
2. Train: the adapter over whole sequences (causal, no cache); loss = soft cross-entropy against the full
   model's distribution (the frozen output layer on the final hidden state) + hard_label_weight x cross-entropy
   with the next token; AdamW, one sequence per step; a validation split by sequence.
3. After every epoch checkpoint.pt (adapter, optimizer, epoch, history) is written atomically and adapter.pt
   holds the adapter with the lowest validation loss so far (epoch 0: untrained, the first exit_layer + 1
   layers). Rerunning into the same directory (hydra.run.dir, or kangaroo.resume=<dir>) continues training.
4. With logger.kind=wandb the final adapter.pt is logged as a W&B artifact (type model, its best epoch's losses
   as metadata).
"""

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from selfspec.data.prompt_sets import Prompt, encode_prompt, load_prompt_set, load_prompts, split_prompts
from selfspec.decoding.speculative import generate
from selfspec.errors import SelfspecError
from selfspec.models.devices import input_device
from selfspec.models.kangaroo_adapter import (adapter_device, check_exit_layer, model_signature, new_adapter,
                                              save_adapter, save_atomic)
from selfspec.models.loading import load_model
from selfspec.models.output_layer import model_logits
from selfspec.models.skip import num_layers
from selfspec.records.wandb_logger import log_files, start_run
from selfspec.settings import DataSettings, RunSettings, SamplingSettings, TrainSettings


@dataclass
class TrainingSequence:
    tokens: torch.Tensor  # (L,) long: prompt + greedy generation
    shallow: torch.Tensor  # (L, hidden): the model's hidden state after exit_layer layers
    final: torch.Tensor  # (L, hidden): its final normed hidden state


def train(run: RunSettings, out_dir: Path) -> Path:
    """The kangaroo_train task; returns the path of adapter.pt."""
    torch.manual_seed(run.seed)
    settings = run.kangaroo.train
    work_dir = _work_dir(run.kangaroo.resume, out_dir)
    loaded = load_model(run.model)
    exit_layer = check_exit_layer(run.kangaroo.exit_layer, num_layers(loaded.model))
    prompts = train_prompts(settings.sets, settings.prompts_per_set, run.data)
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in prompts]
    sequences = collect(loaded.model, prompt_ids, exit_layer, settings.max_new_tokens, work_dir / "kangaroo_data",
                        loaded.end_ids)
    history = train_adapter(loaded.model, exit_layer, sequences, settings, work_dir)
    best = min(history, key=lambda h: h["val_loss"])
    adapter_path = work_dir / "adapter.pt"
    wandb_run = start_run(run.logger, out_dir, asdict(run), job_type="kangaroo_train")
    if wandb_run is not None:
        try:
            log_files(wandb_run, f"{loaded.name}-kangaroo-exit{exit_layer}", "model", [adapter_path], metadata=best)
        finally:
            wandb_run.finish()
    print(f"\nkangaroo adapter for {loaded.name}, exit layer {exit_layer}: epoch {best['epoch']}, val loss "
          f"{best['val_loss']:.4f} (untrained {history[0]['val_loss']:.4f}), val agreement "
          f"{best['val_agreement']:.3f} (untrained {history[0]['val_agreement']:.3f})\nsaved: {adapter_path}\n"
          f"benchmark it: python run.py model={run.model.name} 'strategies=[plain,kangaroo]' "
          f"kangaroo.adapter_path={adapter_path}")
    return adapter_path


def _work_dir(resume, out_dir: Path) -> Path:
    if resume is None:
        return out_dir
    resume = Path(resume).expanduser()
    if not (resume / "checkpoint.pt").is_file():
        raise SelfspecError(f"kangaroo.resume={str(resume)!r} holds no checkpoint.pt; "
                            f"pass the directory of an earlier kangaroo_train run")
    return resume


def train_prompts(sets, per_set: int | None, eval_data: DataSettings | None = None) -> list[Prompt]:
    """The first `per_set` prompts of the calibration half of each set; warns if some are evaluation prompts."""
    prompts = []
    for name in sets:
        prompts += split_prompts(load_prompts(name), "calibration")[:per_set]
    if eval_data is not None:
        evaluated = {p.question_id for p in load_prompt_set(eval_data)}
        shared = evaluated & {p.question_id for p in prompts}
        if shared:
            print(f"kangaroo: warning: {len(shared)} training prompts are also evaluation prompts "
                  f"(data.limit={eval_data.limit}); lower kangaroo.train.prompts_per_set or data.limit")
    return prompts


@torch.no_grad()  # not inference_mode: the adapter trains on these tensors
def hidden_states(model, tokens: list[int], exit_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(shallow, final), each (L, hidden): the output of layer exit_layer - 1 and the final normed state."""
    out = model.model(torch.tensor([tokens], device=input_device(model)), output_hidden_states=True)
    return out.hidden_states[exit_layer][0], out.last_hidden_state[0]


def collect(model, prompt_ids: list[list[int]], exit_layer: int, max_new_tokens: int, data_dir: Path,
            end_ids: tuple[int, ...]) -> list[TrainingSequence]:
    """One sequence per prompt, generated greedily; reuses the files of an earlier run with the same settings."""
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0,  # greedy, whatever `sampling`
                                max_new_tokens=max_new_tokens)
    device = adapter_device(model, exit_layer)  # where the shallow states come out, and the adapter runs
    sequences = []
    for index, ids in enumerate(tqdm(prompt_ids, desc="collect", unit="prompt")):
        path = data_dir / f"seq-{index:04d}.pt"
        key = {"prompt": ids, "exit_layer": exit_layer, "max_new_tokens": max_new_tokens}
        saved = torch.load(path, map_location=device, weights_only=True) if path.exists() else None
        if saved is None or saved["key"] != key:
            tokens = ids + generate(model, ids, settings, end_ids=end_ids).new_tokens
            shallow, final = hidden_states(model, tokens, exit_layer)
            saved = {"key": key, "tokens": torch.tensor(tokens), "shallow": shallow, "final": final}
            save_atomic(saved, path)
        sequences.append(TrainingSequence(saved["tokens"].to(device), saved["shallow"], saved["final"]))
    return sequences


def distill_loss(adapter, model, seq: TrainingSequence, hard_label_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, agreement): soft cross-entropy of the draft against the full model per position, plus the weighted
    hard-label cross-entropy; agreement = share of positions where both argmaxes match."""
    positions = torch.arange(len(seq.tokens), device=seq.shallow.device)[None]  # (1, L)
    out = adapter(inputs_embeds=seq.shallow[None], position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state[0]  # (L, hidden)
    student = torch.log_softmax(model_logits(model, hidden), dim=-1)  # (L, vocab)
    with torch.no_grad():
        teacher = torch.softmax(model_logits(model, seq.final), dim=-1)  # (L, vocab)
    loss = -(teacher * student).sum(dim=-1).mean()
    if hard_label_weight:
        loss = loss + hard_label_weight * F.nll_loss(student[:-1], seq.tokens[1:].to(student.device))
    agreement = (student.argmax(dim=-1) == teacher.argmax(dim=-1)).float().mean()
    return loss, agreement


@torch.no_grad()
def validate(adapter, model, sequences: list[TrainingSequence], hard_label_weight: float) -> tuple[float, float]:
    """Mean loss and argmax agreement over the validation sequences."""
    adapter.eval()
    results = [distill_loss(adapter, model, seq, hard_label_weight) for seq in sequences]
    return (sum(float(loss) for loss, _ in results) / len(results),
            sum(float(agree) for _, agree in results) / len(results))


def split(sequences: list[TrainingSequence], val_fraction: float, seed: int) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """(train, val) by sequence, shuffled with `seed`; at least one of each."""
    if len(sequences) < 2:
        raise SelfspecError(f"kangaroo training needs at least 2 prompts (train and validation), got "
                            f"{len(sequences)}; raise kangaroo.train.prompts_per_set")
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    n_val = min(max(1, round(val_fraction * len(sequences))), len(sequences) - 1)
    return [sequences[i] for i in order[n_val:]], [sequences[i] for i in order[:n_val]]


def train_adapter(model, exit_layer: int, sequences: list[TrainingSequence], settings: TrainSettings,
                  work_dir: Path) -> list[dict]:
    """Train (or continue training) up to settings.epochs epochs; returns the history, one dict per epoch
    (epoch 0: the untrained adapter)."""
    model.requires_grad_(False)  # the target stays frozen: gradients flow into the adapter only
    train, val = split(sequences, settings.val_fraction, settings.seed)
    adapter = new_adapter(model, exit_layer)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    checkpoint_path, adapter_path = work_dir / "checkpoint.pt", work_dir / "adapter.pt"
    history = _resume(checkpoint_path, adapter, optimizer, model, exit_layer)
    if not history:
        val_loss, agreement = validate(adapter, model, val, settings.hard_label_weight)
        history = [{"epoch": 0, "train_loss": None, "val_loss": val_loss, "val_agreement": agreement}]
        save_adapter(adapter_path, adapter, model, exit_layer, epoch=0, val_loss=val_loss)
    done = history[-1]["epoch"]
    bar = tqdm(total=settings.epochs * len(train), initial=min(done, settings.epochs) * len(train), desc="train",
               unit="seq")
    for epoch in range(done + 1, settings.epochs + 1):
        adapter.train()
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(settings.seed + epoch))
        total = 0.0
        for i in order.tolist():
            loss, _ = distill_loss(adapter, model, train[i], settings.hard_label_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += (value := loss.item())
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{value:.3f}")
        val_loss, agreement = validate(adapter, model, val, settings.hard_label_weight)
        if val_loss < min(h["val_loss"] for h in history):
            save_adapter(adapter_path, adapter, model, exit_layer, epoch=epoch, val_loss=val_loss)
        history.append({"epoch": epoch, "train_loss": total / len(train), "val_loss": val_loss,
                        "val_agreement": agreement})
        save_atomic({"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(), "history": history,
                     "exit_layer": exit_layer, "model": model_signature(model)}, checkpoint_path)
        bar.write(f"epoch {epoch}: train loss {total / len(train):.4f}, val loss {val_loss:.4f}, "
                  f"val agreement {agreement:.3f}")
    bar.close()
    return history


def _resume(path: Path, adapter, optimizer, model, exit_layer: int) -> list[dict]:
    """Load the checkpoint into adapter and optimizer; return its history ([] when there is none)."""
    if not path.exists():
        return []
    saved = torch.load(path, map_location="cpu", weights_only=True)  # load_state_dict moves it to the adapter
    if saved["exit_layer"] != exit_layer or saved["model"] != model_signature(model):
        raise SelfspecError(f"kangaroo.exit_layer={exit_layer}: the checkpoint {path} was trained for exit layer "
                            f"{saved['exit_layer']} of {saved['model']['model_type']}; use another output directory")
    adapter.load_state_dict(saved["adapter"])
    optimizer.load_state_dict(saved["optimizer"])
    print(f"kangaroo: resuming from {path} after epoch {saved['history'][-1]['epoch']}")
    return saved["history"]
