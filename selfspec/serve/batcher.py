"""The server's decoding worker: one thread owns the model and one `DecodingBatch` (decoding/batch.py) of up to
serve.max_batch requests' generations.

A request's generation joins the running batch before the next step (its prefill runs in that step's forward),
steps with the others (every row drafts, one forward verifies all rows), and leaves when it ends or when its request
stops reading (the client went away). Each request reads what its own generation emitted from its own queue
(`Row.emitted`), so its stream is built from its own steps as at batch size 1. Rows may differ in strategy and
sampling settings: each brings its own settings, and a drafter taken from a pool and given back when it leaves. The
pools hold, per (strategy, greedy or sampled), drafters built for rows of batches of 1, 2, 4, ... and max_batch rows
(their cost-aware exits price that batch's verify); a row takes one for the first of these sizes that holds the
batch it joins: a lone request drafts as at batch size 1, one joining a full batch as a row of a full batch. The
pooled drafters' draft-exit policies go on learning from one request to the next.

A request the batch cannot take (its prompt is longer than a row holds) ends alone; a step that fails ends the
requests it stepped (their rows share the one forward), and the worker goes on with the next requests.
"""

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace

from selfspec.api.decoder import Job, SelfSpeculativeDecoder
from selfspec.decoding.batch import DecodingBatch
from selfspec.decoding.drafters import Drafter
from selfspec.decoding.speculative import Generation
from selfspec.decoding.results import Emitted
from selfspec.serve.memory import HeapTrim
from selfspec.settings import SamplingSettings, ServeSettings

END = object()  # what a row's queue holds after its generation's last Emitted

Pools = dict[tuple[str, bool, int], list[Drafter | None]]  # (strategy name, greedy, batch size) -> free drafters


class DecodingFailed(Exception):
    """What ended a request's generation in the batch: joining it, or a step it took part in, raised."""


def drafter_pools(decoders: Iterable[SelfSpeculativeDecoder], sampling: SamplingSettings, capacity: int) -> Pools:
    """Per strategy of `decoders`, mode (greedy, sampled) and size n of `pool_sizes(capacity)`: n drafters for rows
    of a batch of n (None: plain decoding). At most n rows hold drafters of size n at once: the last of them to
    join found the others there, in a batch of at most n."""
    pools = {}
    for decoder in decoders:
        for temperature in (0.0, 1.0):
            strategy = decoder.strategy(replace(sampling, temperature=temperature))
            for rows in pool_sizes(capacity):
                pools[strategy.name, strategy.options.sampling.greedy, rows] = list(strategy.drafters(rows))
    return pools


def pool_sizes(capacity: int) -> list[int]:
    """1, 2, 4, ... below `capacity`, then `capacity`: the batch sizes drafters are built for (each size's
    cost-aware exit measures that batch's verify once)."""
    return [2 ** i for i in range(capacity.bit_length()) if 2 ** i < capacity] + [capacity]


def row_length(serve: ServeSettings, context_length: int | None, pools: Pools) -> int:
    """Cache positions per batch row: the longest prompt and reply the server takes (serve.max_prompt_tokens and
    serve.max_tokens, within the model's context) and the widest verify block of any pooled drafter."""
    longest = serve.max_prompt_tokens + serve.max_tokens
    longest = min(longest, context_length) if context_length else longest
    widest = max((d.max_tokens for pool in pools.values() for d in pool if d is not None), default=0)
    return longest + widest + 1


class Row:
    """One request's generation in the batch, as the request sees it: what the generation emits, in order."""

    def __init__(self, batcher: "Batcher", job: Job):
        self.batcher, self.job = batcher, job
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # Emitted ..., then END; or a DecodingFailed
        self.generation: Generation | None = None  # once it joined the batch
        self.drafter: Drafter | None = None  # from the pool, while it decodes
        self.pool: tuple[str, bool, int] | None = None  # which pool it came from
        self.left = False  # its request stopped reading

    def emitted(self) -> Iterator[Emitted]:
        """What the generation emits: the prefill's token, then each step's. It joins the batch at the first
        `next` and leaves it when this iterator ends or is closed."""
        self.batcher.join(self)
        try:
            while (item := self.outbox.get()) is not END:
                if isinstance(item, DecodingFailed):
                    raise item
                yield item
        finally:
            self.batcher.leave(self)


