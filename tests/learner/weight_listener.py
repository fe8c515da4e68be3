"""A stand-alone receiver of the learner's weight push, for the tests and bench/weight_push.py.

    python -m tests.learner.weight_listener --port P --world_size 2 --rank 1 --out FILE

Joins the gloo weight group (services/common/weights.py: open_weight_group), or with --ipc opens
the CUDA IPC handles of its GPU's buckets instead, prints "JOINED",
then, for each line on stdin holding a base64 rlmesh.rollout.v1.UpdateWeightsRequest, receives
that chunk's buckets exactly as a rollout worker does (receive_buckets), prints
"CHUNK <index> <received params>", and after the final chunk saves every tensor to --out
(torch.save of name -> tensor) and prints "CHECKSUM <weights checksum>".
"""

import argparse
import base64
import sys

import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights


def _buckets(group, request, slots):
    """(buffer, slots) per bucket: broadcast over gloo, or opened from the CUDA IPC handles of this GPU."""
    if group is not None:
        yield from weights.receive_buckets(group, slots, list(request.bucket_bytes))
        return
    mine = weights.device_uuid()
    handles = {b.bucket: b for b in request.ipc_buckets if b.device_uuid == mine}
    members = weights.bucket_members(slots, len(request.bucket_bytes))
    for bucket in range(len(request.bucket_bytes)):
        yield weights.open_bucket_ipc(handles[bucket]), members[bucket]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1", help="the learner's rank 0 host")
    parser.add_argument("--port", type=int, required=True, help="InitWeightTransfer master_port")
    parser.add_argument("--world_size", type=int, default=2, help="learner + listeners")
    parser.add_argument("--rank", type=int, default=1, help="this listener's rank in the weight group")
    parser.add_argument("--group_name", default="rlmesh-weights", help="InitWeightTransfer group_name")
    parser.add_argument("--out", default="", help="where to torch.save the received tensors")
    parser.add_argument("--ipc", action="store_true", help="take CUDA IPC handles (same GPU) instead of joining gloo")
    parser.add_argument("--timeout_s", type=float, default=300.0, help="rendezvous and broadcast timeout")
    args = parser.parse_args()
    group = None
    if not args.ipc:
        group = weights.open_weight_group("gloo", args.address, args.port, args.world_size, args.rank,
                                          args.group_name, args.timeout_s)
    print("JOINED", flush=True)
    received: dict[str, torch.Tensor] = {}
    entries: dict[str, weights.DigestEntry] = {}
    for line in sys.stdin:
        request = rollout_pb2.UpdateWeightsRequest.FromString(base64.b64decode(line.strip()))
        slots = weights.slots_from_proto(request.params)
        weights.check_layout(slots, request.bucket_bytes)
        for buffer, members in _buckets(group, request, slots):
            digests = weights.bucket_digests(buffer, members)
            for name, tensor in weights.unpack_bucket(buffer, members):
                received[name] = tensor.clone().cpu()
                entries[name] = weights.DigestEntry(tensor.dtype, tuple(tensor.shape), digests[name])
        print(f"CHUNK {request.chunk_index} {len(received)}", flush=True)
        if request.final:
            break
    if args.out:
        torch.save(received, args.out)
    print(f"CHECKSUM {weights.combine_digests(entries)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
