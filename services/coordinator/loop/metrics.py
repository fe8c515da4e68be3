"""Where the training metrics go: Prometheus always, metrics.jsonl always, TensorBoard and
Weights & Biases when asked, and the coordinator's StreamMetrics subscribers.

Each global step produces one flat dict {"reward/mean": 0.4, "time/step_s": 12.1, ...}; the
JSONL file holds one such line per logged step (plus "global_step" and "unix_time"), which is what
`rlmesh plot` and resumed runs read.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import time

import prometheus_client

from services.common.log import get_logger, log_event
from services.coordinator.config import public_config

_log = get_logger("coordinator")

PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)

STEPS = prometheus_client.Counter("rlmesh_coordinator_steps_total", "Global steps completed")
SAMPLES = prometheus_client.Counter("rlmesh_coordinator_samples_total", "Samples generated and trained on")
GENERATED_TOKENS = prometheus_client.Counter("rlmesh_coordinator_generated_tokens_total", "Response tokens generated")
FILTERED_PROMPTS = prometheus_client.Counter("rlmesh_coordinator_filtered_prompts_total",
                                             "Prompts dropped by dynamic filtering (all samples scored the same)")
RPC_RETRIES = prometheus_client.Counter("rlmesh_coordinator_rpc_retries_total",
                                       "Calls sent again to another instance after theirs died, by service",
                                       ["service"])
GLOBAL_STEP = prometheus_client.Gauge("rlmesh_coordinator_global_step", "Last completed global step")
WEIGHT_VERSION = prometheus_client.Gauge("rlmesh_coordinator_weight_version",
                                         "Weight version verified on every rollout engine")
STEP_SECONDS = prometheus_client.Histogram("rlmesh_coordinator_step_duration_seconds", "Duration of a global step",
                                           buckets=PHASE_BUCKETS)
PHASE_SECONDS = prometheus_client.Histogram("rlmesh_coordinator_phase_duration_seconds",
                                            "Duration of each phase of a step (generate, score, train, push, ...)",
                                            ["phase"], buckets=PHASE_BUCKETS)
# Gauges of the latest step's values, by JSONL name.
_GAUGES = {
    "reward/mean": ("rlmesh_coordinator_reward_mean", "Mean reward of the step's samples"),
    "reward/std": ("rlmesh_coordinator_reward_std", "Standard deviation of the step's rewards"),
    "kl/mean": ("rlmesh_coordinator_kl_mean", "Mean per-token KL(policy || reference) of the step"),
    "kl/coef": ("rlmesh_coordinator_kl_coef", "KL coefficient in use"),
    "actor/policy_loss": ("rlmesh_coordinator_policy_loss", "Policy loss reported by the learner"),
    "critic/value_loss": ("rlmesh_coordinator_value_loss", "Value loss reported by the learner"),
    "actor/clip_ratio": ("rlmesh_coordinator_clip_fraction", "Fraction of tokens whose ratio was clipped"),
    "response_length/mean": ("rlmesh_coordinator_response_length_tokens", "Mean response length, tokens"),
    "response_length/max": ("rlmesh_coordinator_response_length_max_tokens", "Longest response of the step, tokens"),
    "response_length/truncated_ratio": ("rlmesh_coordinator_truncated_ratio",
                                        "Fraction of the step's responses cut at the most new tokens (no EOS or stop)"),
    "actor/entropy": ("rlmesh_coordinator_entropy", "Mean entropy of the policy on the trained response tokens "
                      "(set only when the learner computes it)"),
    "throughput/samples_per_s": ("rlmesh_coordinator_samples_per_second", "Samples per second over the step"),
    "throughput/tokens_per_s": ("rlmesh_coordinator_tokens_per_second", "Generated tokens per second over the step"),
}
GAUGES = {key: prometheus_client.Gauge(name, help_text) for key, (name, help_text) in _GAUGES.items()}
# The latest step's reward logs (JSONL reward/<name>: the math rule's accuracy, boxed, no_answer, a
# format rule's format_ok, a reward server's extra_logs) and mean rewards per group (group_rewards.py).
REWARD_LOG = prometheus_client.Gauge("rlmesh_coordinator_reward_log",
                                     "Mean of a metric the reward source reported per sample or per call, by name",
                                     ["name"])
REWARD_BY_DIFFICULTY = prometheus_client.Gauge("rlmesh_coordinator_reward_by_difficulty",
                                               "Mean reward of the step's samples whose prompt has this difficulty",
                                               ["difficulty"])
REWARD_BY_DATASOURCE = prometheus_client.Gauge("rlmesh_coordinator_reward_by_datasource",
                                               "Mean reward of the step's samples from this data source (when a "
                                               "step has several)", ["datasource"])
# Evaluation on --eval_dataset (JSONL eval/pass@K, eval/response_length, eval/<datasource>/...).
EVAL_PASS = prometheus_client.Gauge("rlmesh_coordinator_eval_pass_ratio",
                                    "Latest evaluation's pass@k on --eval_dataset (datasource=all: every prompt)",
                                    ["k", "datasource"])
EVAL_RESPONSE_LENGTH = prometheus_client.Gauge("rlmesh_coordinator_eval_response_length_tokens",
                                               "Latest evaluation's mean response length, tokens", ["datasource"])


def _export_eval(record: dict) -> None:
    """Sets the evaluation gauges from a record's eval/ keys."""
    for key, value in record.items():
        if not key.startswith("eval/"):
            continue
        datasource, _, name = key.removeprefix("eval/").rpartition("/")
        datasource = datasource or "all"
        if name.startswith("pass@") and name.removeprefix("pass@").isdigit():  # not pass@1_ci_low / _ci_high
            EVAL_PASS.labels(name.removeprefix("pass@"), datasource).set(value)
        elif name == "response_length":
            EVAL_RESPONSE_LENGTH.labels(datasource).set(value)


