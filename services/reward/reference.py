"""The reference role (`--ref_pretrain DIR`): log-probs of response tokens under a frozen causal LM.

The numbers come from services.common.logprobs.sequence_logprobs, the function the learner uses
for the policy, so with the same weights, dtype, device and batch the two agree bit for bit.
"""

from __future__ import annotations

import pathlib
import threading

import torch
import transformers

from services.common.config import ConfigError
from services.common.logprobs import sequence_logprobs
from services.reward.model_source import pad_right, resolve_device, resolve_dtype, warm_up_sequences


class ReferenceModel:
    """A frozen causal LM; `response_logprobs` is thread-safe (one forward at a time)."""

    def __init__(self, model_dir: str, device: str = "auto", dtype: str = "auto", micro_batch_size: int = 16,
                 attn_implementation: str = "sdpa"):
        path = pathlib.Path(model_dir)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--ref_pretrain {model_dir}: no config.json; give a Hugging Face model folder")
        self.path = path
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.micro_batch_size = micro_batch_size
        transformers.logging.set_verbosity_error()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype,
                                                                       attn_implementation=attn_implementation)
        self.model.to(self.device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self._lock = threading.Lock()
        if self.device.type == "cuda":
            seqs = warm_up_sequences(self.vocab_size, self.max_positions)
            self.response_logprobs(seqs, [len(s) // 2 for s in seqs], 1.0)

    def describe(self) -> str:
        return f"{self.path} ({self.dtype}, {self.device})"

    @torch.inference_mode()
    def response_logprobs(self, seqs: list[torch.Tensor], starts: list[int], temperature: float) -> list[torch.Tensor]:
        """For each 1-D id sequence s with response start k: (len(s) - k,) float32 log-probs of s[k:].

        Sequences run in micro-batches of similar length, padded on the right.
        """
        out: list[torch.Tensor | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        with self._lock:
            for first in range(0, len(order), self.micro_batch_size):
                rows = order[first:first + self.micro_batch_size]
                ids, mask = pad_right([seqs[i] for i in rows], 0)
                logp = sequence_logprobs(self.model, ids.to(self.device), mask.to(self.device),
                                         temperature).cpu()  # (b, T-1): logp[:, t-1] scores token t
                for row, i in enumerate(rows):
                    out[i] = logp[row, starts[i] - 1:len(seqs[i]) - 1].clone()
        return out
