"""Reward models (`--reward_pretrain DIR`): a transformer body plus a linear head with one output,
read at each sequence's last non-padding token.

Two checkpoint layouts load the same way: Hugging Face AutoModelForSequenceClassification with one
label (head `score`), and the value-head layout written by RLHF reward-model trainers (head
`value_head`, or the name in the config's `value_head_prefix`, with the config's `normalize_reward`,
`mean` and `std`). The body is loaded with AutoModel and the head weight is read from the
checkpoint's files, so both layouts run the same code and the score never depends on how a class
guesses the last token from pad ids.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading

import grpc
import numpy as np
import torch
import transformers
from safetensors import safe_open

from services.common.config import ConfigError
from services.common.errors import ServiceError, invalid_argument
from services.common.logprobs import position_ids_from_mask
from services.common.rl_math import last_token_values
from services.reward.source import RewardSource, ScoreBatch, SourceScores


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available here; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def read_tensor(model_dir: pathlib.Path, key: str) -> torch.Tensor | None:
    """One tensor from a checkpoint's safetensors (single file or index) or pytorch_model.bin; None if absent."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        file = json.loads(index.read_text())["weight_map"].get(key)
        files = [model_dir / file] if file else []
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    binary = model_dir / "pytorch_model.bin"
    if not files and binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True).get(key)
    return None


