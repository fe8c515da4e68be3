"""`python -m services.coordinator.train`: the `rlmesh train` command under its module path
(kept for the commands users already type); the code lives in services/coordinator/cli/train.py."""

import sys

from services.common.user_errors import run_command
from services.coordinator.cli.train import main

if __name__ == "__main__":
    sys.exit(run_command(main))
