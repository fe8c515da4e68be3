"""veRL's reward function convention, served as an OpenRLHF-style batch reward function.

A veRL user's custom reward file (`custom_reward_function.path` / `.name`, default name
compute_score) defines one of

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 1.0                     # a number (or bool), or
        return {"score": 1.0, "acc": True, "pred": "72"}   # "score" is the reward, the rest is logged

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        return [1.0, 0.0, ...]         # the batch form: one number or dict per sample

either of them possibly `async def`. `as_batch_reward_func` wraps such a function into
reward_func(queries, prompts, labels, responses, data_sources): solution_str is the response text
(the model's tokens decoded, without the prompt), ground_truth the sample's label (a veRL dataset's
`--label_key reward_model.ground_truth`), data_source the row's data_source, extra_info the row's
`extra_info` column (a dict, as veRL's data preparation writes it; {} for a row without one). Of a dict
answer, "score" is the reward and every other key whose values are numbers (or bools) in all the
samples of the call becomes a per-sample extra log (reward/<key>); other keys (strings such as
"pred") are dropped.

Runs inside the reward function worker (function_worker.py): imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable

PER_SAMPLE = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def convention(func: Callable) -> str:
    """"verl" (one sample per call), "verl_batch", or "openrlhf" (reward_func(queries, prompts, labels))."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return "openrlhf"
    if "solution_str" in params:
        return "verl"
    if "solution_strs" in params:
        return "verl_batch"
    return "openrlhf"


def accepted(func: Callable, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that func takes as keyword arguments (all of them with **kwargs)."""
    params = inspect.signature(func).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return [n for n in names if takes_all or n in params]


def _number(value) -> float | None:
    if hasattr(value, "item") and callable(value.item):  # a numpy or torch scalar
        value = value.item()
    return float(value) if isinstance(value, (int, float)) else None  # bool is an int


def _answers_to_payload(answers: list, origin: str) -> dict:
    """veRL answers (numbers or {"score": ..., ...} dicts) -> {"rewards": [...], "extra_logs": {...}}."""
    rewards: list[float] = []
    logs: list[dict[str, float]] = []
    for i, answer in enumerate(answers):
        if isinstance(answer, dict):
            if "score" not in answer:
                raise ValueError(f"{origin} answered a dict without 'score' for sample {i} (keys {sorted(answer)}); "
                                 "return a number, or a dict whose 'score' is the reward")
            reward = _number(answer["score"])
            logs.append({str(k): v for k, v in ((k, _number(v)) for k, v in answer.items() if k != "score")
                         if v is not None and math.isfinite(v)})
        else:
            reward = _number(answer)
            logs.append({})
        if reward is None:
            raise ValueError(f"{origin} answered {answer!r} for sample {i}; return a number (or bool), or a dict "
                             "whose 'score' is one")
        rewards.append(reward)
    shared = set(logs[0]).intersection(*logs[1:]) if logs else set()
    return {"rewards": rewards, "extra_logs": {k: [log[k] for log in logs] for k in sorted(shared)}}


def as_batch_reward_func(func: Callable, origin: str) -> Callable:
    """func (a veRL compute_score, either form) as reward_func(queries, prompts, labels, responses, data_sources,
    extra_infos)."""
    form = convention(func)
    if form == "openrlhf":
        raise ValueError(f"{origin} takes neither solution_str nor solution_strs: not veRL's compute_score")
    is_async = inspect.iscoroutinefunction(func)
    takes = set(accepted(func, BATCH if form == "verl_batch" else PER_SAMPLE))  # once, not per call

    def arguments(names: tuple[str, ...], values: tuple) -> dict:
        """The keyword arguments veRL passes, less those the function does not take."""
        return {n: v for n, v in zip(names, values) if n in takes}

    def reward_func(queries, prompts, labels, responses=None, data_sources=None, extra_infos=None):
        n = len(queries)
        responses = list(responses) if responses is not None else [""] * n
        sources = list(data_sources) if data_sources is not None else [""] * n
        infos = list(extra_infos) if extra_infos is not None else [{} for _ in range(n)]
        if form == "verl_batch":
            kwargs = arguments(BATCH, (sources, responses, list(labels), infos))
            answers = asyncio.run(func(**kwargs)) if is_async else func(**kwargs)
            if isinstance(answers, (str, bytes)) or not hasattr(answers, "__len__") or len(answers) != n:
                raise ValueError(f"{origin} answered {type(answers).__name__} for {n} samples; return one number or "
                                 "dict per sample")
            answers = list(answers)
        else:
            calls = [arguments(PER_SAMPLE, (s, r, g, i)) for s, r, g, i in zip(sources, responses, labels, infos)]
            if is_async:
                async def all_samples():
                    return await asyncio.gather(*(func(**kwargs) for kwargs in calls))
                answers = asyncio.run(all_samples())
            else:
                answers = [func(**kwargs) for kwargs in calls]
        return _answers_to_payload(list(answers), origin)

    return reward_func
