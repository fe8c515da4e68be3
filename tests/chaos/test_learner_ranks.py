"""A learner of two ranks (local placement, real processes) loses rank 1 to `kill -9` while it
trains: rank 0, which may sit in a collective waiting for it, notices the rank's exit, fails the
call and stops the learner; the coordinator restarts the learner (both ranks), which loads the
checkpoint of the step before, and the run redoes the step and ends with every step and sample, as
without the fault. The kill aims at step 2's training (a fraction of a second here); when the polls
miss it, it lands in step 3, which the run also has."""

from __future__ import annotations

from tests.chaos.harness import Kill, grpo_argv, run_trial


def test_a_dead_learner_rank_restarts_the_whole_learner(tiny_model_dir, tiny_data_dir, tmp_path):
    argv = grpo_argv(tiny_model_dir, tiny_data_dir, tmp_path, 1, 3) + ["--actor_num_gpus_per_node", "2"]
    trial = run_trial(argv, tmp_path, [Kill("learner-rank1", "train", 2)], timeout_s=600)
    assert trial.returncode == 0, trial.log[-8000:]
    assert len(trial.killed_at_s) == 1, trial.log[-4000:]
    print(f"rank 1 killed at {trial.killed_at_s[0]:.1f} s; run took {trial.seconds:.1f} s")
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text(errors="replace")
    assert "world_size=2" in learner_log
    # Rank 0 did not wait for the dead rank: it failed the call as fatal and exited by itself (code 3).
    assert "fatal=True" in learner_log, learner_log[-4000:]
    died = [e for e in trial.events if e["event"] == "service.died"]
    assert [(e["service"], e["how"]) for e in died] == [("learner", "exit code 3")], died
    assert [e["service"] for e in trial.events if e["event"] == "service.restarted"] == ["learner"]
    # Back to the checkpoint of the last completed step (1, or 2 when the kill landed in step 3): only
    # the step under way is redone.
    rewinds = [(e["from_step"], e["to_step"]) for e in trial.events if e["event"] == "learner.rewound"]
    assert len(rewinds) == 1 and rewinds[0][0] == rewinds[0][1] in (1, 2), rewinds
    failed = [e["step"] for e in trial.events if e["event"] == "step.failed"]
    assert set(failed) <= {rewinds[0][0] + 1}, trial.events
    # Every step once, each generated and trained on all its samples, as a run without the fault.
    assert trial.steps == [1, 2, 3]
    assert all(r["samples/generated"] == 32 and r["samples/trained"] == 32 for r in trial.records), trial.records
