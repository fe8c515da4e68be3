"""The learner service with two CPU ranks (gloo), ZeRO-3 (parameters sharded), packed training
micro-batches and no critic; then checkpoints across a killed service process, and a failure on
one rank.

The tests share one service (its start is most of the module's time) and pass in any order: none
assumes what an earlier one trained, and the service is started again for the next test when the
checkpoint test has killed it.
"""

import concurrent.futures
import queue
import shutil
import signal

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2 as pb
from rlmesh.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common import rl_math
from services.common.tensors import ragged_to_proto, to_proto
from tests.conftest import get_free_port
from tests.learner.learner_helpers import (
    WeightListener,
    experience,
    export_weights,
    init_transfer,
    logprobs,
    push_weights,
    random_sequences,
    reference_logprobs,
    signed_advantages,
    start_learner,
    start_rollout,
    wait_gone,
)

TRAIN_BATCH = 4
MICRO_FORWARD = 2


def learner_args(model_dir) -> list[str]:
    return ["--pretrain", str(model_dir), "--num_gpus", "2", "--zero_stage", "3", "--packing_samples",
            "--train_batch_size", str(TRAIN_BATCH), "--micro_train_batch_size", "2", "--micro_forward_batch_size",
            str(MICRO_FORWARD), "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--max_ckpt_num", "2"]


@pytest.fixture(scope="module")
def learner_slot(tmp_path_factory, tiny_model_dir):
    slot: dict = {"proc": None}
    yield slot
    if slot["proc"] is not None:
        slot["proc"].stop()


@pytest.fixture
def learner(learner_slot, tmp_path_factory, tiny_model_dir):
    """The module's running learner; a new one when the last was killed (the checkpoint test)."""
    proc = learner_slot["proc"]
    if proc is None or proc.popen.poll() is not None:
        if proc is not None:
            proc.stop()
        learner_slot["proc"] = start_learner(tmp_path_factory.mktemp("learner_z3"), *learner_args(tiny_model_dir))
    return learner_slot["proc"]


def train_once(stub, vocab: int, seed: int) -> None:
    """One TrainActor call, so that the weights differ from the initial ones whatever ran before."""
    seqs, starts = random_sequences(TRAIN_BATCH, vocab, seed=seed)
    batch = experience(seqs, starts, old_logprobs=logprobs(stub, seqs, starts),
                       advantages=signed_advantages(seqs, starts))
    stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=seed, loss=pb.ActorLoss(eps_clip_low=10.0)),
                    timeout=300)


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_logprobs_equal_a_plain_transformers_forward(learner, plain_model, tmp_path):
    # The plain model holds the learner's weights as they are now (other tests train them).
    export_weights(learner.stub, tmp_path / "export")
    current = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    # 5 samples over 2 ranks: one rank runs a pass with no samples of its own (ZeRO-3 needs it).
    seqs, starts = random_sequences(5, plain_model.config.vocab_size, seed=11)
    got = logprobs(learner.stub, seqs, starts)
    want = reference_logprobs(current, seqs, starts, world=2, micro=MICRO_FORWARD)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # Packed passes, with the same filler pass on the rank without samples: equal to rounding.
    for p, w in zip(logprobs(learner.stub, seqs, starts, packed=True), want):
        torch.testing.assert_close(p, w, atol=1e-5, rtol=0)


def test_values_need_a_critic(learner, plain_model):
    seqs, starts = random_sequences(2, plain_model.config.vocab_size, seed=12)
    with pytest.raises(grpc.RpcError) as info:
        learner.stub.Values(pb.ValuesRequest(input_ids=ragged_to_proto(seqs), response_start=to_proto(starts)),
                            timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--critic_pretrain" in info.value.details()


def test_training_lowers_the_loss_and_moves_every_parameter(learner, plain_model, tiny_model_dir, tmp_path):
    stub = learner.stub
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=13)
    old = logprobs(stub, seqs, starts)
    batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
    losses = []
    for call in range(5):
        r = stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=call, max_epochs=2,
                                                 loss=pb.ActorLoss(eps_clip_low=10.0)), timeout=300)
        assert (r.optimizer_steps, r.skipped_steps) == (2, 0)
        losses.append(r.policy_loss)
    assert losses[-1] < losses[0] - 0.1, losses
    trained = export_weights(stub, tmp_path / "export")  # gathered from the ZeRO-3 partitions
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    unmoved = [name for name in initial if torch.equal(initial[name], trained[name])]
    assert trained.keys() == initial.keys() and not unmoved, unmoved


def test_train_actor_measures_the_entropy_of_the_logits_it_trains_on(learner, tmp_path):
    """No entropy term, --logprobs_head full: the learner still reports the policy's entropy, taken from
    the logits it has; one optimizer step's token mean equals a plain forward pass of its weights."""
    export_weights(learner.stub, tmp_path / "export")
    current = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    seqs, starts = random_sequences(TRAIN_BATCH, current.config.vocab_size, seed=14)
    with torch.no_grad():
        want = torch.cat([rl_math.entropy_from_logits(current(s[None]).logits[0, int(st) - 1:-1])
                          for s, st in zip(seqs, starts)]).mean().item()
    batch = experience(seqs, starts, old_logprobs=logprobs(learner.stub, seqs, starts),
                       advantages=signed_advantages(seqs, starts))
    r = learner.stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=0, loss=pb.ActorLoss(eps_clip_low=10.0)),
                                timeout=300)
    assert r.optimizer_steps == 1 and want > 1.0
    assert r.entropy == pytest.approx(want, rel=1e-4)


