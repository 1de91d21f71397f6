"""The main job behind run.py: load the model and prompts, decode with every strategy, write the records."""

import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from selfspec.data import encode_prompt, load_prompts
from selfspec.decoding.sampling import SamplingSettings
from selfspec.decoding.strategies import make_strategy
from selfspec.evaluate import evaluate
from selfspec.models.draft_head import make_draft_head
from selfspec.models.loading import load_model
from selfspec.models.skip import num_layers
from selfspec.models.skip_config import searched_from_config, skip_from_config
from selfspec.records import markdown_table
from selfspec.wandb_logger import make_logger


def run(cfg, out_dir: Path) -> dict:
    print(OmegaConf.to_yaml(cfg, resolve=True))
    torch.manual_seed(cfg.seed)
    settings = SamplingSettings(**cfg.sampling)
    prompts = prompt_set(cfg.data)
    loaded = load_model(cfg.model)
    draft_model = load_model(cfg.draft_model).model if cfg.draft_model else None
    prompt_ids = [encode_prompt(loaded.tokenizer, p) for p in prompts]
    layers = num_layers(loaded.model)
    if cfg.search:
        from selfspec.search import search_skip_set  # imports optuna only when searching

        found = search_skip_set(cfg, loaded, settings, out_dir)
        skip, vocab_size = found.skip, found.vocab_size
    else:
        skip, vocab_size = skip_from_config(cfg.skip, layers), cfg.draft.get("vocab_size")
    print(f"skip set ({skip.fraction(layers):.0%} of {2 * layers} sublayers): attn={list(skip.attn)} mlp={list(skip.mlp)}")
    heads = {}

    def head(size: int | None):
        if size and size not in heads:
            heads[size] = make_draft_head(loaded.model, loaded.tokenizer, size)
        return heads.get(size)

    searched, searched_cfg = None, searched_skip_config(cfg) if "self_spec_searched" in cfg.strategies else None
    if searched_cfg is not None:
        searched_skip, searched_vocab = searched_from_config(searched_cfg, layers)
        print(f"searched skip set ({searched_skip.fraction(layers):.0%}): attn={list(searched_skip.attn)} "
              f"mlp={list(searched_skip.mlp)}, draft vocabulary {searched_vocab or 'full'}")
        searched = (searched_skip, head(searched_vocab))
    strategies = [make_strategy(name, loaded.model, settings, loaded.tokenizer.eos_token_id, skip, cfg.draft,
                                draft_model, head(vocab_size), cfg.get("hf"), cfg.get("kangaroo"), searched)
                  for name in cfg.strategies]
    logger = make_logger(cfg.logger, OmegaConf.to_container(cfg, resolve=True), out_dir)
    try:
        summary = evaluate(strategies, prompts, prompt_ids, loaded.tokenizer, out_dir, cfg.seed, cfg.repeats,
                           cfg.warmup, logger)
        if logger is not None:
            logger.log_summary(summary)
    finally:
        if logger is not None:
            logger.finish()
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(summary)
    (out_dir / "summary.md").write_text(f"{loaded.name}, {len(prompts)} prompts, {settings}\n\n{table}\n")
    print(f"\n{loaded.name}: {len(prompts)} prompts, max_new_tokens={settings.max_new_tokens}, "
          f"{'greedy' if settings.greedy else 'sampling'}\n{table}\n\nrecords: {out_dir}")
    return summary


def searched_skip_config(cfg):
    """`searched_skip.path` if given, else the model's shipped searched set (`model.searched_skip`), else None."""
    if (cfg.get("searched_skip") or {}).get("path"):
        return cfg.searched_skip
    return cfg.model.get("searched_skip")


def prompt_set(data_cfg) -> list:
    names = data_cfg.name if OmegaConf.is_list(data_cfg.name) else [data_cfg.name]
    return [p for name in names for p in load_prompts(name, data_cfg.get("path"), data_cfg.get("limit"))]
