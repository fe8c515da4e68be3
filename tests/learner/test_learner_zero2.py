"""The learner service with two CPU ranks (gloo), ZeRO-2, an actor and a critic, over gRPC; with
gradient checkpointing, log-probs from the hidden states (--logprobs_head fused) and a cosine LR schedule.

One service process (rank 0 starting rank 1) serves every test of this module (its start is most
of the module's time). The tests pass alone and in any order: each trains, pushes or counts what it
asserts on, and compares against the learner's weights, steps and counters as they are when it starts.
"""

import math
import time
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2 as pb
from services.common.tensors import ragged_from_proto, ragged_to_proto, to_proto
from services.learner.deepspeed_setup import lr_multiplier
from services.reward.reference import ReferenceModel
from tests.learner.learner_helpers import (
    WeightListener,
    experience,
    export_weights,
    init_transfer,
    logprobs,
    push_weights,
    random_sequences,
    reference_logprobs,
    response_lengths,
    signed_advantages,
    start_learner,
)

LR = 2e-3
TRAIN_BATCH = 4
MICRO_FORWARD = 3


@pytest.fixture(scope="module")
def started(tmp_path_factory, tiny_model_dir, tiny_reward_model_dir):
    """The module's learner and its GetInfo as it started, before any test trained or pushed."""
    proc = start_learner(
        tmp_path_factory.mktemp("learner_z2"), "--pretrain", str(tiny_model_dir), "--critic_pretrain",
        str(tiny_reward_model_dir), "--num_gpus", "2", "--zero_stage", "2", "--train_batch_size", str(TRAIN_BATCH),
        "--micro_train_batch_size", "1", "--micro_forward_batch_size", str(MICRO_FORWARD), "--actor_learning_rate",
        str(LR), "--critic_learning_rate", str(LR), "--gradient_checkpointing", "--lr_scheduler", "cosine_with_min_lr",
        "--max_steps", "1000", "--lr_warmup_ratio", "0.004", "--metrics_port", "0", "--logprobs_head", "fused")
    yield proc, proc.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    proc.stop()


@pytest.fixture(scope="module")
def learner(started):
    return started[0]


@pytest.fixture(scope="module")
def plain_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def metrics(learner) -> dict[str, float]:
    """The learner's Prometheus series, "name{labels}" -> value."""
    url = f"http://127.0.0.1:{learner.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    series = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in series}


