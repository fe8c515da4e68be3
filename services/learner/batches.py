"""Experience batches: decoding and checking requests, splitting over ranks, collating micro-batches.

A sample is one full sequence (prompt then response, no padding), the index of its first response
token, and per-response-token fields (advantages, old log-probs, ...). Rank 0 decodes and checks
every request here before any rank sees it, so bad input is answered with INVALID_ARGUMENT naming
the field and the sample, and the ranks only ever get well-formed work.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from services.common.errors import invalid_argument
from services.common.tensors import from_proto, ragged_from_proto

# Per-response-token float fields of rlmesh.learner.v1.ExperienceBatch.
FLOAT_FIELDS = ("old_logprobs", "advantages", "ref_logprobs", "returns", "old_values")


@dataclasses.dataclass
class Sample:
    input_ids: torch.Tensor  # (L,) int64
    response_start: int  # index of the first response token, 1 <= response_start <= L
    fields: dict[str, torch.Tensor]  # name -> (L - response_start,) float32; "action_mask" bool

    @property
    def response_len(self) -> int:
        return self.input_ids.numel() - self.response_start

    @property
    def action_tokens(self) -> int:
        mask = self.fields.get("action_mask")
        return self.response_len if mask is None else int(mask.sum())


# ----------------------------------------------------------------------------------------------
# Decoding and checking


def decode_sequences(input_ids_msg, response_start_msg, vocab_size: int, max_len: int,
                     prefix: str = "", min_response: int = 0) -> list[Sample]:
    """input_ids (RaggedTensor) + response_start (Tensor) -> samples, or INVALID_ARGUMENT.

    min_response: fewest response tokens a sample may have (1 for training).
    """
    try:
        seqs = ragged_from_proto(input_ids_msg, f"{prefix}input_ids")
        starts = from_proto(response_start_msg, f"{prefix}response_start")
    except ValueError as exc:
        raise invalid_argument(f"{prefix}input_ids/response_start", None, str(exc),
                               "encode them with services.common.tensors") from exc
    if not seqs:
        raise invalid_argument(f"{prefix}input_ids", None, "the batch is empty", "send at least one sample")
    if seqs[0].dtype not in (torch.int32, torch.int64):
        raise invalid_argument(f"{prefix}input_ids", None, f"dtype {seqs[0].dtype} is not an integer type",
                               "send token ids as INT32 or INT64")
    if starts.dtype not in (torch.int32, torch.int64) or starts.shape != (len(seqs),):
        raise invalid_argument(f"{prefix}response_start", None,
                               f"got {starts.dtype} of shape {list(starts.shape)} for {len(seqs)} sequences",
                               f"send one INT64 per sequence, shape ({len(seqs)},)")
    samples = []
    for i, (ids, start) in enumerate(zip(seqs, starts.tolist())):
        length = ids.numel()
        if not 1 <= start <= length - min_response:
            need = "1 <= response_start < length" if min_response else "1 <= response_start <= length"
            raise invalid_argument(f"{prefix}response_start", f"sample {i}",
                                   f"{start} does not satisfy {need} (length {length})",
                                   "put the index of the first response token; every sample needs a prompt"
                                   + (" and a response" if min_response else ""))
        if length > max_len:
            raise invalid_argument(f"{prefix}input_ids", f"sample {i}",
                                   f"{length} tokens exceed the longest sequence the learner takes ({max_len})",
                                   "shorten prompt + response (generate_max_len, prompt_max_len) or raise --max_len")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            pos = int(bad.nonzero()[0, 0])
            raise invalid_argument(f"{prefix}input_ids", f"sample {i}",
                                   f"token id {int(ids[pos])} at position {pos} is outside the vocabulary "
                                   f"[0, {vocab_size})", "tokenize with the actor's tokenizer")
        # copy=True: a row of the request is a view of the whole request's tensor, and pickling a view
        # (to send a rank its share) would send that whole tensor once per sample.
        samples.append(Sample(ids.to(torch.int64, copy=True), int(start), {}))
    return samples


def attach_field(samples: list[Sample], msg, name: str, prefix: str = "batch.") -> None:
    """Decodes a per-response-token RaggedTensor into samples[i].fields[name], checking lengths,
    dtype and finiteness (action_mask: 0/1 with at least one 1 per sample)."""
    field = f"{prefix}{name}"
    try:
        values = ragged_from_proto(msg, field)
    except ValueError as exc:
        raise invalid_argument(field, None, str(exc), "encode it with services.common.tensors.ragged_to_proto") from exc
    if len(values) != len(samples):
        raise invalid_argument(field, None, f"{len(values)} sequences for {len(samples)} samples",
                               "send one sequence per sample, in sample order")
    for i, (sample, v) in enumerate(zip(samples, values)):
        if v.numel() != sample.response_len:
            raise invalid_argument(field, f"sample {i}",
                                   f"{v.numel()} values for {sample.response_len} response tokens "
                                   f"(length {sample.input_ids.numel()} - response_start {sample.response_start})",
                                   "send one value per response token")
        if name == "action_mask":
            if ((v != 0) & (v != 1)).any():
                raise invalid_argument(field, f"sample {i}", "values other than 0 and 1", "send a 0/1 UINT8 mask")
            if not v.any():
                raise invalid_argument(field, f"sample {i}", "the mask is all zeros: nothing to train on",
                                       "drop the sample, or mark its action tokens with 1")
            sample.fields[name] = v.to(torch.bool)  # a copy, not a view (see decode_sequences)
            continue
        if not v.is_floating_point():
            raise invalid_argument(field, f"sample {i}", f"dtype {v.dtype} is not a float type", "send FLOAT32")
        v = v.to(torch.float32, copy=True)  # not a view of the request (see decode_sequences)
        finite = torch.isfinite(v)
        if not finite.all():
            pos = int((~finite).nonzero()[0, 0])
            raise invalid_argument(field, f"sample {i}", f"{float(v[pos])} at response token {pos} is not finite",
                                   "check the rewards and advantage computation for NaN/inf")
        sample.fields[name] = v


def decode_experience(batch, required: list[str], vocab_size: int, max_len: int) -> list[Sample]:
    """ExperienceBatch -> samples with the required per-token fields (and action_mask when set)."""
    samples = decode_sequences(batch.input_ids, batch.response_start, vocab_size, max_len, "batch.", min_response=1)
    if batch.HasField("action_mask"):
        attach_field(samples, batch.action_mask, "action_mask")
    for name in required:
        if not batch.HasField(name):
            raise invalid_argument(f"batch.{name}", None, "is required for this call and was not set",
                                   f"send {name} for every response token")
        attach_field(samples, getattr(batch, name), name)
    return samples


# ----------------------------------------------------------------------------------------------
# Splitting work over ranks


@dataclasses.dataclass
class StepPlan:
    """One optimizer step: this rank's micro-batches and the loss normalizers of the global step."""

    micro_batches: list[list[Sample]]
    tokens: int  # action tokens in the global mini-batch (all ranks): token-level normalizer
    sequences: int  # samples in the global mini-batch: sequence-level normalizer


