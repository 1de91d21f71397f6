"""Training prompts the model writes itself (Magpie: Xu et al., 2024, "Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"): given its chat template up to where a user's text begins, an instruction-tuned
model goes on to write a user's request. `train.self_prompts` of them widen the shipped sets' few hundred prompts
with requests from the model's own distribution; a turn the model does not end within `QUERY_TOKENS` is dropped.
They are stored in the data folder (`self-prompts.pt`) and read back by a rerun with the same settings.
"""

from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.data.formats import Prompt
from selfspec.data.prompt_sets import as_token_ids
from selfspec.decoding.drafters.base import cut_at_end
from selfspec.errors import SelfspecError
from selfspec.models.cache_files import load_checked, save_checked
from selfspec.models.devices import input_device
from selfspec.models.loading import LoadedModel
from selfspec.settings import TrainSettings

QUERY_TOKENS = 64  # the longest user turn kept: a request, not a document
MARK = "<<selfspec-user-text>>"


def self_prompts(loaded: LoadedModel, settings: TrainSettings, data_dir: Path) -> list[Prompt]:
    """`settings.self_prompts` sampled user turns (fewer: those the model did not end are dropped), as chat prompts."""
    if not settings.self_prompts:
        return []
    path = data_dir / "self-prompts.pt"
    key = {"count": settings.self_prompts, "temperature": settings.temperature, "seed": settings.seed,
           "batch": settings.generate_batch}
    saved = load_checked(path, "the self prompts file")
    if saved is None or saved["key"] != key:
        texts = write_user_turns(loaded, settings)
        data_dir.mkdir(parents=True, exist_ok=True)
        saved = {"key": key, "texts": texts}
        save_checked(saved, path)
    kept = [text for text in saved["texts"] if text]
    print(f"self prompts: {len(kept)} of {settings.self_prompts} user turns ended within {QUERY_TOKENS} tokens")
    return [Prompt(f"self-{i}", "self", (text,), chat=True) for i, text in enumerate(kept)]


@torch.inference_mode()
def write_user_turns(loaded: LoadedModel, settings: TrainSettings) -> list[str]:
    """The sampled user turns, "" for one the model did not end (or ended at once); `generate_batch` at a time."""
    opening = user_turn_opening(loaded)
    device, pad = input_device(loaded.model), loaded.end_ids[0]
    torch.manual_seed(settings.seed)
    texts = []
    for start in tqdm(range(0, settings.self_prompts, settings.generate_batch), desc="self prompts", unit="batch"):
        rows = min(settings.generate_batch, settings.self_prompts - start)
        input_ids = torch.tensor([opening] * rows, device=device)  # (rows, opening)
        out = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                    temperature=settings.temperature, top_k=0, top_p=1.0,
                                    max_new_tokens=QUERY_TOKENS, eos_token_id=list(loaded.end_ids),
                                    pad_token_id=pad)  # (rows, opening + new)
        for row in out[:, len(opening):].tolist():
            turn = cut_at_end(row, loaded.end_ids)
            ended = bool(turn) and turn[-1] in loaded.end_ids
            texts.append(loaded.tokenizer.decode(turn[:-1]).strip() if ended else "")
    return texts


def user_turn_opening(loaded: LoadedModel) -> list[int]:
    """Token ids of the chat template up to where a user's first message's text begins."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise SelfspecError(f"train.self_prompts needs a chat model; {loaded.name}'s tokenizer has no chat template")
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    return as_token_ids(loaded.tokenizer(text[:text.index(MARK)], add_special_tokens=False))
