"""OpenRLHF 0.11's namespaced options (`--actor.num_nodes`, `--ds.zero_stage`, ...) in rlmesh's names.

OpenRLHF 0.11 renamed the flat options of its earlier releases (the names the seed guide uses and
rlmesh takes: `--actor_num_nodes`, `--zero_stage`, `--colocate_all_models`) into namespaces. This
table is the one place that knows both: every namespaced option of `openrlhf.cli.train_ppo_ray`,
`train_sft`, `train_rm` and `train_dpo` is either renamed to the flat option with the same meaning
(with its value converted where the form differs: `--ds.param_dtype bf16` is `--bf16`), or refused
with what to use instead. Nothing is accepted and ignored. Options that only rlmesh's defaults
make harmless (`--ds.zpg 1`, `--ds.ring_attn_size 1`) pass when given with OpenRLHF's default value.

`translate_argv(cls, argv)` rewrites a command line for a config class that opts in
(`OPENRLHF_NAMESPACED = True`); services.common.config.parse_config calls it. A rename applies
only where its flat option is a field of the class, so one table serves the coordinator and the
offline trainers (`--adam.lr` is the SFT learning rate, `--actor.adam.lr` the PPO actor's).
The same option given in both forms is an error naming both.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

from services.common.config_error import ConfigError


@dataclasses.dataclass(frozen=True)
class Rename:
    """The namespaced option is rlmesh's --flat; `convert` turns OpenRLHF's values into the
    arguments that replace the option (default: --flat followed by the same values)."""
    flat: str
    convert: Callable[[list[str]], list[str]] | None = None


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Not supported: `advice` says what to use instead. Given with `default` (OpenRLHF's default,
    which is what rlmesh does), the option changes nothing and passes."""
    advice: str
    default: tuple[str, ...] | None = None


Rule = Rename | Refuse

QLORA = ("4-bit base weights (QLoRA) are not supported: LoRA trains adapters over bf16 / fp32 base weights "
         "(--ds.lora.rank N with --ds.param_dtype bf16); drop it, or use --ds.zero_stage 3 / --ds.adam_offload to fit "
         "the model")
DEEPSPEED_FILE = "set {key} in a DeepSpeed config file given with --deepspeed FILE (laid over rlmesh's config)"
VISION = "vision-language training is not supported: rlmesh trains text-only causal LMs"
# OpenRLHF splits each sequence over --ds.ring_attn_size GPUs with the ring_flash_attn package, whose kernels are
# flash-attn's (CUDA only); rlmesh's learner has neither.
RING_ATTENTION = ("ring attention (context parallel: one sequence split over several GPUs) needs the ring_flash_attn "
                  "and flash_attn packages on CUDA GPUs, which rlmesh's learner does not use; give 1 (each sample on "
                  "one GPU) and fit long samples with --actor.gradient_checkpointing_enable, --ds.packing_samples with "
                  "--train.dynamic_batch_enable --train.max_tokens_per_gpu N, --ds.zero_stage 3 / --ds.adam_offload, "
                  "or a shorter --data.max_len / --rollout.max_new_tokens")


def _param_dtype(values: list[str]) -> list[str]:
    if values != ["bf16"]:
        raise ConfigError(f"--ds.param_dtype {' '.join(values)}: rlmesh trains in bfloat16 (--ds.param_dtype bf16, "
                          "i.e. --bf16) or float32 (leave it out); fp16 is not supported")
    return ["--bf16"]


def _flash_attn(values: list[str]) -> list[str]:
    """The coordinator's learner has one switch: FlashAttention or the model's default attention."""
    if len(values) != 1:
        raise ConfigError(f"--ds.attn_implementation takes one value, got {values}")
    if "flash" in values[0]:
        return ["--flash_attn"]
    if values[0] in ("eager", "sdpa"):
        return ["--no-flash_attn"]
    raise ConfigError(f"--ds.attn_implementation {values[0]}: train_ppo_ray here takes flash_attention_2 / "
                      "flash_attention_3 (--flash_attn), sdpa or eager")


