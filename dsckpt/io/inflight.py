"""Work handed to a thread pool with a bound on what is pending: memory stays a few chunks or parts, whatever the size."""
from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any, Callable


class InFlight:
    """Submit jobs to ``pool``, waiting for the oldest once more than ``limit`` are pending; each job returns the
    bytes it did, passed to ``progress``.  ``drain`` waits for the rest; ``cancel`` drops what has not started (a
    failure or Ctrl-C then waits for the running jobs only)."""

    def __init__(self, pool: Executor, limit: int, progress: Callable[[int], None] | None = None):
        self.pool, self.limit, self.progress = pool, limit, progress
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., int | None], *args: Any) -> None:
        self._pending.append(self.pool.submit(fn, *args))
        while len(self._pending) > self.limit:
            self._finish(self._pending.pop(0))

    def drain(self) -> None:
        while self._pending:
            self._finish(self._pending.pop(0))

    def cancel(self) -> None:
        for future in self._pending:
            future.cancel()

    def _finish(self, future: Future) -> None:
        done = future.result()
        if self.progress:
            self.progress(done)
