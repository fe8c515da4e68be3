"""What a CUDA learner does once at start-up so that step 1 runs as fast as the later steps.

The first forward pass on a device loads the kernels it uses (CUDA loads modules lazily), creates
the cuBLAS handles and chooses their algorithms, and compiles the Triton kernel of the fused
log-probs head; on an H200 this made step 1's log-probs pass seconds slower than the next ones.
Here every forward path a step takes (the log-probs pass, the training head, the critic's values)
runs once without gradients on two short dummy samples, padded and packed as the config asks, and
the weight push's on-device digest kernel (Triton) is compiled on two dummy buckets: step 1's push
took 0.37 s on the learner's side against 0.08 s later.
Nothing is trained and no state changes: the passes run under no_grad, and under ZeRO-3 every rank
runs the same passes (their parameter gathers are collective).

Then the objects alive after start-up are frozen out of the garbage collector's reach (gc.freeze):
DeepSpeed's offload runs a full collection every time, which over that heap was most of an offload.
Frozen objects are never collected, also if they later become unreachable cycles; the learner
builds its engines once, so what is frozen lives as long as the process.

The other first-use costs are moved elsewhere: the host buffers of the states are page-locked by
the offload before step 1 (host_offload.py), and the coordinator puts colocated engines to sleep
before step 1 (their first sleep page-locks vLLM's host copy of the weights).
"""

from __future__ import annotations

import gc
import time

import torch

from services.common import weights
from services.learner.batches import Sample, collate

_TOKENS = 96  # per dummy sample; half prompt, half response


def _dummy_samples(vocab_size: int, max_len: int) -> list[Sample]:
    n = max(4, min(_TOKENS, max_len))
    samples = []
    for length in (n, n - n // 4):
        ids = torch.arange(length, dtype=torch.int64) % vocab_size
        samples.append(Sample(ids, length // 2, {}))
    return samples


def freeze_heap() -> None:
    """Moves every object alive after start-up (the modules, the model's and DeepSpeed's structures:
    ~0.5 million objects for a 0.5B model) out of the garbage collector's reach. DeepSpeed's
    offload_states runs a full gc.collect at every offload: over that heap it took 0.45 s each time
    on an H200's host, most of an offload; over what a step leaves it takes about a millisecond."""
    gc.collect()
    gc.freeze()


def warm_up(rank) -> float:
    """Runs the forward paths of a step once on dummy samples; returns the seconds."""
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
        weights.warm_up_bucket_sums(rank.device)
    torch.cuda.synchronize(rank.device)
    return time.monotonic() - t0
