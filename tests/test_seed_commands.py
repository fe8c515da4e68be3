"""The seed documents' commands (OpenRLHF's multi-node guide and skill page, simpleRL-reason's
guide) with the module name swapped: every flag they use is accepted by the matching rlmesh entry
point, or rejected with a message saying what to use instead; never silently ignored.

The commands are transcribed from the documents (flags and values unchanged). Each is parsed and
validated with the hub model names and data replaced by local tiny ones; the reward-model command
also runs at tiny sizes with simpleRL-reason's `--deepspeed FILE` (the GRPO command runs in
tests/coordinator/test_local.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ConfigError, build_parser, config_from_args, parse_config
from services.common.deepspeed_file import read_deepspeed_file
from services.coordinator.config import CoordinatorConfig
from services.learner.train_dpo import DPOConfig
from services.learner.train_rm import RMConfig

ROOT = Path(__file__).resolve().parents[1]

MULTI_NODE_PPO_70B = r"""
ray job submit --address=http://127.0.0.1:8265 --runtime-env-json='{"working_dir": "/openrlhf"}' \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
  --vllm_num_engines 2 --vllm_tensor_parallel_size 4 --pretrain meta-llama/Llama-2-70b-hf \
  --reward_pretrain ./reward-model-70b --save_path ./output/llama-70b-ppo --ckpt_path ./checkpoints/llama-70b-ppo \
  --save_steps 100 --logging_steps 1 --micro_train_batch_size 2 --train_batch_size 128 \
  --micro_rollout_batch_size 4 --rollout_batch_size 1024 --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024 \
  --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
  --init_kl_coef 0.01 --normalize_reward --gradient_checkpointing --flash_attn
"""
MULTI_NODE_HYBRID = r"""
ray job submit --address=http://127.0.0.1:8265 -- python3 -m openrlhf.cli.train_ppo_ray \
  --colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep \
  --actor_num_nodes 2 --actor_num_gpus_per_node 8 --critic_num_nodes 0 --critic_num_gpus_per_node 0 \
  --reward_num_nodes 0 --reward_num_gpus_per_node 0 --ref_num_nodes 0 --ref_num_gpus_per_node 0 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 4
"""
MULTI_NODE_64_GPUS = r"""
ray job submit --address=http://10.0.0.1:8265 --runtime-env-json='{"working_dir": "/openrlhf"}' \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --ref_num_nodes 2 --ref_num_gpus_per_node 8 --reward_num_nodes 2 --reward_num_gpus_per_node 8 \
  --critic_num_nodes 2 --critic_num_gpus_per_node 8 --actor_num_nodes 2 --actor_num_gpus_per_node 8 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 4 --pretrain meta-llama/Llama-2-70b-hf \
  --reward_pretrain ./reward-70b --save_path ./output/llama-70b-ppo --ckpt_path ./checkpoints/llama-70b-ppo \
  --save_steps 100 --save_hf_ckpt --micro_train_batch_size 1 --train_batch_size 128 \
  --micro_rollout_batch_size 2 --rollout_batch_size 1024 --max_epochs 1 --bf16 --zero_stage 3 \
  --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --gradient_checkpointing --flash_attn --packing_samples \
  --use_wandb {token} --wandb_project llama-70b-ppo
"""
SKILL_PPO_HYBRID = r"""
ray job submit --address=http://127.0.0.1:8265 --runtime-env-json='{"working_dir": "/openrlhf"}' \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5 \
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
  --save_path ./output/llama3-8b-rlhf --micro_train_batch_size 8 --train_batch_size 128 \
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --prompt_max_len 1024 \
  --generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
  --init_kl_coef 0.01 --normalize_reward --gradient_checkpointing --packing_samples \
  --vllm_enable_sleep --deepspeed_enable_sleep