def _token_count(name: str, values: list[str]) -> int:
    """One whole number of tokens (`4096`, or `4096.0`: OpenRLHF reads some counts as floats); else a
    ConfigError naming the option."""
    try:
        number = float(values[0]) if len(values) == 1 else math.nan
    except ValueError:
        number = math.nan
    if not number.is_integer():  # also nan and inf
        raise ConfigError(f"--{name} {' '.join(values)}".rstrip() + ": expected one whole number of tokens, e.g. "
                          "2048")
    return int(number)


def _whole_number(flat: str, name: str) -> Callable[[list[str]], list[str]]:
    """OpenRLHF reads some token counts as floats (`--reward.overlong_buffer_len 4096.0`)."""
    def convert(values: list[str]) -> list[str]:
        return [f"--{flat}", str(_token_count(name, values))]
    return convert


def _one_for_both(name: str, flat: str) -> Refuse:
    """A critic setting that rlmesh shares with the actor."""
    return Refuse(f"rlmesh's learner uses one --{flat} for the actor and the critic: give the actor's "
                  f"(--actor.{name})")


# Every namespaced option of OpenRLHF 0.11's train_ppo_ray / train_sft / train_rm / train_dpo.
# A tuple lists renames for different trainers: the first whose flat option the config has applies.
NAMES: dict[str, Rule | tuple[Rule, ...]] = {
    # ---- placement -------------------------------------------------------------------------------
    "actor.num_nodes": Rename("actor_num_nodes"),
    "actor.num_gpus_per_node": Rename("actor_num_gpus_per_node"),
    "critic.num_nodes": Rename("critic_num_nodes"),
    "critic.num_gpus_per_node": Rename("critic_num_gpus_per_node"),
    "ref.num_nodes": Rename("ref_num_nodes"),
    "ref.num_gpus_per_node": Rename("ref_num_gpus_per_node"),
    "reward.num_nodes": Rename("reward_num_nodes"),
    "reward.num_gpus_per_node": Rename("reward_num_gpus_per_node"),
    "train.colocate_actor_ref": Rename("colocate_actor_ref"),
    "train.colocate_critic_reward": Rename("colocate_critic_reward"),
    "train.colocate_all": Rename("colocate_all_models"),
    "ref.offload": Refuse("the reference model runs in its own service (own GPUs, or the actor's with "
                          "--train.colocate_actor_ref / --train.colocate_all); drop it"),
    "reward.offload": Refuse("the reward model runs in its own service (own GPUs, or the critic's with "
                             "--train.colocate_critic_reward / --train.colocate_all); drop it"),
    # ---- vLLM ------------------------------------------------------------------------------------
    "vllm.num_engines": Rename("vllm_num_engines"),
    "vllm.tensor_parallel_size": Rename("vllm_tensor_parallel_size"),
    "vllm.sync_backend": Rename("vllm_sync_backend"),
    "vllm.sync_with_ray": Refuse("weights travel learner -> engines over --vllm.sync_backend (nccl, gloo or ipc), "
                                 "not through Ray's object store; drop it"),
    "vllm.enable_prefix_caching": Rename("enable_prefix_caching"),
    "vllm.enforce_eager": Rename("enforce_eager"),
    "vllm.enable_sleep": Rename("vllm_enable_sleep"),
    "vllm.gpu_memory_utilization": Rename("vllm_gpu_memory_utilization"),
    # ---- asynchronous training -------------------------------------------------------------------
    "train.async_enable": Rename("async_train"),
    # OpenRLHF's queue between generation and training holds N steps: generation runs up to N steps ahead.
    "train.async_queue_size": Rename("max_staleness"),
    "train.partial_rollout_enable": Rename("partial_rollout"),
    "train.agent_func_path": Rename("agent_func_path"),
    # ---- checkpoints and logs --------------------------------------------------------------------
    "ckpt.output_dir": Rename("save_path"),
    "ckpt.path": Rename("ckpt_path"),
    "ckpt.save_steps": Rename("save_steps"),
    "ckpt.save_hf": (Rename("save_hf_ckpt"),
                     Refuse("the offline trainers write the model in Hugging Face format to --ckpt.output_dir at "
                            "the end; the checkpoints are DeepSpeed's (resume with --ckpt.load_enable)")),
    "ckpt.disable_ds": Rename("disable_ds_ckpt"),
    "ckpt.max_num": Rename("max_ckpt_num"),
    "ckpt.max_mem": Refuse("rlmesh bounds the checkpoints kept by number: --ckpt.max_num N"),
    "ckpt.load_enable": Rename("load_checkpoint"),
    "ckpt.best_metric_key": Refuse("rlmesh keeps the newest --ckpt.max_num checkpoints and no extra best one; the "
                                   "evaluation metrics of every step are in the run's metrics.jsonl", default=("",)),
    "ds.use_universal_ckpt": Rename("use_ds_universal_ckpt"),  # refused by the config's UNSUPPORTED_FLAGS
    "eval.steps": Rename("eval_steps"),
    "logger.logging_steps": Rename("logging_steps"),
    "logger.wandb.key": Rename("use_wandb"),
    "logger.wandb.org": Rename("wandb_org"),
    "logger.wandb.group": Rename("wandb_group"),
    "logger.wandb.project": Rename("wandb_project"),
    "logger.wandb.run_name": Rename("wandb_run_name"),
    "logger.tensorboard_dir": Rename("use_tensorboard"),
    # ---- DeepSpeed -------------------------------------------------------------------------------
    "ds.zero_stage": Rename("zero_stage"),
    "ds.param_dtype": Rename("bf16", _param_dtype),
    "ds.adam_offload": Rename("adam_offload"),
    "ds.attn_implementation": (Rename("attn_implementation"), Rename("flash_attn", _flash_attn)),
    "ds.use_liger_kernel": Rename("use_liger_kernel"),
    "ds.packing_samples": Rename("packing_samples"),
    "ds.enable_sleep": Rename("deepspeed_enable_sleep"),
    "actor.gradient_checkpointing_enable": Rename("gradient_checkpointing"),
    "model.gradient_checkpointing_enable": Rename("gradient_checkpointing"),
    "actor.gradient_checkpointing_reentrant": Refuse("rlmesh's gradient checkpointing is the non-reentrant kind "
                                                     "(same gradients); drop it"),
    "model.gradient_checkpointing_reentrant": Refuse("rlmesh's gradient checkpointing is the non-reentrant kind "
                                                     "(same gradients); drop it"),
    "ds.zpg": Refuse(DEEPSPEED_FILE.format(key="zero_optimization.zero_hpz_partition_size"), default=("1",)),
    "ds.overlap_comm": Refuse(DEEPSPEED_FILE.format(key="zero_optimization.overlap_comm: true")),
    "ds.grad_accum_dtype": Refuse(DEEPSPEED_FILE.format(key="data_types.grad_accum_dtype")),
    "ds.deepcompile": Refuse("DeepSpeed's compiler is not supported; drop it"),
    "ds.tensor_parallel_size": Refuse("the learner is data parallel (DeepSpeed ZeRO) only; use --ds.zero_stage 3 "
                                      "to shard a large model", default=("1",)),
    "ds.ring_attn_size": Refuse(RING_ATTENTION, default=("1",)),
    "ds.ring_attn_head_stride": Refuse(RING_ATTENTION, default=("1",)),
    "ds.experts_implementation": Refuse("rlmesh loads MoE models with transformers' default expert kernels; drop it"),
    "ds.value_head_prefix": Refuse("rlmesh's reward models and critics are transformers sequence-classification "
                                   "models whose head is `score`", default=("score",)),
    "ds.load_in_4bit": Refuse(QLORA),
    "ds.lora.rank": Rename("lora_rank"),
    "ds.lora.alpha": Rename("lora_alpha"),
    "ds.lora.target_modules": Rename("target_modules"),
    "ds.lora.dropout": Rename("lora_dropout"),
    "train.dynamic_batch_enable": Rename("use_dynamic_batch"),
    "train.max_tokens_per_gpu": Rename("train_max_tokens_per_gpu"),
    "rollout.max_tokens_per_gpu": Rename("rollout_max_tokens_per_gpu"),
    "data.disable_fast_tokenizer": Refuse("rlmesh loads the model's tokenizer as transformers picks it; drop it"),
    "data.dataloader_num_workers": Refuse("rlmesh reads the data in the trainer's process", default=("0",)),
    "train.full_determinism_enable": Refuse("rlmesh seeds the data order and the sampling (--train.seed) but does "
                                            "not switch kernels to deterministic ones; drop it"),
    "train.enable_ema": Refuse("an EMA copy of the model is not kept; the exported model is the trained one"),
    "train.ema_beta": Refuse("an EMA copy of the model is not kept", default=("0.992",)),
    # ---- batches and lengths ---------------------------------------------------------------------
    "train.batch_size": Rename("train_batch_size"),
    "train.micro_batch_size": Rename("micro_train_batch_size"),
    "train.max_epochs": Rename("max_epochs"),
    "train.num_episodes": Rename("num_episodes"),
    "train.seed": Rename("seed"),
    "rollout.batch_size": Rename("rollout_batch_size"),
    "rollout.micro_batch_size": Rename("micro_rollout_batch_size"),
    "rollout.n_samples_per_prompt": Rename("n_samples_per_prompt"),
    "rollout.vllm_generate_batch_size": Refuse("generation covers --rollout.batch_size prompts per step; "
                                               "over-sampling is not supported: drop it"),
    "rollout.temperature": Rename("temperature"),
    "rollout.top_p": Rename("top_p"),
    # The coordinator's lengths (--data.max_len with --rollout.max_new_tokens) are translated by _lengths().
    "data.max_len": Rename("max_len"),
    "rollout.max_new_tokens": Rename("generate_max_len"),
    "data.max_samples": Rename("max_samples"),
    # ---- data ------------------------------------------------------------------------------------
    "data.prompt_dataset": Rename("prompt_data"),
    "data.prompt_probs": Rename("prompt_data_probs"),
    "data.dataset": Rename("dataset"),
    "data.dataset_probs": Rename("dataset_probs"),
    "eval.dataset": Rename("eval_dataset"),
    "eval.temperature": Rename("eval_temperature"),
    "eval.n_samples_per_prompt": Rename("eval_n_samples_per_prompt"),
    "data.prompt_split": Refuse("rlmesh reads local files: give the split's file or folder", default=("train",)),
    "data.dataset_split": Refuse("rlmesh reads local files: give the split's file or folder", default=("train",)),
    "eval.split": Refuse("rlmesh reads local files: give the split's file or folder to --eval.dataset",
                         default=("train",)),
    "data.input_key": Rename("input_key"),
    "data.output_key": Rename("output_key"),
    "data.label_key": Rename("label_key"),
    "data.prompt_key": Rename("prompt_key"),
    "data.chosen_key": Rename("chosen_key"),
    "data.rejected_key": Rename("rejected_key"),
    "data.input_template": Rename("input_template"),
    "data.apply_chat_template": Rename("apply_chat_template"),
    "data.multiturn": Rename("multiturn"),
    "data.tokenizer_chat_template": Refuse("rlmesh renders with the chat template stored with the tokenizer: put "
                                           "yours in the model folder's tokenizer_config.json"),
    "data.image_key": Refuse(VISION, default=("images",)),
    "data.max_images_per_prompt": Refuse(VISION, default=("0",)),
    "actor.freeze_visual_encoder": Refuse(VISION),
    # ---- models ----------------------------------------------------------------------------------
    "actor.model_name_or_path": Rename("pretrain"),
    "model.model_name_or_path": Rename("pretrain"),
    "ref.model_name_or_path": Rename("ref_pretrain"),
    "critic.model_name_or_path": Rename("critic_pretrain"),
    "reward.model_name_or_path": Rename("reward_pretrain"),
    "reward.remote_url": Rename("remote_rm_url"),
    "model.pretrain_mode_enable": Refuse("SFT's loss covers the response tokens; for a loss over every token put "
                                         "the whole text in --data.output_key with an empty --data.input_key field"),
    "actor.aux_loss_coef": Rename("aux_loss_coef"),
    "model.aux_loss_coef": Rename("aux_loss_coef"),
    # ---- the RL objective ------------------------------------------------------------------------
    "algo.advantage.estimator": Rename("advantage_estimator"),
    "algo.advantage.gamma": Rename("gamma"),
    "algo.advantage.lambd": Rename("lambd"),
    "algo.advantage.no_std_norm": Rename("no_advantage_std_norm"),
    # Translated together by _is_correction() where the config has --use_tis (so are the flat names of
    # OpenRLHF 0.9: --enable_vllm_is_correction, --vllm_is_truncated_threshold, --vllm_is_correction_type).
    "algo.advantage.is_correction_enable": Rename("use_tis"),
    "algo.advantage.is_correction_threshold": Rename("use_tis"),
    "algo.advantage.is_correction_type": Rename("use_tis"),
    "algo.kl.init_coef": Rename("init_kl_coef"),
    "algo.kl.target": Rename("kl_target"),
    "algo.kl.horizon": Rename("kl_horizon"),
    "algo.kl.use_loss": Rename("use_kl_loss"),
    "algo.kl.estimator": Rename("kl_estimator"),
    "algo.dynamic_filtering_enable": Rename("dynamic_filtering"),
    "algo.dynamic_filtering_range": Rename("dynamic_filtering_reward_range"),
    "actor.eps_clip": Rename("eps_clip"),
    "actor.eps_clip_low_high": Rename("eps_clip_low_high"),
    "actor.dual_clip": Rename("dual_clip"),
    "actor.policy_loss_type": Rename("policy_loss_type"),
    "actor.entropy_coef": Rename("entropy_loss_coef"),
    "critic.value_clip": Rename("value_clip"),
    "critic.save_value_network": Rename("save_value_network"),
    "critic.freezing_steps": Refuse("training the critic alone for the first steps is not supported: the actor "
                                    "trains from the first step", default=("-1",)),
    "reward.normalize_enable": Rename("normalize_reward"),
    "reward.clip_range": Rename("reward_clip_range"),
    "reward.overlong_buffer_len": Rename("overlong_buffer_len", _whole_number("overlong_buffer_len",
                                                                         "reward.overlong_buffer_len")),
    "reward.overlong_penalty_factor": Rename("overlong_penalty_factor"),
    "reward.stop_properly_penalty_coef": Rename("stop_properly_penalty_coef"),
    "model.loss_type": Rename("loss"),
    "model.margin_loss_enable": Rename("margin_loss"),
    # The reward model's scores are cast to float32 before the loss anyway: the switch is what rlmesh does.
    "model.compute_fp32_loss_enable": Refuse("the pairwise loss is always computed in float32", default=()),
    "model.beta": Rename("beta"),
    "model.ipo_enable": Rename("ipo"),
    "model.label_smoothing": Rename("label_smoothing"),
    "model.nll_loss_coef": Rename("nll_loss_coef"),
    # ---- optimizers (--actor.* / --critic.* in train_ppo_ray, bare in the offline trainers) -----
    "actor.optim": Refuse("rlmesh trains with AdamW (--actor.adam.*)", default=("adam",)),
    "critic.optim": Refuse("rlmesh trains with AdamW (--critic.adam.lr)", default=("adam",)),
    "actor.adam.lr": Rename("actor_learning_rate"),
    "critic.adam.lr": Rename("critic_learning_rate"),
    "adam.lr": Rename("learning_rate"),
    "actor.adam.betas": Rename("adam_betas"),
    "critic.adam.betas": Refuse("the critic trains with the actor's Adam betas (--actor.adam.betas)",
                                default=("0.9", "0.95")),
    "adam.betas": Rename("adam_betas"),
    "actor.adam.eps": Refuse("rlmesh's Adam epsilon is 1e-8", default=("1e-8",)),
    "critic.adam.eps": Refuse("rlmesh's Adam epsilon is 1e-8", default=("1e-8",)),
    "adam.eps": Refuse("rlmesh's Adam epsilon is 1e-8", default=("1e-8",)),
    "actor.adam.weight_decay": Rename("l2"),
    "critic.adam.weight_decay": _one_for_both("adam.weight_decay", "l2"),
    "adam.weight_decay": Rename("l2"),
    "actor.lr_scheduler": Rename("lr_scheduler"),
    "critic.lr_scheduler": _one_for_both("lr_scheduler", "lr_scheduler"),
    "actor.lr_warmup_ratio": Rename("lr_warmup_ratio"),
    "critic.lr_warmup_ratio": _one_for_both("lr_warmup_ratio", "lr_warmup_ratio"),
    "actor.min_lr_ratio": Rename("min_lr_ratio"),
    "critic.min_lr_ratio": Refuse("rlmesh's learner uses one --min_lr_ratio for the actor and the critic: give the "
                                  "actor's (--actor.min_lr_ratio)", default=("0.1",)),
    "actor.max_norm": Rename("max_norm"),
    "critic.max_norm": _one_for_both("max_norm", "max_norm"),
}
MUON = "the Muon optimizer is not supported: rlmesh trains with AdamW (--actor.adam.* / --adam.*)"
for _prefix in ("actor.", "critic.", ""):
    for _name in ("muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov", "muon.no_nesterov"):
        NAMES[_prefix + _name] = Refuse(MUON)
