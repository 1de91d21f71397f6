"""The main job behind run.py: load the model and prompts, decode with every strategy, write the records."""

import dataclasses
import sys
from pathlib import Path

import torch

from selfspec.data.conversation import check_multi_turn
from selfspec.data.lengths import context_room, fit_prompts, with_truncated_count
from selfspec.data.prompt_sets import calibration_texts, encode_prompt, load_prompt_set
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.strategies import REGISTRY, cost_meter, make_strategy
from selfspec.decoding.text_rules import text_rules
from selfspec.errors import SelfspecError
from selfspec.evaluation.evaluate import evaluate
from selfspec.evaluation.field import FIELD, field_prompts, field_strategies, field_table
from selfspec.evaluation.spec_bench import write_answers
from selfspec.evaluation.summarize import summary_title, write_summary
from selfspec.models.draft_vocabulary import DraftVocabulary, make_draft_vocabulary
from selfspec.models.loading import LoadedModel, load_model
from selfspec.models.layouts import describe, num_layers
from selfspec.models.skip_config import resolve_skip
from selfspec.records.prompt_records import WrittenRecord, read_records
from selfspec.records.run_dir import RECORDS_FILE, SETTINGS_FILE, open_run_dir, write_file
from selfspec.records.wandb_logger import log_files, make_logger
from selfspec.settings import DataSettings, RunSettings, SkipSet, named


def run(settings: RunSettings, out_dir: Path) -> dict:
    torch.manual_seed(settings.seed)
    launch = settings.launch
    if launch.parallel:
        print(f"selfspec: warning: job {launch.job_num} of a sweep started by {launch.launcher}, whose jobs run at the "
              f"same time: they share the cores, so tokens/s and speedups are not comparable across jobs "
              f"(summary.json: parallel_launcher)", file=sys.stderr)
    sampling = settings.sampling
    check_batchable(settings)
    stored = dataclasses.asdict(settings)
    resumed = open_run_dir(out_dir, stored, settings.resume)  # first: a bad run dir ends before any loading
    earlier = read_records(out_dir / RECORDS_FILE, WrittenRecord) if resumed else []
    field = FIELD in settings.strategies  # experiment=field: every training-free method, Spec-Bench's task types
    prompts = field_prompts(settings.data) if field else load_prompt_set(settings.data)
    loaded = load_model(settings.model)
    all_turns = settings.data.turns == "all"
    if all_turns:
        check_multi_turn(loaded.tokenizer, prompts, loaded.name)
    draft_model = load_model(settings.draft_model).model if settings.draft_model else None
    room = context_room(loaded.model, sampling.max_new_tokens, settings.draft.max_tokens)
    fitted = fit_prompts(prompts, [encode_prompt(loaded.tokenizer, p) for p in prompts], room,
                         settings.data.max_prompt_tokens)
    prompt_ids = fitted.ids
    layers = num_layers(loaded.model)
    if settings.search:
        from selfspec.search import search_skip_set  # imports optuna only when searching

        found = search_skip_set(settings, loaded, out_dir)
        skip, vocab_size = found.skip, found.vocab_size
    else:
        with named("skip"):
            skip, _ = resolve_skip(settings.skip, layers)
        vocab_size = settings.draft.vocab_size
    print(f"model: {describe(loaded.model)}")
    print(f"skip set ({skip.fraction(layers):.0%} of {2 * layers} sublayers): attn={list(skip.attn)} mlp={list(skip.mlp)}")
    vocabularies = DraftVocabularies(loaded)
    searched = (searched_draft(settings, layers, vocabularies)
                if {"self_spec_searched", FIELD} & set(settings.strategies) else None)
    costs = cost_meter(loaded.model, settings.draft)  # measured on first use, shared by the strategies
    rules = text_rules(loaded.model, loaded.tokenizer, settings.constraints.banned_words,
                       settings.constraints.case_sensitive, sampling.stop)
    options = GenerationOptions(sampling, loaded.end_ids, rules=rules)
    def build(name: str):
        return make_strategy(name, loaded.model, options, skip=skip, draft=settings.draft, draft_model=draft_model,
                             draft_vocabulary=vocabularies(vocab_size), hf=settings.hf, kangaroo=settings.kangaroo,
                             searched=searched, costs=costs)
    strategies = field_strategies(build) if field else [build(name) for name in settings.strategies]
    if costs.summary():
        print(costs.summary())
    logger = make_logger(settings.logger, stored, out_dir, group=launch.sweep_dir)
    try:
        summary = evaluate(strategies, prompts, prompt_ids, loaded.tokenizer, out_dir, seed=settings.seed,
                           repeats=settings.repeats, warmup=settings.warmup, logger=logger, all_turns=all_turns,
                           earlier=earlier, batch_size=settings.batch_size)
        batch_costs = costs.for_batch(settings.batch_size).summary() if settings.batch_size > 1 else ""
        if batch_costs:
            print(batch_costs)  # measured by the batch's drafters
        summary = with_truncated_count(summary, fitted.truncated)
        if launch.parallel:  # timings measured while other jobs ran
            for row in summary.values():
                row["parallel_launcher"] = launch.launcher
        table = write_summary(out_dir, summary, summary_title(loaded.name, len(prompts), stored))
        if field:
            table = field_table(read_records(out_dir / RECORDS_FILE), sampling.greedy)
            write_file(out_dir / "field.md", f"{summary_title(loaded.name, len(prompts), stored)}\n\n{table}\n")
        if logger is not None:  # after the files are written: a W&B failure loses none of them
            logger.log_summary(summary)
            stem = f"{loaded.name}-{data_label(settings.data)}"
            log_files(logger.run, f"{stem}-records", "records", [out_dir / RECORDS_FILE, out_dir / SETTINGS_FILE])
            log_files(logger.run, f"{stem}-summary", "summary", [out_dir / "summary.json", out_dir / "summary.md"])
    finally:
        if logger is not None:
            logger.finish()
    if settings.spec_bench_answers:
        paths = write_answers(out_dir, read_records(out_dir / RECORDS_FILE), loaded.tokenizer, loaded.name)
        print(f"Spec-Bench answers: {', '.join(str(p) for p in paths)}")
    print(f"\n{loaded.name}: {len(prompts)} prompts, max_new_tokens={sampling.max_new_tokens}, "
          f"{'greedy' if sampling.greedy else 'sampling'}\n{table}\n\nrecords: {out_dir}")
    return summary


