"""The calls made for each micro-batch of samples as they arrive from the engines: rewards
(Score), and the old policy's, reference's and critic's views (LogProbs, RefLogProbs, Values)."""

from __future__ import annotations

import time
from collections.abc import Awaitable

import torch

from rlmesh.learner.v1 import learner_pb2
from services.common.tasks import gather_or_cancel
from services.common.tensors import ragged_from_proto, ragged_to_proto, to_proto
from services.coordinator.loop.experience import Sample
from services.reward.client import ScoreBatch

RPCS = ("score", "logprobs", "ref_logprobs", "values")


class SampleCalls:
    """Scores and log-probs of micro-batches, with the number and summed seconds of each kind of call
    (they overlap each other and generation). The loop sets `learner` (again after a learner restart),
    `query_decoder` and `step` (the step being collected)."""

    def __init__(self, config, rewards, references, run_id: str, use_ref: bool, use_critic: bool):
        self.config, self.rewards, self.references, self.run_id = config, rewards, references, run_id
        self.use_ref, self.use_critic = use_ref, use_critic
        # Packed forward passes (the training layout) unless a reference model's log-probs are
        # compared with these: the reference service batches padded, and the same padded batches
        # agree bit for bit. Packed, a call's grouping into passes is the learner's, by tokens.
        self.packed = bool(config.packing_samples) and not use_ref
        self.learner = None
        self.query_decoder = None  # token ids -> the query text reward servers get (set by the train command)
        self.agents = None  # an agent run's episodes carry their own rewards
        self.step = 0
        self.seconds = dict.fromkeys(RPCS, 0.0)
        self.counts = dict.fromkeys(RPCS, 0)

    def new_step(self, step: int) -> None:
        self.step, self.seconds, self.counts = step, dict.fromkeys(RPCS, 0.0), dict.fromkeys(RPCS, 0)

    async def _timed(self, what: str, call: Awaitable):
        t0 = time.monotonic()
        self.counts[what] += 1
        try:
            return await call
        finally:
            self.seconds[what] += time.monotonic() - t0

    async def score(self, samples: list[Sample]) -> None:
        if self.agents is not None and self.agents.own_rewards:
            return  # the agent's step rewards, set on each episode's sample
        # As OpenRLHF: the whole sequence decoded with special tokens ("" lets the reward service join texts).
        decoder = self.query_decoder
        queries = decoder.queries([s.sequence for s in samples]) if decoder else [""] * len(samples)
        batch = ScoreBatch(queries=queries, prompts=[s.prompt.text for s in samples],
                           responses=[s.text for s in samples], labels=[s.prompt.label for s in samples],
                           sample_ids=[s.sample_id for s in samples],
                           data_sources=[s.prompt.datasource for s in samples],
                           extra_infos=[s.prompt.extra_info for s in samples])
        # One id per (run, step, micro-batch): a batch sent again is answered once by the reward service.
        request_id = f"{self.run_id}/step{self.step}/{samples[0].sample_id}+{len(samples)}"
        result = await self._timed("score", self.rewards.call(lambda c: c.score(batch, request_id=request_id)))
        for i, s in enumerate(samples):
            s.reward, s.score = float(result.rewards[i]), float(result.scores[i])
            s.extra = {k: float(v[i]) for k, v in result.extra.items()}
        samples[0].score_batch_metrics = dict(result.batch)  # per call, not per sample

    async def logprobs(self, samples: list[Sample]) -> None:
        cfg = self.config
        sequences = [s.sequence for s in samples]
        starts = [s.response_start for s in samples]
        input_ids = ragged_to_proto(sequences, torch.int32)
        response_start = to_proto(torch.tensor(starts, dtype=torch.int64))
        request_id = f"step{self.step}"
        calls: list[Awaitable] = [self._timed("logprobs", self.learner.LogProbs(learner_pb2.LogProbsRequest(
            input_ids=input_ids, response_start=response_start, temperature=cfg.temperature, request_id=request_id,
            packed=self.packed)))]
        if self.use_ref:
            calls.append(self._timed("ref_logprobs", self.references.call(
                lambda c: c.ref_logprobs(sequences, starts, cfg.temperature, request_id))))
        if self.use_critic:
            calls.append(self._timed("values", self.learner.Values(learner_pb2.ValuesRequest(
                input_ids=input_ids, response_start=response_start, request_id=request_id,
                packed=cfg.packing_samples))))
        results = await gather_or_cancel(calls)
        old = ragged_from_proto(results[0].logprobs, "LogProbs.logprobs")
        ref = results[1] if self.use_ref else None
        values = ragged_from_proto(results[-1].values, "Values.values") if self.use_critic else None
        for i, s in enumerate(samples):
            s.old_logprobs = old[i].float()
            if ref is not None:
                s.ref_logprobs = ref[i].float()
            if values is not None:
                s.values = values[i].float()