# The PPO defaults above make the critic's settings harmless when they equal OpenRLHF's defaults.
for _name, _default in (("critic.adam.weight_decay", "0.0"), ("critic.lr_scheduler", "cosine_with_min_lr"),
                        ("critic.lr_warmup_ratio", "0.03"), ("critic.max_norm", "1.0")):
    NAMES[_name] = dataclasses.replace(NAMES[_name], default=(_default,))

# With --train.async_enable OpenRLHF colocates only the DeepSpeed models under --train.colocate_all: the vLLM
# engines generate on GPUs of their own while the learner trains (--ds.enable_sleep still offloads the
# learner's states between its trainings, as without async).
ASYNC_RULES: dict[str, Rule] = {
    "train.colocate_all": Rename("colocate_actor_ref", lambda values: ["--colocate_actor_ref",
                                                                        "--colocate_critic_reward"]),
}
IS_CORRECTION = ("algo.advantage.is_correction_enable", "algo.advantage.is_correction_threshold",
                 "algo.advantage.is_correction_type")
# OpenRLHF 0.9's flat names of the same options.
IS_CORRECTION_FLAT = dict(zip(("enable_vllm_is_correction", "vllm_is_truncated_threshold", "vllm_is_correction_type"),
                              IS_CORRECTION))
OPENRLHF_IS_BAND = ("0.5", "5.0")  # --algo.advantage.is_correction_threshold's default
LENGTHS = ("data.max_len", "rollout.max_new_tokens")
OPENRLHF_MAX_LEN = 2048  # train_ppo_ray's --data.max_len default


