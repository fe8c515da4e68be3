"""A test agent in OpenRLHF's format: two model turns per episode ("wrong" after the first), except
that labels ending in 1 raise in step() and labels ending in 2 hang in step() (a blocking call)."""

import time

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        label = str(states["label"])
        if label.endswith("1"):
            raise ValueError(f"tool crashed on {label}")
        if label.endswith("2"):
            time.sleep(3600)  # a tool that never answers
        self.turn += 1
        done = self.turn >= 2
        return {"rewards": torch.tensor(float(len(states["action_text"]) % 2)), "scores": torch.tensor(0.0),
                "environment_feedback": "" if done else " wrong, again: ",
                "done": done, "sampling_params": states.get("sampling_params", None),
                "extra_logs": {"turn": torch.tensor(float(self.turn))}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
