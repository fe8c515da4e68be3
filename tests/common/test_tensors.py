import numpy as np
import pytest
import torch

from rlmesh.common.v1 import common_pb2
from services.common.tensors import from_proto, ragged_from_proto, ragged_to_proto, to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8])
def test_round_trip_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, generator=g) * 100).to(dtype)
    back = from_proto(to_proto(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_bytes_are_little_endian_row_major():
    msg = to_proto(torch.tensor([[1, 2], [3, 258]], dtype=torch.int32))
    assert msg.dtype == common_pb2.DTYPE_INT32 and list(msg.shape) == [2, 2]
    assert msg.data == np.array([1, 2, 3, 258], dtype="<i4").tobytes()
    bf = to_proto(torch.tensor([1.0], dtype=torch.bfloat16))
    assert bf.data == b"\x80\x3f"  # 1.0 in bfloat16 = 0x3F80, little-endian


def test_scalar_bool_and_numpy():
    assert from_proto(to_proto(torch.tensor(2.5))).item() == 2.5
    assert torch.equal(from_proto(to_proto(torch.tensor([True, False]))), torch.tensor([1, 0], dtype=torch.uint8))
    assert torch.equal(from_proto(to_proto(np.arange(4, dtype=np.int64))), torch.arange(4))


def test_bad_messages_name_the_problem():
    with pytest.raises(ValueError, match="logprobs: 3 data bytes do not match shape"):
        from_proto(common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2], data=b"abc"), "logprobs")
    with pytest.raises(ValueError, match="dtype .* is not supported"):
        from_proto(common_pb2.Tensor(shape=[1], data=b"abcd"))
    with pytest.raises(ValueError, match="not supported"):
        to_proto(torch.zeros(2, dtype=torch.float64))


def test_ragged_round_trip_and_validation():
    seqs = [[1, 2, 3], [], [7]]
    back = ragged_from_proto(ragged_to_proto(seqs))
    assert [b.tolist() for b in back] == seqs
    msg = ragged_to_proto(seqs)
    msg.lengths[0] = 5
    with pytest.raises(ValueError, match="prompts.lengths: sum 6 must equal the 4"):
        ragged_from_proto(msg, "prompts")
