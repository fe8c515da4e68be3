"""Which folders the learner may write into and delete from (services.common.ownership)."""

import os
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest

from services.common import ownership
from services.common.errors import ServiceError

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_new_and_empty_folders_are_claimed_and_marked(tmp_path):
    created = tmp_path / "a" / "b"
    ownership.claim_dir(created, "output_dir", "export")
    # Every folder the learner made carries the marker; the existing tmp_path does not.
    assert ownership.is_owned(created) and ownership.is_owned(tmp_path / "a")
    assert not ownership.is_owned(tmp_path)
    (tmp_path / "empty").mkdir()
    ownership.claim_dir(tmp_path / "empty", "output_dir", "export")
    assert ownership.is_owned(tmp_path / "empty")


def test_folders_of_other_files_are_refused_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ServiceError) as err:
        ownership.claim_dir(tmp_path, "output_dir", "export")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "notes.txt" in err.value.message and "output_dir" in err.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ServiceError, match="is a file"):
        ownership.claim_dir(tmp_path / "file", "output_dir", "export")


def test_a_checkpoint_root_of_an_earlier_run_is_accepted(tmp_path):
    # Written before the marker existed: complete checkpoints (learner.json) make it the learner's.
    (tmp_path / "global_step_2").mkdir()
    (tmp_path / "global_step_2" / "learner.json").write_text("{}")
    (tmp_path / "latest").write_text("global_step_2")
    ownership.claim_dir(tmp_path, "ckpt_path", "checkpoints", checkpoint_root=True)
    assert ownership.is_owned(tmp_path)
    foreign = tmp_path / "global_step_3"
    foreign.mkdir()
    with pytest.raises(ServiceError, match="was not written by the learner"):
        ownership.check_step_dir(foreign, "global_step")
    assert not ownership.may_delete_step(foreign) and ownership.may_delete_step(tmp_path / "global_step_2")


def test_export_record_keeps_the_purpose(tmp_path):
    ownership.claim_dir(tmp_path / "out", "output_dir", "export")
    ownership.record_export(tmp_path / "out", ["model.safetensors", "config.json"])
    assert ownership.export_files(tmp_path / "out") == ["config.json", "model.safetensors"]
    assert ownership.read_marker(tmp_path / "out")["purpose"] == "export"


def _killed_while_creating(folder, point: str) -> None:
    """A real process creates `folder` as the learner's save does and is SIGKILLed at `point`."""
    env = {**os.environ, "RLMESH_CRASH_AT": point, "PYTHONPATH": str(REPO)}
    code = f"from services.common import ownership; ownership.make_owned_dir({str(folder)!r}, 'checkpoint')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_a_learner_killed_while_creating_a_step_folder_leaves_no_foreign_looking_folder(tmp_path):
    step = tmp_path / "global_step_4"
    for point in ("learner.checkpoint.folder_created", "learner.checkpoint.folder_marking"):
        _killed_while_creating(step, point)
        # The folder is made under a temporary name and renamed once marked: global_step_4 is not there.
        assert not step.exists() and len(list(tmp_path.iterdir())) == 1
    # The restarted learner saves step 4: accepted, and the killed ones' leftovers are gone.
    ownership.check_step_dir(step, "global_step")
    ownership.make_owned_dir(step, "checkpoint")
    assert ownership.is_owned(step) and [p.name for p in tmp_path.iterdir()] == ["global_step_4"]


def test_a_step_folder_holding_only_a_temporary_marker_is_the_learners_unfinished_one(tmp_path):
    # What a learner killed between creating global_step_N/ and renaming its marker left in place
    # before folders were created under a temporary name.
    step = tmp_path / "global_step_4"
    step.mkdir()
    (step / "..rlmesh-learner.tmp-4242").write_text("{")
    ownership.check_step_dir(step, "global_step")  # not refused as foreign
    assert ownership.may_delete_step(step)
    ownership.make_owned_dir(step, "checkpoint")  # replaced: marked, the temporary file gone
    assert ownership.is_owned(step) and [p.name for p in step.iterdir()] == [ownership.OWNER_MARKER]


def test_a_temporary_marker_beside_other_files_does_not_make_a_folder_the_learners(tmp_path):
    step = tmp_path / "global_step_4"
    step.mkdir()
    (step / "..rlmesh-learner.tmp-4242").write_text("{")
    (step / "weights.bin").write_text("someone else's")
    assert not ownership.may_delete_step(step)
    with pytest.raises(ServiceError) as err:
        ownership.check_step_dir(step, "global_step")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "global_step_4" in err.value.message
    assert (step / "weights.bin").read_text() == "someone else's"
