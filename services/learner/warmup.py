"""What a CUDA learner does once at start-up so that step 1 runs as fast as the later steps.

The first forward pass on a device loads the kernels it uses (CUDA loads modules lazily), creates
the cuBLAS handles and chooses their algorithms, and compiles the Triton kernel of the fused
log-probs head; on an H200 this made step 1's log-probs pass seconds slower than the next ones.
Here every forward path a step takes (the log-probs pass, the training head, the critic's values)
runs once without gradients on two short dummy samples, padded and packed as the config asks.
Nothing is trained and no state changes: the passes run under no_grad, and under ZeRO-3 every rank
runs the same passes (their parameter gathers are collective).

The other first-use costs are moved elsewhere: the host buffers of the states are page-locked by
the offload before step 1 (host_offload.py), and the coordinator puts colocated engines to sleep
before step 1 (their first sleep page-locks vLLM's host copy of the weights).
"""

from __future__ import annotations

import time

import torch

from services.learner.batches import Sample, collate

_TOKENS = 96  # per dummy sample; half prompt, half response


def _dummy_samples(vocab_size: int, max_len: int) -> list[Sample]:
    n = max(4, min(_TOKENS, max_len))
    samples = []
    for length in (n, n - n // 4):
        ids = torch.arange(length, dtype=torch.int64) % vocab_size
        samples.append(Sample(ids, length // 2, {}))
    return samples


def warm_up(rank) -> float:
    """Runs the forward paths of a step once on dummy samples (CUDA only); returns the seconds."""
    if rank.device.type != "cuda":
        return 0.0
    t0 = time.monotonic()
    samples = _dummy_samples(rank.vocab_size, rank.max_len)
    rank.logprobs({"micro_batches": [samples], "passes": 1, "temperature": 1.0})
    packed = bool(rank.config.packing_samples)
    mb = collate(samples, packed=packed).to(rank.device)
    with torch.no_grad():
        rank.actor.train()
        rank.actor_outputs(mb, 1.0, want_entropy=False)
        if rank.critic is not None:
            rank.values({"micro_batches": [samples], "passes": 1, "temperature": 1.0})
    torch.cuda.synchronize(rank.device)
    return time.monotonic() - t0
