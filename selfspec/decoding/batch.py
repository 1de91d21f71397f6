"""Batched decoding: several generations advance together, each drafting on its own, one full-model forward
verifying every row's proposal at the row's own length.

Each row is a `Generation` (decoding/speculative.py) over its row of one `BatchCache` (models/batch_cache.py): its
drafter's forwards, rewinds and tree compaction are the batch-1 code on a batch-1 view of that row. A step asks
every row for its proposal (a draft, or nothing: a plain step), feeds all of them in one forward, and hands each
row its own logits to verify as at batch size 1, so a row's output is the one it would have alone. A row that ends
leaves at once (its slot goes to the last row), and a new generation may join between steps (`add`): its prefill
is a block of the next step's forward, so the other rows do not wait a step for it. A server batches continuously
with this.
"""

from collections import deque
from collections.abc import Iterator
from dataclasses import replace

import torch

from selfspec.decoding.drafters import Drafter, DraftForward
from selfspec.decoding.results import Emitted, GenerationResult
from selfspec.decoding.options import GenerationOptions
from selfspec.decoding.speculative import Generation, Proposal, Tally, needed_length
from selfspec.errors import SelfspecError
from selfspec.models.attention_masks import chain
from selfspec.models.batch_cache import BatchCache, forward_batch, forward_rows_hidden
from selfspec.models.devices import output_device
from selfspec.models.output_layer import model_logits
from selfspec.models.skip import skipping
from selfspec.timing import clock


