"""The learner's side of PushWeights (the protocol and the checksum live in services/common/weights.py).

The actor's parameters are laid out in buckets (Hugging Face names, module order, cast to the
engines' dtype) and the buckets are grouped in chunks, one UpdateWeights call per chunk. For each
bucket every rank takes part (under ZeRO-3 the bucket's parameters are gathered, one bucket at a
time, never the whole model), and then:
  gloo / nccl: rank 0 packs the bucket and broadcasts it to the engines' workers;
  ipc: every rank packs the bucket on its own GPU and shares a CUDA IPC handle of it, which the
       engine worker on that GPU opens; the buffers stay alive until the chunk is acknowledged.

With LoRA (the actor is a PEFT model) a push carries the adapter's tensors alone, under the names
the engines know (lora.adapter_state: model.layers.0.self_attn.q_proj.lora_A.weight, ...), and
every UpdateWeights request declares the adapter (rank, scaling, target modules), which the
engines merge into their --pretrain weights: megabytes per push instead of the whole model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses

import grpc
import torch

from services.common import weights
from services.common.errors import ServiceError, failed_precondition
from services.learner import lora
from services.learner.spmd import CANCEL
from rlmesh.rollout.v1 import rollout_pb2


@dataclasses.dataclass
class Chunk:
    """The buckets of one UpdateWeights call, numbered from 0 within the chunk."""

    slots: list[weights.ParamSlot]
    bucket_sizes: list[int]
    adapter: weights.LoraAdapter | None = None  # set on every chunk of an adapter push


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """A parameter's unsharded shape (ZeRO-3 keeps it in ds_shape)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def pushed_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """What a push of `module` carries, under the engines' names: the LoRA adapter's tensors for a
    PEFT model, else every parameter."""
    return lora.adapter_state(module) if lora.is_peft_model(module) else list(module.named_parameters())


def adapter_info(module: torch.nn.Module) -> weights.LoraAdapter | None:
    """The pushed adapter of a PEFT model (None for any other): rank and scaling as its LoRA layers
    apply them, and its target modules in push order."""
    if not lora.is_peft_model(module):
        return None
    from peft.tuners.lora import LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer) and lora.ADAPTER_NAME in m.scaling]
    ranks = {m.r[lora.ADAPTER_NAME] for m in layers}
    scalings = {m.scaling[lora.ADAPTER_NAME] for m in layers}
    if len(ranks) != 1 or len(scalings) != 1:
        raise failed_precondition(f"the adapter's layers have ranks {sorted(ranks)} and scalings {sorted(scalings)}; "
                                  "an adapter push declares one of each: train with one --lora_rank and --lora_alpha")
    suffix = ".lora_A.weight"
    targets = tuple(name.removesuffix(suffix) for name, _ in lora.adapter_state(module) if name.endswith(suffix))
    return weights.LoraAdapter(ranks.pop(), float(scalings.pop()), targets)


def plan_chunks(module: torch.nn.Module, wire_dtype: torch.dtype, bucket_bytes: int,
                buckets_per_chunk: int) -> list[Chunk]:
    """Buckets of every pushed tensor (pushed_parameters) in module order, grouped buckets_per_chunk
    at a time (0 = all)."""
    params = [(name, wire_dtype, full_shape(p)) for name, p in pushed_parameters(module)]
    adapter = adapter_info(module)
    slots, sizes = weights.plan_buckets(params, bucket_bytes)
    per_chunk = buckets_per_chunk if buckets_per_chunk > 0 else len(sizes)
    chunks = []
    for first in range(0, len(sizes), per_chunk):
        last = min(first + per_chunk, len(sizes))
        members = [dataclasses.replace(s, bucket=s.bucket - first) for s in slots if first <= s.bucket < last]
        chunks.append(Chunk(members, list(sizes[first:last]), adapter))
    return chunks


def push_checksum(entries: dict[str, weights.DigestEntry], chunks: list[Chunk]) -> str:
    """The weights checksum of a push as sent (an adapter push's includes its scaling)."""
    adapter = chunks[0].adapter if chunks else None
    if adapter is None:
        return weights.combine_digests(entries)
    return weights.combine_digests(weights.adapter_checksum_entries(entries, adapter.scaling))


class WeightSender:
    """One per rank: the weight group (rank 0, gloo/nccl) and the ipc buffers awaiting their ack."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device
        self.backend = ""
        self.group = None
        self._ipc_buffers: list[torch.Tensor] = []
        # CUDA's current device is per thread: the sending thread gets this rank's.
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._sending = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-send", initializer=init)

    def init(self, backend: str, master_address: str, master_port: int, world_size: int, group_name: str,
             timeout_s: float) -> None:
        """Rank 0 joins the group as its rank 0 (blocks until the engines joined); others note the backend."""
        self.release()
        self.group = None
        if backend in ("gloo", "nccl") and self.rank == 0:
            self.group = weights.open_weight_group(backend, master_address, master_port, world_size, 0,
                                                   group_name, timeout_s)
        self.backend = backend

    def release(self) -> None:
        """Drops the ipc buffers of the last chunk (after the engines acknowledged it)."""
        self._ipc_buffers = []

    def send_chunk(self, module: torch.nn.Module, zero3: bool, chunk: Chunk) -> tuple[dict, list[bytes]]:
        """Sends one chunk's buckets. Collective over the learner's ranks under ZeRO-3.

        Returns (name -> DigestEntry of what rank 0 sent, serialized IpcBucket messages of this rank).
        gloo / nccl: bucket b is broadcast from a helper thread while this one sums its digest on
        the device and then gathers and packs bucket b + 1, so packing, checking and sending
        overlap (two buffers live); the host reads the digests once, after the last bucket.
        If a broadcast fails (an engine went away), rank 0 stops sending but keeps taking part in
        the gathers, so the learner's ranks stay in step, and raises UNAVAILABLE at the end.
        """
        if not self.backend:
            raise failed_precondition("no weight transfer set up: call InitWeightTransfer first")
        self.release()
        by_name = dict(pushed_parameters(module))
        entries: dict[str, weights.DigestEntry] = {}
        sums: list[tuple[torch.Tensor, list[weights.ParamSlot]]] = []
        ipc: list[bytes] = []
        in_flight: concurrent.futures.Future | None = None
        send_error: Exception | None = None

        def settle() -> None:
            nonlocal in_flight, send_error
            if in_flight is not None:
                try:
                    self._wait_sent(in_flight)
                except Exception as exc:  # noqa: BLE001 - reported once every bucket was gathered
                    send_error = send_error or exc
                in_flight = None

        for bucket, members in enumerate(weights.bucket_members(chunk.slots, len(chunk.bucket_sizes))):
            size = chunk.bucket_sizes[bucket]
            with _gathered([by_name[s.name] for s in members], zero3):
                tensors = {s.name: by_name[s.name].data for s in members}
                if self.backend == "ipc":
                    buffer = weights.pack_bucket(tensors, members, size, self.device)
                    self._ipc_buffers.append(buffer)
                    ipc.append(weights.share_bucket_ipc(buffer, bucket).SerializeToString())
                elif self.rank == 0 and send_error is None:
                    buffer = weights.pack_bucket(tensors, members, size, self.group.device)
            if self.rank != 0 or send_error is not None:
                continue
            if self.backend != "ipc":
                settle()  # buckets go out in index order, one at a time
                if send_error is not None:
                    continue
                in_flight = self._sending.submit(self.group.broadcast_from_learner, buffer)
            sums.append((weights.bucket_sums(buffer, members), members))
        settle()
        if self.backend == "ipc" and self.device.type == "cuda":
            # The handles leave only once their bytes are written, so a receiver never depends on
            # the IPC event that torch attaches to a shared buffer (its IPC cache can hand out an
            # earlier mapping of the same allocator block without that event). One wait per chunk.
            torch.cuda.current_stream(self.device).synchronize()
        # The digests were summed on the device; the host waits for them once per chunk.
        for bucket_sum, members in sums:
            digests = weights.digests_from_sums(bucket_sum, members)
            entries.update({s.name: weights.DigestEntry(s.dtype, s.shape, digests[s.name]) for s in members})
        if send_error is not None:
            self.group = None
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"broadcasting the weights to the engines failed: {send_error}; call "
                               "InitWeightTransfer on the learner and the engines again, then push")
        return entries, ipc


    def _wait_sent(self, in_flight: concurrent.futures.Future) -> None:
        """Waits for a broadcast; gives it up once the push's caller has gone (spmd.CANCEL).

        A coordinator that dies after the learner's chunk left and before the engines were told
        (UpdateWeights) leaves this broadcast waiting for receivers that never come, until the group's
        timeout (300 s). Nobody waits for it any more: the broadcast is abandoned on its thread (it
        fails by itself at that timeout), the group is dropped, and the next InitWeightTransfer
        builds a new one at once.
        """
        while True:
            try:
                in_flight.result(timeout=0.2)
                return
            except concurrent.futures.TimeoutError:
                if CANCEL.requested.is_set():
                    self._sending.shutdown(wait=False)
                    self._sending = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="weight-send", initializer=self._sending._initializer)
                    raise RuntimeError("the push's caller went away mid-broadcast; the broadcast was abandoned")


def _gathered(params: list[torch.nn.Parameter], zero3: bool):
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def update_request(version: int, chunk: Chunk, index: int, final: bool,
                   ipc_buckets: list[bytes]) -> rollout_pb2.UpdateWeightsRequest:
    buckets = [rollout_pb2.IpcBucket.FromString(b) for b in ipc_buckets]
    return weights.update_weights_request(version, chunk.slots, chunk.bucket_sizes, chunk_index=index,
                                          final=final, ipc_buckets=buckets,
                                          adapter=chunk.adapter.to_proto() if chunk.adapter else None)