"""
SKILL_PPO_STEP2 = r"""
ray job submit --address=http://127.0.0.1:8265 -- python3 -m openrlhf.cli.train_ppo_ray \
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models \
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain ./output/llama3-8b-rm \
  --save_path ./output/llama3-8b-ppo --micro_train_batch_size 8 --train_batch_size 128 \
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --prompt_max_len 1024 \
  --generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
  --init_kl_coef 0.01 --normalize_reward --vllm_enable_sleep --deepspeed_enable_sleep
"""
SKILL_GRPO = r"""
ray job submit --address=http://127.0.0.1:8265 -- python3 -m openrlhf.cli.train_ppo_ray \
  --advantage_estimator group_norm --ref_num_nodes 1 --ref_num_gpus_per_node 8 \
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models \
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
  --save_path ./output/llama3-8b-grpo --micro_train_batch_size 8 --train_batch_size 128 \
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --bf16 --actor_learning_rate 5e-7 \
  --init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --normalize_reward --no_advantage_std_norm
"""
SKILL_RM = r"""
deepspeed --module openrlhf.cli.train_rm --save_path ./output/llama3-8b-rm --save_steps -1 --logging_steps 1 \
  --eval_steps -1 --train_batch_size 256 --micro_train_batch_size 1 --pretrain meta-llama/Meta-Llama-3-8B \
  --bf16 --max_epochs 1 --max_len 8192 --zero_stage 3 --learning_rate 9e-6 \
  --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --apply_chat_template --chosen_key chosen \
  --rejected_key rejected --flash_attn --gradient_checkpointing
"""
SKILL_DPO = r"""
deepspeed --module openrlhf.cli.train_dpo --save_path ./output/llama3-8b-dpo --save_steps -1 --logging_steps 1 \
  --eval_steps -1 --train_batch_size 256 --micro_train_batch_size 2 --pretrain meta-llama/Meta-Llama-3-8B \
  --bf16 --max_epochs 1 --max_len 8192 --zero_stage 3 --learning_rate 5e-7 --beta 0.1 \
  --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --apply_chat_template --chosen_key chosen \
  --rejected_key rejected --flash_attn --gradient_checkpointing
"""
# Flag snippets the documents add to a command ("# ... other args").
SNIPPETS = {
    "checkpoints": "--save_path ./output/model --ckpt_path ./checkpoints/model --save_steps 100 --save_value_network "
                   "--save_hf_ckpt",
    "resume": "--load_checkpoint --ckpt_path ./checkpoints/llama-70b-ppo",
    "wandb": "--use_wandb {your-wandb-token} --wandb_org your-org --wandb_project llama-70b-ppo",
    "oom": "--micro_train_batch_size 1 --micro_rollout_batch_size 2 --zero_stage 3 --vllm_gpu_memory_utilization 0.5",
    "kl": "--init_kl_coef 0.05",
    "grpo": "--advantage_estimator group_norm --n_samples_per_prompt 8",  # the group size: see above
}
RL_COMMANDS = {"multi_node_ppo_70b": MULTI_NODE_PPO_70B, "multi_node_hybrid": MULTI_NODE_HYBRID,
               "multi_node_64_gpus": MULTI_NODE_64_GPUS, "skill_ppo_hybrid": SKILL_PPO_HYBRID,
               "skill_ppo_step2": SKILL_PPO_STEP2, "skill_grpo": SKILL_GRPO}
OFFLINE_COMMANDS = {"skill_rm": (SKILL_RM, RMConfig), "skill_dpo": (SKILL_DPO, DPOConfig)}
# Flags of the documents that rlmesh rejects, each with a message naming what to use instead (none
# since --use_ds_universal_ckpt is honoured).
REJECTED: dict[str, str] = {}
# simpleRL-reason's recipe (an Accelerate config in DeepSpeed mode), for `--deepspeed FILE`.
ZERO3_RECIPE = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
mixed_precision: bf16
num_processes: 8
"""


def flags_and_values(command: str) -> list[str]:
    """The arguments after the module name: `python3 -m X ...` or `deepspeed --module X ...`."""
    args = shlex.split(command.replace("\\\n", " "))
    module = next(i for i, a in enumerate(args) if a in ("-m", "--module"))
    return args[module + 2:]


