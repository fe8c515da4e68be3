"""The training loop: one global step after another over the rollout, reward and learner services.

    step:  prompts -> Generate on every engine (streamed)
                   -> as samples arrive: Score, RefLogProbs, LogProbs, Values (micro-batches)
                   -> advantages (services.coordinator.advantages)
                   -> TrainActor / TrainCritic
                   -> PushWeights -> UpdateWeights on every engine -> verify version + checksum
                   -> metrics -> checkpoint every --save_steps
    with --eval_dataset: evaluation on the engines' current weights before the first step, after
    every --eval_steps steps and after the last (services.coordinator.evaluate, as `rlmesh eval`)

With --vllm_enable_sleep / --deepspeed_enable_sleep (colocated on GPUs) the phases run one
after another instead: wake -> generate -> sleep -> reload -> log-probs, train -> push -> offload,
so vLLM and DeepSpeed never hold a GPU's memory at the same time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import pathlib
import sys
import time
import uuid
from collections.abc import Awaitable

import grpc
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.coordinator.v1 import coordinator_pb2 as cpb
from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from rlmesh.rollout.v1 import rollout_pb2
from services.common.client import make_channel
from services.common.log import get_logger, log_event
from services.common.tensors import from_proto, ragged_from_proto, ragged_to_proto, to_proto
from services.coordinator import metrics as prom
from services.coordinator.advantages import (compute_advantages, keep_group, length_mask, overlong_penalty,
                                             pad_right, update_kl_coef)
from services.coordinator import checkpoint
from services.coordinator.agent import AgentRunner
from services.coordinator.async_loop import AsyncSteps, CollectedStep, admit_fresh, token_versions
from services.coordinator.checkpoint import CoordinatorState, config_digest
from services.coordinator.config import CoordinatorConfig
from services.coordinator.control import RunControl, ServiceEntry
from services.coordinator.data import Prompt, PromptStream
from services.coordinator.evaluate import evaluate, evaluate_episodes
from services.coordinator.experience import Sample, StepCollector
from services.coordinator.metrics import MetricsLog
from services.coordinator.placement import Endpoints
from services.coordinator.queries import QueryDecoder
from services.coordinator.reward_logs import reward_metrics
from services.coordinator.rollout_pool import RolloutPool, gather_or_cancel
from services.coordinator.scoring_pool import ScoringPool
from services.reward.client import ReferenceClient, RewardClient
from services.reward.source import ScoreBatch

_log = get_logger("coordinator")
LEARNER_SERVICE = "rlmesh.learner.v1.LearnerService"
LEARNER_IDEMPOTENT = ("GetInfo", "LogProbs", "Values", "SaveCheckpoint", "LoadCheckpoint", "ExportHF",
                      "Offload", "Reload")
KL_ESTIMATORS = {"k1": learner_pb2.KL_ESTIMATOR_K1, "k2": learner_pb2.KL_ESTIMATOR_K2,
                 "k3": learner_pb2.KL_ESTIMATOR_K3}
LOSS_LEVELS = {"token": learner_pb2.LOSS_AGGREGATION_TOKEN_MEAN, "sequence": learner_pb2.LOSS_AGGREGATION_SEQUENCE_MEAN,
               "sequence_sum": learner_pb2.LOSS_AGGREGATION_SEQUENCE_SUM}
BACKENDS = {"gloo": rollout_pb2.WEIGHT_BACKEND_GLOO, "nccl": rollout_pb2.WEIGHT_BACKEND_NCCL,
            "ipc": rollout_pb2.WEIGHT_BACKEND_IPC}


class WeightSyncError(RuntimeError):
    """An engine does not hold the weights the learner pushed."""


def _step_seed(seed: int, step: int, what: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{step}/{what}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Trainer:
    """Runs the loop against services found at `endpoints`."""

    def __init__(self, config: CoordinatorConfig, endpoints: Endpoints, control: RunControl, stream: PromptStream,
                 metrics: MetricsLog, state: CoordinatorState, weight_sync_master: tuple[str, int] | None = None,
                 eval_prompts: list[Prompt] | None = None):
        self.config, self.endpoints, self.control = config, endpoints, control
        self.stream, self.metrics, self.state = stream, metrics, state
        self.run_id = pathlib.PurePath(state.run_dir).name or "run"  # in request ids
        self.weight_sync_master = weight_sync_master
        self.eval_prompts = eval_prompts or []  # empty = no evaluation during training
        self.last_eval_step = -1
        cfg = config
        self.pool = RolloutPool(endpoints.rollout, cfg.rpc_timeout_s, cfg.max_message_mb)
        # The pools retry a call on another instance when its instance dies, so their channels do not.
        self.rewards = ScoringPool("reward", endpoints.reward, lambda a: RewardClient(
            a, timeout_s=cfg.rpc_timeout_s, channel_retries=False), cfg.scoring_wait_s, cfg.scoring_retries)
        self.references = ScoringPool("reference", endpoints.reference, lambda a: ReferenceClient(
            a, timeout_s=cfg.rpc_timeout_s, channel_retries=False), cfg.scoring_wait_s, cfg.scoring_retries)
        self.learner_channel = None
        self.connect_learner(endpoints.learner)
        self.sequential = cfg.vllm_enable_sleep or cfg.deepspeed_enable_sleep
        self.use_ref = cfg.ref_needed and bool(endpoints.reference)
        self.use_critic = cfg.critic_needed
        self.weights_dtype = common_pb2.DTYPE_FLOAT32
        self.learner_info: learner_pb2.GetInfoResponse | None = None
        self.asleep: set[str] = set()  # what the rollout engines have put to sleep: weights, kv_cache
        self._sleep_supported = cfg.vllm_enable_sleep
        self.learner_offloaded = False  # learner states in host memory (--deepspeed_enable_sleep)
        self._rpc_seconds: dict[str, float] = {}
        # Decodes each sample's token ids into the query text reward servers get (set by train.run).
        self.query_decoder: QueryDecoder | None = None
        # Supervision hooks (services/coordinator/recovery.py; None = a failure ends the run).
        self.recovery = None
        self.group_engines: list = []  # the engines of the current weight-transfer group
        self.trained_step = 0  # the last step whose TrainActor succeeded (a redo would train twice)
        self.lost_samples = 0  # samples of the last failed step attempt
        self.async_steps = AsyncSteps(self) if cfg.async_train else None  # --async_train
        self.agents = AgentRunner(cfg, self.pool) if cfg.agent_func_path else None  # started in setup()

    def connect_learner(self, address: str) -> grpc.aio.Channel | None:
        """Points the learner stub at `address` (at start, and after a restart moved the learner);
        returns the channel it replaced, for the caller to close."""
        cfg, old = self.config, self.learner_channel
        self.learner_channel = make_channel(address, LEARNER_SERVICE, idempotent_methods=LEARNER_IDEMPOTENT,
                                            default_timeout_s=cfg.rpc_timeout_s, max_message_mb=cfg.max_message_mb)
        self.learner = learner_pb2_grpc.LearnerServiceStub(self.learner_channel)
        self.endpoints.learner = address
        return old

    async def close(self) -> None:
        if self.async_steps is not None:
            await self.async_steps.close()
        if self.agents is not None:
            await self.agents.close()
        closers = [self.pool.close(), self.learner_channel.close()]
        closers += [self.rewards.close(), self.references.close()]
        await asyncio.gather(*closers, return_exceptions=True)

    # ------------------------------------------------------------------------------------------
    # Start-up

    async def setup(self, resume: bool) -> None:
        cfg = self.config
        self.learner_info = await self.learner.GetInfo(learner_pb2.GetInfoRequest(), timeout=30.0)
        if self.learner_info.train_batch_size != cfg.train_batch_size:
            raise RuntimeError(f"the learner at {self.endpoints.learner} trains with --train_batch_size "
                               f"{self.learner_info.train_batch_size} but this run has --train_batch_size "
                               f"{cfg.train_batch_size}; give both the same value")
        if self.use_critic and not self.learner_info.critic_pretrain:
            raise RuntimeError(f"--advantage_estimator gae needs a critic, but the learner at {self.endpoints.learner} "
                               "has none; start it with --critic_pretrain")
        if self.agents is not None:
            await self.agents.start()  # a file that does not load stops the run here, before any step
        infos = await self.pool.model_infos()
        self.weights_dtype = infos[0].weights_dtype or common_pb2.DTYPE_FLOAT32
        for engine, info in zip(self.pool.engines, infos):
            engine.weight_version = info.weight_version
            engine.tensor_parallel_size = max(1, info.tensor_parallel_size)
        if resume:
            await self._load_checkpoint()
        self.control.services = self._service_entries()
        await self._init_weight_transfer()
        # Engines must hold the learner's weights before they generate. A fresh run that started
        # every service from the same --pretrain folder already has them; otherwise (a resume,
        # services started elsewhere, an engine that served another version) they are pushed.
        versions = {i.weight_version for i in infos}
        checksums = {i.weights_checksum for i in infos}
        if (resume or cfg.placement == "static" or versions != {0} or len(checksums) > 1
                or self.learner_info.weight_version):
            await self.push_weights()
        else:
            self.state.weight_version = 0
        await self._offload_learner()

    async def _offload_learner(self) -> float:
        """Moves the learner's states off its GPUs (--deepspeed_enable_sleep); returns the seconds it took."""
        if not self.config.deepspeed_enable_sleep or self.learner_offloaded:
            return 0.0
        t0 = time.monotonic()
        await self.learner.Offload(learner_pb2.OffloadRequest(), timeout=120.0)
        self.learner_offloaded = True
        return time.monotonic() - t0

    async def _reload_learner(self) -> float:
        """Brings the learner's states back to its GPUs; returns the seconds it took (0 when they were there)."""
        if not self.learner_offloaded:
            return 0.0
        t0 = time.monotonic()
        await self.learner.Reload(learner_pb2.ReloadRequest(), timeout=120.0)
        self.learner_offloaded = False
        return time.monotonic() - t0

    def _service_entries(self) -> list[ServiceEntry]:
        entries = [ServiceEntry("rollout", e.index, e.address, e.weight_version) for e in self.pool.engines]
        entries += [ServiceEntry("reward", i, a) for i, a in enumerate(self.endpoints.reward)]
        entries += [ServiceEntry("reference", i, a) for i, a in enumerate(self.endpoints.reference)]
        entries.append(ServiceEntry("learner", 0, self.endpoints.learner))
        return entries

    async def _load_checkpoint(self) -> None:
        """Continues from the checkpoint `latest` names: the coordinator's state from its
        coordinator.json, the learner's from the same global_step_N folder."""
        cfg = self.config
        saved = checkpoint.load_latest(cfg.ckpt_path)
        if saved is None:
            log_event(_log, "resume.no_checkpoint", ckpt_path=cfg.ckpt_path, action="starting from step 0")
            return
        reply = await self.learner.LoadCheckpoint(learner_pb2.LoadCheckpointRequest(
            ckpt_path=cfg.ckpt_path, global_step=saved.global_step), timeout=cfg.rpc_timeout_s)
        digest, values = config_digest(cfg)
        if saved.config_digest and saved.config_digest != digest:
            changed = {k: (saved.config_values.get(k), v) for k, v in values.items() if saved.config_values.get(k) != v}
            log_event(_log, "resume.config_changed", changed=json.dumps(changed, default=str))
        saved.run_dir = self.state.run_dir
        self.state = saved
        self.stream.restore(saved.episode, saved.data_position)
        self.control.global_step = saved.global_step
        self.control.last_checkpoint_step = saved.global_step
        log_event(_log, "resume.loaded", step=saved.global_step, episode=saved.episode,
                  position=saved.data_position, path=reply.path)

    def _sync_backend(self) -> str:
        """--vllm_sync_backend, or what the learner's devices allow: gloo on CPU, nccl (ipc when
        colocated) on GPUs. The learner knows, also for services this run did not start."""
        cfg = self.config
        if cfg.vllm_sync_backend != "auto":
            return cfg.vllm_sync_backend
        if self.learner_info.dist_backend != "nccl":
            return "gloo"
        return "ipc" if cfg.colocate_all_models else "nccl"

    async def _init_weight_transfer(self, engines: list | None = None) -> None:
        """A new weight group of the learner and `engines` (default: the admitted ones)."""
        engines = self.pool.admitted() if engines is None else engines
        self.group_engines = list(engines)
        backend = self._sync_backend()
        world_size = 1 + sum(e.tensor_parallel_size for e in engines)
        # Unique per group: with a fixed rendezvous port (--weight_sync_master) the store of the group
        # being replaced may still answer, and a rank that reached it under the same name would read
        # the old group's gloo addresses (a name from the second of the build repeated within a second).
        group = f"rlmesh-weights-{uuid.uuid4().hex[:16]}"
        if backend == "ipc":
            await asyncio.gather(
                self.learner.InitWeightTransfer(learner_pb2.InitWeightTransferRequest(backend=BACKENDS[backend]), timeout=120.0),
                *(e.stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(backend=BACKENDS[backend]), timeout=120.0)
                  for e in engines))
            return
        host, port = self.weight_sync_master or (self.learner_info.rank0_host, 0)
        if not port:
            raise RuntimeError("no port for the weight-transfer rendezvous; set --weight_sync_master HOST:PORT "
                               "(a free port on the learner's rank-0 host that the rollout engines can reach)")
        calls = [self.learner.InitWeightTransfer(learner_pb2.InitWeightTransferRequest(
            backend=BACKENDS[backend], master_address=host, master_port=port, world_size=world_size,
            group_name=group, timeout_s=300.0), timeout=360.0)]
        offset = 1
        for engine in engines:
            tp = engine.tensor_parallel_size
            calls.append(engine.stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                backend=BACKENDS[backend], master_address=host, master_port=port, world_size=world_size,
                rank_offset=offset, group_name=group, timeout_s=300.0), timeout=360.0))
            offset += tp
        await gather_or_cancel(calls)
        log_event(_log, "weights.group_ready", backend=backend, master=f"{host}:{port}", world_size=world_size)

    # ------------------------------------------------------------------------------------------
    # Weight push

    async def push_weights(self, engines: list | None = None, version: int = 0) -> dict:
        """Pushes the actor's weights to `engines` (default: the admitted ones; they must be the
        weight group's) and verifies version and checksum on each. version 0 = a new one."""
        t0 = time.monotonic()
        engines = self.pool.admitted() if engines is None else engines
        version = version or max([self.state.weight_version, self.learner_info.weight_version if self.learner_info
                                  else 0] + [e.weight_version for e in self.pool.engines]) + 1
        if "weights" in self.asleep:
            # Only the weights: the KV cache stays freed until the next generation (colocation).
            await self.pool.wake_up(("weights",))
            self.asleep.discard("weights")
        requests: asyncio.Queue = asyncio.Queue()
        await requests.put(learner_pb2.PushWeightsRequest(start=learner_pb2.PushWeightsStart(
            version=version, weights_dtype=self.weights_dtype)))

        async def request_iter():
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        call = self.learner.PushWeights(request_iter(), timeout=self.config.rpc_timeout_s)
        replies: list[rollout_pb2.UpdateWeightsResponse] = []
        done = None
        try:
            async for message in call:
                if message.HasField("chunk"):
                    update = message.chunk.update
                    update.pause_generation = self.config.partial_rollout  # running generations continue on it
                    replies = await gather_or_cancel([e.stub.UpdateWeights(update, timeout=self.config.rpc_timeout_s)
                                                       for e in engines])
                    await requests.put(learner_pb2.PushWeightsRequest(
                        ack=learner_pb2.PushWeightsAck(chunk_index=update.chunk_index)))
                else:
                    done = message.done
                    await requests.put(None)
        except grpc.aio.AioRpcError as exc:
            # An engine usually fails because the sender did: report the learner's own error first.
            learner_error = ""
            try:
                code = await asyncio.wait_for(call.code(), 5.0)
                if code != grpc.StatusCode.OK:
                    learner_error = f"the learner's PushWeights failed: {code.name}: {await call.details()}; "
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                call.cancel()
            raise WeightSyncError(f"weight push of version {version} failed: {learner_error}"
                                  f"{exc.code().name}: {exc.details()}") from None
        finally:
            await requests.put(None)
        if done is None:
            raise WeightSyncError("PushWeights ended without a 'done' message")
        for engine, reply in zip(engines, replies):
            if reply.weight_version != version or reply.weights_checksum != done.weights_checksum:
                raise WeightSyncError(f"rollout {engine.index} ({engine.address}) answered version "
                                      f"{reply.weight_version} checksum {reply.weights_checksum!r} to a push of version "
                                      f"{version} checksum {done.weights_checksum!r}")
        await self.verify_weights(version, done.weights_checksum, engines)
        self.state.weight_version = version
        self.control.weight_version = version
        prom.WEIGHT_VERSION.set(version)
        for entry in self.control.services:
            if entry.role == "rollout":
                entry.weight_version = version
        return {"weights/version": version, "weights/push_s": time.monotonic() - t0, "weights/bytes": done.bytes,
                "weights/learner_push_s": done.duration_s}

    async def verify_weights(self, version: int, checksum: str, engines: list | None = None) -> None:
        """GetModelInfo on every engine: the pushed version and checksum, and ready to generate."""
        engines = self.pool.admitted() if engines is None else engines
        infos = await self.pool.model_infos(engines)
        for engine, info in zip(engines, infos):
            if (info.weight_version != version or info.weights_checksum != checksum
                    or info.weights_state != rollout_pb2.WEIGHTS_STATE_READY):
                raise WeightSyncError(
                    f"rollout {engine.index} ({engine.address}) reports version {info.weight_version}, checksum "
                    f"{info.weights_checksum!r}, state {rollout_pb2.WeightsState.Name(info.weights_state)} "
                    f"({info.weights_state_detail}); the learner pushed version {version} checksum {checksum!r}")
            engine.weight_version = version

    # ------------------------------------------------------------------------------------------
    # Per-sample RPCs

    async def _timed(self, what: str, call: Awaitable):
        t0 = time.monotonic()
        try:
            return await call
        finally:
            self._rpc_seconds[what] += time.monotonic() - t0

    async def _score(self, samples: list[Sample]) -> None:
        if self.agents is not None and self.agents.own_rewards:
            return  # the agent's step rewards, set on each episode's sample
        # As OpenRLHF: the whole sequence decoded with special tokens ("" lets the reward service join texts).
        decoder = self.query_decoder
        queries = decoder.queries([s.sequence for s in samples]) if decoder else [""] * len(samples)
        batch = ScoreBatch(queries=queries, prompts=[s.prompt.text for s in samples],
                           responses=[s.text for s in samples], labels=[s.prompt.label for s in samples],
                           sample_ids=[s.sample_id for s in samples],
                           data_sources=[s.prompt.datasource for s in samples])
        t0 = time.monotonic()
        # One id per (run, step, micro-batch): a batch sent again is answered once by the reward service.
        request_id = f"{self.run_id}/step{self.state.global_step + 1}/{samples[0].sample_id}+{len(samples)}"
        result = await self.rewards.call(lambda c: c.score(batch, request_id=request_id))
        self._rpc_seconds["score"] += time.monotonic() - t0
        for i, s in enumerate(samples):
            s.reward, s.score = float(result.rewards[i]), float(result.scores[i])
            s.extra = {k: float(v[i]) for k, v in result.extra.items()}
        samples[0].score_batch_metrics = dict(result.batch)  # per call, not per sample

    async def _logprobs(self, samples: list[Sample]) -> None:
        cfg = self.config
        sequences = [s.sequence for s in samples]
        starts = [s.response_start for s in samples]
        input_ids = ragged_to_proto(sequences, torch.int32)
        response_start = to_proto(torch.tensor(starts, dtype=torch.int64))
        request_id = f"step{self.state.global_step + 1}"
        calls: list[Awaitable] = [self._timed("logprobs", self.learner.LogProbs(learner_pb2.LogProbsRequest(
            input_ids=input_ids, response_start=response_start, temperature=cfg.temperature, request_id=request_id)))]
        if self.use_ref:
            calls.append(self._timed("ref_logprobs", self.references.call(
                lambda c: c.ref_logprobs(sequences, starts, cfg.temperature, request_id))))
        if self.use_critic:
            calls.append(self._timed("values", self.learner.Values(learner_pb2.ValuesRequest(
                input_ids=input_ids, response_start=response_start, request_id=request_id))))
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

    # ------------------------------------------------------------------------------------------
    # One step

    def _sampling(self) -> rollout_pb2.SamplingOptions:
        cfg = self.config
        return rollout_pb2.SamplingOptions(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                           max_tokens=cfg.generate_max_len, return_text=True,
                                           logprobs=cfg.use_tis)  # the behaviour policy's, for TIS

    def _new_sample(self, prompt, response: rollout_pb2.GenerateResponse) -> Sample:
        if self.agents is not None:  # an agent episode's outcome
            return self.agents.new_sample(prompt, response, self.state.weight_version)
        ids = from_proto(response.response_token_ids, "response_token_ids").to(torch.int64)
        rollout_logprobs = from_proto(response.logprobs, "logprobs").float() if self.config.use_tis else None
        return Sample(prompt=prompt, index=response.sample_index, response_ids=ids, text=response.text,
                      finish_reason=response.finish_reason, weight_version=response.weight_version,
                      rollout_logprobs=rollout_logprobs, token_versions=token_versions(response))

    async def _generate(self, collector: StepCollector, step: int, progress) -> dict:
        """Generation of the step, with DAPO refill rounds; returns generation metrics."""
        cfg = self.config
        prompts = self.stream.next_batch(cfg.rollout_batch_size, whole=True)
        if len(prompts) < cfg.rollout_batch_size:
            return {}
        consumed = len(prompts)
        # Async: the engines may take newer weights while this step generates; each sample says which.
        expected = None if cfg.async_train else self.state.weight_version

        def on_sample(prompt, response):
            if response.finish_reason == rollout_pb2.FINISH_REASON_ABORT:
                raise RuntimeError(f"rollout aborted sample {response.sample_index} of prompt {prompt.uid}; "
                                   "an engine is shutting down")
            collector.add(self._new_sample(prompt, response))
            if progress is not None:
                progress.update(1)

        collector.expect(prompts)
        generate = self.pool.generate if self.agents is None else self.agents.generate  # episodes: agent.py
        await generate(prompts, cfg.n_samples_per_prompt, self._sampling(), expected, cfg.seed, step, 0,
                                 on_sample, on_retry=collector.forget_prompt)
        rounds = 0
        if collector.keep_group is not None:
            await collector.wait_scores()
            while len(collector.kept) < cfg.rollout_batch_size and rounds < cfg.dynamic_filtering_max_rounds:
                decided = len(collector.kept) + len(collector.dropped)
                keep_rate = max(len(collector.kept) / max(decided, 1), 0.1)
                need = math.ceil((cfg.rollout_batch_size - len(collector.kept)) / keep_rate)
                more = self.stream.next_batch(need, whole=False)
                if not more:
                    break
                rounds += 1
                consumed += len(more)
                if progress is not None:
                    progress.total += len(more) * cfg.n_samples_per_prompt
                collector.expect(more)
                await generate(more, cfg.n_samples_per_prompt, self._sampling(), expected, cfg.seed, step,
                                         rounds, on_sample, on_retry=collector.forget_prompt)
                await collector.wait_scores()
        return {"prompts_consumed": consumed, "filter_rounds": rounds}

    async def train_step(self, step: int) -> dict | None:
        """Runs global step `step`; returns its metrics, or None when the data is exhausted.

        With --async_train, services/coordinator/async_loop.py runs collect_step of later steps
        while learn_step of this one trains (this is its special case with staleness 0)."""
        t_step, cpu_step = time.monotonic(), time.process_time()
        self.lost_samples = 0
        collected = await self.collect_step(step)
        if collected is None:
            return None
        # A failure from here on (a learner dying in training or push) loses the step's samples too.
        self.lost_samples = len(collected.collector.all_samples())
        metrics = await self.learn_step(step, collected, t_step, cpu_step)
        self.lost_samples = 0
        return metrics

    async def collect_step(self, step: int, defer_logprobs: bool = False) -> CollectedStep | None:
        """Generation and scores of step `step`, and its log-probs unless deferred to learn_step
        (async: they must come from the weights the step is trained on); None when the data is exhausted."""
        cfg = self.config
        times: dict[str, float] = {}
        # Summed durations of the per-sample calls (they overlap each other and generation).
        self._rpc_seconds = {"score": 0.0, "logprobs": 0.0, "ref_logprobs": 0.0, "values": 0.0}
        keep = None
        if cfg.dynamic_filtering:
            low, high = cfg.dynamic_filtering_reward_range
            keep = lambda rewards: bool(keep_group(torch.tensor([rewards]), low, high)[0])  # noqa: E731
        collector = StepCollector(cfg.n_samples_per_prompt, cfg.micro_rollout_batch_size, self._score, self._logprobs,
                                  keep_group=keep, defer_logprobs=self.sequential or defer_logprobs)
        progress = _progress_bar(cfg, step, self.control.total_steps)
        try:
            # ---- generate (scoring and log-probs run alongside) ----
            self.control.set_phase(cpb.PHASE_GENERATING)
            t0 = time.monotonic()
            if self.recovery is not None:
                await self.recovery.before_step()  # restarted engines get the current weights first
            if self.asleep:
                await self.pool.wake_up(tuple(sorted(self.asleep)))
                self.asleep.clear()
            gen = await self._generate(collector, step, progress)
            if not gen:
                return None
            if self._sleep_supported:
                t_sleep = time.monotonic()
                await self._sleep_rollout()
                times["rollout_sleep"] = time.monotonic() - t_sleep  # the last part of "generate"
            times["generate"] = time.monotonic() - t0
            # ---- wait for the remaining scores and log-probs ----
            self.control.set_phase(cpb.PHASE_SCORING)
            t0 = time.monotonic()
            times["learner_reload"] = await self._reload_learner()  # the first part of "score"
            await (collector.wait_scores() if defer_logprobs else collector.finish())
            times["score"] = time.monotonic() - t0
        except BaseException:
            self.lost_samples = len(collector.all_samples())
            await collector.cancel()
            raise
        finally:
            if progress is not None:
                progress.close()
        return CollectedStep(collector, gen, times, self.stream.state(), defer_logprobs)

    async def learn_step(self, step: int, collected: CollectedStep, t_step: float, cpu_step: float) -> dict:
        """Advantages, training and weight push of a collected step; returns the step's metrics."""
        cfg = self.config
        collector, gen, times = collected.collector, collected.gen, collected.times
        if collected.logprobs_deferred:
            t0 = time.monotonic()
            try:
                await collector.finish()  # old log-probs under the weights this step trains
            except BaseException:
                await collector.cancel()
                raise
            times["logprobs"] = time.monotonic() - t0
        t0 = time.monotonic()
        samples = collector.kept_samples(max_groups=cfg.rollout_batch_size)
        samples, staleness = admit_fresh(samples, cfg.n_samples_per_prompt, self.state.weight_version,
                                         cfg.max_staleness if cfg.async_train else 0, cfg.staleness_policy)
        batch = self._advantages(samples)
        times["advantages"] = time.monotonic() - t0
        # ---- train ----
        self.control.set_phase(cpb.PHASE_TRAINING)
        t0 = time.monotonic()
        train_metrics = await self._train(step, batch) if batch["count"] else {}
        self.trained_step = step
        times["train"] = time.monotonic() - t0
        # ---- push ----
        self.control.set_phase(cpb.PHASE_PUSHING_WEIGHTS)
        t0 = time.monotonic()
        push = self.push_weights if self.recovery is None else self.recovery.push_weights
        push_metrics = await push() if batch["count"] else {}
        times["push"] = time.monotonic() - t0
        # ---- bookkeeping ----
        self.state.global_step = step
        # Where the data stood after this step's prompts (async: later steps have taken more since).
        self.state.episode, self.state.data_position = collected.stream_position
        self.state.prompts_consumed += gen["prompts_consumed"]
        self.state.samples_trained += batch["count"]
        step_s = time.monotonic() - t_step
        # CPU the coordinator itself used during the step (all its threads): its real cost on a
        # machine it shares with the services, whichever phase it falls in.
        times["coordinator_cpu"] = time.process_time() - cpu_step
        metrics = self._step_metrics(step, collector, samples, batch, gen, train_metrics, push_metrics, times, step_s)
        metrics.update(staleness)
        if self.agents is not None:
            metrics.update(self.agents.step_metrics(collector.all_samples()))
        return metrics

    async def _sleep_rollout(self) -> None:
        try:
            await self.pool.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._sleep_supported = False
            log_event(_log, "rollout.sleep_unsupported", detail=exc.details(), action="continuing without sleep")

    def _advantages(self, samples: list[Sample]) -> dict:
        """Pads the step's samples and computes advantages; returns the training batch."""
        cfg = self.config
        if not samples:
            return {"count": 0}
        lengths = [len(s.response_ids) for s in samples]
        mask = length_mask(lengths)  # (B, T)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (B,)
        penalty = overlong_penalty(torch.tensor(lengths), cfg.generate_max_len, cfg.overlong_buffer_len,
                                   cfg.overlong_penalty_factor)
        logp = pad_right([s.old_logprobs for s in samples])
        ref = pad_right([s.ref_logprobs for s in samples]) if self.use_ref else None
        values = pad_right([s.values for s in samples]) if self.use_critic else None
        result = compute_advantages(
            rewards + penalty, mask, cfg.advantage_estimator, cfg.n_samples_per_prompt, logp=logp, ref_logp=ref,
            values=values, kl_coef=self.state.kl_coef, kl_estimator=cfg.kl_estimator, use_kl_loss=cfg.use_kl_loss,
            gamma=cfg.gamma, lambd=cfg.lambd, reward_clip=tuple(cfg.reward_clip_range),
            std_norm=not cfg.no_advantage_std_norm)
        # The learner takes whole multiples of train_batch_size (fewer kept groups after filtering).
        count = len(samples) // cfg.train_batch_size * cfg.train_batch_size
        return {"samples": samples[:count], "count": count, "lengths": lengths[:count], "mask": mask,
                "advantages": result.advantages, "returns": result.returns, "kl": result.kl, "penalty": penalty,
                "all_samples": samples}

    def _experience(self, batch: dict, actor: bool) -> learner_pb2.ExperienceBatch:
        samples, lengths, count = batch["samples"], batch["lengths"], batch["count"]
        rows = lambda t: [t[i, :lengths[i]] for i in range(count)]  # noqa: E731 - (B, T) -> ragged
        exp = learner_pb2.ExperienceBatch(
            input_ids=ragged_to_proto([s.sequence for s in samples], torch.int32),
            response_start=to_proto(torch.tensor([s.response_start for s in samples], dtype=torch.int64)))
        if any(s.action_mask is not None for s in samples):  # multi-turn: environment tokens are not trained
            exp.action_mask.CopyFrom(ragged_to_proto(
                [s.action_mask if s.action_mask is not None else torch.ones(len(s.response_ids), dtype=torch.uint8)
                 for s in samples], torch.uint8))
        if actor:
            exp.old_logprobs.CopyFrom(ragged_to_proto([s.old_logprobs for s in samples], torch.float32))
            if self.config.use_tis:
                exp.rollout_logprobs.CopyFrom(ragged_to_proto([s.rollout_logprobs for s in samples], torch.float32))
            exp.advantages.CopyFrom(ragged_to_proto(rows(batch["advantages"]), torch.float32))
            if self.use_ref and self.config.use_kl_loss and self.state.kl_coef > 0:
                exp.ref_logprobs.CopyFrom(ragged_to_proto([s.ref_logprobs for s in samples], torch.float32))
        else:
            exp.returns.CopyFrom(ragged_to_proto(rows(batch["returns"]), torch.float32))
            exp.old_values.CopyFrom(ragged_to_proto([s.values for s in samples], torch.float32))
        return exp

    async def _train(self, step: int, batch: dict) -> dict:
        cfg = self.config
        low_high = cfg.eps_clip_low_high or [cfg.eps_clip, cfg.eps_clip]
        level, policy_level = cfg.loss_levels()
        loss = learner_pb2.ActorLoss(
            policy_loss_type=learner_pb2.POLICY_LOSS_TYPE_GSPO if cfg.policy_loss_type == "gspo"
            else learner_pb2.POLICY_LOSS_TYPE_PPO,
            eps_clip_low=low_high[0], eps_clip_high=low_high[1], dual_clip=cfg.dual_clip,
            kl_coef=self.state.kl_coef if (cfg.use_kl_loss and self.use_ref) else 0.0,
            kl_estimator=KL_ESTIMATORS[cfg.kl_estimator], entropy_coef=cfg.entropy_loss_coef,
            loss_aggregation=LOSS_LEVELS[level], policy_loss_aggregation=LOSS_LEVELS[policy_level],
            temperature=cfg.temperature, tis_cap=cfg.tis_cap if cfg.use_tis else 0.0)
        seed = _step_seed(cfg.seed, step, "shuffle")
        calls = [self.learner.TrainActor(learner_pb2.TrainActorRequest(
            batch=self._experience(batch, actor=True), loss=loss, max_epochs=cfg.max_epochs, shuffle_seed=seed,
            request_id=f"step{step}"), timeout=cfg.rpc_timeout_s)]
        if self.use_critic:
            calls.append(self.learner.TrainCritic(learner_pb2.TrainCriticRequest(
                batch=self._experience(batch, actor=False), value_clip=cfg.value_clip, max_epochs=cfg.max_epochs,
                loss_aggregation=LOSS_LEVELS[level], shuffle_seed=seed,
                request_id=f"step{step}"), timeout=cfg.rpc_timeout_s))
        replies = await gather_or_cancel(calls)
        actor = replies[0]
        out = {"actor/policy_loss": actor.policy_loss, "actor/kl_loss": actor.kl_loss, "actor/entropy": actor.entropy,
               "actor/clip_ratio": actor.clip_ratio, "actor/ppo_kl": actor.ppo_kl, "actor/grad_norm": actor.grad_norm,
               "actor/lr": actor.learning_rate, "actor/optimizer_steps": actor.optimizer_steps,
               "actor/skipped_steps": actor.skipped_steps, "actor/tokens": actor.tokens}
        if cfg.use_tis:
            out["actor/tis_weight_mean"] = actor.tis_weight_mean
        if self.use_critic:
            critic = replies[1]
            out.update({"critic/value_loss": critic.value_loss, "critic/values_mean": critic.values_mean,
                        "critic/value_clip_ratio": critic.value_clip_ratio, "critic/grad_norm": critic.grad_norm,
                        "critic/lr": critic.learning_rate})
        return out

    def _step_metrics(self, step, collector, samples, batch, gen, train_metrics, push_metrics, times, step_s) -> dict:
        cfg = self.config
        all_samples = collector.all_samples()
        rewards = torch.tensor([s.reward for s in all_samples if s.reward is not None], dtype=torch.float32)
        lengths = torch.tensor([len(s.response_ids) for s in all_samples], dtype=torch.float32)
        tokens = int(lengths.sum())
        m = {"reward/mean": rewards.mean().item() if len(rewards) else 0.0,
             "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
             "reward/max": rewards.max().item() if len(rewards) else 0.0,
             "reward/min": rewards.min().item() if len(rewards) else 0.0,
             "response_length/mean": lengths.mean().item() if len(lengths) else 0.0,
             "response_length/max": lengths.max().item() if len(lengths) else 0.0,
             "response_length/truncated_ratio": sum(s.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
                                                    for s in all_samples) / max(len(all_samples), 1),
             "kl/coef": self.state.kl_coef,
             "samples/generated": len(all_samples), "samples/trained": batch["count"],
             "progress/episode": self.state.episode, "progress/prompts_consumed": self.state.prompts_consumed}
        m.update(reward_metrics(all_samples))
        if batch["count"]:
            mask = batch["mask"]
            per_sample_kl = (batch["kl"] * mask).sum(1) / mask.sum(1).clamp(min=1)
            m["kl/mean"] = per_sample_kl.mean().item()
            adv = batch["advantages"][mask.bool()]
            m["advantages/mean"], m["advantages/abs_mean"] = adv.mean().item(), adv.abs().mean().item()
            if cfg.overlong_buffer_len:
                m["reward/overlong_penalty"] = batch["penalty"].mean().item()
        if cfg.dynamic_filtering:
            m.update({"filter/kept_groups": len(collector.kept), "filter/dropped_groups": len(collector.dropped),
                      "filter/rounds": gen["filter_rounds"]})
            prom.FILTERED_PROMPTS.inc(len(collector.dropped))
        m.update(train_metrics)
        m.update(push_metrics)
        for what, seconds in self._rpc_seconds.items():
            if seconds:
                m[f"rpc/{what}_s"] = seconds
        for phase, seconds in times.items():
            m[f"time/{phase}_s"] = seconds
            if phase != "coordinator_cpu":
                prom.PHASE_SECONDS.labels(phase).observe(seconds)
        m["time/step_s"] = step_s
        # Wall time outside generate, score, train and push (advantages and bookkeeping included).
        m["time/overhead_s"] = max(step_s - sum(times[k] for k in ("generate", "score", "train", "push")), 0.0)
        m["time/overhead_ratio"] = m["time/overhead_s"] / step_s if step_s > 0 else 0.0
        m["throughput/samples_per_s"] = len(all_samples) / step_s
        m["throughput/tokens_per_s"] = tokens / step_s
        prom.STEP_SECONDS.observe(step_s)
        prom.SAMPLES.inc(len(all_samples))
        prom.GENERATED_TOKENS.inc(tokens)
        prom.STEPS.inc()
        prom.GLOBAL_STEP.set(step)
        if cfg.kl_target > 0 and "kl/mean" in m:
            self.state.kl_coef = update_kl_coef(self.state.kl_coef, m["kl/mean"], cfg.kl_target, cfg.kl_horizon,
                                                len(all_samples))
        return m

    # ------------------------------------------------------------------------------------------
    # Evaluation on held-out prompts (--eval_dataset)

    async def evaluate_step(self, step: int) -> dict:
        """eval/pass@1, eval/pass@n, eval/response_length (overall and per data source) of the weights
        the engines hold after `step`, computed exactly as `rlmesh eval` does; in an agent run each
        sample is a whole episode (evaluate_episodes), with the agent's extra logs as eval/<name>.

        Evaluation takes no prompts from the training stream and its generation seeds depend only on
        --seed and the prompt chunk, so a run trains on the same samples with or without it.
        """
        cfg = self.config
        self.control.set_phase(cpb.PHASE_GENERATING)
        if self.asleep:
            await self.pool.wake_up(tuple(sorted(self.asleep)))
            self.asleep.clear()
        sampling = rollout_pb2.SamplingOptions(temperature=cfg.eval_temperature, max_tokens=cfg.generate_max_len,
                                               return_text=True)

        def score(batch: ScoreBatch):
            return self.rewards.call(lambda c: c.score(batch, request_id=f"eval{step}"))

        # An agent run is evaluated on whole episodes (its multi-turn success), as it trains.
        run, engines = (evaluate, self.pool) if self.agents is None else (evaluate_episodes, self.agents)
        metrics = await run(engines, score, self.eval_prompts, cfg.eval_n_samples_per_prompt, sampling,
                            self.state.weight_version, cfg.seed, pass_reward=cfg.eval_pass_reward,
                            decoder=self.query_decoder)
        # Colocated: vLLM gives the memory back before the learner needs it again, as after generation.
        if self._sleep_supported:
            await self._sleep_rollout()
        self.last_eval_step = step
        n = cfg.eval_n_samples_per_prompt
        log_event(_log, "eval.step", step=step, version=self.state.weight_version,
                  pass_at_1=f"{metrics['eval/pass@1']:.4f}",
                  **({f"pass_at_{n}": f"{metrics[f'eval/pass@{n}']:.4f}"} if n > 1 else {}),
                  response_length=f"{metrics['eval/response_length']:.1f}", prompts=len(self.eval_prompts))
        return metrics

    # ------------------------------------------------------------------------------------------
    # Checkpoints and the loop

    async def save_checkpoint(self, step: int) -> dict:
        cfg = self.config
        t0 = time.monotonic()
        self.control.set_phase(cpb.PHASE_CHECKPOINTING)
        await self._reload_learner()
        self.state.config_digest, self.state.config_values = config_digest(cfg)
        reply = await self.learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(
            ckpt_path=cfg.ckpt_path, global_step=step, client_state=self.state.to_json().encode(),
            max_ckpt_num=cfg.max_ckpt_num, request_id=f"step{step}"), timeout=cfg.rpc_timeout_s)
        if cfg.save_hf_ckpt:
            await self.learner.ExportHF(learner_pb2.ExportHFRequest(output_dir=f"{reply.path.rstrip('/')}_hf"),
                                        timeout=cfg.rpc_timeout_s)
        # The learner's files are complete (its marker is in place): coordinator.json, then `latest`.
        checkpoint.commit(cfg.ckpt_path, self.state, cfg.max_ckpt_num)
        self.control.last_checkpoint_step = step
        log_event(_log, "checkpoint.saved", step=step, path=reply.path, removed=",".join(reply.removed))
        return {"time/checkpoint_s": time.monotonic() - t0}

    async def run(self) -> None:
        cfg = self.config
        c = self.control
        c.state = cpb.RUN_STATE_RUNNING
        step = self.state.global_step
        if self.eval_prompts and step == 0:
            # The start of the evaluation curve; a resumed run logged it before its checkpoint.
            self.metrics.log(0, await self.evaluate_step(0))
            c.set_phase(cpb.PHASE_IDLE)
        while True:
            await c.wait_while_paused()
            if c.stop_requested or (cfg.max_steps and step >= cfg.max_steps):
                break
            try:
                steps = self if self.async_steps is None else self.async_steps
                metrics = await steps.train_step(step + 1)
                if metrics is None:
                    break
                saving = ((cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0)
                          or (c.stop_requested and c.stop_checkpoint))
                if saving and not cfg.disable_ds_ckpt:
                    metrics.update(await self.save_checkpoint(step + 1))
            except Exception as exc:  # noqa: BLE001 - a dead service: recovery restarts it or re-raises
                if self.recovery is None:
                    raise
                step = await self.recovery.recover(exc, step)
                continue
            step += 1
            c.global_step, c.episode = step, self.state.episode
            # The learner sleeps until the next step's log-probs (after any checkpoint). Outside the
            # step's own time/step_s, and the GPU waits for it: reported as time/learner_offload_s.
            offload_s = await self._offload_learner()
            if cfg.deepspeed_enable_sleep:
                metrics["time/learner_offload_s"] = offload_s
                prom.PHASE_SECONDS.labels("learner_offload").observe(offload_s)
            last = bool(c.total_steps and step >= c.total_steps) or bool(cfg.max_steps and step >= cfg.max_steps)
            evaluating = bool(self.eval_prompts) and not c.stop_requested and (step % cfg.eval_steps == 0 or last)
            if evaluating:
                metrics.update(await self.evaluate_step(step))
            c.set_phase(cpb.PHASE_IDLE)
            if step % cfg.logging_steps == 0 or c.stop_requested or evaluating:
                self.metrics.log(step, metrics)
                log_event(_log, "step.done", step=step, reward=f"{metrics['reward/mean']:.4f}",
                          kl=f"{metrics.get('kl/mean', 0.0):.5f}", step_s=f"{metrics['time/step_s']:.2f}",
                          version=self.state.weight_version)
        c.state = cpb.RUN_STATE_STOPPING
        if self.eval_prompts and step > 0 and step != self.last_eval_step and not c.stop_requested:
            # The data ran out before the planned last step (dynamic filtering refills use prompts up).
            self.metrics.log(step, await self.evaluate_step(step))
        if step > c.last_checkpoint_step and step > 0 and not cfg.disable_ds_ckpt and \
                (cfg.save_steps < 0 or (c.stop_requested and c.stop_checkpoint)):
            await self.save_checkpoint(step)
        if cfg.save_path and step > 0 and not c.stop_requested:
            await self._reload_learner()
            await self.learner.ExportHF(learner_pb2.ExportHFRequest(output_dir=cfg.save_path), timeout=cfg.rpc_timeout_s)
            log_event(_log, "model.exported", path=cfg.save_path)
            if cfg.save_value_network and self.use_critic:
                critic_path = cfg.save_path.rstrip("/") + "_critic"  # OpenRLHF's place for it
                await self.learner.ExportHF(learner_pb2.ExportHFRequest(output_dir=critic_path, critic=True),
                                            timeout=cfg.rpc_timeout_s)
                log_event(_log, "model.exported", path=critic_path, model="critic")


def _progress_bar(config, step: int, total_steps: int):
    if not config.progress_bar or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=config.samples_per_step(), desc=f"step {step}/{total_steps or '?'}", unit="sample",
                leave=False, dynamic_ncols=True)


def new_state(config: CoordinatorConfig, run_dir: str) -> CoordinatorState:
    digest, values = config_digest(config)
    return CoordinatorState(kl_coef=config.init_kl_coef, seed=config.seed, run_dir=run_dir,
                            config_digest=digest, config_values=values)
