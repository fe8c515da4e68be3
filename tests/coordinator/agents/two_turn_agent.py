"""A test agent in OpenRLHF's format that brings its own rewards: two model turns per episode, the
reward of the second being 1 when the answer's length is even (so a prompt's samples differ)."""

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        done = self.turn >= 2
        return {"rewards": float(done and len(states["action_text"]) % 2 == 0), "scores": 0.0,
                "environment_feedback": "" if done else " again: ", "done": done,
                "sampling_params": states.get("sampling_params", None)}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