def current_model(learner, folder) -> AutoModelForCausalLM:
    """The learner's actor as it is now (other tests train it), exported into folder."""
    export_weights(learner.stub, folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_get_info(started, plain_model):
    learner, at_start = started
    info = learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert (info.world_size, info.zero_stage, info.dtype, info.dist_backend) == (2, 2, "float32", "gloo")
    assert info.actor_num_parameters == sum(p.numel() for p in plain_model.parameters())
    assert info.critic_num_parameters > 0 and info.critic_pretrain
    assert info.vocab_size == plain_model.config.vocab_size
    # A fresh learner has trained nothing and pushed nothing.
    assert (at_start.actor_global_step, at_start.critic_global_step, at_start.weight_version) == (0, 0, 0)
    assert at_start.actor_num_parameters == info.actor_num_parameters and not at_start.offloaded


def test_logprobs_equal_a_plain_transformers_forward(learner, plain_model, tmp_path):
    current = current_model(learner, tmp_path / "export")
    seqs, starts = random_sequences(7, plain_model.config.vocab_size, seed=1)
    for temperature in (0.0, 0.7):
        got = logprobs(learner.stub, seqs, starts, temperature)
        want = reference_logprobs(current, seqs, starts, world=2, micro=MICRO_FORWARD,
                                  temperature=temperature or 1.0)
        assert [g.numel() for g in got] == response_lengths(seqs, starts)
        for g, w in zip(got, want):
            assert torch.equal(g, w)  # same micro-batches, same weights: bit for bit
    # The reference role batches the same way: the two services agree bit for bit.
    reference = ReferenceModel(str(tmp_path / "export"), device="cpu", dtype="fp32", micro_batch_size=MICRO_FORWARD)
    assert all(torch.equal(g, r) for g, r in zip(got, reference.response_logprobs(seqs, starts.tolist(), 0.7)))
    # And against one unpadded forward per sample (padding may move the last bits only); packed
    # passes (the training layout, its fused head) agree with it to rounding too.
    packed = logprobs(learner.stub, seqs, starts, 0.7, packed=True)
    with torch.no_grad():
        for g, p, s, st in zip(got, packed, seqs, starts):
            alone = torch.log_softmax(current(s[None]).logits[0, :-1].float() / 0.7, -1)
            alone = alone.gather(-1, s[1:, None])[:, 0][st - 1:]
            torch.testing.assert_close(g, alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(p, alone, atol=1e-5, rtol=0)


def _status(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=60)
    return info.value


def test_bad_input_is_rejected_naming_field_and_sample(learner, plain_model):
    stub, vocab = learner.stub, plain_model.config.vocab_size
    step = stub.GetInfo(pb.GetInfoRequest(), timeout=10).actor_global_step
    seqs, starts = random_sequences(TRAIN_BATCH, vocab, seed=2)
    old = logprobs(stub, seqs, starts)
    adv = signed_advantages(seqs, starts)

    def train(**changes):
        fields = {"old_logprobs": old, "advantages": adv, **changes}
        return _status(stub.TrainActor, pb.TrainActorRequest(batch=experience(seqs, starts, **fields)))

    short = [a.clone() for a in adv]
    short[2] = short[2][:-1]
    nan = [a.clone() for a in adv]
    nan[1][0] = float("nan")
    masks = [torch.ones(n) for n in response_lengths(seqs, starts)]
    masks[3] = torch.zeros_like(masks[3])
    cases = [
        (train(advantages=short), "batch.advantages of sample 2"),
        (train(advantages=nan), "batch.advantages of sample 1"),
        (train(action_mask=masks), "batch.action_mask of sample 3"),
        (_status(stub.TrainActor, pb.TrainActorRequest(batch=experience(seqs[:3], starts[:3], old_logprobs=old[:3],
                                                                        advantages=adv[:3]))), "train_batch_size"),
        (_status(stub.TrainActor, pb.TrainActorRequest(batch=experience(seqs, starts, advantages=adv))),
         "batch.old_logprobs"),
        (_status(stub.LogProbs, pb.LogProbsRequest(input_ids=ragged_to_proto([]),
                                                   response_start=to_proto(torch.zeros(0, dtype=torch.int64)))),
         "empty"),
        (_status(stub.LogProbs, pb.LogProbsRequest(input_ids=ragged_to_proto([torch.tensor([1, vocab + 5, 2])]),
                                                   response_start=to_proto(torch.tensor([1])))),
         "input_ids of sample 0"),
        (_status(stub.TrainActor, pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=old,
                                                                        advantages=adv),
                                                       loss=pb.ActorLoss(dual_clip=0.5))), "loss.dual_clip"),
    ]
    for error, needle in cases:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert needle in error.details() and "fix:" in error.details(), error.details()
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).actor_global_step == step  # nothing trained, still serving


def test_non_finite_loss_skips_the_step_and_keeps_the_weights(learner, plain_model):
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=3)
    before = logprobs(learner.stub, seqs, starts)
    # Finite advantages whose loss overflows float32: the gradient is not finite.
    huge = [torch.full((n,), 3e38) for n in response_lengths(seqs, starts)]
    r = learner.stub.TrainActor(pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=before,
                                                                      advantages=huge)), timeout=120)
    assert (r.skipped_steps, r.optimizer_steps) == (1, 0)
    after = logprobs(learner.stub, seqs, starts)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # Nor did the skipped step move the LR schedule: the next kept step applies the same rate.
    kept = learner.stub.TrainActor(pb.TrainActorRequest(batch=experience(
        seqs, starts, old_logprobs=before, advantages=signed_advantages(seqs, starts))), timeout=120)
    assert (kept.skipped_steps, kept.optimizer_steps) == (0, 1)
    assert kept.learning_rate == r.learning_rate


