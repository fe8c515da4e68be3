"""The learner's gRPC servicer (rank 0): check each request, split it over the ranks, run it on all
of them through the RankGroupDriver, and put the ranks' results together."""

from __future__ import annotations

import asyncio
import math
import pathlib
import time

import grpc
import prometheus_client
import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import weights
from services.common.crash_points import crash_point
from services.common.errors import ServiceError, failed_precondition, handle_errors, invalid_argument
from services.common.hold_points import hold
from services.common.log import get_logger, log_event
from services.common.tensors import ragged_to_proto
from services.common import ownership
from services.learner import checkpoint, moe_aux, universal
from services.learner.batches import (
    decode_experience,
    decode_sequences,
    forward_micro_batches,
    plan_training,
    token_forward_micro_batches,
)
from services.learner.config import LearnerConfig
from services.learner.learner_rank import LearnerRank
from services.learner.spmd import GroupError, RankGroupDriver
from services.learner.weight_push import plan_chunks, push_checksum, update_request

SERVICE_NAME = "rlmesh.learner.v1.LearnerService"
log = get_logger("learner")

# ----------------------------------------------------------------------------------------------
# Metrics (rlmesh_learner_<what>_<unit>)

CALL_SECONDS = prometheus_client.Histogram(
    "rlmesh_learner_call_duration_seconds", "Wall time of a learner call, by method", ["method"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
PHASE_SECONDS = prometheus_client.Histogram(
    "rlmesh_learner_train_phase_duration_seconds", "Time of one training call spent in each phase on rank 0 "
    "(forward = forward pass and loss, backward, optimizer = DeepSpeed step incl. gradient reduction)",
    ["model", "phase"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
TOKENS = prometheus_client.Counter("rlmesh_learner_tokens_trained_total", "Action tokens trained on", ["model"])
OPTIMIZER_STEPS = prometheus_client.Counter("rlmesh_learner_optimizer_steps_total", "Optimizer steps taken",
                                            ["model"])
MICRO_BATCHES = prometheus_client.Counter("rlmesh_learner_micro_batches_total",
                                          "Forward/backward passes of training, over all ranks", ["model"])
FORWARD_PASSES = prometheus_client.Counter("rlmesh_learner_forward_passes_total",
                                           "Forward passes of LogProbs and Values (micro-batches), over all ranks",
                                           ["method"])
SKIPPED_STEPS = prometheus_client.Counter("rlmesh_learner_skipped_steps_total",
                                          "Optimizer steps skipped: non-finite loss or gradient", ["model"])
POLICY_LOSS = prometheus_client.Gauge("rlmesh_learner_policy_loss", "Policy loss of the last TrainActor call")
KL = prometheus_client.Gauge("rlmesh_learner_kl_loss", "KL-to-reference loss term of the last TrainActor call")
CLIP_RATIO = prometheus_client.Gauge("rlmesh_learner_clip_ratio", "Clipped-token fraction of the last TrainActor call")
VALUE_LOSS = prometheus_client.Gauge("rlmesh_learner_value_loss", "Value loss of the last TrainCritic call")
GRAD_NORM = prometheus_client.Gauge("rlmesh_learner_grad_norm", "Gradient norm before clipping, last call", ["model"])
LEARNING_RATE = prometheus_client.Gauge("rlmesh_learner_learning_rate", "Learning rate of the last step", ["model"])
PUSH_SECONDS = prometheus_client.Histogram(
    "rlmesh_learner_weight_push_duration_seconds", "Wall time of PushWeights from start to done",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
PUSH_BYTES = prometheus_client.Counter("rlmesh_learner_weight_push_bytes_total", "Parameter bytes pushed")
WEIGHT_VERSION = prometheus_client.Gauge("rlmesh_learner_weight_version", "Version of the last weight push")
ERRORS = prometheus_client.Counter("rlmesh_learner_errors_total", "Calls that failed, by method and status",
                                   ["method", "code"])

_KL_ESTIMATORS = {learner_pb2.KL_ESTIMATOR_UNSPECIFIED: "k3", learner_pb2.KL_ESTIMATOR_K1: "k1",
                  learner_pb2.KL_ESTIMATOR_K2: "k2", learner_pb2.KL_ESTIMATOR_K3: "k3"}
_IS_CORRECTION_TYPES = {learner_pb2.IS_CORRECTION_TYPE_UNSPECIFIED: "tis", learner_pb2.IS_CORRECTION_TYPE_TIS: "tis",
                        learner_pb2.IS_CORRECTION_TYPE_ICEPOP: "icepop",
                        learner_pb2.IS_CORRECTION_TYPE_SEQ_MASK_TIS: "seq-mask-tis"}
_LEVELS = {learner_pb2.LOSS_AGGREGATION_UNSPECIFIED: "token", learner_pb2.LOSS_AGGREGATION_TOKEN_MEAN: "token",
           learner_pb2.LOSS_AGGREGATION_SEQUENCE_MEAN: "sequence",
           learner_pb2.LOSS_AGGREGATION_SEQUENCE_SUM: "sequence_sum"}


class _CallTimer:
    """Times a call into CALL_SECONDS and counts its failure in ERRORS by status code."""

    def __init__(self, method: str):
        self.method = method
        self.start = time.monotonic()

    def __enter__(self) -> "_CallTimer":
        self.start = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        CALL_SECONDS.labels(self.method).observe(self.elapsed)
        if exc is not None:
            code = exc.code.name if isinstance(exc, ServiceError) else "INTERNAL"
            if isinstance(exc, asyncio.CancelledError):
                code = "CANCELLED"  # the caller went away (deadline or cancel); the ranks were stopped
            ERRORS.labels(self.method, code).inc()
            log_event(log, "call.failed", method=self.method, code=code, error=str(exc)[:300], level=30)
        return False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _finite(field: str, value: float, lower: float | None = None) -> float:
    if not math.isfinite(value) or (lower is not None and value < lower):
        bound = f" and >= {lower}" if lower is not None else ""
        raise invalid_argument(field, None, f"{value} is not a finite number{bound}", f"send a finite value{bound}")
    return float(value)


def _level(field: str, value: int) -> str:
    if value not in _LEVELS:
        raise invalid_argument(field, None, f"unknown value {value}", "use TOKEN_MEAN, SEQUENCE_MEAN or SEQUENCE_SUM")
    return _LEVELS[value]


def _epochs(value: int) -> int:
    if value < 0:
        raise invalid_argument("max_epochs", None, f"{value} is negative", "send 1 or more (0 means 1)")
    return value or 1


def _temperature(field: str, value: float) -> float:
    return _finite(field, value, 0.0) or 1.0


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, config: LearnerConfig, driver: RankGroupDriver, rank0: LearnerRank, runner):
        self.config = config
        self.driver = driver
        self.rank0 = rank0
        self.runner = runner
        self.world = driver.world_size
        self.weight_backend = ""
        # A cancelled call whose ranks do not stop within the grace: health says so until they do.
        driver.on_wedged = lambda wedged: runner.set_serving(not wedged)
        # Calls that change or read out the weights as a whole never interleave with a push.
        self._weights_lock = asyncio.Lock()

    # ------------------------------------------------------------------------------------------
    # Running commands on the ranks

    async def _run(self, name: str, payloads: list) -> list:
        if self.rank0.offloaded and name not in ("offload", "reload", "init_weight_transfer"):
            raise failed_precondition(f"the learner is offloaded (Offload was called); call Reload before {name}")
        try:
            return await self.driver.run(name, payloads)
        except GroupError as exc:
            if exc.fatal:
                self._stop_after_fatal()
            raise exc.to_service_error() from exc

    def _stop_after_fatal(self) -> None:
        """The ranks may be out of step: stop serving; the process exits (see __main__)."""
        self.runner.set_serving(False)
        self.runner.request_stop()

    def _timed(self, method: str) -> "_CallTimer":
        return _CallTimer(method)

    def _require_critic(self, method: str) -> None:
        if self.rank0.critic is None:
            raise failed_precondition(f"{method} needs a critic; start the learner with --critic_pretrain")

    # ------------------------------------------------------------------------------------------
    # Info

    @handle_errors
    async def GetInfo(self, request, context):
        info = self.rank0.info()
        cfg = self.config
        return learner_pb2.GetInfoResponse(
            pretrain=cfg.pretrain, critic_pretrain=cfg.critic_pretrain, world_size=self.world,
            zero_stage=cfg.zero_stage, dtype=str(cfg.dtype).removeprefix("torch."),
            train_batch_size=cfg.train_batch_size, micro_train_batch_size=cfg.micro_train_batch_size,
            actor_global_step=info["actor_global_step"], critic_global_step=info["critic_global_step"],
            weight_version=info["weight_version"], actor_num_parameters=info["actor_num_parameters"],
            critic_num_parameters=info["critic_num_parameters"], offloaded=info["offloaded"],
            rank0_host=info["rank0_host"], dist_backend=self.driver.spec.backend, vocab_size=info["vocab_size"])

    # ------------------------------------------------------------------------------------------
    # Forward passes

    def _forward_payloads(self, request, temperature: float | None) -> tuple[list, list, int]:
        """Per rank: its micro-batches of the request's samples; and where each result row belongs.
        Padded (the reference service's layout), or packed when the request asks (LogProbsRequest.packed)."""
        samples = decode_sequences(request.input_ids, request.response_start, self.rank0.vocab_size,
                                   self.rank0.max_len)
        cfg = self.config
        if request.packed and cfg.use_dynamic_batch:
            budget = cfg.rollout_max_tokens_per_gpu or cfg.train_max_tokens_per_gpu
            layout = token_forward_micro_batches(samples, budget, self.world)
        else:
            layout = forward_micro_batches(samples, cfg.micro_forward_batch_size, self.world)
        most = max(len(batches) for batches in layout)
        payloads = [{"micro_batches": [[samples[i] for i in mb] for mb in batches],
                     # ZeRO-3 gathers parameters collectively in every forward: all ranks run as many.
                     "passes": most if cfg.zero_stage == 3 else len(batches),
                     "packed": request.packed, "temperature": temperature} for batches in layout]
        return payloads, layout, len(samples)

    @staticmethod
    def _in_request_order(method: str, results: list, layout: list, count: int) -> list:
        """The ranks' result rows in request order; counts the call's passes."""
        FORWARD_PASSES.labels(method).inc(sum(len(batches) for batches in layout))
        rows: list = [None] * count
        for rank_rows, batches in zip(results, layout):
            indices = [i for mb in batches for i in mb]
            for i, row in zip(indices, rank_rows):
                rows[i] = row
        return rows

    @handle_errors
    async def LogProbs(self, request, context):
        with self._timed("LogProbs"):
            temperature = _temperature("temperature", request.temperature)
            payloads, layout, count = self._forward_payloads(request, temperature)
            rows = self._in_request_order("LogProbs", await self._run("logprobs", payloads), layout, count)
            return learner_pb2.LogProbsResponse(logprobs=ragged_to_proto(rows, dtype=torch.float32),
                                                actor_global_step=int(self.rank0.actor.global_steps))

    @handle_errors
    async def Values(self, request, context):
        with self._timed("Values"):
            self._require_critic("Values")
            payloads, layout, count = self._forward_payloads(request, None)
            rows = self._in_request_order("Values", await self._run("values", payloads), layout, count)
            return learner_pb2.ValuesResponse(values=ragged_to_proto(rows, dtype=torch.float32),
                                              critic_global_step=int(self.rank0.critic.global_steps))

    # ------------------------------------------------------------------------------------------
    # Training

    def _plan(self, samples, epochs: int, seed: int) -> list:
        tbs = self.config.train_batch_size
        if len(samples) % tbs:
            raise invalid_argument("batch", None, f"{len(samples)} samples is not a multiple of train_batch_size {tbs}",
                                   f"send a multiple of {tbs} samples (rollout_batch_size x n_samples_per_prompt "
                                   "divisible by --train_batch_size)")
        max_tokens = self.config.train_max_tokens_per_gpu if self.config.use_dynamic_batch else 0
        return plan_training(samples, tbs, self.config.micro_train_batch_size, self.world, epochs, seed, max_tokens)

    def _actor_loss(self, loss) -> dict:
        eps_low = _finite("loss.eps_clip_low", loss.eps_clip_low, 0.0) if loss.HasField("eps_clip_low") else 0.2
        eps_high = _finite("loss.eps_clip_high", loss.eps_clip_high, 0.0) if loss.HasField("eps_clip_high") else eps_low
        dual_clip = _finite("loss.dual_clip", loss.dual_clip, 0.0) or None
        if dual_clip is not None and dual_clip <= 1.0:
            raise invalid_argument("loss.dual_clip", None, f"{dual_clip} must be > 1",
                                   "send e.g. 3, or 0 to disable it")
        if loss.policy_loss_type not in (learner_pb2.POLICY_LOSS_TYPE_UNSPECIFIED, learner_pb2.POLICY_LOSS_TYPE_PPO,
                                         learner_pb2.POLICY_LOSS_TYPE_GSPO):
            raise invalid_argument("loss.policy_loss_type", None, f"unknown value {loss.policy_loss_type}",
                                   "use PPO or GSPO")
        if loss.kl_estimator not in _KL_ESTIMATORS:
            raise invalid_argument("loss.kl_estimator", None, f"unknown value {loss.kl_estimator}", "use K1, K2 or K3")
        tis_cap = _finite("loss.tis_cap", loss.tis_cap, 0.0)
        if 0 < tis_cap < 1:
            raise invalid_argument("loss.tis_cap", None, f"{tis_cap} must be >= 1", "send e.g. 2, or 0 to disable TIS")
        tis_low = _finite("loss.tis_low", loss.tis_low, 0.0)
        if tis_low > 1:
            raise invalid_argument("loss.tis_low", None, f"{tis_low} must be <= 1 (a band [tis_low, tis_cap] "
                                   "around 1)", "send e.g. 0.5, or 0 for a cap from above only")
        if loss.is_correction_type not in _IS_CORRECTION_TYPES:
            raise invalid_argument("loss.is_correction_type", None, f"unknown value {loss.is_correction_type}",
                                   "use TIS, ICEPOP or SEQ_MASK_TIS")
        return {
            "tis_cap": tis_cap, "tis_low": tis_low, "is_correction_type": _IS_CORRECTION_TYPES[loss.is_correction_type],
            "aux_loss_coef": _finite("loss.aux_loss_coef", loss.aux_loss_coef, 0.0),
            "eps_low": eps_low, "eps_high": eps_high, "dual_clip": dual_clip,
            "ratio_type": "sequence" if loss.policy_loss_type == learner_pb2.POLICY_LOSS_TYPE_GSPO else "token",
            "kl_coef": _finite("loss.kl_coef", loss.kl_coef, 0.0), "kl_estimator": _KL_ESTIMATORS[loss.kl_estimator],
            "entropy_coef": _finite("loss.entropy_coef", loss.entropy_coef),
            "level": _level("loss.loss_aggregation", loss.loss_aggregation),
            "policy_level": _level("loss.policy_loss_aggregation", loss.policy_loss_aggregation
                                   or loss.loss_aggregation),
            "temperature": _temperature("loss.temperature", loss.temperature),
        }

    @staticmethod
    def _combine(results: list[dict], model: str) -> dict:
        """Per-rank step results -> totals over ranks, means over the steps not skipped."""
        steps = len(results[0]["steps"])
        kept = [k for k in range(steps) if not results[0]["steps"][k]["skipped"]]
        totals: dict[str, float] = {}
        for k in kept:
            for result in results:
                for key, value in result["steps"][k]["sums"].items():
                    totals[key] = totals.get(key, 0.0) + value
        norms = [results[0]["steps"][k]["grad_norm"] for k in kept]
        combined = {
            "steps": steps, "kept": len(kept), "tokens": totals.get("tokens", 0.0), "totals": totals,
            "grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "lr": results[0]["steps"][-1]["lr"] if steps else 0.0,
            "global_step": results[0]["global_step"],
        }
        for phase, seconds in results[0]["timing"].items():
            PHASE_SECONDS.labels(model, phase).observe(seconds)
        TOKENS.labels(model).inc(combined["tokens"])
        OPTIMIZER_STEPS.labels(model).inc(len(kept))
        MICRO_BATCHES.labels(model).inc(sum(r["micro_batches"] for r in results))
        SKIPPED_STEPS.labels(model).inc(steps - len(kept))
        GRAD_NORM.labels(model).set(combined["grad_norm"])
        LEARNING_RATE.labels(model).set(combined["lr"])
        return combined

    @handle_errors
    async def TrainActor(self, request, context):
        with self._timed("TrainActor") as timer:
            loss = self._actor_loss(request.loss)
            required = ["old_logprobs", "advantages"] + (["ref_logprobs"] if loss["kl_coef"] > 0 else [])
            required += ["rollout_logprobs"] if loss["tis_cap"] > 0 else []
            samples = decode_experience(request.batch, required, self.rank0.vocab_size, self.rank0.max_len)
            plans = self._plan(samples, _epochs(request.max_epochs), request.shuffle_seed)
            await hold("learner.train.started", request.request_id)
            async with self._weights_lock:
                results = await self._run("train_actor", [{"steps": p, "loss": loss} for p in plans])
            c = self._combine(results, "actor")
            kept, totals = max(c["kept"], 1), c["totals"]
            tokens = max(c["tokens"], 1.0)
            response = learner_pb2.TrainActorResponse(
                policy_loss=totals.get("policy_loss", 0.0) / kept, kl_loss=totals.get("kl_loss", 0.0) / kept,
                # NaN where the learner did not measure it (services/learner/entropy_metric.py).
                entropy=totals["entropy"] / kept if "entropy" in totals else math.nan,
                clip_ratio=totals.get("clip_ratio", 0.0) / tokens,
                ppo_kl=totals.get("ppo_kl", 0.0) / tokens, grad_norm=c["grad_norm"], learning_rate=c["lr"],
                optimizer_steps=c["kept"], skipped_steps=c["steps"] - c["kept"], tokens=int(c["tokens"]),
                tis_weight_mean=totals.get("tis_weight", 0.0) / tokens,
                rollout_kl=totals.get("rollout_kl", 0.0) / tokens, aux_loss=totals.get("aux_loss", 0.0) / kept,
                actor_global_step=c["global_step"], duration_s=timer.elapsed)
            POLICY_LOSS.set(response.policy_loss)
            KL.set(response.kl_loss)
            CLIP_RATIO.set(response.clip_ratio)
            log_event(log, "train.actor", request.request_id, samples=len(samples), steps=c["steps"],
                      skipped=response.skipped_steps, policy_loss=f"{response.policy_loss:.6g}",
                      grad_norm=f"{response.grad_norm:.4g}", seconds=f"{timer.elapsed:.2f}")
            return response

    @handle_errors
    async def TrainCritic(self, request, context):
        with self._timed("TrainCritic") as timer:
            self._require_critic("TrainCritic")
            value_clip = _finite("value_clip", request.value_clip, 0.0) if request.HasField("value_clip") else 0.5
            value_clip = value_clip or None
            level = _level("loss_aggregation", request.loss_aggregation)
            aux_coef = self._critic_aux_loss_coef(request.aux_loss_coef)
            required = ["returns"] + (["old_values"] if value_clip is not None else [])
            samples = decode_experience(request.batch, required, self.rank0.vocab_size, self.rank0.max_len)
            plans = self._plan(samples, _epochs(request.max_epochs), request.shuffle_seed)
            payloads = [{"steps": p, "level": level, "value_clip": value_clip, "aux_loss_coef": aux_coef}
                        for p in plans]
            async with self._weights_lock:
                results = await self._run("train_critic", payloads)
            c = self._combine(results, "critic")
            kept, totals = max(c["kept"], 1), c["totals"]
            tokens = max(c["tokens"], 1.0)
            response = learner_pb2.TrainCriticResponse(
                value_loss=totals.get("value_loss", 0.0) / kept, values_mean=totals.get("values", 0.0) / tokens,
                value_clip_ratio=totals.get("value_clip_ratio", 0.0) / tokens, grad_norm=c["grad_norm"],
                learning_rate=c["lr"], optimizer_steps=c["kept"], skipped_steps=c["steps"] - c["kept"],
                tokens=int(c["tokens"]), critic_global_step=c["global_step"], duration_s=timer.elapsed,
                aux_loss=totals.get("aux_loss", 0.0) / kept)
            VALUE_LOSS.set(response.value_loss)
            log_event(log, "train.critic", request.request_id, samples=len(samples), steps=c["steps"],
                      value_loss=f"{response.value_loss:.6g}", seconds=f"{timer.elapsed:.2f}")
            return response

    def _critic_aux_loss_coef(self, coef: float) -> float:
        """TrainCriticRequest.aux_loss_coef, checked: a router loss needs a mixture-of-experts critic."""
        coef = _finite("aux_loss_coef", coef, 0.0)
        if coef > 0 and not hasattr(moe_aux.transformers_model(self.rank0.critic).config, "output_router_logits"):
            raise invalid_argument("aux_loss_coef", None, f"{coef:g}: the critic ({self.config.critic_pretrain}) is "
                                   "not a mixture-of-experts model, so it has no router loss", "send 0")
        return coef

    # ------------------------------------------------------------------------------------------
    # Weight push

    @handle_errors
    async def InitWeightTransfer(self, request, context):
        with self._timed("InitWeightTransfer"):
            backend = weights.BACKEND_NAMES.get(request.backend)
            if backend is None:
                raise invalid_argument("backend", None, f"unknown value {request.backend}", "use GLOO, NCCL or IPC")
            if backend in ("nccl", "ipc") and not torch.cuda.is_available():
                raise failed_precondition(f"the {backend} backend needs GPUs; this learner runs on CPU: use GLOO")
            timeout_s = _finite("timeout_s", request.timeout_s, 0.0) or 600.0
            if backend != "ipc":
                if not request.master_address:
                    raise invalid_argument("master_address", None, "is empty",
                                           "send rank 0's host (GetInfo.rank0_host)")
                if not 0 < request.master_port < 65536:
                    raise invalid_argument("master_port", None, f"{request.master_port} is not a port",
                                           "send a free port on rank 0's host")
                if request.world_size < 2:
                    raise invalid_argument("world_size", None, f"{request.world_size} leaves no engine worker",
                                           "send 1 + the number of rollout workers")
            payload = {"backend": backend, "master_address": request.master_address,
                       "master_port": request.master_port, "world_size": request.world_size,
                       "group_name": request.group_name or "rlmesh-weights", "timeout_s": timeout_s}
            async with self._weights_lock:
                await self._run("init_weight_transfer", [payload] * self.world)
            self.weight_backend = backend
            log_event(log, "weights.transfer_ready", backend=backend, world_size=request.world_size)
            return learner_pb2.InitWeightTransferResponse(rank=0)

    @handle_errors
    async def PushWeights(self, request_iterator, context):
        with self._timed("PushWeights") as timer:
            requests = request_iterator.__aiter__()
            first = await anext(requests, None)
            if first is None or first.WhichOneof("message") != "start":
                raise invalid_argument("start", None, "the first message must be PushWeightsRequest.start",
                                       "open the push with start{version, weights_dtype}")
            start = first.start
            if start.version < 1:
                raise invalid_argument("start.version", None, f"{start.version} must be >= 1",
                                       "send a version greater than the engines' (e.g. the global step)")
            wire = weights.PROTO_TO_WIRE_DTYPE.get(start.weights_dtype)
            if wire is None:
                raise invalid_argument("start.weights_dtype", None, "must be FLOAT32, BFLOAT16 or FLOAT16",
                                       "send the engines' GetModelInfoResponse.weights_dtype")
            if start.bucket_bytes < 0 or start.buckets_per_chunk < 0:
                raise invalid_argument("start.bucket_bytes/buckets_per_chunk", None, "negative",
                                       "send 0 for the defaults")
            if not self.weight_backend:
                raise failed_precondition("no weight transfer set up: call InitWeightTransfer (with the engines) first")
            backend = self.weight_backend
            if backend != "ipc" and self.rank0.sender.group is None:
                raise failed_precondition("the weight group broke in an earlier push; call InitWeightTransfer on the "
                                          "learner and the engines again")
            bucket_bytes = start.bucket_bytes or self.config.weight_bucket_mb * 1024 * 1024
            per_chunk = start.buckets_per_chunk or (1 if backend == "ipc" else 0)
            chunks = plan_chunks(self.rank0.actor.module, wire, bucket_bytes, per_chunk)
            entries: dict = {}
            async with self._weights_lock:
                for index, chunk in enumerate(chunks):
                    final = index == len(chunks) - 1
                    payload = [{"chunk": chunk}] * self.world
                    if backend == "ipc":
                        results = await self._run("push_chunk", payload)
                        handles = [h for _, rank_handles in results for h in rank_handles]
                        yield learner_pb2.PushWeightsResponse(chunk=learner_pb2.PushWeightsChunk(
                            update=update_request(start.version, chunk, index, final, handles)))
                    else:
                        # The engines join the broadcast once the client forwards this chunk to them.
                        yield learner_pb2.PushWeightsResponse(chunk=learner_pb2.PushWeightsChunk(
                            update=update_request(start.version, chunk, index, final, [])))
                        results = await self._run("push_chunk", payload)
                    entries.update(results[0][0])
                    ack = await anext(requests, None)
                    crash_point("learner.push.chunk_acknowledged")
                    if ack is None or ack.WhichOneof("message") != "ack" or ack.ack.chunk_index != index:
                        await self._run("push_done", [{"version": None}] * self.world)
                        raise invalid_argument("ack", f"chunk {index}", "expected PushWeightsRequest.ack for this "
                                               "chunk", "ack each chunk after every engine answered UpdateWeights")
                await self._run("push_done", [{"version": start.version}] * self.world)
            checksum = push_checksum(entries, chunks)
            total = sum(s.nbytes for c in chunks for s in c.slots)
            PUSH_SECONDS.observe(timer.elapsed)
            PUSH_BYTES.inc(total)
            WEIGHT_VERSION.set(start.version)
            log_event(log, "weights.pushed", version=start.version, backend=backend, bytes=total,
                      buckets=sum(len(c.bucket_sizes) for c in chunks), seconds=f"{timer.elapsed:.3f}",
                      checksum=checksum)
            yield learner_pb2.PushWeightsResponse(done=learner_pb2.PushWeightsDone(
                version=start.version, weights_checksum=checksum, bytes=total,
                num_params=sum(len(c.slots) for c in chunks), num_buckets=sum(len(c.bucket_sizes) for c in chunks),
                duration_s=timer.elapsed))

    # ------------------------------------------------------------------------------------------
    # Checkpoints and export

    @handle_errors
    async def SaveCheckpoint(self, request, context):
        with self._timed("SaveCheckpoint") as timer:
            if not request.ckpt_path:
                raise invalid_argument("ckpt_path", None, "is empty", "send the run's checkpoint folder")
            if request.global_step < 1:
                raise invalid_argument("global_step", None, f"{request.global_step} must be >= 1",
                                       "send the coordinator's global step")
            if request.max_ckpt_num < 0:
                raise invalid_argument("max_ckpt_num", None, "is negative", "send 0 for --max_ckpt_num or a count")
            payload = {"ckpt_path": request.ckpt_path, "global_step": request.global_step,
                       "client_state": request.client_state,
                       "max_ckpt_num": request.max_ckpt_num or self.config.max_ckpt_num}
            async with self._weights_lock:
                # Before any rank writes: only folders the learner created or marked (ownership).
                ownership.claim_dir(request.ckpt_path, "ckpt_path", "checkpoints", checkpoint_root=True)
                ownership.check_step_dir(checkpoint.step_dir(request.ckpt_path, request.global_step), "global_step")
                results = await self._run("save_checkpoint", [payload] * self.world)
            log_event(log, "checkpoint.saved", request.request_id, path=results[0]["path"],
                      removed=len(results[0]["removed"]), seconds=f"{timer.elapsed:.2f}")
            return learner_pb2.SaveCheckpointResponse(path=results[0]["path"], removed=results[0]["removed"],
                                                      duration_s=timer.elapsed)

    @handle_errors
    async def LoadCheckpoint(self, request, context):
        with self._timed("LoadCheckpoint") as timer:
            if not request.ckpt_path:
                raise invalid_argument("ckpt_path", None, "is empty", "send the run's checkpoint folder")
            if request.global_step < 0:
                raise invalid_argument("global_step", None, "is negative", "send 0 for the newest or a step")
            models = ["actor"] + (["critic"] if self.rank0.critic is not None else [])
            try:
                folder = checkpoint.resolve_checkpoint(pathlib.Path(request.ckpt_path), request.global_step)
                marker = checkpoint.check_compatible(folder, self.world, self.config.zero_stage, models,
                                                     universal=self.config.use_ds_universal_ckpt)
            except FileNotFoundError as exc:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc
            except ValueError as exc:
                raise failed_precondition(str(exc)) from exc
            load_optimizer = request.load_optimizer_states if request.HasField("load_optimizer_states") else True
            convert = checkpoint.layout_differs(marker, self.world, self.config.zero_stage)
            if convert and not load_optimizer:
                raise invalid_argument("load_optimizer_states", None, f"is false, but {folder} has another layout",
                                       "a checkpoint of another layout loads whole (optimizer and schedule too); "
                                       "leave load_optimizer_states unset")
            payload = {"path": str(folder), "load_optimizer_states": load_optimizer, "universal": None}
            async with self._weights_lock:
                if convert:
                    # On rank 0's side, in a thread: the ranks wait for the next command meanwhile,
                    # and no collective times out however long the conversion takes.
                    converted = await asyncio.to_thread(universal.prepare, folder, models)
                    payload["universal"] = str(converted)
                    log_event(log, "checkpoint.universal", request.request_id, path=str(converted),
                              saved_ranks=marker["world_size"], saved_zero_stage=marker["zero_stage"],
                              seconds=f"{timer.elapsed:.2f}")
                results = await self._run("load_checkpoint", [payload] * self.world)
            step = int(checkpoint.STEP_DIR.match(folder.name).group(1))
            log_event(log, "checkpoint.loaded", request.request_id, path=str(folder), seconds=f"{timer.elapsed:.2f}")
            return learner_pb2.LoadCheckpointResponse(
                global_step=step, path=str(folder), client_state=results[0]["client_state"],
                actor_global_step=results[0]["actor_global_step"], duration_s=timer.elapsed)

    @handle_errors
    async def ExportHF(self, request, context):
        with self._timed("ExportHF") as timer:
            if not request.output_dir:
                raise invalid_argument("output_dir", None, "is empty", "send the folder to write")
            dtype = None
            if request.dtype != common_pb2.DTYPE_UNSPECIFIED:
                dtype = weights.PROTO_TO_WIRE_DTYPE.get(request.dtype)
                if dtype is None:
                    raise invalid_argument("dtype", None, "must be BFLOAT16, FLOAT16 or FLOAT32", "or leave it unset")
            if request.critic:
                self._require_critic("ExportHF")
            payload = {"output_dir": request.output_dir, "dtype": dtype, "critic": request.critic}
            async with self._weights_lock:
                ownership.claim_dir(request.output_dir, "output_dir", "export")  # before any rank writes
                results = await self._run("export_hf", [payload] * self.world)
            return learner_pb2.ExportHFResponse(path=results[0]["path"], bytes=results[0]["bytes"],
                                                duration_s=timer.elapsed)

    # ------------------------------------------------------------------------------------------
    # Colocation

    @handle_errors
    async def Offload(self, request, context):
        with self._timed("Offload") as timer:
            results = await self._run("offload", [None] * self.world)
            return learner_pb2.OffloadResponse(moved=bool(results[0]), duration_s=timer.elapsed)

    @handle_errors
    async def Reload(self, request, context):
        with self._timed("Reload") as timer:
            results = await self._run("reload", [None] * self.world)
            return learner_pb2.ReloadResponse(moved=bool(results[0]), duration_s=timer.elapsed)


def add_to_runner(runner, servicer: LearnerServicer) -> None:
    runner.add(learner_pb2_grpc.add_LearnerServiceServicer_to_server, servicer, SERVICE_NAME)

