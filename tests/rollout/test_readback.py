"""The arithmetic of reading weights back (services/rollout/readback.py, held_weights.py), without an
engine: shares of a tensor, split as tensor-parallel workers hold them, add up to the tensor's digest;
the verdict names what differs; zeros travel and are digested as +0.0. The engines themselves are
tested in test_push_logprobs.py."""

from __future__ import annotations

import pytest
import torch

from services.common import weights
from services.rollout.held_weights import HeldWeightsError, held_digests
from services.rollout.readback import Sums, Unverifiable, digest_bytes


def digest_of(shares, shape) -> bytes:
    """The digest from (piece, row, col) shares, as the engine adds the workers' sums."""
    total = Sums()
    for piece, row, col in shares:
        part = Sums()
        part.add(piece, row, col, shape)
        total.a, total.b = (total.a + part.a) % 2 ** 64, (total.b + part.b) % 2 ** 64
        total.count += part.count
    assert total.count == torch.Size(shape).numel()
    return digest_bytes(total.a, total.b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shares_add_up_to_the_tensor_digest(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(dtype)  # a fused qkv: q 64 rows, k 16, v 16
    w[3, 5], w[70, 8] = -0.0, 0.0  # digested as +0.0 both
    expected = weights.tensor_digest(w)
    # Column-parallel over 2 workers, each holding its half of q, k and v.
    halves = [(w[r0 + h * n // 2: r0 + (h + 1) * n // 2], r0 + h * n // 2, 0)
              for r0, n in ((0, 64), (64, 16), (80, 16)) for h in (0, 1)]
    assert digest_of(halves, w.shape) == expected
    # Row-parallel over 4 workers (columns split), and an identity probe's column blocks of 16.
    assert digest_of([(w[:, c:c + 16], 0, c) for c in range(0, 64, 16)], w.shape) == expected
    # Vocabulary rows split unevenly (the last worker's padding rows are not counted).
    assert digest_of([(w[:50], 0, 0), (w[50:], 50, 0)], w.shape) == expected


def test_one_dimensional_tensors_and_odd_tails():
    g = torch.Generator().manual_seed(1)
    for n in (7, 96, 1):
        bias = torch.randn(n, generator=g).bfloat16()
        first = (n // 2) // 2 * 2  # a share starts on a 4-byte word
        shares = ([(bias[:first], 0, 0)] if first else []) + [(bias[first:], first, 0)]
        assert digest_of(shares, bias.shape) == weights.tensor_digest(bias)


def test_a_share_off_the_words_cannot_be_verified():
    w = torch.randn(10, 6).bfloat16()
    with pytest.raises(Unverifiable, match="4-byte words"):
        Sums().add(w[5:, :3], 5, 0, w.shape)  # 3 bf16 columns end inside a word, mid-row


def test_zeros_are_sent_and_digested_as_positive_zero():
    t = {"w": torch.tensor([[-0.0, 1.5], [2.0, -3.0]])}
    slots, sizes = weights.plan_buckets([("w", torch.bfloat16, (2, 2))])
    sent = weights.unpack_bucket(weights.pack_bucket(t, slots, sizes[0], "cpu"), slots)[0][1]
    assert not torch.signbit(sent[0, 0]) and torch.signbit(sent[1, 1])
    assert weights.tensor_digest(torch.tensor([-0.0, 1.0])) == weights.tensor_digest(torch.tensor([0.0, 1.0]))
    assert weights.tensor_digest(torch.tensor([-1.0])) != weights.tensor_digest(torch.tensor([1.0]))


def report(loaded: dict, held: dict, tied=None, shared=None, warnings=()) -> dict:
    return {"loaded": loaded, "held": held, "tied": tied or {}, "unverified": {}, "shared": shared or {},
            "reload_warnings": list(warnings)}


def half_sums(t: torch.Tensor, half: int) -> list:
    """One of two workers' shares of t's digest: rows [0, n/2) or [n/2, n)."""
    n = t.shape[0] // 2
    s = Sums()
    s.add(t[half * n:(half + 1) * n], half * n, 0, t.shape)
    return [digest_bytes(s.a, s.b).hex(), s.count]


def test_the_verdict_adds_workers_and_names_what_differs():
    g = torch.Generator().manual_seed(2)
    embed, norm = torch.randn(8, 4, generator=g), torch.randn(4, generator=g)
    loaded = {"model.embed_tokens.weight": [weights.tensor_digest(embed).hex(), "float32", [8, 4]],
              "model.norm.weight": [weights.tensor_digest(norm).hex(), "float32", [4]]}
    whole_norm = [weights.tensor_digest(norm).hex(), 4]
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    workers = [report(loaded, {"model.embed_tokens.weight": half_sums(embed, 0), "model.norm.weight": whole_norm,
                               "lm_head.weight": half_sums(embed, 0)}, tied=tied),
               report(loaded, {"model.embed_tokens.weight": half_sums(embed, 1), "lm_head.weight": half_sums(embed, 1)},
                      tied=tied)]
    held, unverified = held_digests(workers, "engine")
    assert held == {n: d for n, (d, _, _) in loaded.items()} and unverified == {}

    stale = embed.clone()
    stale[5] += 1  # the second worker's head still holds an old row
    workers[1]["held"]["lm_head.weight"] = half_sums(stale, 1)
    workers[1]["reload_warnings"] = ["ParallelLMHead: Failed to load weights", "something else"]
    with pytest.raises(HeldWeightsError) as exc:
        held_digests(workers, "the test engine")
    message = str(exc.value)
    assert "the test engine does not compute with the weights it was given: 1 tensors" in message
    assert "lm_head.weight (tied to model.embed_tokens.weight, holds other values)" in message
    assert "(vLLM said while loading: ParallelLMHead: Failed to load weights)" in message

    del workers[1]["held"]["model.embed_tokens.weight"]  # a worker that read only half of it
    workers[1]["held"]["lm_head.weight"] = half_sums(embed, 1)
    with pytest.raises(HeldWeightsError, match=r"model.embed_tokens.weight \(its shares on the workers cover 16 of "
                                               r"its 32 elements\)"):
        held_digests(workers, "engine")
