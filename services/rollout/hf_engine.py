"""transformers fallback engine (`--engine hf`): the same RPCs on machines without vLLM.

A plain KV-cached decoding loop over a left-padded batch (position ids from the attention mask,
so every row sees the positions it would see alone), with vLLM's sampling order: temperature,
min-p, top-k/top-p, then one draw per sample from its own random generator. It runs one batch at
a time in a worker thread, so the gRPC event loop stays free; concurrent Generate calls queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.log import get_logger, log_event
from services.common.weights import DigestEntry, LoraAdapter, tensor_digest
from services.rollout import cpu_defaults
from services.rollout.config import RolloutConfig
from services.rollout.adapters import CheckpointWeights, adapter_weights
from services.rollout.engine import Engine, ModelFacts, Received, SampleResult, SampleSpec, Sampling, WeightChunk
from services.rollout.weight_receiver import WeightReceiver

log = get_logger("rollout")
_GREEDY_EPS = 1e-5  # temperatures below this decode greedily (as vLLM does)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Sampling transforms of next-token logits, in vLLM's order; masked entries become -inf.

    logits: (B, V) float32. Returns (B, V): logits / temperature, then tokens with probability
    below min_p * max probability dropped, then all but the top_k dropped, then the smallest tail
    whose total mass is below 1 - top_p dropped (the most likely token always survives).
    """
    logits = logits / max(temperature, _GREEDY_EPS)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclasses.dataclass
class _Row:
    """Decoding state of one sample of the batch."""

    spec: SampleSpec
    limit: int  # most new tokens for this row (max_tokens, capped by max_model_len)
    generator: torch.Generator
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str = ""
    text: str = ""


