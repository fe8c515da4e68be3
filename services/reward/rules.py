"""Built-in rule rewards (`--reward_func math`, `simplerl_math`, `exact_match`, `format`, or several
joined by commas, whose rewards add up).

- math: the final answer is the last \\boxed{...} of the response, else what follows its last
  "the answer is" / "answer:" (the first $...$ math there, else the first number, else the words),
  else its last number (scientific notation such as 2.5e3 or 2.5 \\times 10^{3} read whole); it is
  compared with the label by math-verify (in worker processes, with a time limit per sample) and
  earns the correct / wrong / no-answer reward of the scheme (--math_*_reward). Its per-sample
  metrics: accuracy, no_answer, boxed (the answer is in a \\boxed{}: the format hit rate) and
  verify_timeout.
- simplerl_math: simpleRL-reason's reward levels, assigned as its own code assigns them: the model
  output is the decoded sequence from its first "<|im_start|>assistant" up to the first stop word
  (</s>, <|im_end|>, <|endoftext|>); no "boxed" in it: -1, even when the answer is right; else the
  answer after the last "boxed" earns 1 if correct, -0.5 if not. Correctness is math-verify's here
  (simpleRL-reason uses its own grader).
- exact_match: the last \\boxed{...} of the response (else the whole response) equals the label
  after trimming and collapsing whitespace: 1, else 0.
- format: the whole response matches --format_pattern: --format_reward, else 0.
- countdown: the response's expression (last <answer>...</answer>, else last \\boxed{}) reaches the
  label's target with each of its numbers once: 1, an expression that does not: 0.1, none: 0
  (services/reward/countdown.py; the label is `rlmesh make-task countdown`'s JSON).
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
from services.common.flags import LABELLED_REWARD_RULES, REWARD_RULES
from services.reward import countdown, math_check
from services.reward.source import RewardSource, ScoreBatch, SourceScores

RULES = REWARD_RULES
LABELLED_RULES = LABELLED_REWARD_RULES
# math-verify work per sample: two parses and a comparison, each limited to the time limit.
_CALLS_PER_SAMPLE = 3
_CHUNK = 16  # samples per worker task: small, so a slow sample delays few others


# ----------------------------------------------------------------------------------------------
# Answer extraction (pure functions)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "2.5 \times 10^{3}", "2.5×10^3" first, so that the mantissa and the exponent stay one number.
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?\s*(?:\\times|\\cdot|×)\s*10\^(?:\{[-+]?\d+\}|[-+]?\d+)"
                     r"|-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+(?![\w.]))?(?:/\d+)?")
# Prose conclusions: "The answer is ...", "Final answer: ...", "**Answer:** ...".
_ANSWER_PHRASE = re.compile(r"\b(?:final\s+)?answer\s*(?:is|:|=)\s*:?[\s*]*", re.IGNORECASE)
# Inline or display math: $...$, $$...$$, \(...\), \[...\].
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# "2.5e3" -> "2.5\times10^{3}": math-verify reads a lower-case e as Euler's number.
_E_NOTATION = re.compile(r"(?<![\w.\\])(-?\d+(?:\.\d+)?)[eE]\+?(-?\d+)(?![\w.])")


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
    """The last number in the text ("1,234" -> "1234", "-3/4", "2.5e3", "2.5 \\times 10^{3}" stay whole), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def stated_answer(text: str) -> str | None:
    """What follows the last "the answer is" / "answer:": its first $...$ math, else the first number of
    its sentence (after the sentence's last "="), else its words; None without such a phrase."""
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if not phrases:
        return None
    rest = text[phrases[-1].end():]
    # The sentence ends at a line break or at a period followed by a space or the end (not 2.5).
    sentence = re.split(r"\n|\.(?:\s|$)", rest, maxsplit=1)[0]
    math = _MATH_SPAN.search(rest)
    if math and math.start() <= len(sentence):
        return next(g for g in math.groups() if g is not None).strip()
    # "The answer is 3 + 4 = 7": the value comes after the last equals sign.
    number = _NUMBER.search(sentence.split("=")[-1])
    if number:
        return number.group(0).replace(",", "")
    words = sentence.strip().strip("*").strip()
    return words or None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last \\boxed{} content, then a stated answer, then the last number."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    return stated_answer(response) or last_number(response)


def e_notation_to_latex(text: str) -> str:
    """2.5e3 -> 2.5\\times10^{3} (also in labels), which math-verify reads as a number."""
    return _E_NOTATION.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2)}}}", text)


def simplerl_model_output(query: str, response: str) -> str:
    """The text simpleRL-reason grades: the decoded sequence from its first "<|im_start|>assistant",
    cut at the first stop word. Without that marker (a prompt not in ChatML) the response alone,
    since the prompt's own "put your answer in \\boxed{}" would otherwise count as a boxed answer."""
    start = query.find("<|im_start|>assistant")
    text = query[start:] if start >= 0 else response
    for stop in ("</s>", "<|im_end|>", "<|endoftext|>"):
        if stop in text:
            text = text.split(stop)[0].strip()
    return text


