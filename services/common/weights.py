"""Moving policy weights from the learner to rollout engines: bucket layout, checksum, transport.

Both ends of a weight push use this module, so the sender (the learner's PushWeights) and the
receiver (each rollout engine's workers) agree on every byte by construction.

The protocol, for the gloo and nccl backends (one process group: the learner's rank 0 is rank 0,
each rollout engine's workers take ranks rank_offset .. rank_offset + tensor_parallel_size - 1):

    learner (rank 0)                                   rollout engine i
    ----------------                                   ----------------
    group = open_weight_group(backend, addr, port,     InitWeightTransfer(backend, addr, port,
            world_size, rank=0, group_name)    <---->      world_size, rank_offset, group_name)
                                                        (every worker: open_weight_group(...))
    slots, sizes = plan_buckets(
        [(name, wire_dtype, shape) ...], bucket_bytes)
    request = update_weights_request(version, slots, sizes)
    send UpdateWeights(request) to every engine  ---->  validates names/shapes/dtypes, then every
    checksum = broadcast_weights(group, slots,            worker: for bucket in receive_buckets(...)
                                 sizes, tensors)           load the bucket's tensors into the model
    await the UpdateWeights replies             <----   reply: version, weights checksum
    compare each reply's checksum with `checksum`

The bytes of a bucket travel as ONE flat uint8 buffer (all dtypes of the bucket packed end to
end, each tensor starting at a multiple of ALIGN_BYTES) in one broadcast; only the small
per-parameter metadata travels over gRPC. The ipc backend (learner and engine on the same GPU)
puts a CUDA IPC handle of each packed bucket buffer into the UpdateWeights request instead of
broadcasting (see share_bucket_ipc / open_bucket_ipc); the learner keeps the buffers alive until
the UpdateWeights reply arrives.

The weights checksum (weights_checksum, combine_digests) is what "did the weights arrive" is
checked with: the learner computes it over the tensors exactly as sent (in the wire dtype), the
engine over the tensors exactly as received, and GetModelInfo reports the engine's. Each
parameter's part is a pair of integer sums over its bytes (combine_digests has the definition)
computed where the bytes are, so a GPU push is checked on the GPUs without copying the weights to
the host, and the host waits for the device once per chunk, not once per bucket.
Little-endian hosts only (every supported platform is).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2
from services.common import rendezvous

# Every tensor starts at a multiple of this many bytes inside its bucket buffer, so a byte view
# can be reinterpreted as any dtype (and GPU copies stay aligned).
ALIGN_BYTES = 64
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
CHECKSUM_DIGEST_BYTES = 16

# The dtypes weights may travel in. The receiving engine requires its own model dtype.
WIRE_DTYPES = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float16: common_pb2.DTYPE_FLOAT16,
}
PROTO_TO_WIRE_DTYPE = {v: k for k, v in WIRE_DTYPES.items()}

BACKEND_NAMES = {
    rollout_pb2.WEIGHT_BACKEND_GLOO: "gloo",
    rollout_pb2.WEIGHT_BACKEND_NCCL: "nccl",
    rollout_pb2.WEIGHT_BACKEND_IPC: "ipc",
}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling used inside the checksum)."""
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# Bucket layout


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the packed buckets of a weight push."""

    name: str  # the Hugging Face parameter name, e.g. "model.layers.0.mlp.up_proj.weight"
    dtype: torch.dtype  # wire dtype
    shape: tuple[int, ...]
    bucket: int  # index of the bucket buffer that carries it
    offset: int  # byte offset of its first element inside that buffer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(params: Iterable[tuple[str, torch.dtype, Sequence[int]]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[list[ParamSlot], list[int]]:
    """Lays parameters out in buckets, in the given order, each bucket at most bucket_bytes.

    params: (name, wire dtype, shape) per parameter. Greedy: a parameter goes into the current
    bucket if it fits, otherwise it opens the next one (a parameter larger than bucket_bytes gets
    a bucket of its own). Returns (slots in the given order, byte size of each bucket).
    Sending parameters in module order keeps each layer's weights in one or two buckets.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    slots: list[ParamSlot] = []
    sizes: list[int] = []
    used = 0
    for name, dtype, shape in params:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"parameter {name!r}: wire dtype {dtype} is not one of "
                             f"{[dtype_name(d) for d in WIRE_DTYPES]}")
        slot = ParamSlot(name, dtype, tuple(int(d) for d in shape), 0, 0)
        start = _align(used)
        if not sizes or (used > 0 and start + slot.nbytes > bucket_bytes):
            sizes.append(0)
            start = 0
        slot = ParamSlot(slot.name, slot.dtype, slot.shape, len(sizes) - 1, start)
        used = start + slot.nbytes
        sizes[-1] = used
        slots.append(slot)
    return slots, sizes


