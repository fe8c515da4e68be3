"""What a collected step becomes for the learner: the padded batch with its advantages
(services.coordinator.loop.advantages), the ExperienceBatch messages, and TrainActor / TrainCritic."""

from __future__ import annotations

import functools
import hashlib
import math
import pathlib
import warnings

import torch

from rlmesh.learner.v1 import learner_pb2
from services.common.tasks import gather_or_cancel
from services.common.tensors import ragged_to_proto, to_proto
from rlmesh.rollout.v1 import rollout_pb2
from services.coordinator.loop.advantages import (
    compute_advantages,
    length_mask,
    overlong_penalty,
    pad_right,
    stop_properly_penalty,
)
from services.coordinator.loop.experience import Sample

KL_ESTIMATORS = {"k1": learner_pb2.KL_ESTIMATOR_K1, "k2": learner_pb2.KL_ESTIMATOR_K2,
                 "k3": learner_pb2.KL_ESTIMATOR_K3}
IS_CORRECTION_TYPES = {"tis": learner_pb2.IS_CORRECTION_TYPE_TIS, "icepop": learner_pb2.IS_CORRECTION_TYPE_ICEPOP,
                       "seq-mask-tis": learner_pb2.IS_CORRECTION_TYPE_SEQ_MASK_TIS}
LOSS_LEVELS = {"token": learner_pb2.LOSS_AGGREGATION_TOKEN_MEAN, "sequence": learner_pb2.LOSS_AGGREGATION_SEQUENCE_MEAN,
               "sequence_sum": learner_pb2.LOSS_AGGREGATION_SEQUENCE_SUM}


def step_seed(seed: int, step: int, what: str) -> int:
    """A seed for one purpose of one step, from --seed alone (a redone step gets the same)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{what}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def training_batch(cfg, samples: list[Sample], kl_coef: float, use_ref: bool, use_critic: bool) -> dict:
    """Pads the step's samples and computes advantages; returns the training batch."""
    if not samples:
        return {"count": 0}
    lengths = [len(s.response_ids) for s in samples]
    mask = length_mask(lengths)  # (B, T)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (B,)
    penalty = overlong_penalty(torch.tensor(lengths), cfg.generate_max_len, cfg.overlong_buffer_len,
                               cfg.overlong_penalty_factor)
    logp = pad_right([s.old_logprobs for s in samples])
    ref = pad_right([s.ref_logprobs for s in samples]) if use_ref else None
    values = pad_right([s.values for s in samples]) if use_critic else None
    truncated = torch.tensor([s.finish_reason == rollout_pb2.FINISH_REASON_LENGTH for s in samples])
    shaped = stop_properly_penalty(rewards + penalty, truncated, cfg.stop_properly_penalty_coef)
    result = compute_advantages(
        shaped, mask, cfg.advantage_estimator, cfg.n_samples_per_prompt, logp=logp, ref_logp=ref,
        values=values, kl_coef=kl_coef, kl_estimator=cfg.kl_estimator, use_kl_loss=cfg.use_kl_loss,
        gamma=cfg.gamma, lambd=cfg.lambd, reward_clip=tuple(cfg.reward_clip_range),
        std_norm=not cfg.no_advantage_std_norm)
    # The learner takes whole multiples of train_batch_size (fewer kept groups after filtering).
    count = len(samples) // cfg.train_batch_size * cfg.train_batch_size
    return {"samples": samples[:count], "count": count, "lengths": lengths[:count], "mask": mask,
            "advantages": result.advantages, "returns": result.returns, "kl": result.kl, "penalty": penalty,
            "truncated": truncated, "all_samples": samples}


def experience(cfg, batch: dict, actor: bool, with_ref: bool) -> learner_pb2.ExperienceBatch:
    """The actor's (or the critic's) ExperienceBatch of a training batch."""
    samples, lengths, count = batch["samples"], batch["lengths"], batch["count"]
    rows = lambda t: [t[i, :lengths[i]] for i in range(count)]  # noqa: E731 - (B, T) -> ragged
    exp = learner_pb2.ExperienceBatch(
        input_ids=ragged_to_proto([s.sequence for s in samples], torch.int32),
        response_start=to_proto(torch.tensor([s.response_start for s in samples], dtype=torch.int64)))
    if any(s.action_mask is not None for s in samples):  # multi-turn: environment tokens are not trained
        exp.action_mask.CopyFrom(ragged_to_proto(
            [s.action_mask if s.action_mask is not None else torch.ones(len(s.response_ids), dtype=torch.uint8)
             for s in samples], torch.uint8))
    if actor:
        exp.old_logprobs.CopyFrom(ragged_to_proto([s.old_logprobs for s in samples], torch.float32))
        if cfg.use_tis:
            exp.rollout_logprobs.CopyFrom(ragged_to_proto([s.rollout_logprobs for s in samples], torch.float32))
        exp.advantages.CopyFrom(ragged_to_proto(rows(batch["advantages"]), torch.float32))
        if with_ref:
            exp.ref_logprobs.CopyFrom(ragged_to_proto([s.ref_logprobs for s in samples], torch.float32))
    else:
        exp.returns.CopyFrom(ragged_to_proto(rows(batch["returns"]), torch.float32))
        exp.old_values.CopyFrom(ragged_to_proto([s.values for s in samples], torch.float32))
    return exp


