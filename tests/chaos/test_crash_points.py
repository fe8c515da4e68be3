"""Every named crash point (services/common/crash_points.py), walked on real processes: the tiny
model, local placement, the process that reaches the point kills itself with SIGKILL
(RLMESH_CRASH_AT), each entry once per run (RLMESH_CRASH_ONCE_DIR), several points per run at
different moments. Each run must end by itself (a coordinator that killed itself: after the same
command with --load_checkpoint), with every step once and the same per-step metrics as the
fault-free run of tests/chaos/conftest.py. A point missing from every plan fails the walk.

A count `#n` is per process: a restarted process counts from 1 again. The runs are 5 steps long, so
that the later entries of a plan (counted again by each restarted process) are still reached.

The plan of the learner's checkpoint folder (the case that used to lose a run) runs inside
tests/chaos/test_chaos.py's kill trial, so the suite skips it here; RLMESH_CRASH_WALK=1 runs it here
too. About 6.5 minutes of test time on 2 cores for the rest.
"""

from __future__ import annotations

import os

import pytest

from services.common.crash_points import POINTS
from tests.chaos.conftest import STEPS
from tests.chaos.harness import differences, grpo_argv, run_trial, unmarked_checkpoints

# Runs of two engines and a one-rank learner, compared with the shared fault-free run.
PLANS = {
    # The learner killed while creating global_step_N/ (the folder made, then its marker half-written:
    # the mid-folder case), while writing its files, and between its marker and pruning.
    "learner-checkpoint-a": ["learner.checkpoint.folder_marking", "learner.checkpoint.model_written#2"],
    "learner-checkpoint-b": ["learner.checkpoint.folder_created", "learner.checkpoint.client_state_written#2",
                             "learner.checkpoint.marker_renamed#3", "learner.checkpoint.pruned#2"],
    # (The first weight group is built at start-up: a death there has the start-up done again.)
    "learner-push": ["learner.push.group_built", "learner.push.chunk_sent#2", "learner.push.chunk_acknowledged#3",
                     "learner.push.version_committed#4"],
    # A rollout engine killed in the push, then admitted again (the coordinator dies right after
    # that): rollout-1 while joining the start-up's group, rollout-0 a group built during the run (#3:
    # its second is the start-up done again without rollout-1's first process).
    "rollout-push": ["rollout.push.group_built@rollout-1", "rollout.push.group_built@rollout-0#3",
                     "rollout.push.chunk_received@rollout-1",
                     "rollout.push.version_committed@rollout-0#2", "coordinator.push.engine_admitted"],
    "coordinator-step": ["coordinator.step.generated", "coordinator.step.scored#2", "coordinator.step.trained#2",
                         "coordinator.step.pushed#2", "coordinator.step.done#2"],
    "coordinator-push": ["coordinator.push.group_built", "coordinator.push.chunk_from_learner#2",
                         "coordinator.push.chunk_relayed#2", "coordinator.push.version_committed#2"],
    "coordinator-checkpoint": ["coordinator.checkpoint.state_written#2", "coordinator.checkpoint.latest_updated#2",
                               "coordinator.checkpoint.pruned#2"],
}
WALK_ALL = os.environ.get("RLMESH_CRASH_WALK", "") not in ("", "0")
IN_KILL_TRIAL = "learner-checkpoint-a"  # tests/chaos/test_chaos.py runs this plan with its kills
# The learner's rank group needs two ranks (and is compared step by step on its own terms).
RANK_PLAN = ["learner.rank.forward_done@rank1", "learner.rank.backward_done@rank1#2",
             "learner.rank.step_done@rank1#3", "learner.rank.result_ready@rank1#4"]


def test_every_point_is_walked():
    planned = {entry.split("@")[0].split(":")[0].split("#")[0] for plan in [*PLANS.values(), RANK_PLAN] for entry in plan}
    assert planned == set(POINTS), sorted(set(POINTS) ^ planned)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_kill_at_each_point_changes_nothing(plan, walk_baseline, tiny_model_dir, tiny_data_dir, tmp_path):
    if plan == IN_KILL_TRIAL and not WALK_ALL:
        pytest.skip("runs inside tests/chaos/test_chaos.py's kill trial (RLMESH_CRASH_WALK=1 runs it here too)")
    base, _ = walk_baseline
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 2, STEPS) + ["--max_restarts", "8"]
    trial = run_trial(argv, tmp_path, crash_at=PLANS[plan], timeout_s=900)
    assert trial.returncode == 0, trial.log[-8000:]
    assert trial.crashed_at == sorted(PLANS[plan]), (trial.crashed_at, trial.log[-4000:])
    assert differences(base, trial) == []
    # No global_step folder is left without its marker: the killed saves were redone or removed.
    assert unmarked_checkpoints(tmp_path / "ckpt") == {}


def test_a_rank_killed_at_each_collective_of_a_step(tiny_model_dir, tiny_data_dir, tmp_path):
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, STEPS) + [
        "--actor_num_gpus_per_node", "2", "--max_restarts", "8"]
    trial = run_trial(argv, tmp_path, crash_at=RANK_PLAN, timeout_s=900)
    assert trial.returncode == 0, trial.log[-8000:]
    assert trial.crashed_at == sorted(RANK_PLAN), (trial.crashed_at, trial.log[-4000:])
    assert trial.steps == list(range(1, STEPS + 1))
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in trial.records), trial.records


# A death while a failed step is being repaired: the learner dies training step 2 (its fifth
# micro-batch: four a step), and rollout-0 dies on the first chunk of the rewind's weight push (its
# second push: step 1's was the first; none at start-up). The repair is repaired in turn and rewinds
# again, to step 1's checkpoint.
REPAIR_PLAN = ["learner.rank.forward_done@learner#5", "rollout.push.chunk_received@rollout-0#2"]


def test_a_death_during_the_repair_of_a_step_is_repaired_too(walk_baseline, tiny_model_dir, tiny_data_dir, tmp_path):
    base, _ = walk_baseline
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 2, STEPS) + ["--max_restarts", "8"]
    trial = run_trial(argv, tmp_path, crash_at=REPAIR_PLAN, timeout_s=900)
    assert trial.returncode == 0, trial.log[-8000:]
    assert trial.crashed_at == sorted(REPAIR_PLAN), (trial.crashed_at, trial.log[-4000:])
    interrupted = [e for e in trial.events if e["event"] == "recovery.interrupted"]
    assert len(interrupted) == 1 and interrupted[0]["rewind"] is True, (interrupted, trial.log[-4000:])
    assert [e["to_step"] for e in trial.events if e["event"] == "learner.rewound"] == [1], trial.events
    assert trial.steps == list(range(1, STEPS + 1))
    assert differences(base, trial) == []
