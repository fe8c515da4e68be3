"""The command-line surface: every service's --help lists every option with its help text, the
`rlmesh` console script dispatches, and the compose deployment names only real flags."""

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from services.common.config import build_parser
from services.coordinator.config import CoordinatorConfig
from services.coordinator.cli.run_config import split_run_config
from services.learner.config import LearnerConfig
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"rollout": RolloutConfig, "reward": RewardConfig, "learner": LearnerConfig, "coordinator": CoordinatorConfig}


@pytest.mark.parametrize("service", sorted(CONFIGS))
def test_service_help_lists_every_option(service):
    out = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = re.sub(r"\s+", " ", out.stdout)
    for f in dataclasses.fields(CONFIGS[service]):
        if f.metadata.get("derived"):
            continue
        assert f"--{f.name}" in text, f"{service} --help misses --{f.name}"
        assert f.metadata.get("help"), f"{service}: option {f.name} has no help text"


def test_console_script_dispatches():
    out = subprocess.run([sys.executable, "-m", "services.cli", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "serve SERVICE" in out.stdout and "make-tiny-model" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "services.cli", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    help_rollout = subprocess.run([sys.executable, "-m", "services.cli", "serve", "rollout", "--help"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
    assert help_rollout.returncode == 0 and "--tensor_parallel_size" in help_rollout.stdout


def _expand(arg: str) -> str:
    # ${NAME:-default} -> default, as compose does with NAME unset.
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(arg))


def test_compose_commands_name_real_flags():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    checked = 0
    for name, spec in compose["services"].items():
        command = [_expand(a) for a in spec.get("command", [])]
        if not command or command[0] not in ("serve", "train"):
            continue
        service = command[1] if command[0] == "serve" else "coordinator"
        argv = command[2:] if command[0] == "serve" else command[1:]
        # --run_config (the run's YAML, mounted from deploy/config) is the console script's, not the service's.
        run_config, argv = split_run_config(argv)
        if run_config:
            assert (ROOT / "deploy" / "config" / pathlib.Path(run_config).relative_to("/config")).is_file()
        build_parser(CONFIGS[service]).parse_args(argv)  # SystemExit (a failure) on an unknown flag or bad value
        checked += 1
    assert checked == 4