def simplerl_answer(model_output: str) -> str:
    """simpleRL-reason's answer of a model output that contains "boxed" (its extract_answer for math):
    a Minerva "final answer is $...$. I hope" first, else the text after the last "boxed", to the
    brace that closes it (or to the next $ without a brace); line breaks removed, a leading ':' and a
    trailing '.' or '/' dropped."""
    text = model_output.replace("\u043a\u0438", "")
    if "final answer is $" in text and "$. I hope" in text:
        answer = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    else:
        after = text.split("boxed")[-1]
        if after.startswith("{"):
            depth, end = 1, len(after)
            for i, c in enumerate(after[1:], 1):
                depth += {"{": 1, "}": -1}.get(c, 0)
                if depth == 0:
                    end = i
                    break
            answer = after[1:end]
        else:
            answer = after.split("$")[0].strip()
    answer = re.sub(r"\n\s*", "", answer)
    answer = answer[1:] if answer.startswith(":") else answer
    return answer[:-1] if answer.endswith((".", "/")) else answer


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


def _countdown(batch: ScoreBatch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rewards, metrics = [], []
    for i, (response, label) in enumerate(zip(batch.responses, batch.labels)):
        try:
            reward, metric = countdown.grade(response, label, last_boxed(response))
        except countdown.LabelError as exc:
            raise invalid_argument(f"samples[{i}].label", batch.describe(i), f"{exc}, which the countdown rule needs",
                                   "write the data with rlmesh make-task countdown, or give each label as "
                                   '{"target": 24, "numbers": [4, 6, 1, 1]}') from None
        rewards.append(reward)
        metrics.append(metric)
    return (np.array(rewards, dtype=np.float64),
            {key: np.array([m[key] for m in metrics], dtype=np.float64) for key in metrics[0]} if metrics else {})


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
        if any(r in ("math", "simplerl_math") for r in self.rules) and self._pool is None:
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
            elif rule == "simplerl_math":
                rewards, metrics = await self._simplerl_math(batch)
            elif rule == "countdown":
                rewards, metrics = await asyncio.to_thread(_countdown, batch)
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
        no_answer = np.array([a is None for a in answers], dtype=bool)
        # The format a prompt asks for ("put the final answer in \boxed{}"): since any last number
        # counts as an answer, no_answer alone says little about whether the model follows it.
        boxed = np.array([last_boxed(r) is not None for r in batch.responses], dtype=np.float64)
        correct, timed_out = await self._judge(answers, batch.labels)
        s = self.scheme
        rewards = np.where(no_answer, s.no_answer, np.where(correct, s.correct, s.wrong)).astype(np.float64)
        return rewards, {"accuracy": correct.astype(np.float64), "no_answer": no_answer.astype(np.float64),
                         "boxed": boxed, "verify_timeout": timed_out.astype(np.float64)}

    async def _simplerl_math(self, batch: ScoreBatch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """simpleRL-reason's levels: no "boxed" in the model output -1 (even if right), else 1 / -0.5."""
        outputs = [simplerl_model_output(q, r) for q, r in zip(batch.queries, batch.responses)]
        boxed = np.array(["boxed" in o for o in outputs], dtype=bool)
        answers = [simplerl_answer(o) if b else None for o, b in zip(outputs, boxed)]
        correct, timed_out = await self._judge(answers, batch.labels)
        rewards = np.where(~boxed, -1.0, np.where(correct, 1.0, -0.5)).astype(np.float64)
        return rewards, {"accuracy": correct.astype(np.float64), "no_boxed": (~boxed).astype(np.float64),
                         "verify_timeout": timed_out.astype(np.float64)}

    async def _judge(self, answers: list[str | None], labels: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(correct, timed_out) bool arrays; a None answer is not correct."""
        n = len(answers)
        correct = np.zeros(n, dtype=bool)
        timed_out = np.zeros(n, dtype=bool)
        answers = [None if a is None else e_notation_to_latex(a) for a in answers]
        labels = [e_notation_to_latex(label) for label in labels]
        # Identical normalised strings need no parser; math-verify decides the rest ("0.5" vs "\frac12").
        pending = []
        for i, (answer, label) in enumerate(zip(answers, labels)):
            if answer is None:
                continue
            if normalize_answer(answer) == normalize_answer(label):
                correct[i] = True
            else:
                pending.append(i)
        chunks = [pending[k:k + _CHUNK] for k in range(0, len(pending), _CHUNK)]
        results = await asyncio.gather(*(self._verify([(answers[i], labels[i]) for i in idx], idx)
                                         for idx in chunks))
        for idx, result in zip(chunks, results):
            for i, (ok, late) in zip(idx, result):
                correct[i], timed_out[i] = ok, late
        return correct, timed_out

    async def _verify(self, pairs: list[tuple[str, str]], idx: list[int]) -> list[tuple[bool, bool]]:
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
