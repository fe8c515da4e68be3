"""gRPC servicers of the reward service: RewardService (Score) over any reward source, and
ReferenceService (RefLogProbs) over the reference model. One process serves either or both."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.reward.v1 import reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc
from services.common.errors import ServiceError, handle_errors, invalid_argument
from services.common.log import get_logger, log_event
from services.common.server import ServiceRunner
from services.common.tensors import from_proto, ragged_from_proto, to_proto
from services.reward import metrics
from services.reward.client import REFERENCE_SERVICE, REWARD_SERVICE
from services.reward.config import RewardConfig
from services.reward.function_source import FunctionRewardSource
from services.reward.grpc_source import GrpcRewardSource
from services.reward.recent import RecentAnswers
from services.reward.remote import RemotePolicy
from services.reward.rules import MathScheme, RuleRewardSource
from services.reward.source import RewardSource, ScoreBatch

if TYPE_CHECKING:
    from services.reward.reference import ReferenceModel

log = get_logger("reward")


def batch_from_request(request: reward_pb2.ScoreRequest) -> ScoreBatch:
    """ScoreRequest -> ScoreBatch; INVALID_ARGUMENT for token id tensors that do not fit the samples."""
    samples = request.samples
    n = len(samples)
    token_ids = {}
    for field in ("prompt_token_ids", "response_token_ids"):
        if not request.HasField(field):
            token_ids[field] = None
            continue
        try:
            seqs = ragged_from_proto(getattr(request, field), field)
        except ValueError as exc:
            raise invalid_argument(field, None, str(exc), "encode it with services.common.tensors.ragged_to_proto") from None
        if len(seqs) != n:
            raise invalid_argument(field, None, f"holds {len(seqs)} sequences for {n} samples",
                                   "send one sequence per sample, in sample order")
        if seqs and seqs[0].is_floating_point():
            raise invalid_argument(field, None, f"has dtype {seqs[0].dtype}", "send INT32 or INT64 token ids")
        token_ids[field] = seqs
    batch = ScoreBatch(
        queries=[s.query or s.prompt + s.response for s in samples],
        prompts=[s.prompt for s in samples], responses=[s.response for s in samples],
        labels=[s.label for s in samples], sample_ids=[s.sample_id for s in samples],
        data_sources=[s.data_source for s in samples],
        prompt_token_ids=token_ids["prompt_token_ids"], response_token_ids=token_ids["response_token_ids"],
        extra_infos=[s.extra_info for s in samples] if any(s.extra_info for s in samples) else None)
    for i, text in enumerate(batch.extra_infos or ()):
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError as exc:
            value, problem = None, f"is not JSON ({exc})"
        else:
            problem = f"is JSON of a {type(value).__name__}, not an object"
        if not isinstance(value, dict):
            raise invalid_argument("extra_info", batch.describe(i), problem,
                                   "send the row's extra_info as JSON text of an object, or leave it empty")
    return batch


# A Score answers this long before its caller's deadline, so that the caller reads the reason
# (e.g. a hanging remote server) instead of its own DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 2.0


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score over one RewardSource, then clipping; the source did any normalisation.

    A request sent again under the same request_id is answered once (services.reward.recent).
    """

    def __init__(self, source: RewardSource, clip_range: list[float] | tuple = (), recent_answers: int = 1024):
        self.source = source
        self.clip = tuple(clip_range) if clip_range else None
        self.recent = RecentAnswers(recent_answers)

    @handle_errors
    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        remaining = context.time_remaining()
        budget = None if remaining is None else max(remaining - min(DEADLINE_MARGIN_S, 0.1 * remaining), 0.0)
        try:
            async with asyncio.timeout(budget):
                answer, reused = await self.recent.get_or_compute(self.recent.key(request),
                                                                  lambda: self._score(request))
        except TimeoutError:
            metrics.SCORE_ERRORS.labels(self.source.kind, "DEADLINE_EXCEEDED").inc()
            last = f"; last error: {self.source.last_error}" if self.source.last_error else ""
            message = (f"reward source {self.source.kind} ({self.source.describe()}) did not score the "
                       f"{len(request.samples)} samples of request {request.request_id or '(no id)'} within the "
                       f"caller's deadline ({remaining:.1f} s){last}; the reward server may be hanging: check "
                       "it, lower --remote_rm_timeout_s / --remote_rm_retries so that the retries fit the "
                       "deadline, or give the caller a longer deadline (--rpc_timeout_s)")
            log_event(log, "score.deadline", request.request_id, level=logging.WARNING, samples=len(request.samples),
                      deadline_s=f"{remaining:.1f}")
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, message) from None
        if reused:
            metrics.DEDUPLICATED.inc()
            log_event(log, "score.deduplicated", request.request_id, samples=len(request.samples))
        return answer

    async def _score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        kind = self.source.kind
        start = time.monotonic()
        try:
            batch = batch_from_request(request)
            result = await self.source.score(batch)
        except Exception as exc:
            code = exc.code if isinstance(exc, ServiceError) else grpc.StatusCode.INTERNAL
            metrics.SCORE_ERRORS.labels(kind, code.name).inc()
            log_event(log, "score.failed", request.request_id, level=logging.WARNING, samples=len(request.samples),
                      code=code.name, error=str(exc))
            raise
        rewards = result.rewards if self.clip is None else np.clip(result.rewards, *self.clip)
        elapsed = time.monotonic() - start
        metrics.SCORE_DURATION.labels(kind).observe(elapsed)
        metrics.SCORED_SAMPLES.labels(kind).inc(len(batch))
        histogram = metrics.REWARD_VALUES.labels(kind)
        for value in rewards:
            histogram.observe(float(value))
        log_event(log, "score.done", request.request_id, samples=len(batch), seconds=f"{elapsed:.3f}",
                  mean_reward=f"{rewards.mean():.4f}" if len(rewards) else "nan")
        return reward_pb2.ScoreResponse(
            rewards=to_proto(rewards.astype(np.float32)), scores=to_proto(result.scores.astype(np.float32)),
            extra_metrics={k: to_proto(v.astype(np.float32)) for k, v in result.extra.items()},
            batch_metrics={k: reward_pb2.BatchMetric(weighted_sum=total, samples=count)
                           for k, (total, count) in result.batch.items()},
            sample_ids=batch.sample_ids, source=kind)

    @handle_errors
    async def GetRewardInfo(self, request, context) -> reward_pb2.GetRewardInfoResponse:
        low, high = self.clip or (0.0, 0.0)
        return reward_pb2.GetRewardInfoResponse(
            source=self.source.kind, description=self.source.describe(), requires_labels=self.source.requires_labels,
            requires_token_ids=self.source.requires_token_ids, clip_low=low, clip_high=high)


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    """RefLogProbs over the reference model."""

    def __init__(self, model: ReferenceModel):
        self.model = model

    def _inputs(self, request: reference_pb2.RefLogProbsRequest) -> tuple[list[torch.Tensor], list[int], float]:
        try:
            seqs = ragged_from_proto(request.input_ids, "input_ids")
            starts = from_proto(request.response_start, "response_start")
        except ValueError as exc:
            raise invalid_argument("input_ids/response_start", None, str(exc),
                                   "encode them with services.common.tensors") from None
        if starts.dim() != 1 or len(starts) != len(seqs) or starts.is_floating_point():
            raise invalid_argument("response_start", None, f"must be integers of shape ({len(seqs)},), got "
                                   f"{starts.dtype} {list(starts.shape)}", "send one start index per sequence")
        if seqs and seqs[0].is_floating_point():
            raise invalid_argument("input_ids", None, f"has dtype {seqs[0].dtype}", "send INT32 or INT64 token ids")
        temperature = request.temperature or 1.0
        if not (temperature > 0 and math.isfinite(temperature)):
            raise invalid_argument("temperature", None, f"is {request.temperature}",
                                   "send the positive sampling temperature (0 means 1.0)")
        starts = starts.tolist()
        for i, (s, k) in enumerate(zip(seqs, starts)):
            item = f"sequence {i}"
            if not 1 <= k <= len(s):
                raise invalid_argument("response_start", item, f"is {k} for a sequence of {len(s)} tokens",
                                       "it must lie in [1, length]: at least one prompt token comes first")
            if int(s.min()) < 0 or int(s.max()) >= self.model.vocab_size:
                raise invalid_argument("input_ids", item, f"token ids must lie in [0, {self.model.vocab_size})",
                                       "send ids of the reference model's tokenizer")
            if self.model.max_positions and len(s) > self.model.max_positions:
                raise invalid_argument("input_ids", item, f"has {len(s)} tokens, more than the reference model's "
                                       f"{self.model.max_positions} positions", "shorten the prompt or response")
        return [s.long() for s in seqs], starts, float(temperature)

    @handle_errors
    async def RefLogProbs(self, request: reference_pb2.RefLogProbsRequest, context) -> reference_pb2.RefLogProbsResponse:
        start = time.monotonic()
        seqs, starts, temperature = self._inputs(request)
        if not seqs:
            out = []
        else:
            try:
                out = await asyncio.to_thread(self.model.response_logprobs, seqs, starts, temperature)
            except torch.OutOfMemoryError as exc:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"reference model ran out of memory: {exc}; "
                                   "lower --ref_micro_batch_size or send smaller requests") from None
        tokens = sum(len(s) for s in seqs)
        elapsed = time.monotonic() - start
        metrics.REF_DURATION.observe(elapsed)
        metrics.REF_TOKENS.inc(tokens)
        log_event(log, "ref_logprobs.done", request.request_id, sequences=len(seqs), tokens=tokens,
                  seconds=f"{elapsed:.3f}")
        values = torch.cat(out) if out else torch.empty(0, dtype=torch.float32)
        return reference_pb2.RefLogProbsResponse(
            logprobs=common_pb2.RaggedTensor(values=to_proto(values), lengths=[len(t) for t in out]))