def check_layout(slots: Sequence[ParamSlot], bucket_sizes: Sequence[int]) -> None:
    """Raises ValueError naming the first parameter whose slot is inconsistent.

    Checks: names unique; bucket index in range; offset aligned; the bytes fit in the bucket;
    no two parameters of one bucket overlap.
    """
    seen: set[str] = set()
    by_bucket: dict[int, list[ParamSlot]] = {}
    for i, s in enumerate(slots):
        where = f"params[{i}] {s.name!r}"
        if s.name in seen:
            raise ValueError(f"{where}: the name appears twice; send each parameter once")
        seen.add(s.name)
        if not 0 <= s.bucket < len(bucket_sizes):
            raise ValueError(f"{where}: bucket {s.bucket} is out of range; there are "
                             f"{len(bucket_sizes)} buckets (bucket_bytes)")
        if s.offset < 0 or s.offset % ALIGN_BYTES:
            raise ValueError(f"{where}: offset {s.offset} must be >= 0 and a multiple of {ALIGN_BYTES}")
        if any(d < 0 for d in s.shape):
            raise ValueError(f"{where}: negative dimension in shape {list(s.shape)}")
        if s.offset + s.nbytes > bucket_sizes[s.bucket]:
            raise ValueError(f"{where}: bytes [{s.offset}, {s.offset + s.nbytes}) run past the end of "
                             f"bucket {s.bucket} ({bucket_sizes[s.bucket]} bytes)")
        by_bucket.setdefault(s.bucket, []).append(s)
    for bucket, members in by_bucket.items():
        members = sorted(members, key=lambda s: s.offset)
        for a, b in zip(members, members[1:]):
            if a.offset + a.nbytes > b.offset:
                raise ValueError(f"parameters {a.name!r} and {b.name!r} overlap in bucket {bucket}")


def bucket_members(slots: Sequence[ParamSlot], num_buckets: int) -> list[list[ParamSlot]]:
    """Slots grouped by bucket index: result[b] lists bucket b's parameters in slot order."""
    members: list[list[ParamSlot]] = [[] for _ in range(num_buckets)]
    for s in slots:
        members[s.bucket].append(s)
    return members


def pack_bucket(tensors: Mapping[str, torch.Tensor], slots: Sequence[ParamSlot], size: int,
                device: torch.device | str) -> torch.Tensor:
    """Copies one bucket's tensors (cast to their wire dtype) into a new flat uint8 buffer.

    tensors: name -> tensor with the slot's shape (any dtype, any device; cast here).
    Returns a (size,) uint8 tensor on `device`. Padding bytes are zero. A zero is sent as +0.0
    (canonical_zeros), so that an engine which reads its weights back through its GEMM kernels
    finds the very bytes that were sent.
    """
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    for s in slots:
        t = tensors[s.name]
        if tuple(t.shape) != s.shape:
            raise ValueError(f"parameter {s.name!r}: tensor shape {list(t.shape)} != planned {list(s.shape)}")
        view = buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
        t = t.detach()
        if t.device == view.device and t.is_floating_point():
            torch.add(t, 0.0, out=view)  # cast and canonical_zeros in one pass
        else:
            view.copy_(t)
            view.add_(0.0)  # x + 0.0 is x for every value but -0.0, which becomes +0.0
    return buffer


def canonical_zeros(t: torch.Tensor) -> torch.Tensor:
    """t with every -0.0 replaced by +0.0 (a copy; other values, inf and NaN unchanged); non-float
    tensors as they are. Every digest of a floating tensor is over this form (combine_digests):
    multiplying by 1 and adding zeros, as a read-back through a GEMM does, cannot keep a zero's
    sign, and the two zeros compute alike in every matmul."""
    return t + 0.0 if t.is_floating_point() else t