def test_training_lowers_the_loss_and_moves_every_parameter(learner, plain_model, tiny_model_dir, tmp_path):
    stub = learner.stub
    # The LR schedule moves on kept optimizer steps only: its position is the steps taken less those skipped.
    skipped = metrics(learner).get('rlmesh_learner_skipped_steps_total{model="actor"}', 0.0)
    position = stub.GetInfo(pb.GetInfoRequest(), timeout=10).actor_global_step - int(skipped)
    before = export_weights(stub, tmp_path / "before")
    seqs, starts = random_sequences(2 * TRAIN_BATCH, plain_model.config.vocab_size, seed=4)
    old = logprobs(stub, seqs, starts)
    batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
    losses, lrs = [], []
    for call in range(4):
        r = stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=call,
                                                 loss=pb.ActorLoss(eps_clip_low=10.0)), timeout=300)
        assert (r.optimizer_steps, r.skipped_steps) == (2, 0)
        assert r.tokens == sum(response_lengths(seqs, starts))
        assert math.isnan(r.entropy)  # the fused head never has the logits: not measured (not a 0.0)
        losses.append(r.policy_loss)
        lrs.append(r.learning_rate)
    assert losses[-1] < losses[0] - 0.1, losses
    # Cosine schedule with 4 warm-up steps (0.004 x 1000); each call reports the rate of its second
    # step: the first call's is position + 1, the fourth call's position + 7.
    warmup = 4
    assert lrs[0] == pytest.approx(LR * lr_multiplier(position + 1, warmup, 1000, "cosine_with_min_lr", 0.1), rel=1e-6)
    assert lrs[-1] == pytest.approx(LR * lr_multiplier(position + 7, warmup, 1000, "cosine_with_min_lr", 0.1),
                                    rel=1e-6)
    trained = export_weights(stub, tmp_path / "export")
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert trained.keys() == initial.keys() == before.keys()
    unmoved = [name for name in before if torch.equal(before[name], trained[name])]
    assert not unmoved, f"parameters that did not move: {unmoved}"
    # The export is a working Hugging Face folder.
    AutoTokenizer.from_pretrained(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, trained["lm_head.weight"])


def test_critic_training_lowers_the_value_loss(learner, plain_model):
    stub = learner.stub
    step = stub.GetInfo(pb.GetInfoRequest(), timeout=10).critic_global_step
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=5)
    request = pb.ValuesRequest(input_ids=ragged_to_proto(seqs), response_start=to_proto(starts))
    old_values = ragged_from_proto(stub.Values(request, timeout=60).values)
    assert [v.numel() for v in old_values] == response_lengths(seqs, starts)
    packed = ragged_from_proto(stub.Values(pb.ValuesRequest(input_ids=ragged_to_proto(seqs),
                                                            response_start=to_proto(starts), packed=True),
                                           timeout=60).values)
    for p, v in zip(packed, old_values):
        torch.testing.assert_close(p, v, atol=1e-5, rtol=0)
    returns = [torch.full((n,), 0.75) for n in response_lengths(seqs, starts)]
    batch = experience(seqs, starts, returns=returns, old_values=old_values)
    losses = [stub.TrainCritic(pb.TrainCriticRequest(batch=batch, shuffle_seed=i, value_clip=0.0),
                               timeout=300).value_loss for i in range(4)]
    assert losses[-1] < 0.5 * losses[0], losses
    new_values = ragged_from_proto(stub.Values(request, timeout=60).values)
    err = lambda vs: sum(float(((v - 0.75) ** 2).sum()) for v in vs)  # noqa: E731
    assert err(new_values) < err(old_values)
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).critic_global_step == step + 4


def test_push_weights_arrive_bit_exact_over_gloo(learner, tmp_path):
    listener = WeightListener(tmp_path)
    try:
        init_transfer(learner.stub, listener)
        # Small buckets, two per chunk: several UpdateWeights calls, several broadcasts each.
        done, chunks, checksum, received = push_weights(learner.stub, listener, version=7,
                                                        dtype=common_pb2.DTYPE_BFLOAT16, bucket_bytes=120_000,
                                                        buckets_per_chunk=2)
    finally:
        listener.close()
    assert chunks >= 2 and done.num_buckets >= 3
    assert done.weights_checksum == checksum and done.version == 7
    trained = export_weights(learner.stub, tmp_path / "export")
    assert received.keys() == trained.keys()
    for name, tensor in trained.items():
        assert received[name].dtype == torch.bfloat16
        assert torch.equal(received[name], tensor.to(torch.bfloat16)), name
    assert done.bytes == sum(t.numel() * 2 for t in trained.values())
    assert learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10).weight_version == 7


def test_a_push_to_a_vanished_engine_fails_and_the_learner_keeps_serving(learner, plain_model, tmp_path):
    version = learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10).weight_version
    listener = WeightListener(tmp_path)
    try:
        init_transfer(learner.stub, listener)
    finally:
        listener.close()  # the engine goes away after joining
    start = pb.PushWeightsRequest(start=pb.PushWeightsStart(version=version + 1, weights_dtype=common_pb2.DTYPE_FLOAT32))
    with pytest.raises(grpc.RpcError) as info:
        for _ in learner.stub.PushWeights(iter([start]), timeout=120):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "InitWeightTransfer" in info.value.details()
    with pytest.raises(grpc.RpcError) as again:
        list(learner.stub.PushWeights(iter([start]), timeout=60))
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    seqs, starts = random_sequences(3, plain_model.config.vocab_size, seed=7)
    assert len(logprobs(learner.stub, seqs, starts)) == 3  # still serving, ranks in step
    assert learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10).weight_version == version  # the failed push counts not


