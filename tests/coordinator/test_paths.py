"""Paths are the user's: relative paths are made absolute against the folder the command ran in
(a whole run started from another folder: tests/coordinator/test_eval_during_training.py)."""

from __future__ import annotations

import pytest

from services.common import paths
from services.common.config import ConfigError


def test_relative_paths_become_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(paths.WORKDIR_ENV, raising=False)
    assert paths.absolute_paths("a.jsonl, sub/b.jsonl", "prompt_data") == f"{tmp_path}/a.jsonl,{tmp_path}/sub/b.jsonl"
    assert paths.absolute_path("http://host:5000/get_reward", "remote_rm_url") == "http://host:5000/get_reward"
    assert paths.absolute_path("/abs/x", "pretrain") == "/abs/x"
    monkeypatch.setenv(paths.WORKDIR_ENV, "/shared/job")
    assert paths.absolute_path("./ckpt", "ckpt_path", output=True) == "/shared/job/ckpt"


def test_ray_working_dir_copy_refuses_relative_outputs(tmp_path, monkeypatch):
    """Under `ray job submit --runtime-env-json '{"working_dir": ...}'` the driver runs in Ray's
    temporary copy: a relative checkpoint folder would vanish with it."""
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    monkeypatch.delenv(paths.WORKDIR_ENV, raising=False)
    assert paths.absolute_path("data/prompts.jsonl", "prompt_data") == "data/prompts.jsonl"  # same copy on every worker
    with pytest.raises(ConfigError, match=f"--ckpt_path ./checkpoints/x is relative.*{paths.WORKDIR_ENV}"):
        paths.absolute_path("./checkpoints/x", "ckpt_path", output=True)
    monkeypatch.setenv(paths.WORKDIR_ENV, "/openrlhf")
    assert paths.absolute_path("./checkpoints/x", "ckpt_path", output=True) == "/openrlhf/checkpoints/x"
