"""OpenRLHF 0.11's namespaced command line (`--actor.num_nodes`, `--ds.zero_stage`, ...).

Every command of OpenRLHF's current examples/scripts/*.sh that runs train_ppo_ray, train_sft,
train_rm or train_dpo is written out below (its options unchanged; train_nonrl_slurm.sh runs
train_dpo_llama.sh's command under torchrun). Each goes through rlmesh's parsing and validation
with the module swapped and the hub names replaced by the tiny local model and data: every option
is honoured, or refused by name with what to use instead, and the refused ones are exactly those
listed per script. The DAPO and ProRL v2 scripts (hybrid engine, importance-sampling correction, the
stop-properly penalty) also run one real step on CPU.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from services.common.config import ConfigError, build_parser, config_from_args, parse_config
from services.common.openrlhf_names import NAMES, Refuse, split_options, translate_argv
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.placement import learner_argv
from services.learner.train_dpo import DPOConfig
from services.learner.train_rm import RMConfig
from services.learner.train_sft import SFTConfig
from tests.coordinator.conftest import finish, read_metrics, start_coordinator

PPO_HYBRID_ENGINE = """
--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
--critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k
--ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
--ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --ckpt.save_hf --train.batch_size 128
--rollout.batch_size 1024 --rollout.n_samples_per_prompt 1 --train.max_epochs 1 --data.max_len 2048
--data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
--algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages
--data.apply_chat_template --reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples
--vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --train.dynamic_batch_enable
--train.max_tokens_per_gpu 16384 --algo.advantage.is_correction_enable
"""
REINFORCE_BASELINE_HYBRID_ENGINE = """
--actor.model_name_or_path Qwen/Qwen3-4B-Thinking-2507 --ckpt.load_enable --ckpt.output_dir {save}
--ckpt.path {save}/ckpt --ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10
--train.agent_func_path examples/python/agent_func.py --data.prompt_dataset zhuzilin/dapo-math-17k
--data.input_key prompt --data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000
--data.apply_chat_template --ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8
--train.batch_size 1024 --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0
--train.dynamic_batch_enable --train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768
--train.micro_batch_size 1 --rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1
--train.num_episodes 1 --ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
--vllm.num_engines 2 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.7 --train.colocate_all
--ds.enable_sleep --vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3
--actor.gradient_checkpointing_enable --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2 --ds.param_dtype bf16
--algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0 --algo.kl.init_coef 1e-5
--algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable
--algo.advantage.is_correction_type icepop --logger.tensorboard_dir {save}/runs --logger.logging_steps 1
--eval.steps -1
"""
DAPO_HYBRID_ENGINE = """
--ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8 --vllm.num_engines 4
--vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.6 --algo.kl.init_coef 1e-3
--algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3 --algo.advantage.estimator group_norm
--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27
--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.remote_url /openrlhf/examples/python/reward_func.py
--ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
--ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --ckpt.save_steps 20 --ckpt.save_hf
--train.micro_batch_size 8 --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 128
--rollout.n_samples_per_prompt 8 --train.max_epochs 1 --data.max_len 2048 --data.max_samples 20000 --ds.zero_stage 3
--ds.param_dtype bf16 --actor.adam.lr 5e-7 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1
--data.input_key context_messages --data.apply_chat_template --actor.gradient_checkpointing_enable --ds.packing_samples
--vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --algo.advantage.is_correction_enable
"""
PRORLV2_MATH_HYBRID_ENGINE = """
--ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8 --vllm.num_engines 8
--vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.75 --algo.kl.init_coef 1e-4
--algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.estimator reinforce_baseline
--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --actor.eps_clip_low_high 0.2 0.27
--actor.model_name_or_path deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reward.remote_url {reward_func}
--ckpt.output_dir {save} --ckpt.path {save}/ckpt --ckpt.save_steps 5 --ckpt.save_hf --train.batch_size 1024
--rollout.batch_size 512 --rollout.n_samples_per_prompt 16 --train.dynamic_batch_enable --train.num_episodes 100
--data.max_len 9216 --rollout.max_new_tokens 8192 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 1e-6
--data.prompt_dataset OpenRLHF/dapo-math-17k --data.input_key prompt --data.label_key label
--eval.dataset OpenRLHF/aime-2024 --eval.steps 5 --eval.temperature 1.0 --eval.n_samples_per_prompt 4
--data.apply_chat_template --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl
--vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --algo.advantage.is_correction_enable
--algo.advantage.is_correction_threshold 0.5 5.0 --algo.advantage.is_correction_type icepop
--train.max_tokens_per_gpu 32768 --reward.stop_properly_penalty_coef 0.0
"""
REINFORCE_BASELINE_RAY_AGENT_ASYNC = """
--actor.model_name_or_path Qwen/Qwen3-4B-Thinking-2507 --ckpt.load_enable --ckpt.output_dir {save}
--ckpt.path {save}/ckpt --ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10
--train.agent_func_path examples/python/agent_func.py --data.prompt_dataset zhuzilin/dapo-math-17k
--data.input_key prompt --data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000
--data.apply_chat_template --ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8
--train.batch_size 1024 --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0
--train.dynamic_batch_enable --train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768
--train.micro_batch_size 1 --rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1
--train.num_episodes 1 --train.async_enable --train.partial_rollout_enable --ref.num_nodes 1
--ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 2
--vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.95 --train.colocate_all --ds.enable_sleep
--vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3 --actor.gradient_checkpointing_enable
--ds.ring_attn_size 2 --ds.ring_attn_head_stride 2 --ds.param_dtype bf16 --algo.advantage.estimator reinforce_baseline
--actor.adam.lr 5e-7 --actor.entropy_coef 0.0 --algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator k2
--algo.advantage.is_correction_enable --algo.advantage.is_correction_type icepop --logger.tensorboard_dir {save}/runs
--logger.logging_steps 1 --eval.steps -1
"""
PPO_WITH_REWARD_FN = """
--ref.num_nodes 1 --ref.num_gpus_per_node 2 --critic.num_nodes 1 --critic.num_gpus_per_node 2 --actor.num_nodes 1
--actor.num_gpus_per_node 2 --vllm.num_engines 2 --vllm.tensor_parallel_size 2 --train.colocate_actor_ref
--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.remote_url /openrlhf/examples/python/reward_func.py
--ckpt.output_dir /openrlhf/examples/checkpoint/llama3-8b-rlhf --train.micro_batch_size 8 --train.batch_size 128
--rollout.micro_batch_size 16 --rollout.batch_size 1024 --data.max_samples 100000 --train.max_epochs 1
--data.max_len 2048 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
--algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages
--data.apply_chat_template --reward.normalize_enable --ds.packing_samples --ds.adam_offload
--ds.attn_implementation flash_attention_2 --actor.gradient_checkpointing_enable --logger.wandb.key {wandb_token}
"""
PPO_RAY_SLURM = """
--ref.num_nodes 1 --ref.num_gpus_per_node 4 --reward.num_nodes 1 --reward.num_gpus_per_node 4 --critic.num_nodes 1
--critic.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 4
--vllm.tensor_parallel_size 2 --train.colocate_critic_reward --train.colocate_actor_ref
--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-mixture
--ckpt.output_dir /openrlhf/examples/checkpoint/llama3-8b-rlhf --train.micro_batch_size 8 --train.batch_size 128
--rollout.micro_batch_size 16 --rollout.batch_size 1024 --data.max_samples 100000 --train.max_epochs 1
--data.max_len 2048 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6
--algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages
--data.apply_chat_template --reward.normalize_enable --ds.adam_offload --ds.packing_samples --vllm.sync_backend nccl
--actor.gradient_checkpointing_enable --logger.wandb.key {wandb_token}
"""
VLM_MATH_HYBRID_ENGINE = """
--ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 4
--vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.7 --algo.kl.init_coef 0
--algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.estimator reinforce_baseline
--actor.model_name_or_path Qwen/Qwen3.5-2B --reward.remote_url {reward_func} --ckpt.output_dir {save}
--ckpt.path {save}/ckpt --ckpt.save_hf --ckpt.save_steps 5 --eval.steps -1 --train.micro_batch_size 1
--rollout.micro_batch_size 1 --train.batch_size 1024 --rollout.batch_size 128 --rollout.n_samples_per_prompt 8
--train.num_episodes 100 --data.max_len 4096 --rollout.max_new_tokens 2048 --ds.zero_stage 3 --ds.param_dtype bf16
--actor.adam.lr 2e-6 --data.prompt_dataset hiyouga/geometry3k --data.input_key prompt --data.label_key label
--data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder --data.apply_chat_template
--actor.gradient_checkpointing_enable --ds.attn_implementation eager --vllm.sync_backend nccl --vllm.enforce_eager
--vllm.enable_sleep --ds.enable_sleep
"""
SFT = """
--data.max_len 2048 --data.dataset Open-Orca/OpenOrca --data.input_key question --data.output_key response
--train.batch_size 256 --train.micro_batch_size 2 --data.max_samples 500000
--model.model_name_or_path meta-llama/Meta-Llama-3-8B --ckpt.output_dir ./checkpoint/llama3-8b-sft --ckpt.save_steps -1
--logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 2 --train.max_epochs 1 --ds.param_dtype bf16
--ds.attn_implementation flash_attention_2 --adam.lr 5e-6 --ckpt.load_enable --ds.packing_samples
--model.gradient_checkpointing_enable
"""
SFT_MIXTRAL_LORA = """
--data.max_len 2048 --data.dataset Open-Orca/OpenOrca --data.input_key question --data.output_key response
--train.batch_size 128 --train.micro_batch_size 4 --data.max_samples 500000
--model.model_name_or_path mistralai/Mixtral-8x7B-v0.1 --ckpt.output_dir ./checkpoint/mixtral-sft-lora
--ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 3 --train.max_epochs 1
--ds.param_dtype bf16 --model.gradient_checkpointing_enable --ds.attn_implementation flash_attention_2 --adam.lr 5e-6
--ds.lora.rank 64 --ds.lora.alpha 64 --ds.packing_samples --model.aux_loss_coef 0.001
"""
RM = """
--ckpt.output_dir ./checkpoint/llama3-8b-rm --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
--train.batch_size 256 --train.micro_batch_size 1 --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture
--ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 9e-6
--data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --data.apply_chat_template --data.chosen_key chosen
--data.rejected_key rejected --ds.attn_implementation flash_attention_2 --ckpt.load_enable --ds.packing_samples
--model.gradient_checkpointing_enable
"""
DPO_LLAMA = """
--ckpt.output_dir ./checkpoint/llama3-8b-dpo --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
--train.batch_size 256 --train.micro_batch_size 1 --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture
--ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 5e-7 --model.beta 0.1
--data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --data.apply_chat_template --data.chosen_key chosen
--data.rejected_key rejected --ds.attn_implementation flash_attention_2 --ckpt.load_enable --ds.packing_samples
--model.gradient_checkpointing_enable
"""

RING = {"ds.ring_attn_size", "ds.ring_attn_head_stride"}
# script -> (command, config class, the options rlmesh refuses in it)
SCRIPTS = {
    "train_ppo_ray_hybrid_engine": (PPO_HYBRID_ENGINE, CoordinatorConfig, set()),
    # Ring attention needs ring_flash_attn and flash_attn on CUDA GPUs: refused by name with what to use instead.
    "train_reinforce_baseline_hybrid_engine": (REINFORCE_BASELINE_HYBRID_ENGINE, CoordinatorConfig, RING),
    "train_dapo_ray_hybrid_engine": (DAPO_HYBRID_ENGINE, CoordinatorConfig, set()),
    "train_prorlv2_math_hybrid_engine": (PRORLV2_MATH_HYBRID_ENGINE, CoordinatorConfig, set()),
    "train_reinforce_baseline_ray_agent_async": (REINFORCE_BASELINE_RAY_AGENT_ASYNC, CoordinatorConfig, RING),
    "train_ppo_with_reward_fn": (PPO_WITH_REWARD_FN, CoordinatorConfig, set()),
    "train_ppo_ray_slurm": (PPO_RAY_SLURM, CoordinatorConfig, set()),
    "train_vlm_math_hybrid_engine": (VLM_MATH_HYBRID_ENGINE, CoordinatorConfig,
                                     {"data.max_images_per_prompt", "actor.freeze_visual_encoder"}),  # --data.image_key images: the default
    "train_sft": (SFT, SFTConfig, set()),
    "train_sft_mixtral_lora": (SFT_MIXTRAL_LORA, SFTConfig, set()),  # on the tiny Mixtral
    "train_rm": (RM, RMConfig, set()),
    "train_dpo_llama": (DPO_LLAMA, DPOConfig, set()),  # also what train_nonrl_slurm.sh runs
}
AGENT = """
class AgentInstance:
    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "scores": 0.0, "environment_feedback": "", "done": True}
