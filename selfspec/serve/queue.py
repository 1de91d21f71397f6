"""Who decodes: up to `max_running` requests at once (serve.max_batch, the decoding batch's rows), the others wait
in arrival order behind them in a bounded queue.

asyncio.Semaphore wakes its waiters first come, first served. A request takes a `Ticket` before its response starts
(a full queue is a 429 then, not a broken stream), waits for its turn, and frees its place when it ends, fails or is
cancelled (a client that went away), so the next request starts.
"""

import asyncio
import math
from contextlib import asynccontextmanager

from selfspec.timing import clock


class QueueFull(Exception):
    def __init__(self, retry_after_s: int):
        super().__init__(f"the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RequestQueue:
    def __init__(self, max_running: int, max_waiting: int):
        self.max_running = max_running  # requests decoding at once
        self.max_waiting = max_waiting  # requests waiting beyond them
        self.pending = 0  # tickets taken and not yet released: waiting ones plus running ones
        self.running = 0
        self.last_request_s = 1.0  # how long the last request decoded: the Retry-After estimate
        self._slots = asyncio.Semaphore(max_running)

    def take(self) -> "Ticket":
        """A place in the queue, or QueueFull with a Retry-After estimate: the time for enough running requests
        to end, `max_running` of them per request's time."""
        over = self.pending + 1 - self.max_running - self.max_waiting  # requests that must end first
        if over > 0:
            raise QueueFull(max(1, math.ceil(self.last_request_s * over / self.max_running)))
        self.pending += 1
        return Ticket(self)

    @property
    def waiting(self) -> int:
        return self.pending - self.running


class Ticket:
    def __init__(self, queue: RequestQueue):
        self.queue, self.released = queue, False

    @asynccontextmanager
    async def turn(self):
        """Wait for a place among the running requests, hold it inside the block; the place in the queue is freed
        however the block ends."""
        try:
            async with self.queue._slots:
                self.queue.running, start = self.queue.running + 1, clock()
                try:
                    yield
                finally:
                    self.queue.running, self.queue.last_request_s = self.queue.running - 1, clock() - start
        finally:
            self.release()

    def release(self) -> None:
        """Free the place (once; also for a request that never got its turn)."""
        if not self.released:
            self.released = True
            self.queue.pending -= 1
