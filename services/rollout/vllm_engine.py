"""vLLM's asynchronous engine (AsyncLLM) inside the rollout service process.

AsyncLLM runs the scheduler and model in its own engine-core and worker processes and talks to
them over ZMQ, so awaiting it never blocks the gRPC event loop, and every concurrent Generate call
lands in the same continuous batch. Each sample is its own vLLM request (n=1, output only when
finished), so a sample streams back the moment it finishes and can be aborted on its own; the n
samples of a prompt still share the prompt's KV cache through prefix caching. With
--partial_rollout, requests stream their tokens in deltas instead, so the engine knows how far each
one has got when a partial-rollout push freezes it (a cost in frontend CPU per token, so only then).

Partial rollout (UpdateWeights with pause_generation): pause_generation(mode="keep") freezes the
running requests, and clear_cache=True drops their KV cache and the prefix cache, so when they
continue they recompute their prompt and tokens so far on the new weights (one prefill each).
Every token after the push then comes from the new weights alone, and no prompt later reuses KV
of the old ones. AReaL and slime keep the old KV instead, saving that prefill; the truncated
importance sampling against the engine's log-probs corrects for either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Sequence

import torch
import vllm
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from services.common.log import get_logger, log_event
from services.common.weights import DigestEntry
from services.rollout.held_weights import held_digests
from services.rollout import cpu_defaults, vllm_log_filter
from services.rollout.config import RolloutConfig
from services.rollout.engine import (
    Engine,
    ModelFacts,
    Received,
    SampleResult,
    SampleSpec,
    Sampling,
    WeightChunk,
    checkpoint_digests,
    checkpoint_parameter_shapes,
)
from services.rollout.weight_receiver import chunk_to_wire

WORKER_EXTENSION = "services.rollout.worker_extension.RolloutWorkerExtension"
_FINISH_REASONS = {"stop": "stop", "length": "length"}  # anything else ("abort", "error") ends as abort

log = get_logger("rollout")


def cpu_process_layout(config: RolloutConfig) -> bool:
    """On the CPU, vLLM's defaults assume the engine has the machine to itself: it pins its worker to
    all cores but one, and runs that worker in a process of its own (one more vLLM import, ~10 s on 2
    cores). A rollout service shares its machine with the learner, the scorers and often other engines,
    which all pinned themselves to the same core. So, unless the user set them: no pinning (the OS
    spreads the processes), and with one worker (tensor parallel 1) the worker inside the engine-core
    process, as vLLM runs it on a GPU. Called before the engine starts; GPUs are left as they are.

    Returns whether the engine-core process is to be forked from this one (_EngineCoreForked): vLLM's CPU
    platform asks for spawned processes (for the OpenMP-bound workers of tensor parallelism), and a
    spawned engine core imports torch, transformers and vLLM again: ~8 CPU-s of a ~18 CPU-s start of the
    tiny model on 2 cores. With one worker inside the engine core there is no such worker; forking it,
    as vLLM does by default on a GPU, skips the imports. Not when the user chose a method."""
    if not current_platform.is_cpu():
        return False
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if config.tensor_parallel_size != 1:
        return False
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


class _EngineCoreForked(AsyncEngineArgs):
    """The engine arguments of a CPU engine whose engine-core process is forked (cpu_process_layout):
    vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn while the configuration is built, so
    the choice is put back right after (vLLM still spawns where it must, e.g. inside a Ray actor)."""

    def create_engine_config(self, *args, **kwargs):
        vllm_config = super().create_engine_config(*args, **kwargs)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        return vllm_config


def engine_args(config: RolloutConfig, fork_engine_core: bool = False) -> AsyncEngineArgs:
    """AsyncEngineArgs from the service options (only those set, so vLLM's defaults stay its own;
    --dtype auto and an unset --enforce_eager as services.rollout.cpu_defaults decides on a CPU)."""
    on_cpu = current_platform.is_cpu()
    dtype, why = cpu_defaults.engine_dtype(config.dtype, on_cpu, cpu_defaults.read_cpu_flags() if on_cpu else set())
    enforce_eager = cpu_defaults.engine_enforce_eager(config.enforce_eager, on_cpu)
    log_event(log, "engine.options", dtype=dtype, dtype_from=why, enforce_eager=enforce_eager,
              enforce_eager_from="--enforce_eager" if config.enforce_eager is not None
              else "default on a CPU" if on_cpu else "vLLM's default on a GPU")
    kwargs = dict(
        model=config.pretrain,
        served_model_name=config.model_name,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_seqs=config.max_num_seqs,
        dtype=dtype,
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=enforce_eager,
        seed=config.seed,
        enable_sleep_mode=config.enable_sleep_mode,
        logprobs_mode=config.logprobs_mode,
        trust_remote_code=config.trust_remote_code,
        worker_extension_cls=WORKER_EXTENSION,
        # With stats on, vLLM's own Prometheus metrics (vllm:num_requests_running, ...) join ours on /metrics.
        disable_log_stats=not config.vllm_log_stats,
    )
    if config.max_model_len:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.quantization:
        kwargs["quantization"] = config.quantization
    chunked = {"on": True, "off": False, "auto": False if current_platform.is_cpu() else None}[config.enable_chunked_prefill]
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    return (_EngineCoreForked if fork_engine_core else AsyncEngineArgs)(**kwargs)


def sampling_params(sampling: Sampling, spec: SampleSpec, stream_tokens: bool = False) -> SamplingParams:
    """vLLM's parameters for one sample. stream_tokens: outputs as tokens come (deltas), else one
    output when the sample is finished (the accumulation in _generate_one handles both)."""
    kwargs = dict(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        seed=spec.seed(sampling),
        logprobs=0 if sampling.logprobs else None,
        ignore_eos=sampling.ignore_eos,
        # Stop strings are matched on text, so they need detokenizing too.
        detokenize=sampling.return_text or bool(sampling.stop),
        output_kind=RequestOutputKind.DELTA if stream_tokens else RequestOutputKind.FINAL_ONLY,
    )
    if sampling.top_k > 0:
        kwargs["top_k"] = sampling.top_k
    return SamplingParams(**kwargs)


@dataclasses.dataclass
class _Running:
    """What one request has streamed back so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    version_starts: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class VllmEngine(Engine):
    def __init__(self, config: RolloutConfig):
        self.config = config
        fork_engine_core = cpu_process_layout(config)
        vllm_log_filter.install()  # before the engine's processes fork, which inherit it
        self.llm = AsyncLLM.from_engine_args(engine_args(config, fork_engine_core))
        # What sleep() released and wake_up() has not restored yet: vLLM's allocator fails when asked
        # to wake a tag that is already awake, and WakeUp is documented as safe to repeat.
        self.asleep_tags: set[str] = set()
        model_config = self.llm.model_config
        self.facts = ModelFacts(
            model_name=config.model_name,
            max_model_len=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            dtype=model_config.dtype,
            engine_kind="vllm",
            engine_version=f"vllm {vllm.__version__}",
            tensor_parallel_size=config.tensor_parallel_size,
            device=str(current_platform.device_type),
            parameters=checkpoint_parameter_shapes(config.pretrain),
        )
        self._running: dict[str, _Running] = {}  # by request id (SampleSpec.key)

    async def initial_digests(self) -> dict[str, DigestEntry]:
        return await asyncio.to_thread(checkpoint_digests, self.config.pretrain, self.facts.dtype)

    def running_samples(self) -> int:
        return len(self._running)

    def is_dead(self) -> bool:
        return self.llm.errored

    async def generate(self, specs: Sequence[SampleSpec], sampling: Sampling) -> AsyncIterator[SampleResult]:
        queue: asyncio.Queue[SampleResult | BaseException] = asyncio.Queue()
        # Registered before any await, so a partial push that lands from here on marks these too.
        for spec in specs:
            self._running[spec.key] = _Running()
        tasks = [asyncio.create_task(self._generate_one(spec, sampling, queue)) for spec in specs]
        try:
            for _ in range(len(tasks)):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            unfinished = [t for t in tasks if not t.done()]
            for task in unfinished:
                task.cancel()  # AsyncLLM.generate aborts the request when its task is cancelled
            if unfinished:
                await asyncio.gather(*unfinished, return_exceptions=True)
                log_event(log, "generate.aborted", samples=len(unfinished))
            for spec in specs:  # a task cancelled before it started never ran its own clean-up
                self._running.pop(spec.key, None)

    async def _generate_one(self, spec: SampleSpec, sampling: Sampling,
                            queue: asyncio.Queue[SampleResult | BaseException]) -> None:
        state = self._running[spec.key]
        try:
            finish_reason = None
            params = sampling_params(sampling, spec, stream_tokens=self.config.partial_rollout)
            async for output in self.llm.generate({"prompt_token_ids": spec.prompt_ids}, params, spec.key):
                delta = output.outputs[0]
                state.token_ids += delta.token_ids
                if sampling.logprobs and delta.token_ids:
                    # logprobs=0 returns, per new position, a dict holding (at least) the sampled token.
                    state.logprobs += [float(pos[tok].logprob) for pos, tok in zip(delta.logprobs, delta.token_ids)]
                state.text.append(delta.text)
                finish_reason = delta.finish_reason
            queue.put_nowait(SampleResult(
                spec=spec, token_ids=state.token_ids, logprobs=state.logprobs if sampling.logprobs else None,
                finish_reason=_FINISH_REASONS.get(finish_reason, "abort"),
                text="".join(state.text) if sampling.return_text else "", version_starts=state.version_starts))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            queue.put_nowait(exc)
        finally:
            self._running.pop(spec.key, None)

    async def open_weight_group(self, backend: str, master_address: str, master_port: int, world_size: int,
                                rank_offset: int, group_name: str, timeout_s: float) -> list[int]:
        ranks = await self.llm.collective_rpc(
            "rlmesh_open_weight_group",
            args=(backend, master_address, master_port, world_size, rank_offset, group_name, timeout_s))
        return [r for r in ranks if r >= 0]

    async def receive_weights(self, chunk: WeightChunk) -> Received:
        reports = await self.llm.collective_rpc("rlmesh_receive_weights", args=(chunk_to_wire(chunk),))
        # Every tensor-parallel worker received the full tensors; they must agree byte for byte.
        first = reports[0]["received"]
        for rank, report in enumerate(reports[1:], start=1):
            digests = report["received"]
            if digests != first:
                differing = sorted(n for n in set(first) | set(digests) if first.get(n) != digests.get(n))
                raise RuntimeError(f"worker {rank} received different bytes than worker 0 for {differing[:5]}")
        slots = {s.name: s for s in chunk.slots}
        received = {name: DigestEntry(slots[name].dtype, slots[name].shape, bytes.fromhex(d))
                    for name, d in first.items()}
        if not chunk.final:
            return Received(received)
        # What the workers' models now compute with (worker_extension.py, readback.py).
        held, unverified = held_digests(reports, f"the vLLM {vllm.__version__} engine")
        if unverified:
            log_event(log, "weights.not_read_back", level=logging.WARNING, tensors=len(unverified),
                      examples="; ".join(f"{n}: {why}" for n, why in list(unverified.items())[:3]),
                      note="taken as received: the read-back does not know where this model keeps them")
        loaded = reports[0]["loaded"]
        return Received(received, {name: DigestEntry(getattr(torch, loaded[name][1]), tuple(loaded[name][2]),
                                                     bytes.fromhex(d)) for name, d in held.items()})

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    def pause_unsupported_reason(self) -> str:
        if not self.config.partial_rollout:
            return ("this rollout service was started without --partial_rollout (it streams whole samples only); "
                    "fix: start it with --partial_rollout (the coordinator does for --partial_rollout runs)")
        if not hasattr(self.llm, "resume_generation"):
            return (f"vllm {vllm.__version__} has no AsyncLLM.pause_generation/resume_generation; fix: install "
                    "vLLM 0.26 or newer, or train without --partial_rollout")
        return ""

    async def pause_generation(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=True)

    async def resume_generation(self, version: int) -> None:
        # The engine has been frozen since pause_generation returned (which itself waits for the
        # engine's last outputs to be sent, then 20 ms), and the weights were loaded since: every
        # token it made before the freeze has reached its request's state by now.
        for state in self._running.values():
            state.version_starts.append((len(state.token_ids), version))
        await self.llm.resume_generation()

    async def abort_frozen(self) -> None:
        if self._running:
            await self.llm.abort(list(self._running))  # each ends with an "abort" output
        await self.llm.resume_generation()

    def sleep_unsupported_reason(self) -> str:
        if not current_platform.is_sleep_mode_available():
            return (f"sleep mode is not supported on this platform ({current_platform.device_type}): vLLM can "
                    "sleep only on CUDA or ROCm GPUs, so Sleep/WakeUp are unavailable here")
        if not self.config.enable_sleep_mode:
            return "the service was started without --enable_sleep_mode; restart it with that flag to use Sleep/WakeUp"
        return ""

    async def sleep(self, level: int) -> int:
        before = await self.llm.collective_rpc("rlmesh_device_memory")
        await self.llm.sleep(level=level)
        self.asleep_tags = {"weights", "kv_cache"}
        after = await self.llm.collective_rpc("rlmesh_device_memory")
        return sum(a[0] - b[0] for a, b in zip(after, before))

    async def wake_up(self, tags: list[str]) -> bool:
        to_wake = (set(tags) if tags else {"weights", "kv_cache"}) & self.asleep_tags
        if to_wake:
            await self.llm.wake_up(tags=sorted(to_wake))
            self.asleep_tags -= to_wake
        return not await self.llm.is_sleeping()

    async def shutdown(self) -> None:
        self.llm.shutdown()
