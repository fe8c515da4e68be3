"""Remote HTTP reward servers, in the protocol users' servers already speak.

    POST {"query": [...], "prompts": [...], "labels": [...]}
      -> {"rewards": [...], "scores"?: [...], "extra_logs"?: {name: [...]}}

Batching, balancing over several URLs, timeouts and retries come from RemoteSource.
"""

from __future__ import annotations

import json

import aiohttp

from services.reward.remote import FinalError, RemotePolicy, RemoteSource, RetryableError
from services.reward.source import InvalidScores, ScoreBatch, SourceScores, scores_from_payload

_BODY_EXCERPT = 200  # characters of a bad answer quoted in error messages


class HttpRewardSource(RemoteSource):
    """Scores batches by POSTing them to one or more HTTP reward servers."""

    kind = "http"

    def __init__(self, urls: list[str], policy: RemotePolicy, seed: int | None = None):
        super().__init__(urls, policy, seed)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await super().start()
        if self._session is None:
            # The per-call timeout is enforced by RemoteSource (asyncio.timeout); the connector only
            # bounds connections, one per call in flight.
            connector = aiohttp.TCPConnector(limit=self.policy.max_in_flight, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, address: str, chunk: ScoreBatch, offset: int) -> SourceScores:
        payload = {"query": chunk.queries, "prompts": chunk.prompts, "labels": chunk.labels}
        try:
            async with self._session.post(address, json=payload) as response:
                status = response.status
                body = await response.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            # Refused, reset, or closed before the whole answer arrived.
            raise RetryableError("connection_error", f"{address}: {type(exc).__name__}: {exc}") from None
        text = body.decode("utf-8", errors="replace")
        if status >= 500:
            raise RetryableError("http_5xx", f"{address}: HTTP {status}: {text[:_BODY_EXCERPT]}")
        if status >= 400:
            raise FinalError("http_4xx", f"remote reward server {address} rejected the request with HTTP {status} "
                                         f"(not retried): {text[:_BODY_EXCERPT]}")
        if not text.strip():
            raise InvalidScores(f"empty body with HTTP {status}")
        try:
            data = json.loads(text)
        except ValueError:
            raise InvalidScores(f"body is not JSON: {text[:_BODY_EXCERPT]!r}") from None
        return scores_from_payload(data, len(chunk), offset)