def test_push_weights_gathers_partitions_bit_exact(learner, tmp_path):
    listener = WeightListener(tmp_path)
    try:
        init_transfer(learner.stub, listener)
        done, chunks, checksum, received = push_weights(learner.stub, listener, version=2,
                                                        dtype=common_pb2.DTYPE_FLOAT32, bucket_bytes=300_000)
    finally:
        listener.close()
    assert chunks == 1 and done.num_buckets >= 3 and done.weights_checksum == checksum
    trained = export_weights(learner.stub, tmp_path / "export")
    assert received.keys() == trained.keys()
    assert all(torch.equal(received[name], tensor) for name, tensor in trained.items())


def test_push_weights_into_the_rollout_service(learner, plain_model, tiny_model_dir, tmp_path):
    """The conversation a coordinator runs: InitWeightTransfer on both sides at once, then each
    PushWeights chunk forwarded to the engine's UpdateWeights; the engine ends with the checksum
    the learner sent (the rollout service's transformers engine: no vLLM start-up needed)."""
    train_once(learner.stub, plain_model.config.vocab_size, seed=15)  # weights unlike the engine's initial ones
    rollout = start_rollout(tmp_path, tiny_model_dir)
    try:
        engine = rollout_pb2_grpc.RolloutServiceStub(rollout.channel)
        before = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30)
        port = get_free_port()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            joined = pool.submit(engine.InitWeightTransfer, rollout_pb2.InitWeightTransferRequest(
                backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
                rank_offset=1, timeout_s=120), timeout=180)
            learner.stub.InitWeightTransfer(pb.InitWeightTransferRequest(
                backend=rollout_pb2.WEIGHT_BACKEND_GLOO, master_address="127.0.0.1", master_port=port, world_size=2,
                timeout_s=120), timeout=180)
            assert list(joined.result().ranks) == [1]
            requests: queue.Queue = queue.Queue()
            requests.put(pb.PushWeightsRequest(start=pb.PushWeightsStart(
                version=before.weight_version + 1, weights_dtype=before.weights_dtype, bucket_bytes=300_000,
                buckets_per_chunk=2)))
            replies, done = [], None
            for response in learner.stub.PushWeights(iter(requests.get, None), timeout=300):
                if response.HasField("done"):
                    done = response.done
                    requests.put(None)
                    continue
                update = response.chunk.update
                replies.append(pool.submit(engine.UpdateWeights, update, timeout=300).result())
                requests.put(pb.PushWeightsRequest(ack=pb.PushWeightsAck(chunk_index=update.chunk_index)))
        after = engine.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30)
    finally:
        rollout.stop()
    assert len(replies) >= 2 and replies[-1].weights_checksum == done.weights_checksum
    assert after.weight_version == done.version and after.weights_checksum == done.weights_checksum
    assert after.weights_checksum != before.weights_checksum  # the trained weights, not the initial ones


def test_checkpoint_survives_a_killed_service(learner, plain_model, tiny_model_dir, tmp_path):
    """save -> train -> kill -9 -> new service -> load -> train again: the same losses, to the bit."""
    stub, ckpt = learner.stub, tmp_path / "ckpt"
    vocab = plain_model.config.vocab_size
    seqs, starts = random_sequences(2 * TRAIN_BATCH, vocab, seed=14)
    old = logprobs(stub, seqs, starts)
    batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
    request = pb.TrainActorRequest(batch=batch, shuffle_seed=99, loss=pb.ActorLoss(eps_clip_low=0.1))
    for step in (1, 2, 3):
        stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=step), timeout=300)
        saved = stub.SaveCheckpoint(pb.SaveCheckpointRequest(ckpt_path=str(ckpt), global_step=step,
                                                             client_state=f"state {step}".encode()), timeout=300)
    assert saved.removed == [str(ckpt / "global_step_1")]  # --max_ckpt_num 2
    # The marker says the learner made the folder (services.common.ownership).
    assert sorted(p.name for p in ckpt.iterdir()) == [".rlmesh-learner", "global_step_2", "global_step_3"]
    uninterrupted = stub.TrainActor(request, timeout=300)
    step_before = stub.GetInfo(pb.GetInfoRequest(), timeout=10).actor_global_step

    workers = learner.worker_pids()
    learner.popen.send_signal(signal.SIGKILL)
    learner.popen.wait(30)
    assert not wait_gone(workers, 30), "rank 1 outlived rank 0"

    restarted = start_learner(tmp_path, *learner_args(tiny_model_dir))
    try:
        loaded = restarted.stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(ckpt)), timeout=300)
        assert (loaded.global_step, loaded.client_state) == (3, b"state 3")
        replayed = restarted.stub.TrainActor(request, timeout=300)
        assert replayed.policy_loss == uninterrupted.policy_loss
        assert replayed.grad_norm == uninterrupted.grad_norm and replayed.clip_ratio == uninterrupted.clip_ratio
        assert replayed.actor_global_step == uninterrupted.actor_global_step == step_before

        # A failure on one rank fails the call with that rank's error, and the learner stops.
        broken = tmp_path / "broken"
        shutil.copytree(ckpt / "global_step_3", broken / "global_step_3")
        shards = [p for p in (broken / "global_step_3" / "actor").iterdir() if "rank_1_" in p.name]
        assert shards
        for shard in shards:
            shard.write_bytes(b"not a checkpoint")
        workers = restarted.worker_pids()
        with pytest.raises(grpc.RpcError) as info:
            restarted.stub.LoadCheckpoint(pb.LoadCheckpointRequest(ckpt_path=str(broken)), timeout=120)
        assert info.value.code() == grpc.StatusCode.INTERNAL and info.value.details().startswith("rank 1:")
        assert restarted.popen.wait(60) == 3
        assert not wait_gone(workers, 30)
    finally:
        restarted.stop()
