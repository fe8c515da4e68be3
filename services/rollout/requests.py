"""Turning RolloutService requests into engine work, rejecting bad input with a message that names
the field, the prompt (or parameter) and the fix. Nothing here touches the engine, so a rejected
request never disturbs the calls being served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlmesh.common.v1 import common_pb2
from rlmesh.rollout.v1 import rollout_pb2
from services.common.errors import failed_precondition, invalid_argument
from services.common.tensors import from_proto
from services.common.weights import LoraAdapter, check_layout, dtype_name, slots_from_proto
from services.rollout.config import RolloutConfig
from services.rollout.adapters import parse_adapter
from services.rollout.engine import ModelFacts, Sampling, WeightChunk


@dataclass
class PreparedPrompt:
    prompt_id: str
    token_ids: list[int]
    tokenized_here: bool  # came as text or chat: the caller gets the token ids back


def _prompt_item(i: int, prompt: rollout_pb2.Prompt) -> str:
    return f"prompt {prompt.prompt_id!r}" if prompt.prompt_id else f"prompt #{i}"


def check_generate_shape(request: rollout_pb2.GenerateRequest, config: RolloutConfig) -> None:
    """Batch-level checks (cheap; run before any tokenizing)."""
    if not request.prompts:
        raise invalid_argument("prompts", None, "the batch is empty", "send at least one prompt")
    if len(request.prompts) > config.max_prompts_per_request:
        raise invalid_argument("prompts", None, f"{len(request.prompts)} prompts exceed the limit of "
                               f"{config.max_prompts_per_request}", "split the batch into several Generate calls")
    if request.n < 1:
        raise invalid_argument("n", None, f"n={request.n}; at least one sample per prompt is needed", "set n >= 1")
    if request.n * len(request.prompts) > config.max_samples_per_request:
        raise invalid_argument("n", None, f"{request.n} x {len(request.prompts)} prompts = "
                               f"{request.n * len(request.prompts)} samples exceed the limit of "
                               f"{config.max_samples_per_request}", "send fewer prompts per call")
    seen: dict[str, int] = {}
    for i, prompt in enumerate(request.prompts):
        if not prompt.prompt_id:
            raise invalid_argument("prompts[].prompt_id", f"prompt #{i}", "empty", "give every prompt a unique prompt_id")
        if prompt.prompt_id in seen:
            raise invalid_argument("prompts[].prompt_id", f"prompt {prompt.prompt_id!r}",
                                   f"used by prompts #{seen[prompt.prompt_id]} and #{i}",
                                   "give every prompt of a batch its own prompt_id")
        seen[prompt.prompt_id] = i


def parse_sampling(request: rollout_pb2.GenerateRequest, facts: ModelFacts) -> Sampling:
    s = request.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid_argument("sampling.temperature", None, f"{temperature} is negative or not finite",
                               "use 0 for greedy decoding or a positive temperature")
    if not 0.0 < top_p <= 1.0:
        raise invalid_argument("sampling.top_p", None, f"{top_p} is outside (0, 1]", "use a value in (0, 1]; 1 = off")
    if s.top_k < -1:
        raise invalid_argument("sampling.top_k", None, f"{s.top_k} is negative", "use 0 or -1 (off) or k >= 1")
    if not 0.0 <= s.min_p <= 1.0:
        raise invalid_argument("sampling.min_p", None, f"{s.min_p} is outside [0, 1]", "use a value in [0, 1]; 0 = off")
    if s.max_tokens < 1:
        raise invalid_argument("sampling.max_tokens", None, f"max_tokens={s.max_tokens}; at least one token must be "
                               "generated", "set max_tokens >= 1")
    for token in s.stop_token_ids:
        if not 0 <= token < facts.vocab_size:
            raise invalid_argument("sampling.stop_token_ids", None, f"token id {token} is outside the vocabulary "
                                   f"[0, {facts.vocab_size})", "use token ids of this model's tokenizer")
    if any(not text for text in s.stop):
        raise invalid_argument("sampling.stop", None, "an empty stop string would end every sample at once",
                               "remove the empty string")
    return Sampling(
        temperature=float(temperature), top_p=float(top_p), top_k=max(int(s.top_k), 0), min_p=float(s.min_p),
        max_tokens=int(s.max_tokens), stop=tuple(s.stop), stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
        seed=int(s.seed) if s.HasField("seed") else None, logprobs=s.logprobs, ignore_eos=s.ignore_eos,
        return_text=s.return_text)


def prepare_prompts(request: rollout_pb2.GenerateRequest, facts: ModelFacts, tokenizer) -> list[PreparedPrompt]:
    """Token ids of every prompt, checked against the vocabulary and max_model_len.

    Text is tokenized as vLLM would (the tokenizer's special tokens added); chat turns are rendered
    with the chat template and a generation prompt, then tokenized without adding more.
    """
    prepared = []
    for i, prompt in enumerate(request.prompts):
        item = _prompt_item(i, prompt)
        kind = prompt.WhichOneof("input")
        if kind == "token_ids":
            field = "prompts[].token_ids"
            if prompt.token_ids.dtype not in (common_pb2.DTYPE_INT32, common_pb2.DTYPE_INT64):
                raise invalid_argument(field, item, "token ids must be an INT32 or INT64 tensor",
                                       "encode the ids with dtype INT64 (services.common.tensors.to_proto)")
            try:
                ids = from_proto(prompt.token_ids, field)
            except ValueError as exc:
                raise invalid_argument(field, item, str(exc), "send a well-formed 1-D tensor") from None
            if ids.dim() != 1:
                raise invalid_argument(field, item, f"shape {list(ids.shape)} is not 1-D", "send a 1-D tensor of ids")
            token_ids = ids.tolist()
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= facts.vocab_size):
                bad = next(t for t in token_ids if not 0 <= t < facts.vocab_size)
                raise invalid_argument(field, item, f"token id {bad} is outside the vocabulary [0, {facts.vocab_size})",
                                       "tokenize with this model's tokenizer")
        elif kind == "text":
            field = "prompts[].text"
            token_ids = tokenizer(prompt.text)["input_ids"] if prompt.text else []
        elif kind == "chat":
            field = "prompts[].chat"
            messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
            if not messages or any(not m["role"] for m in messages):
                raise invalid_argument(field, item, "no messages, or a message without a role",
                                       "send at least one message, each with a role (system/user/assistant)")
            if tokenizer.chat_template is None:
                raise invalid_argument(field, item, "the model's tokenizer has no chat template",
                                       "send the prompt as text or token ids")
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            token_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            raise invalid_argument("prompts[].input", item, "no prompt given", "set one of token_ids, text or chat")
        if not token_ids:
            raise invalid_argument(field, item, "the prompt is empty (0 tokens)", "send at least one token")
        if len(token_ids) >= facts.max_model_len:
            raise invalid_argument(field, item, f"the prompt has {len(token_ids)} tokens; max_model_len is "
                                   f"{facts.max_model_len}, which leaves no room for a response",
                                   f"shorten it to at most {facts.max_model_len - 1} tokens, or restart the "
                                   "service with a larger --max_model_len")
        prepared.append(PreparedPrompt(prompt.prompt_id, [int(t) for t in token_ids], kind != "token_ids"))
    return prepared


# ----------------------------------------------------------------------------------------------
# UpdateWeights


@dataclass
class PushProgress:
    """A weight push whose chunks are still arriving."""

    version: int
    next_chunk: int
    received: set[str]
    adapter: LoraAdapter | None = None  # an adapter push's, from its chunk 0


def parse_update(request: rollout_pb2.UpdateWeightsRequest, facts: ModelFacts, backend: str,
                 committed_version: int, push: PushProgress | None) -> WeightChunk:
    """Checks one UpdateWeights chunk against the model and the push so far; returns the chunk.

    Version going backwards and out-of-order chunks are FAILED_PRECONDITION (they depend on the
    engine's state); malformed parameters are INVALID_ARGUMENT.
    """
    if request.version <= committed_version:
        raise failed_precondition(
            f"version: {request.version} does not move forward from the engine's weight version {committed_version}; "
            f"fix: push with a version greater than {committed_version}")
    if request.chunk_index < 0:
        raise invalid_argument("chunk_index", None, f"{request.chunk_index} is negative", "start a push at 0")
    if request.chunk_index > 0:
        if push is None or push.version != request.version or push.next_chunk != request.chunk_index:
            expected = "0 (no push is under way)" if push is None else \
                f"{push.next_chunk} of version {push.version}"
            raise failed_precondition(
                f"chunk_index: got chunk {request.chunk_index} of version {request.version}, expected chunk "
                f"{expected}; fix: send a push's chunks in order, or restart it with chunk_index 0")
    received = set() if request.chunk_index == 0 else set(push.received)
    adapter = parse_adapter(request.adapter, facts.parameters) if request.HasField("adapter") else None
    if request.chunk_index > 0 and adapter != push.adapter:
        raise invalid_argument("adapter", None, f"chunk {request.chunk_index} declares another adapter (or none) "
                               "than chunk 0 of the push", "send the same adapter on every chunk of a push")
    # What the push must carry: every parameter of the model, or every tensor of the adapter.
    expected = facts.parameters if adapter is None else adapter.tensor_shapes(facts.parameters)

    if any(b < 0 for b in request.bucket_bytes):
        raise invalid_argument("bucket_bytes", None, "a bucket size is negative", "send the sizes from plan_buckets")
    try:
        slots = slots_from_proto(request.params)
    except ValueError as exc:
        raise invalid_argument("params[].dtype", None, str(exc), f"send every tensor in {dtype_name(facts.dtype)}") from None
    for i, slot in enumerate(slots):
        item = f"parameter {slot.name!r}"
        if slot.name not in expected and adapter is not None:
            raise invalid_argument("params[].name", item, "not a tensor of the declared adapter",
                                   "send only <target>.lora_A.weight and <target>.lora_B.weight of the modules in "
                                   "adapter.target_modules")
        if slot.name not in expected:
            raise invalid_argument("params[].name", item, "the model has no parameter of that name",
                                   "send Hugging Face parameter names of this model "
                                   "(GetModelInfo with include_parameters lists them)")
        if slot.shape != expected[slot.name]:
            whose = "the model's" if adapter is None else f"the adapter's (rank {adapter.rank} on the base weight)"
            raise invalid_argument("params[].shape", item, f"shape {list(slot.shape)} differs from {whose} "
                                   f"{list(expected[slot.name])}", "send the full, unsharded tensor")
        if slot.dtype != facts.dtype:
            raise invalid_argument("params[].dtype", item, f"dtype {dtype_name(slot.dtype)} differs from the engine's "
                                   f"{dtype_name(facts.dtype)}", f"cast to {dtype_name(facts.dtype)} before sending")
        if slot.name in received:
            raise invalid_argument("params[].name", item, "already received in an earlier chunk of this push",
                                   "send each parameter once per push")
    try:
        check_layout(slots, list(request.bucket_bytes))
    except ValueError as exc:
        raise invalid_argument("params[].bucket/offset_bytes", None, str(exc),
                               "lay the chunk out with services.common.weights.plan_buckets") from None

    if backend == "ipc":
        buckets_needed = set(range(len(request.bucket_bytes)))
        buckets_given = {b.bucket for b in request.ipc_buckets}
        if buckets_needed - buckets_given:
            raise invalid_argument("ipc_buckets", None, f"no handle for buckets {sorted(buckets_needed - buckets_given)}",
                                   "share every bucket with services.common.weights.share_bucket_ipc")
    elif request.ipc_buckets:
        raise invalid_argument("ipc_buckets", None, f"handles sent, but the transfer backend is {backend}",
                               "send ipc_buckets only after InitWeightTransfer with backend IPC")

    if request.final:
        missing = sorted(set(expected) - received - {s.name for s in slots})
        if missing:
            whole = "every parameter of the model" if adapter is None else "every tensor of the adapter's targets"
            raise invalid_argument("params", None, f"the push is final but lacks {len(missing)} parameters, e.g. "
                                   f"{missing[:5]}", f"a push must carry {whole}")
    return WeightChunk(chunk_index=int(request.chunk_index), final=bool(request.final), slots=slots,
                       bucket_sizes=[int(b) for b in request.bucket_bytes],
                       ipc_buckets=[b.SerializeToString() for b in request.ipc_buckets], adapter=adapter)