class DecodingBatch:
    """Up to `capacity` generations of up to `max_len` cache positions each (prompt, output and a verify block)."""

    def __init__(self, model, capacity: int, max_len: int):
        if capacity < 1:
            raise SelfspecError(f"a batch holds at least one generation, got capacity {capacity}")
        self.model = model
        self.cache = BatchCache(model, capacity, max_len)
        self.rows: list[Generation] = []  # rows[i] decodes over the cache's row i
        self.joining: set[Generation] = set()  # the rows whose prefill the next step runs

    @property
    def full(self) -> bool:
        return len(self.rows) == self.cache.capacity

    def add(self, prompt: list[int], options: GenerationOptions, drafter: Drafter | None = None) -> Generation:
        """A new generation joins. Its prefill runs in the next `step`'s forward, beside the other rows'
        verifications, and that step emits its first token."""
        if self.full:
            raise SelfspecError(f"the batch is full ({self.cache.capacity} generations)")
        generation = Generation(self.model, prompt, options, drafter, cache=self.cache.view(len(self.rows)))
        generation.begin()
        self.rows.append(generation)
        self.joining.add(generation)
        return generation

    def step(self) -> list[tuple[Generation, Emitted]]:
        """Every decoding row drafts, one forward verifies them all and runs the joining rows' prefills; returns what
        each row emitted. Rows that end leave."""
        proposals = self._propose()  # None: a joining row
        start = clock(output_device(self.model))  # every row's verification starts with the shared forward
        proposals = [proposal and replace(proposal, verify_start=start) for proposal in proposals]
        feeds = [(p.ids, p.start, p.block) if p is not None else (generation.prompt, 0, chain(len(generation.prompt)))
                 for generation, p in zip(self.rows, proposals)]  # per row: (its block's ids, cache index, parents)
        blocks, starts, parents = map(list, zip(*feeds))
        prefills = [row for row, proposal in enumerate(proposals) if proposal is None]
        logits = forward_batch(self.model, self.cache, blocks, starts, parents, last_only=prefills)
        emitted = [(generation, generation.conclude(proposal, row_logits) if proposal is not None
                    else replace(generation.prefilled(row_logits), began=start))
                   for generation, proposal, row_logits in zip(self.rows, proposals, logits)]
        self.joining.clear()
        for generation, _ in emitted:
            if generation.finished:
                self.remove(generation)
        return emitted

    def _propose(self) -> list[Proposal | None]:
        """Every row's proposal, None for a joining row (its prefill is its block). The rows whose drafters draft
        with the same skip set run their draft forwards together, one packed forward a draft token (DraftForward);
        one skip set's rows draft to the end before another's start."""
        steps = {row: generation.propose_steps() for row, generation in enumerate(self.rows)
                 if generation not in self.joining}
        pending: dict[int, DraftForward] = {}  # row -> its next draft forward
        proposals: list[Proposal | None] = [None] * len(self.rows)

        def advance(row: int, logits: torch.Tensor | None) -> None:
            try:
                pending[row] = steps[row].send(logits) if logits is not None else next(steps[row])
            except StopIteration as done:
                proposals[row] = done.value

        for row in steps:
            advance(row, None)
        key = None
        while pending:
            if not any(forward.group == key for forward in pending.values()):
                key = next(iter(pending.values())).group
            group = [row for row, forward in pending.items() if forward.group == key]
            skip, head = pending[group[0]].skip, pending[group[0]].head
            with skipping(self.model, skip), torch.inference_mode():
                hidden = forward_rows_hidden(self.model, self.cache, group, [pending[row].ids for row in group],
                                             [pending[row].start for row in group])
                last = torch.stack([row_hidden[-1] for row_hidden in hidden])  # (group, hidden)
                logits = model_logits(self.model, last) if head is None else head.rows_logits(last)  # (group, vocab)
            for row, row_logits in zip(group, logits):
                pending.pop(row).rows = len(group)
                advance(row, row_logits)
        return proposals

    def remove(self, generation: Generation) -> None:
        """`generation` leaves the batch (it ended, or its consumer went away); the last row takes its slot."""
        row, last = self.rows.index(generation), len(self.rows) - 1
        if row != last:
            self.cache.move(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        self.joining.discard(generation)


def batch_length(prompts: list[list[int]], options: GenerationOptions, drafters: list[Drafter | None]) -> int:
    """Cache positions per row for these prompts: the longest prompt and output, then the widest verify block."""
    widest = max((drafter.max_tokens for drafter in drafters if drafter is not None), default=0)
    return needed_length(max(map(len, prompts)), options.sampling, widest)


def decode_batch_steps(model, prompts: list[list[int]], options: GenerationOptions,
                       drafters: list[Drafter | None] | None = None,
                       generators: list[torch.Generator | None] | None = None, rows: int | None = None
                       ) -> Iterator[tuple[int, Emitted]]:
    """Decode `prompts` in a batch of `rows` rows (None: all together), prompt i sampling from `generators[i]`
    (None: options.generator); yields (prompt index, what it emitted) as decode_steps does for one prompt, each
    prompt's prefill first (in the step it joins). `drafters`: one per row (None: plain decoding). With fewer rows than prompts the batch starts with the
    first prompts, and as a row ends the next prompt joins in its place, with its drafter (decoding as a server
    batches, never with an idle row while prompts wait)."""
    if not prompts:
        raise SelfspecError("an empty batch: give at least one prompt")
    rows = rows or len(prompts)
    free = list(drafters or [None] * rows)  # the drafters of the rows no generation holds
    if len(free) != rows:
        raise SelfspecError(f"{len(free)} drafters for a batch of {rows} rows: give one per row")
    generators = generators or [options.generator] * len(prompts)
    batch = DecodingBatch(model, rows, batch_length(prompts, options, free))
    holder: dict[Generation, tuple[int, Drafter | None]] = {}  # a generation in the batch -> (prompt, drafter)
    waiting = deque(range(len(prompts)))
    while waiting or batch.rows:
        while waiting and not batch.full:  # free rows take the next prompts
            index, drafter = waiting.popleft(), free.pop(0)
            generation = batch.add(prompts[index], replace(options, generator=generators[index]), drafter)
            holder[generation] = index, drafter
        for generation, emitted in batch.step():
            yield holder[generation][0], emitted
            if generation.finished:
                free.append(holder.pop(generation)[1])


def generate_batch(model, prompts: list[list[int]], options: GenerationOptions,
                   drafters: list[Drafter | None] | None = None,
                   generators: list[torch.Generator | None] | None = None, rows: int | None = None
                   ) -> list[GenerationResult]:
    """`generate` for several prompts in a batch of `rows` (decode_batch_steps): one result per prompt, each timed
    from just before its prefill to the step that ended it, with the prompts it shared the batch with."""
    device = output_device(model)
    tallies: dict[int, Tally] = {}
    spans: dict[int, list[int]] = {}  # prompt -> [its first event, its last event]
    for event, (i, emitted) in enumerate(decode_batch_steps(model, prompts, options, drafters, generators, rows)):
        if i not in tallies:  # its prefill, in the step that began at `emitted.began`
            tallies[i], spans[i] = Tally(emitted.began), [event, event]
        tallies[i].add(emitted, clock(device))
        spans[i][1] = event
    results = [tallies[i].result(options.end_ids) for i in range(len(prompts))]
    for i, result in enumerate(results):
        result.batch_neighbours = [j for j in range(len(prompts))
                                   if j != i and spans[j][0] <= spans[i][1] and spans[i][0] <= spans[j][1]]
    return results
