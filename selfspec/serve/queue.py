"""One model, batch size 1: requests decode one at a time, in arrival order, behind a bounded queue.

asyncio.Lock wakes its waiters first come, first served. A request takes a `Ticket` before its response starts (a
full queue is a 429 then, not a broken stream), waits for its turn, and frees its place when it ends, fails or is
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
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting  # requests waiting behind the running one
        self.pending = 0  # tickets taken and not yet released: waiting ones plus the running one
        self.running = False
        self.last_request_s = 1.0  # how long the last request held the model: the Retry-After estimate
        self._lock = asyncio.Lock()

    def take(self) -> "Ticket":
        """A place in the queue, or QueueFull with a Retry-After estimate."""
        if self.pending > self.max_waiting:
            raise QueueFull(max(1, math.ceil(self.last_request_s * (self.pending - self.max_waiting))))
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
        """Wait for the model, hold it inside the block; the place is freed however the block ends."""
        try:
            async with self.queue._lock:
                self.queue.running, start = True, clock()
                try:
                    yield
                finally:
                    self.queue.running, self.queue.last_request_s = False, clock() - start
        finally:
            self.release()

    def release(self) -> None:
        """Free the place (once; also for a request that never got its turn)."""
        if not self.released:
            self.released = True
            self.queue.pending -= 1