def is_namespaced(name: str) -> bool:
    return "." in name.removeprefix("no-")


def split_options(argv: list[str]) -> list[tuple[str, list[str]]]:
    """argv -> [(option name without --, its values)], in order; ("", [token]) for a token before any option."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--") and len(token) > 2 and " " not in token:  # "--a b" is a value, as in argparse
            name, sep, value = token[2:].partition("=")
            out.append((name, [value] if sep else []))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("", [token]))
    return out


def _lengths(given: dict[str, list[str]]) -> list[str]:
    """OpenRLHF 0.11 bounds prompt + response by --data.max_len and the response by --rollout.max_new_tokens
    (when absent, by what the prompt leaves); rlmesh bounds prompts and responses separately."""
    total = _token_count("data.max_len", given["data.max_len"]) if "data.max_len" in given else OPENRLHF_MAX_LEN
    if total < 2:
        raise ConfigError(f"--data.max_len {total} must be >= 2 (a prompt token and a response token), e.g. 2048")
    if "rollout.max_new_tokens" in given:
        response = _token_count("rollout.max_new_tokens", given["rollout.max_new_tokens"])
        if not 0 < response < total:
            raise ConfigError(f"--rollout.max_new_tokens {response} must be in [1, --data.max_len {total}): the "
                              "prompt gets the rest of --data.max_len")
        return ["--prompt_max_len", str(total - response), "--generate_max_len", str(response)]
    response = total - total // 2
    warnings.warn(f"--data.max_len {total} without --rollout.max_new_tokens: OpenRLHF lets each response use what "
                  f"its prompt leaves of {total} tokens; rlmesh bounds both apart: prompts up to {total // 2} tokens "
                  f"(longer ones are skipped and counted), responses up to {response}. Give --rollout.max_new_tokens N "
                  "to choose the split", stacklevel=3)
    return ["--prompt_max_len", str(total // 2), "--generate_max_len", str(response)]


def _is_correction(given: dict[str, list[str]], typed: dict[str, str]) -> list[str]:
    """OpenRLHF's vLLM importance-sampling correction as rlmesh's --use_tis --tis_low --tis_cap --tis_type,
    with OpenRLHF's defaults (band [0.5, 5], type tis). A single threshold is OpenRLHF 0.8's cap (no low bound).
    Every malformed value is a ConfigError naming the option as typed (`typed`: 0.11 name -> the 0.9 name
    given instead), the values given and what to give."""
    from services.common.is_correction import IS_CORRECTION_TYPES  # torch: only for a config that has --use_tis

    enable, name, type_name = (typed.get(n, n) for n in IS_CORRECTION)
    given = {typed.get(n, n): v for n, v in given.items()}
    if enable not in given:
        unused = [f"--{n}" for n in (name, type_name) if n in given]
        if unused:
            warnings.warn(f"{' and '.join(unused)} without --{enable}: no importance-sampling correction (as in "
                          f"OpenRLHF); add --{enable} to apply it", stacklevel=3)
        return []
    if given[enable]:
        raise ConfigError(f"--{enable} {' '.join(given[enable])}: it is a switch and takes no value; give "
                          f"--{enable} alone")
    kind = given.get(type_name, ["tis"])
    if len(kind) != 1 or kind[0] not in IS_CORRECTION_TYPES:
        shown = f"--{type_name} {' '.join(kind)}".rstrip()
        raise ConfigError(f"{shown}: give one of {', '.join(IS_CORRECTION_TYPES)} (tis: "
                          "weights clamped into the band; icepop: weights outside it set to 0; seq-mask-tis: "
                          "sequences outside it dropped)")
    values = given.get(name, list(OPENRLHF_IS_BAND))
    shown = f"--{name} {' '.join(values)}".rstrip()
    fix = "give LOW HIGH with 0 <= LOW <= 1 <= HIGH, e.g. OpenRLHF's default 0.5 5 (or one value: a cap HIGH >= 1)"
    if len(values) not in (1, 2):
        raise ConfigError(f"{shown}: expected LOW HIGH (2 numbers), got {len(values)} value(s); {fix}")
    try:
        band = [float(v) for v in values]
    except ValueError:
        raise ConfigError(f"{shown}: not numbers; {fix}") from None
    if not all(math.isfinite(v) for v in band):
        raise ConfigError(f"{shown}: the bounds must be finite numbers; {fix}")
    if len(band) == 1:
        if band[0] < 1:
            raise ConfigError(f"{shown}: a single value is the cap from above (OpenRLHF 0.8's threshold) and must "
                              f"be >= 1, so that on-policy tokens (weight 1) keep their weight; {fix}")
        band = [0.0, band[0]]
    if not 0 <= band[0] <= 1 <= band[1]:
        raise ConfigError(f"{shown}: the band of importance weights must hold 1 (an on-policy token), LOW in "
                          f"[0, 1] and HIGH >= 1; {fix}")
    return ["--use_tis", "--tis_low", f"{band[0]:g}", "--tis_cap", f"{band[1]:g}", "--tis_type", kind[0]]


def _dotted_is_correction(options: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """OpenRLHF 0.9's flat importance-sampling options as their 0.11 names (translated together)."""
    given = {name for name, _ in options}
    for flat, dotted in IS_CORRECTION_FLAT.items():
        if flat in given and dotted in given:
            raise ConfigError(f"--{dotted} and --{flat} are the same option (OpenRLHF 0.11's name and the earlier "
                              "one); give it once")
    return [(IS_CORRECTION_FLAT.get(name, name), values) for name, values in options]


