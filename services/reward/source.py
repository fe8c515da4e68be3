"""The one interface every reward source implements, and the checks on what sources return.

A source turns a `ScoreBatch` into a `SourceScores`: the reward model, the rule rewards, remote HTTP
and gRPC reward servers and reward function files all sit behind `RewardSource.score`. Whatever a
source returns is validated here (`scores_from_payload`): a missing field, a wrong length, a
non-number, NaN or infinity is an error naming where it came from and the sample index, never a
silent zero.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers

import grpc
import numpy as np
import torch

from services.common.errors import ServiceError


@dataclasses.dataclass
class ScoreBatch:
    """Samples to score; every list has one entry per sample."""

    queries: list[str]
    prompts: list[str]
    responses: list[str]
    labels: list[str]
    sample_ids: list[str]
    data_sources: list[str]
    # Token ids per sample (1-D int tensors) when the caller sent them, else None.
    prompt_token_ids: list[torch.Tensor] | None = None
    response_token_ids: list[torch.Tensor] | None = None
    # Each row's extra_info as JSON object text ("" = {}), when the caller sent any, else None.
    extra_infos: list[str] | None = None

    def __len__(self) -> int:
        return len(self.queries)

    def slice(self, start: int, stop: int) -> ScoreBatch:
        part = lambda xs: None if xs is None else xs[start:stop]  # noqa: E731
        return ScoreBatch(self.queries[start:stop], self.prompts[start:stop], self.responses[start:stop],
                          self.labels[start:stop], self.sample_ids[start:stop], self.data_sources[start:stop],
                          part(self.prompt_token_ids), part(self.response_token_ids), part(self.extra_infos))

    def describe(self, index: int) -> str:
        """'sample 5 (id "p3/1")' for error messages."""
        sid = self.sample_ids[index] if index < len(self.sample_ids) else ""
        return f'sample {index} (id "{sid}")' if sid else f"sample {index}"

    @classmethod
    def from_texts(cls, prompts: list[str], responses: list[str], labels: list[str] | None = None,
                   **fields) -> ScoreBatch:
        """A batch from prompt and response texts; queries default to prompt + response."""
        n = len(prompts)
        return cls(queries=fields.pop("queries", None) or [p + r for p, r in zip(prompts, responses)],
                   prompts=list(prompts), responses=list(responses), labels=list(labels or [""] * n),
                   sample_ids=fields.pop("sample_ids", None) or [""] * n,
                   data_sources=fields.pop("data_sources", None) or [""] * n, **fields)


@dataclasses.dataclass
class SourceScores:
    """What a source returns for a batch of n samples (float64 arrays of shape (n,))."""

    rewards: np.ndarray
    scores: np.ndarray
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Metrics given once per call, not per sample: name -> (sum of value x samples of the call, samples).
    batch: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def concat(parts: list[SourceScores]) -> SourceScores:
        """Joins the results of consecutive chunks; an extra metric missing from a chunk is NaN there."""
        if not parts:
            return SourceScores(np.zeros(0), np.zeros(0), {})
        names = sorted({k for p in parts for k in p.extra})
        extra = {k: np.concatenate([p.extra.get(k, np.full(len(p.rewards), np.nan)) for p in parts])
                 for k in names}
        return SourceScores(np.concatenate([p.rewards for p in parts]),
                            np.concatenate([p.scores for p in parts]), extra, merge_batch_metrics(parts))


def merge_batch_metrics(parts) -> dict[str, tuple[float, int]]:
    """Adds up the (weighted sum, samples) of each batch metric over parts that have a `batch` dict."""
    merged: dict[str, tuple[float, int]] = {}
    for part in parts:
        for name, (weighted_sum, samples) in part.batch.items():
            total, count = merged.get(name, (0.0, 0))
            merged[name] = (total + weighted_sum, count + samples)
    return merged


class RewardSource(abc.ABC):
    """A way to compute rewards. `kind` labels metrics and answers: model, http, grpc, function, rule."""

    kind: str = ""
    requires_labels: bool = False
    requires_token_ids: bool = False
    # The latest failed attempt ("" if none), for the message when a caller's deadline cuts scoring short.
    last_error: str = ""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for logs and GetRewardInfo: the model path, URLs, file or rule names."""

    @abc.abstractmethod
    async def score(self, batch: ScoreBatch) -> SourceScores:
        """Scores every sample of the batch (raises ServiceError with a status code on failure)."""

    async def start(self) -> None:
        """Acquires what needs the event loop (HTTP sessions, gRPC channels, worker pools)."""

    async def close(self) -> None:
        """Releases what start() acquired."""