def plan_training(samples: list[Sample], train_batch_size: int, micro_batch_size: int, world_size: int,
                  epochs: int, seed: int, max_tokens: int = 0) -> list[list[StepPlan]]:
    """Shuffles (per epoch, from seed), cuts mini-batches of train_batch_size, gives each rank an
    equal share of each, in micro-batches. Returns per rank the list of its StepPlans.

    Micro-batches hold micro_batch_size samples, or with max_tokens (dynamic batching) as many as
    fit in max_tokens tokens (token_micro_batches); every rank then gets the same number of them
    in a step (the most any rank needs), as its gradient reductions pair up with the others'.

    len(samples) must be a multiple of train_batch_size, and train_batch_size of
    micro_batch_size x world_size (checked by the caller / the config).
    """
    per_rank = train_batch_size // world_size
    plans: list[list[StepPlan]] = [[] for _ in range(world_size)]
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), train_batch_size):
            batch = [samples[i] for i in order[start:start + train_batch_size]]
            tokens = sum(s.action_tokens for s in batch)
            shares = [batch[rank * per_rank:(rank + 1) * per_rank] for rank in range(world_size)]
            if max_tokens:
                count = max(micro_batch_count(share, max_tokens) for share in shares)
                micro = [token_micro_batches(share, count) for share in shares]
            else:
                micro = [[share[m:m + micro_batch_size] for m in range(0, per_rank, micro_batch_size)]
                         for share in shares]
            for rank in range(world_size):
                plans[rank].append(StepPlan(micro[rank], tokens, len(batch)))
    return plans


def _token_bins(lengths: list[int], count: int) -> list[list[int]]:
    """Indices of `lengths` in `count` bins of near-equal sums: longest first, each into the bin
    holding the fewest tokens so far (ties: the first). Empty bins are dropped."""
    bins: list[list[int]] = [[] for _ in range(count)]
    lightest = [(0, b) for b in range(count)]  # (tokens so far, bin): a heap
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, j = heapq.heappop(lightest)
        bins[j].append(i)
        heapq.heappush(lightest, (load + lengths[i], j))
    return [b for b in bins if b]


def token_micro_batches(samples: list[Sample], count: int) -> list[list[Sample]]:
    """samples in `count` micro-batches of near-equal token counts (see _token_bins)."""
    return [[samples[i] for i in b] for b in _token_bins([s.input_ids.numel() for s in samples], count)]


def micro_batch_count(samples: list[Sample], max_tokens: int) -> int:
    """The fewest micro-batches of token_micro_batches that keep each within max_tokens tokens (a
    longer sample alone makes one of its own)."""
    lengths = [s.input_ids.numel() for s in samples]
    count = max(1, math.ceil(sum(lengths) / max_tokens), sum(n >= max_tokens for n in lengths))
    while count < len(samples):
        bins = token_micro_batches(samples, count)
        if all(len(b) == 1 or sum(s.input_ids.numel() for s in b) <= max_tokens for b in bins):
            break
        count += 1
    return min(count, len(samples))