@pytest.mark.parametrize("rendezvous", ["new_port", "same_port"])
def test_a_push_whose_caller_died_mid_chunk_frees_the_learner_at_once(learner, tmp_path, rendezvous):
    """The coordinator takes a chunk and dies before any engine asks for it (UpdateWeights): the
    learner's broadcast waits for receivers that never come. It gives that broadcast up when the
    call goes, so a new group and push (the coordinator's rerun) run within seconds, not after the
    group's timeout (120 s here, 300 s in a run); also on the same rendezvous port (a fixed
    --weight_sync_master), which the abandoned group still holds: the learner keeps its store."""
    stale = WeightListener(tmp_path)
    try:
        init_transfer(learner.stub, stale)
        start = pb.PushWeightsRequest(start=pb.PushWeightsStart(version=20, weights_dtype=common_pb2.DTYPE_FLOAT32))
        call = learner.stub.PushWeights(iter([start]), timeout=300)
        assert next(call).HasField("chunk")  # the chunk is out; the "coordinator" now goes away
        call.cancel()
        t0 = time.monotonic()
        # A new group's name, as the coordinator gives each group one.
        fresh = (WeightListener(tmp_path, port=stale.port, group_name="rlmesh-weights-rerun")
                 if rendezvous == "same_port" else WeightListener(tmp_path))
        try:
            init_transfer(learner.stub, fresh)
            done, _, checksum, _ = push_weights(learner.stub, fresh, version=21)
        finally:
            fresh.close()
        seconds = time.monotonic() - t0
    finally:
        stale.close()
    assert done.version == 21 and done.weights_checksum == checksum
    assert seconds < 60, f"the new group and push took {seconds:.0f} s"
    assert learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10).weight_version == 21


def test_offload_blocks_model_calls_until_reload(learner, plain_model):
    seqs, starts = random_sequences(2, plain_model.config.vocab_size, seed=6)
    assert not learner.stub.Offload(pb.OffloadRequest(), timeout=60).moved  # CPU: nothing to move
    assert learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10).offloaded
    error = _status(learner.stub.LogProbs, pb.LogProbsRequest(input_ids=ragged_to_proto(seqs),
                                                              response_start=to_proto(starts)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "Reload" in error.details()
    learner.stub.Reload(pb.ReloadRequest(), timeout=60)
    assert len(logprobs(learner.stub, seqs, starts)) == 2


def test_metrics_report_training(learner, plain_model, tmp_path):
    """A rejected call, a skipped and a kept actor step, a critic step and a push: each moves its series."""
    stub = learner.stub
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=9)
    old = logprobs(stub, seqs, starts)
    lengths = response_lengths(seqs, starts)
    before = metrics(learner)
    error = _status(stub.TrainActor, pb.TrainActorRequest(batch=experience(seqs, starts, advantages=old)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # no old_logprobs
    huge = [torch.full((n,), 3e38) for n in lengths]
    for advantages in (huge, signed_advantages(seqs, starts)):
        stub.TrainActor(pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=old, advantages=advantages)),
                        timeout=120)
    old_values = ragged_from_proto(stub.Values(pb.ValuesRequest(input_ids=ragged_to_proto(seqs),
                                                                response_start=to_proto(starts)), timeout=60).values)
    stub.TrainCritic(pb.TrainCriticRequest(batch=experience(seqs, starts, returns=[torch.full((n,), 0.75) for n in lengths],
                                                            old_values=old_values)), timeout=300)
    listener = WeightListener(tmp_path)
    try:
        init_transfer(stub, listener)
        done, *_ = push_weights(stub, listener, version=30)
    finally:
        listener.close()
    after = metrics(learner)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('rlmesh_learner_errors_total{code="INVALID_ARGUMENT",method="TrainActor"}') == 1
    assert moved('rlmesh_learner_skipped_steps_total{model="actor"}') == 1
    assert moved('rlmesh_learner_tokens_trained_total{model="actor"}') >= sum(lengths)
    assert moved('rlmesh_learner_train_phase_duration_seconds_count{model="critic",phase="backward"}') > 0
    assert moved("rlmesh_learner_weight_push_bytes_total") == done.bytes > 0
    for gauge in ("rlmesh_learner_policy_loss", 'rlmesh_learner_learning_rate{model="actor"}',
                  'rlmesh_learner_grad_norm{model="critic"}'):
        assert any(name.startswith(gauge) for name in after), gauge


def test_gspo_trains_on_openrlhf_aggregation(learner, plain_model):
    """On-policy (ratio 1) the policy loss is -A aggregated: per sequence for the GSPO policy term
    (policy_loss_aggregation), per token for the KL term; over both ranks' micro-batches."""
    stub = learner.stub
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=8)
    lengths = response_lengths(seqs, starts)
    assert len(set(lengths)) > 1, lengths  # the two aggregations differ only with unequal lengths
    old = logprobs(stub, seqs, starts)
    adv_values = [0.5, -1.0, 2.0, 1.5]
    gaps = [0.1, 0.4, 0.2, 0.3]  # per sequence: ref = old - gap, so k1 = gap on every token
    advantages = [torch.full((n,), a) for n, a in zip(lengths, adv_values)]
    ref = [o - g for o, g in zip(old, gaps)]
    loss = pb.ActorLoss(policy_loss_type=pb.POLICY_LOSS_TYPE_GSPO, eps_clip_low=0.2, kl_coef=0.01,
                        kl_estimator=pb.KL_ESTIMATOR_K1, loss_aggregation=pb.LOSS_AGGREGATION_TOKEN_MEAN,
                        policy_loss_aggregation=pb.LOSS_AGGREGATION_SEQUENCE_MEAN)
    r = stub.TrainActor(pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=old, advantages=advantages,
                                                              ref_logprobs=ref), loss=loss), timeout=300)
    assert (r.optimizer_steps, r.skipped_steps) == (1, 0)
    tokens = sum(lengths)
    assert r.policy_loss == pytest.approx(-sum(adv_values) / len(adv_values), abs=1e-4)
    assert r.kl_loss == pytest.approx(sum(g * n for g, n in zip(gaps, lengths)) / tokens, abs=1e-4)
    # The token mean of the same policy term is a different number.
    assert abs(-sum(a * n for a, n in zip(adv_values, lengths)) / tokens - r.policy_loss) > 0.05