def unpack_bucket(buffer: torch.Tensor, slots: Sequence[ParamSlot]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one bucket, as views into `buffer` (no copy)."""
    return [(s.name, buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in slots]


# ----------------------------------------------------------------------------------------------
# Checksum
#
# Each parameter's digest is two sums over its bytes, computed where the bytes are (on the GPU for
# nccl and ipc pushes), so verifying a push costs a few passes over device memory instead of a
# device-to-host copy and a CPU hash of every byte on both sides. Integer sums with wraparound give
# the same bits whatever order a device adds them in, so CPU, GPU and any reduction tree agree.
# It detects transport faults (lost, stale, shifted, swapped or flipped bytes), not tampering.

_ROW_WORDS = ALIGN_BYTES // 4  # int32 words per 64-byte row; every parameter starts on a row


def bucket_sums(buffer: torch.Tensor, slots: Sequence[ParamSlot]) -> torch.Tensor:
    """The digest sums of every parameter of one packed bucket, on the buffer's device.

    buffer: (size,) uint8 packed as by pack_bucket (alignment padding zero); slots: its parameters.
    Returns a (len(slots), 2) int64 tensor, row i = (A, B) of slots[i] (see combine_digests), without
    waiting for the device: nothing here copies to the host, so packing, sending and summing the
    next buckets queue up behind it. digests_from_sums turns the result into bytes.
    """
    if buffer.device.type == "cpu":
        return _cpu_bucket_sums(buffer, slots)
    return _device_bucket_sums(buffer, slots)


def warm_up_bucket_sums(device: torch.device) -> None:
    """Builds bucket_sums' device kernel before the first push needs it (on CUDA Triton compiles it on
    first use: ~0.3 s on each side of a GPU's first push). Triton specialises the kernel on whether
    the row count divides by 16, so one bucket of each runs. Nothing to do on the CPU."""
    if device.type == "cpu":
        return
    for rows in (64, 65):
        bucket_sums(torch.zeros(rows * ALIGN_BYTES, dtype=torch.uint8, device=device), [])


def _device_bucket_sums(buffer: torch.Tensor, slots: Sequence[ParamSlot]) -> torch.Tensor:
    """bucket_sums from per-row sums. With a parameter's words as rows of 16 (its rows s .. e-1 of
    the bucket), word 16 (r - s) + k has weight 16 (r - s) + (k + 1), so
        A = sum_r rowsum_r,   B = sum_r (16 (r - s) rowsum_r + roww_r),   roww_r = sum_k (k + 1) w_rk,
    and both are differences of running sums over the rows. One pass reads the bucket (a Triton
    kernel on CUDA: 16 bytes out per 64 in); the rest works on the rows, 1/16 of the words."""
    device = buffer.device
    size = buffer.numel()
    full_rows, tail = divmod(size, ALIGN_BYTES)
    words = buffer[:full_rows * ALIGN_BYTES].view(torch.int32).view(full_rows, _ROW_WORDS)  # (rows, 16)
    rows = [_row_sums(words)] if full_rows else []  # (rows, 2): rowsum, roww
    if tail:  # a bucket may end inside a row: its last bytes, zero-padded to one row
        last = torch.zeros(ALIGN_BYTES, dtype=torch.uint8, device=device)
        last[:tail] = buffer[full_rows * ALIGN_BYTES:]
        rows.append(_row_sums_torch(last.view(torch.int32).view(1, _ROW_WORDS)))
    if not slots or not rows:
        return torch.zeros(len(slots), 2, dtype=torch.int64, device=device)
    rows = torch.cat(rows)
    index = torch.arange(rows.shape[0], dtype=torch.int64, device=device)
    zero = torch.zeros(1, 3, dtype=torch.int64, device=device)
    # (rows + 1, 3) running sums of rowsum, r * rowsum and roww; they wrap modulo 2**64
    # (one 1-D scan each: a scan down the rows of a (rows, 3) tensor runs 3 threads wide on CUDA)
    run = torch.cat([zero, torch.stack([torch.cumsum(v, 0) for v in (rows[:, 0], index * rows[:, 0],
                                                                      rows[:, 1].contiguous())], 1)])
    bounds = torch.tensor([[s.offset // ALIGN_BYTES for s in slots],
                           [(s.offset + s.nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES for s in slots]],
                          dtype=torch.int64)  # (2, n) first row, row after the last
    if device.type == "cuda":  # pinned and asynchronous: a pageable copy would wait for the device
        bounds = bounds.pin_memory().to(device, non_blocking=True)
    else:
        bounds = bounds.to(device)
    start, end = bounds[0], bounds[1]
    span = run[end] - run[start]  # (n, 3)
    a = span[:, 0]
    b = _ROW_WORDS * (span[:, 1] - start * a) + span[:, 2]
    return torch.stack([a, b], dim=1)  # (n, 2)


_ROWS_PER_SLICE = 1 << 22  # rows per step of the torch fallback: bounds its int64 copy (512 MiB)


def _row_sums_torch(words: torch.Tensor) -> torch.Tensor:
    """(rows, 16) int32 -> (rows, 2) int64: sum_k w_k and sum_k (k + 1) w_k per row."""
    column = torch.arange(1, _ROW_WORDS + 1, dtype=torch.int64, device=words.device)
    out = []
    for first in range(0, words.shape[0], _ROWS_PER_SLICE):
        w = words[first:first + _ROWS_PER_SLICE].to(torch.int64)
        out.append(torch.stack([w.sum(1), (w * column).sum(1)], 1))
    return torch.cat(out)


def _row_sums(words: torch.Tensor) -> torch.Tensor:
    """_row_sums_torch, in one Triton pass on CUDA (the torch form makes an int64 copy of every
    word and reads it three times)."""
    kernel = _row_sums_kernel() if words.is_cuda else None
    if kernel is None:
        return _row_sums_torch(words)
    out = torch.empty(words.shape[0], 2, dtype=torch.int64, device=words.device)
    block = 256
    with torch.cuda.device(words.device):  # Triton launches on the thread's current device
        kernel[(_cdiv(words.shape[0], block),)](words, out, words.shape[0], BLOCK=block)
    return out


def _cdiv(n: int, d: int) -> int:
    return (n + d - 1) // d


@functools.cache
def _row_sums_kernel():
    """The Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_sums(words_ptr, out_ptr, n_rows, BLOCK: tl.constexpr):
        # BLOCK rows of 16 int32 words per program; per row a 16-term sum (no overflow: < 2**39).
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, 16)
        mask = rows < n_rows
        w = tl.load(words_ptr + rows[:, None] * 16 + cols[None, :], mask=mask[:, None], other=0).to(tl.int64)
        tl.store(out_ptr + rows * 2, tl.sum(w, axis=1), mask=mask)
        tl.store(out_ptr + rows * 2 + 1, tl.sum(w * (cols[None, :].to(tl.int64) + 1), axis=1), mask=mask)

    return row_sums


