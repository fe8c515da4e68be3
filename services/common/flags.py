"""Flags that mean the same in the coordinator and in a service, declared once.

The coordinator takes these flags from the user and hands them on to the service it starts
(services.coordinator.fleet.placement builds the command lines); a service started by hand takes
them directly. Each is declared here once, with its help text and its check, so both accept and
refuse the same values with the same message. A config declares such a field with the flag's
`field(default)` (its default may differ where the two differ today: the coordinator keeps
OpenRLHF's, a service its own) and calls services.common.config.check_fields in validate().

Flags with the same name but another meaning are not here: --pretrain (the policy for the
coordinator, the served model for the rollout service), --seed (data order vs engine seed),
--ref_pretrain (the coordinator defaults it to --pretrain), --partial_rollout (the coordinator's
way of pushing vs the rollout service's permission), --device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.common.config import opt


@dataclasses.dataclass(frozen=True)
class SharedFlag:
    """One flag's help text and check (value -> "" when good, else what is wrong and what to give)."""

    help: str
    check: Callable[[Any], str] | None = None

    def field(self, default):
        return opt(default, self.help, check=self.check)


def positive(example: str) -> Callable[[float], str]:
    return lambda value: "" if value > 0 else f"must be > 0 (e.g. {example})"


def at_least_one(why: str = "") -> Callable[[int], str]:
    return lambda value: "" if value >= 1 else "must be >= 1" + (f" ({why})" if why else "")


# ---- coordinator and learner ------------------------------------------------------------------
ACTOR_LEARNING_RATE = SharedFlag("peak learning rate of the actor (after the warm-up, before the schedule's decay)",
                                 positive("5e-7"))
CRITIC_LEARNING_RATE = SharedFlag("peak learning rate of the critic (PPO with --advantage_estimator gae)",
                                  positive("9e-6"))
MAX_CKPT_NUM = SharedFlag("checkpoints kept (the oldest are removed first when a new one is saved)", at_least_one())

# ---- coordinator and rollout ------------------------------------------------------------------
ENFORCE_EAGER = SharedFlag("vLLM without CUDA graphs / torch.compile: faster start, less memory, slower decode")
ENABLE_PREFIX_CACHING = SharedFlag("vLLM reuses the KV cache of shared prompt prefixes (the n samples of a prompt "
                                   "share theirs)")

# ---- coordinator and reward -------------------------------------------------------------------
REMOTE_RM_BATCH_SIZE = SharedFlag(
    "samples per call to a --remote_rm_url server or reward function; 1 calls them one sample at a time, as "
    "OpenRLHF does, and they may then answer single numbers for rewards and scores; an extra_logs entry given as "
    "one number is logged as a metric of its call, never copied to each sample",
    at_least_one("1 = one sample per call, as OpenRLHF calls reward servers and functions"))
NORMALIZE_REWARD = SharedFlag("normalise a reward model's scores by the mean and std stored in its config.json: "
                              "(score - mean) / std; rewards from --remote_rm_url or --reward_func are used as "
                              "they come")
