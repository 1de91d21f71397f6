"""Training data for a draft from the model itself: its own generations for training prompts, and the hidden states
each draft learns from, in shards so that a killed run keeps what it made: each written whole with its sha256 beside it,
and made again after one warning line where it is damaged (models/cache_files.py).

1. Sequences: per prompt `train.samples_per_prompt` continuations by transformers' own batched `generate` (left
   padding; prompts batched by length, as every prompt of a batch costs as much as its longest): the greedy one,
   then sampled ones (`train.temperature`), each cut after its first end id. One shard per `train.generate_batch`
   prompts (`tokens-NNNN.pt`), reused by a later run with the same settings.
   With a store path (experiment=train_draft's store.pt), the generations are also written as a token store
   (models/token_store.py) before the states are made.
2. States: one full forward per sequence gives the final normed hidden state at every position (the feature head's
   input and target, the teacher of both drafts) and, for Kangaroo, the state after `exit_layer` layers; stored per
   shard in float16 (`states-<layers>-NNNN.pt`), recomputed only when missing. A head with `fused_layers` also
   learns from the states after those layers (models/feature_head.py's `inner_states`), kept beside them.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.data.prompt_sets import Prompt, encode_prompt, load_prompts, split_prompts
from selfspec.decoding.drafters.base import cut_at_end
from selfspec.errors import SelfspecError
from selfspec.models.cache_files import load_checked, save_checked
from selfspec.models.devices import input_device
from selfspec.models.feature_head import inner_states
from selfspec.models.layouts import base_model
from selfspec.models.loading import LoadedModel
from selfspec.models.token_store import save_token_store
from selfspec.settings import TrainSettings
from selfspec.timing import clock
from selfspec.training.self_prompts import self_prompts


@dataclass
class TrainingSequence:
    tokens: torch.Tensor  # (L,) long: prompt + generated continuation
    prompt_length: int  # tokens[prompt_length:] the model generated
    final: torch.Tensor  # (L, hidden): the model's final normed hidden states
    shallow: torch.Tensor | None = None  # (L, hidden): its states after kangaroo.exit_layer layers (Kangaroo only)
    inner: torch.Tensor | None = None  # (L, n x hidden): inner_states after a feature head's n fused layers


def training_data(loaded: LoadedModel, settings: TrainSettings, data_dir: Path, exit_layer: int | None,
                  store_path: Path | None = None, fused_layers: tuple[int, ...] = (),
                  **store_info) -> list[TrainingSequence]:
    """Every training sequence with its states: the model's generations for `training_prompts` and their states
    (after `exit_layer` layers too, if set, and after `fused_layers`), each part read back from `data_dir` where an
    earlier run made it with the same settings. With `store_path`, the generations (without their prompts) are also
    written there as a token store, with `store_info`, before their states are computed."""
    sequences, prompt_lengths = generate_sequences(loaded, training_prompts(loaded, settings, data_dir), settings,
                                                   data_dir)
    if store_path is not None:
        save_token_store(store_path, [seq[n:] for seq, n in zip(sequences, prompt_lengths)], loaded.model,
                         **store_info)
    return sequence_states(loaded.model, sequences, prompt_lengths, exit_layer, data_dir, settings.generate_batch,
                           fused_layers)


def training_prompts(loaded: LoadedModel, settings: TrainSettings, data_dir: Path) -> list[Prompt]:
    """The prompts a draft's data is generated from: train_prompts, then the `train.self_prompts` requests the
    model writes itself (read back from `data_dir` where an earlier run wrote them)."""
    return train_prompts(settings) + self_prompts(loaded, settings, data_dir)


def train_prompts(settings: TrainSettings) -> list[Prompt]:
    """The calibration half of each of `settings.sets` (the first `prompts_per_set`: `make bench` reports on the
    evaluation halves), and `settings.prompt_file` whole."""
    prompts = [p for name in settings.sets
               for p in split_prompts(load_prompts(name), "calibration")[:settings.prompts_per_set]]
    if settings.prompt_file:
        prompts += load_prompts("jsonl", settings.prompt_file)
    if len(prompts) < 2:
        raise SelfspecError(f"training needs at least 2 prompts (train and validation), got {len(prompts)}; "
                            f"raise train.prompts_per_set or add train.prompt_file")
    return prompts


def generate_sequences(loaded: LoadedModel, prompts: list[Prompt], settings: TrainSettings,
                       data_dir: Path) -> tuple[list[list[int]], list[int]]:
    """(sequences, their prompts' lengths): `samples_per_prompt` sequences per prompt (greedy first), shard by shard;
    a shard written by an earlier run with the same settings is read back instead of generated again."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ids = sorted((encode_prompt(loaded.tokenizer, p) for p in prompts), key=len)  # little left padding per batch
    batches = [ids[i:i + settings.generate_batch] for i in range(0, len(ids), settings.generate_batch)]
    sequences, prompt_lengths, started = [], [], clock()
    bar = tqdm(total=len(ids) * settings.samples_per_prompt * settings.max_new_tokens, desc="generate",
               unit="tok", unit_scale=True)
    for index, batch in enumerate(batches):
        path = data_dir / f"tokens-{index:04d}.pt"
        key = {"prompts": batch, "samples": settings.samples_per_prompt, "temperature": settings.temperature,
               "max_new_tokens": settings.max_new_tokens, "seed": settings.seed + index}
        saved = load_checked(path, "the training data shard")
        if saved is None or saved["key"] != key:
            torch.manual_seed(settings.seed + index)
            made = [continue_batch(loaded, batch, settings, sample=s > 0) for s in range(settings.samples_per_prompt)]
            saved = {"key": key, "sequences": [seq for rows in made for seq in rows]}
            save_checked(saved, path)
        sequences += saved["sequences"]
        prompt_lengths += [len(prompt) for _ in range(settings.samples_per_prompt) for prompt in batch]  # as made
        bar.update(len(batch) * settings.samples_per_prompt * settings.max_new_tokens)
    bar.close()
    tokens = sum(map(len, sequences))
    print(f"train data: {len(sequences)} sequences, {tokens} tokens ({clock() - started:.0f} s)")
    return sequences, prompt_lengths


@torch.inference_mode()
def continue_batch(loaded: LoadedModel, prompts: list[list[int]], settings: TrainSettings, sample: bool) -> list[list[int]]:
    """prompt + continuation per prompt, by one batched `generate` call with left padding."""
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else loaded.end_ids[0]
    width = max(map(len, prompts))
    device = input_device(loaded.model)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # (B, width)
    options = dict(do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0) if sample else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = loaded.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens,
                                eos_token_id=list(loaded.end_ids), pad_token_id=pad, **options)  # (B, width + new)
    return [p + cut_at_end(row[width:].tolist(), loaded.end_ids) for p, row in zip(prompts, out)]


