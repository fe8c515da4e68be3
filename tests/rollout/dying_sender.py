"""A weight sender that dies part-way: joins the gloo group, starts a push of several buckets,
broadcasts the first bucket only, and exits without closing anything (as a crashed learner would).

    python -m tests.rollout.dying_sender ADDRESS CHECKPOINT VERSION
"""

import os
import socket
import sys
import time

import grpc
from safetensors.torch import load_file

from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common import weights


def main(address: str, checkpoint: str, version: int) -> None:
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(address))
    info = stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30)
    dtype = weights.PROTO_TO_WIRE_DTYPE[info.weights_dtype]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world_size = 1 + info.tensor_parallel_size
    joined = stub.InitWeightTransfer.future(rollout_pb2.InitWeightTransferRequest(
        backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port,
        world_size=world_size, rank_offset=1, group_name="dying", timeout_s=120), timeout=180)
    group = weights.open_weight_group("gloo", "127.0.0.1", port, world_size, 0, "dying", 120)
    joined.result()
    tensors = load_file(f"{checkpoint}/model.safetensors")
    slots, sizes = weights.plan_buckets([(n, dtype, t.shape) for n, t in tensors.items()], bucket_bytes=100_000)
    assert len(sizes) > 2, "the push must have several buckets for a part-way failure"
    update = stub.UpdateWeights.future(weights.update_weights_request(version, slots, sizes), timeout=180)
    # Broadcast only once the service is receiving: the blocking broadcast below could otherwise
    # hold this process before the UpdateWeights request has left it.
    deadline = time.monotonic() + 120
    while stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30).weights_state != \
            rollout_pb2.WEIGHTS_STATE_UPDATING:
        assert not update.done(), f"UpdateWeights ended before any bucket was sent: {update.exception()}"
        assert time.monotonic() < deadline, "the service never started receiving the update"
        time.sleep(0.05)
    first = weights.bucket_members(slots, len(sizes))[0]
    weights.send_bucket(group, {s.name: tensors[s.name] for s in first}, first, sizes[0])
    print(f"sent bucket 0 of {len(sizes)}; dying", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