"""
REWARD_FUNC = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    # Varies within a prompt's group, so dynamic filtering keeps the groups.
    return torch.tensor([float(len(q) % 3) for q in queries])
"""


@pytest.fixture(scope="module")
def local(tiny_model_dir, tiny_reward_model_dir, tiny_moe_model_dir, tiny_data_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("openrlhf")
    (tmp / "agent_func.py").write_text(AGENT)
    (tmp / "reward_func.py").write_text(REWARD_FUNC)
    return {"model": str(tiny_model_dir), "reward_model": str(tiny_reward_model_dir), "tmp": tmp,
            "moe_model": str(tiny_moe_model_dir),
            "prompts": str(tiny_data_dir / "arith_train.jsonl"), "sft": str(tiny_data_dir / "sft.jsonl"),
            "prefs": str(tiny_data_dir / "prefs.jsonl"), "agent": str(tmp / "agent_func.py"),
            "reward_func": str(tmp / "reward_func.py")}


def localise(command: str, paths: dict) -> list[str]:
    """The script's options with hub names, data and output folders replaced by local ones (by the option
    they follow), the tiny data's keys, and lengths within the tiny model's context; nothing else changes."""
    tmp = paths["tmp"]
    args = shlex.split(command.format(save=tmp / "exp", reward_func=paths["reward_func"], wandb_token="offline"))
    local = {"--actor.model_name_or_path": paths["model"], "--model.model_name_or_path": paths["model"],
             "--reward.model_name_or_path": paths["reward_model"], "--data.prompt_dataset": paths["prompts"],
             "--eval.dataset": paths["prompts"], "--reward.remote_url": paths["reward_func"],
             "--train.agent_func_path": paths["agent"], "--data.input_key": "prompt", "--data.output_key": "response",
             "--data.dataset": paths["prefs"]}
    out = []
    for prev, arg in zip([""] + args, args):
        if prev == "--data.dataset" and "--data.output_key" in args:
            arg = paths["sft"]
        elif prev == "--model.model_name_or_path" and "--model.aux_loss_coef" in args:
            arg = paths["moe_model"]  # the Mixtral script: a mixture of experts, for its router loss
        elif prev in local:
            arg = local[prev]
        elif prev in ("--data.max_len", "--rollout.max_new_tokens"):  # within the tiny model's 1024 positions
            arg = str(min(int(arg), 1024 if prev == "--data.max_len" else 512))
        elif prev in ("--ckpt.output_dir", "--ckpt.path", "--logger.tensorboard_dir"):
            arg = str(tmp / arg.lstrip("./").lstrip("/"))
        out.append(arg)
    return out


def build(cls, args: list[str]):
    """parse_config's path (translation, parsing, validation), raising ConfigError instead of exiting."""
    return config_from_args(cls, build_parser(cls).parse_args(translate_argv(cls, args)))


def drop(args: list[str], name: str) -> list[str]:
    return [token for option, values in split_options(args) if option != name
            for token in (f"--{option}", *values)]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_openrlhf_example_command_is_honoured_or_refused_by_name(script, local):
    command, cls, refused = SCRIPTS[script]
    args = localise(command, local)
    if cls is CoordinatorConfig:
        args += ["--placement", "local", "--device", "cpu"]
    seen = set()
    while True:
        try:
            cfg = build(cls, args)
            break
        except ConfigError as exc:
            name = str(exc).split(":")[0].split(" ")[0].removeprefix("--")
            # A refusal of the configuration's own names the flat option: the namespaced one that set it.
            name = next((n for n, _ in split_options(args) if n in NAMES and not isinstance(NAMES[n], tuple)
                         and getattr(NAMES[n], "flat", None) == name), name)
            assert name in refused - seen, f"{script}: {exc}"
            seen.add(name)
            args = drop(args, name)
    assert seen == refused
    # What the namespaced options set, read back from the validated configuration.
    flags = dict(split_options(args))
    if "ds.zero_stage" in flags:
        assert cfg.zero_stage == int(flags["ds.zero_stage"][0])
    assert cfg.bf16 == ("ds.param_dtype" in flags)
    assert cfg.pretrain == local["moe_model" if "model.aux_loss_coef" in dict(split_options(args)) else "model"]
    assert cfg.gradient_checkpointing == any(n.endswith("gradient_checkpointing_enable") for n in flags)
    assert cfg.packing_samples == ("ds.packing_samples" in flags)
    if "train.batch_size" in flags:
        assert cfg.train_batch_size == int(flags["train.batch_size"][0])
    if cls is CoordinatorConfig:
        assert cfg.colocate_all_models == ("train.colocate_all" in flags and "train.async_enable" not in flags)
        assert cfg.async_train == ("train.async_enable" in flags)
        assert cfg.actor_learning_rate == float(flags["actor.adam.lr"][0])
        assert cfg.vllm_num_engines == int(flags["vllm.num_engines"][0])
        assert cfg.deepspeed_enable_sleep == ("ds.enable_sleep" in flags)
        assert cfg.dynamic_filtering == ("algo.dynamic_filtering_enable" in flags)
        assert cfg.use_dynamic_batch == ("train.dynamic_batch_enable" in flags)
        if "train.max_tokens_per_gpu" in flags:
            assert cfg.train_max_tokens_per_gpu == int(flags["train.max_tokens_per_gpu"][0])
        total = int(flags["data.max_len"][0])
        if "rollout.max_new_tokens" in flags:
            assert cfg.generate_max_len == int(flags["rollout.max_new_tokens"][0])
        assert cfg.prompt_max_len + cfg.generate_max_len == total  # OpenRLHF's bound on prompt + response
    else:
        assert cfg.learning_rate == float(flags["adam.lr"][0]) and cfg.max_len == int(flags["data.max_len"][0])
        # FlashAttention where there is a GPU; here, sdpa with a warning (as the coordinator does).
        assert cfg.attn_implementation == ("flash_attention_2" if torch.cuda.is_available() else "sdpa")


def test_every_refusal_says_what_to_do():
    for name, rules in NAMES.items():
        for rule in rules if isinstance(rules, tuple) else (rules,):
            if isinstance(rule, Refuse):
                assert len(rule.advice) > 20, name
    assert {n: NAMES[f"ds.lora.{n}"].flat for n in ("rank", "alpha", "target_modules", "dropout")} == {
        "rank": "lora_rank", "alpha": "lora_alpha", "target_modules": "target_modules", "dropout": "lora_dropout"}


@pytest.mark.filterwarnings("ignore")
def test_values_translate_with_openrlhf_meaning(local):
    base = ["--actor.model_name_or_path", local["model"], "--data.prompt_dataset", local["prompts"],
            "--data.input_key", "prompt", "--reward.remote_url", local["reward_func"], "--placement", "local",
            "--device", "cpu", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    cfg = build(CoordinatorConfig, [*base, "--data.max_len", "1024", "--rollout.max_new_tokens", "256",
                                    "--reward.overlong_buffer_len", "128.0", "--ds.attn_implementation", "eager",
                                    "--algo.advantage.is_correction_enable",
                                    "--algo.advantage.is_correction_threshold", "0", "3.5", "--train.async_enable",
                                    "--train.async_queue_size", "2", "--ds.zpg", "1", "--ds.lora.rank", "8",
                                    "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj", "v_proj",
                                    "--ds.lora.dropout", "0.05", "--ds.use_universal_ckpt"])
    assert (cfg.prompt_max_len, cfg.generate_max_len, cfg.overlong_buffer_len) == (768, 256, 128)
    assert (cfg.use_tis, cfg.tis_cap, cfg.flash_attn) == (True, 3.5, False)
    assert (cfg.async_train, cfg.max_staleness, cfg.use_ds_universal_ckpt) == (True, 2, True)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.target_modules, cfg.lora_dropout) == (8, 32, ["q_proj", "v_proj"], 0.05)
    # Adam betas reach every learner rank.
    cfg = build(CoordinatorConfig, [*base, "--actor.adam.betas", "0.9", "0.99"])
    assert cfg.adam_betas == [0.9, 0.99]
    assert "--adam_betas 0.9 0.99" in " ".join(learner_argv(cfg, 10, 1))
    with pytest.raises(ConfigError, match="--adam_betas .* must be two numbers in \\[0, 1\\)"):
        build(CoordinatorConfig, [*base, "--actor.adam.betas", "0.9", "1.5"])
    with pytest.warns(UserWarning, match="prompts up to 512 tokens"):
        cfg = build(CoordinatorConfig, [*base, "--data.max_len", "1024"])
    assert (cfg.prompt_max_len, cfg.generate_max_len) == (512, 512)
    refusals = {("--ds.param_dtype", "fp16"): "fp16 is not supported",
                ("--algo.advantage.is_correction_threshold", "2", "5", "--algo.advantage.is_correction_enable"):
                    "LOW in [0, 1] and HIGH >= 1",
                ("--ds.zpg", "2"): "zero_hpz_partition_size", ("--ds.load_in_4bit",): "QLoRA",
("--actor.muon.lr", "0.02"): "Muon",
                ("--critic.max_norm", "0.5"): "--actor.max_norm", ("--vllm.sync_with_ray",): "--vllm.sync_backend",
                ("--ds.zero_stage", "3", "--zero_stage", "2"): "--ds.zero_stage and --zero_stage are the same option",
                ("--train.colocate_all", "--colocate_all_models"): "--train.colocate_all and --colocate_all_models",
                ("--actor.nonsense", "1"): "not an option of OpenRLHF 0.11",
                ("--model.beta", "0.1"): "no counterpart in this command"}
    for extra, words in refusals.items():
        with pytest.raises(ConfigError) as err:
            build(CoordinatorConfig, [*base, *extra])
        assert words in str(err.value) and extra[0] in str(err.value), (extra, str(err.value))


def test_parse_config_and_yaml_take_namespaced_options(local, tmp_path, capsys):
    yaml_file = tmp_path / "sft.yaml"
    yaml_file.write_text(f"model:\n  model_name_or_path: {local['model']}\ndata.dataset: {local['sft']}\n"
                         "data:\n  input_key: prompt\n  output_key: response\nds:\n  zero_stage: 3\n"
                         "  param_dtype: bf16\nadam.lr: 2.0e-6\nmax_epochs: 2\n")
    cfg = parse_config(SFTConfig, ["--config", str(yaml_file), "--train.batch_size", "4",
                                   "--train.micro_batch_size", "2"])
    assert (cfg.pretrain, cfg.dataset, cfg.input_key, cfg.output_key) == (local["model"], local["sft"], "prompt",
                                                                         "response")
    assert (cfg.zero_stage, cfg.bf16, cfg.learning_rate, cfg.max_epochs, cfg.train_batch_size) == (3, True, 2e-6, 2, 4)
    with pytest.raises(SystemExit):
        parse_config(SFTConfig, ["--config", str(yaml_file), "--ds.load_in_4bit"])
    assert "config error: --ds.load_in_4bit: 4-bit base weights (QLoRA) are not supported" in capsys.readouterr().err
    cfg = parse_config(SFTConfig, ["--config", str(yaml_file), "--ds.lora.rank", "16", "--ds.lora.target_modules",
                                   "q_proj", "--train.batch_size", "4", "--train.micro_batch_size", "2"])
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == (16, 16.0, ["q_proj"])
    yaml_file.write_text(yaml_file.read_text() + "zero_stage: 2\n")
    with pytest.raises(SystemExit):
        parse_config(SFTConfig, ["--config", str(yaml_file)])
    assert "zero_stage given twice" in capsys.readouterr().err
    assert "--ds.zero_stage" in build_parser(CoordinatorConfig).format_help().replace("\n", " ")


@pytest.mark.parametrize("script", ["train_dapo_ray_hybrid_engine", "train_prorlv2_math_hybrid_engine"])
def test_the_rl_script_trains_one_step_on_cpu(local, tmp_path, script):
    """OpenRLHF's DAPO hybrid-engine script (GRPO: group_norm, dynamic filtering, clip-higher, KL loss, the
    importance-sampling correction with its default band) and ProRL v2's (reinforce_baseline, ICEPOP, the
    stop-properly penalty), module swapped, at tiny sizes, one real step: learner, vLLM engine and reward
    function on CPU."""
    args = localise(SCRIPTS[script][0], local)
    sizes = {"--actor.num_gpus_per_node": "1", "--ref.num_gpus_per_node": "1", "--vllm.num_engines": "1",
             "--vllm.tensor_parallel_size": "1", "--train.micro_batch_size": "4", "--train.batch_size": "8",
             "--rollout.micro_batch_size": "8", "--rollout.batch_size": "2", "--rollout.n_samples_per_prompt": "4",
             "--data.max_len": "80", "--rollout.max_new_tokens": "16"}
    args = [sizes.get(prev, arg) for prev, arg in zip([""] + args, args)]
    # Without evaluation (ProRL's evaluates its own data set every 5 steps).
    args = drop(drop(drop(args, "ckpt.path"), "eval.dataset"), "eval.steps") + [
        "--max_steps", "1", "--run_dir", str(tmp_path / "run"), "--ckpt.path", str(tmp_path / "ckpt"), "--no-plots"]
    if "--rollout.max_new_tokens" not in args:
        args += ["--rollout.max_new_tokens", "16"]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.train_ppo_ray", args, log)
    output = finish(proc, log, timeout_s=480)
    assert proc.returncode == 0, output[-6000:]
    [metrics] = read_metrics(tmp_path / "run")
    assert metrics["global_step"] == 1 and metrics["samples/trained"] == 8 and metrics["actor/optimizer_steps"] == 1
    assert "kl/mean" in metrics  # --algo.kl.use_loss with --algo.kl.init_coef > 0: a reference model ran
    # The correction ran against the engine's log-probs: weights in the band (tis) or 0 outside it (icepop).
    assert 0 < metrics["actor/tis_weight_mean"] <= 5.0 and abs(metrics["actor/rollout_kl"]) < 1.0, metrics
    if script == "train_prorlv2_math_hybrid_engine":
        # A random tiny model rarely stops within 16 tokens: the cut responses' rewards were set to 0.
        assert metrics["reward/stop_properly_penalised"] > 0.5, metrics