def localise(args: list[str], paths: dict) -> list[str]:
    """Hub names and relative outputs -> local tiny models, data and tmp folders, chosen by the flag
    they follow (nothing else changes)."""
    local = {"--pretrain": str(paths["model"]), "--reward_pretrain": str(paths["reward_model"]),
             "--dataset": str(paths["prefs"]), "--use_wandb": "offline"}  # offline W&B instead of a key
    out = []
    for prev, arg in zip([""] + args, args):
        if prev in local:
            arg = local[prev]
        elif prev in ("--save_path", "--ckpt_path"):
            arg = str(paths["tmp"] / arg.lstrip("./"))
        out.append(arg)
    return out


@pytest.fixture(scope="module")
def paths(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("seeds")
    prefs = tmp / "prefs.jsonl"
    rows = [json.loads(line) for line in (tiny_data_dir / "prefs.jsonl").read_text().splitlines()]
    prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp / "deepspeed_zero3.yaml"
    recipe.write_text(ZERO3_RECIPE)
    return {"model": tiny_model_dir, "reward_model": tiny_reward_model_dir, "data": tiny_data_dir / "arith_train.jsonl",
            "prefs": prefs, "tmp": tmp, "recipe": recipe}


def coordinator_config(args: list[str]) -> CoordinatorConfig:
    return config_from_args(CoordinatorConfig, build_parser(CoordinatorConfig).parse_args(args))


def rl_args(command: str, paths: dict, *extra: str) -> list[str]:
    args = localise(flags_and_values(command), paths)
    if "--pretrain" not in args:  # the hybrid example's "# ... other args"
        args += ["--pretrain", str(paths["model"]), "--advantage_estimator", "group_norm",
                 "--n_samples_per_prompt", "8", "--reward_pretrain", str(paths["reward_model"])]
    # What the documents leave out: the prompts (OpenRLHF needs --prompt_data too), where to run.
    return args + ["--prompt_data", str(paths["data"]), "--input_key", "prompt", "--placement", "local",
                   "--device", "cpu", *extra]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(RL_COMMANDS))
def test_rl_seed_commands_validate(name, paths):
    args = rl_args(RL_COMMANDS[name], paths)
    if "group_norm" in args and "--n_samples_per_prompt" not in args:
        # GRPO compares the samples of a prompt; the skill page's command leaves the group size at 1.
        with pytest.raises(ConfigError, match="set --n_samples_per_prompt >= 2"):
            coordinator_config(args)
        args += ["--n_samples_per_prompt", "8"]
    cfg = coordinator_config(args)
    assert cfg.pretrain == str(paths["model"])
    if "--zero_stage" in RL_COMMANDS[name]:
        assert cfg.zero_stage == 3


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_seed_flag_snippets_validate(name, paths):
    cfg = coordinator_config(rl_args(SKILL_PPO_STEP2, paths, *localise(SNIPPETS[name].split(), paths)))
    if name == "checkpoints":
        assert cfg.save_value_network and cfg.save_hf_ckpt and cfg.critic_needed


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(OFFLINE_COMMANDS))
def test_offline_seed_commands_validate(name, paths):
    command, cls = OFFLINE_COMMANDS[name]
    args = localise(flags_and_values(command), paths)
    cfg = config_from_args(cls, build_parser(cls).parse_args(args))
    assert (cfg.zero_stage, cfg.max_len, cfg.eval_steps, cfg.save_steps) == (3, 8192, -1, -1)


