"""Which steps a resumed run records (services/coordinator/loop/resume.py): real runs of the tiny
model (local placement, the transformers engine, a checkpoint every step).

A run resumed from another run's checkpoint into a fresh run folder records only the steps that ran
there: not the checkpoint's step, which ran in the first folder. A run resumed into the folder the
checkpoint was saved from, whose metrics.jsonl lacks the checkpoint's step (the coordinator died
between the save and the log line), records that step from the checkpoint, as it was."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.chaos.harness import grpo_argv, run_trial


def argv_for(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, ckpt: pathlib.Path, steps: int) -> list[str]:
    argv = grpo_argv(model, data, out, 1, steps)
    argv[argv.index("--ckpt_path") + 1] = str(ckpt)  # one checkpoint folder, several run folders
    return argv


def test_a_resumed_run_records_the_steps_that_ran_in_its_folder(tiny_model_dir, tiny_data_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_trial(argv_for(tiny_model_dir, tiny_data_dir, tmp_path / "a", ckpt, 2), tmp_path / "a", timeout_s=300)
    assert first.returncode == 0 and first.steps == [1, 2], first.log[-6000:]

    # Resumed from step 2 into a fresh folder: only step 3 ran there.
    fresh = run_trial([*argv_for(tiny_model_dir, tiny_data_dir, tmp_path / "b", ckpt, 3), "--load_checkpoint"],
                      tmp_path / "b", timeout_s=300)
    assert fresh.returncode == 0 and "resume.loaded step=2" in fresh.log, fresh.log[-6000:]
    assert fresh.steps == [3], fresh.steps
    assert [json.loads(line)["global_step"] for line in (tmp_path / "a" / "run" / "metrics.jsonl").open()] == [1, 2]

    # As if the coordinator had died after step 3's checkpoint and before its log line: the same
    # command again (the checkpoint's own folder) records step 3 from the checkpoint, then step 4.
    metrics = tmp_path / "b" / "run" / "metrics.jsonl"
    step3 = json.loads(metrics.read_text())
    metrics.write_text("")
    again = run_trial([*argv_for(tiny_model_dir, tiny_data_dir, tmp_path / "b", ckpt, 4), "--load_checkpoint"],
                      tmp_path / "b", timeout_s=300)
    assert again.returncode == 0 and "resume.loaded step=3" in again.log, again.log[-6000:]
    assert again.steps == [3, 4], again.steps
    assert again.records[0]["reward/mean"] == pytest.approx(step3["reward/mean"])
    assert again.records[0]["actor/policy_loss"] == pytest.approx(step3["actor/policy_loss"])
