"""Which folders the learner may write into and delete from (services.common.ownership)."""

import grpc
import pytest

from services.common import ownership
from services.common.errors import ServiceError


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