class Batcher:
    """Up to `capacity` generations of up to `max_len` cache positions each, stepped together by one thread;
    `pools`: the drafters rows take (drafter_pools)."""

    def __init__(self, model, capacity: int, max_len: int, pools: Pools):
        self.batch = DecodingBatch(model, capacity, max_len)
        self.pools = pools
        self.steps = 0  # batch steps so far
        self.row_steps = 0  # rows those steps advanced (row_steps / steps: the batch's mean size)
        self._joining: list[Row] = []
        self._leaving: list[Row] = []
        self._rows: dict[Generation, Row] = {}  # the batch's generations' rows
        self._changed = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="selfspec-batch", daemon=True)
        self._trim_heap = HeapTrim()  # an ended row's freed buffers go back to the system (serve/memory.py)

    @property
    def size(self) -> int:
        """Generations decoding now."""
        return len(self.batch.rows)

    def row(self, job: Job) -> Row:
        """`job`'s place in the batch; it joins when its `emitted()` is first read."""
        return Row(self, job)

    def join(self, row: Row) -> None:
        with self._changed:
            self._joining.append(row)
            self._changed.notify()

    def leave(self, row: Row) -> None:
        with self._changed:
            row.left = True
            self._leaving.append(row)
            self._changed.notify()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the worker after its current step; requests still decoding end with DecodingFailed."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            while self._wait():
                for row in self._take_leaving():
                    self._remove(row)
                for row in self._take_joining():
                    self._start(row)
                if self.batch.rows:
                    self._step()
        finally:  # stopped, or a bug here: no request waits forever
            failure = DecodingFailed("the server stopped decoding")
            with self._changed:
                rows, self._joining = [*self._rows.values(), *self._joining], []
            for row in rows:
                row.outbox.put(failure)

    def _wait(self) -> bool:
        """Wait for work; False: stop."""
        with self._changed:
            self._changed.wait_for(lambda: self._stopping or self._joining or self._leaving or self.batch.rows)
            return not self._stopping

    def _take_leaving(self) -> list[Row]:
        with self._changed:
            leaving, self._leaving = self._leaving, []
        return leaving

    def _take_joining(self) -> list[Row]:
        """The joining rows the batch has room for, first come first; those whose request left already are
        dropped."""
        with self._changed:
            self._joining = [row for row in self._joining if not row.left]
            room = self.batch.cache.capacity - len(self.batch.rows)
            joining, self._joining = self._joining[:room], self._joining[room:]
        return joining

    def _start(self, row: Row) -> None:
        """The row joins the batch: the next step runs its prefill."""
        job, strategy = row.job, row.job.strategy
        size = next(n for n in pool_sizes(self.batch.cache.capacity) if n > len(self.batch.rows))
        row.pool = strategy.name, strategy.options.sampling.greedy, size
        row.drafter = self.pools[row.pool].pop()
        try:
            row.generation = self.batch.add(job.ids, job.options, row.drafter)
        except Exception as error:  # this request's own: its neighbours decode on
            self._end(row, DecodingFailed(f"it could not join the batch: {str(error).splitlines()[0]}"))
            return
        self._rows[row.generation] = row

    def _step(self) -> None:
        try:
            stepped = self.batch.step()
        except Exception as error:  # one forward for all rows: each of them ends, the batch starts afresh
            failure = DecodingFailed(f"a decoding step failed: {str(error).splitlines()[0]}")
            for generation in reversed(list(self.batch.rows)):  # the last row first: no row moves
                self.batch.remove(generation)
                self._end(self._rows[generation], failure)
            return
        self.steps, self.row_steps = self.steps + 1, self.row_steps + len(stepped)
        for generation, emitted in stepped:
            self._emit(self._rows[generation], emitted)

    def _emit(self, row: Row, emitted: Emitted) -> None:
        row.outbox.put(emitted)
        if row.generation.finished:  # the batch let it go
            self._end(row)

    def _remove(self, row: Row) -> None:
        """A row whose request left: out of the batch, unless it ended already."""
        if row.generation in self._rows:
            self.batch.remove(row.generation)
            self._end(row)

    def _end(self, row: Row, failure: DecodingFailed | None = None) -> None:
        """The row is out of the batch: its request gets END (or the failure), its drafter goes back."""
        row.outbox.put(failure or END)
        self.pools[row.pool].append(row.drafter)
        self._rows.pop(row.generation, None)
        self._trim_heap()
