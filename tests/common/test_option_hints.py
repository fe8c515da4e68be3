"""Command-line messages: the program is named as the user typed it, an unknown option names the
nearest known one, and OpenRLHF options rlmesh lacks say so and what to use."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from services.common.config import parse_config
from services.common.option_hints import OPENRLHF_ONLY
from services.coordinator.config import CoordinatorConfig
from services.learner.train_sft import SFTConfig

REPO = pathlib.Path(__file__).resolve().parents[2]


def errors_of(cls, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_config(cls, argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_unknown_options_name_the_nearest_known_one(capsys):
    err = errors_of(CoordinatorConfig, ["--actor_num_node", "2", "--vllm_num_engine", "1"], capsys)
    assert "--actor_num_node is not an option of this command; did you mean --actor_num_nodes?" in err
    assert "did you mean --vllm_num_engines?" in err
    assert "usage:" not in err  # the sentence, not argparse's page of usage
    err = errors_of(CoordinatorConfig, ["--actor.num_node", "2"], capsys)
    assert "did you mean --actor.num_nodes?" in err
    err = errors_of(SFTConfig, ["--learning_rat", "1e-5"], capsys)
    assert "did you mean --learning_rate?" in err


def test_openrlhf_options_rlmesh_lacks_say_what_to_use(capsys):
    err = errors_of(SFTConfig, ["--optim", "muon"], capsys)
    assert "--optim is an option of OpenRLHF that rlmesh does not have: rlmesh trains with AdamW only" in err
    err = errors_of(CoordinatorConfig, ["--ring_attn_size", "4"], capsys)
    assert "--ring_attn_size is an option of OpenRLHF that rlmesh does not have: ring attention" in err
    # Given with OpenRLHF's default (what rlmesh does anyway) such an option is noted and dropped: parsing
    # goes on to the next problem, here the missing model.
    err = errors_of(SFTConfig, ["--optim", "adam", "--use_ms"], capsys)
    assert "note: --optim is an option of OpenRLHF" in err and "note: --use_ms is an option of OpenRLHF" in err
    assert "--pretrain" in err
    # An option another rlmesh command has names that command.
    err = errors_of(SFTConfig, ["--stop_properly_penalty_coef", "0.1"], capsys)
    assert "--stop_properly_penalty_coef is not an option of this command: an RL reward option: `rlmesh train" in err
    # A flag rlmesh has takes precedence over the table.
    assert not set(OPENRLHF_ONLY) & {"actor_num_nodes", "bf16", "flash_attn", "zero_stage"}


@pytest.mark.parametrize("command, prog", [
    ([sys.executable, "-m", "services.learner.train_sft", "--nonsense"], "python -m services.learner.train_sft"),
    ([sys.executable, "-m", "services.coordinator.train_ppo_ray", "--help"], "python -m services.coordinator.train_ppo_ray"),
    ([sys.executable, "-m", "services.cli", "dpo", "--help"], "rlmesh dpo"),
    ([sys.executable, "-m", "services.rollout", "--pretrian", "x"], "python -m services.rollout"),
    ([sys.executable, "-m", "services.cli", "serve", "reward", "--pretrian", "x"], "rlmesh serve reward"),
])
def test_the_program_is_named_as_typed(command, prog):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert f"usage: {prog} " in text or f"{prog}: " in text or text.startswith(f"usage: {prog}"), text[-2000:]
    assert "__main__" not in text.splitlines()[0]
