"""One step's samples, from the moment each arrives until the batch is ready to train on.

The prompts of a step are registered in dispatch order (`expect`) and cut into fixed micro-batches
of consecutive prompts (about micro_rollout_batch_size samples each). As samples stream in
(`add`), a micro-batch whose samples have all arrived is sent at once to Score on the reward
service, and, once its groups are known to be kept (at once without dynamic filtering), to
RefLogProbs, LogProbs and Values. So scoring and log-probs run while generation continues, and yet
which samples share a call never depends on arrival order: padded batches give results that
differ in the last bits with their company, and Adam turns such bits into different updates, so
a fixed grouping is what makes a step reproducible (and a resumed run equal an uninterrupted one).

With colocation the learner sleeps while the engines generate, so the log-probs wait for `finish`
(defer_logprobs); there, packed log-probs (no reference model to agree with bit for bit) go in one
call for the whole step, which the learner cuts into full passes by tokens, instead of one call per
micro-batch. `finish` waits for all the work; `kept_samples` returns the samples of kept groups in
prompt order, then sample index.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import torch

from services.coordinator.loop.data import Prompt

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
    # Metrics the reward source gave once for the Score call of this sample's micro-batch, name ->
    # (value x samples, samples): held by the call's first sample only, so each call counts once.
    score_batch_metrics: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)
    old_logprobs: torch.Tensor | None = None  # (T,) float32
    ref_logprobs: torch.Tensor | None = None  # (T,) float32
    values: torch.Tensor | None = None  # (T,) float32
    # Weight version that generated each response token, (T,) int64; None: weight_version for all.
    # Multi-turn agent episodes: each model token its own (a turn's, or several with --partial_rollout);
    # environment tokens take the version of the model token before them.
    token_versions: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None  # (T,) float32, the engine's own log-probs (--use_tis)
    action_mask: torch.Tensor | None = None  # (T,) uint8, 0 on environment tokens; None: all 1
    failed: bool = False  # an agent episode that failed: its group is not trained on
    episode: dict | None = None  # agent episodes: turns, environment step times

    @property
    def oldest_version(self) -> int:
        """The weight version of the sample's oldest token."""
        return int(self.token_versions.min()) if self.token_versions is not None else self.weight_version

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


@dataclasses.dataclass
class _MicroBatch:
    uids: list[str]  # consecutive prompts in dispatch order
    scored: bool = False  # Score sent
    logprobs_sent: bool = False