def _wrap64(x: int) -> int:
    """x modulo 2**64, as a signed int64 (how the device tensors hold the sums)."""
    x %= 1 << 64
    return x - (1 << 64) if x >= 1 << 63 else x


def _cpu_bucket_sums(buffer: torch.Tensor, slots: Sequence[ParamSlot]) -> torch.Tensor:
    """bucket_sums on the CPU, per parameter with numpy: torch's int64 kernels run at a fraction
    of numpy's summing speed there. Same values: with the parameter's words as rows of 16,
    B = 16 * sum_r r * (row sum r) + sum_k (k + 1) * (column sum k)."""
    import numpy as np

    raw = buffer.numpy()
    column = np.arange(1, _ROW_WORDS + 1, dtype=np.int64)
    out = []
    for s in slots:
        data = raw[s.offset:s.offset + s.nbytes]
        full = data.size // ALIGN_BYTES * ALIGN_BYTES
        parts = [data[:full]]
        if full < data.size:  # the last, partial row, zero-padded
            last = np.zeros(ALIGN_BYTES, dtype=np.uint8)
            last[:data.size - full] = data[full:]
            parts.append(last)
        a = b = 0
        first_row = 0
        for part in parts:
            rows = part.view("<i4").reshape(-1, _ROW_WORDS)  # (rows, 16)
            row_a = rows.sum(1, dtype=np.int64)  # (rows,)
            index = np.arange(first_row, first_row + rows.shape[0], dtype=np.int64)
            a += int(row_a.sum())
            b += _ROW_WORDS * int((row_a * index).sum()) + int((rows.sum(0, dtype=np.int64) * column).sum())
            first_row += rows.shape[0]
        out.append((_wrap64(a), _wrap64(b)))
    return torch.tensor(out, dtype=torch.int64).reshape(len(slots), 2)


