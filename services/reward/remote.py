"""Calling remote reward servers: batching, load balancing, timeouts and retries.

HTTP and gRPC reward servers share this policy; only the call itself differs (`RemoteSource.call`).
A Score batch is cut into chunks of `batch_size` samples, at most `max_in_flight` chunks are on the
wire at once, and each chunk goes to the endpoint with the fewest outstanding requests (endpoints
that failed recently come last). Connection errors, timeouts and 5xx (UNAVAILABLE for gRPC) are retried
with exponential back-off and jitter; anything else fails the batch at once. When the retry budget
is spent the batch fails with UNAVAILABLE, naming the endpoints and the last error.

This is the only layer that retries the reward service -> remote server hop, and it is bounded:
a chunk takes at most (max_retries + 1) attempts of timeout_s each plus the back-offs between
them, i.e. with the defaults 4 x 60 s + at most 0.5 + 1 + 2 s = 243.5 s. The UNAVAILABLE it ends
with is final (services.common.errors), so no client channel sends the batch again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time

import grpc

from services.common.errors import ServiceError
from services.common.tasks import gather_or_cancel
from services.reward import metrics
from services.reward.source import InvalidScores, RewardSource, ScoreBatch, SourceScores, invalid_response


@dataclasses.dataclass
class RemotePolicy:
    """How remote reward servers are called (set from the --remote_rm_* options)."""

    batch_size: int = 64  # samples per call
    max_in_flight: int = 8  # calls on the wire at once, over all endpoints
    timeout_s: float = 60.0  # per call
    max_retries: int = 3  # extra attempts per chunk after the first
    backoff_s: float = 0.5  # first back-off; doubles per retry
    backoff_max_s: float = 8.0


class RetryableError(Exception):
    """A failure worth another attempt (connection error, timeout, 5xx, UNAVAILABLE)."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


class FinalError(Exception):
    """A failure another attempt will not fix (4xx, unusable answer)."""

    def __init__(self, outcome: str, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION):
        super().__init__(message)
        self.outcome = outcome
        self.code = code


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential back-off with jitter: uniform in [cap/2, cap], cap = min(max_s, base_s * 2**attempt).

    Half the cap is kept so delays still grow; the random half spreads out callers that failed together.
    """
    cap = min(max_s, base_s * (2 ** attempt))
    return cap / 2 + rng.uniform(0, cap / 2)


@dataclasses.dataclass
class _Endpoint:
    address: str
    outstanding: int = 0
    # After a failure the endpoint comes last until this time (monotonic seconds), then competes again.
    avoid_until: float = 0.0


class RemoteSource(RewardSource):
    """Base of the HTTP and gRPC remote sources: subclasses implement `call` for one chunk."""

    def __init__(self, addresses: list[str], policy: RemotePolicy, seed: int | None = None):
        if not addresses:
            raise ValueError("at least one remote reward server address is needed")
        self.endpoints = [_Endpoint(a) for a in addresses]
        self.policy = policy
        self._rng = random.Random(seed)
        self._turn = itertools.count()
        self._in_flight: asyncio.Semaphore | None = None

    def describe(self) -> str:
        return ",".join(e.address for e in self.endpoints)

    async def call(self, address: str, chunk: ScoreBatch, offset: int) -> SourceScores:
        """Scores one chunk at one endpoint. Raises RetryableError / FinalError / InvalidScores."""
        raise NotImplementedError

    async def start(self) -> None:
        self._in_flight = asyncio.Semaphore(self.policy.max_in_flight)

    async def score(self, batch: ScoreBatch) -> SourceScores:
        if self._in_flight is None:
            await self.start()
        size = self.policy.batch_size
        # One failed chunk fails the batch: stop the others instead of letting them retry on.
        return SourceScores.concat(await gather_or_cancel(
            self._score_chunk(batch.slice(i, i + size), i) for i in range(0, len(batch), size)))

    def _pick(self) -> _Endpoint:
        """Fewest outstanding requests, endpoints that failed recently last; ties rotate."""
        turn = next(self._turn)
        n = len(self.endpoints)
        order = [self.endpoints[(turn + i) % n] for i in range(n)]
        now = time.monotonic()
        return min(order, key=lambda e: (e.avoid_until > now, e.outstanding))

    async def _score_chunk(self, chunk: ScoreBatch, offset: int) -> SourceScores:
        policy = self.policy
        last_error = ""
        tried: list[str] = []
        async with self._in_flight:
            for attempt in range(policy.max_retries + 1):
                endpoint = self._pick()
                tried.append(endpoint.address)
                endpoint.outstanding += 1
                start = time.monotonic()
                try:
                    async with asyncio.timeout(policy.timeout_s):
                        result = await self.call(endpoint.address, chunk, offset)
                    outcome = "ok"
                except TimeoutError:
                    outcome = "timeout"
                    last_error = f"{endpoint.address}: no answer within --remote_rm_timeout_s {policy.timeout_s:g} s"
                except RetryableError as exc:
                    outcome = exc.outcome
                    last_error = str(exc)
                except FinalError as exc:
                    self._record(endpoint, exc.outcome, start)
                    raise ServiceError(exc.code, str(exc)) from None
                except InvalidScores as exc:
                    self._record(endpoint, "invalid_response", start)
                    raise invalid_response(endpoint.address, str(exc)) from None
                finally:
                    endpoint.outstanding -= 1
                self._record(endpoint, outcome, start)
                if outcome == "ok":
                    return result
                self.last_error = last_error
                if attempt < policy.max_retries:
                    metrics.REMOTE_RETRIES.labels(endpoint.address).inc()
                    await asyncio.sleep(backoff_delay(attempt, policy.backoff_s, policy.backoff_max_s, self._rng))
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            f"remote reward server(s) unavailable: {len(tried)} attempts to score samples "
            f"{offset}..{offset + len(chunk) - 1} failed (tried {', '.join(dict.fromkeys(tried))}); "
            f"last error: {last_error}; check that the servers are up, or raise --remote_rm_retries / "
            "--remote_rm_timeout_s")

    def _record(self, endpoint: _Endpoint, outcome: str, start: float) -> None:
        # A failed endpoint sits out for the longest back-off, so a server that comes back gets traffic again.
        endpoint.avoid_until = 0.0 if outcome == "ok" else time.monotonic() + self.policy.backoff_max_s
        metrics.REMOTE_REQUESTS.labels(endpoint.address, outcome).inc()
        metrics.REMOTE_DURATION.labels(endpoint.address).observe(time.monotonic() - start)
