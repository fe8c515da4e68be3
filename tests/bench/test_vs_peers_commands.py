"""bench/gpu/vs_peers.py --liger: each framework gets liger-kernel through its own switch, and only then
(rlmesh's --use_liger_kernel itself: tests/coordinator/test_config.py)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import vs_peers  # noqa: E402

SWITCH = {"rlmesh": "--use_liger_kernel", "openrlhf": "--ds.use_liger_kernel", "trl": "--liger",
          "verl": "actor_rollout_ref.model.use_liger=True"}


@pytest.mark.parametrize("liger", [False, True])
def test_each_framework_gets_its_own_liger_switch_only_when_asked(tmp_path, liger):
    args = vs_peers.parse_args(["--liger"] if liger else [])
    job = vs_peers.jobs_of(args)["A"]
    paths = {name: tmp_path / name for name in ("prompts", "reward", "verl_data", "verl_reward")}
    for framework, switch in SWITCH.items():
        command = vs_peers.COMMANDS[framework](job, tmp_path / "model", paths, tmp_path / "work", tmp_path / "scratch",
                                               args)
        assert (switch in command) is liger, (framework, command)
    # TRL's child parses the switch into its GRPOConfig's use_liger_kernel.
    assert vs_peers.parse_args(["--role", "trl", *(["--liger"] if liger else [])]).liger is liger

