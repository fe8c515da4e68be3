"""Seeded kill trials on real processes (local placement, tiny model, `kill -9`, never a mock).

1. A run without faults, then the same run with a rollout engine killed during generation (step 1),
   the reward + reference service killed during generation (step 2) and the learner killed during
   training (step 3); the learner also kills itself at two points of its checkpoint protocol
   (tests/chaos/test_crash_points.py's "learner-checkpoint-a" plan: while marking a new folder, the
   case that used to lose a run, and while writing the model of its second save). Every service is
   restarted, the steps are the same, every step generated, scored and trained on the same samples
   with the same results, and the final model equals the fault-free one (each learner death went
   back to the newest complete checkpoint: one step redone, no more).
2. One engine only, killed during the weight push: the push waits for the restart and the run ends
   with every step.
3. --max_restarts 0: the first death stops the run with an error naming the service, its exit code
   and its log.
"""

from __future__ import annotations

import pathlib

from tests.chaos.conftest import STEPS
from tests.chaos.harness import Kill, differences, grpo_argv, model_difference, run_trial, unmarked_checkpoints
from tests.chaos.test_crash_points import PLANS

CHECKPOINT_CRASHES = PLANS["learner-checkpoint-a"]


def test_rollout_reward_and_learner_deaths_change_nothing(baseline, tiny_model_dir, tiny_data_dir, tmp_path):
    base, base_out = baseline
    kills = [Kill("rollout-0", "generate", 1), Kill("reward-ref-0", "generate", 2, delay_s=0.2),
             Kill("learner", "train", 3)]
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 2, STEPS) + ["--max_restarts", "8"]
    trial = run_trial(argv, tmp_path, kills, timeout_s=900, crash_at=CHECKPOINT_CRASHES)
    assert trial.returncode == 0, trial.log[-8000:]
    assert len(trial.killed_at_s) == 3, trial.log[-4000:]
    assert trial.crashed_at == sorted(CHECKPOINT_CRASHES), (trial.crashed_at, trial.log[-4000:])
    restarted = sorted(e["service"] for e in trial.events if e["event"] == "service.restarted")
    assert restarted == ["learner"] * 3 + ["reward-ref-0", "rollout-0"], trial.events
    assert trial.count("rollout.admitted") >= 1
    # Every learner death goes back to the newest complete checkpoint (--save_steps 1), nothing redone
    # beyond the step under way. The last one, during step 3, goes back to step 2's; on a loaded machine
    # that kill can land just after step 3 (its checkpoint saved): the restarted learner loads step 3's.
    rewinds = [(e["from_step"], e["to_step"]) for e in trial.events if e["event"] == "learner.rewound"]
    assert len(rewinds) == 3 and rewinds[-1] in ((2, 2), (3, 3)), rewinds
    assert all(0 <= frm - to <= 1 for frm, to in rewinds), rewinds
    assert differences(base, trial) == []
    assert model_difference(base_out / "model", tmp_path / "model") < 1e-6
    # No global_step folder is left without its marker: the killed saves were redone or removed.
    assert unmarked_checkpoints(tmp_path / "ckpt") == {}
    metrics = (tmp_path / "run" / "events.jsonl").read_text()
    assert "service.died" in metrics


def test_single_engine_waits_for_its_restart(tiny_model_dir, tiny_data_dir, tmp_path):
    # Killed while generating (a phase long enough for the harness to see it on any machine; the
    # tiny model's push lasts a few milliseconds, so a kill aimed at it can land in the next
    # step instead: bench/chaos.py draws push-time kills).
    # Three steps: a kill that misses step 2's generation (a second on the tiny model) lands later in
    # step 2 or in step 3, and the next generation waits for the restart all the same.
    trial = run_trial(grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, 3), tmp_path,
                      [Kill("rollout-0", "generate", 2)], timeout_s=600)
    assert trial.returncode == 0, trial.log[-8000:]
    assert trial.steps == [1, 2, 3]
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in trial.records)
    # With no other engine the step waited: the engine came back, got the current weights, generated.
    assert trial.count("service.died") == 1, trial.log[-8000:]
    assert trial.count("service.restarted") == 1 and trial.count("rollout.admitted") == 1
    versions = [r["weights/version"] for r in trial.records]
    assert versions == sorted(set(versions)), versions


def test_restart_budget_stops_the_run_with_the_services_log(tiny_model_dir, tiny_data_dir, tmp_path):
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, 2) + ["--max_restarts", "0"]
    trial = run_trial(argv, tmp_path, [Kill("rollout-0", "generate", 1)], timeout_s=600)
    assert trial.returncode == 1
    failed = next(line for line in trial.log.splitlines() if "run.failed" in line)
    assert "rollout-0" in failed and "exit code -9" in failed and "--max_restarts 0" in failed, failed
    assert "last lines of" in trial.log and "rollout-0.log" in trial.log
    assert trial.count("service.failed") == 1
    assert not pathlib.Path(tmp_path / "model").exists()
