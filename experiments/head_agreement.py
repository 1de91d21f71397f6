"""Feature heads read against plain decoding's greedy outputs, per category: the share of output positions where a
head's top token (top 3: one of its three best) is the model's next token. The head reads the model's own states at
every position, as its draft's first token does live, over the draft vocabulary of `draft.vocab_size`. It
compares heads offline, free of a timed run's noise; more agreement need not draft faster live, where the cost-aware
policies decide when the head drafts.

    make bench MODEL=smollm2 LIMIT=6 OUT=<dir> ARGS="repeats=1 sampling.max_new_tokens=96 'strategies=[plain]'"
    python experiments/head_agreement.py <dir> shipped <run dir>/head.pt -- model=smollm2 data.split=evaluation \
        data.limit=6

Heads are `draft.head` values (a head.pt, or `shipped`). The overrides after `--` must select the model and the
prompts the records hold (`model=`, `data.*`). The first output token is the prefill's, so it is not counted.
"""

import collections
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import calibration_texts, encode_prompt, load_prompt_set
from selfspec.errors import SelfspecError
from selfspec.models.devices import execution_device, input_device
from selfspec.models.draft_vocabulary import DraftVocabulary, make_draft_vocabulary
from selfspec.models.feature_head import FeatureHead, load_feature_head
from selfspec.models.loading import load_model
from selfspec.models.output_layer import model_logits
from selfspec.settings import from_config
from selfspec.training.draft_data import forward_states

from copy_replay import plain_rows  # experiments/, beside this script

TOP = 3


@torch.inference_mode()
def head_predictions(model, head: FeatureHead, vocab: DraftVocabulary | None, ids: list[int], first: int,
                     top: int = TOP) -> torch.Tensor:
    """(len(ids) - first, top) token ids: the head's `top` best for each of ids[first:], each read from the model's
    state at the position two before it and the token one before it, as a draft's first token is live."""
    final, _, inner = forward_states(model, torch.tensor([ids], device=input_device(model)), None,
                                     head.fused_layers)  # (n, hidden), (n, fused x hidden) or None
    device = execution_device(head)
    features = final[None, :-1].to(device)  # (1, n - 1, hidden): h_t
    inner = inner[None, :-1].to(device) if inner is not None else None  # (1, n - 1, fused x hidden)
    embeds = model.get_input_embeddings()(torch.tensor([ids[1:]], device=input_device(model))).to(device)  # x_{t+1}
    positions = torch.arange(len(ids) - 1, device=device)[None]  # (1, n - 1)
    predicted = head(features, embeds, positions, inner=inner)[0, first - 2:len(ids) - 2]  # (rows, hidden): h_{t+1}
    logits = vocab.rows_logits(predicted) if vocab is not None else model_logits(model, predicted)  # (rows, vocab)
    return logits.topk(top, dim=-1).indices.cpu()


def main(records: Path, heads: list[str], overrides: list[str]) -> None:
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        settings = from_config(compose("config", overrides=["data=mix", *overrides]))
    prompts = {prompt.question_id: prompt for prompt in load_prompt_set(settings.data)}
    plain = plain_rows(records, prompts, overrides)
    loaded = load_model(settings.model)
    vocab = make_draft_vocabulary(loaded.model, loaded.tokenizer, settings.draft.vocab_size, calibration_texts()) \
        if settings.draft.vocab_size else None
    categories = ["all", *sorted({row["category"] for row in plain})]
    print(f"{len(plain)} prompts, draft vocabulary {settings.draft.vocab_size or 'all'}; per head and category: "
          f"top-1 agreement (top {TOP})\n")
    print("| head | " + " | ".join(categories) + " |\n|---|" + "---|" * len(categories))
    for path in heads:
        head = load_feature_head(path, loaded.model)
        counts = collections.defaultdict(lambda: [0, 0, 0])  # category: top-1 hits, top-k hits, positions
        for row in plain:
            prompt = encode_prompt(loaded.tokenizer, prompts[row["question_id"]])
            ids = prompt + row["output_ids"]
            if len(ids) < len(prompt) + 2:  # a one-token output: nothing drafted
                continue
            found = head_predictions(loaded.model, head, vocab, ids, len(prompt) + 1) \
                == torch.tensor(ids[len(prompt) + 1:])[:, None]  # (rows, top)
            for category in ("all", row["category"]):
                counts[category][0] += int(found[:, 0].sum())
                counts[category][1] += int(found.any(-1).sum())
                counts[category][2] += len(found)
        cells = [f"{top1 / n:.3f} ({topk / n:.3f})" if n else "-"
                 for top1, topk, n in (counts[category] for category in categories)]
        print(f"| {path} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--" in arguments:
        arguments, overrides = arguments[:arguments.index("--")], arguments[arguments.index("--") + 1:]
    else:
        overrides = []
    if len(arguments) < 2:
        sys.exit(__doc__)
    try:
        main(Path(arguments[0]), arguments[1:], overrides)
    except SelfspecError as error:  # a head that is no head of this model, a bad override value
        sys.exit(f"head_agreement: error: {error}")
