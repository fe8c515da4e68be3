"""Score answers kept by request id, so that a batch sent twice is scored once.

A caller that did not hear an answer (its connection was reset, the reply was lost, its channel
sent the call again) may send the same ScoreRequest again. A request with a non-empty request_id
is keyed by that id and a digest of the whole request, so a different batch under the same id is
never mistaken for it: a request still being scored is joined, a finished one is answered from
memory, and the remote reward server or the reward model sees the samples once. Only successes
are kept (a failure may be worth another attempt), and only the newest `capacity` of them.

Work nobody waits for stops: when every caller of a running request has gone (deadline passed,
cancelled), its scoring is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message


@dataclasses.dataclass
class _Running:
    task: asyncio.Task
    waiters: int = 0


class RecentAnswers:
    """A bounded LRU of finished answers plus the requests being computed, by request key."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._done: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._running: dict[bytes, _Running] = {}

    @staticmethod
    def key(request: Message) -> bytes | None:
        """The request's key, or None when it has no request_id (such a request is never deduplicated)."""
        if not request.request_id:
            return None
        digest = hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16)
        return digest.digest()

    def __len__(self) -> int:
        return len(self._done)

    async def get_or_compute(self, key: bytes | None, compute: Callable[[], Awaitable[Any]]) -> tuple[Any, bool]:
        """(answer, reused): the kept or running answer of `key`, else compute()'s."""
        if key is None or self.capacity <= 0:
            return await compute(), False
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key], True
        running = self._running.get(key)
        reused = running is not None
        if running is None:
            running = _Running(asyncio.ensure_future(compute()))
            self._running[key] = running
            running.task.add_done_callback(lambda task: self._finished(key, running))
        running.waiters += 1
        try:
            # shield: one caller leaving must not cancel the work another caller still waits for.
            return await asyncio.shield(running.task), reused
        finally:
            running.waiters -= 1
            if running.waiters == 0 and not running.task.done():
                running.task.cancel()

    def _finished(self, key: bytes, running: _Running) -> None:
        if self._running.get(key) is running:
            del self._running[key]
        task = running.task
        if task.cancelled() or task.exception() is not None:
            return
        self._done[key] = task.result()
        self._done.move_to_end(key)
        while len(self._done) > self.capacity:
            self._done.popitem(last=False)
