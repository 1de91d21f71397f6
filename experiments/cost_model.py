"""Where drafting can pay on this machine: measured step costs and the acceptance a draft needs to break even.

    python experiments/cost_model.py [hydra overrides, e.g. model=gemma3_270m skip=none draft.vocab_size=16384]

Measures, over one KV cache at a 200-token context: c(q), a full-model forward of q tokens (the verification
of q - 1 drafts), and d, one draft token with the configured skip set (and reduced draft vocabulary). With
per-token acceptance a and k drafts, a step emits E = (1 - a^(k+1)) / (1 - a) tokens for k d + c(k+1), so
speedup(a, k) = E c(1) / (k d + c(k+1)) (StepCosts.speedup_at_acceptance). Prints c(q), d, the best k and
speedup per acceptance, and the acceptance needed for 1.0x and 1.25x. Copied n-gram drafts cost nothing, so for
them d = 0.
"""

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.data.prompt_sets import calibration_texts
from selfspec.decoding.costs import CONTEXT, measure_draft_ms, measure_step_costs
from selfspec.models.draft_vocabulary import make_draft_vocabulary
from selfspec.models.loading import load_model
from selfspec.models.layouts import num_layers
from selfspec.models.skip_config import resolve_skip
from selfspec.settings import from_config

ACCEPTANCES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


def main(overrides: list[str]) -> None:
    torch.set_num_threads(2)
    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    settings = from_config(cfg)
    loaded = load_model(settings.model)
    skip, _ = resolve_skip(settings.skip, num_layers(loaded.model))
    size = settings.draft.vocab_size
    head = make_draft_vocabulary(loaded.model, loaded.tokenizer, size, calibration_texts()) if size else None
    costs = measure_step_costs(loaded.model, settings.draft.max_tokens + 1, {size: head} if head else None)
    verify, draft = costs.verify_ms, costs.draft_ms(skip, size)
    print(f"{loaded.name}, {torch.get_num_threads()} threads, context {CONTEXT}; skip attn={list(skip.attn)} "
          f"mlp={list(skip.mlp)}, draft vocabulary {size or 'full'}")
    print(costs.summary())
    print(f"d = {draft:.1f} ms per draft token = {draft / verify[0]:.2f} c(1) (modelled from the sublayer costs; "
          f"timed directly: {measure_draft_ms(loaded.model, skip, head):.1f} ms)\n")
    print("| acceptance | best k (layer skip) | speedup (layer skip) | best k (n-gram, d = 0) | speedup (n-gram) |")
    print("|---|---|---|---|---|")
    for a in ACCEPTANCES:
        ks = range(1, len(verify))
        skip_k = max(ks, key=lambda k: costs.speedup_at_acceptance(a, k, draft))
        copy_k = max(ks, key=lambda k: costs.speedup_at_acceptance(a, k, 0.0))
        print(f"| {a} | {skip_k} | {costs.speedup_at_acceptance(a, skip_k, draft):.2f} | {copy_k} | "
              f"{costs.speedup_at_acceptance(a, copy_k, 0.0):.2f} |")
    for target in (1.0, 1.25):
        print(f"acceptance for {target}x: layer skip {costs.break_even(target, draft) or 'unreachable'}, "
              f"n-gram {costs.break_even(target, 0.0) or 'unreachable'}")


if __name__ == "__main__":
    main(sys.argv[1:])
