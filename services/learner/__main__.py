"""python -m services.learner --pretrain DIR [--critic_pretrain DIR] [--num_gpus N] ...

One process per rank. Started plainly, this process is rank 0 of --num_gpus ranks and starts the
others on this machine. Started by a launcher (torchrun, the deepspeed launcher, or the
coordinator placing Ray actors across nodes), each process takes its rank, the world size and
rank 0's address from --rank/--world_size/--master_addr/--master_port or from RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Rank 0 serves gRPC (SIGTERM stops it and every rank).
"""

from __future__ import annotations

import signal
import sys

from services.common.config import ConfigError, parse_config
from services.common.log import get_logger, log_event
from services.common.security import check_exposure, resolve_token
from services.common.server import exit_now, run_service
from services.common.user_errors import run_command
from services.learner.config import LearnerConfig
from services.learner.learner_rank import LearnerRank
from services.learner.server import LearnerServicer, add_to_runner
from services.learner.spmd import (
    GroupError,
    RankGroupDriver,
    connect_store,
    resolve_rank_spec,
    serve_worker,
    spawn_local_ranks,
    stop_processes,
)

log = get_logger("learner")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    config = parse_config(LearnerConfig, argv, description=__doc__)
    try:
        spec = resolve_rank_spec(config.rank, config.world_size, config.local_rank, config.master_addr,
                                 config.master_port, config.num_gpus)
        config.validate_deepspeed(spec.world_size)
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if spec.rank == 0:
        # Rank 0 serves gRPC: an address open to others without a token is refused here, as every
        # service refuses it (ConfigError, one line, exit 2), before the store and the other ranks start.
        check_exposure("learner", config.host, resolve_token(config.auth_token, config.auth_token_file),
                       bool(config.tls_client_ca), bool(config.allow_unauthenticated))
    if config.dry_run:  # checked and planned: no model loaded, no rank group, no rank started
        from services.learner.dry_run import print_plan

        return print_plan(config, spec)
    rank = LearnerRank(config, spec)
    if spec.rank != 0:
        # Ctrl-C reaches every process of the terminal; only rank 0 decides when the ranks stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        store = connect_store(spec, config.startup_timeout_s)
        serve_worker(spec, store, rank.setup)
        return 0

    store = connect_store(spec, config.startup_timeout_s)
    procs = spawn_local_ranks(spec, argv) if spec.spawn_local else []
    driver = RankGroupDriver(spec, store, procs, config.startup_timeout_s, config.heartbeat_timeout_s,
                             config.cancel_grace_s)

    async def build(runner) -> None:
        try:
            await driver.setup(rank.setup)
        except GroupError as exc:
            log_event(log, "learner.start_failed", error=str(exc)[:500], level=50)
            stop_processes(procs, timeout_s=1.0)
            raise SystemExit(f"learner failed to start: {exc}") from exc
        add_to_runner(runner, LearnerServicer(config, driver, rank, runner))
        runner.on_shutdown.append(lambda: driver.shutdown(timeout_s=1.0 if driver.broken else 20.0))

    code = 0
    try:
        run_service("learner", config, build)
    except SystemExit as exc:
        if isinstance(exc.code, int):
            code = exc.code  # run_service reported it already (a user error: exit 2)
        else:
            print(exc, file=sys.stderr)  # build()'s "learner failed to start: ..."
            code = 1
    if driver.broken is not None:
        code = 3
    return code


if __name__ == "__main__":
    # Without the interpreter's teardown also because a rank thread may still sit in a collective
    # after a failure, and DeepSpeed / process-group destructors can block on peers that are gone.
    exit_now(run_command(main))
