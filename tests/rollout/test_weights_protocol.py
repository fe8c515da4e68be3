"""services/common/weights.py: bucket layout, packing, the checksum definition, and a gloo push
between two ranks, on CPU without any service."""

from __future__ import annotations

import hashlib
import struct
import threading

import pytest
import torch

from services.common import weights


def named_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.float16),
        "model.norm.weight": torch.randn(3, generator=g),
        "lm_head.weight": torch.randn(50, 8, generator=g),
    }


def test_plan_buckets_respects_the_size_and_alignment():
    tensors = named_tensors()
    slots, sizes = weights.plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=2000)
    assert [s.name for s in slots] == list(tensors)  # order kept
    assert all(s.offset % weights.ALIGN_BYTES == 0 for s in slots)
    # embed 1600 B @0, q bias 16 B @1600, up_proj 256 B @1664 (aligned), norm 12 B @1920: 1932 B in bucket 0;
    # lm_head (1600 B) would end at 3584 > 2000, so it opens bucket 1.
    assert [s.bucket for s in slots] == [0, 0, 0, 0, 1]
    assert [s.offset for s in slots] == [0, 1600, 1664, 1920, 0]
    assert sizes == [1932, 1600]
    weights.check_layout(slots, sizes)
    # A parameter larger than a bucket gets a bucket of its own.
    big, big_sizes = weights.plan_buckets([("a", torch.float32, (10,)), ("b", torch.float32, (1000,)),
                                           ("c", torch.float32, (10,))], bucket_bytes=100)
    assert [s.bucket for s in big] == [0, 1, 2] and big_sizes == [40, 4000, 40]


def test_pack_then_unpack_is_exact_for_every_dtype():
    tensors = named_tensors()
    slots, sizes = weights.plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=2000)
    for bucket, members in enumerate(weights.bucket_members(slots, len(sizes))):
        buffer = weights.pack_bucket(tensors, members, sizes[bucket], "cpu")
        assert buffer.dtype == torch.uint8 and buffer.numel() == sizes[bucket]
        for name, tensor in weights.unpack_bucket(buffer, members):
            assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name])


def test_check_layout_names_the_broken_parameter():
    slots = [weights.ParamSlot("a", torch.float32, (4,), 0, 0), weights.ParamSlot("b", torch.float32, (4,), 0, 0)]
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        weights.check_layout(slots, [64])
    with pytest.raises(ValueError, match="'b'.*run past the end"):
        weights.check_layout([slots[0], weights.ParamSlot("b", torch.float32, (20,), 0, 64)], [128])
    with pytest.raises(ValueError, match="'b'.*multiple of 64"):
        weights.check_layout([weights.ParamSlot("b", torch.float32, (1,), 0, 8)], [64])
    with pytest.raises(ValueError, match="'a'.*bucket 1 is out of range"):
        weights.check_layout([weights.ParamSlot("a", torch.float32, (1,), 1, 0)], [64])
    with pytest.raises(ValueError, match="'a'.*twice"):
        weights.check_layout([slots[0], slots[0]], [64])


def written_tensor_digest(t: torch.Tensor) -> bytes:
    """combine_digests' definition of a tensor digest, in plain Python integers."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 4)
    words = struct.unpack(f"<{len(raw) // 4}i", raw)
    a = sum(words) % 2 ** 64
    b = sum((i + 1) * w for i, w in enumerate(words)) % 2 ** 64
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")


def test_checksum_follows_its_written_definition():
    tensors = named_tensors()
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode() + b"\0" + str(t.dtype).removeprefix("torch.").encode() + b"\0"
                 + ",".join(map(str, t.shape)).encode() + b"\0" + written_tensor_digest(t))
    assert weights.weights_checksum(tensors.items()) == h.hexdigest()


def test_bucket_sums_equal_the_written_digest_of_every_parameter():
    # Odd byte counts (a bucket ending inside a 64-byte row, a parameter ending inside a word),
    # values whose sums wrap past 2**63, an empty tensor and a scalar, in buckets of every size.
    g = torch.Generator().manual_seed(3)
    tensors = {"odd.bf16": torch.randn(3, 5, generator=g).bfloat16(), "fp16": torch.randn(33, 17, generator=g).half(),
               "huge": torch.full((5000,), -3.0e38).float(), "empty": torch.zeros(0), "scalar": torch.tensor(1.5),
               "tail": torch.randn(7, generator=g).bfloat16()}
    for bucket_bytes in (64, 2000, 1 << 20):
        slots, sizes = weights.plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes)
        for bucket, members in enumerate(weights.bucket_members(slots, len(sizes))):
            buffer = weights.pack_bucket(tensors, members, sizes[bucket], "cpu")
            digests = weights.bucket_digests(buffer, members)
            assert digests == {s.name: written_tensor_digest(tensors[s.name]) for s in members}
            # The GPU's way of summing (row and column passes), run here on CPU tensors.
            on_device = weights.digests_from_sums(weights._device_bucket_sums(buffer, members), members)
            assert on_device == digests
    assert all(weights.tensor_digest(t) == written_tensor_digest(t) for t in tensors.values())
    # Two swapped words change B (A alone would not see it).
    words = tensors["huge"].clone().view(torch.int32)
    words[[3, 4]] = torch.tensor([7, 9], dtype=torch.int32)
    swapped = words.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    before, after = weights.tensor_digest(words), weights.tensor_digest(swapped)
    assert before[:8] == after[:8] and before[8:] != after[8:]


def test_checksum_ignores_order_and_sees_one_changed_bit_or_dtype():
    tensors = named_tensors()
    reference = weights.weights_checksum(tensors.items())
    assert weights.weights_checksum(reversed(list(tensors.items()))) == reference
    flipped = dict(tensors)
    raw = flipped["model.norm.weight"].clone().view(torch.int32)
    raw[1] ^= 1
    flipped["model.norm.weight"] = raw.view(torch.float32)
    assert weights.weights_checksum(flipped.items()) != reference
    # Cast to the wire dtype first: the same values in another dtype are other weights.
    assert weights.weights_checksum(tensors.items(), torch.float32) != reference


def test_gloo_push_between_two_ranks_delivers_every_byte():
    from services.rollout.pusher import free_port

    tensors = named_tensors()
    slots, sizes = weights.plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes=1000)
    port = free_port("127.0.0.1")
    sent: dict = {}

    def learner():
        group = weights.open_weight_group("gloo", "127.0.0.1", port, 2, 0, "unit", 30)
        sent["checksum"] = weights.broadcast_weights(group, slots, sizes, lambda names: {n: tensors[n] for n in names})

    thread = threading.Thread(target=learner)
    thread.start()
    group = weights.open_weight_group("gloo", "127.0.0.1", port, 2, 1, "unit", 30)
    received = {}
    digests = {}
    for buffer, members in weights.receive_buckets(group, slots, sizes):
        received.update({n: t.clone() for n, t in weights.unpack_bucket(buffer, members)})
        digests.update({s.name: weights.DigestEntry(s.dtype, s.shape, d)
                        for s, d in zip(members, weights.bucket_digests(buffer, members).values())})
    thread.join(30)
    assert received.keys() == tensors.keys()
    assert all(torch.equal(received[n], tensors[n]) for n in tensors)
    assert weights.combine_digests(digests) == sent["checksum"] == weights.weights_checksum(tensors.items())
