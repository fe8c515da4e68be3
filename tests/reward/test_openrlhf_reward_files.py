"""Reward files written for OpenRLHF import its helpers (ProRL v2's math_reward_func.py: `from
openrlhf.utils import extract_boxed_answer, grade_answer`): they run here without OpenRLHF, in the
reward function workers, and an import of something rlmesh does not provide fails at validation,
before any service starts, naming the import and the file."""

import asyncio

import numpy as np
import pytest

from services.common.config import ConfigError, build_parser, config_from_args
from services.common.openrlhf_compat import missing_imports
from services.coordinator.config import CoordinatorConfig
from services.reward.config import RewardConfig
from services.reward.function_source import FunctionRewardSource
from services.reward.source import ScoreBatch

# Written like ProRL v2's math reward file (the same imports and return form), in words of our own.
PRORL_STYLE = '''
from typing import List

import torch

from openrlhf.utils import extract_boxed_answer, grade_answer
from openrlhf.utils.math_utils import mathd_normalize_answer


def reward_func(queries: List[str], prompts: List[str], labels: List[str], **kwargs) -> dict:
    scores = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if prompt in query else query
        scores.append(1.0 if grade_answer(extract_boxed_answer(response), label) else 0.0)
    scores = torch.tensor(scores)
    return {"rewards": scores, "scores": scores,
            "extra_logs": {"math_accuracy": scores.mean(), "normalised": torch.tensor(
                [float(mathd_normalize_answer(label) == "\\\\frac{1}{2}") for label in labels])}}
'''


def test_a_prorl_style_reward_file_scores_in_the_workers(tmp_path):
    path = tmp_path / "math_reward_func.py"
    path.write_text(PRORL_STYLE)
    assert missing_imports(str(path)) == []
    source = FunctionRewardSource.from_file(str(path), timeout_s=30, batch_size=4)
    responses = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}", "no box: 1/2"]
    labels = ["0.5", "\\frac12", "1/2", "1/2"]

    async def score():
        await source.start()
        try:
            return await source.score(ScoreBatch.from_texts(["Q: half?"] * 4, responses, labels))
        finally:
            await source.close()

    out = asyncio.run(score())
    np.testing.assert_array_equal(out.rewards, [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.extra["normalised"], [1.0, 1.0, 1.0, 1.0])


def test_an_import_not_provided_fails_at_validation_naming_it(tmp_path, tiny_model_dir, tiny_data_dir):
    path = tmp_path / "reward_with_tokenizer.py"
    path.write_text("import torch\nfrom openrlhf.utils import grade_answer, get_tokenizer\nimport openrlhf.models\n\n"
                    "def reward_func(queries, prompts, labels):\n    return torch.zeros(len(queries))\n")
    assert missing_imports(str(path)) == ["line 2: from openrlhf.utils import get_tokenizer",
                                          "line 3: import openrlhf.models"]
    coordinator = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
                   "--remote_rm_url", str(path), "--placement", "local", "--device", "cpu"]
    for cls, argv in ((CoordinatorConfig, coordinator), (RewardConfig, ["--remote_rm_url", str(path)])):
        with pytest.raises(ConfigError) as err:
            config_from_args(cls, build_parser(cls).parse_args(argv))
        message = str(err.value)
        assert f"--remote_rm_url {path} imports from OpenRLHF what rlmesh does not provide" in message, message
        assert "from openrlhf.utils import get_tokenizer" in message and "import openrlhf.models" in message
    # The agent API is for agent files: a reward file that imports it is told so; an agent file may.
    agent = tmp_path / "agent.py"
    agent.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n"
                     "from openrlhf.utils import grade_answer\n")
    assert missing_imports(str(agent), agent=True) == []
    assert missing_imports(str(agent)) == ["line 1: from openrlhf.utils.agent import AgentInstanceBase",
                                           "line 1: from openrlhf.utils.agent import MultiTurnAgentExecutor"]
