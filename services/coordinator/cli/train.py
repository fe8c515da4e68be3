"""`rlmesh train` / `python -m services.coordinator.train_ppo_ray`: one RL training run.

    rlmesh train --config examples/tiny_grpo.yaml
    ray job submit --address=http://127.0.0.1:8265 -- python3 -m services.coordinator.train_ppo_ray \\
        --actor_num_nodes 1 --actor_num_gpus_per_node 8 --vllm_num_engines 4 ... --advantage_estimator group_norm

Order of events: flags are validated; the prompt data and any --eval_dataset are loaded and
tokenized (bad data fails before any service starts); the control API starts (GetStatus,
StreamMetrics, Pause, Resume, Stop on --port, Prometheus on --metrics_port); the services are
placed or found; the run resumes from the latest checkpoint with --load_checkpoint; steps run
(with --eval_dataset the rollout engines' current model is evaluated before the first step, every
--eval_steps steps and after the last); the final model is exported to --save_path. Services
this run started are stopped on every way out: the end, an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os

# gRPC's C core logs every fork (each service start) at INFO; keep its errors only.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import asyncio  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from services.common.config import ConfigError, parse_config
from services.common.datasets import DatasetError
from services.common.log import get_logger, log_event
from services.common.server import ServiceRunner
from services.common.user_errors import is_user_error, report, run_command
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.control import add_to_runner
from services.coordinator.loop.run_state import RunControl
from services.coordinator.loop.data import build_prompt_stream
from services.coordinator.loop.evaluate import load_eval_prompts
from services.coordinator.fleet.final_scrape import ScrapeWatch
from services.coordinator.loop.metrics import MetricsLog
from services.coordinator.fleet.placement import LocalPlacement, StaticPlacement
from services.coordinator.loop.queries import QueryDecoder
from services.coordinator.config import public_config
from services.coordinator.fleet.security import secure_run
from services.coordinator.cli.run_config import total_steps_of
from services.coordinator.fleet.elastic import Elastic
from services.coordinator.fleet.recovery import Recovery
from services.coordinator.fleet.scaling import Scaler
from services.coordinator.fleet.supervisor import Supervisor
from services.coordinator.loop.checkpoint import new_state
from services.coordinator.loop.trainer import Trainer

_log = get_logger("coordinator")


def parse(argv: list[str] | None) -> CoordinatorConfig:
    """Parses and validates the flags; warnings (GPU-only flags on CPU, ...) go to the log."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(CoordinatorConfig, argv, description=__doc__)
    for w in caught:
        log_event(_log, "config.warning", level=30, message=str(w.message))
    return config


def run_dir_of(config: CoordinatorConfig) -> pathlib.Path:
    """--run_dir, else runs/<run name>: the same folder again when a run resumes from its --ckpt_path."""
    if config.run_dir:
        return pathlib.Path(config.run_dir)
    name = config.wandb_run_name or os.path.basename(os.path.normpath(config.ckpt_path)) or "run"
    return pathlib.Path("runs") / name


def make_placement(config: CoordinatorConfig, run_dir: pathlib.Path, total_steps: int):
    if config.placement == "local":
        return LocalPlacement(config, run_dir, total_steps)
    if config.placement == "static":
        return StaticPlacement(config)
    from services.coordinator.fleet.ray_elastic import ElasticRayPlacement
    from services.coordinator.fleet.ray_placement import RayPlacement

    placement = (ElasticRayPlacement if config.elastic else RayPlacement)(config, run_dir, total_steps)
    placement.connect()
    return placement


def eval_prompts_of(config: CoordinatorConfig, tokenizer) -> list:
    """--eval_dataset's prompts, formatted and length-filtered like the training prompts; [] = no evaluation."""
    if not config.eval_enabled():
        return []
    try:
        return load_eval_prompts(config.eval_dataset, tokenizer, config.input_key, config.label_key,
                                 config.apply_chat_template, config.input_template, config.prompt_max_len,
                                 config.eval_max_samples, config.seed)
    except DatasetError as exc:
        raise ConfigError(f"--eval_dataset: {exc}") from exc


def write_plots(run_dir: pathlib.Path, evaluated: bool) -> None:
    from services.coordinator.cli.plot import plot_run

    keys = ["reward/mean", "kl/mean", "response_length/mean", "time/step_s"] + (["eval/pass@1"] if evaluated else [])
    try:
        paths = plot_run(run_dir, keys)
        log_event(_log, "run.plots", folder=str(paths[0].parent))
    except Exception as exc:  # noqa: BLE001 - plots are a convenience; `rlmesh plot` can redo them
        log_event(_log, "run.plots_skipped", reason=str(exc))


