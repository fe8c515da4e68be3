"""What the rollout service asks of a generation engine, and the types both engines share.

Two implementations: `VllmEngine` (vLLM's AsyncLLM inside the service process; its workers run
in their own processes) and `HfEngine` (transformers, one device, for machines without vLLM).
The servicer (server.py) owns validation, weight versions, checksums and locking; an engine only
generates, receives weight buckets into its model, and sleeps. engines.py builds the one --engine
selects; this module imports neither implementation (they import it).
"""

from __future__ import annotations

import abc
import json
import pathlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from services.common.weights import DigestEntry, LoraAdapter, ParamSlot


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters of one Generate call (see rollout.proto SamplingOptions)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    return_text: bool = False


@dataclass(frozen=True)
class SampleSpec:
    """One sample to generate: sample `sample_index` of prompt `prompt_index`."""

    key: str  # unique inside the engine (the engine's request id)
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]

    def seed(self, sampling: Sampling) -> int | None:
        # Distinct samples of one prompt need distinct random streams; seed + i keeps a seeded call reproducible.
        return None if sampling.seed is None else sampling.seed + self.sample_index


@dataclass
class SampleResult:
    """A finished sample."""

    spec: SampleSpec
    token_ids: list[int]
    logprobs: list[float] | None  # one per token when Sampling.logprobs
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    # (first token index, version) of every push with pause_generation that landed while the
    # sample generated, oldest first; tokens before the first one come from the starting version.
    version_starts: list[tuple[int, int]] = field(default_factory=list)

    def token_versions(self, first_version: int) -> list[int]:
        """The weight version of each token, given the version the sample started under."""
        versions = [first_version] * len(self.token_ids)
        for start, version in self.version_starts:
            versions[start:] = [version] * (len(versions) - start)
        return versions


@dataclass(frozen=True)
class WeightChunk:
    """One UpdateWeights chunk, already validated against the model's parameter table (an adapter
    push's: against the adapter's tensors)."""

    chunk_index: int
    final: bool
    slots: list[ParamSlot]
    bucket_sizes: list[int]
    ipc_buckets: list[bytes] = field(default_factory=list)  # serialized rollout_pb2.IpcBucket
    adapter: LoraAdapter | None = None  # set on every chunk of an adapter push


@dataclass(frozen=True)
class Received:
    """What one UpdateWeights chunk did to an engine's model."""

    digests: dict[str, DigestEntry]  # name -> digest of the bytes that arrived, for the chunk's tensors
    # The push's final chunk: name -> digest of what the model now computes with, read back from it,
    # for every tensor of the push (for an adapter push: every weight it loaded); None before the final
    # chunk. An engine raises instead when the two differ (services/rollout/held_weights.py).
    held: dict[str, DigestEntry] | None = None


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo reports and the servicer validates against."""

    model_name: str
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype
    engine_kind: str  # "vllm" | "hf"
    engine_version: str
    tensor_parallel_size: int
    device: str  # "cuda" | "cpu" | ...: where the model runs
    # Every parameter a weight push must carry: Hugging Face name -> full shape.
    parameters: dict[str, tuple[int, ...]]


class Engine(abc.ABC):
    """A generation engine the servicer drives. All methods run on the service's event loop and
    must not block it (engines hand blocking work to their worker processes or to a thread)."""

    facts: ModelFacts

    @abc.abstractmethod
    def generate(self, specs: Sequence[SampleSpec], sampling: Sampling) -> AsyncIterator[SampleResult]:
        """Yields each sample as it finishes. Closing the iterator early aborts the unfinished ones."""

    def is_dead(self) -> bool:
        """True once the engine can no longer generate (e.g. vLLM's engine-core process died)."""
        return False

    @abc.abstractmethod
    def running_samples(self) -> int:
        """Samples submitted to the engine and not finished yet."""

    @abc.abstractmethod
    async def initial_digests(self) -> dict[str, DigestEntry]:
        """Per-parameter digests of the weights the engine started with (the --pretrain checkpoint)."""

    @abc.abstractmethod
    async def open_weight_group(self, backend: str, master_address: str, master_port: int, world_size: int,
                                rank_offset: int, group_name: str, timeout_s: float) -> list[int]:
        """Joins the push group on every worker (gloo/nccl) or selects ipc; returns the ranks taken."""

    @abc.abstractmethod
    async def receive_weights(self, chunk: WeightChunk) -> Received:
        """Receives one chunk into the model; returns the digests of what arrived and, at the push's
        final chunk, of what the model then holds, read back from it. Raises on failure (the model
        may then hold a mix of old and new weights), also when the model holds other values than
        it was given. An adapter push's tensors are kept until its final chunk, which merges them
        into the --pretrain weights of the targets (adapters.py) and loads those."""

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drops cached KV of earlier prompts (stale after new weights)."""

    @abc.abstractmethod
    def pause_unsupported_reason(self) -> str:
        """Why UpdateWeights(pause_generation) cannot work here ("" when it can)."""

    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Freezes every running request where it stands and drops the KV cache (partial rollout);
        requests submitted meanwhile queue."""

    @abc.abstractmethod
    async def resume_generation(self, version: int) -> None:
        """Continues the frozen requests on the weights now loaded; their tokens from here on are
        marked `version` (SampleResult.version_starts)."""

    @abc.abstractmethod
    async def abort_frozen(self) -> None:
        """Aborts the frozen requests (a push failed part-way: the weights may be mixed) and resumes."""

    @abc.abstractmethod
    def sleep_unsupported_reason(self) -> str:
        """Why Sleep/WakeUp cannot work here ("" when they can)."""

    @abc.abstractmethod
    async def sleep(self, level: int) -> int:
        """Frees accelerator memory; returns the bytes freed as measured (0 if unknown)."""

    @abc.abstractmethod
    async def wake_up(self, tags: list[str]) -> bool:
        """Re-allocates what sleep freed (only `tags` if given); True when fully awake."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stops the engine and its worker processes."""


def checkpoint_parameter_shapes(model_dir: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in a Hugging Face safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    model_dir = pathlib.Path(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint (sharded or not); raises if there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights; save the model with safe_serialization=True")
    return files


def checkpoint_digests(model_dir: str | pathlib.Path, dtype: torch.dtype) -> dict[str, DigestEntry]:
    """Per-tensor digests of a safetensors checkpoint, each tensor cast to `dtype` (one at a time)."""
    from safetensors import safe_open

    from services.common.weights import tensor_digest

    entries: dict[str, DigestEntry] = {}
    for path in checkpoint_files(pathlib.Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # Quantized checkpoints hold integer tensors; only floating weights take the engine dtype.
                t = t.to(dtype) if t.is_floating_point() else t
                entries[name] = DigestEntry(t.dtype, tuple(t.shape), tensor_digest(t))
    return entries