class StepCollector:
    """Collects one step's samples and runs the per-sample RPCs in fixed micro-batches as they arrive."""

    def __init__(self, n_samples_per_prompt: int, micro_batch: int, score: ScoreFn, logprobs: LogprobFn,
                 keep_group: Callable[[list[float]], bool] | None = None, defer_logprobs: bool = False,
                 merge_deferred: bool = False):
        self.n = n_samples_per_prompt
        self.prompts_per_batch = max(1, micro_batch // n_samples_per_prompt)
        self._score, self._logprobs = score, logprobs
        self.keep_group = keep_group  # None: every group is kept (no dynamic filtering)
        self.defer_logprobs = defer_logprobs  # colocation: the learner is asleep during generation
        # Deferred log-probs in one call for every micro-batch instead of one call each (the learner
        # then forms its passes over the whole step): only where the grouping into calls does not
        # reach the results' bits, i.e. packed passes that no reference model compares with.
        self.merge_deferred = merge_deferred
        self.groups: dict[str, list[Sample | None]] = {}
        self.prompt_order: list[str] = []
        self.kept: list[str] = []  # prompt uids of kept groups
        self.dropped: list[str] = []
        self._batches: list[_MicroBatch] = []
        self._batch_of: dict[str, _MicroBatch] = {}
        self._tasks: set[asyncio.Task] = set()
        self._errors: list[BaseException] = []
        self.generated_tokens = 0

    # ---- arrival ----
    def expect(self, prompts: list[Prompt]) -> None:
        """Registers prompts about to be generated (in dispatch order) and their micro-batches."""
        uids = [p.uid for p in prompts]
        for uid in uids:
            self.groups[uid] = [None] * self.n
        self.prompt_order += uids
        for i in range(0, len(uids), self.prompts_per_batch):
            batch = _MicroBatch(uids[i:i + self.prompts_per_batch])
            self._batches.append(batch)
            self._batch_of.update({uid: batch for uid in batch.uids})

    def add(self, sample: Sample) -> None:
        uid = sample.prompt.uid
        if uid not in self.groups:
            raise KeyError(f"sample {sample.sample_id} belongs to no prompt of this step")
        self.groups[uid][sample.index] = sample
        self.generated_tokens += len(sample.response_ids)
        batch = self._batch_of[uid]
        if not batch.scored and all(s is not None for u in batch.uids for s in self.groups[u]):
            batch.scored = True
            self._spawn(self._score_then_filter(batch))
            if self.keep_group is None and not self.defer_logprobs:
                # Nothing to wait for: log-probs and values run alongside the scoring.
                self._send_logprobs(batch)

    def forget_prompt(self, prompt: Prompt) -> None:
        """Drops a prompt's samples before it is generated again (after an engine failure).

        Its micro-batch cannot have been sent yet: that needs every one of its samples.
        """
        self.groups[prompt.uid] = [None] * self.n

    # ---- work ----
    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._errors.append(task.exception())

    def _samples(self, uids: list[str]) -> list[Sample]:
        return [s for uid in uids for s in self.groups[uid]]

    async def _score_then_filter(self, batch: _MicroBatch) -> None:
        await self._score(self._samples(batch.uids))
        if self.keep_group is not None:
            for uid in batch.uids:
                (self.kept if self.keep_group([s.reward for s in self.groups[uid]]) else self.dropped).append(uid)
        if not self.defer_logprobs:
            self._send_logprobs(batch)

    def _send_logprobs(self, *batches: _MicroBatch) -> None:
        """One log-probs call for the kept samples of these micro-batches (those not sent yet)."""
        batches = tuple(b for b in batches if not b.logprobs_sent)
        for batch in batches:
            batch.logprobs_sent = True
        uids = [u for b in batches for u in b.uids if self.keep_group is None or u in self.kept]
        if uids:
            self._spawn(self._logprobs(self._samples(uids)))

    def raise_errors(self) -> None:
        if self._errors:
            raise self._errors[0]

    async def _drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_EXCEPTION)
            self.raise_errors()
        self.raise_errors()

    async def wait_scores(self) -> None:
        """Waits until every micro-batch received so far is scored (and, with dynamic filtering,
        every group of it decided)."""
        await self._drain()

    async def finish(self) -> None:
        """Waits for all the work of the step; deferred log-probs are sent now, in order."""
        await self._drain()
        incomplete = [b for b in self._batches if not b.scored]
        if incomplete:
            missing = [u for b in incomplete for u in b.uids if any(s is None for s in self.groups[u])]
            raise RuntimeError(f"samples of prompts {missing[:5]} never arrived")
        if self.defer_logprobs and self.merge_deferred:
            self._send_logprobs(*self._batches)
        else:
            for batch in self._batches:
                self._send_logprobs(batch)
        await self._drain()

    async def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- results ----
    def kept_uids(self) -> list[str]:
        if self.keep_group is None:
            return list(self.prompt_order)
        kept = set(self.kept)
        return [uid for uid in self.prompt_order if uid in kept]

    def kept_samples(self, max_groups: int | None = None) -> list[Sample]:
        """Samples of the kept groups, in prompt order then sample index; at most max_groups groups."""
        return self._samples(self.kept_uids()[:max_groups])

    def all_samples(self) -> list[Sample]:
        return [s for uid in self.prompt_order for s in self.groups[uid] if s is not None]
