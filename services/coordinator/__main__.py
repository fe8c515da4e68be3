"""`python -m services.coordinator` (and `rlmesh serve coordinator`): run one training job.

The coordinator is the job itself: it serves its control API (GetStatus, StreamMetrics, Pause,
Resume, Stop) while the run lasts. See `services.coordinator.cli.train` for the flags.
"""

import sys

from services.common.user_errors import run_command
from services.coordinator.cli.train import main

if __name__ == "__main__":
    sys.exit(run_command(main))
