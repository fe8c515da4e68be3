"""Reward functions: a Python file defining

    def reward_func(queries, prompts, labels, **kwargs):
        return [...]          # one number per sample (list, numpy array or torch tensor), or
        return {"rewards": [...], "scores": [...], "extra_logs": {"name": [...] or a number}}

(`--remote_rm_url path/to/file.py`), or any such callable handed over in Python (the gRPC server
base in function_server.py; it must be defined at module level, since workers import it by name).
Besides the three lists, the function receives those of `responses`, `sample_ids`, `data_sources`
and `extra_infos` (each row's extra_info dict, {} when it has none) that it names or, with **kwargs,
all of them.

Each call runs in a worker process, in its main thread (function_worker.py): libraries that time
out with SIGALRM, such as math-verify, work as in a script, and a call past the time limit is
stopped by killing its worker, which is replaced. `workers_at_start` workers start together when
the source is made (the reward service starts as many as it may run at once, up to one per CPU
core): a file that imports torch takes seconds to load, and a step's first calls waiting for new
workers made its scoring seconds slower than the next steps'. More, up to `max_in_flight`, are
started as calls need them. A crash, a hang or an exception in user code fails the request with an error
naming the file and the samples; it never turns into a reward of zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import grpc

from services.common.config import ConfigError
from services.common.errors import ServiceError
from services.common.tasks import gather_or_cancel
from services.reward import function_worker, metrics
from services.reward.source import InvalidScores, RewardSource, ScoreBatch, SourceScores, invalid_response, \
    scores_from_payload


_REPO = pathlib.Path(__file__).resolve().parents[2]  # where workers import services.reward.function_worker from


def load_reward_func(path: str) -> Callable:
    """Imports `reward_func` from a Python file in this process; ConfigError says what is missing."""
    try:
        return function_worker.load_reward_func(path)
    except function_worker.ImportProblem as exc:
        raise ConfigError(str(exc)) from None


class _Worker:
    """One worker process (function_worker.py) and the parent's ends of its two pipes.

    A plain subprocess, not multiprocessing: a spawned multiprocessing child imports the service's
    __main__ again (torch, gRPC: ~230 MB and seconds per worker); this one imports only the worker
    module and the user's code. Its blocking methods run in threads.
    """

    def __init__(self, target: tuple):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "services.reward.function_worker",
                                             str(to_child_r), str(from_child_w)],
                                            pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.send_conn = Connection(to_child_w, readable=False)
        self.recv_conn = Connection(from_child_r, writable=False)
        self.optional: list[str] = []
        self.send_conn.send(target)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> tuple:
        """("ready", optional args) | ("failed", why) | ("timeout",) | ("died", exit code)."""
        return self._receive(timeout_s)

    def call(self, request: tuple, timeout_s: float) -> tuple:
        """Sends one call and waits for its answer; a worker past the limit is killed here."""
        try:
            self.send_conn.send(request)
        except (OSError, EOFError):
            return self._died()
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> tuple:
        try:
            if not self.recv_conn.poll(timeout_s):
                self.kill()
                return ("timeout",)
            return self.recv_conn.recv()
        except (EOFError, OSError):
            return self._died()

    def _died(self) -> tuple:
        try:
            code = self.process.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return ("died", code)

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass  # unkillable for now (stuck in the kernel); nothing waits for it
        self.send_conn.close()
        self.recv_conn.close()


class FunctionRewardSource(RewardSource):
    """Calls a reward function on chunks of `batch_size` samples, in up to `max_in_flight` worker processes."""

    kind = "function"

    def __init__(self, func: Callable | str, origin: str, timeout_s: float, batch_size: int = 1024,
                 max_in_flight: int = 4, start_timeout_s: float | None = None, workers_at_start: int = 1):
        """func: the function, or the path of a file defining reward_func. `workers_at_start` workers
        (at least one, at most max_in_flight) start here together (so a file that does not import is
        a ConfigError before the service serves)."""
        try:
            self.target = function_worker.target_of(func)
        except ValueError as exc:
            raise ConfigError(f"reward function {origin}: {exc}; define it at module level, so that worker "
                              "processes can import it") from None
        self.origin = origin
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        # Importing the user's file may load models: it gets at least the call limit.
        self.start_timeout_s = start_timeout_s or max(timeout_s, 60.0)
        # One thread per worker waits on its pipe, so the event loop never blocks on user code.
        self._threads = concurrent.futures.ThreadPoolExecutor(max_in_flight + 1, thread_name_prefix="reward-func")
        self._idle: list[_Worker] = []
        self._live = 0
        self._workers: set[_Worker] = set()  # every started worker, idle or busy, for close()
        self._freed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        started = self._start_workers(max(1, min(workers_at_start, max_in_flight)))
        self.optional: list[str] = started[0].optional
        self._idle.extend(started)
        self._live = len(started)

    @classmethod
    def from_file(cls, path: str, timeout_s: float, batch_size: int = 1024, max_in_flight: int = 4,
                  workers_at_start: int = 1):
        return cls(path, path, timeout_s, batch_size, max_in_flight, workers_at_start=workers_at_start)

    def describe(self) -> str:
        return self.origin

    def _start_worker(self) -> _Worker:
        """Starts a worker and waits until it imported the function (blocking; ConfigError if it cannot)."""
        return self._start_workers(1)[0]

    def _start_workers(self, count: int) -> list[_Worker]:
        """Starts `count` workers at once and waits until each imported the function (blocking);
        if one cannot, all are stopped and the first failure is a ConfigError."""
        workers = []
        try:
            for _ in range(count):
                workers.append(_Worker(self.target))
            replies = [worker.wait_ready(self.start_timeout_s) for worker in workers]
        except BaseException:
            for worker in workers:
                worker.kill()
            raise
        failed = next((reply for reply in replies if reply[0] != "ready"), None)
        if failed is None:
            for worker, reply in zip(workers, replies):
                worker.optional = reply[1]
                self._workers.add(worker)
            return workers
        for worker in workers:
            worker.kill()
        raise self._start_error(failed)

    def _start_error(self, reply: tuple) -> ConfigError:
        if reply[0] == "failed":
            return ConfigError(reply[1] if reply[1].startswith("--remote_rm_url") else
                              f"reward function {self.origin}: loading it in a worker process failed: {reply[1]} "
                              "(define it at module level, so that the worker can import it)")
        if reply[0] == "timeout":
            return ConfigError(f"reward function {self.origin}: its worker process did not finish importing it "
                              f"within {self.start_timeout_s:g} s; make the import faster or raise "
                              "--reward_func_timeout_s")
        return ConfigError(f"reward function {self.origin}: its worker process exited with code {reply[1]} while "
                          "importing it; its output above, or running the file with python, says why")

    async def start(self) -> None:
        # The condition belongs to one event loop; tests and tools may call from a new one each time.
        if self._loop is not asyncio.get_running_loop():
            self._loop, self._freed = asyncio.get_running_loop(), asyncio.Condition()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()
        # A busy worker may be stuck in user code: kill it, and the thread waiting on it sees its pipe close.
        for worker in list(self._workers):
            if worker.alive():
                worker.process.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _acquire(self) -> _Worker:
        async with self._freed:
            while True:
                if self._closed:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the reward service is shutting down")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_in_flight:
                    self._live += 1
                    break
                await self._freed.wait()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, self._start_worker)
        except BaseException:
            await self._release(None)
            raise

    async def _release(self, worker: _Worker | None) -> None:
        """Back to the idle list, or (None, or a worker that was killed) one live worker fewer."""
        async with self._freed:
            if worker is not None and worker.alive() and not self._closed:
                self._idle.append(worker)
            else:
                if worker is not None:
                    worker.kill()
                    self._workers.discard(worker)
                self._live -= 1
            self._freed.notify()

    async def score(self, batch: ScoreBatch) -> SourceScores:
        await self.start()
        # One failed chunk fails the batch: the others stop instead of running on.
        return SourceScores.concat(await gather_or_cancel(
            self._score_chunk(batch.slice(i, i + self.batch_size), i) for i in range(0, len(batch), self.batch_size)))

    async def _call(self, request: tuple) -> tuple:
        """Runs one call in a worker; if the caller gives up, the worker is freed when the call ends."""
        worker = await self._acquire()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, worker.call, request, self.timeout_s)
        try:
            reply = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda _: asyncio.ensure_future(self._release(worker)))
            raise
        await self._release(worker)
        return reply

    async def _score_chunk(self, chunk: ScoreBatch, offset: int) -> SourceScores:
        extra = {"responses": chunk.responses, "sample_ids": chunk.sample_ids, "data_sources": chunk.data_sources}
        if "extra_infos" in self.optional:  # parsed once here (the reward service checked each is an object)
            extra["extra_infos"] = [json.loads(t) if t else {} for t in chunk.extra_infos or [""] * len(chunk)]
        kwargs = {name: list(extra[name]) for name in self.optional}
        request = (list(chunk.queries), list(chunk.prompts), list(chunk.labels), kwargs)
        span = _span(chunk, offset)
        start = time.monotonic()
        try:
            reply = await self._call(request)
        except ConfigError as exc:  # a replacement worker could not import the file
            self._record("error", start)
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"{exc} (scoring {span})") from None
        kind = reply[0]
        if kind == "timeout":
            self._record("timeout", start)
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"reward function {self.origin} did not return within --reward_func_timeout_s "
                               f"{self.timeout_s:g} s for {span}; its worker process was killed and is replaced; "
                               "make it faster, lower --remote_rm_batch_size, or raise the timeout")
        if kind == "died":
            self._record("error", start)
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"reward function {self.origin} crashed its worker process (exit code {reply[1]}) "
                               f"while scoring {span}; the worker is replaced; run the function on these samples "
                               "in a script to see why")
        if kind == "error":
            _, name, message, trace, status = reply
            self._record("error", start)
            if status:  # the function chose the status itself (e.g. INVALID_ARGUMENT for a missing label)
                raise ServiceError(grpc.StatusCode[status], message)
            where = f"\n{trace.rstrip()}" if trace else ""
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"reward function {self.origin} raised {name}: {message} (scoring {span}){where}")
        try:
            scores = scores_from_payload(reply[1], len(chunk), offset)
        except InvalidScores as exc:
            self._record("invalid_response", start)
            raise invalid_response(self.origin, f"{exc} (scoring {span})") from None
        self._record("ok", start)
        return scores

    def _record(self, outcome: str, start: float) -> None:
        metrics.REMOTE_REQUESTS.labels(self.origin, outcome).inc()
        metrics.REMOTE_DURATION.labels(self.origin).observe(time.monotonic() - start)


def _span(chunk: ScoreBatch, offset: int) -> str:
    """'sample 5 (id "p3/1")' or 'samples 0..63 (ids "p0/0" .. "p15/3")' for error messages."""
    n = len(chunk)
    if n == 1:
        sid = chunk.sample_ids[0]
        return f'sample {offset} (id "{sid}")' if sid else f"sample {offset}"
    first, last = chunk.sample_ids[0], chunk.sample_ids[-1]
    ids = f' (ids "{first}" .. "{last}")' if first or last else ""
    return f"samples {offset}..{offset + n - 1}{ids}"
