"""One step's samples, from the moment each arrives until the batch is ready to train on.

`StepCollector.add` receives every generated sample as it streams in and starts the work it
needs as soon as a micro-batch is full: Score on the reward service, and, once a sample's group
is known to be kept (at once without dynamic filtering), RefLogProbs, LogProbs and Values. So
scoring and log-probs run while generation continues. `finish` sends the last partial
micro-batches and waits for everything; `kept_samples` returns the samples of whole, kept groups
in a fixed order (prompt order, then sample index), independent of arrival order.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import torch

from services.coordinator.data import Prompt

ScoreFn = Callable[[list["Sample"]], Awaitable[None]]  # fills sample.reward / .score / .extra
LogprobFn = Callable[[list["Sample"]], Awaitable[None]]  # fills old/ref log-probs and values


@dataclasses.dataclass(eq=False)
class Sample:
    """One generated response and everything computed about it."""

    prompt: Prompt
    index: int  # sample index within its prompt's group
    response_ids: torch.Tensor  # (T,) int64
    text: str
    finish_reason: int
    weight_version: int
    reward: float | None = None  # from the reward service (after its normalisation and clipping)
    score: float | None = None  # raw score before normalisation and clipping
    extra: dict[str, float] = dataclasses.field(default_factory=dict)
    old_logprobs: torch.Tensor | None = None  # (T,) float32
    ref_logprobs: torch.Tensor | None = None  # (T,) float32
    values: torch.Tensor | None = None  # (T,) float32

    @property
    def sample_id(self) -> str:
        return f"{self.prompt.uid}/{self.index}"

    @property
    def sequence(self) -> torch.Tensor:
        """Prompt followed by response, (len(prompt) + T,) int64."""
        return torch.cat([torch.tensor(self.prompt.token_ids, dtype=torch.int64), self.response_ids])

    @property
    def response_start(self) -> int:
        return len(self.prompt.token_ids)


class StepCollector:
    """Collects one step's samples and runs the per-sample RPCs in micro-batches as they arrive."""

    def __init__(self, n_samples_per_prompt: int, micro_batch: int, score: ScoreFn, logprobs: LogprobFn,
                 keep_group: Callable[[list[float]], bool] | None = None, defer_logprobs: bool = False):
        self.n = n_samples_per_prompt
        self.micro_batch = micro_batch
        self._score, self._logprobs = score, logprobs
        self.keep_group = keep_group  # None: every group is kept (no dynamic filtering)
        self.defer_logprobs = defer_logprobs  # colocation: the learner is asleep during generation
        self.groups: dict[str, list[Sample | None]] = {}
        self.prompt_order: list[str] = []
        self.kept: list[str] = []  # prompt uids of kept groups, in the order they were decided
        self.dropped: list[str] = []
        self._score_queue: list[Sample] = []
        self._logprob_queue: list[Sample] = []
        self._tasks: set[asyncio.Task] = set()
        self._errors: list[BaseException] = []
        self.generated_tokens = 0

    # ---- arrival ----
    def add(self, sample: Sample) -> None:
        uid = sample.prompt.uid
        if uid not in self.groups:
            self.groups[uid] = [None] * self.n
            self.prompt_order.append(uid)
        self.groups[uid][sample.index] = sample
        self.generated_tokens += len(sample.response_ids)
        self._score_queue.append(sample)
        if self.keep_group is None:
            self._logprob_queue.append(sample)
        self._flush(final=False)

    def forget_prompt(self, prompt: Prompt) -> None:
        """Drops a prompt's samples before it is generated again (after an engine failure).

        Work already started on them finishes on objects no longer referenced here, so its results
        are ignored.
        """
        self.groups.pop(prompt.uid, None)
        self._score_queue = [s for s in self._score_queue if s.prompt.uid != prompt.uid]
        self._logprob_queue = [s for s in self._logprob_queue if s.prompt.uid != prompt.uid]

    # ---- micro-batches ----
    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._errors.append(task.exception())

    def _flush(self, final: bool) -> None:
        while len(self._score_queue) >= self.micro_batch or (final and self._score_queue):
            batch, self._score_queue = self._score_queue[:self.micro_batch], self._score_queue[self.micro_batch:]
            self._spawn(self._score_then_filter(batch))
        if self.defer_logprobs and not final:
            return
        while len(self._logprob_queue) >= self.micro_batch or (final and self._logprob_queue):
            batch, self._logprob_queue = (self._logprob_queue[:self.micro_batch],
                                          self._logprob_queue[self.micro_batch:])
            self._spawn(self._logprobs(batch))

    async def _score_then_filter(self, batch: list[Sample]) -> None:
        await self._score(batch)
        if self.keep_group is None:
            return
        for uid in dict.fromkeys(s.prompt.uid for s in batch):
            group = self.groups.get(uid)
            if group is None or uid in self.kept or uid in self.dropped:
                continue
            if all(s is not None and s.reward is not None for s in group):
                if self.keep_group([s.reward for s in group]):
                    self.kept.append(uid)
                    self._logprob_queue.extend(group)
                else:
                    self.dropped.append(uid)
        self._flush(final=False)

    def raise_errors(self) -> None:
        if self._errors:
            raise self._errors[0]

    async def wait_scores(self) -> None:
        """Sends the partial score batch and waits until every sample received so far is scored
        (and, with dynamic filtering, every complete group is decided)."""
        self._flush_scores_only()
        while self._tasks:
            await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_EXCEPTION)
            self.raise_errors()
            self._flush_scores_only()

    def _flush_scores_only(self) -> None:
        while self._score_queue:
            batch, self._score_queue = self._score_queue[:self.micro_batch], self._score_queue[self.micro_batch:]
            self._spawn(self._score_then_filter(batch))

    async def finish(self) -> None:
        """Sends every partial micro-batch and waits for all the work of the step."""
        self._flush(final=True)
        while self._tasks:
            await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_EXCEPTION)
            self.raise_errors()
            self._flush(final=True)
        self.raise_errors()

    async def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- results ----
    def kept_uids(self) -> list[str]:
        if self.keep_group is None:
            return [uid for uid in self.prompt_order if uid in self.groups]
        return list(self.kept)

    def kept_samples(self, max_groups: int | None = None) -> list[Sample]:
        """Samples of the kept groups, in prompt order then sample index; at most max_groups groups."""
        order = {uid: i for i, uid in enumerate(self.prompt_order)}
        uids = sorted(self.kept_uids(), key=order.__getitem__)[:max_groups]
        samples = []
        for uid in uids:
            group = self.groups[uid]
            missing = [i for i, s in enumerate(group) if s is None]
            if missing:
                raise RuntimeError(f"prompt {uid}: samples {missing} never arrived")
            samples.extend(group)
        return samples

    def all_samples(self) -> list[Sample]:
        return [s for uid in self.prompt_order if uid in self.groups for s in self.groups[uid] if s is not None]