@torch.no_grad()  # not inference_mode: the draft trains on these tensors
def sequence_states(model, sequences: list[list[int]], prompt_lengths: list[int], exit_layer: int | None,
                    data_dir: Path, shard_size: int, fused_layers: tuple[int, ...] = ()) -> list[TrainingSequence]:
    """The states of every sequence (final, after `exit_layer` layers if set, after `fused_layers`), stored per
    shard of `shard_size` sequences in float16 and read back when the shard's sequences are the same."""
    layers = "-".join(["final"] + ([str(exit_layer)] if exit_layer else []) +
                      ([f"fused{'.'.join(map(str, fused_layers))}"] if fused_layers else []))
    device = input_device(model)
    out = []
    for start in tqdm(range(0, len(sequences), shard_size), desc="states", unit="shard"):
        shard = sequences[start:start + shard_size]
        path = data_dir / f"states-{layers}-{start // shard_size:04d}.pt"
        saved = load_checked(path, "the training states shard")
        if saved is None or saved["sequences"] != shard:
            states = [forward_states(model, torch.tensor([seq], device=device), exit_layer, fused_layers)
                      for seq in shard]
            saved = {"sequences": shard, **{part: [half(state[i]) for state in states]
                                            for i, part in enumerate(("final", "shallow", "inner"))}}
            save_checked(saved, path)
        inner = saved.get("inner", [None] * len(shard))  # a shard made without fused layers holds none
        for seq, prompt_length, *states in zip(shard, prompt_lengths[start:start + shard_size], saved["final"],
                                               saved["shallow"], inner):
            out.append(TrainingSequence(torch.tensor(seq), prompt_length, *(as_dtype(s, model.dtype) for s in states)))
    return out


def half(state: torch.Tensor | None) -> torch.Tensor | None:
    return state.half().cpu() if state is not None else None


def as_dtype(state: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return state.to(dtype) if state is not None else None


def forward_states(model, ids: torch.Tensor, exit_layer: int | None,
                   fused_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(final (L, hidden), state after exit_layer layers (L, hidden) or None, inner_states after fused_layers
    (L, n x hidden) or None) of one sequence ids (1, L)."""
    out = base_model(model)(ids, output_hidden_states=exit_layer is not None or bool(fused_layers))
    shallow = out.hidden_states[exit_layer][0] if exit_layer is not None else None
    inner = inner_states([out.hidden_states[layer][0] for layer in fused_layers]) if fused_layers else None
    return out.last_hidden_state[0], shallow, inner
