"""A step's logged metrics (rewards, reward logs and rewards per difficulty / data source, lengths
and the truncated share, KL, advantages, phase times, throughput), also observed into the
coordinator's Prometheus series."""

from __future__ import annotations

import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.coordinator.loop import metrics as prom
from services.coordinator.loop.group_rewards import group_rewards
from services.coordinator.loop.reward_logs import reward_metrics


def step_metrics(cfg, state, step: int, collector, batch: dict, gen: dict, times: dict, step_s: float,
                 rpc_seconds: dict, rpc_counts: dict) -> dict:
    """Metrics of step `step` from its collector (every generated sample), the training batch,
    generation counts, phase times and the per-sample calls (number, summed seconds)."""
    all_samples = collector.all_samples()
    rewards = torch.tensor([s.reward for s in all_samples if s.reward is not None], dtype=torch.float32)
    lengths = torch.tensor([len(s.response_ids) for s in all_samples], dtype=torch.float32)
    tokens = int(lengths.sum())
    m = {"reward/mean": rewards.mean().item() if len(rewards) else 0.0,
         "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
         "reward/max": rewards.max().item() if len(rewards) else 0.0,
         "reward/min": rewards.min().item() if len(rewards) else 0.0,
         "response_length/mean": lengths.mean().item() if len(lengths) else 0.0,
         "response_length/max": lengths.max().item() if len(lengths) else 0.0,
         "response_length/truncated_ratio": sum(s.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
                                                for s in all_samples) / max(len(all_samples), 1),
         "kl/coef": state.kl_coef,
         "samples/generated": len(all_samples), "samples/trained": batch["count"],
         "progress/episode": state.episode, "progress/prompts_consumed": state.prompts_consumed}
    logs = reward_metrics(all_samples)
    for key, value in logs.items():
        prom.REWARD_LOG.labels(key.removeprefix("reward/")).set(value)
    m.update(logs)
    m.update(group_rewards(all_samples))
    if batch["count"]:
        mask = batch["mask"]
        per_sample_kl = (batch["kl"] * mask).sum(1) / mask.sum(1).clamp(min=1)
        m["kl/mean"] = per_sample_kl.mean().item()
        adv = batch["advantages"][mask.bool()]
        m["advantages/mean"], m["advantages/abs_mean"] = adv.mean().item(), adv.abs().mean().item()
        if cfg.overlong_buffer_len:
            m["reward/overlong_penalty"] = batch["penalty"].mean().item()
        if cfg.stop_properly_penalty_coef is not None:  # the share of the batch's rewards it changed
            m["reward/stop_properly_penalised"] = batch["truncated"].float().mean().item()
    if cfg.dynamic_filtering:
        m.update({"filter/kept_groups": len(collector.kept), "filter/dropped_groups": len(collector.dropped),
                  "filter/rounds": gen["filter_rounds"]})
        prom.FILTERED_PROMPTS.inc(len(collector.dropped))
    for what, seconds in rpc_seconds.items():
        if rpc_counts.get(what):
            m[f"rpc/{what}_s"], m[f"rpc/{what}_calls"] = seconds, rpc_counts[what]
    for phase, seconds in times.items():
        m[f"time/{phase}_s"] = seconds
        if phase != "coordinator_cpu":
            prom.PHASE_SECONDS.labels(phase).observe(seconds)
    m["time/step_s"] = step_s
    # Wall time outside generate, score, train and push (advantages and bookkeeping included).
    m["time/overhead_s"] = max(step_s - sum(times[k] for k in ("generate", "score", "train", "push")), 0.0)
    m["time/overhead_ratio"] = m["time/overhead_s"] / step_s if step_s > 0 else 0.0
    m["throughput/samples_per_s"] = len(all_samples) / step_s
    m["throughput/tokens_per_s"] = tokens / step_s
    prom.STEP_SECONDS.observe(step_s)
    prom.SAMPLES.inc(len(all_samples))
    prom.GENERATED_TOKENS.inc(tokens)
    prom.STEPS.inc()
    prom.GLOBAL_STEP.set(step)
    return m