async def run(config: CoordinatorConfig) -> int:
    from transformers import AutoTokenizer

    run_dir = run_dir_of(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(public_config(config), indent=1, sort_keys=True, default=str))
    auth_token = secure_run(config, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
    stream = build_prompt_stream(config, tokenizer)
    eval_prompts = eval_prompts_of(config, tokenizer)
    total_steps = total_steps_of(config, stream.total_steps(config.rollout_batch_size))
    if total_steps == 0:
        raise ConfigError(f"--rollout_batch_size {config.rollout_batch_size} is larger than the {len(stream)} "
                          "usable prompts; lower it or add data")

    # Before the control server starts: joining Ray forks processes (see RayPlacement.connect).
    placement = make_placement(config, run_dir, total_steps)
    control = RunControl(config.placement)
    control.run_dir, control.total_steps = str(run_dir), total_steps
    runner = ServiceRunner("coordinator", config, auth_token=auth_token)
    add_to_runner(runner, control)
    scrapes = ScrapeWatch() if config.metrics_port >= 0 else None
    await runner.start()
    main_task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    interrupted = []

    def on_signal(signum: int) -> None:
        # First signal: stop now (services are stopped in `finally`); a second one exits at once.
        if interrupted:
            os._exit(128 + signum)
        interrupted.append(signum)
        log_event(_log, "run.interrupted", signal=signal.Signals(signum).name)
        main_task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)

    trainer = supervisor = elastic = None
    code = 0
    log_event(_log, "run.start", run_dir=str(run_dir), placement=config.placement, steps=total_steps,
              prompts=len(stream), eval_prompts=len(eval_prompts), control=f"{config.host}:{runner.port}",
              metrics_port=runner.metrics_port)
    try:
        endpoints = await placement.start()
        master = await placement.weight_sync_master(endpoints)
        trainer = Trainer(config, endpoints, control, stream, metrics=None, state=new_state(config, str(run_dir)),
                          weight_sync_master=master, eval_prompts=eval_prompts)
        trainer.query_decoder = QueryDecoder(tokenizer)
        # From here on a service that dies is restarted (supervisor) and what it was doing redone
        # (recovery): the start-up, or the step.
        supervisor = Supervisor(placement, config.max_restarts, config.restart_backoff_s, config.health_poll_s,
                                run_dir)
        recovery = Recovery(trainer, supervisor)
        elastic = Elastic(recovery, placement, control)  # the run's shape; --elastic: goes on without a lost node
        supervisor.start()
        elastic.start()
        await supervisor.run_unless_failed(recovery.setup(resume=config.load_checkpoint))
        trainer.metrics = MetricsLog(run_dir, config, resumed_step=trainer.state.global_step)
        trainer.metrics.log_if_missing(trainer.state.global_step, trainer.state.step_record)
        control.attach_metrics(trainer.metrics)
        control.scaler = Scaler(recovery, placement.name)
        await supervisor.run_unless_failed(trainer.run())
        control.finish()
        log_event(_log, "run.done", step=control.global_step, run_dir=str(run_dir))
    except asyncio.CancelledError:
        if not interrupted and main_task.cancelling() == 0:
            # Not a stop signal: a call inside the run was cancelled and the cancellation reached the
            # run (a defect, not a user's stop): a failed run with the traceback, not an interruption.
            control.finish("CancelledError: a call inside the run was cancelled")
            log_event(_log, "run.failed", level=40, error="CancelledError: a call inside the run was cancelled")
            _log.exception("the run failed")
            code = 1
        else:
            control.finish(f"interrupted by {signal.Signals(interrupted[0]).name if interrupted else 'cancellation'}")
            code = 130
    except Exception as exc:  # noqa: BLE001 - reported, services stopped, non-zero exit
        control.finish(f"{type(exc).__name__}: {exc}")
        log_event(_log, "run.failed", level=40, error=f"{type(exc).__name__}: {exc}")
        if is_user_error(exc):  # e.g. a static address where no service answers: what to change
            report(exc)
        else:
            _log.exception("the run failed")
        code = 1
    finally:
        if control.scaler is not None:
            await control.scaler.close()
        if elastic is not None:
            await elastic.stop()
        if supervisor is not None:
            await supervisor.stop()  # before the services stop, or it would restart them
        if trainer is not None:
            await trainer.close()
        await asyncio.shield(placement.stop())
        if control.metrics is not None:
            control.metrics.close()
        if scrapes is not None:
            if not interrupted:  # a stop signal leaves no time to wait (docker stop kills after 10 s)
                await scrapes.wait_for_scrape_after(time.monotonic(), config.metrics_final_scrape_timeout_s)
            scrapes.close()
        await runner.server.stop(1.0)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if config.plots and control.metrics is not None and control.metrics.history:
        write_plots(run_dir, evaluated=any("eval/pass@1" in r for r in control.metrics.history))
    return code


def main(argv: list[str] | None = None) -> int:
    """Runs one training run; a user error raised before the run starts (a bad value, a data file
    without usable rows) propagates to run_command, which prints it without a traceback (exit 2).
    A run that started and failed exits 1 (a user error's message again without a traceback)."""
    config = parse(argv)
    if config.dry_run:
        from services.coordinator.cli.dry_run import print_plan

        return print_plan(config)
    try:
        return asyncio.run(run(config))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(run_command(main))
