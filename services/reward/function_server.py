"""A gRPC reward server around any Python function, in a few lines:

    from services.reward.function_server import serve_reward_function

    def reward_func(queries, prompts, labels, **kwargs):
        return [float(label in q) for q, label in zip(queries, labels)]

    if __name__ == "__main__":
        serve_reward_function(reward_func)  # --port 50051, --metrics_port, TLS, ... from the command line

The server speaks rlmesh.reward.v1.RewardService (Score, GetRewardInfo) with health, reflection,
metrics and graceful shutdown like every rlmesh service; point the reward service at it with
`--remote_rm_url grpc://host:50051`. The function gets the same arguments and may return the same
things as a reward function file (see function_source.py); raising
services.common.errors.ServiceError sends that status to the caller. Calls run in worker processes,
which import the function by name: define it at module level and keep the `__main__` guard.
"""

import dataclasses
from collections.abc import Callable

from services.common.config import ConfigError, opt, parse_config
from services.common.server import ServerConfig, run_service
from services.reward.function_source import FunctionRewardSource
from services.reward.server import add_reward_service


@dataclasses.dataclass
class FunctionServerConfig(ServerConfig):
    """A gRPC reward server around a Python reward function."""

    batch_size: int = opt(1024, "samples per call of the function; larger requests are split")
    max_in_flight: int = opt(4, "calls of the function running at once (each in its own worker process)")
    timeout_s: float = opt(300.0, "time limit of one call of the function, seconds")

    def validate(self) -> None:
        self.validate_server()
        if self.batch_size < 1 or self.max_in_flight < 1:
            raise ConfigError("--batch_size and --max_in_flight must be >= 1")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout_s {self.timeout_s} must be positive")


def serve_reward_function(reward_func: Callable, argv: list[str] | None = None, name: str = "reward") -> None:
    """Serves reward_func over gRPC until SIGTERM; options come from argv (default: the command line)."""
    config = parse_config(FunctionServerConfig, argv, description=f"gRPC reward server around {reward_func.__qualname__}")
    source = FunctionRewardSource(reward_func, reward_func.__qualname__, config.timeout_s, config.batch_size,
                                  config.max_in_flight)

    async def build(runner) -> None:
        await add_reward_service(runner, source)

    run_service(name, config, build)
