"""OpenRLHF 0.11's example training scripts, run as shipped with only the module swapped, through
rlmesh's real entry points with --dry_run: each is accepted (parsed, placed, its model, data and
reward source checked, its plan printed) or refused naming the option, exactly as the table of
docs/guides/openrlhf-scripts.md says. The scripts' commands are those of test_openrlhf_cli.py, with
hub names replaced by the tiny local model and data (and lengths fitted to its context)."""

from __future__ import annotations

import pathlib
import re

import pytest

from services.common.user_errors import run_command
from services.coordinator.cli import train
from services.coordinator.config import CoordinatorConfig
from services.learner import train_dpo, train_rm, train_sft
from tests.coordinator.test_openrlhf_cli import SCRIPTS, localise, local  # noqa: F401 - `local` is a fixture

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "openrlhf-scripts.md"
MAINS = {CoordinatorConfig: train.main, train_sft.SFTConfig: train_sft.main, train_rm.RMConfig: train_rm.main,
         train_dpo.DPOConfig: train_dpo.main}


def exit_code(main, args: list[str]) -> int:
    """The command's exit code as its entry point gives it (a parse error exits through argparse)."""
    try:
        return run_command(main, args)
    except SystemExit as exc:
        return exc.code


def table() -> dict[str, str]:
    """script -> "accepted" or the option named in "refused: `--option`" (from the doc's table)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(train_\w+)\.sh`", cells[0]) if len(cells) >= 3 else None
        if match:
            refused = re.search(r"refused: `--([\w.]+)", cells[1])
            rows[match.group(1)] = refused.group(1) if refused else cells[1]
    return rows


def test_the_table_lists_every_training_script():
    # train_nonrl_slurm.sh runs train_dpo_llama.sh's command under torchrun: the same row's command.
    assert set(table()) == set(SCRIPTS) | {"train_nonrl_slurm"}
    assert table()["train_nonrl_slurm"] == table()["train_dpo_llama"]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_runs_or_is_refused_as_the_table_says(script, local, capsys):  # noqa: F811
    command, cls, _ = SCRIPTS[script]
    args = localise(command, local) + ["--dry_run"]
    code = exit_code(MAINS[cls], args)
    out, err = capsys.readouterr()
    expected = table()[script]
    if expected == "accepted":
        assert code == 0, err[-3000:]
        assert "dry run" in out and "nothing was started" in out
    else:
        assert code == 2 and f"--{expected}" in err, (expected, err[-3000:])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("script", ["train_reinforce_baseline_hybrid_engine", "train_reinforce_baseline_ray_agent_async"])
def test_the_agent_scripts_run_without_their_ring_attention_options(script, local, capsys):  # noqa: F811
    """As the table says: with --ds.ring_attn_size / --ds.ring_attn_head_stride dropped, the rest is accepted
    (the agent's rewards, async with the learner's sleep, partial rollout with an agent)."""
    from tests.coordinator.test_openrlhf_cli import drop

    command, cls, _ = SCRIPTS[script]
    args = drop(drop(localise(command, local), "ds.ring_attn_size"), "ds.ring_attn_head_stride") + ["--dry_run"]
    code = exit_code(MAINS[cls], args)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "the agent's own rewards" in out and "no reward service" in out