def actor_loss(cfg, kl_coef: float, kl_in_loss: bool) -> learner_pb2.ActorLoss:
    """The actor's loss as the flags define it (kl_coef: the step's, possibly adapted)."""
    low_high = cfg.eps_clip_low_high or [cfg.eps_clip, cfg.eps_clip]
    level, policy_level = cfg.loss_levels()
    return learner_pb2.ActorLoss(
        policy_loss_type=learner_pb2.POLICY_LOSS_TYPE_GSPO if cfg.policy_loss_type == "gspo"
        else learner_pb2.POLICY_LOSS_TYPE_PPO,
        eps_clip_low=low_high[0], eps_clip_high=low_high[1], dual_clip=cfg.dual_clip,
        kl_coef=kl_coef if kl_in_loss else 0.0,
        kl_estimator=KL_ESTIMATORS[cfg.kl_estimator], entropy_coef=cfg.entropy_loss_coef,
        loss_aggregation=LOSS_LEVELS[level], policy_loss_aggregation=LOSS_LEVELS[policy_level],
        temperature=cfg.temperature, tis_cap=cfg.tis_cap if cfg.use_tis else 0.0,
        tis_low=cfg.tis_low if cfg.use_tis else 0.0, is_correction_type=IS_CORRECTION_TYPES[cfg.tis_type],
        aux_loss_coef=cfg.aux_loss_coef)


def critic_aux_loss_coef(cfg) -> float:
    """The critic's share of --aux_loss_coef. OpenRLHF adds the actor's coefficient times the router loss
    to its critic's loss too; a critic that is not a mixture-of-experts model (a dense reward model
    under a MoE actor) has no router loss, so it gets 0, with a warning. A folder that is not on this
    machine (a Ray cluster's) gets the coefficient: its learner refuses it for a dense critic."""
    path = cfg.critic_pretrain or cfg.reward_pretrain or cfg.pretrain
    if cfg.aux_loss_coef <= 0 or not pathlib.Path(path, "config.json").is_file() or _is_moe(path):
        return cfg.aux_loss_coef
    if path not in _DENSE_CRITICS_TOLD:
        _DENSE_CRITICS_TOLD.add(path)
        warnings.warn(f"--aux_loss_coef {cfg.aux_loss_coef:g}: the critic's model {path} is not a mixture-of-experts "
                      "model, so only the actor's loss gets the router loss", stacklevel=2)
    return 0.0


_DENSE_CRITICS_TOLD: set[str] = set()


@functools.cache
def _is_moe(path: str) -> bool:
    from services.common.moe_check import is_moe_model

    return is_moe_model(path)


async def train(learner, cfg, step: int, batch: dict, kl_coef: float, use_ref: bool, use_critic: bool) -> dict:
    """TrainActor (and TrainCritic) on the step's batch; returns their metrics."""
    level, _ = cfg.loss_levels()
    kl_in_loss = cfg.use_kl_loss and use_ref
    loss = actor_loss(cfg, kl_coef, kl_in_loss)
    seed = step_seed(cfg.seed, step, "shuffle")
    calls = [learner.TrainActor(learner_pb2.TrainActorRequest(
        batch=experience(cfg, batch, actor=True, with_ref=kl_in_loss and kl_coef > 0), loss=loss,
        max_epochs=cfg.max_epochs, shuffle_seed=seed, request_id=f"step{step}"), timeout=cfg.rpc_timeout_s)]
    critic_coef = critic_aux_loss_coef(cfg) if use_critic else 0.0
    if use_critic:
        calls.append(learner.TrainCritic(learner_pb2.TrainCriticRequest(
            batch=experience(cfg, batch, actor=False, with_ref=False), value_clip=cfg.value_clip,
            max_epochs=cfg.max_epochs, loss_aggregation=LOSS_LEVELS[level], shuffle_seed=seed,
            request_id=f"step{step}", aux_loss_coef=critic_coef), timeout=cfg.rpc_timeout_s))
    replies = await gather_or_cancel(calls)
    actor = replies[0]
    out = {"actor/policy_loss": actor.policy_loss, "actor/kl_loss": actor.kl_loss,
           "actor/clip_ratio": actor.clip_ratio, "actor/ppo_kl": actor.ppo_kl, "actor/grad_norm": actor.grad_norm,
           "actor/lr": actor.learning_rate, "actor/optimizer_steps": actor.optimizer_steps,
           "actor/skipped_steps": actor.skipped_steps, "actor/tokens": actor.tokens}
    if math.isfinite(actor.entropy):  # NaN: the learner did not measure it (never logged as a 0.0)
        out["actor/entropy"] = actor.entropy
    if cfg.use_tis:
        out["actor/rollout_kl"] = actor.rollout_kl
        if cfg.policy_loss_type != "gspo":  # GSPO corrects its sequence ratio instead of weighting tokens
            out["actor/tis_weight_mean"] = actor.tis_weight_mean
    if cfg.aux_loss_coef > 0:
        out["actor/aux_loss"] = actor.aux_loss
    if use_critic:
        critic = replies[1]
        out.update({"critic/value_loss": critic.value_loss, "critic/values_mean": critic.values_mean,
                    "critic/value_clip_ratio": critic.value_clip_ratio, "critic/grad_norm": critic.grad_norm,
                    "critic/lr": critic.learning_rate})
        if critic_coef > 0:
            out["critic/aux_loss"] = critic.aux_loss
    return out
