"""Decode the same prompts with several strategies, interleaved, and record what each did."""

import ctypes
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from tqdm import tqdm

from selfspec.data.conversation import encode_turn
from selfspec.data.prompt_sets import Prompt
from selfspec.decoding.results import GenerationResult
from selfspec.decoding.strategies import Strategy
from selfspec.models.devices import output_device
from selfspec.records.prompt_records import (PromptRecord, SkipSetRecord, append_record, first_difference, read_records,
                                             summarize)
from selfspec.timing import clock

T = TypeVar("T")
GROUP_BATCHES = 4  # batch_size > 1: each strategy decodes a group of 4 x batch_size prompts, batch_size at a time
# (a waiting prompt joins as a row ends), before the next strategy decodes the same group: strategies stay
# interleaved, and the batch runs full until the group's last rows


def evaluate(strategies: list[Strategy], prompts: list[Prompt], prompt_ids: list[list[int]], tokenizer,
             out_dir: Path, *, seed: int = 0, repeats: int = 1, warmup: bool = True, logger=None,
             all_turns: bool = False, earlier: list[PromptRecord] | None = None, batch_size: int = 1) -> dict:
    """Run every strategy on every prompt (strategies interleaved per batch of prompts and turn, `repeats` timed runs
    each taken in turns, median time kept), append records to out_dir/records.jsonl as they finish, return the summary.

    prompt_ids: each prompt's first turn, encoded. all_turns: also decode every later turn, each strategy after its
    own earlier answers (data.turns=all); a batch decodes turn by turn. earlier: the records already in
    records.jsonl (resume=true): their (prompt, turn, strategy) is not decoded again, and their steps are replayed
    into the draft-exit policies. batch_size: prompts decoded together (decoding/batch.py), each compared with plain
    decoding of the same prompt; the records of a group (GROUP_BATCHES) share its wall time and list the prompts
    that shared the batch with them."""
    records_path = out_dir / "records.jsonl"
    done = {(r.question_id, r.turn, r.strategy): r for r in earlier or []}
    if warmup:
        _warm_up(strategies, prompt_ids[0], seed, batch_size)
    _replay_steps(strategies, earlier or [])
    size = batch_size * GROUP_BATCHES if batch_size > 1 else 1
    groups = [range(first, min(first + size, len(prompts))) for first in range(0, len(prompts), size)]
    for group in tqdm(groups, desc="prompts" if batch_size == 1 else f"groups of {size} prompts, {batch_size} at a "
                      f"time", unit="group" if batch_size > 1 else "prompt"):
        answers = {(index, strategy.name): [] for index in group for strategy in strategies}  # earlier turns' outputs
        for turn in range(max(len(prompts[i].turns) for i in group) if all_turns else 1):
            rows = [i for i in group if turn < len(prompts[i].turns)]
            todo = {strategy.name: [i for i in rows if (prompts[i].question_id, turn, strategy.name) not in done]
                    for strategy in strategies}
            turn_ids = {strategy.name: [prompt_ids[i] if turn == 0 else
                                        encode_turn(tokenizer, prompts[i], turn, answers[i, strategy.name])
                                        for i in todo[strategy.name]] for strategy in strategies}
            runs = _timed_runs([s for s in strategies if todo[s.name]], turn_ids,
                               {name: [seed + i for i in todo[name]] for name in todo}, repeats, batch_size)
            plain = {}
            for strategy in strategies:
                indices = todo[strategy.name]
                decoded = _records(strategy, [prompts[i] for i in indices], turn, turn_ids[strategy.name],
                                   [plain.get(i) for i in indices], tokenizer, runs[strategy.name],
                                   batch_size) if indices else []
                for index, record in zip(indices, decoded):
                    append_record(records_path, record)
                    if logger is not None:
                        logger.log_prompt(index, record)
                fresh = dict(zip(indices, decoded))
                for index in rows:
                    record = done.get((prompts[index].question_id, turn, strategy.name)) or fresh[index]
                    plain[index] = record if strategy.name == "plain" else plain.get(index)
                    answers[index, strategy.name].append(record.output_ids)
    return summarize(read_records(records_path))


Run = tuple[tuple[list[GenerationResult], float], float | None]  # ((results, wall seconds), peak MiB)


def _timed_runs(strategies: list[Strategy], ids: dict[str, list[list[int]]], seeds: dict[str, list[int]],
                repeats: int, batch_size: int) -> dict[str, list[Run]]:
    """Each strategy's `repeats` timed runs over its prompts `ids[name]` (decoded together when batch_size > 1),
    taken in turns, every strategy once a round: a slow spell of the machine falls on every strategy alike."""
    def run(strategy: Strategy) -> tuple[list[GenerationResult], float]:
        generators = [_generator(strategy, seed) for seed in seeds[strategy.name]]
        device = output_device(strategy.model)
        start = clock(device)
        prompt_ids = ids[strategy.name]
        results = ([strategy.generate(prompt_ids[0], generators[0])] if batch_size == 1 else
                   strategy.generate_batch(prompt_ids, generators, batch_size))
        return results, clock(device) - start

    runs: dict[str, list[Run]] = {strategy.name: [] for strategy in strategies}
    for _ in range(repeats):
        for strategy in strategies:
            runs[strategy.name].append(measure_peak_memory(lambda: run(strategy), output_device(strategy.model)))
    return runs