def forward_micro_batches(samples: list[Sample], micro_batch_size: int, world_size: int) -> list[list[list[int]]]:
    """The micro-batches of a forward-only call (LogProbs, Values), as sample indices, per rank.

    Samples are sorted by length, longest first, and cut into micro-batches of micro_batch_size
    (little padding); micro-batch j goes to rank j % world_size. This is how the reference service
    batches (services/reward/reference.py), so with the same micro-batch size both form the same
    padded batches whatever the number of ranks, and their log-probs agree bit for bit.
    """
    order = sorted(range(len(samples)), key=lambda i: -samples[i].input_ids.numel())
    batches = [order[m:m + micro_batch_size] for m in range(0, len(order), micro_batch_size)]
    return [batches[rank::world_size] for rank in range(world_size)]


def token_forward_micro_batches(samples: list[Sample], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """The micro-batches of a packed forward-only call under a token budget, as sample indices,
    per rank: the fewest micro-batches of near-equal token counts that keep each within max_tokens
    (a longer sample alone makes one of its own), at least one per rank while there are samples
    enough; micro-batch j goes to rank j % world_size."""
    count = max(micro_batch_count(samples, max_tokens), min(world_size, len(samples)))
    batches = _token_bins([s.input_ids.numel() for s in samples], count)
    return [batches[rank::world_size] for rank in range(world_size)]


# ----------------------------------------------------------------------------------------------
# Collation


@dataclasses.dataclass
class MicroBatch:
    """Model inputs of some samples, and where their response tokens sit in the model's outputs.

    Padded: input_ids / attention_mask (B, T), right-padded. Packed: input_ids / position_ids
    (1, N), every sample's tokens end to end with positions restarting at 0 (attention stays
    within a sample). In both, the next-token outputs (rows, T-1) flattened to one dimension hold
    sample i's j-th response token at out_index[i, j].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    out_index: torch.Tensor  # (B, R) long
    response_mask: torch.Tensor  # (B, R) bool: real response tokens
    fields: dict[str, torch.Tensor]  # name -> (B, R), 0 / False at padding
    seq_lengths: list[int] | None = None  # packed: the samples' lengths, in row order

    @property
    def action_mask(self) -> torch.Tensor:
        """(B, R) bool: the tokens the losses count."""
        mask = self.fields.get("action_mask")
        return self.response_mask if mask is None else self.response_mask & mask

    def to(self, device) -> "MicroBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                          move(self.out_index), move(self.response_mask),
                          {k: move(v) for k, v in self.fields.items()}, self.seq_lengths)


def _pad_fields(samples: list[Sample], width: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    B = len(samples)
    response_mask = torch.zeros(B, width, dtype=torch.bool)
    fields: dict[str, torch.Tensor] = {}
    for i, s in enumerate(samples):
        response_mask[i, :s.response_len] = True
        for name, v in s.fields.items():
            if name not in fields:
                fields[name] = torch.zeros(B, width, dtype=v.dtype)
            fields[name][i, :v.numel()] = v
    return response_mask, fields


def collate(samples: list[Sample], packed: bool = False, pad_id: int = 0) -> MicroBatch:
    """Samples -> a MicroBatch (right-padded, or packed into one row)."""
    B = len(samples)
    width = max(s.response_len for s in samples)
    j = torch.arange(width)
    response_mask, fields = _pad_fields(samples, width)
    lengths = [s.input_ids.numel() for s in samples]
    # Output t predicts token t + 1, so response token j of a sample is output start - 1 + j.
    first_out = torch.tensor([s.response_start - 1 for s in samples])
    if packed:
        offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        input_ids = torch.cat([s.input_ids for s in samples]).unsqueeze(0)  # (1, N)
        position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        out_index = offsets[:, None] + first_out[:, None] + j[None, :]  # (B, R)
        limit = input_ids.shape[1] - 2
        return MicroBatch(input_ids, None, position_ids, out_index.clamp(max=limit), response_mask, fields, lengths)
    T = max(lengths)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros(B, T, dtype=torch.int64)
    for i, s in enumerate(samples):
        input_ids[i, :lengths[i]] = s.input_ids
        attention_mask[i, :lengths[i]] = 1
    # Rows of T - 1 outputs; positions past a sample's end point at its own padding (masked).
    out_index = torch.arange(B)[:, None] * (T - 1) + (first_out[:, None] + j[None, :]).clamp(max=max(T - 2, 0))
    return MicroBatch(input_ids, attention_mask, None, out_index, response_mask, fields)


def ragged_rows(values: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """(B, R) padded per-response-token outputs -> one (response_len,) tensor per sample."""
    return [values[i, :s.response_len].clone() for i, s in enumerate(samples)]
