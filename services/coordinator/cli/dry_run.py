"""--dry_run of `rlmesh train` / `python -m services.coordinator.train_ppo_ray` / `main_ppo`: the run's
plan, checked, without starting anything.

The flags are parsed and validated as for a run; then the model folders, the prompt and evaluation
data (read and tokenized, as the run would: the usable prompts and the run's steps are counted), the
reward source (a function file's function, an agent file's classes, their OpenRLHF imports) are
checked, and the plan is printed: each service, the GPUs it takes on the cluster the flags describe
(actor GPUs are the ones colocated roles share; other roles get groups of their own, placed by Ray
or by the local placement), and a rough memory estimate of its model states. A problem is a
ConfigError naming the flag and the file (exit 2). No process, port or Ray connection is made: a
cluster script is checked on a laptop before it spends GPU hours.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

from services.common.config import ConfigError
from services.common.memory_estimate import gib, learner_state_bytes, parameter_count, weights_bytes
from services.common.python_names import defined_names
from services.coordinator.config import CoordinatorConfig


@dataclasses.dataclass
class Role:
    """One kind of service in the plan."""

    name: str  # learner, rollout, reference, reward
    instances: int
    gpus: str  # where: "actor GPUs 0-7", "own group of 8 GPUs", ...
    per_gpu: str  # memory estimate of its model states on one GPU
    note: str = ""


def _model_files(cfg: CoordinatorConfig) -> list[str]:
    """Each model folder the run reads must be a Hugging Face folder on this machine (the local placement),
    or on the cluster's shared storage (Ray: noted when it is not here)."""
    notes = []
    for flag in ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain"):
        path = getattr(cfg, flag)
        if not path or (flag == "critic_pretrain" and not cfg.critic_needed):
            continue
        if (pathlib.Path(path) / "config.json").is_file():
            continue
        if cfg.placement == "local":
            raise ConfigError(f"--{flag} {path}: no config.json there; give a local Hugging Face model folder")
        notes.append(f"--{flag} {path} is not on this machine: the {cfg.placement} placement's nodes must have it")
    return notes


def _reward_source(cfg: CoordinatorConfig) -> str:
    """What scores the samples, with the files checked (defined names, OpenRLHF imports: validate())."""
    if cfg.agent_func_path:
        defined = defined_names(cfg.agent_func_path)
        if not defined & {"AgentExecutor", "AgentInstance"}:
            raise ConfigError(f"--agent_func_path {cfg.agent_func_path} defines neither AgentExecutor nor "
                              "AgentInstance (OpenRLHF's agent API)")
        if not cfg.reward_service_needed:
            return f"the agent's own rewards ({cfg.agent_func_path}); no reward service"
    if cfg.reward_pretrain:
        return f"reward model {cfg.reward_pretrain}"
    if cfg.reward_func:
        return f"rule(s) {cfg.reward_func}"
    if cfg.placement == "static" and cfg.reward_addresses:
        return f"reward services at {', '.join(cfg.reward_addresses)}"
    entry = cfg.remote_rm_url
    head, sep, name = entry.rpartition(":")
    file, name = (head, name) if sep and head.endswith(".py") and name.isidentifier() else (entry, "")
    if file.endswith(".py") and pathlib.Path(file).is_file():
        wanted = {name} if name else {"reward_func", "compute_score"}
        if not defined_names(file) & wanted:
            raise ConfigError(f"--remote_rm_url {entry}: {file} defines no {' or '.join(sorted(wanted))}")
        return f"reward function file {entry}"
    return f"remote reward server(s) {entry} (not contacted by a dry run)"


def _data(cfg: CoordinatorConfig) -> tuple[int | None, int | None]:
    """(usable prompts, global steps) of --prompt_data, read and tokenized as the run does; (None, None)
    when the policy's tokenizer is not on this machine (then only the files are looked for)."""
    for part in (p.strip() for p in cfg.prompt_data.split(",")):
        if part and not pathlib.Path(part).exists():
            raise ConfigError(f"--prompt_data {part}: no such file or folder; give local JSONL / Parquet / Arrow "
                              "files or save_to_disk folders (rlmesh does not download data)")
    if not (pathlib.Path(cfg.pretrain) / "config.json").is_file():
        return None, None
    from transformers import AutoTokenizer

    from services.common.datasets import DatasetError
    from services.coordinator.cli.run_config import total_steps_of
    from services.coordinator.loop.data import build_prompt_stream

    try:
        stream = build_prompt_stream(cfg, AutoTokenizer.from_pretrained(cfg.pretrain))
    except DatasetError as exc:
        raise ConfigError(f"--prompt_data: {exc}") from exc
    steps = total_steps_of(cfg, stream.total_steps(cfg.rollout_batch_size))
    if steps == 0:
        raise ConfigError(f"--rollout_batch_size {cfg.rollout_batch_size} is larger than the {len(stream)} usable "
                          "prompts; lower it or add data")
    return len(stream), steps


def _span(prefix: str, first: int, count: int) -> str:
    return f"{prefix} {first}" if count == 1 else f"{prefix} {first}-{first + count - 1}"


