"""--dry_run of the services started by hand (`rlmesh serve rollout|reward|learner`, the same mains as
`python -m services.X`): the flags and what the start would read are checked, the plan is printed and
the command exits 0 with no process, worker, listening socket or model started; what a start would
fail on is one config line naming the flag (exit 2)."""

from __future__ import annotations

import multiprocessing
import shutil

import pytest

from services import cli
from services.common import config
from services.common.memory_estimate import parameter_count
from tests.coordinator.test_dry_run import nothing_starts  # noqa: F401 - the fixture


@pytest.fixture
def serve(nothing_starts, monkeypatch, capsys):  # noqa: F811 - the imported fixture
    """Runs `rlmesh serve ARGS --dry_run` here; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(config, "PROGRAM", "")  # the dispatch names the program for this process

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = cli.main(["serve", *map(str, args), "--dry_run"])
        except SystemExit as exc:  # the parser's own refusals exit there, as in a real start
            code = exc.code
        out, err = capsys.readouterr()
        assert not multiprocessing.active_children()
        return code, out, err

    return run


def test_rollout_plan(serve, tiny_model_dir):
    code, out, _ = serve("rollout", "--pretrain", tiny_model_dir, "--engine", "hf", "--port", "50123",
                         "--served_model_name", "tiny")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "dry run (rollout): nothing was started"
    assert f"model    {tiny_model_dir} ({parameter_count(str(tiny_model_dir)):,} parameters), served as tiny" in lines
    assert any(line.startswith("engine   hf on ") for line in lines)
    assert "serves   gRPC on 127.0.0.1:50123 (plaintext, no token)" in out


def test_rollout_refusals_name_the_flag(serve, tiny_model_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare)
    code, _, err = serve("rollout", "--pretrain", bare)
    assert code == 2 and f"--pretrain {bare}: no weight files" in err
    shutil.copy(tiny_model_dir / "model.safetensors", bare)
    code, _, err = serve("rollout", "--pretrain", bare)
    assert code == 2 and f"--pretrain {bare}: no tokenizer there" in err
    code, _, err = serve("rollout", "--pretrain", tiny_model_dir, "--host", "0.0.0.0")
    assert code == 2 and "would serve --host 0.0.0.0 without a token" in err and len(err.splitlines()) == 1


def test_reward_plans_and_refusals(serve, tiny_model_dir, tiny_reward_model_dir, tmp_path):
    code, out, _ = serve("reward", "--reward_pretrain", tiny_reward_model_dir, "--ref_pretrain", tiny_model_dir,
                         "--device", "cpu")
    assert code == 0
    assert f"rewards  reward model {tiny_reward_model_dir} ({parameter_count(str(tiny_reward_model_dir)):,} " \
           "parameters, float32 on cpu" in out
    assert f"reference {tiny_model_dir} (" in out
    functions = tmp_path / "reward.py"
    functions.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                         "    return 1.0\n")
    code, out, _ = serve("reward", "--remote_rm_url", functions, "--metrics_port", "9101")
    assert code == 0 and f"rewards  reward function compute_score of {functions}" in out and "port 9101" in out
    code, out, _ = serve("reward", "--remote_rm_url", "http://10.0.0.1:5000/get_reward")
    assert code == 0 and "remote reward server(s) http://10.0.0.1:5000/get_reward (http; not contacted)" in out
    other = tmp_path / "other.py"
    other.write_text("def score(x):\n    return 1.0\n")
    code, _, err = serve("reward", "--remote_rm_url", other)
    assert code == 2 and f"{other} defines no reward_func or compute_score; name the function as FILE.py:NAME" in err
    code, out, _ = serve("reward", "--remote_rm_url", f"{other}:score")
    assert code == 0 and "reward function score of" in out


def test_learner_plan_with_a_critic_over_two_local_ranks(serve, tiny_model_dir, tiny_reward_model_dir):
    code, out, _ = serve("learner", "--pretrain", tiny_model_dir, "--critic_pretrain", tiny_reward_model_dir,
                         "--num_gpus", "2", "--zero_stage", "3", "--bf16")
    assert code == 0, out
    assert f"actor    {tiny_model_dir} ({parameter_count(str(tiny_model_dir)):,} parameters)" in out
    assert f"critic   {tiny_reward_model_dir} (" in out
    assert "ranks    2 on " in out and "rank 0 starts rank 1 on this machine" in out
    assert "training ZeRO-3, bf16" in out and "of model states (actor and critic" in out
    code, _, err = serve("learner", "--pretrain", tiny_model_dir, "--critic_pretrain", tiny_model_dir / "absent")
    assert code == 2 and "--critic_pretrain" in err and "absent" in err
