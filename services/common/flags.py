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


# --reward_func: the built-in rule rewards (services/reward/rules.py), and those that need a label.
REWARD_RULES = ("math", "simplerl_math", "exact_match", "format", "countdown")
LABELLED_REWARD_RULES = ("math", "simplerl_math", "exact_match", "countdown")


@dataclasses.dataclass(frozen=True)
class SharedFlag:
    """One flag's help text and check (value -> "" when good, else what is wrong and what to give)."""

    help: str
    check: Callable[[Any], str] | None = None
    choices: tuple | None = None

    def field(self, default):
        return opt(default, self.help, check=self.check, choices=list(self.choices) if self.choices else None)


def no_gpu_attention(given: str) -> str:
    """The one warning for FlashAttention asked for on a machine without a CUDA GPU, where the
    coordinator and the offline trainers alike train with sdpa instead (the learner service too)."""
    return (f"{given} needs a CUDA GPU and this machine has none: training with sdpa attention instead "
            "(PyTorch's scaled dot-product attention; the same maths, slower on long sequences)")


def positive(example: str) -> Callable[[float], str]:
    return lambda value: "" if value > 0 else f"must be > 0 (e.g. {example})"


def at_least_one(why: str = "") -> Callable[[int], str]:
    return lambda value: "" if value >= 1 else "must be >= 1" + (f" ({why})" if why else "")


# ---- coordinator and learner ------------------------------------------------------------------
ACTOR_LEARNING_RATE = SharedFlag("peak learning rate of the actor (after the warm-up, before the schedule's decay)",
                                 positive("5e-7"))
CRITIC_LEARNING_RATE = SharedFlag("peak learning rate of the critic (PPO with --advantage_estimator gae)",
                                  positive("9e-6"))
# The learner's DeepSpeed and optimizer settings: the coordinator passes them to every learner rank.
LR_SCHEDULERS = ("constant_with_warmup", "cosine_with_min_lr")
ZERO_STAGE = SharedFlag("DeepSpeed ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, 2 = also "
                        "gradients, 3 = also parameters", choices=(0, 1, 2, 3))
DEEPSPEED_FILE = SharedFlag(
    "a DeepSpeed config file (JSON or YAML, or an Accelerate config with a deepspeed_config section, e.g. "
    "simpleRL-reason's recipes): its ZeRO stage, optimizer offload, bf16, gradient clipping, Adam betas and weight "
    "decay replace these flags' values; its other settings are laid over rlmesh's DeepSpeed config; 'auto' values "
    "keep rlmesh's; batch sizes must match the flags")
BF16 = SharedFlag("bfloat16 parameters and activations (fp32 master weights and gradient accumulation); "
                  "otherwise float32")
GRADIENT_CHECKPOINTING = SharedFlag("recompute activations in the backward pass: less memory, about a third more "
                                    "compute")
ADAM_OFFLOAD = SharedFlag("keep Adam states and fp32 master weights in host memory (DeepSpeedCPUAdam); needs ZeRO "
                          "stage >= 1")
MAX_NORM = SharedFlag("gradient clipping: bound on the global L2 norm of the gradients; 0 disables",
                      lambda value: "" if value >= 0 else "must be >= 0 (0 disables clipping)")
MICRO_TRAIN_BATCH_SIZE = SharedFlag("samples per forward/backward pass on one learner rank", at_least_one())
TRAIN_BATCH_SIZE = SharedFlag("samples per optimizer step over all learner ranks; a multiple of "
                              "micro_train_batch_size x ranks (the quotient is the gradient accumulation)",
                              at_least_one())
LR_SCHEDULER = SharedFlag("learning-rate schedule after the linear warm-up: constant, or cosine decay to "
                          "min_lr_ratio x the peak over the run's optimizer steps", choices=LR_SCHEDULERS)
LR_WARMUP_RATIO = SharedFlag("fraction of the run's optimizer steps spent warming up linearly from 0",
                             lambda value: "" if 0 <= value <= 1 else "must be in [0, 1]")
L2 = SharedFlag("AdamW weight decay (not applied to biases and norm weights)",
                lambda value: "" if value >= 0 else "must be >= 0")
ADAM_BETAS = SharedFlag("AdamW's beta1 beta2 (OpenRLHF's default 0.9 0.95; veRL's 0.9 0.999)",
                        lambda value: "" if len(value) == 2 and all(0 <= b < 1 for b in value)
                        else "must be two numbers in [0, 1) (e.g. 0.9 0.95)")
USE_LIGER_KERNEL = SharedFlag("replace the model's RMSNorm, SwiGLU MLP and rotary embedding with the fused Triton "
                              "kernels of the liger-kernel package (CUDA; pip install liger-kernel)")
PACKING_SAMPLES = SharedFlag("training: concatenate each micro-batch's samples into one row without padding "
                             "(attention kept within each sample)")
USE_DYNAMIC_BATCH = SharedFlag("training: micro-batches of as many samples as fit in --train_max_tokens_per_gpu "
                               "tokens (with --packing_samples) instead of --micro_train_batch_size samples each")
TRAIN_MAX_TOKENS_PER_GPU = SharedFlag("--use_dynamic_batch: most tokens in one micro-batch of one learner rank (a "
                                      "longer sample gets a micro-batch of its own)", at_least_one())
MAX_CKPT_NUM = SharedFlag("checkpoints kept (the oldest are removed first when a new one is saved)", at_least_one())

# LoRA (services/learner/lora.py): the coordinator passes them to the learner for the actor (the
# critic is trained in full); the offline trainers apply them to the model they train.
# services/common/lora_check.py checks them together, against the model, before anything starts.
LORA_RANK = SharedFlag("LoRA rank: the actor (the trained model, in SFT / RM / DPO) gets low-rank adapters on "
                       "--target_modules and only they train, the base weights stay frozen; 0 = no LoRA, every "
                       "weight trains", lambda value: "" if value >= 0 else "must be >= 0 (0 = no LoRA; e.g. 16)")
LORA_ALPHA = SharedFlag("LoRA alpha: the adapter's update B @ A is scaled by lora_alpha / lora_rank", positive("16"))
TARGET_MODULES = SharedFlag("the layers that get an adapter, by the last part of their name (q_proj v_proj ...), or "
                            "all-linear: every linear layer but the output head")
LORA_DROPOUT = SharedFlag("dropout on the adapter's input in training",
                          lambda value: "" if 0 <= value < 1 else "must be in [0, 1) (e.g. 0.05; 0 = none)")
LORA_MERGE_ON_SAVE = SharedFlag("with --lora_rank: a saved model (the final one, --save_hf_ckpt exports) is the "
                                "adapter folder (adapter_config.json, adapter_model.safetensors) plus, in its merged/ "
                                "folder, the base model with the adapter merged in: a plain Hugging Face model")

# ---- coordinator and rollout ------------------------------------------------------------------
ENFORCE_EAGER = SharedFlag("vLLM without CUDA graphs / torch.compile: faster start, less memory, slower decode; "
                           "unset: eager on a CPU (compiling a 135M model there took ~30 s more at start for "
                           "~1.1-1.2x the decode rate), compiled on a GPU; --no-enforce_eager compiles on a CPU "
                           "too, worth it for long runs")
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
