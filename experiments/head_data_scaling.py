"""How a feature head's drafting grows with its training prompts: one head per share of the training prompts (nested
shares of one shuffled order; the same held-out validation prompts for all), each trained from the same seed and
for the same optimiser steps: an epoch passes over a share as many times as makes about the whole training set, so a
smaller share is seen more often, not trained less. Then its validation after `train.epochs` such epochs (objective.py's
`val_chain`, agreement on generated text, loss).

    python experiments/head_data_scaling.py train.data_dir=outputs/draft_data/smollm2 train.epochs=4 \
        [shares=0.125,0.25,0.5,1] [trained_draft.chain_steps=3] [any experiment=train_draft override]

The data is experiment=train_draft's (read from `train.data_dir` when made there with the same `train` settings,
else made there). Each head is written to outputs/experiments/head_data_scaling/<date_time>/<share>/head.pt, to be
measured live with `python run.py ... 'strategies=[plain,self_spec_head]' draft.head=<it>`.
"""

import json
import sys
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.cli import fail
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model
from selfspec.settings import from_config
from selfspec.timing import clock
from selfspec.training.draft_data import training_data
from selfspec.training.train_draft import by_prompt, fit, new_part, output_rows, split, training_rows

SHARES = (0.125, 0.25, 0.5, 1.0)
ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = ROOT / "outputs/experiments/head_data_scaling"


def main(argv: list[str]) -> None:
    shares = SHARES
    overrides = ["model=smollm2", "trained_draft=feature", "logger=none"]
    for arg in argv:
        if arg.startswith("shares="):
            try:
                shares = tuple(float(x) for x in arg.removeprefix("shares=").split(","))
            except ValueError:
                shares = ()
            if not shares or not all(0 < share <= 1 for share in shares):
                raise SelfspecError(f"{arg}: shares are numbers in (0, 1], comma-separated")
        else:
            overrides.append(arg)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        run = from_config(compose("config", overrides=overrides))
    if run.trained_draft.kind != "feature":
        raise SelfspecError(f"trained_draft={run.trained_draft.kind}: this experiment trains feature heads only")
    settings = run.train
    loaded = load_model(run.model)
    model = loaded.model.requires_grad_(False)
    data_dir = Path(settings.data_dir).expanduser() if settings.data_dir else ROOT / "outputs/draft_data" / loaded.name
    data = training_data(loaded, settings, data_dir, None)
    token_ids, weight = output_rows(model, loaded.tokenizer, run.draft.vocab_size)
    train_set, val = split(data, settings.val_fraction, settings.seed)
    groups = by_prompt(train_set)
    out_dir = OUTPUTS / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    results = []
    for share in shares:
        kept = [seq for group in groups[:max(1, round(share * len(groups)))] for seq in group]
        passes = max(1, round(len(train_set) / len(kept)))  # the same optimiser steps for every share
        torch.manual_seed(run.seed)  # as train_draft: every head starts from the same weights
        started, work_dir = clock(), out_dir / f"{share:g}"
        work_dir.mkdir(parents=True)
        rows = (training_rows(token_ids, weight, kept, settings.ce_vocab), weight)
        history = fit(new_part(model, "feature", None), model, (kept * passes, val), rows, run, work_dir, None, started)
        best = min(history, key=lambda h: h["val_loss"])
        results.append({"share": share, "prompts": len(by_prompt(kept)), "tokens": sum(len(s.tokens) for s in kept),
                         "passes": passes,
                         "minutes": (clock() - started) / 60, "last": history[-1], "best": best})
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{loaded.name}, chain_steps={run.trained_draft.chain_steps}, {settings.epochs} epochs; validation: "
          f"{len(by_prompt(val))} prompts, {sum(len(s.tokens) for s in val)} tokens")
    print("| share | prompts | tokens | passes an epoch | val_chain | agreement on generated text | val loss "
          "| best epoch | minutes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        last = r["last"]
        print(f"| {r['share']:g} | {r['prompts']} | {r['tokens']} | {r['passes']} | {last['val_chain']:.3f} | "
              f"{last['val_generated_agreement']:.3f} | {last['val_loss']:.3f} | {r['best']['epoch']} | "
              f"{r['minutes']:.1f} |")
    print(f"heads and results.json: {out_dir}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except SelfspecError as error:
        fail(str(error))
