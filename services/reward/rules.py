"""Built-in rule rewards (`--reward_func math`, `exact_match`, `format`, or several joined by commas,
whose rewards add up).

- math: the final answer is the last \\boxed{...} of the response, else its last number; it is
  compared with the label by math-verify (in worker processes, with a time limit per sample) and
  earns the correct / wrong / no-answer reward of the scheme (e.g. 1 / -0.5 / -1 as in
  simpleRL-reason).
- exact_match: the last \\boxed{...} of the response (else the whole response) equals the label
  after trimming and collapsing whitespace: 1, else 0.
- format: the whole response matches --format_pattern: --format_reward, else 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import multiprocessing.pool
import re
import threading

import grpc
import numpy as np

from services.common.errors import ServiceError, invalid_argument
from services.reward import math_check
from services.reward.source import RewardSource, ScoreBatch, SourceScores

RULES = ("math", "exact_match", "format")
LABELLED_RULES = ("math", "exact_match")
# math-verify work per sample: two parses and a comparison, each limited to the time limit.
_CALLS_PER_SAMPLE = 3
_CHUNK = 16  # samples per worker task: small, so a slow sample delays few others


# ----------------------------------------------------------------------------------------------
# Answer extraction (pure functions)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in the text ("1,234" -> "1234", "-3/4" stays), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last \\boxed{} content first, then the last number."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    return last_number(response)


def normalize_answer(text: str) -> str:
    """Trims, drops $ signs, spaces and a trailing period, so "$ 12 .$" == "12"."""
    text = text.strip().replace("$", "")
    return re.sub(r"\s+", "", text).rstrip(".")


def exact_match(response: str, label: str) -> bool:
    """The response's last \\boxed{} (else the whole response) equals the label, whitespace collapsed."""
    answer = last_boxed(response)
    answer = response if answer is None else answer
    collapse = lambda s: " ".join(s.split())  # noqa: E731
    return collapse(answer) == collapse(label)


# ----------------------------------------------------------------------------------------------
# The source


def _discard_pool(pool) -> threading.Thread:
    """Terminates a worker pool in a daemon thread, returned so callers may wait a little.

    Pool.terminate() blocks for ever when a worker died (OOM killer, SIGKILL) while holding the task
    queue's lock, which idle workers hold while they wait; it must never run on the event loop.
    Daemon workers left behind are killed by multiprocessing when the process exits.
    """
    thread = threading.Thread(target=pool.terminate, daemon=True, name="math-pool-terminate")
    thread.start()
    return thread


@dataclasses.dataclass
class MathScheme:
    """Rewards of the math rule."""

    correct: float = 1.0
    wrong: float = 0.0
    no_answer: float = 0.0


