"""An agent file in OpenRLHF's format: arithmetic with one retry.

    rlmesh train --config examples/tiny_grpo.yaml --agent_func_path examples/agent_retry_arith.py

The prompt is a problem such as "12+7=" and the label its answer. The model answers with
\\boxed{...}; a right first answer earns 1 and ends the episode. A wrong one gets the feedback
" wrong, again: 12+7=" (environment tokens: in the context, not trained on) and a second turn; a
right second answer earns 0.5. So an episode is one or two model turns, and the policy learns
both to answer right and to use the feedback. extra_logs "solved" (right at either attempt) and
"attempts" are logged per step as reward/solved and reward/attempts.

The same file runs under OpenRLHF (`--agent_func_path`), which is what the import is for.
"""

import re

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
MAX_ATTEMPTS = 2


def final_answer(text: str) -> str:
    found = _BOXED.findall(text)
    return found[-1].strip() if found else ""


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.attempts = 0
        self.question = ""

    async def reset(self, states: dict, **kwargs):
        self.question = states["observation"]
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.attempts += 1
        correct = final_answer(states["action_text"]) == str(states["label"]).strip()
        done = correct or self.attempts >= MAX_ATTEMPTS
        reward = (1.0 if self.attempts == 1 else 0.5) if correct else 0.0
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "" if done else f" wrong, again: {self.question}",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"solved": torch.tensor(float(correct)), "attempts": torch.tensor(float(self.attempts))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
