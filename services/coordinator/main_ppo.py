"""`python -m services.coordinator.main_ppo key=value ...`: veRL's trainer command (`python3 -m
verl.trainer.main_ppo ...`) with its Hydra overrides, run by the rlmesh coordinator; see
services/coordinator/cli/verl_cli.py for what each key becomes."""

import sys

from services.common.user_errors import run_command
from services.coordinator.cli.verl_cli import main

if __name__ == "__main__":
    sys.exit(run_command(main))