def digests_from_sums(sums: torch.Tensor, slots: Sequence[ParamSlot]) -> dict[str, bytes]:
    """name -> 16-byte tensor digest (A then B, each 8 bytes little-endian two's complement) from
    bucket_sums' (n, 2) result; waits for the device (one small copy)."""
    raw = sums.cpu().numpy().astype("<i8")
    return {s.name: raw[i].tobytes() for i, s in enumerate(slots)}


def bucket_digests(buffer: torch.Tensor, slots: Sequence[ParamSlot]) -> dict[str, bytes]:
    """name -> tensor_digest for every parameter of one packed bucket (waits for the device)."""
    return digests_from_sums(bucket_sums(buffer, slots), slots)


def tensor_digest(t: torch.Tensor) -> bytes:
    """The 16-byte digest (see combine_digests) of a tensor's raw row-major bytes in its own dtype
    (zeros as +0.0), computed on the tensor's device."""
    t = canonical_zeros(t.detach()).contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    buffer = torch.zeros(_align(raw.numel()), dtype=torch.uint8, device=t.device)
    buffer[:raw.numel()] = raw
    # Any dtype (quantized checkpoints hold integers): only the byte count matters to the sums.
    slot = ParamSlot("t", torch.uint8, (raw.numel(),), 0, 0)
    return bucket_digests(buffer, [slot])["t"]


