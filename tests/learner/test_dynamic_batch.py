"""--use_dynamic_batch: micro-batches sized by tokens train the same model as micro-batches of a fixed
number of samples. Two learner services, two CPU ranks each (gloo), ZeRO-2, packed samples, from the
same model and data: one with 2 samples per micro-batch (gradient accumulation 2), one whose token
budget holds a rank's whole share in one micro-batch (fewer passes than the accumulation steps
DeepSpeed is configured with): the losses, gradient norms and weights after two calls agree, and
the second took half the forward/backward passes. Its packed LogProbs fill the same token budget."""

import concurrent.futures
import urllib.request

import torch

from rlmesh.learner.v1 import learner_pb2 as pb
from tests.learner.learner_helpers import (
    experience,
    export_weights,
    logprobs,
    random_sequences,
    signed_advantages,
    start_learner,
)

TRAIN_BATCH = 8
COMMON = ("--num_gpus", "2", "--zero_stage", "2", "--train_batch_size", str(TRAIN_BATCH), "--micro_train_batch_size",
          "2", "--packing_samples", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--metrics_port", "0")


def counter(learner, series: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{learner.info['metrics_port']}/metrics", timeout=10).read().decode()
    line = next((line for line in text.splitlines() if line.startswith(series + " ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def micro_batches(learner) -> float:
    return counter(learner, 'rlmesh_learner_micro_batches_total{model="actor"}')


def logprob_passes(learner) -> float:
    return counter(learner, 'rlmesh_learner_forward_passes_total{method="LogProbs"}')


def test_token_sized_micro_batches_train_the_same_model(tmp_path, tiny_model_dir):
    flags = {"fixed": (), "dynamic": ("--use_dynamic_batch", "--train_max_tokens_per_gpu", "4096")}
    for name in flags:
        (tmp_path / name).mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once
        starts = {name: pool.submit(start_learner, tmp_path / name, "--pretrain", str(tiny_model_dir), *COMMON, *extra)
                  for name, extra in flags.items()}
        learners = {name: future.result() for name, future in starts.items()}
    try:
        seqs, starts = random_sequences(2 * TRAIN_BATCH, 600, seed=11)
        old = logprobs(learners["fixed"].stub, seqs, starts)
        batch = experience(seqs, starts, old_logprobs=old, advantages=signed_advantages(seqs, starts))
        replies = {name: [] for name in learners}
        for call in range(2):
            for name, learner in learners.items():
                replies[name].append(learner.stub.TrainActor(pb.TrainActorRequest(batch=batch, shuffle_seed=call),
                                                             timeout=300))
        for fixed, dynamic in zip(replies["fixed"], replies["dynamic"]):
            assert (fixed.optimizer_steps, dynamic.optimizer_steps) == (2, 2)
            assert dynamic.tokens == fixed.tokens
            assert abs(dynamic.policy_loss - fixed.policy_loss) <= 1e-5 * max(1.0, abs(fixed.policy_loss))
            assert abs(dynamic.grad_norm - fixed.grad_norm) <= 1e-4 * fixed.grad_norm  # a loss scaled wrong shows here
        # 2 calls x 2 optimizer steps x 2 ranks: one pass per rank and step against two of 2 samples.
        assert (micro_batches(learners["fixed"]), micro_batches(learners["dynamic"])) == (16.0, 8.0)
        # Packed log-probs under the token budget: 48 samples of < 20 tokens in one pass per rank;
        # without a budget, passes of 8 samples (the default --micro_forward_batch_size), as padded.
        # Packed and padded log-probs of the same weights agree to rounding.
        seqs, starts = random_sequences(48, 600, seed=12)
        for name, learner in learners.items():
            padded = logprobs(learner.stub, seqs, starts)
            before = logprob_passes(learner)
            packed = logprobs(learner.stub, seqs, starts, packed=True)
            assert logprob_passes(learner) - before == {"fixed": 6.0, "dynamic": 2.0}[name]
            assert [p.numel() for p in packed] == [p.numel() for p in padded]
            for p, q in zip(packed, padded):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
        weights = {name: export_weights(learner.stub, tmp_path / f"export-{name}") for name, learner in learners.items()}
        for key, value in weights["fixed"].items():
            # Adam moves a weight ~lr (1e-3) per step whatever its gradient's size, so a gradient at
            # float32 noise level (summed in another order) may move one by a few 1e-5: 1e-4 allowed.
            torch.testing.assert_close(weights["dynamic"][key], value, atol=1e-4, rtol=0)
    finally:
        for learner in learners.values():
            learner.stop()
