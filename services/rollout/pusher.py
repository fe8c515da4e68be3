"""The sending side of weight pushes to rollout engines: what a learner's rank 0 runs.

    pusher = WeightPusher(["10.0.0.5:50051", "10.0.0.6:50051"], backend="nccl", master_address="10.0.0.2")
    await pusher.connect()                      # InitWeightTransfer on every engine + the group
    result = await pusher.push(version, model.named_parameters())
    assert result.consistent                    # every engine reports the checksum that was sent

Also a command that pushes a checkpoint folder into running engines (e.g. to roll a fleet onto new
weights without restarting it):

    python -m services.rollout.pusher --rollout_addresses HOST:PORT ... --checkpoint DIR --version 7

gloo and nccl: one group, this process is rank 0, engine i's workers take the ranks after engine
i-1's. ipc: the buckets are packed on this process's GPU and their CUDA IPC handles go inside the
UpdateWeights request; every engine must run on that same GPU (tensor_parallel_size 1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import socket
import sys
from collections.abc import Iterable

import grpc
import torch

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.client import make_channel
from services.common.weights import (
    DEFAULT_BUCKET_BYTES,
    PROTO_TO_WIRE_DTYPE,
    DigestEntry,
    ParamSlot,
    WeightGroup,
    bucket_members,
    bucket_sums,
    combine_digests,
    digests_from_sums,
    open_weight_group,
    pack_bucket,
    plan_buckets,
    send_buckets,
    share_bucket_ipc,
    update_weights_request,
)
from services.rollout.engine import checkpoint_files

SERVICE = "rlmesh.rollout.v1.RolloutService"
_BACKENDS = {"gloo": rollout_pb2.WEIGHT_BACKEND_GLOO, "nccl": rollout_pb2.WEIGHT_BACKEND_NCCL,
             "ipc": rollout_pb2.WEIGHT_BACKEND_IPC}


@dataclasses.dataclass
class PushResult:
    version: int
    sent_checksum: str
    engine_checksums: list[str]
    seconds: float

    @property
    def consistent(self) -> bool:
        return all(c == self.sent_checksum for c in self.engine_checksums)


def split_chunks(slots: list[ParamSlot], sizes: list[int], buckets_per_chunk: int) -> list[tuple[list[ParamSlot], list[int]]]:
    """Groups consecutive buckets into chunks; bucket numbers restart at 0 in every chunk."""
    chunks = []
    for first in range(0, len(sizes), buckets_per_chunk):
        last = min(first + buckets_per_chunk, len(sizes))
        members = [dataclasses.replace(s, bucket=s.bucket - first) for s in slots if first <= s.bucket < last]
        chunks.append((members, list(sizes[first:last])))
    return chunks


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightPusher:
    def __init__(self, addresses: list[str], backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: int = 0, group_name: str = "rlmesh-weights", timeout_s: float = 600.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, chunk_buckets: int = 0, pause_generation: bool = False):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        self.addresses = addresses
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.chunk_buckets = chunk_buckets
        self.pause_generation = pause_generation  # partial rollout: running generations continue on the new weights
        self.channels = [make_channel(a, SERVICE, idempotent_methods=("GetModelInfo",),
                                      default_timeout_s=timeout_s + 60) for a in addresses]
        self.stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in self.channels]
        self.group: WeightGroup | None = None
        self.infos: list[rollout_pb2.GetModelInfoResponse] = []

    @property
    def wire_dtype(self) -> torch.dtype:
        """The engines' weights dtype: pushed tensors are cast to it."""
        return PROTO_TO_WIRE_DTYPE[self.infos[0].weights_dtype]

    async def connect(self) -> None:
        """Reads every engine's model info and sets up the transfer (blocks until all ranks joined)."""
        self.infos = list(await asyncio.gather(*(s.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30)
                                                 for s in self.stubs)))
        dtypes = {i.weights_dtype for i in self.infos}
        if len(dtypes) != 1:
            raise RuntimeError(f"engines hold different weight dtypes {dtypes}; serve them alike")
        if self.backend == "ipc":
            await asyncio.gather(*(s.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
                backend=_BACKENDS["ipc"])) for s in self.stubs))
            return
        port = self.master_port or free_port(self.master_address)
        world_size = 1 + sum(i.tensor_parallel_size for i in self.infos)
        offsets = [1 + sum(i.tensor_parallel_size for i in self.infos[:k]) for k in range(len(self.infos))]
        joins = [s.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(
            backend=_BACKENDS[self.backend], master_address=self.master_address, master_port=port,
            world_size=world_size, rank_offset=offset, group_name=self.group_name, timeout_s=self.timeout_s))
            for s, offset in zip(self.stubs, offsets)]
        replies = asyncio.gather(*joins)
        self.group = await asyncio.to_thread(open_weight_group, self.backend, self.master_address, port,
                                             world_size, 0, self.group_name, self.timeout_s)
        await replies

    async def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PushResult:
        """Sends every (name, tensor) (cast to the engines' dtype) as weight version `version`.

        With chunk_buckets > 0 the push is split into UpdateWeights calls of that many buckets each
        (chunk_index 0, 1, ...; the last one final), which bounds what an engine holds per call.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        tensors = {name: t.detach() for name, t in named_tensors}
        slots, sizes = plan_buckets([(n, self.wire_dtype, t.shape) for n, t in tensors.items()], self.bucket_bytes)
        chunks = split_chunks(slots, sizes, self.chunk_buckets or len(sizes))
        entries: dict[str, DigestEntry] = {}
        replies = []
        for index, (chunk_slots, chunk_sizes) in enumerate(chunks):
            final = index == len(chunks) - 1
            if self.backend == "ipc":
                replies = await self._push_chunk_ipc(version, index, final, chunk_slots, chunk_sizes, tensors, entries)
            else:
                replies = await self._push_chunk_broadcast(version, index, final, chunk_slots, chunk_sizes, tensors,
                                                           entries)
        return PushResult(version, combine_digests(entries), [r.weights_checksum for r in replies],
                          loop.time() - start)

    async def _push_chunk_broadcast(self, version, index, final, slots, sizes, tensors, entries):
        request = update_weights_request(version, slots, sizes, chunk_index=index, final=final)
        request.pause_generation = self.pause_generation
        calls = [asyncio.ensure_future(s.UpdateWeights(request)) for s in self.stubs]
        try:
            entries.update(await asyncio.to_thread(send_buckets, self.group, slots, sizes, tensors))
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        return await asyncio.gather(*calls)

    async def _push_chunk_ipc(self, version, index, final, slots, sizes, tensors, entries):
        device = torch.device("cuda", torch.cuda.current_device())
        members_of = bucket_members(slots, len(sizes))
        buffers = [pack_bucket(tensors, members, sizes[b], device) for b, members in enumerate(members_of)]
        sums = [bucket_sums(buffer, members) for buffer, members in zip(buffers, members_of)]
        # Packed before any handle leaves (see WeightSender.send_chunk: torch's IPC cache can skip
        # the event a receiver would otherwise wait for).
        torch.cuda.synchronize(device)
        for bucket_sum, members in zip(sums, members_of):
            digests = digests_from_sums(bucket_sum, members)
            entries.update({s.name: DigestEntry(s.dtype, s.shape, digests[s.name]) for s in members})
        handles = [share_bucket_ipc(buffer, b) for b, buffer in enumerate(buffers)]
        request = update_weights_request(version, slots, sizes, chunk_index=index, final=final, ipc_buckets=handles)
        request.pause_generation = self.pause_generation
        # The buffers stay alive (referenced here) until every engine has answered.
        return await asyncio.gather(*(s.UpdateWeights(request) for s in self.stubs))

    async def close(self) -> None:
        self.group = None
        for channel in self.channels:
            await channel.close()


def load_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint folder."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(pathlib.Path(model_dir)):
        tensors.update(load_file(str(path)))
    return tensors


async def push_checkpoint(args: argparse.Namespace) -> PushResult:
    pusher = WeightPusher(args.rollout_addresses, args.backend, args.master_address, args.master_port,
                          args.group_name, args.timeout_s, int(args.bucket_mb * 1024 * 1024), args.chunk_buckets,
                          args.pause_generation)
    try:
        await pusher.connect()
        return await pusher.push(args.version, load_checkpoint(args.checkpoint).items())
    finally:
        await pusher.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Push a checkpoint's weights into running rollout engines.")
    parser.add_argument("--rollout_addresses", nargs="+", required=True, help="HOST:PORT of every engine")
    parser.add_argument("--checkpoint", required=True, help="Hugging Face model folder (safetensors)")
    parser.add_argument("--version", type=int, required=True, help="weight version to assign (> the engines')")
    parser.add_argument("--backend", default="gloo", choices=sorted(_BACKENDS), help="transport of the bytes")
    parser.add_argument("--master_address", default="127.0.0.1", help="address the engines reach this process at")
    parser.add_argument("--master_port", type=int, default=0, help="rendezvous port; 0 = a free one")
    parser.add_argument("--group_name", default="rlmesh-weights", help="name of the push group")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="bound on rendezvous and each broadcast")
    parser.add_argument("--bucket_mb", type=float, default=256, help="largest bucket, MiB")
    parser.add_argument("--chunk_buckets", type=int, default=0,
                        help="buckets per UpdateWeights call; 0 = the whole push in one call")
    parser.add_argument("--pause_generation", action="store_true",
                        help="do not wait for running generations: freeze them, load, and let them continue on the "
                             "new weights (vLLM engines only)")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(push_checkpoint(args))
    except grpc.aio.AioRpcError as exc:
        print(f"push failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(result) | {"consistent": result.consistent}))
    return 0 if result.consistent else 1


if __name__ == "__main__":
    sys.exit(main())
