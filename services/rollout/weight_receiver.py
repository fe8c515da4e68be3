"""The receiving end of a weight push, as it runs next to the model (a vLLM worker or the hf engine).

It holds the push group (gloo/nccl) or the ipc choice made by InitWeightTransfer, receives the
buckets of one UpdateWeights chunk, hands each bucket's (name, tensor) pairs to a load function,
and returns the digests of exactly the bytes that arrived (services/common/weights.py).
Chunks cross into vLLM's worker processes through collective_rpc, so they travel as plain
lists and dicts (`chunk_to_wire` / `chunk_from_wire`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common.weights import (
    LoraAdapter,
    ParamSlot,
    bucket_members,
    bucket_sums,
    device_uuid,
    digests_from_sums,
    dtype_name,
    open_bucket_ipc,
    open_weight_group,
    receive_buckets,
    unpack_bucket,
)
from services.rollout.engine import WeightChunk

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


def chunk_to_wire(chunk: WeightChunk) -> dict:
    return {
        "chunk_index": chunk.chunk_index,
        "final": chunk.final,
        "slots": [[s.name, dtype_name(s.dtype), list(s.shape), s.bucket, s.offset] for s in chunk.slots],
        "bucket_sizes": list(chunk.bucket_sizes),
        "ipc_buckets": list(chunk.ipc_buckets),
        "adapter": None if chunk.adapter is None else [chunk.adapter.rank, chunk.adapter.scaling,
                                                       list(chunk.adapter.targets)],
    }


def chunk_from_wire(wire: dict) -> WeightChunk:
    slots = [ParamSlot(name, getattr(torch, dtype), tuple(shape), bucket, offset)
             for name, dtype, shape, bucket, offset in wire["slots"]]
    adapter = None
    if wire["adapter"] is not None:
        rank, scaling, targets = wire["adapter"]
        adapter = LoraAdapter(rank, scaling, tuple(targets))
    return WeightChunk(chunk_index=wire["chunk_index"], final=wire["final"], slots=slots,
                       bucket_sizes=list(wire["bucket_sizes"]), ipc_buckets=list(wire["ipc_buckets"]),
                       adapter=adapter)


class WeightReceiver:
    """One per model replica (per vLLM worker, or the hf engine's model)."""

    def __init__(self) -> None:
        self.backend = ""
        self.group = None
        self.rank = -1

    def open(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
             group_name: str, timeout_s: float) -> int:
        """Joins the push group as `rank` (gloo/nccl; blocks until every rank joined) or selects ipc."""
        self.close()
        if backend != "ipc":
            self.group = open_weight_group(backend, master_address, master_port, world_size, rank,
                                           group_name, timeout_s)
            self.rank = rank
        self.backend = backend
        return self.rank

    def close(self) -> None:
        # Dropping the group object closes its connections; a broken group must not be reused.
        self.group, self.backend, self.rank = None, "", -1

    def receive(self, chunk: WeightChunk, device: torch.device, load: LoadFn) -> dict[str, str]:
        """Receives every bucket of `chunk`, calls load(pairs) per bucket; returns name -> hex digest.

        The digests are summed on `device` bucket by bucket and read back once, at the end, so
        receiving, loading and checking the buckets never wait for the host in between.
        A failure (peer gone, timeout, missing handle) raises; the group is then closed, so the
        next push needs a new InitWeightTransfer.
        """
        if not self.backend:
            raise RuntimeError("no weight transfer set up on this worker; call InitWeightTransfer first")
        sums = []
        try:
            for buffer, members in self._buckets(chunk, device):
                sums.append((bucket_sums(buffer, members), members))
                load(unpack_bucket(buffer, members))
            digests: dict[str, str] = {}
            for bucket_sum, members in sums:
                digests.update({n: d.hex() for n, d in digests_from_sums(bucket_sum, members).items()})
        except BaseException:
            if self.backend != "ipc":
                self.close()
            raise
        return digests

    def _buckets(self, chunk: WeightChunk, device: torch.device) -> Iterator[tuple[torch.Tensor, list[ParamSlot]]]:
        if self.backend != "ipc":
            yield from receive_buckets(self.group, chunk.slots, chunk.bucket_sizes)
            return
        mine = device_uuid(device)
        handles = {}
        for raw in chunk.ipc_buckets:
            msg = rollout_pb2.IpcBucket.FromString(raw)
            if msg.device_uuid == mine:
                handles[msg.bucket] = msg
        buffers = []
        for bucket, members in enumerate(bucket_members(chunk.slots, len(chunk.bucket_sizes))):
            if bucket not in handles:
                raise RuntimeError(f"ipc_buckets has no handle of bucket {bucket} for this worker's GPU {mine}")
            buffer = open_bucket_ipc(handles[bucket], device)
            if buffer.numel() != chunk.bucket_sizes[bucket]:
                raise RuntimeError(f"ipc bucket {bucket}: handle maps {buffer.numel()} bytes, "
                                   f"bucket_bytes says {chunk.bucket_sizes[bucket]}")
            buffers.append(buffer)
            yield buffer, members
        # The producer may reuse its buffers once the reply arrives: finish reading them first
        # (once per chunk, not per bucket, so the copies of every bucket queue up back to back).
        torch.cuda.synchronize(device)
        del buffers
