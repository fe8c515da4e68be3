"""--dry_run of the learner service: what `python -m services.learner` / `rlmesh serve learner` would
start, checked without loading a model, forming the rank group or starting a rank
(services/common/service_plan.py).

Checked as a start would meet them: the ranks (flags and the launcher's environment, already resolved
by __main__), that this machine has a GPU for each local rank, the actor's and the critic's weight
files, the DeepSpeed settings (validated by the config for the world size). Printed by rank 0 (under a
launcher every rank would print the same): the models, the ranks, ZeRO and precision, a rough memory
estimate of the model states per GPU, where rank 0 would serve.
"""

from __future__ import annotations

import torch

from services.common.config import ConfigError
from services.common.memory_estimate import gib, learner_state_bytes
from services.common.service_plan import checked_model_folder, print_service_plan
from services.learner.config import LearnerConfig
from services.learner.spmd import RankSpec


def _check_gpus(spec: RankSpec) -> str:
    """The device the ranks train on; ConfigError when a local rank has no GPU of its own."""
    if spec.backend != "nccl":
        return "the CPU (gloo)"
    count = torch.cuda.device_count()
    if spec.spawn_local and spec.world_size > count:
        raise ConfigError(f"--num_gpus {spec.world_size}: this machine has {count} GPU(s), one per rank; give at "
                          f"most {count}")
    if spec.local_rank >= count:
        raise ConfigError(f"local rank {spec.local_rank} (--local_rank / LOCAL_RANK) has no GPU: this machine has "
                          f"{count}")
    return "GPUs (NCCL)"


def plan_lines(config: LearnerConfig, spec: RankSpec) -> list[str]:
    device = _check_gpus(spec)
    actor = checked_model_folder("--pretrain", config.pretrain, tokenizer=False)
    critic = checked_model_folder("--critic_pretrain", config.critic_pretrain, tokenizer=False) \
        if config.critic_pretrain else None
    world = spec.world_size
    states = learner_state_bytes(actor, world, config.zero_stage, config.bf16, config.adam_offload,
                                 0.01 if config.lora_rank else 1.0)  # adapters: about a percent of the weights
    if critic is not None:  # the critic trains in full
        states += learner_state_bytes(critic, world, config.zero_stage, config.bf16, config.adam_offload)
    others = "rank 1" if world == 2 else f"ranks 1-{world - 1}"
    ranks = (f"rank 0 starts {others} on this machine" if spec.spawn_local
             else "this process alone" if world == 1
             else f"each started by a launcher; the rendezvous store at {spec.master_addr}:{spec.master_port}")
    return [f"actor    {config.pretrain} ({actor:,} parameters)"
            + (f", LoRA rank {config.lora_rank} (the adapter trains)" if config.lora_rank else ""),
            f"critic   {config.critic_pretrain} ({critic:,} parameters)" if critic is not None
            else "critic   none (GRPO, RLOO, REINFORCE++)",
            f"ranks    {world} on {device}: {ranks}",
            f"training ZeRO-{config.zero_stage}, {'bf16' if config.bf16 else 'fp32'}, attention "
            f"{config.attn_implementation}, log-probs head {config.logprobs_head}"
            + (", Adam states in host memory" if config.adam_offload else "")
            + (", gradient checkpointing" if config.gradient_checkpointing else ""),
            f"memory   per rank {gib(states)} of model states (actor"
            + (" and critic" if critic is not None else "") + "; activations not counted)"]


def print_plan(config: LearnerConfig, spec: RankSpec, out=None) -> int:
    """Rank 0 prints the plan; another rank says that it would join it."""
    if spec.rank != 0:
        print(f"dry run (learner rank {spec.rank} of {spec.world_size}): nothing was started; rank 0 prints the "
              "plan", file=out, flush=True)
        return 0
    return print_service_plan("learner", config, plan_lines(config, spec), out)