def test_every_seed_flag_is_accepted_or_rejected_with_advice(capsys):
    seen = {}
    for text, cls in [*((c, CoordinatorConfig) for c in RL_COMMANDS.values()),
                      *((" ".join(SNIPPETS.values()), CoordinatorConfig),),
                      *OFFLINE_COMMANDS.values()]:
        for arg in (flags_and_values(text) if " -m " in text or "--module" in text else text.split()):
            if arg.startswith("--"):
                seen.setdefault(arg[2:], cls)
    for flag, cls in sorted(seen.items()):
        assert flag in {a.dest for a in build_parser(cls)._actions}, f"--{flag} is not accepted by {cls.__name__}"
    for flag, advice in REJECTED.items():
        argv = [f"--{flag}", "agent.py"] if flag.endswith("path") else [f"--{flag}"]
        with pytest.raises(SystemExit) as exit_:
            parse_config(CoordinatorConfig, argv)
        message = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--{flag}: " in message and advice in message, message


def test_deepspeed_file_is_honoured(paths, tmp_path):
    """simpleRL-reason's `--deepspeed FILE`: its ZeRO stage and precision decide; no prefix match."""
    cfg = coordinator_config(rl_args(SKILL_PPO_STEP2, paths, "--zero_stage", "2", "--no-bf16",
                                     "--deepspeed", str(paths["recipe"])))
    assert (cfg.zero_stage, cfg.bf16) == (3, True)
    from services.coordinator.fleet.placement import learner_argv

    argv = learner_argv(cfg, total_steps=4, num_ranks=1)
    assert argv[argv.index("--deepspeed") + 1] == str(paths["recipe"])
    native = tmp_path / "ds.json"
    native.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "offload_optimizer":
                                                        {"device": "cpu"}}, "gradient_clipping": 0.5,
                                  "train_batch_size": "auto", "bf16": {"enabled": "auto"}}))
    ds = read_deepspeed_file(str(native))
    assert ds.flags == {"zero_stage": 2, "adam_offload": True, "max_norm": 0.5}
    assert ds.extra == {"zero_optimization": {"reduce_bucket_size": 1234}}
    native.write_text(json.dumps({"train_batch_size": 64}))
    with pytest.raises(ConfigError, match="train_batch_size 64 differs from --train_batch_size"):
        coordinator_config(rl_args(SKILL_PPO_STEP2, paths, "--deepspeed", str(native)))


def test_seed_rm_command_runs_with_the_deepspeed_recipe(paths, tmp_path):
    """The skill page's reward-model command at tiny sizes, plus `--deepspeed` with simpleRL's ZeRO-3
    recipe; the trainer reports the file's stage and writes a reward model."""
    args = localise(flags_and_values(SKILL_RM), paths)
    sizes = {"--train_batch_size": "8", "--micro_train_batch_size": "4", "--max_len": "256"}
    args = [sizes.get(prev, arg) for prev, arg in zip([""] + args, args)]
    save = paths["tmp"] / "output" / "llama3-8b-rm"
    command = [sys.executable, "-m", "services.learner.train_rm", *args, "--zero_stage", "2",
               "--deepspeed", str(paths["recipe"]), "--max_samples", "8"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "zero_stage=3" in output  # the recipe's stage, over the command's --zero_stage 2
    assert (save / "config.json").is_file()


def test_no_parser_takes_a_prefix_for_an_option():
    """Every argparse parser of the project has allow_abbrev=False (simpleRL's `--deepspeed FILE`
    once became --deepspeed_enable_sleep, and `--load` --load_checkpoint)."""
    lax = []
    for folder in ("services", "bench", "protos", "tests", "examples", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for match in re.finditer(r"argparse\.ArgumentParser\(", text):
                depth, end = 1, match.end()
                while depth and end < len(text):  # the call's arguments, up to its closing parenthesis
                    depth += {"(": 1, ")": -1}.get(text[end], 0)
                    end += 1
                if text[match.end():end].count("allow_abbrev=False") != 1:
                    lax.append(f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}")
    assert not lax, f"parsers that accept abbreviations: {lax}"


def test_simplerl_eval_flag_names_the_rlmesh_flag(capsys):
    from services.coordinator.cli.eval_cli import EvalConfig

    with pytest.raises(SystemExit):
        parse_config(EvalConfig, ["--model_path", "./checkpoints"])
    assert "--model_path: rlmesh eval takes the model folder as --pretrain DIR" in capsys.readouterr().err