class RuleRewardSource(RewardSource):
    """Sums the rewards of the chosen rules; per-rule results are extra metrics."""

    kind = "rule"

    def __init__(self, rules: list[str], scheme: MathScheme = MathScheme(), verify_timeout_s: int = 5,
                 workers: int = 2, format_pattern: str = r"<think>.+?</think>\s*<answer>.+?</answer>",
                 format_reward: float = 1.0, guard_slack_s: float = 10.0):
        unknown = [r for r in rules if r not in RULES]
        if unknown or not rules:
            raise ValueError(f"unknown rule(s) {unknown}; choose from {list(RULES)}")
        self.rules = list(rules)
        self.scheme = scheme
        self.verify_timeout_s = verify_timeout_s
        self.workers = workers
        self.format_pattern = re.compile(format_pattern, re.DOTALL)
        self.format_reward = format_reward
        self.guard_slack_s = guard_slack_s  # added to the per-chunk guard over the per-sample limits
        self.requires_labels = any(r in LABELLED_RULES for r in self.rules)
        self._pool: multiprocessing.pool.Pool | None = None
        # One chunk per worker at a time, so a chunk's guard clock starts only when a worker takes it.
        self._slots: asyncio.Semaphore | None = None

    def describe(self) -> str:
        return ",".join(self.rules)

    async def start(self) -> None:
        if "math" in self.rules and self._pool is None:
            self._pool = self._new_pool()
            self._slots = asyncio.Semaphore(self.workers)

    def _new_pool(self):
        # spawn: fresh interpreters, never a fork of this threaded (gRPC, torch) process.
        return multiprocessing.get_context("spawn").Pool(self.workers, initializer=math_check.warm_up)

    async def close(self) -> None:
        if self._pool is not None:
            await asyncio.to_thread(_discard_pool(self._pool).join, 5.0)
            self._pool = None

    async def score(self, batch: ScoreBatch) -> SourceScores:
        if self.requires_labels:
            for i, label in enumerate(batch.labels):
                if not label.strip():
                    needing = [r for r in self.rules if r in LABELLED_RULES]
                    raise invalid_argument(f"samples[{i}].label", batch.describe(i), "is empty, and the "
                                           f"{'/'.join(needing)} rule compares the response with it",
                                           "send each sample's reference answer in Sample.label")
        n = len(batch)
        total = np.zeros(n)
        extra: dict[str, np.ndarray] = {}
        for rule in self.rules:
            if rule == "math":
                rewards, metrics = await self._math(batch)
            elif rule == "exact_match":
                hits = await asyncio.to_thread(lambda: [exact_match(r, lab) for r, lab in zip(batch.responses, batch.labels)])
                rewards = np.array(hits, dtype=np.float64)
                metrics = {"exact_match": rewards.copy()}
            else:
                hits = await asyncio.to_thread(lambda: [self.format_pattern.fullmatch(r.strip()) is not None
                                                        for r in batch.responses])
                ok = np.array(hits, dtype=np.float64)
                rewards, metrics = ok * self.format_reward, {"format_ok": ok}
            total += rewards
            extra.update(metrics)
            if len(self.rules) > 1:
                extra[f"{rule}_reward"] = rewards
        return SourceScores(total, total.copy(), extra)

    async def _math(self, batch: ScoreBatch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        answers = await asyncio.to_thread(lambda: [extract_answer(r) for r in batch.responses])
        n = len(batch)
        correct = np.zeros(n, dtype=bool)
        timed_out = np.zeros(n, dtype=bool)
        no_answer = np.array([a is None for a in answers])
        # Identical normalised strings need no parser; math-verify decides the rest ("0.5" vs "\frac12").
        pending = []
        for i, (answer, label) in enumerate(zip(answers, batch.labels)):
            if answer is None:
                continue
            if normalize_answer(answer) == normalize_answer(label):
                correct[i] = True
            else:
                pending.append(i)
        chunks = [pending[k:k + _CHUNK] for k in range(0, len(pending), _CHUNK)]
        results = await asyncio.gather(*(self._verify(batch, answers, idx) for idx in chunks))
        for idx, result in zip(chunks, results):
            for i, (ok, late) in zip(idx, result):
                correct[i], timed_out[i] = ok, late
        s = self.scheme
        rewards = np.where(no_answer, s.no_answer, np.where(correct, s.correct, s.wrong)).astype(np.float64)
        return rewards, {"accuracy": correct.astype(np.float64), "no_answer": no_answer.astype(np.float64),
                         "verify_timeout": timed_out.astype(np.float64)}

    async def _verify(self, batch: ScoreBatch, answers: list[str | None], idx: list[int]) -> list[tuple[bool, bool]]:
        """Runs one chunk in the worker pool, guarded by a time limit of its own.

        The per-sample limit inside the worker should always fire first; if a worker hangs anyway
        (stuck in C code, killed), the pool is replaced so later requests are not stuck behind it.
        """
        if self._pool is None:
            await self.start()
        async with self._slots:
            pool = self._pool
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def settle(ok: bool, value) -> None:
                if not future.done():
                    (future.set_result if ok else future.set_exception)(value)

            pairs = [(answers[i], batch.labels[i]) for i in idx]
            pool.apply_async(math_check.check_answers, (pairs, self.verify_timeout_s),
                             callback=lambda r: loop.call_soon_threadsafe(settle, True, r),
                             error_callback=lambda e: loop.call_soon_threadsafe(settle, False, e))
            guard_s = self.guard_slack_s + len(idx) * (_CALLS_PER_SAMPLE * self.verify_timeout_s + 1)
            try:
                return await asyncio.wait_for(future, guard_s)
            except TimeoutError:
                if self._pool is pool:
                    self._pool = self._new_pool()
                    _discard_pool(pool)
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"math-verify did not finish samples {', '.join(map(str, idx))} within "
                                   f"{guard_s:g} s; its worker processes were restarted; retry the request or lower "
                                   "--math_verify_timeout_s") from None
