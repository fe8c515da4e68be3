"""`python -m services.coordinator.main_ppo key=value ...`: the command veRL users know.

veRL's trainer (`python3 -m verl.trainer.main_ppo`) takes Hydra overrides such as
`algorithm.adv_estimator=grpo data.train_files=train.parquet actor_rollout_ref.rollout.n=5`. This
entry point reads the same overrides, starts from veRL's defaults where they differ from rlmesh's
(KL off, dual-clip c = 3, learning rate 1e-6, weight decay 0.01, enforce_eager, 30 epochs, ...), or
from a config file of the user's (`--config-path DIR --config-name NAME`, verl_config_file.py),
and runs the coordinator with the equivalent rlmesh flags, which it logs in full (`verl.translated`)
so that the run can be repeated with `rlmesh train`. Arguments that start with `--` are rlmesh
flags and are passed on as they are, after the translated ones (they win).

Sizes follow veRL's meaning: data.train_batch_size counts prompts per step (--rollout_batch_size),
ppo_mini_batch_size counts prompts per optimizer step (--train_batch_size counts samples, so it is
multiplied by rollout.n), the *_per_gpu micro batches count samples. The rollout is veRL's hybrid
engine: every GPU of trainer.nnodes x trainer.n_gpus_per_node holds the learner and a vLLM engine
of rollout.tensor_model_parallel_size GPUs (--colocate_all_models, sleep between phases).

Keys with no meaning here (FSDP and Megatron internals, Ulysses, the log-prob passes' token
budgets) are listed in a warning and otherwise ignored; a key that would change what is trained and
that rlmesh cannot honour (another rollout backend or advantage estimator, multi-turn rollouts in
veRL's format, an unknown KL estimator, and the keys of REFUSED when set to anything but veRL's
default) is a ConfigError naming it. simpleRL-reason's `trainer.remove_clip=True` (its fork: the
unclipped loss -ratio x advantage) is honoured; `trainer.save_freq=-1` (veRL's default) writes no
checkpoint, only the final model. Without a reward model or a
custom_reward_function, veRL scores by data_source with its built-in rules; here that is
`--reward_func math` (math-verify on the final answer: \\boxed{}, "the answer is", else the last
number, which reads GSM8K's `#### 42`). The label is the row's reward_model.ground_truth, except
with a reward model, which needs none.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import yaml

from services.common.config import ConfigError
from services.coordinator.cli.verl_config_file import config_file_overrides, resolve_interpolations, \
    split_hydra_options

A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."

# veRL's defaults for the keys translated below (verl/trainer/config/ppo_trainer.yaml).
DEFAULTS: dict[str, object] = {
    "data.prompt_key": "prompt", "data.reward_fn_key": "data_source", "data.max_prompt_length": 512,
    "data.max_response_length": 512, "data.train_batch_size": 1024,
    A + "ppo_mini_batch_size": 256, A + "grad_clip": 1.0, A + "clip_ratio": 0.2, A + "clip_ratio_c": 3.0,
    A + "loss_agg_mode": "token-mean", A + "entropy_coeff": 0.0, A + "use_kl_loss": False,
    A + "kl_loss_coef": 0.001, A + "kl_loss_type": "low_var_kl", A + "ppo_epochs": 1, A + "optim.lr": 1e-6,
    A + "optim.lr_warmup_steps_ratio": 0.0, A + "optim.lr_scheduler_type": "constant", A + "optim.weight_decay": 0.01,
    A + "optim.betas": [0.9, 0.999],
    R + "name": "vllm", R + "n": 1, R + "temperature": 1.0, R + "top_p": 1.0, R + "top_k": -1,
    R + "gpu_memory_utilization": 0.5, R + "tensor_model_parallel_size": 2, R + "enforce_eager": True,
    R + "free_cache_engine": True, R + "val_kwargs.temperature": 0.0, R + "val_kwargs.n": 1,
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1, "trainer.total_epochs": 30, "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1, "trainer.test_freq": -1, "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k", "trainer.logger": ["console", "wandb"], "trainer.resume_mode": "auto",
    "custom_reward_function.name": "compute_score", "reward_model.enable": False, "trainer.remove_clip": False,
}

UNCLIPPED = 1e9  # trainer.remove_clip's clip range: beyond any ratio rlmesh computes
ADVANTAGE = {"gae": "gae", "grpo": "group_norm", "rloo": "rloo", "reinforce_plus_plus": "reinforce",
             "reinforce_plus_plus_baseline": "reinforce_baseline"}
KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
LOSS_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
            "seq-mean-token-sum": "seq_mean_token_sum"}

# Keys that change what is trained and that rlmesh does not do: given with a value other than veRL's
# default (which is rlmesh's behaviour too), they are a ConfigError with what to use instead.
REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "trainer.critic_warmup": ((0,), "training the critic alone for the first steps is not supported"),
    "trainer.val_only": ((False,), "for evaluation alone use `rlmesh eval --pretrain DIR --eval_dataset FILE`"),
    R + "do_sample": ((True,), "greedy rollouts are not supported; sampling is set by rollout.temperature"),
    R + "ignore_eos": ((False,), "responses end at the end-of-sequence token"),
    "algorithm.use_pf_ppo": ((False,), "preference-feedback PPO (sample reweighting) is not supported"),
    "reward_model.reward_manager": (("naive", "batch", "dapo"), "rlmesh calls the reward function per sample "
                                                                "(compute_score) or per batch (compute_score with "
                                                                "lists) as veRL's naive and batch managers do, and "
                                                                "adds the overlong penalty as its dapo manager does"),
    "data.custom_cls.path": ((None, ""), "a dataset class of the user's is not loaded here: write the rows as "
                                         "parquet or JSONL files in veRL's layout (prompt messages, data_source, "
                                         "reward_model.ground_truth, extra_info) and give them as data.train_files"),
    "custom_reward_function.reward_kwargs": (({}, None), "extra keyword arguments to the reward function are not "
                                                         "passed; give them defaults in the function"),
}

# DAPO's overlong penalty as veRL's dapo reward manager takes it now (`+reward_model.reward_kwargs...`);
# reward_model.overlong_buffer.* is the older form.
OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg."

# Keys read by translate(): everything else the user gives is reported as having no effect.
READ = set(DEFAULTS) | {
    "data.train_files", "data.val_files", "data.seed", "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.use_liger", "actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules", A + "ppo_micro_batch_size_per_gpu", A + "clip_ratio_low",
    A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu", A + "ppo_micro_batch_size", R + "log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size",
    A + "clip_ratio_high", A + "strategy", A + "fsdp_config.optimizer_offload", A + "policy_loss.loss_mode",
    R + "max_num_batched_tokens", R + "max_num_seqs", R + "log_prob_micro_batch_size_per_gpu",
    R + "multi_turn.enable", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.model.path", "critic.optim.lr", "critic.cliprange_value", "reward_model.model.path",
    "custom_reward_function.path", "algorithm.filter_groups.enable", "algorithm.filter_groups.max_num_gen_batches",
    "reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor", *(OVERLONG + k for k in ("enable", "len", "penalty_factor", "log")),
    "reward_model.reward_kwargs.max_resp_len", "trainer.total_training_steps", "trainer.default_local_dir",
    "trainer.max_actor_ckpt_to_keep", "ray_init.num_cpus", "trainer.remove_clip", "data.shuffle",
    A + "optim.lr_warmup_steps", A + "optim.warmup_style", A + "optim.min_lr_ratio", A + "tis_imp_ratio_cap",
    *(f"algorithm.rollout_correction.{k}" for k in ("rollout_is", "rollout_is_threshold", "rollout_rs",
                                                    "rollout_rs_threshold", "bypass_mode", "loss_type",
                                                    "rollout_is_batch_normalize")),
    *REFUSED,
}


class VerlKeyIgnored(UserWarning):
    """veRL keys that have no effect in rlmesh."""


def parse_overrides(args: list[str]) -> tuple[dict[str, object], list[str]]:
    """Hydra overrides (`key=value`, `+key=value`, `++key=value`) -> {key: value}, and the `--` flags."""
    values: dict[str, object] = {}
    flags: list[str] = []
    in_flag = False  # after a --flag, the tokens without "=" are its values
    for arg in args:
        if arg.startswith("--") or (in_flag and "=" not in arg):
            flags.append(arg)
            in_flag = in_flag or arg.startswith("--")
            continue
        in_flag = False
        key, sep, raw = arg.lstrip("+").partition("=")
        if not sep or not key:
            raise ConfigError(f"{arg!r}: expected a veRL override key=value (e.g. data.train_batch_size=256) or an "
                              "rlmesh --flag")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        values[key.strip()] = raw if value is None and raw not in ("null", "~", "None") else value
    return values, flags


def read_command(args: list[str]) -> tuple[dict[str, object], list[str]]:
    """The overrides of a veRL command (its config file's keys, then key=value, which win), interpolations
    resolved, and the rlmesh `--` flags."""
    config_path, config_name, rest = split_hydra_options(args)
    overrides, flags = parse_overrides(rest)
    merged = {**config_file_overrides(config_path, config_name), **overrides}
    return resolve_interpolations(merged, DEFAULTS, READ), flags


def translate(overrides: dict[str, object]) -> tuple[list[str], list[str]]:
    """veRL overrides -> (rlmesh coordinator argv, keys given that have no effect here)."""
    # key=null on a key with a default means the default (veRL reads null as "not set" there).
    v = {**DEFAULTS, **{k: x for k, x in overrides.items() if x is not None or k not in DEFAULTS}}
    get: Callable[[str], object] = lambda key: v.get(key)  # noqa: E731
    argv: list[str] = []

    def flag(name: str, value=None) -> None:
        argv.append(f"--{name}")
        if value is not None:
            argv.extend(value if isinstance(value, list) else [str(value)])

    def need(key: str) -> object:
        if v.get(key) in (None, ""):
            raise ConfigError(f"{key}: required (veRL has no usable default for it); give {key}=...")
        return v[key]

    def whole(key: str) -> int:
        value = get(key)
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a whole number (e.g. {DEFAULTS.get(key, 1)})") from None

    def one_of(key: str, table: dict[str, str], what: str) -> str:
        value = str(get(key))
        if value not in table:
            raise ConfigError(f"{key}={value}: rlmesh has no {what} of that name; use one of {sorted(table)}")
        return table[value]

    def files(key: str) -> str:
        value = get(key)
        return ",".join(str(x) for x in value) if isinstance(value, list) else str(value)

    # The data.
    flag("prompt_data", files("data.train_files") if get("data.train_files") else need("data.train_files"))
    flag("input_key", get("data.prompt_key"))
    # veRL's rule rewards and reward files get reward_model.ground_truth; a reward model needs no label
    # (and veRL's datasets for one may not carry a ground truth).
    flag("label_key", "" if get("reward_model.enable") else "reward_model.ground_truth")
    flag("apply_chat_template")  # veRL renders the prompt's message list with the model's chat template
    if get("data.reward_fn_key") not in ("data_source", "datasource"):
        raise ConfigError(f"data.reward_fn_key={get('data.reward_fn_key')}: rlmesh reads the data source from the "
                          "data_source column; rename the column")
    if get("data.val_files"):
        flag("eval_dataset", files("data.val_files"))
        flag("eval_temperature", get(R + "val_kwargs.temperature"))
        flag("eval_n_samples_per_prompt", get(R + "val_kwargs.n"))
    flag("prompt_max_len", get("data.max_prompt_length"))
    flag("generate_max_len", get("data.max_response_length"))
    if get("data.seed") is not None:
        flag("seed", get("data.seed"))
    if get("data.shuffle") is False:  # the prompts in the files' order, every epoch
        flag("no-shuffle_prompts")

    # Batch sizes: prompts per step and per optimizer step in veRL, samples in rlmesh.
    n = whole(R + "n")
    flag("n_samples_per_prompt", n)
    flag("rollout_batch_size", get("data.train_batch_size"))
    flag("train_batch_size", whole(A + "ppo_mini_batch_size") * n)
    world = whole("trainer.nnodes") * whole("trainer.n_gpus_per_node")

    def per_gpu(key: str) -> object:
        """key_per_gpu, or veRL's older key (a count over every GPU, divided among them as veRL does)."""
        if get(key + "_per_gpu"):
            return get(key + "_per_gpu")
        if get(key) in (None, ""):
            return None
        if whole(key) < world:
            raise ConfigError(f"{key}={get(key)} counts samples over all {world} GPUs (trainer.nnodes x "
                              f"trainer.n_gpus_per_node): give at least {world}, or {key}_per_gpu")
        return whole(key) // world

    if per_gpu(A + "ppo_micro_batch_size"):
        flag("micro_train_batch_size", per_gpu(A + "ppo_micro_batch_size"))
    if get(A + "use_dynamic_bsz"):  # micro-batches of up to ppo_max_token_len_per_gpu tokens
        flag("use_dynamic_batch")
        if get(A + "ppo_max_token_len_per_gpu"):
            flag("train_max_tokens_per_gpu", get(A + "ppo_max_token_len_per_gpu"))
    log_prob_micro = per_gpu(R + "log_prob_micro_batch_size") or per_gpu(
        "actor_rollout_ref.ref.log_prob_micro_batch_size")
    if log_prob_micro:
        flag("micro_rollout_batch_size", log_prob_micro)
    flag("max_epochs", get(A + "ppo_epochs"))

    # The model, the learner and the hybrid engine.
    flag("pretrain", need("actor_rollout_ref.model.path"))
    strategy = str(get(A + "strategy") or "fsdp")
    if strategy not in ("fsdp", "fsdp2"):
        raise ConfigError(f"{A}strategy={strategy}: the rlmesh learner is DeepSpeed ZeRO (FSDP settings map to it); "
                          "Megatron is not supported")
    if get("actor_rollout_ref.model.enable_gradient_checkpointing"):
        flag("gradient_checkpointing")
    if get("actor_rollout_ref.model.use_remove_padding"):
        flag("packing_samples")
    if get("actor_rollout_ref.model.use_liger"):
        flag("use_liger_kernel")
    if get(A + "fsdp_config.optimizer_offload"):
        flag("adam_offload")
    # LoRA on the actor; veRL reads lora_alpha and target_modules only with lora_rank > 0.
    lora_rank = whole("actor_rollout_ref.model.lora_rank") if get("actor_rollout_ref.model.lora_rank") else 0
    if lora_rank < 0:
        raise ConfigError(f"actor_rollout_ref.model.lora_rank={lora_rank} must be >= 0 (0 = no LoRA; e.g. 32)")
    if lora_rank > 0:
        flag("lora_rank", lora_rank)
        if get("actor_rollout_ref.model.lora_alpha") is not None:
            flag("lora_alpha", get("actor_rollout_ref.model.lora_alpha"))
        targets = get("actor_rollout_ref.model.target_modules")
        if targets:
            flag("target_modules", [str(t) for t in targets] if isinstance(targets, list) else str(targets).split(","))
    nodes, gpus = whole("trainer.nnodes"), whole("trainer.n_gpus_per_node")
    if nodes < 1 or gpus < 1:
        raise ConfigError(f"trainer.nnodes={nodes}, trainer.n_gpus_per_node={gpus}: each must be >= 1")
    tp = whole(R + "tensor_model_parallel_size")
    if (nodes * gpus) % tp:
        raise ConfigError(f"{R}tensor_model_parallel_size={tp} does not divide the {nodes * gpus} GPUs of "
                          "trainer.nnodes x trainer.n_gpus_per_node")
    flag("actor_num_nodes", nodes)
    flag("actor_num_gpus_per_node", gpus)
    flag("vllm_num_engines", nodes * gpus // tp)
    flag("vllm_tensor_parallel_size", tp)
    flag("colocate_all_models")
    flag("vllm_gpu_memory_utilization", get(R + "gpu_memory_utilization"))
    if get(R + "free_cache_engine"):
        flag("vllm_enable_sleep")
    if get(R + "enforce_eager"):
        flag("enforce_eager")
    for key, name in (("max_num_batched_tokens", "vllm_max_num_batched_tokens"), ("max_num_seqs", "vllm_max_num_seqs")):
        if get(R + key):
            flag(name, get(R + key))
    flag("rollout_engine", one_of(R + "name", {"vllm": "vllm", "hf": "hf"}, "rollout backend"))
    if get(R + "multi_turn.enable"):
        raise ConfigError(f"{R}multi_turn.enable=True: veRL's tool configs do not run here; multi-turn rollouts "
                          "take an agent file: --agent_func_path FILE.py (OpenRLHF's agent API)")
    flag("temperature", get(R + "temperature"))
    flag("top_p", get(R + "top_p"))
    flag("top_k", get(R + "top_k"))

    # The algorithm.
    estimator = one_of("algorithm.adv_estimator", ADVANTAGE, "advantage estimator")
    if estimator == "group_norm" and not get("algorithm.norm_adv_by_std_in_grpo"):
        estimator = "dr_grpo"
    flag("advantage_estimator", estimator)
    flag("gamma", get("algorithm.gamma"))
    flag("lambd", get("algorithm.lam"))
    flag("actor_learning_rate", get(A + "optim.lr"))
    flag("lr_warmup_ratio", get(A + "optim.lr_warmup_steps_ratio"))
    # veRL's lr_warmup_steps: a count of training steps that wins over the ratio (0: no warm-up; negative,
    # its default -1: the ratio applies).
    warmup_steps = whole(A + "optim.lr_warmup_steps") if get(A + "optim.lr_warmup_steps") is not None else -1
    if warmup_steps > 0:
        flag("lr_warmup_steps", warmup_steps)
    elif warmup_steps == 0:
        flag("lr_warmup_ratio", 0)
    # optim.lr_scheduler_type (veRL's name now), or the deprecated warmup_style, which wins where given.
    schedule_key = A + ("optim.warmup_style" if get(A + "optim.warmup_style") is not None else "optim.lr_scheduler_type")
    schedule = one_of(schedule_key, {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr"},
                      "learning-rate schedule")
    flag("lr_scheduler", schedule)
    if schedule == "cosine_with_min_lr":  # veRL's cosine ends at min_lr_ratio of the peak, 0 unless set
        flag("min_lr_ratio", get(A + "optim.min_lr_ratio") or 0.0)
    flag("l2", get(A + "optim.weight_decay"))
    flag("adam_betas", [str(b) for b in get(A + "optim.betas")])
    flag("max_norm", get(A + "grad_clip"))
    low, high = get(A + "clip_ratio_low"), get(A + "clip_ratio_high")
    if get("trainer.remove_clip"):
        # simpleRL-reason's fork of veRL: the policy loss is -ratio x advantage, unclipped. A clip range no ratio
        # can reach (rlmesh bounds the log-ratio to [-20, 20], e^20 < 1e9) and no dual clip give exactly that.
        flag("eps_clip", UNCLIPPED)
        flag("dual_clip", 0)
    elif low is not None or high is not None:
        flag("eps_clip_low_high", [str(low if low is not None else get(A + "clip_ratio")),
                                   str(high if high is not None else get(A + "clip_ratio"))])
        flag("dual_clip", get(A + "clip_ratio_c"))
    else:
        flag("eps_clip", get(A + "clip_ratio"))
        flag("dual_clip", get(A + "clip_ratio_c"))
    flag("loss_agg_mode", one_of(A + "loss_agg_mode", LOSS_AGG, "loss aggregation"))
    flag("entropy_loss_coef", get(A + "entropy_coeff"))
    if str(get(A + "policy_loss.loss_mode") or "vanilla") not in ("vanilla", "gspo"):
        raise ConfigError(f"{A}policy_loss.loss_mode={get(A + 'policy_loss.loss_mode')}: rlmesh has the vanilla "
                          "(PPO) and gspo losses")
    if get(A + "policy_loss.loss_mode") == "gspo":
        flag("policy_loss_type", "gspo")
    in_loss, in_reward = bool(get(A + "use_kl_loss")), bool(get("algorithm.use_kl_in_reward"))
    if in_loss and in_reward:
        raise ConfigError(f"{A}use_kl_loss and algorithm.use_kl_in_reward are both on; rlmesh applies the KL one "
                          "way: choose one")
    if in_loss:
        flag("use_kl_loss")
        flag("init_kl_coef", get(A + "kl_loss_coef"))
        flag("kl_estimator", one_of(A + "kl_loss_type", KL, "KL estimator"))
    elif in_reward:
        flag("init_kl_coef", get("algorithm.kl_ctrl.kl_coef"))
        flag("kl_estimator", one_of("algorithm.kl_penalty", KL, "KL estimator"))
        if get("algorithm.kl_ctrl.type") == "adaptive":
            flag("kl_target", get("algorithm.kl_ctrl.target_kl"))
            flag("kl_horizon", get("algorithm.kl_ctrl.horizon"))
    else:
        flag("init_kl_coef", 0)  # veRL's default: no KL, no reference model
    # Importance sampling against the rollout engine's own log-probs: veRL's rollout_correction with
    # token-level truncated IS (decoupled mode), or its older tis_imp_ratio_cap, is --use_tis.
    rc = "algorithm.rollout_correction."
    cap = get(A + "tis_imp_ratio_cap")
    if get(rc + "rollout_is") not in (None, "", "null"):
        if str(get(rc + "rollout_is")) != "token":
            raise ConfigError(f"{rc}rollout_is={get(rc + 'rollout_is')}: rlmesh weights by token (truncated "
                              "importance sampling, rollout_is=token) only")
        for key, fine in (("rollout_rs", (None, "", "null")), ("bypass_mode", (None, False)),
                          ("rollout_is_batch_normalize", (None, False))):
            if get(rc + key) not in fine:
                raise ConfigError(f"{rc}{key}={get(rc + key)}: not supported with rlmesh's truncated importance "
                                  f"sampling (rollout_is=token); leave {rc}{key} at veRL's default")
        cap = get(rc + "rollout_is_threshold") if get(rc + "rollout_is_threshold") is not None else 2.0
    elif get(rc + "rollout_rs") not in (None, "", "null"):
        raise ConfigError(f"{rc}rollout_rs={get(rc + 'rollout_rs')}: rejection sampling of off-policy samples is "
                          f"not supported; rlmesh has token-level truncated importance sampling ({rc}rollout_is=token)")
    if cap is not None and float(cap) > 0:
        flag("use_tis")
        flag("tis_cap", cap)
    if get("algorithm.filter_groups.enable"):
        flag("dynamic_filtering")
        if get("algorithm.filter_groups.max_num_gen_batches"):
            flag("dynamic_filtering_max_rounds", get("algorithm.filter_groups.max_num_gen_batches"))
    for prefix in ("reward_model.overlong_buffer.", OVERLONG):
        if get(prefix + "enable"):
            if get(prefix + "len") in (None, ""):
                raise ConfigError(f"{prefix}enable=True without {prefix}len: give the buffer's length in tokens")
            flag("overlong_buffer_len", whole(prefix + "len"))
            flag("overlong_penalty_factor", get(prefix + "penalty_factor") or 1.0)
            # The penalty starts max_resp_len - len tokens in; rlmesh's max_resp_len is data.max_response_length.
            max_resp_len = get("reward_model.reward_kwargs.max_resp_len")
            if max_resp_len not in (None, "") and whole("reward_model.reward_kwargs.max_resp_len") != whole(
                    "data.max_response_length"):
                raise ConfigError(f"reward_model.reward_kwargs.max_resp_len={max_resp_len} differs from "
                                  f"data.max_response_length={get('data.max_response_length')}: rlmesh measures the "
                                  "overlong penalty against the generation limit; give both the same value")
            break

    # The critic (gae) and the reward.
    if get("critic.model.path"):
        flag("critic_pretrain", get("critic.model.path"))
    if get("critic.optim.lr") is not None:
        flag("critic_learning_rate", get("critic.optim.lr"))
    if get("critic.cliprange_value") is not None:
        flag("value_clip", get("critic.cliprange_value"))
    if get("reward_model.enable"):
        flag("reward_pretrain", need("reward_model.model.path"))
    elif get("custom_reward_function.path"):
        flag("remote_rm_url", f"{get('custom_reward_function.path')}:{get('custom_reward_function.name')}")
    else:
        flag("reward_func", "math")  # veRL's default_compute_score checks math answers by data source

    # The trainer.
    flag("num_episodes", get("trainer.total_epochs"))
    if get("trainer.total_training_steps"):
        flag("max_steps", get("trainer.total_training_steps"))
    if whole("trainer.save_freq") <= 0:
        # veRL's -1: no checkpoints at all (the final model is still written to default_local_dir/final).
        flag("save_steps", -1)
        flag("disable_ds_ckpt")
    else:
        flag("save_steps", get("trainer.save_freq"))
    flag("eval_steps", get("trainer.test_freq"))
    local_dir = get("trainer.default_local_dir") or (
        f"checkpoints/{get('trainer.project_name')}/{get('trainer.experiment_name')}")
    flag("ckpt_path", local_dir)
    flag("save_path", f"{local_dir}/final")
    if get("trainer.max_actor_ckpt_to_keep"):
        flag("max_ckpt_num", get("trainer.max_actor_ckpt_to_keep"))
    if str(get("trainer.resume_mode")) == "auto":
        flag("load_checkpoint")
    elif str(get("trainer.resume_mode")) not in ("disable", "False"):
        raise ConfigError(f"trainer.resume_mode={get('trainer.resume_mode')}: use auto (the latest checkpoint under "
                          "trainer.default_local_dir) or disable")
    loggers = get("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    flag("wandb_project", get("trainer.project_name"))
    flag("wandb_run_name", get("trainer.experiment_name"))
    if "wandb" in loggers:
        flag("use_wandb", "True")
    if "tensorboard" in loggers:
        flag("use_tensorboard", f"{local_dir}/tensorboard")
    if get("ray_init.num_cpus"):
        flag("ray_num_cpus", get("ray_init.num_cpus"))
    for key, (defaults, advice) in REFUSED.items():
        if key in overrides and overrides[key] not in defaults:
            raise ConfigError(f"{key}={overrides[key]}: {advice}")
    ignored = sorted(k for k in overrides if k not in READ)
    return argv, ignored


def main(argv: list[str] | None = None) -> int:
    from services.coordinator.cli import train

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        overrides, flags = read_command(args)
        translated, ignored = translate(overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if ignored:
        warnings.warn(f"veRL keys with no effect in rlmesh (ignored): {', '.join(ignored)}", VerlKeyIgnored,
                      stacklevel=1)
    print("verl.translated rlmesh train " + " ".join(translated + flags), file=sys.stderr, flush=True)
    return train.main(translated + flags)