def check_batchable(settings: RunSettings) -> None:
    """batch_size > 1 decodes with our batched loop, which transformers' own generate baselines do not take."""
    unbatched = [name for name in settings.strategies if name in REGISTRY and REGISTRY[name].hf_baseline]
    if settings.batch_size > 1 and unbatched:
        raise SelfspecError(f"batch_size={settings.batch_size}: strategies {', '.join(unbatched)} are transformers' "
                            f"own generate, which decodes one prompt at a time here; drop them or set batch_size=1")


def data_label(data: DataSettings) -> str:
    """The prompts of a run in an artifact name: `chat`, `humaneval-chat`, a prompt file's stem."""
    return Path(data.path).stem if data.path else "-".join(data.names)


class DraftVocabularies:
    """One draft vocabulary per size, made on first use and shared by the strategies."""

    def __init__(self, loaded: LoadedModel):
        self.loaded, self.heads = loaded, {}

    def __call__(self, size: int | None) -> DraftVocabulary | None:
        if size and size not in self.heads:
            self.heads[size] = make_draft_vocabulary(self.loaded.model, self.loaded.tokenizer, size,
                                              calibration_texts())
        return self.heads.get(size)


def searched_draft(settings: RunSettings, layers: int, vocabularies: DraftVocabularies
                   ) -> tuple[SkipSet, DraftVocabulary | None] | None:
    """The skip set and draft vocabulary of strategy self_spec_searched: `searched_skip.path`, else the model's shipped
    searched set; None when there is neither (make_strategy then says how to make one)."""
    if settings.searched_skip is None:
        return None
    key = "searched_skip" if settings.searched_skip.path else "model.searched_skip"
    with named(key):
        skip, vocab_size = resolve_skip(settings.searched_skip, layers)
    print(f"searched skip set ({skip.fraction(layers):.0%}): attn={list(skip.attn)} mlp={list(skip.mlp)}, "
          f"draft vocabulary {vocab_size or 'full'}")
    return skip, vocabularies(vocab_size)
