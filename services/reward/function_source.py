"""Reward functions: a Python file defining

    def reward_func(queries, prompts, labels, **kwargs):
        return [...]          # one number per sample (list, numpy array or torch tensor), or
        return {"rewards": [...], "scores": [...], "extra_logs": {"name": [...]}}

(`--remote_rm_url path/to/file.py`), or any such callable handed over in Python (the gRPC server
base in function_server.py). Besides the three lists, the function receives those of `responses`,
`sample_ids` and `data_sources` that it names or, with **kwargs, all of them.

Each batch runs in its own daemon thread, off the event loop, with a time limit. Python cannot stop
a thread, so a call past the limit fails the batch and is left to finish in the background; being a
daemon thread it never holds up shutdown.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import pathlib
import threading
import time
from collections.abc import Callable

import grpc

from services.common.config import ConfigError
from services.common.errors import ServiceError
from services.reward import metrics
from services.reward.source import InvalidScores, RewardSource, ScoreBatch, SourceScores, invalid_response, \
    scores_from_payload

OPTIONAL_ARGUMENTS = ("responses", "sample_ids", "data_sources")


def load_reward_func(path: str) -> Callable:
    """Imports `reward_func` from a Python file; ConfigError says what is missing."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"--remote_rm_url {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlmesh_reward_func_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is a config problem
        raise ConfigError(f"--remote_rm_url {path}: importing it failed: {type(exc).__name__}: {exc}") from exc
    func = vars(module).get("reward_func")
    if not callable(func):
        raise ConfigError(f"--remote_rm_url {path}: defines no function reward_func(queries, prompts, labels, **kwargs)")
    return func


def _run_in_daemon_thread(func: Callable, *args, **kwargs) -> asyncio.Future:
    """Starts func in a daemon thread; the returned future gets its result or exception."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():  # cancelled when the caller gave up on it
            (future.set_result if ok else future.set_exception)(value)

    def target() -> None:
        try:
            result, ok = func(*args, **kwargs), True
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, result)
        except RuntimeError:
            pass  # the event loop closed while the function ran; nobody waits for it

    threading.Thread(target=target, daemon=True, name="reward-func").start()
    return future


class FunctionRewardSource(RewardSource):
    """Calls a reward function on chunks of `batch_size` samples, `max_in_flight` at a time."""

    kind = "function"

    def __init__(self, func: Callable, origin: str, timeout_s: float, batch_size: int = 1024,
                 max_in_flight: int = 4):
        self.func = func
        self.origin = origin
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        params = inspect.signature(func).parameters.values()
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
        names = {p.name for p in params}
        self.optional = [a for a in OPTIONAL_ARGUMENTS if takes_all or a in names]
        self._limit: asyncio.Semaphore | None = None

    @classmethod
    def from_file(cls, path: str, timeout_s: float, batch_size: int = 1024, max_in_flight: int = 4):
        return cls(load_reward_func(path), path, timeout_s, batch_size, max_in_flight)

    def describe(self) -> str:
        return self.origin

    async def start(self) -> None:
        self._limit = asyncio.Semaphore(self.max_in_flight)

    async def score(self, batch: ScoreBatch) -> SourceScores:
        if self._limit is None:
            await self.start()
        tasks = [asyncio.create_task(self._score_chunk(batch.slice(i, i + self.batch_size), i))
                 for i in range(0, len(batch), self.batch_size)]
        try:
            return SourceScores.concat(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _score_chunk(self, chunk: ScoreBatch, offset: int) -> SourceScores:
        extra = {"responses": chunk.responses, "sample_ids": chunk.sample_ids, "data_sources": chunk.data_sources}
        kwargs = {name: list(extra[name]) for name in self.optional}
        span = f"samples {offset}..{offset + len(chunk) - 1}"
        async with self._limit:
            start = time.monotonic()
            future = _run_in_daemon_thread(self.func, list(chunk.queries), list(chunk.prompts), list(chunk.labels),
                                           **kwargs)
            try:
                result = await asyncio.wait_for(future, self.timeout_s)
            except TimeoutError:
                self._record("timeout", start)
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"reward function {self.origin} did not return within --reward_func_timeout_s "
                                   f"{self.timeout_s:g} s for {span} (it keeps running in the background); "
                                   "make it faster, lower --remote_rm_batch_size, or raise the timeout") from None
            except ServiceError:
                # The function chose the status itself (e.g. INVALID_ARGUMENT for a missing label).
                self._record("error", start)
                raise
            except Exception as exc:  # noqa: BLE001 - user code may raise anything
                self._record("error", start)
                raise ServiceError(grpc.StatusCode.INTERNAL,
                                   f"reward function {self.origin} raised {type(exc).__name__}: {exc} "
                                   f"(scoring {span})") from None
        try:
            scores = scores_from_payload(result, len(chunk), offset)
        except InvalidScores as exc:
            self._record("invalid_response", start)
            raise invalid_response(self.origin, str(exc)) from None
        self._record("ok", start)
        return scores

    def _record(self, outcome: str, start: float) -> None:
        metrics.REMOTE_REQUESTS.labels(self.origin, outcome).inc()
        metrics.REMOTE_DURATION.labels(self.origin).observe(time.monotonic() - start)