def test_export_of_the_critic(learner, tmp_path):
    """ExportHF(critic=True) (--save_value_network) writes the critic: one value per token."""
    from transformers import AutoModelForTokenClassification

    r = learner.stub.ExportHF(pb.ExportHFRequest(output_dir=str(tmp_path / "critic"), critic=True), timeout=300)
    critic = AutoModelForTokenClassification.from_pretrained(r.path, dtype=torch.float32)
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_importance_sampling_correction_weights_each_token_in_its_band(learner, plain_model, kind):
    """OpenRLHF's correction against the engine's log-probs, band [0.5, 5]: on-policy for the learner (ratio 1),
    the engine's ratio w = exp(old - rollout) is 0.25, 1, 3 and 8 on every token of the four samples.
    tis clamps w into the band (0.5, 1, 3, 5); icepop keeps it inside and zeroes it outside (0, 1, 3, 0).
    The policy loss is then -sum(w * A * tokens) / tokens over both ranks' micro-batches."""
    stub = learner.stub
    seqs, starts = random_sequences(TRAIN_BATCH, plain_model.config.vocab_size, seed=9)
    lengths = response_lengths(seqs, starts)
    old = logprobs(stub, seqs, starts)
    ratios, adv_values = [0.25, 1.0, 3.0, 8.0], [1.0, -1.0, 0.5, 2.0]
    weights = {"tis": [0.5, 1.0, 3.0, 5.0], "icepop": [0.0, 1.0, 3.0, 0.0]}[kind]
    rollout = [o - torch.log(torch.tensor(w)) for o, w in zip(old, ratios)]
    advantages = [torch.full((n,), a) for n, a in zip(lengths, adv_values)]
    loss = pb.ActorLoss(eps_clip_low=0.2, tis_low=0.5, tis_cap=5.0, is_correction_type={
        "tis": pb.IS_CORRECTION_TYPE_TIS, "icepop": pb.IS_CORRECTION_TYPE_ICEPOP}[kind])
    r = stub.TrainActor(pb.TrainActorRequest(batch=experience(seqs, starts, old_logprobs=old, advantages=advantages,
                                                              rollout_logprobs=rollout), loss=loss), timeout=300)
    assert (r.optimizer_steps, r.skipped_steps) == (1, 0)
    tokens = sum(lengths)
    assert r.policy_loss == pytest.approx(-sum(w * a * n for w, a, n in zip(weights, adv_values, lengths)) / tokens,
                                          abs=1e-4)
    assert r.tis_weight_mean == pytest.approx(sum(w * n for w, n in zip(weights, lengths)) / tokens, abs=1e-5)
    # rollout - old = -log w per token.
    assert r.rollout_kl == pytest.approx(-sum(math.log(w) * n for w, n in zip(ratios, lengths)) / tokens, abs=1e-5)