# ----------------------------------------------------------------------------------------------
# Building the service from its config


def make_reward_source(config: RewardConfig) -> RewardSource | None:
    """The configured reward source, or None for a reference-only deployment (may raise ConfigError)."""
    policy = RemotePolicy(batch_size=config.remote_rm_batch_size, max_in_flight=config.remote_rm_max_in_flight,
                          timeout_s=config.remote_rm_timeout_s, max_retries=config.remote_rm_retries,
                          backoff_s=config.remote_rm_backoff_s, backoff_max_s=config.remote_rm_backoff_max_s)
    if config.reward_pretrain:
        # transformers loads only where a model is served: remote and rule deployments start faster.
        from services.reward.model_source import ModelRewardSource, RewardModel

        model = RewardModel(config.reward_pretrain, config.device, config.reward_dtype, config.reward_micro_batch_size,
                            config.value_head_prefix, config.attn_implementation)
        return ModelRewardSource(model, use_token_ids=config.reward_input == "token_ids",
                                 normalize=config.normalize_reward)
    if config.remote_kind == "http":
        from services.reward.http_source import HttpRewardSource  # aiohttp (~0.15 s): only for HTTP scorers

        return HttpRewardSource(config.remote_urls, policy)
    if config.remote_kind == "grpc":
        return GrpcRewardSource(config.remote_urls, policy, config.max_message_mb, config.remote_rm_tls_ca)
    if config.remote_kind == "function":
        # As many workers as may run at once (up to one per core) load the file before the service
        # serves, so the first step's calls do not wait for more to start.
        return FunctionRewardSource.from_file(config.remote_urls[0], config.reward_func_timeout_s,
                                              config.remote_rm_batch_size, config.remote_rm_max_in_flight,
                                              workers_at_start=min(config.remote_rm_max_in_flight, os.cpu_count() or 1))
    if config.rules:
        scheme = MathScheme(config.math_correct_reward, config.math_wrong_reward, config.math_no_answer_reward)
        return RuleRewardSource(config.rules, scheme, config.math_verify_timeout_s, config.math_verify_workers,
                                config.format_pattern, config.format_reward)
    return None


async def add_reward_service(runner: ServiceRunner, source: RewardSource, clip_range=(),
                             recent_answers: int = 1024) -> None:
    """Starts the source and registers RewardService on the runner (closing the source at shutdown)."""
    await source.start()
    runner.on_shutdown.append(source.close)
    runner.add(reward_pb2_grpc.add_RewardServiceServicer_to_server,
               RewardServicer(source, clip_range, recent_answers), REWARD_SERVICE)
    log_event(log, "reward.source", kind=source.kind, description=source.describe())


def add_reference_service(runner: ServiceRunner, model: ReferenceModel) -> None:
    runner.add(reference_pb2_grpc.add_ReferenceServiceServicer_to_server, ReferenceServicer(model), REFERENCE_SERVICE)
    log_event(log, "reference.model", description=model.describe())