@dataclass(frozen=True)
class DigestEntry:
    """One parameter's contribution to the weights checksum."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: bytes


def combine_digests(entries: Mapping[str, DigestEntry]) -> str:
    """The weights checksum: 32 hex characters.

    Definition: blake2b with a 16-byte digest, fed, for each parameter in ascending order of its
    name (Python string order), with
        name (UTF-8) + b"\\0" + dtype name ("float32" | "bfloat16" | "float16") + b"\\0"
        + shape as decimal numbers joined by "," + b"\\0" + tensor digest (16 bytes)
    where the tensor digest of a tensor is computed from its raw little-endian row-major bytes in
    that dtype (a floating tensor's zeros taken as +0.0: canonical_zeros; pack_bucket sends them so),
    zero-padded to a multiple of 4 bytes and read as signed 32-bit little-endian integers
    w_0 .. w_{n-1}:
        A = sum of w_i                 modulo 2**64
        B = sum of (i + 1) * w_i       modulo 2**64
        tensor digest = A, then B, each as 8 bytes little-endian two's complement.
    (Integer sums, so every device and summation order gives the same bits; computed on the GPU
    for GPU pushes, see bucket_sums.) A learner gets the same value with weights_checksum over its
    parameters cast to the engine's dtype (GetModelInfo.weights_dtype).
    """
    h = hashlib.blake2b(digest_size=CHECKSUM_DIGEST_BYTES)
    for name in sorted(entries):
        e = entries[name]
        h.update(name.encode() + b"\0" + dtype_name(e.dtype).encode() + b"\0"
                 + ",".join(str(d) for d in e.shape).encode() + b"\0" + e.digest)
    return h.hexdigest()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype | None = None) -> str:
    """The weights checksum (see combine_digests) of (name, tensor) pairs, in any order.

    dtype: cast every tensor to this dtype first (the wire dtype); None keeps each tensor's own.
    Example (learner, HF model): weights_checksum(model.named_parameters(), torch.bfloat16).
    """
    entries = {}
    for name, t in named_tensors:
        t = t.detach() if dtype is None else t.detach().to(dtype)
        entries[name] = DigestEntry(t.dtype, tuple(t.shape), tensor_digest(t))
    return combine_digests(entries)


# ----------------------------------------------------------------------------------------------
# gloo / nccl: one process group between the learner and every rollout worker


@dataclass
class WeightGroup:
    """A joined weight-push process group (gloo or nccl); rank 0 is the learner."""

    backend: str
    rank: int
    world_size: int
    process_group: object  # torch.distributed ProcessGroupGloo / ProcessGroupNCCL
    store: object  # kept alive with the group: rank 0's store is the rendezvous server

    @property
    def device(self) -> torch.device:
        """Where this rank's buffers live: the current CUDA device for nccl, else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast_from_learner(self, tensor: torch.Tensor) -> None:
        """Blocking broadcast from rank 0: the learner's tensor is sent, every other rank's is filled."""
        self.process_group.broadcast(tensor, 0).wait()


def open_weight_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str = "rlmesh-weights", timeout_s: float = 600.0) -> WeightGroup:
    """Joins the weight-push process group; blocks until all world_size ranks have joined.

    Rank 0 (the learner) hosts the rendezvous store on master_address:master_port; every other rank
    connects to it. The group is independent of any default torch.distributed group the process
    may have (vLLM's own, DeepSpeed's). backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors on
    the current device). timeout_s bounds the rendezvous and every later broadcast, so a dead peer
    surfaces as an error instead of a hang.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _join_weight_group(backend, master_address, master_port, world_size, rank, group_name,
                                      max(deadline - time.monotonic(), 1.0))
        except torch.distributed.DistNetworkError:
            # A fixed rendezvous port (--weight_sync_master) serves one group after another: an
            # engine may reach the store of the group this one replaces, which the learner closes
            # only as it opens the new one. That store vanishes under it: join again, on the new
            # one, within the same timeout.
            if rank == 0 or time.monotonic() > deadline - 1.0:
                raise
            time.sleep(0.2)


# The learner's rendezvous store of the newest weight group, kept for the next group on the same
# address: a fixed --weight_sync_master port is not bound again. A group abandoned mid-broadcast (its
# caller died) holds its store until the group's timeout, so a new store on that port would wait that
# long; each group's keys live under its name, so one store serves every group of another name (the
# coordinator names each group anew). A name seen before on it gets a new store, as the old keys
# would answer its rendezvous.
_MASTER_STORE: dict[tuple[str, int], tuple[torch.distributed.TCPStore, set[str]]] = {}


def _master_store(host: str, port: int, world_size: int, group_name: str,
                  timeout: datetime.timedelta) -> torch.distributed.TCPStore:
    store, names = _MASTER_STORE.get((host, port), (None, set()))
    if store is None or group_name in names:
        _MASTER_STORE.clear()  # one at a time: the groups of an older store no longer need it from here
        store, names = rendezvous.store(host, port, world_size, is_master=True, timeout=timeout), set()
        _MASTER_STORE[(host, port)] = (store, names)
    names.add(group_name)
    return store


def _join_weight_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                       group_name: str, timeout_s: float) -> WeightGroup:
    timeout = datetime.timedelta(seconds=timeout_s)
    # On one machine (a loopback master) the store and gloo listen on loopback only.
    if rank == 0 and master_port:
        store = _master_store(master_address, master_port, world_size, group_name, timeout)
    else:
        store = rendezvous.store(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    prefixed = torch.distributed.PrefixStore(group_name, store)
    if backend == "gloo":
        process_group = rendezvous.gloo_group(prefixed, rank, world_size, timeout, master_address)
    else:
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        process_group = torch.distributed.ProcessGroupNCCL(prefixed, rank, world_size, options)
    group = WeightGroup(backend, rank, world_size, process_group, store)
    # A first collective makes "joined" mean "connected" on every rank, for both backends.
    group.broadcast_from_learner(torch.zeros(1, device=group.device))
    return group


def send_bucket(group: WeightGroup, tensors: Mapping[str, torch.Tensor], slots: Sequence[ParamSlot],
                size: int) -> dict[str, bytes]:
    """Sender side of one bucket: pack, broadcast from rank 0, return name -> tensor digest.

    Call it for b = 0, 1, ... in order (e.g. inside a ZeRO-3 gather of bucket b's parameters);
    receivers expect the buckets in index order. Waits for the device; send_buckets does not.
    """
    buffer = pack_bucket(tensors, slots, size, group.device)
    group.broadcast_from_learner(buffer)
    return bucket_digests(buffer, slots)


def send_buckets(group: WeightGroup, slots: Sequence[ParamSlot], bucket_sizes: Sequence[int],
                 tensors: Mapping[str, torch.Tensor] | Callable[[list[str]], Mapping[str, torch.Tensor]]
                 ) -> dict[str, DigestEntry]:
    """Sender side of a whole push: every bucket in order; returns name -> DigestEntry as sent.

    tensors: name -> tensor, or a function that returns name -> tensor for the list of names of
    one bucket (so a sharded learner can gather one bucket at a time).
    Bucket b + 1 is packed (and its sums queued) while bucket b is on the wire: the broadcast is
    waited for only before the next one starts (gloo sends on its own threads; for nccl the wait
    only orders the device streams), and the host waits for the device once, at the end.
    """
    members_of = bucket_members(slots, len(bucket_sizes))
    sums = []
    in_flight = None
    for bucket, members in enumerate(members_of):
        names = [s.name for s in members]
        chunk = tensors(names) if callable(tensors) else {n: tensors[n] for n in names}
        buffer = pack_bucket(chunk, members, bucket_sizes[bucket], group.device)
        if in_flight is not None:
            in_flight.wait()
        in_flight = group.process_group.broadcast(buffer, 0)
        sums.append(bucket_sums(buffer, members))
    if in_flight is not None:
        in_flight.wait()
    entries: dict[str, DigestEntry] = {}
    for members, bucket_sum in zip(members_of, sums):
        digests = digests_from_sums(bucket_sum, members)
        entries.update({s.name: DigestEntry(s.dtype, s.shape, digests[s.name]) for s in members})
    return entries


def broadcast_weights(group: WeightGroup, slots: Sequence[ParamSlot], bucket_sizes: Sequence[int],
                      tensors: Mapping[str, torch.Tensor] | Callable[[list[str]], Mapping[str, torch.Tensor]]) -> str:
    """send_buckets, returning the weights checksum sent (weights_checksum over the sent tensors
    in their wire dtypes)."""
    return combine_digests(send_buckets(group, slots, bucket_sizes, tensors))


def receive_buckets(group: WeightGroup, slots: Sequence[ParamSlot],
                    bucket_sizes: Sequence[int]) -> Iterator[tuple[torch.Tensor, list[ParamSlot]]]:
    """Receiver side: yields (bucket buffer, its slots) for each bucket in index order.

    Each buffer is a fresh (size,) uint8 tensor on this rank's device, filled by the broadcast
    from rank 0; unpack_bucket(buffer, slots) gives the parameters, bucket_sums their digests.
    Bucket b + 1 is already being received while the caller loads bucket b (two buffers live).
    For nccl, a yielded buffer is ready for work queued on the current stream, not for the host.
    """
    members_of = bucket_members(slots, len(bucket_sizes))

    def start(bucket: int):
        buffer = torch.empty(bucket_sizes[bucket], dtype=torch.uint8, device=group.device)
        return buffer, group.process_group.broadcast(buffer, 0)

    pending = start(0) if members_of else None
    for bucket, members in enumerate(members_of):
        buffer, work = pending
        work.wait()
        pending = start(bucket + 1) if bucket + 1 < len(members_of) else None
        yield buffer, members


# ----------------------------------------------------------------------------------------------
# ipc: CUDA IPC handles of packed buckets (learner and engine share a GPU)


def device_uuid(device: torch.device | int | None = None) -> str:
    """The physical GPU's UUID ("GPU-..."), the same in every process whatever CUDA_VISIBLE_DEVICES."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return f"GPU-{props.uuid}"


def share_bucket_ipc(buffer: torch.Tensor, bucket: int) -> rollout_pb2.IpcBucket:
    """Sender side: a CUDA IPC handle of a packed bucket buffer (from pack_bucket on a GPU).

    Keep `buffer` alive (and unmodified) until the engine's UpdateWeights reply has arrived.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("share_bucket_ipc needs a 1-D uint8 CUDA buffer from pack_bucket")
    _, args = reduce_tensor(buffer)
    (_, size, _stride, tensor_offset, _storage_cls, _dtype, _device, handle, storage_size_bytes,
     storage_offset_bytes, _requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    return rollout_pb2.IpcBucket(
        bucket=bucket, device_uuid=device_uuid(buffer.device), nbytes=int(size[0]),
        tensor_offset=int(tensor_offset), storage_handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes), storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle), ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync_required))


def open_bucket_ipc(msg: rollout_pb2.IpcBucket, device: torch.device | int | None = None) -> torch.Tensor:
    """Receiver side: the (nbytes,) uint8 buffer behind an IpcBucket, mapped on this process's device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if device is None:
        index = torch.cuda.current_device()
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
    return rebuild_cuda_tensor(
        torch.Tensor, (msg.nbytes,), (1,), msg.tensor_offset, torch.storage.TypedStorage, torch.uint8,
        index, msg.storage_handle, msg.storage_size_bytes, msg.storage_offset_bytes, False,
        msg.ref_counter_handle, msg.ref_counter_offset, msg.event_handle or None,
        msg.event_sync_required)


# ----------------------------------------------------------------------------------------------
# gRPC messages


def slots_to_proto(slots: Sequence[ParamSlot]) -> list[rollout_pb2.ParameterMeta]:
    return [rollout_pb2.ParameterMeta(name=s.name, dtype=WIRE_DTYPES[s.dtype], shape=list(s.shape),
                                      bucket=s.bucket, offset_bytes=s.offset) for s in slots]


def slots_from_proto(params: Sequence[rollout_pb2.ParameterMeta]) -> list[ParamSlot]:
    """Raises ValueError naming the parameter whose dtype is not a wire dtype."""
    slots = []
    for i, p in enumerate(params):
        if p.dtype not in PROTO_TO_WIRE_DTYPE:
            raise ValueError(f"params[{i}] {p.name!r}: dtype {p.dtype} is not one of FLOAT32, BFLOAT16, FLOAT16")
        slots.append(ParamSlot(p.name, PROTO_TO_WIRE_DTYPE[p.dtype], tuple(int(d) for d in p.shape),
                               int(p.bucket), int(p.offset_bytes)))
    return slots


def update_weights_request(version: int, slots: Sequence[ParamSlot], bucket_sizes: Sequence[int],
                           chunk_index: int = 0, final: bool = True,
                           ipc_buckets: Sequence[rollout_pb2.IpcBucket] = (),
                           adapter: rollout_pb2.LoraAdapter | None = None) -> rollout_pb2.UpdateWeightsRequest:
    """The UpdateWeights request describing one chunk of a push (by default the whole push);
    with `adapter`, a chunk of an adapter push (its slots are adapter tensors)."""
    return rollout_pb2.UpdateWeightsRequest(
        version=version, chunk_index=chunk_index, final=final, params=slots_to_proto(slots),
        bucket_bytes=list(bucket_sizes), ipc_buckets=list(ipc_buckets), adapter=adapter)


# ----------------------------------------------------------------------------------------------
# LoRA adapters (adapter-only pushes)
#
# An adapter push carries, per target module T, the tensors T.lora_A.weight (rank, in) and
# T.lora_B.weight (out, rank); the engine serves W_T + scaling * B @ A over its --pretrain weights.
# Its weights checksum is combine_digests over those tensors as sent / received plus one entry for
# the scaling (adapter_checksum_entries), so the same bytes under another scaling are other weights.

LORA_SCALING_ENTRY = "lora.scaling"


def lora_tensor_names(target: str) -> tuple[str, str]:
    """The adapter tensors of target module `target` ("model.layers.0.self_attn.q_proj")."""
    return f"{target}.lora_A.weight", f"{target}.lora_B.weight"


@dataclass(frozen=True)
class LoraAdapter:
    """The LoRA adapter of an adapter push (rollout.proto LoraAdapter): what the learner declares
    and the engines check and apply."""

    rank: int
    scaling: float
    targets: tuple[str, ...]  # Hugging Face module names, each with a 2-D weight "<target>.weight"

    def to_proto(self) -> rollout_pb2.LoraAdapter:
        return rollout_pb2.LoraAdapter(rank=self.rank, scaling=self.scaling, target_modules=list(self.targets))

    def tensor_shapes(self, parameters: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """name -> shape of every tensor the push must carry, given the model's parameter shapes:
        T.lora_A.weight (rank, in) and T.lora_B.weight (out, rank) for the (out, in) weight of T."""
        shapes = {}
        for target in self.targets:
            out_features, in_features = parameters[f"{target}.weight"]
            a, b = lora_tensor_names(target)
            shapes[a], shapes[b] = (self.rank, in_features), (out_features, self.rank)
        return shapes


def adapter_checksum_entries(entries: Mapping[str, DigestEntry], scaling: float) -> dict[str, DigestEntry]:
    """The digest entries an adapter push's checksum is combined from: the adapter tensors' and
    LORA_SCALING_ENTRY, the scaling as a float64 scalar."""
    value = torch.tensor(float(scaling), dtype=torch.float64)
    return {**entries, LORA_SCALING_ENTRY: DigestEntry(value.dtype, (), tensor_digest(value))}
