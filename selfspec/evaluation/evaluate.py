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
from selfspec.decoding.strategies import Strategy
from selfspec.models.devices import output_device
from selfspec.records.prompt_records import PromptRecord, append_record, first_difference, read_records, summarize

T = TypeVar("T")


def evaluate(strategies: list[Strategy], prompts: list[Prompt], prompt_ids: list[list[int]], tokenizer,
             out_dir: Path, seed: int = 0, repeats: int = 1, warmup: bool = True, logger=None,
             all_turns: bool = False, earlier: list[PromptRecord] | None = None) -> dict:
    """Run every strategy on every prompt (strategies interleaved per prompt and turn, `repeats` timed runs each,
    median time kept), append records to out_dir/records.jsonl as they finish, return the summary.

    prompt_ids: each prompt's first turn, encoded. all_turns: also decode every later turn, each strategy after its
    own earlier answers (data.turns=all). earlier: the records already in records.jsonl (resume=true): their
    (prompt, turn, strategy) is not decoded again, and their steps are replayed into the draft-exit policies."""
    records_path = out_dir / "records.jsonl"
    done = {(r.question_id, r.turn, r.strategy): r for r in earlier or []}
    if warmup:
        _warm_up(strategies, prompt_ids[0], seed)
    _replay_steps(strategies, earlier or [])
    for index, (prompt, ids) in enumerate(tqdm(list(zip(prompts, prompt_ids)), desc="prompts", unit="prompt")):
        answers = {strategy.name: [] for strategy in strategies}  # each strategy's outputs for the earlier turns
        for turn in range(len(prompt.turns) if all_turns else 1):
            plain = None
            for strategy in strategies:
                record = done.get((prompt.question_id, turn, strategy.name))
                if record is None:
                    turn_ids = ids if turn == 0 else encode_turn(tokenizer, prompt, turn, answers[strategy.name])
                    record = _decode(strategy, prompt, turn, turn_ids, plain, tokenizer, seed + index, repeats)
                    append_record(records_path, record)
                    if logger is not None:
                        logger.log_prompt(index, record)
                plain = record if strategy.name == "plain" else plain
                answers[strategy.name].append(record.output_ids)
    return summarize(read_records(records_path))


def _decode(strategy: Strategy, prompt: Prompt, turn: int, ids: list[int], plain: PromptRecord | None, tokenizer,
            seed: int, repeats: int) -> PromptRecord:
    """The record of `strategy` on one turn, compared with plain decoding's record of the same turn."""
    measured = [measure_peak_memory(lambda: strategy.generate(ids, _generator(strategy, seed)),
                                    output_device(strategy.model))
                for _ in range(repeats)]
    runs = [result for result, _ in measured]
    peaks = [mb for _, mb in measured if mb is not None]
    result = sorted(runs, key=lambda r: r.elapsed_s)[len(runs) // 2]
    result.elapsed_s = statistics.median(r.elapsed_s for r in runs)
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
        peak_mem_mb=max(peaks) if peaks else None, output_ids=result.new_tokens,
        output_text=before_stop(tokenizer.decode(result.new_tokens), strategy), steps=result.steps)


def before_stop(text: str, strategy: Strategy) -> str:
    """`text` up to its first stop string (sampling.stop), as the API and the server hand it out."""
    cut = [i for i in (text.find(stop) for stop in strategy.settings.stop) if i >= 0]
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


def _warm_up(strategies: list[Strategy], ids: list[int], seed: int) -> None:
    """One short untimed generation per strategy (allocator, kernels, lazy imports)."""
    for strategy in strategies:
        short = dataclasses.replace(strategy, settings=dataclasses.replace(strategy.settings, max_new_tokens=16))
        short.generate(ids[:64], _generator(strategy, seed))


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