# ----------------------------------------------------------------------------------------------
# Validation of what remote servers and reward functions return


class InvalidScores(Exception):
    """A source's answer does not hold one finite number per sample; the message says which."""


def finite_values(values, n: int, field: str, offset: int = 0) -> np.ndarray:
    """A list / tuple / array / tensor of n finite numbers -> float64 array (n,).

    offset is added to indices in messages, so they count samples of the whole request.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().float().cpu().reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        values = values.reshape(-1).tolist()
    if not isinstance(values, (list, tuple)):
        raise InvalidScores(f"'{field}' must be a list of {n} numbers, got {type(values).__name__}")
    if len(values) != n:
        raise InvalidScores(f"'{field}' has {len(values)} values for {n} samples "
                            f"(samples {offset}..{offset + n - 1})")
    out = np.empty(n, dtype=np.float64)
    for i, v in enumerate(values):
        # bool is an int subclass; a true/false reward is almost surely a server bug.
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidScores(f"'{field}'[{i}] (sample index {offset + i}) is {v!r}, not a number")
        if not math.isfinite(v):
            raise InvalidScores(f"'{field}'[{i}] (sample index {offset + i}) is {v}; rewards must be finite")
        out[i] = float(v)
    return out


def _scalar(value) -> float | None:
    """value as a float if it is one number (a Python number, or a tensor / array of no dimension)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def per_sample_values(values, n: int, field: str, offset: int = 0) -> np.ndarray:
    """finite_values, also taking one number for a one-sample call (OpenRLHF's per-sample convention)."""
    one = _scalar(values)
    if one is not None:
        if n != 1:
            raise InvalidScores(f"'{field}' is one number ({one:g}) for {n} samples (samples {offset}.."
                                f"{offset + n - 1}); return one value per sample, or have each call score one "
                                "sample, as OpenRLHF does, with --remote_rm_batch_size 1")
        values = [one]
    return finite_values(values, n, field, offset)


def scores_from_payload(payload, n: int, offset: int = 0) -> SourceScores:
    """Parses {"rewards": [...], "scores"?: [...], "extra_logs"?: {name: [...] or a number}} or a bare list.

    One number is accepted for "rewards" and "scores" (and as the whole answer) when the call held one
    sample, as OpenRLHF reward servers and functions answer. An "extra_logs" entry given as one number
    is a metric of the whole call (e.g. the accuracy of its batch): it becomes a batch metric weighted by
    the call's n samples, never a value copied to every sample. Raises InvalidScores naming the field
    and the sample index.
    """
    if isinstance(payload, (list, tuple, np.ndarray, torch.Tensor)) or _scalar(payload) is not None:
        rewards = per_sample_values(payload, n, "rewards", offset)
        return SourceScores(rewards, rewards.copy(), {})
    if not isinstance(payload, dict):
        raise InvalidScores(f"expected a JSON object with 'rewards', got {type(payload).__name__}")
    if "rewards" not in payload:
        raise InvalidScores(f"no 'rewards' field (fields present: {sorted(payload)})")
    rewards = per_sample_values(payload["rewards"], n, "rewards", offset)
    scores = rewards.copy()
    if payload.get("scores") is not None:
        scores = per_sample_values(payload["scores"], n, "scores", offset)
    extra: dict[str, np.ndarray] = {}
    batch: dict[str, tuple[float, int]] = {}
    extra_logs = payload.get("extra_logs")
    if extra_logs is not None:
        if not isinstance(extra_logs, dict):
            raise InvalidScores(f"'extra_logs' must be an object of name: list, got {type(extra_logs).__name__}")
        for name, values in extra_logs.items():
            one = _scalar(values)
            if one is None:
                extra[str(name)] = finite_values(values, n, f"extra_logs.{name}", offset)
            elif not math.isfinite(one):
                raise InvalidScores(f"'extra_logs.{name}' is {one} for samples {offset}..{offset + n - 1}; "
                                    "metrics must be finite")
            else:
                batch[str(name)] = (one * n, n)
    return SourceScores(rewards, scores, extra, batch)


def invalid_response(origin: str, problem: str) -> ServiceError:
    """A source answered something unusable: FAILED_PRECONDITION, since retrying will not help."""
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"reward source {origin} returned an invalid answer: {problem}; "
                        "fix the reward server or function so that it returns one finite number per sample")