class HfEngine(Engine):
    def __init__(self, config: RolloutConfig):
        self.config = config
        device = config.hf_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        dtype, why = cpu_defaults.engine_dtype(config.dtype, on_cpu, cpu_defaults.read_cpu_flags() if on_cpu else set())
        log_event(log, "engine.options", dtype=dtype, dtype_from=why)
        dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(config.pretrain, trust_remote_code=config.trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.pretrain, dtype=dtype, trust_remote_code=config.trust_remote_code).to(self.device).eval()
        model_config = self.model.config
        limit = config.max_model_len or int(getattr(model_config, "max_position_embeddings", 0) or 2048)
        self.facts = ModelFacts(
            model_name=config.model_name,
            max_model_len=limit,
            vocab_size=int(model_config.vocab_size),
            dtype=self.model.dtype,
            engine_kind="hf",
            engine_version=f"transformers {transformers.__version__}",
            tensor_parallel_size=1,
            device=self.device.type,
            parameters={n: tuple(p.shape) for n, p in self.model.named_parameters()},
        )
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.receiver = WeightReceiver()
        self.seed_source = torch.Generator().manual_seed(config.seed)
        self._lock = asyncio.Lock()  # one batch (or weight chunk) on the model at a time
        self._running = 0
        # LoRA: the adapter tensors of the push under way, the targets merged by the last adapter
        # push, and the --pretrain checkpoint the merges start from (opened at the first).
        self._adapter_tensors: dict[str, torch.Tensor] = {}
        self._merged_targets: tuple[str, ...] = ()
        self._base: CheckpointWeights | None = None

    async def initial_digests(self) -> dict[str, DigestEntry]:
        return await asyncio.to_thread(self._digests)

    def _digests(self) -> dict[str, DigestEntry]:
        return {n: DigestEntry(p.dtype, tuple(p.shape), tensor_digest(p)) for n, p in self.model.named_parameters()}

    def running_samples(self) -> int:
        return self._running

    async def generate(self, specs: Sequence[SampleSpec], sampling: Sampling) -> AsyncIterator[SampleResult]:
        step = self.config.hf_max_batch_samples
        for start in range(0, len(specs), step):
            batch = list(specs[start:start + step])
            cancelled = threading.Event()
            async with self._lock:
                self._running += len(batch)
                decoding = asyncio.ensure_future(asyncio.to_thread(self._decode, batch, sampling, cancelled.is_set))
                try:
                    results = await asyncio.shield(decoding)
                except asyncio.CancelledError:
                    # The thread stops at its next step; keep the lock until it has, so batches never overlap.
                    cancelled.set()
                    await asyncio.gather(decoding, return_exceptions=True)
                    log_event(log, "generate.aborted", samples=len(batch))
                    raise
                finally:
                    self._running -= len(batch)
            for result in results:
                yield result

    @torch.no_grad()
    def _decode(self, specs: list[SampleSpec], sampling: Sampling, cancelled: Callable[[], bool]) -> list[SampleResult]:
        rows = []
        for spec in specs:
            seed = spec.seed(sampling)
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_source))
            limit = min(sampling.max_tokens, self.facts.max_model_len - len(spec.prompt_ids))
            rows.append(_Row(spec, limit, torch.Generator(device=self.device).manual_seed(seed)))
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        greedy = sampling.temperature < _GREEDY_EPS
        processed_mode = self.config.logprobs_mode == "processed_logprobs"

        width = max(len(s.prompt_ids) for s in specs)
        input_ids = torch.full((len(specs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(specs), width), dtype=torch.long)
        for i, spec in enumerate(specs):  # left padding: every prompt ends at the last column
            input_ids[i, width - len(spec.prompt_ids):] = torch.tensor(spec.prompt_ids)
            mask[i, width - len(spec.prompt_ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, width)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        next_position = positions[:, -1:] + 1  # (B, 1)

        for _ in range(max(r.limit for r in rows)):
            logits = out.logits[:, -1, :].float()  # (B, V)
            processed = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
            if greedy:
                tokens = logits.argmax(-1).tolist()
            else:
                probs = processed.softmax(-1)
                tokens = [int(torch.multinomial(probs[i], 1, generator=r.generator)) if not r.finish else self.pad_id
                          for i, r in enumerate(rows)]
            logprob_table = (processed if processed_mode and not greedy else logits).log_softmax(-1)
            for i, row in enumerate(rows):
                if row.finish:
                    continue
                row.tokens.append(tokens[i])
                row.logprobs.append(float(logprob_table[i, tokens[i]]))
                row.finish = self._finish(row, tokens[i], stop_ids, sampling.stop)
            if all(r.finish for r in rows) or cancelled():
                break
            step_ids = torch.tensor([[t] for t in tokens], device=self.device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=next_position,
                             past_key_values=out.past_key_values, use_cache=True)
            next_position = next_position + 1

        results = []
        for row in rows:
            text = row.text
            if sampling.return_text and not text:
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            results.append(SampleResult(spec=row.spec, token_ids=row.tokens,
                                        logprobs=row.logprobs if sampling.logprobs else None,
                                        finish_reason=row.finish or "abort", text=text))
        return results

    def _finish(self, row: _Row, token: int, stop_ids: set[int], stop: tuple[str, ...]) -> str:
        """"stop" / "length" when this token ends the row, else ""; a stop string also trims row.text."""
        if token in stop_ids:
            return "stop"
        if stop:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            hits = [text.find(s) for s in stop if s in text]
            if hits:
                row.text = text[:min(hits)]
                return "stop"
        return "length" if len(row.tokens) >= row.limit else ""

    async def open_weight_group(self, backend: str, master_address: str, master_port: int, world_size: int,
                                rank_offset: int, group_name: str, timeout_s: float) -> list[int]:
        rank = await asyncio.to_thread(self.receiver.open, backend, master_address, master_port, world_size,
                                       rank_offset, group_name, timeout_s)
        return [rank] if rank >= 0 else []

    async def receive_weights(self, chunk: WeightChunk) -> Received:
        params = dict(self.model.named_parameters())
        if chunk.chunk_index == 0:
            self._adapter_tensors = {}
            self._push_received: dict[str, DigestEntry] = {}

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            if chunk.adapter is not None:  # kept (the bucket buffers are reused) until the final chunk merges them
                self._adapter_tensors.update((name, tensor.clone()) for name, tensor in pairs)
                return
            self._merged_targets = ()
            for name, tensor in pairs:
                params[name].data.copy_(tensor)

        async with self._lock:
            digests = await asyncio.to_thread(self.receiver.receive, chunk, self.device, load)
            if chunk.adapter is not None and chunk.final:
                await asyncio.to_thread(self._merge_adapter, chunk.adapter, params)
        slots = {s.name: s for s in chunk.slots}
        received = {n: DigestEntry(slots[n].dtype, slots[n].shape, bytes.fromhex(d)) for n, d in digests.items()}
        if chunk.adapter is not None:  # merged into the parameters directly, as full pushes are
            return Received(received)
        self._push_received.update(received)
        if not chunk.final:
            return Received(received)
        return Received(received, await asyncio.to_thread(self._held, params, self._push_received))

    def _held(self, params: dict[str, torch.nn.Parameter], given: dict[str, DigestEntry]) -> dict[str, DigestEntry]:
        """The digests of what the model holds now, for every tensor of a push (transformers computes
        with the parameters themselves, a tied head with the embedding's); raises if one is not as given."""
        held = {n: DigestEntry(e.dtype, e.shape, tensor_digest(params[n])) for n, e in given.items()}
        wrong = sorted(n for n in given if held[n].digest != given[n].digest)
        if wrong:
            raise RuntimeError(f"the model holds other values than it was given for {len(wrong)} tensors: {wrong[:8]}")
        return held

    def _merge_adapter(self, adapter: LoraAdapter, params: dict[str, torch.nn.Parameter]) -> None:
        """Loads the --pretrain weights of the adapter's targets merged with it (adapters.py)."""
        if self._base is None:
            self._base = CheckpointWeights(self.config.pretrain)
        tensors, self._adapter_tensors = self._adapter_tensors, {}
        for name, weight in adapter_weights(adapter, tensors, self._base, self._merged_targets, self.facts.dtype,
                                            self.device):
            params[name].data.copy_(weight)
        self._merged_targets = adapter.targets

    async def reset_prefix_cache(self) -> None:
        return None  # no cache survives a batch

    def pause_unsupported_reason(self) -> str:
        return ("the hf engine (--engine hf) decodes a batch to its end and cannot take new weights in the middle; "
                "fix: serve the rollout with --engine vllm, or train without --partial_rollout")

    async def pause_generation(self) -> None:
        raise NotImplementedError(self.pause_unsupported_reason())

    async def resume_generation(self, version: int) -> None:
        raise NotImplementedError(self.pause_unsupported_reason())

    async def abort_frozen(self) -> None:
        raise NotImplementedError(self.pause_unsupported_reason())

    def sleep_unsupported_reason(self) -> str:
        return "the hf engine has no sleep mode; Sleep/WakeUp need --engine vllm with --enable_sleep_mode on a GPU"

    async def sleep(self, level: int) -> int:
        raise NotImplementedError(self.sleep_unsupported_reason())

    async def wake_up(self, tags: list[str]) -> bool:
        raise NotImplementedError(self.sleep_unsupported_reason())

    async def shutdown(self) -> None:
        self.receiver.close()
