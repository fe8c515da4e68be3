"""Work nobody waits for stops: a TrainActor call with a huge epoch count whose client deadline
passes is stopped on both ranks of a real 2-rank learner (ZeRO-2, gloo) within seconds, and the
learner answers the next calls at once; the same for a cancelled LogProbs. Health reports
NOT_SERVING while the stopping takes longer than --cancel_grace_s (set tiny here), SERVING after."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.learner.v1 import learner_pb2 as pb
from services.common.tensors import ragged_to_proto, to_proto
from tests.learner.learner_helpers import experience, logprobs, random_sequences, signed_advantages, start_learner

TRAIN_BATCH = 4


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tiny_model_dir):
    proc = start_learner(
        tmp_path_factory.mktemp("learner_cancel"), "--pretrain", str(tiny_model_dir), "--num_gpus", "2",
        "--zero_stage", "2", "--train_batch_size", str(TRAIN_BATCH), "--micro_train_batch_size", "1",
        "--micro_forward_batch_size", "1", "--actor_learning_rate", "1e-4", "--max_steps", "100000",
        "--cancel_grace_s", "0.01")
    yield proc
    proc.stop()


def serving(learner) -> bool:
    stub = health_pb2_grpc.HealthStub(learner.channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_train_actor_past_its_deadline_stops_and_the_learner_serves_the_next_call(learner):
    stub = learner.stub
    vocab = stub.GetInfo(pb.GetInfoRequest(), timeout=30).vocab_size
    seqs, starts = random_sequences(2 * TRAIN_BATCH, vocab, seed=1)
    batch = experience(seqs, starts, old_logprobs=logprobs(stub, seqs, starts),
                       advantages=signed_advantages(seqs, starts))
    before = stub.GetInfo(pb.GetInfoRequest(), timeout=30).actor_global_step
    statuses = []
    watch = health_pb2_grpc.HealthStub(learner.channel).Watch(health_pb2.HealthCheckRequest(), timeout=300)

    def record():
        try:
            for reply in watch:
                statuses.append(reply.status)
        except grpc.RpcError:
            pass  # cancelled at the end

    watcher = threading.Thread(target=record)
    watcher.start()
    # 20,000 optimizer steps: tens of minutes on this machine, were the call to run to its end.
    with pytest.raises(grpc.RpcError) as err:
        stub.TrainActor(pb.TrainActorRequest(batch=batch, max_epochs=10_000, request_id="huge"), timeout=8)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    t0 = time.monotonic()
    # The next call that needs the ranks is answered within seconds, not after the huge one.
    r = stub.TrainActor(pb.TrainActorRequest(batch=batch, max_epochs=1, request_id="next"), timeout=60)
    assert time.monotonic() - t0 < 30
    assert (r.optimizer_steps, r.skipped_steps) == (2, 0)
    stopped_at = r.actor_global_step - 2
    assert 0 < stopped_at - before < 20_000  # it trained a while, then stopped
    assert serving(learner)
    watch.cancel()
    watcher.join(10)
    # Stopping took longer than the 0.01 s grace: health said so, then recovered.
    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    assert statuses[0] == SERVING and NOT_SERVING in statuses and statuses[-1] == SERVING, statuses
    time.sleep(3)  # nothing runs on in the background: the step count stays put
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=30).actor_global_step == r.actor_global_step
    log = learner.log.read_text()
    assert "command.cancelled command=train_actor" in log and "outcome=stopped" in log


def test_a_cancelled_forward_pass_stops_too(learner):
    stub = learner.stub
    vocab = stub.GetInfo(pb.GetInfoRequest(), timeout=30).vocab_size
    seqs, starts = random_sequences(20_000, vocab, seed=2)  # 10,000 forward passes per rank
    request = pb.LogProbsRequest(input_ids=ragged_to_proto(seqs), response_start=to_proto(starts))
    stopped_before = learner.log.read_text().count("outcome=stopped")  # the other test stops a call too
    future = stub.LogProbs.future(request, timeout=120)
    time.sleep(4)
    future.cancel()
    t0 = time.monotonic()
    small = logprobs(stub, seqs[:4], starts[:4])
    assert len(small) == 4 and time.monotonic() - t0 < 30
    assert learner.log.read_text().count("outcome=stopped") == stopped_before + 1
