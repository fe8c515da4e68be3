"""The weight checksum on a CUDA GPU (skipped without one): the Triton row sums give the digests of
the written definition (computed on the CPU), for lone tensors and for a bucket of 290 parameters
packed like a 0.5B model's, including values whose sums wrap and a bucket that ends inside a row."""

import torch

from services.common import weights


def test_gpu_digests_equal_the_cpu_definition():
    assert weights._row_sums_kernel() is not None  # Triton is part of every CUDA install we support
    g = torch.Generator().manual_seed(0)
    lone = {"small.bf16": torch.randn(3, 5, generator=g).bfloat16(), "mid.f32": torch.randn(1001, 77, generator=g),
            "wraps": torch.full((1 << 20,), -3e38), "odd.f16": torch.randn(7, generator=g).half()}
    for name, t in lone.items():
        assert weights.tensor_digest(t.cuda()) == weights.tensor_digest(t), name
    shapes = [(15193, 896)] + [(896, 896), (128, 896), (128, 896), (896, 896), (486, 896), (486, 896), (896, 486),
                               (896,), (896,), (128,), (128,), (896,)] * 24 + [(3,)]
    named = {f"p{i}": torch.randn(s, generator=g).bfloat16() for i, s in enumerate(shapes)}
    slots, sizes = weights.plan_buckets([(n, t.dtype, t.shape) for n, t in named.items()], 64 << 20)
    on_gpu = {n: t.cuda() for n, t in named.items()}
    for bucket, members in enumerate(weights.bucket_members(slots, len(sizes))):
        buffer = weights.pack_bucket(on_gpu, members, sizes[bucket], "cuda")
        assert weights.bucket_digests(buffer, members) == weights.bucket_digests(buffer.cpu(), members), bucket
