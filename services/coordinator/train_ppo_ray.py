"""`python -m services.coordinator.train_ppo_ray`: the entry point OpenRLHF users know.

It accepts the flags of `openrlhf.cli.train_ppo_ray` (see `--help`) and runs the coordinator:
inside a Ray job (`ray job submit -- python3 -m services.coordinator.train_ppo_ray ...`) it places
the services on the cluster; elsewhere it starts them on this machine.
"""

import sys

from services.common.user_errors import run_command
from services.coordinator.cli.train import main

if __name__ == "__main__":
    sys.exit(run_command(main))
