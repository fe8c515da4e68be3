"""Tensor <-> rlmesh.common.v1.Tensor: raw little-endian bytes with dtype and shape."""

import sys

import numpy as np
import torch

from rlmesh.common.v1 import common_pb2

_TORCH_TO_PROTO = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.int32: common_pb2.DTYPE_INT32,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.uint8: common_pb2.DTYPE_UINT8,
}
_PROTO_TO_TORCH = {v: k for k, v in _TORCH_TO_PROTO.items()}
_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in _PROTO_TO_TORCH.items()}
# bool masks travel as uint8.
_NUMPY_TO_TORCH = {np.dtype(np.bool_): torch.uint8}


def to_proto(t: "torch.Tensor | np.ndarray") -> common_pb2.Tensor:
    """Encodes a tensor (any supported dtype, any shape) as raw little-endian bytes."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t).astype(t.dtype.newbyteorder("<"), copy=False))
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.dtype not in _TORCH_TO_PROTO:
        raise ValueError(f"tensor dtype {t.dtype} is not supported; use one of "
                         f"{sorted(str(d) for d in _TORCH_TO_PROTO)}")
    t = t.detach().to("cpu").contiguous()
    # bfloat16 has no numpy dtype: view the bits as int16.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    arr = raw.numpy()
    if sys.byteorder != "little":
        arr = arr.byteswap()
    return common_pb2.Tensor(dtype=_TORCH_TO_PROTO[t.dtype], shape=list(t.shape), data=arr.tobytes())


def from_proto(msg: common_pb2.Tensor, name: str = "tensor") -> torch.Tensor:
    """Decodes a Tensor message; `name` is used in error messages (e.g. "samples[3].logprobs")."""
    if msg.dtype not in _PROTO_TO_TORCH:
        raise ValueError(f"{name}: dtype {common_pb2.DType.Name(msg.dtype) if msg.dtype in common_pb2.DType.values() else msg.dtype} "
                         "is not supported; set one of FLOAT32, BFLOAT16, FLOAT16, INT32, INT64, UINT8")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}: negative dimension in shape {shape}")
    count = int(np.prod(shape)) if shape else 1
    expected = count * _ITEMSIZE[msg.dtype]
    if len(msg.data) != expected:
        raise ValueError(f"{name}: {len(msg.data)} data bytes do not match shape {list(shape)} "
                         f"x {common_pb2.DType.Name(msg.dtype)} ({expected} bytes)")
    dtype = _PROTO_TO_TORCH[msg.dtype]
    np_dtype = {torch.bfloat16: np.dtype("<i2")}.get(dtype) or torch.empty((), dtype=dtype).numpy().dtype.newbyteorder("<")
    arr = np.frombuffer(msg.data, dtype=np_dtype, count=count).reshape(shape)
    t = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def ragged_to_proto(seqs, dtype: torch.dtype = torch.int64) -> common_pb2.RaggedTensor:
    """Packs 1-D sequences of different lengths end to end, with their lengths."""
    parts = [torch.as_tensor(s, dtype=dtype).reshape(-1) for s in seqs]
    values = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    return common_pb2.RaggedTensor(values=to_proto(values), lengths=[len(p) for p in parts])


def ragged_from_proto(msg: common_pb2.RaggedTensor, name: str = "ragged") -> list[torch.Tensor]:
    values = from_proto(msg.values, f"{name}.values")
    if values.dim() != 1:
        raise ValueError(f"{name}.values: must be 1-D, got shape {list(values.shape)}")
    lengths = list(msg.lengths)
    if any(n < 0 for n in lengths) or sum(lengths) != values.numel():
        raise ValueError(f"{name}.lengths: sum {sum(lengths)} must equal the {values.numel()} "
                         "packed values and no length may be negative")
    return list(torch.split(values, lengths)) if lengths else []
