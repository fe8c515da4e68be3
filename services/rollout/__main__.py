"""python -m services.rollout --pretrain DIR [--engine vllm|hf] [--port 50051] [--metrics_port 9101] ..."""

from services.common.config import parse_config
from services.common.server import exit_now, run_service
from services.common.user_errors import run_command
from services.rollout.config import RolloutConfig


def main(argv: list[str] | None = None) -> int:
    config = parse_config(RolloutConfig, argv)
    if config.dry_run:  # checked and planned, nothing started
        from services.rollout.dry_run import print_plan

        return print_plan(config)
    # Imported after parsing, so --help and config errors do not wait for torch/vLLM imports.
    from services.rollout.server import build

    run_service("rollout", config, lambda runner: build(runner, config))
    return 0


if __name__ == "__main__":
    exit_now(run_command(main))