def _finite(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricsLog:
    """Fans each step's metrics out to every sink that is switched on."""

    def __init__(self, run_dir: pathlib.Path, config, resumed_step: int = 0):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict] = []
        if resumed_step and self.path.exists():
            # Steps after the checkpoint are redone: drop their lines so the file reads as one run.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("global_step", 0) <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in kept))
            self.history = [json.loads(line) for line in kept]
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")
        self._subscribers: list[asyncio.Queue] = []
        self.tensorboard = self._open_tensorboard(config)
        self.wandb = self._open_wandb(config)

    def _open_tensorboard(self, config):
        if not config.use_tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        folder = pathlib.Path(config.use_tensorboard) / (config.wandb_run_name or self.run_dir.name)
        log_event(_log, "metrics.tensorboard", folder=str(folder))
        return SummaryWriter(str(folder))

    def _open_wandb(self, config):
        if not config.use_wandb:
            return None
        try:
            import wandb
        except ImportError:
            log_event(_log, "metrics.wandb_missing", level=30,
                      fix="pip install wandb (optional; metrics stay in metrics.jsonl)")
            return None
        key = config.use_wandb
        if key.lower() == "offline":
            os.environ["WANDB_MODE"] = "offline"
        elif key.lower() not in ("true", "1", "yes") and os.environ.get("WANDB_MODE") != "offline":
            wandb.login(key=key)
        run = wandb.init(project=config.wandb_project, entity=config.wandb_org or None,
                         group=config.wandb_group or None, name=config.wandb_run_name or self.run_dir.name,
                         dir=str(self.run_dir), config={k: v for k, v in public_config(config).items()
                                                        if isinstance(v, (int, float, str, bool, list))},
                         mode="offline" if os.environ.get("WANDB_MODE") == "offline" else None, reinit=True)
        log_event(_log, "metrics.wandb", mode=os.environ.get("WANDB_MODE", "online"), dir=str(self.run_dir))
        return run

    def log(self, step: int, metrics: dict) -> dict:
        """Records one step's metrics everywhere; returns the JSONL record."""
        record = {"global_step": step, "unix_time": time.time()}
        record.update({k: v for k, v in metrics.items() if _finite(v) is not None})
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        self.history.append(record)
        for key, gauge in GAUGES.items():
            if key in record:
                gauge.set(record[key])
        _export_eval(record)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("global_step", "unix_time"):
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "unix_time"}, step=step)
        for queue in self._subscribers:
            queue.put_nowait(record)
        return record

    def log_if_missing(self, step: int, metrics: dict) -> None:
        """Logs a checkpointed step's metrics kept in its checkpoint when this file lacks the step
        (a coordinator that died after the save and before the log line)."""
        if step and metrics and not any(r["global_step"] == step for r in self.history):
            self.log(step, metrics)

    def rewind(self, step: int) -> None:
        """Drops the records after `step` (the run went back to a checkpoint and redoes them)."""
        self.history = [r for r in self.history if r["global_step"] <= step]
        self._file.close()
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in self.history))
        self._file = open(self.path, "a", encoding="utf-8")

    def subscribe(self) -> asyncio.Queue:
        """A queue that receives every record logged from now on, then None when the run ends."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    def close(self) -> None:
        for queue in self._subscribers:
            queue.put_nowait(None)
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