def warm_up_sequences(vocab_size: int, max_positions: int | None) -> list[torch.Tensor]:
    """Two short dummy id sequences (64 and 48 tokens, fewer for a model with fewer positions) for the
    one forward pass a model on a GPU runs as it loads: the first forward on a device loads its
    kernels and sets up cuBLAS (seconds), which would otherwise fall in the first step's scoring."""
    n = min(64, max_positions or 64)
    return [torch.arange(n) % vocab_size, torch.arange(n - n // 4) % vocab_size]


def pad_right(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D id tensors -> input_ids (B, T) padded on the right with pad_id, attention_mask (B, T)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return ids, mask


class RewardModel:
    """A loaded reward model: `scores(sequences)` -> raw scores; thread-safe (one forward at a time)."""

    def __init__(self, model_dir: str, device: str = "auto", dtype: str = "auto", micro_batch_size: int = 16,
                 value_head_prefix: str = "", attn_implementation: str = "sdpa"):
        path = pathlib.Path(model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--reward_pretrain {model_dir}: no config.json; give a Hugging Face model folder")
        self.path = path
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.micro_batch_size = micro_batch_size
        config = transformers.AutoConfig.from_pretrained(path)
        self.config = config
        head_name = value_head_prefix or getattr(config, "value_head_prefix", None) or "score"
        head = read_tensor(path, f"{head_name}.weight")
        if head is None:
            raise ConfigError(f"--reward_pretrain {model_dir}: no '{head_name}.weight' tensor; set "
                              "--value_head_prefix to the head's name (e.g. value_head or score)")
        if head.shape[0] != 1:
            raise ConfigError(f"--reward_pretrain {model_dir}: head '{head_name}' has {head.shape[0]} outputs; "
                              "a reward model has exactly one label")
        self.head_name = head_name
        self.head_weight = head.to(self.device, self.dtype)  # (1, H)
        bias = read_tensor(path, f"{head_name}.bias")
        self.head_bias = None if bias is None else bias.to(self.device, self.dtype)
        # The body's weights are the checkpoint's minus the head; AutoModel drops the head prefix.
        transformers.logging.set_verbosity_error()
        self.body = transformers.AutoModel.from_pretrained(path, dtype=self.dtype,
                                                           attn_implementation=attn_implementation)
        self.body.to(self.device).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.mean = float(getattr(config, "mean", 0.0) or 0.0)
        self.std = float(getattr(config, "std", 1.0) or 1.0)
        self.has_norm_stats = hasattr(config, "mean") and hasattr(config, "std")
        self._lock = threading.Lock()
        if self.device.type == "cuda":
            self.scores(warm_up_sequences(int(getattr(config, "vocab_size", 2) or 2), self.max_positions))

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask (B, T) -> raw scores (B,) float32 on CPU."""
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                           use_cache=False).last_hidden_state  # (B, T, H)
        per_token = torch.nn.functional.linear(hidden, self.head_weight, self.head_bias).squeeze(-1)  # (B, T)
        return last_token_values(per_token, mask).float().cpu()

    def scores(self, seqs: list[torch.Tensor]) -> np.ndarray:
        """Raw scores (n,) of 1-D token id sequences, in micro-batches sorted by length."""
        out = np.empty(len(seqs), dtype=np.float64)
        # Longest first: similar lengths share a micro-batch, so little compute goes to padding.
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        with self._lock:
            for start in range(0, len(order), self.micro_batch_size):
                rows = order[start:start + self.micro_batch_size]
                ids, mask = pad_right([seqs[i] for i in rows], self.pad_id)
                out[rows] = self._forward(ids, mask).double().numpy()
        return out


class ModelRewardSource(RewardSource):
    """Scores samples with a RewardModel; rewards are normalised by the checkpoint's mean/std on request."""

    kind = "model"

    def __init__(self, model: RewardModel, use_token_ids: bool = False, normalize: bool = False):
        if normalize and not model.has_norm_stats:
            raise ConfigError(f"--normalize_reward: {model.path}/config.json has no 'mean' and 'std'; "
                              "drop --normalize_reward or use a checkpoint trained with reward normalisation")
        self.model = model
        self.use_token_ids = use_token_ids
        self.requires_token_ids = use_token_ids
        self.normalize = normalize

    def describe(self) -> str:
        norm = f", normalised by mean {self.model.mean:g} std {self.model.std:g}" if self.normalize else ""
        return f"{self.model.path} ({self.model.dtype}, {self.model.device}{norm})"

    def _sequences(self, batch: ScoreBatch) -> list[torch.Tensor]:
        if self.use_token_ids:
            if batch.prompt_token_ids is None or batch.response_token_ids is None:
                raise invalid_argument("prompt_token_ids/response_token_ids", None, "missing, and this reward "
                                       "model scores token ids (--reward_input token_ids)",
                                       "send both token id tensors, or start the service with --reward_input text")
            seqs = [torch.cat([p.long(), r.long()]) for p, r in zip(batch.prompt_token_ids, batch.response_token_ids)]
        else:
            # The text is scored as given: chat templates already wrote any BOS/EOS markers into it.
            encoded = self.model.tokenizer(batch.queries, add_special_tokens=False)["input_ids"]
            seqs = [torch.tensor(ids, dtype=torch.long) for ids in encoded]
        vocab = self.model.config.vocab_size
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise invalid_argument("samples[].query", batch.describe(i), "has no tokens to score",
                                       "send a non-empty prompt/response or query")
            if self.model.max_positions and len(s) > self.model.max_positions:
                raise invalid_argument("samples[].query", batch.describe(i), f"has {len(s)} tokens, more than the "
                                       f"reward model's {self.model.max_positions} positions",
                                       "shorten the prompt or response (--prompt_max_len / --generate_max_len)")
            if int(s.min()) < 0 or int(s.max()) >= vocab:
                raise invalid_argument("prompt_token_ids/response_token_ids", batch.describe(i),
                                       f"token ids must lie in [0, {vocab})", "send ids of the reward model's tokenizer")
        return seqs

    async def score(self, batch: ScoreBatch) -> SourceScores:
        if len(batch) == 0:
            return SourceScores(np.zeros(0), np.zeros(0), {})
        # Tokenizing thousands of long texts takes a while: off the event loop, like the forward.
        seqs = await asyncio.to_thread(self._sequences, batch)
        try:
            raw = await asyncio.to_thread(self.model.scores, seqs)
        except torch.OutOfMemoryError as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"reward model ran out of memory: {exc}; lower --reward_micro_batch_size") from None
        rewards = (raw - self.model.mean) / self.model.std if self.normalize else raw.copy()
        return SourceScores(rewards, raw, {})
