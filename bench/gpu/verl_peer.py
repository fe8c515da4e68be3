"""veRL 0.9.1 as the fourth framework of vs_peers.py: its data, its reward file, its command and its step log.

veRL runs as `python -m verl.trainer.main_ppo` with hydra overrides: the v1 "sync" trainer (0.9.1's
default, trainer.use_v1=True, which needs the transferqueue package), FSDP actor (strategy fsdp, as in
its GRPO examples) and vLLM in its hybrid engine on the same GPU (rollout mode async, the only mode
0.9.1 has: an in-process vLLM AsyncLLM server per replica). Its prompts are a parquet file converted
from vs_peers.py's prompts.jsonl; its reward is a custom_reward_function file with the same rule.

Settings that differ from the other frameworks (for the benchmark pages, docs/benchmarks/method.md):
  - Attention: sdpa and no sample packing (actor_rollout_ref.model.use_remove_padding=False), padded
    micro-batches like OpenRLHF. veRL's default is flash_attention_2 with padding removal, which needs
    the flash-attn package (no wheel for the GPU machine's torch 2.11); rlmesh packs samples.
  - Micro-batches: token-budgeted (actor.use_dynamic_bsz) for the update and the old log-probs, with
    rlmesh's budget (vs_peers.Job.micro_batch_tokens: the tokens of 32 full-length samples, 18,432 on job A,
    34,816 on job B), as veRL's performance-tuning guide advises; TRL and OpenRLHF take 32 samples per micro-batch.
  - Learner: FSDP (FULL_SHARD of one rank) with fp32 master parameters and bf16 compute (veRL's
    model_dtype fp32 + mixed precision), plain torch AdamW; rlmesh and OpenRLHF use DeepSpeed ZeRO-2
    bf16, TRL plain torch AdamW. FSDP's own torch.compile of the log-prob/entropy helpers stays on
    (veRL's default, use_torch_compile=True).
  - Sleep and offload: veRL's defaults for a model that fits. vLLM sleeps after each generation
    (rollout.free_cache_engine=True, its hybrid-engine default: level-2 sleep, weights and KV cache
    freed, weights pushed back from FSDP after the update). The FSDP model and optimizer stay on the
    GPU during generation (fsdp_config.param_offload / optimizer_offload False, veRL's defaults and
    its GRPO examples' values; its config says offload "trades speed for memory", and a 0.5B model's
    states take a few GiB of the H200's 139). rlmesh and OpenRLHF offload the DeepSpeed states during
    generation (--deepspeed_enable_sleep / --ds.enable_sleep); TRL keeps its model on the GPU too.
  - Weight push: veRL's "naive" checkpoint engine (in-process, bucketed, CUDA IPC into the vLLM worker),
    timed by veRL as timing_s/update_weights at the end of each step (wake weights, push, wake KV cache).
  - Rollout: vLLM weights start as dummy (load_format=dummy, veRL's default) and are pushed from FSDP
    before the first step; vLLM logprobs are also returned (rollout.calculate_log_probs=True, default),
    and the old log-probs are still recomputed by the actor (timing_s/old_log_prob), as the others do.
    The requests go one by one through veRL's agent loop (8 agent-loop workers, 8 reward-loop workers,
    its defaults) into vLLM; max_num_seqs 512 and max_num_batched_tokens 4096 as rlmesh and TRL.
  - Loss: GRPO advantages (reward - group mean) / group std (norm_adv_by_std_in_grpo=True), PPO clip
    0.2 with dual-clip c=3, token-mean loss aggregation over the mini-batch, grad clip 1.0: veRL's
    defaults. Weight decay set to 0 (veRL's default is 0.01; rlmesh's --l2 is 0).
  - Prompts: the chat template applied by veRL to [{"role": "user", "content": prompt}] and left-padded
    to max_prompt_length 64 (data.truncation=error: a longer prompt stops the run instead of being cut).
  - Steps are the console logger's "step:N - key:value - ..." lines (printed once the step's metrics
    are computed, after update_weights); veRL's own phase times come from those lines.
  - Packages: veRL pins transformers <5.11 and vllm 0.24 (its [vllm] extra); it runs here on the GPU
    machine's transformers 5.17 and vLLM 0.26, installed without its pins.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

SAMPLES_PER_PROMPT, LEARNING_RATE, PROMPT_MAX_LEN = 8, 1e-6, 64  # as in vs_peers.py
DATA_SOURCE = "arith"

REWARD_FILE = '''"""veRL's side of the rule reward shared by the frameworks: 1 when the label's digits appear in the response."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if str(ground_truth) in solution_str else 0.0
'''


def input_paths(scratch: pathlib.Path) -> dict[str, pathlib.Path]:
    return {"verl_data": scratch / "verl_prompts.parquet", "verl_reward": scratch / "verl_reward.py"}


def write_inputs(scratch: pathlib.Path) -> dict[str, pathlib.Path]:
    """scratch/prompts.jsonl ({"prompt", "label"} per line) -> the parquet veRL's RLHFDataset reads
    (prompt: a chat message list, data_source, reward_model.ground_truth) and the reward file."""
    import pandas as pd

    paths = input_paths(scratch)
    rows = [json.loads(line) for line in (scratch / "prompts.jsonl").read_text().splitlines() if line.strip()]
    frame = pd.DataFrame([{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": r["prompt"]}],
                           "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(r["label"])},
                           "extra_info": {"index": i}} for i, r in enumerate(rows)])
    frame.to_parquet(paths["verl_data"], index=False)
    paths["verl_reward"].write_text(REWARD_FILE)
    return paths


def verl_command(job, model, paths, work: pathlib.Path, scratch: pathlib.Path, args) -> list[str]:
    return as_command(verl_overrides(job, model, paths, scratch, args))


def as_command(overrides: dict) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *(f"{key}={value}" for key, value in overrides.items())]


def verl_overrides(job, model, paths, scratch: pathlib.Path, args, prompt_max_len: int = PROMPT_MAX_LEN,
                   learning_rate: float = LEARNING_RATE, samples_per_prompt: int = SAMPLES_PER_PROMPT) -> dict:
    """veRL's hydra overrides for a job (vs_peers.Job's max_tokens, micro_batch_tokens, name) and the
    benchmark's options (prompts_per_step, gpu_memory_utilization, steps, liger); learn_peers.py
    adds its own on top."""
    A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."  # noqa: N806
    overrides = {
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
        "data.train_files": paths["verl_data"], "data.val_files": paths["verl_data"],
        "data.train_batch_size": args.prompts_per_step, "data.max_prompt_length": prompt_max_len,
        "data.max_response_length": job.max_tokens, "data.shuffle": False, "data.seed": 42,
        "data.truncation": "error", "data.filter_overlong_prompts": False,
        "actor_rollout_ref.hybrid_engine": True, "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        # flash-attn has no wheel for torch 2.11: sdpa, and so no padding removal (it patches flash attention)
        "actor_rollout_ref.model.use_remove_padding": False,
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        A + "strategy": "fsdp", A + "fsdp_config.dtype": "bfloat16",
        A + "fsdp_config.param_offload": False, A + "fsdp_config.optimizer_offload": False,
        A + "optim.lr": learning_rate, A + "optim.lr_warmup_steps_ratio": 0,
        A + "optim.lr_scheduler_type": "constant", A + "optim.weight_decay": 0.0,
        A + "ppo_mini_batch_size": args.prompts_per_step, A + "ppo_epochs": 1,
        # token-budgeted micro-batches (veRL's performance-tuning advice), the budget rlmesh's command gets
        A + "use_dynamic_bsz": True, A + "ppo_max_token_len_per_gpu": job.micro_batch_tokens,
        A + "use_kl_loss": False, A + "entropy_coeff": 0,
        R + "name": "vllm", R + "mode": "async", R + "n": samples_per_prompt, R + "temperature": 1.0,
        R + "tensor_model_parallel_size": 1, R + "gpu_memory_utilization": args.gpu_memory_utilization,
        # veRL's hybrid-engine default: vLLM sleeps (weights and KV cache freed) while FSDP trains
        R + "free_cache_engine": True,
        R + "log_prob_use_dynamic_bsz": True, R + "log_prob_max_token_len_per_gpu": job.micro_batch_tokens,
        R + "max_model_len": prompt_max_len + job.max_tokens,
        R + "max_num_seqs": 512, R + "max_num_batched_tokens": 4096,  # rlmesh's and TRL's values
        "reward.custom_reward_function.path": paths["verl_reward"],
        "reward.custom_reward_function.name": "compute_score",
        "trainer.logger": "[console]", "trainer.project_name": "vs_peers", "trainer.experiment_name": f"job{job.name}",
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 1, "trainer.total_epochs": 1,
        "trainer.total_training_steps": args.steps, "trainer.critic_warmup": 0,
        "trainer.val_before_train": False, "trainer.test_freq": -1, "trainer.save_freq": -1,
        "trainer.resume_mode": "disable", "trainer.default_local_dir": scratch / "ckpt",
    }
    if args.liger:
        overrides["actor_rollout_ref.model.use_liger"] = True
    return overrides


# veRL's console logger (verl/utils/logger/aggregate_logger.py, concat_dict_to_str) prints
# "step:3 - key:value - key:value" with pprint.pformat'ed numbers (numpy ones as np.float64(1.5));
# Ray prefixes the lines of its actors with "(TaskRunnerV1 pid=...) ".
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(r"(?:^|\) )step:(\d+) - (.*)$", re.M)
NUMBER = re.compile(r"^(?:np\.\w+\()?(-?(?:[\d.]+(?:e[-+]?\d+)?|nan|inf))\)?$")


def read_steps(log: pathlib.Path, seen: int) -> list[dict]:
    """Step records past the first `seen`, from veRL's console lines: {"step", metric name: value}."""
    text = log.read_text(errors="replace") if log.exists() else ""
    text = ANSI_COLOUR.sub("", text)  # Ray colours the "(TaskRunnerV1 pid=...)" prefix of forwarded lines
    out: dict[int, dict] = {}
    for m in STEP_LINE.finditer(text):
        row = {"step": int(m.group(1))}
        for item in m.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = NUMBER.match(value.strip())
            if key and number:
                row[key] = float(number.group(1))
        out.setdefault(row["step"], row)  # a line Ray forwards twice counts once
    return list(out.values())[seen:]


if __name__ == "__main__":  # vs_peers.py writes the parquet in a child with the peers' packages (pandas)
    print(json.dumps({k: str(v) for k, v in write_inputs(pathlib.Path(sys.argv[1])).items()}))