def _rule(name: str, fields: set[str]) -> Rule | None:
    rules = NAMES[name] if isinstance(NAMES[name], tuple) else (NAMES[name],)
    for rule in rules:
        if isinstance(rule, Refuse) or rule.flat in fields:
            return rule
    return None


def translate_argv(cls, argv: list[str]) -> list[str]:
    """A command line with OpenRLHF 0.11's namespaced options as cls's flat ones; ConfigError for a
    refused option, an unknown namespaced one, or an option given in both forms."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unsupported = getattr(cls, "UNSUPPORTED_FLAGS", {})
    options = split_options(argv)
    typed: dict[str, str] = {}  # OpenRLHF 0.11's importance-sampling option -> its 0.9 name, where that was given
    if "use_tis" in fields:
        typed = {IS_CORRECTION_FLAT[n]: n for n, _ in options if n in IS_CORRECTION_FLAT}
        options = _dotted_is_correction(options)
    joint = {n: v for n, v in options
             if (n in IS_CORRECTION and "use_tis" in fields) or (n in LENGTHS and "max_len" not in fields)}
    async_train = any(n == "train.async_enable" for n, _ in options) and "async_train" in fields
    out: list[str] = []
    produced: dict[str, str] = {}  # flat option -> the namespaced option it came from

    def emit(source: str, tokens: list[str]) -> None:
        for token in tokens:
            if token.startswith("--"):
                flat = token[2:].removeprefix("no-")
                if flat in produced and produced[flat] != source:
                    raise ConfigError(f"--{produced[flat]} and --{source} both set --{flat}; give one of them")
                produced[flat] = source
        out.extend(tokens)

    for name, values in options:
        if not name or not is_namespaced(name):
            out.extend([f"--{name}", *values] if name else values)
            continue
        if name in joint:
            continue
        negated = name.startswith("no-")
        key = name.removeprefix("no-")
        if key not in NAMES:
            from services.common.option_hints import nearest

            guess = nearest(key, list(NAMES))
            raise ConfigError(f"--{name}: not an option of OpenRLHF 0.11 that rlmesh knows"
                              + (f"; did you mean --{guess}?" if guess else "") + " See --help for the options "
                              "(OpenRLHF's namespaced ones are in services/common/openrlhf_names.py)")
        rule = ASYNC_RULES.get(key) if async_train else None
        rule = rule or _rule(key, fields)
        if rule is None:
            raise ConfigError(f"--{name}: OpenRLHF's option has no counterpart in this command (see --help)")
        if isinstance(rule, Refuse):
            if rule.default is not None and tuple(values) == rule.default:
                continue  # OpenRLHF's default, which is what rlmesh does
            raise ConfigError(f"--{name}: {rule.advice}")
        if rule.flat in unsupported:
            raise ConfigError(f"--{name} (OpenRLHF's --{rule.flat}): {unsupported[rule.flat]}")
        if rule.convert is not None:
            emit(key, rule.convert(values))
        else:
            emit(key, [f"--{'no-' if negated else ''}{rule.flat}", *values])
    if joint.keys() & set(IS_CORRECTION):
        emit("algo.advantage.is_correction_enable", _is_correction(joint, typed))
    if joint.keys() & set(LENGTHS):
        emit("data.max_len", _lengths(joint))
    given_flat = {n.removeprefix("no-") for n, _ in options if n and not is_namespaced(n)}
    both = sorted(given_flat & produced.keys())
    if both:
        raise ConfigError("; ".join(f"--{produced[flat]} and --{flat} are the same option (OpenRLHF 0.11's name and "
                                    "the earlier one); give it once" for flat in both))
    return out


def mapping_to_argv(values: dict) -> tuple[list[str], dict]:
    """A YAML --config's namespaced keys (`ds.zero_stage: 3`, or nested `ds: {zero_stage: 3}`) as command-line
    tokens for translate_argv, and the other keys unchanged."""
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}".replace("-", "_")
            if isinstance(value, dict) and (prefix or name.split(".")[0] in NAMESPACES):
                walk(name + ".", value)
            else:
                flat[name] = value

    walk("", values)
    argv: list[str] = []
    rest = {}
    for name, value in flat.items():
        if not is_namespaced(name):
            rest[name] = value
        elif value is True:
            argv.append(f"--{name}")
        elif value is False:
            continue  # OpenRLHF's switches are off unless given
        else:
            argv += [f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv, rest


NAMESPACES = {name.split(".")[0] for name in NAMES}