def _records(strategy: Strategy, prompts: list[Prompt], turn: int, ids: list[list[int]],
             plain: list[PromptRecord | None], tokenizer, measured: list[Run], batch_size: int) -> list[PromptRecord]:
    """The records of `strategy` on one turn of `prompts` from its timed runs (the median run's outputs and steps,
    the median times), each compared with plain decoding's record of the same prompt and turn."""
    (results, _), _ = sorted(measured, key=lambda run: run[0][1])[len(measured) // 2]  # the median run
    batch_s = statistics.median(seconds for (_, seconds), _ in measured)
    peaks = [mb for _, mb in measured if mb is not None]
    records = []
    group = [p.question_id for p in prompts] if batch_size > 1 else []
    for row, (prompt, result, reference) in enumerate(zip(prompts, results, plain)):
        result.elapsed_s = statistics.median(run[0][0][row].elapsed_s for run in measured)
        neighbours = [prompts[j].question_id for j in result.batch_neighbours]
        records.append(_record(strategy, prompt, turn, ids[row], result, reference, tokenizer,
                               max(peaks) if peaks else None, min(batch_size, len(prompts)), neighbours, group,
                               batch_s))
    return records


def _record(strategy: Strategy, prompt: Prompt, turn: int, ids: list[int], result: GenerationResult,
            plain: PromptRecord | None, tokenizer, peak_mem_mb: float | None, batch_size: int,
            neighbours: list[str], group: list[str], batch_elapsed_s: float) -> PromptRecord:
    if strategy.name == "plain":
        reference_ids, reference_tps = result.new_tokens, result.tokens_per_s
    else:
        reference_ids, reference_tps = (plain.output_ids, plain.tokens_per_s) if plain else (None, None)
    return PromptRecord(
        strategy=strategy.name, question_id=prompt.question_id, category=prompt.category, turn=turn,
        prompt_tokens=len(ids), new_tokens=len(result.new_tokens), elapsed_s=result.elapsed_s,
        tokens_per_s=result.tokens_per_s, drafted=result.drafted, accepted=result.accepted,
        verify_steps=len(result.steps), emitted=sum(s.emitted for s in result.steps),
        acceptance_rate=result.acceptance_rate, mean_accepted_tokens=result.mean_accepted_tokens,
        speedup=result.tokens_per_s / reference_tps if reference_tps else None,
        matches_plain=result.new_tokens == reference_ids if reference_ids is not None else None,
        first_difference=first_difference(result.new_tokens, reference_ids) if reference_ids is not None else None,
        gated_steps=result.gated_steps, rollbacks=result.rollbacks, finish_reason=result.finish_reason,
        peak_mem_mb=peak_mem_mb, batch_size=batch_size, batch_neighbours=neighbours, batch_group=group,
        batch_elapsed_s=batch_elapsed_s, output_ids=result.new_tokens,
        output_text=before_stop(tokenizer.decode(result.new_tokens), strategy), steps=result.steps,
        skip_sets=chosen_skip_sets(strategy) if batch_size == 1 else [])


def chosen_skip_sets(strategy: Strategy) -> list[SkipSetRecord]:
    """The skip sets the strategy's drafter chose in its last generation (skip_strategy: decoding/skip_choice/)."""
    return [SkipSetRecord(each.step, list(each.skip.attn), list(each.skip.mlp))
            for each in getattr(getattr(strategy, "drafter", None), "chosen", [])]


def before_stop(text: str, strategy: Strategy) -> str:
    """`text` up to its first stop string (sampling.stop), as the API and the server hand it out."""
    cut = [i for i in (text.find(stop) for stop in strategy.options.sampling.stop) if i >= 0]
    return text[:min(cut)] if cut else text


def _replay_steps(strategies: list[Strategy], earlier: list[PromptRecord]) -> None:
    """Feed the recorded verifications to each drafter, in order: the adaptive draft exit carries its state from
    prompt to prompt, so a resumed run drafts on as the uninterrupted run would have."""
    for strategy in strategies:
        drafter = getattr(strategy, "drafter", None)  # None: plain decoding and the HF baselines
        for record in (r for r in earlier if r.strategy == strategy.name and drafter is not None):
            for step in (s for s in record.steps if s.drafted):
                drafter.update(step.drafted, step.accepted, source=step.source)


def _generator(strategy: Strategy, seed: int) -> torch.Generator:
    return torch.Generator(device=output_device(strategy.model)).manual_seed(seed)


def _warm_up(strategies: list[Strategy], ids: list[int], seed: int, batch_size: int) -> None:
    """One short untimed generation per strategy (allocator, kernels, lazy imports); with batch_size > 1 a short
    batch, whose drafters measure what the batch's verify costs a row."""
    for strategy in strategies:
        options = strategy.options
        short = dataclasses.replace(strategy, options=dataclasses.replace(
            options, sampling=dataclasses.replace(options.sampling, max_new_tokens=16)))
        if batch_size == 1:
            short.generate(ids[:64], _generator(strategy, seed))
        else:
            short.generate_batch([ids[:64]] * batch_size, [_generator(strategy, seed)] * batch_size, batch_size)


def measure_peak_memory(run: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, float | None]:
    """`run()`'s result and the peak memory growth during it, in MiB above the level at its start.

    CUDA: `torch.cuda.max_memory_allocated` (tensors only). CPU: the process's peak RSS (Linux VmHWM, reset through
    /proc/self/clear_refs), after returning freed heap to the OS so reused memory counts as growth again; other
    threads' allocations count too. None where neither is available (CPU off Linux, or /proc not writable).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = run()
        torch.cuda.synchronize(device)
        return result, (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if not sys.platform.startswith("linux"):
        return run(), None
    _return_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS to the current RSS
    except OSError:
        return run(), None
    before = _proc_status_kb("VmRSS")
    result = run()
    return result, (_proc_status_kb("VmHWM") - before) / 1024


def _return_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