def roles(cfg: CoordinatorConfig) -> list[Role]:
    """The services of the run on the cluster the flags describe (GPU counts as on GPUs)."""
    actor = cfg.actor_gpus()
    params = parameter_count(cfg.pretrain)
    lora = 0.01 if cfg.lora_rank else 1.0  # adapters: about a percent of the weights train
    learner = None if params is None else learner_state_bytes(params, actor, cfg.zero_stage, cfg.bf16,
                                                               cfg.adam_offload, lora)
    if learner is not None and cfg.critic_needed:
        critic = parameter_count(cfg.critic_pretrain or cfg.reward_pretrain or cfg.pretrain) or params
        learner += learner_state_bytes(critic, actor, cfg.zero_stage, cfg.bf16, cfg.adam_offload)
    out = [Role("learner", actor, f"{_span('actor GPUs', 0, actor)} ({cfg.actor_num_nodes} node(s) x "
                f"{cfg.actor_num_gpus_per_node}), one DeepSpeed rank each", gib(learner),
                f"ZeRO-{cfg.zero_stage}, {'bf16' if cfg.bf16 else 'fp32'}"
                + (", Adam states in host memory" if cfg.adam_offload else "")
                + (", critic on the same ranks" if cfg.critic_needed else "")
                + (", states offloaded between steps" if cfg.deepspeed_enable_sleep else ""))]
    tp = cfg.vllm_tensor_parallel_size
    engine = None if params is None else weights_bytes(params, cfg.bf16, tp)
    where = (f"actor GPUs (engine i on GPUs i*{tp}.. mod {actor})" if cfg.colocate_all_models
             else f"own group of {cfg.vllm_num_engines * tp} GPUs")
    out.append(Role("rollout", cfg.vllm_num_engines, f"{where}, tensor parallel {tp}", f"{gib(engine)} weights + "
                    f"KV cache (vLLM takes {cfg.vllm_gpu_memory_utilization or 'its default'} of each GPU)",
                    "sleeps between generations" if cfg.vllm_enable_sleep else ""))
    if cfg.ref_needed:
        shared = cfg.colocate_all_models or cfg.colocate_actor_ref
        count = actor if shared else cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        ref = parameter_count(cfg.ref_pretrain or cfg.pretrain)
        out.append(Role("reference", count, "actor GPUs (one each)" if shared else f"own group of {count} GPUs",
                        gib(None if ref is None else weights_bytes(ref, cfg.bf16))))
    if cfg.reward_service_needed:
        if cfg.colocate_all_models:
            count, where = actor, "actor GPUs (one each)"
        elif cfg.colocate_critic_reward:
            count = max(1, cfg.critic_num_nodes * cfg.critic_num_gpus_per_node)
            where = "the critic's GPUs (one each)"
        else:
            count = cfg.reward_num_nodes * cfg.reward_num_gpus_per_node
            where = f"own group of {count} GPUs"
        rm = parameter_count(cfg.reward_pretrain) if cfg.reward_pretrain else 0
        out.append(Role("reward", count, where, "none on the GPU (rules, files and servers run on the CPU)"
                        if not cfg.reward_pretrain else gib(None if rm is None else weights_bytes(rm, cfg.bf16))))
    return out


def gpus_in_all(cfg: CoordinatorConfig) -> int:
    total = cfg.actor_gpus()
    if not cfg.colocate_all_models:
        total += cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size
        if cfg.ref_needed and not cfg.colocate_actor_ref:
            total += cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        if cfg.reward_service_needed and not cfg.colocate_critic_reward:
            total += cfg.reward_num_nodes * cfg.reward_num_gpus_per_node
    return total


def print_plan(cfg: CoordinatorConfig, out=None) -> int:
    """Checks the run's inputs and prints its plan; ConfigError on a problem. Returns 0."""
    out = out or sys.stdout
    notes = _model_files(cfg)
    source = _reward_source(cfg)
    prompts, steps = _data(cfg)
    params = parameter_count(cfg.pretrain)
    if cfg.placement != "local":
        where = "services where the cluster puts them (it was not contacted)"
    elif cfg.on_gpu:
        where = "services on this machine's GPUs"
    else:
        where = "services on the CPU here: GPU-only flags were turned off; add --device cuda to plan the GPU run"
    lines = [f"dry run: nothing was started ({cfg.placement} placement, {where})",
             f"policy   {cfg.pretrain} ({f'{params:,}' if params else 'unknown number of'} parameters)",
             f"rewards  {source}",
             f"data     {cfg.prompt_data}: "
             + (f"{prompts} usable prompts, {steps} global steps of {cfg.rollout_batch_size} prompts x "
                f"{cfg.n_samples_per_prompt} samples" if prompts is not None else "files found (tokenizer not here)"),
             f"objective {cfg.advantage_estimator}" + (", async" if cfg.async_train else "")
             + (f", KL {cfg.init_kl_coef}" if cfg.ref_needed else ", no KL"),
             "services (GPUs as on the cluster the flags describe; memory: model states only, no activations):"]
    for role in roles(cfg):
        lines.append(f"  {role.name:<9} x{role.instances:<3} on {role.gpus}; per GPU {role.per_gpu}"
                     + (f"; {role.note}" if role.note else ""))
    lines.append(f"GPUs in all: {gpus_in_all(cfg)}" + (" (everything shares the actor's)" if cfg.colocate_all_models
                                                       else ""))
    lines += [f"note: {n}" for n in notes]
    print("\n".join(lines), file=out, flush=True)
    return 0
