"""Clients of the reward service's two roles, which split large batches below the message limit.

Score and RefLogProbs are unary RPCs: a rollout batch (e.g. 8,192 samples with 2k-token
responses, ~100 MB of token ids alone) is cut into requests of at most `max_request_mb`, sent
concurrently, and the answers are joined in order. Every request is scored on its own, so the
result does not depend on where the cuts fall.

    client = RewardClient("127.0.0.1:50051")
    result = await client.score(ScoreBatch.from_texts(prompts, responses, labels))
    result.rewards  # float32 (N,)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import numpy as np
import torch

from rlmesh.reward.v1 import reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc
from services.common.client import make_channel
from services.common.tensors import from_proto, ragged_from_proto, ragged_to_proto, to_proto
from services.reward.source import InvalidScores, ScoreBatch, SourceScores, finite_values

# The reward service's client API: the only module of services/reward that other services import.
__all__ = ["RewardClient", "ReferenceClient", "ScoreBatch", "ScoreResult"]

REWARD_SERVICE = "rlmesh.reward.v1.RewardService"
REFERENCE_SERVICE = "rlmesh.reward.v1.ReferenceService"
MiB = 1024 * 1024
# Protobuf framing per sample (field tags, lengths): generous, so estimates err on the safe side.
_SAMPLE_OVERHEAD_BYTES = 64


def chunk_ranges(sizes: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges whose summed sizes stay <= max_bytes (a lone item may exceed it)."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > max_bytes:
            ranges.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def _utf8_len(text: str) -> int:
    # isascii() is a flag check in CPython, so plain ASCII text costs no encoding pass.
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def sample_sizes(batch: ScoreBatch, token_bytes: int = 4) -> list[int]:
    """Estimated encoded bytes of each sample of a ScoreRequest."""
    sizes = []
    fields = (batch.queries, batch.prompts, batch.responses, batch.labels, batch.sample_ids, batch.data_sources)
    for i in range(len(batch)):
        size = _SAMPLE_OVERHEAD_BYTES + sum(_utf8_len(f[i]) for f in fields)
        if batch.extra_infos:
            size += _utf8_len(batch.extra_infos[i])
        for ids in (batch.prompt_token_ids, batch.response_token_ids):
            if ids is not None:
                size += token_bytes * len(ids[i]) + 8
        sizes.append(size)
    return sizes


def score_request(batch: ScoreBatch, request_id: str = "") -> reward_pb2.ScoreRequest:
    """The ScoreRequest of a batch; token ids travel as INT32 (every vocabulary fits)."""
    request = reward_pb2.ScoreRequest(request_id=request_id, samples=[
        reward_pb2.Sample(sample_id=batch.sample_ids[i], prompt=batch.prompts[i], response=batch.responses[i],
                          query=batch.queries[i], label=batch.labels[i], data_source=batch.data_sources[i],
                          extra_info=batch.extra_infos[i] if batch.extra_infos else "")
        for i in range(len(batch))])
    if batch.prompt_token_ids is not None:
        request.prompt_token_ids.CopyFrom(ragged_to_proto(batch.prompt_token_ids, torch.int32))
    if batch.response_token_ids is not None:
        request.response_token_ids.CopyFrom(ragged_to_proto(batch.response_token_ids, torch.int32))
    return request


def scores_from_response(response: reward_pb2.ScoreResponse, n: int, offset: int = 0) -> SourceScores:
    """Decodes and validates a ScoreResponse for n samples (raises InvalidScores naming the problem)."""
    try:
        rewards = from_proto(response.rewards, "rewards") if response.HasField("rewards") else None
        scores = from_proto(response.scores, "scores") if response.HasField("scores") else None
        extra = {k: from_proto(v, f"extra_metrics[{k}]") for k, v in response.extra_metrics.items()}
    except ValueError as exc:
        raise InvalidScores(str(exc)) from None
    if rewards is None:
        raise InvalidScores("the answer has no 'rewards' tensor")
    rewards = finite_values(rewards, n, "rewards", offset)
    scores = rewards.copy() if scores is None else finite_values(scores, n, "scores", offset)
    # Extra metrics may be NaN where a chunk lacked them; only their length is checked.
    checked = {}
    for name, values in extra.items():
        if values.numel() != n:
            raise InvalidScores(f"'extra_metrics.{name}' has {values.numel()} values for {n} samples")
        checked[name] = values.double().numpy().reshape(-1)
    batch = {}
    for name, metric in response.batch_metrics.items():
        if metric.samples < 0 or not math.isfinite(metric.weighted_sum):
            raise InvalidScores(f"'batch_metrics.{name}' is {metric.weighted_sum} over {metric.samples} samples; "
                                "send a finite sum over a sample count >= 0")
        batch[name] = (metric.weighted_sum, metric.samples)
    return SourceScores(rewards, scores, checked, batch)


@dataclasses.dataclass
class ScoreResult:
    """Score answer for a whole batch: float32 arrays of shape (N,)."""

    rewards: np.ndarray
    scores: np.ndarray
    extra: dict[str, np.ndarray]
    source: str
    # Metrics reported per call, not per sample: name -> (sum of value x samples, samples).
    batch: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)


class RewardClient:
    """Calls RewardService.Score, splitting big batches into requests of at most max_request_mb."""

    def __init__(self, address: str, timeout_s: float = 600.0, max_request_mb: float = 32.0,
                 max_concurrent: int = 4, max_message_mb: int = 256, channel_retries: bool = True,
                 **channel_kwargs):
        # channel_retries=False when the caller retries elsewhere itself (the coordinator's ScoringPool).
        idempotent = ("Score", "GetRewardInfo") if channel_retries else ()
        self.channel = make_channel(address, REWARD_SERVICE, idempotent_methods=idempotent,
                                    default_timeout_s=timeout_s, max_message_mb=max_message_mb, **channel_kwargs)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.max_request_bytes = int(max_request_mb * MiB)
        self.max_concurrent = max_concurrent

    async def score(self, batch: ScoreBatch, request_id: str = "") -> ScoreResult:
        ranges = chunk_ranges(sample_sizes(batch), self.max_request_bytes)
        limit = asyncio.Semaphore(self.max_concurrent)

        async def one(start: int, stop: int) -> reward_pb2.ScoreResponse:
            async with limit:
                return await self.stub.Score(score_request(batch.slice(start, stop), request_id))

        answers = await asyncio.gather(*(one(a, b) for a, b in ranges))
        parts = [scores_from_response(r, b - a, a) for r, (a, b) in zip(answers, ranges)]
        joined = SourceScores.concat(parts)
        return ScoreResult(joined.rewards.astype(np.float32), joined.scores.astype(np.float32),
                           {k: v.astype(np.float32) for k, v in joined.extra.items()},
                           answers[0].source if answers else "", joined.batch)

    async def info(self) -> reward_pb2.GetRewardInfoResponse:
        return await self.stub.GetRewardInfo(reward_pb2.GetRewardInfoRequest(), timeout=10.0)

    async def close(self) -> None:
        await self.channel.close()


class ReferenceClient:
    """Calls ReferenceService.RefLogProbs, splitting big batches into requests of at most max_request_mb."""

    def __init__(self, address: str, timeout_s: float = 600.0, max_request_mb: float = 32.0,
                 max_concurrent: int = 2, max_message_mb: int = 256, channel_retries: bool = True,
                 **channel_kwargs):
        idempotent = ("RefLogProbs",) if channel_retries else ()
        self.channel = make_channel(address, REFERENCE_SERVICE, idempotent_methods=idempotent,
                                    default_timeout_s=timeout_s, max_message_mb=max_message_mb, **channel_kwargs)
        self.stub = reference_pb2_grpc.ReferenceServiceStub(self.channel)
        self.max_request_bytes = int(max_request_mb * MiB)
        self.max_concurrent = max_concurrent

    async def ref_logprobs(self, sequences: list[torch.Tensor], response_starts: list[int],
                           temperature: float = 1.0, request_id: str = "") -> list[torch.Tensor]:
        """Per-token log-probs (float32, length len - start) of each sequence's response tokens."""
        if len(sequences) != len(response_starts):
            raise ValueError(f"{len(sequences)} sequences but {len(response_starts)} response starts")
        # Request: 4 bytes per token id; answer: 4 bytes per response token.
        ranges = chunk_ranges([4 * len(s) + 16 for s in sequences], self.max_request_bytes)
        limit = asyncio.Semaphore(self.max_concurrent)

        async def one(start: int, stop: int) -> list[torch.Tensor]:
            request = reference_pb2.RefLogProbsRequest(
                input_ids=ragged_to_proto(sequences[start:stop], torch.int32),
                response_start=to_proto(torch.tensor(response_starts[start:stop], dtype=torch.int64)),
                temperature=temperature, request_id=request_id)
            async with limit:
                answer = await self.stub.RefLogProbs(request)
            return ragged_from_proto(answer.logprobs, "logprobs")

        parts = await asyncio.gather(*(one(a, b) for a, b in ranges))
        return [t for part in parts for t in part]

    async def close(self) -> None:
        await self.channel.close()
