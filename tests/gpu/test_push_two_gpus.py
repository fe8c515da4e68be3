"""PushWeights from a learner on two GPUs into a vLLM engine with tensor parallelism 2 on the same two
GPUs (CUDA IPC: each learner rank hands its GPU's copy of every bucket to the engine worker on that
GPU), for a ZeRO-3 learner (each bucket gathered on its own, never the whole model on one rank)
and a ZeRO-2 one. Bit-exact: the engine's checksum, which its two workers agree on byte for byte,
equals the learner's and that of the weights the learner was started from (it does not train
here), whose tensors its own Hugging Face export holds too.
Skipped without two GPUs.

    PYTHONPATH=.:protos:$PYTHONPATH python3 -m pytest tests/gpu/test_push_two_gpus.py -x -q -rA
"""

from __future__ import annotations

import os
import queue

import pytest
import torch

from bench.rollout_overhead import build_model
from rlmesh.learner.v1 import learner_pb2 as pb
from rlmesh.rollout.v1 import rollout_pb2
from services.common import weights
from tests.learner.learner_helpers import start_learner
from tests.rollout.helpers import ROOT, start_rollout, stop_rollout

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2_models")
    # Qwen2.5-0.5B shapes: 14 query and 2 key/value heads split over 2 workers.
    return build_model("qwen2.5-0.5b", root / "a", seed=0), build_model("qwen2.5-0.5b", root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    old = os.environ.get("PYTHONPATH")
    paths = [str(ROOT), str(ROOT / "protos")] + [p for p in (old or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    proc = start_rollout(models[0], tmp_path_factory.mktemp("rollout_tp2"), "--engine", "vllm", "--dtype", "bfloat16",
                         "--tensor_parallel_size", "2", "--gpu_memory_utilization", "0.3", "--max_model_len", "1024",
                         "--enforce_eager", timeout_s=900)
    channel = proc.channel(timeout_s=600)
    yield proc.stub(channel)
    channel.close()
    stop_rollout(proc.proc)
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def push(learner_stub, engine, version: int, bucket_bytes: int):
    """The coordinator's side of PushWeights over ipc: each chunk forwarded to the engine, then acked."""
    requests: queue.Queue = queue.Queue()
    requests.put(pb.PushWeightsRequest(start=pb.PushWeightsStart(
        version=version, weights_dtype=engine.GetModelInfo(rollout_pb2.GetModelInfoRequest()).weights_dtype,
        bucket_bytes=bucket_bytes)))
    done, replies = None, []
    for response in learner_stub.PushWeights(iter(requests.get, None), timeout=600):
        if response.HasField("done"):
            done = response.done
            requests.put(None)
            continue
        update = response.chunk.update
        assert len({b.device_uuid for b in update.ipc_buckets}) == 2  # one copy of each bucket per GPU
        replies.append(engine.UpdateWeights(update, timeout=600))
        requests.put(pb.PushWeightsRequest(ack=pb.PushWeightsAck(chunk_index=update.chunk_index)))
    return done, replies


@pytest.mark.parametrize("zero_stage", ["3", "2"])
def test_two_rank_learner_pushes_into_a_tp2_engine_bit_exact(engine, models, tmp_path, zero_stage):
    learner = start_learner(tmp_path, "--pretrain", str(models[1]), "--num_gpus", "2", "--bf16", "--zero_stage",
                            zero_stage, "--train_batch_size", "8", timeout_s=900)
    try:
        info = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest())
        assert info.tensor_parallel_size == 2
        engine.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest(backend=rollout_pb2.WEIGHT_BACKEND_IPC))
        learner.stub.InitWeightTransfer(pb.InitWeightTransferRequest(backend=rollout_pb2.WEIGHT_BACKEND_IPC),
                                        timeout=120)
        # 64 MiB buckets: the 1 GB model goes in many gathers of its own under ZeRO-3.
        done, replies = push(learner.stub, engine, info.weight_version + 1, 64 << 20)
        assert done.num_buckets >= 10 and len(replies) == done.num_buckets
        export = tmp_path / "export"
        learner.stub.ExportHF(pb.ExportHFRequest(output_dir=str(export)), timeout=600)
    finally:
        learner.stop()
    from services.rollout.pusher import load_checkpoint

    # The learner did not train: it holds model b's weights, which the engine must now hold bit for bit.
    expected = weights.weights_checksum(load_checkpoint(str(models[1])).items(), torch.bfloat16)
    assert replies[-1].weights_checksum == done.weights_checksum
    assert done.weights_checksum == expected
    after = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest())
    assert (after.weight_version, after.weights_checksum) == (info.weight_version + 1, expected)
    assert after.weights_state == rollout_pb2.WEIGHTS_STATE_READY
    # And the learner's own export holds the same tensors. (A ZeRO-2 export also writes the tied
    # lm_head.weight as a tensor of its own, which a push does not send: compare the pushed names.)
    exported = load_checkpoint(str(export))
    reference = load_checkpoint(str(models[1]))
    assert all(torch.equal(exported[name], tensor) for name, tensor in reference.items())
