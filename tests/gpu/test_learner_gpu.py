"""The learner service on one GPU (nccl, bf16): training with the fast paths (fused AdamW, packing
with varlen FlashAttention, the fused log-prob head, liger kernels when installed, gradient
checkpointing), Offload / Reload of DeepSpeed states, and PushWeights over CUDA IPC to a listener
process on the same GPU; the fused head's Triton kernel and the varlen attention against their
plain torch counterparts. Skipped without CUDA (tests/conftest.py)."""

import importlib.util

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.common.v1 import common_pb2
from rlmesh.learner.v1 import learner_pb2 as pb
from rlmesh.rollout.v1 import rollout_pb2
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

TRAIN_BATCH = 8


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tiny_model_dir):
    proc = start_learner(
        tmp_path_factory.mktemp("learner_gpu"), "--pretrain", str(tiny_model_dir), "--num_gpus", "1", "--bf16",
        "--zero_stage", "2", "--train_batch_size", str(TRAIN_BATCH), "--micro_train_batch_size", "4",
        "--packing_samples", "--attn_implementation", "varlen", "--logprobs_head", "fused", "--gradient_checkpointing",
        "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0",
        *(["--use_liger_kernel"] if importlib.util.find_spec("liger_kernel") else []))
    yield proc
    proc.stop()


def test_logprobs_match_transformers_on_the_gpu(learner, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    seqs, starts = random_sequences(6, model.config.vocab_size, seed=21)
    got = logprobs(learner.stub, seqs, starts)
    want = reference_logprobs(model, seqs, starts, world=1, micro=8)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=0)  # bf16 weights, float32 log-softmax


def test_training_lowers_the_loss(learner, tiny_model_dir):
    info = learner.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert (info.dist_backend, info.dtype) == ("nccl", "bfloat16")
    seqs, starts = random_sequences(TRAIN_BATCH, info.vocab_size, seed=22)
    old = logprobs(learner.stub, seqs, starts)
    batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
    losses = [learner.stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=i, max_epochs=2,
                                                           loss=pb.ActorLoss(eps_clip_low=10.0)),
                                      timeout=300).policy_loss for i in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_offload_frees_and_reload_restores(learner):
    assert learner.stub.Offload(pb.OffloadRequest(), timeout=120).moved
    with pytest.raises(grpc.RpcError) as info:
        learner.stub.ExportHF(pb.ExportHFRequest(output_dir="/nonexistent"), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert learner.stub.Reload(pb.ReloadRequest(), timeout=120).moved
    seqs, starts = random_sequences(TRAIN_BATCH, 600, seed=23)
    old = logprobs(learner.stub, seqs, starts)
    r = learner.stub.TrainActor(pb.TrainActorRequest(batch=experience(
        seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))), timeout=300)
    assert r.optimizer_steps == 1 and r.tokens == sum(response_lengths(seqs, starts))


def test_push_weights_over_cuda_ipc(learner, tmp_path):
    listener = WeightListener(tmp_path, ipc=True)
    try:
        init_transfer(learner.stub, listener, backend=rollout_pb2.WEIGHT_BACKEND_IPC)
        done, chunks, checksum, received = push_weights(learner.stub, listener, version=3,
                                                        dtype=common_pb2.DTYPE_BFLOAT16, bucket_bytes=200_000)
    finally:
        listener.close()
    assert chunks == done.num_buckets >= 3  # ipc: one bucket per chunk by default
    assert done.weights_checksum == checksum
    trained = export_weights(learner.stub, tmp_path / "export")
    assert all(torch.equal(received[name], tensor.to(torch.bfloat16)) for name, tensor in trained.items())


def test_fused_head_kernel_matches_torch():
    from services.learner.logprob_head import _logprobs_and_grad_torch_, logprobs_and_grad_, triton_available

    assert triton_available()
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab, temperature in ((151936, 1.0), (1000, 0.7)):
        z = (torch.randn(300, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        y = torch.randint(0, vocab, (300,), device="cuda", generator=g)
        ref_z = z.clone()
        ref = _logprobs_and_grad_torch_(ref_z, y, 1 / temperature)
        got = logprobs_and_grad_(z, y, 1 / temperature)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(z.float(), ref_z.float(), atol=1e-3, rtol=1e-2)  # bf16 storage


def test_varlen_flash_attention_matches_sdpa_forward_and_backward():
    from services.learner.varlen_attention import _sdpa_per_sequence, _flash_varlen, cumulative_lengths

    lengths = [700, 1, 1500, 33]
    n = sum(lengths)
    cu = cumulative_lengths(lengths, "cuda")
    torch.manual_seed(0)
    q = torch.randn(n, 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out_grad = torch.randn(n, 14, 64, device="cuda", dtype=torch.bfloat16)
    got = _flash_varlen(q, k, v, cu, max(lengths), 0.125)
    grads = torch.autograd.grad(got, (q, k, v), out_grad)
    ref = _sdpa_per_sequence(q, k, v, cu, 0.125)
    ref_grads = torch.autograd.grad(ref, (q, k, v), out_grad)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
