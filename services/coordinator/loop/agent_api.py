"""OpenRLHF's agent API (`openrlhf.utils.agent`), so that OpenRLHF agent files run unchanged.

An agent file (--agent_func_path) does `from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor` and defines

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs): ...
        async def reset(self, states: dict, **kwargs) -> {"observation": str}
        async def step(self, states: dict, **kwargs) -> {"rewards", "scores", "environment_feedback",
                                                        "done", "sampling_params", "extra_logs"}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

The agent worker (services/coordinator/loop/agent_worker.py) registers this module under that name
before it loads the file; `llm_engine.generate` there goes to the rollout service. An executor may
also override `execute` (token in, token out) as in OpenRLHF.

MultiTurnAgentExecutor keeps the model's tokens exactly as generated: the episode's token list
grows by the generated ids and by the tokenized environment feedback, and is never re-tokenized;
`action_ranges` mark the model's tokens (trained on), everything else is context. It stops at
`done`, at `max_turns` model turns (set on the class by the worker) or when `max_length` tokens
leave no room to generate.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from abc import ABC, abstractmethod
from copy import deepcopy


@dataclasses.dataclass
class SamplingParams:
    """The sampling parameters an agent sees and may return (vLLM's names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    logprobs: int | None = 1  # not None: the engine's log-prob of each sampled token is returned
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    seed: int | None = None


class AgentInstanceBase(ABC):
    """One environment, bound to one episode."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Runs one episode: execute(...) returns the episode's tokens, action ranges, rewards and logs."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine):
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


def _as_float(value) -> float:
    """A reward as agents give it: a number, or a one-element tensor."""
    return float(value.item()) if hasattr(value, "item") else float(value)


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Alternates model turns and environment steps of one AgentInstance until it is done."""

    max_turns: int = 8  # model turns per episode; the agent worker sets it from --agent_max_turns

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_instance_cls!r} must be a subclass of AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine):
        # Earlier OpenRLHF examples declare `async def __init__`: await it instead of failing.
        agent = self.agent_instance_cls.__new__(self.agent_instance_cls)
        initialised = agent.__init__()
        if inspect.isawaitable(initialised):
            await initialised
        reset = await agent.reset({"observation": prompt, "label": label})
        observation_text = reset["observation"]
        tokens = hf_tokenizer(observation_text, add_special_tokens=False)["input_ids"]
        room = max_length - max(1, min(sampling_params.max_tokens, max_length // 2))
        if len(tokens) > room:  # keep the end of a long first observation, room to generate
            tokens = tokens[-room:]
            observation_text = hf_tokenizer.decode(tokens, skip_special_tokens=False)
        action_ranges: list[tuple[int, int]] = []
        rollout_log_probs = [0.0] * len(tokens)
        total_reward, scores, extra_logs = 0.0, None, {}
        step_seconds: list[float] = []
        for _ in range(self.max_turns):
            budget = min(sampling_params.max_tokens, max_length - len(tokens))
            if budget <= 0:
                break
            params = deepcopy(sampling_params)
            params.max_tokens = budget
            output = (await llm_engine.generate(list(tokens), params)).outputs[0]
            action = list(output.token_ids)
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            tokens += action  # exactly as generated: never decoded and encoded again
            rollout_log_probs += [lp[t].logprob for t, lp in zip(action, output.logprobs or [])] or [0.0] * len(action)
            t0 = time.monotonic()
            result = await agent.step({"observation_text": observation_text, "action_text": output.text,
                                       "label": label, "sampling_params": sampling_params})
            step_seconds.append(time.monotonic() - t0)
            total_reward += _as_float(result["rewards"])
            scores = result.get("scores", total_reward)
            extra_logs = result.get("extra_logs") or {}
            feedback = result.get("environment_feedback") or ""
            observation_text = observation_text + output.text + feedback
            if result["done"] or len(tokens) >= max_length:
                break
            feedback_ids = hf_tokenizer(feedback, add_special_tokens=False)["input_ids"] if feedback else []
            tokens += feedback_ids[:max(0, max_length - len(tokens))]
            rollout_log_probs += [0.0] * (len(tokens) - len(rollout_log_probs))
            if result.get("sampling_params") is not None:
                sampling_params = result["sampling_params"]
        return {"prompt": prompt, "label": label, "reward": total_reward,
                "scores": total_reward if scores is None else _as_float(scores),
                "observation_tokens": tokens, "action_ranges": action_ranges,
                "rollout_log_probs": rollout_log_probs, "extra_logs": extra_logs, "step_seconds": step_seconds}
