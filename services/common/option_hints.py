"""What an unknown option on a command line was meant to be.

parse_config (services/common/config.py) asks here about every option its parser does not know:

- an option of OpenRLHF (its flat names of 0.9 / 0.10, or 0.11's own flat ones such as --optim and
  --use_ms) that rlmesh does not have gets a sentence saying so and what to use instead
  (OPENRLHF_ONLY; given with OpenRLHF's default value, which is what rlmesh does, it is only noted);
  one that another rlmesh command has gets that command;
- any other option gets the nearest known one (difflib), e.g. --actor_num_node -> --actor_num_nodes.

OpenRLHF 0.11's namespaced options (--ds.zero_stage, ...) are services/common/openrlhf_names.py's.
An entry here applies only to a command whose configuration lacks the option: when rlmesh gains
one of these flags, its field wins.
"""

from __future__ import annotations

import dataclasses
import difflib


@dataclasses.dataclass(frozen=True)
class Missing:
    """An OpenRLHF option rlmesh does not have: `advice` says what to use. Given with `default`
    (OpenRLHF's default value, what rlmesh does anyway) it is noted and dropped."""
    advice: str
    default: tuple[str, ...] | None = None
    elsewhere: bool = False  # rlmesh has it, in another command (the advice names it)


_DS_FILE = "set {key} in a DeepSpeed config file given with --deepspeed FILE (laid over rlmesh's config)"
_SPLIT = "rlmesh reads local files: give the split's file or folder"
_RING = ("ring attention (context parallel) is not supported: each sample is trained on one GPU; use "
         "--gradient_checkpointing for long samples")

# OpenRLHF's flat option -> what rlmesh offers instead.
OPENRLHF_ONLY: dict[str, Missing] = {
    "use_ms": Missing("rlmesh does not download models or data (ModelScope or the Hugging Face hub): give local "
                      "folders and files", default=()),
    "optim": Missing("rlmesh trains with AdamW only, which is OpenRLHF's --optim adam; the Muon optimizer is not "
                     "supported", default=("adam",)),
    "param_dtype": Missing("give --bf16 for bfloat16 (OpenRLHF's --param_dtype bf16); without it rlmesh trains in "
                           "float32; fp16 is not supported"),
    "attn_implementation": Missing("the coordinator's learner takes --flash_attn (FlashAttention) or the model's "
                                   "default attention; the offline trainers take --attn_implementation"),
    "max_len": Missing("the coordinator bounds prompts and responses apart: --prompt_max_len N --generate_max_len M "
                       "(OpenRLHF 0.11's --data.max_len with --rollout.max_new_tokens is translated)"),
    "max_new_tokens": Missing("use --generate_max_len"),
    "async_queue_size": Missing("use --max_staleness N (how many steps generation may run ahead of training)"),
    "enable_vllm_is_correction": Missing("use --use_tis (truncated importance sampling against the engine's own "
                                         "log-probs) with --tis_cap"),
    "vllm_is_truncated_threshold": Missing("use --tis_cap HIGH (with --use_tis)"),
    "vllm_is_correction_type": Missing("rlmesh's importance-sampling correction is --use_tis --tis_cap HIGH; "
                                       "OpenRLHF 0.11's --algo.advantage.is_correction_type is translated",
                                       default=("tis",)),
    "vllm_sync_with_ray": Missing("weights travel learner -> engines over --vllm_sync_backend (nccl, gloo or ipc), "
                                  "not through Ray's object store; drop it", default=()),
    "vllm_generate_batch_size": Missing("generation covers --rollout_batch_size prompts per step; over-sampling is "
                                        "not supported: drop it"),
    "ref_reward_offload": Missing("the reference and reward models run in services of their own (own GPUs, or "
                                  "colocated with --colocate_actor_ref / --colocate_critic_reward / "
                                  "--colocate_all_models); drop it", default=()),
    "ref_offload": Missing("the DPO reference model is held beside the trained one; drop it (use --zero_stage 3 "
                           "or --adam_offload to fit the models)", default=()),
    "actor_init_on_gpu": Missing("the learner places the model itself; drop it", default=()),
    "perf": Missing("step timings are always in the run's metrics.jsonl (time/*); drop it", default=()),
    "ptx_coef": Missing("the PPO-ptx pre-training loss is not supported; train on pre-training data with "
                        "`rlmesh sft` before or after"),
    "freezing_actor_steps": Missing("training the critic alone for the first steps is not supported: the actor "
                                    "trains from the first step", default=("-1",)),
    "ring_attn_size": Missing(_RING, default=("1",)),
    "ring_head_stride": Missing(_RING, default=("1",)),
    "ds_tensor_parallel_size": Missing("the learner is data parallel (DeepSpeed ZeRO) only; use --zero_stage 3 to "
                                       "shard a large model", default=("1",)),
    "zpg": Missing(_DS_FILE.format(key="zero_optimization.zero_hpz_partition_size"), default=("1",)),
    "overlap_comm": Missing(_DS_FILE.format(key="zero_optimization.overlap_comm: true")),
    "grad_accum_dtype": Missing(_DS_FILE.format(key="data_types.grad_accum_dtype")),
    "deepcompile": Missing("DeepSpeed's compiler is not supported; drop it"),
    "load_in_4bit": Missing("4-bit base weights (QLoRA) are not supported: LoRA (--lora_rank N) trains adapters "
                            "over bf16 / fp32 base weights"),
    "value_head_prefix": Missing("rlmesh's reward models and critics are transformers sequence-classification "
                                 "models whose head is `score`", default=("score",)),
    "aux_loss_coef": Missing("the MoE router's load-balancing loss is a training option: `rlmesh train "
                             "--aux_loss_coef X` (the coordinator sends it with each training call) or `rlmesh "
                             "sft|rm|dpo --aux_loss_coef X`", default=("0",), elsewhere=True),
    "compute_fp32_loss": Missing("the pairwise loss is always computed in float32; drop it", default=()),
    "pretrain_mode": Missing("SFT's loss covers the response tokens; for a loss over every token put the whole "
                             "text in --output_key with an empty --input_key field"),
    "dataloader_num_workers": Missing("rlmesh reads the data in the trainer's process", default=("0",)),
    "disable_fast_tokenizer": Missing("rlmesh loads the model's tokenizer as transformers picks it; drop it"),
    "tokenizer_chat_template": Missing("rlmesh renders with the chat template stored with the tokenizer: put yours "
                                       "in the model folder's tokenizer_config.json"),
    "enable_ema": Missing("an EMA copy of the model is not kept; the exported model is the trained one"),
    "ema_beta": Missing("an EMA copy of the model is not kept", default=("0.992",)),
    "full_determinism": Missing("rlmesh seeds the data order and the sampling (--seed) but does not switch kernels "
                                "to deterministic ones; drop it"),
    "gradient_checkpointing_use_reentrant": Missing("rlmesh's gradient checkpointing is the non-reentrant kind "
                                                    "(same gradients); drop it", default=()),
    "max_ckpt_mem": Missing("rlmesh bounds the checkpoints kept by number: --max_ckpt_num N"),
    "best_metric_key": Missing("rlmesh keeps the newest --max_ckpt_num checkpoints and no extra best one; every "
                               "step's evaluation metrics are in the run's metrics.jsonl", default=("",)),
    "prompt_split": Missing(_SPLIT, default=("train",)),
    "dataset_split": Missing(_SPLIT, default=("train",)),
    "train_split": Missing(_SPLIT, default=("train",)),
    "eval_split": Missing(_SPLIT, default=("train",)),
    "rollout_max_tokens_per_gpu": Missing("an RL option: `rlmesh train --rollout_max_tokens_per_gpu N` (the "
                                          "coordinator passes it on to the learner)", elsewhere=True),
    "stop_properly_penalty_coef": Missing("an RL reward option: `rlmesh train --stop_properly_penalty_coef X` (the "
                                          "coordinator applies it to the rewards of truncated responses)",
                                          elsewhere=True),
    "save_hf_ckpt": Missing("the offline trainers write the model in Hugging Face format to --save_path at the end "
                            "and with every --save_steps checkpoint", default=()),
    "disable_ds_ckpt": Missing("the offline trainers write DeepSpeed checkpoints only with --save_steps N: leave "
                               "that at -1 for none", default=()),
    "use_wandb": Missing("the offline trainers log to the console and to {save_path}/metrics.jsonl (`rlmesh plot` "
                         "draws it); Weights & Biases is the coordinator's (--use_wandb there)"),
    "use_tensorboard": Missing("the offline trainers log to the console and to {save_path}/metrics.jsonl (`rlmesh "
                               "plot` draws it)"),
    "wandb_org": Missing("the offline trainers do not log to Weights & Biases; see {save_path}/metrics.jsonl"),
    "wandb_group": Missing("the offline trainers do not log to Weights & Biases; see {save_path}/metrics.jsonl"),
    "wandb_project": Missing("the offline trainers do not log to Weights & Biases; see {save_path}/metrics.jsonl"),
    "wandb_run_name": Missing("the offline trainers do not log to Weights & Biases; see {save_path}/metrics.jsonl"),
}


def nearest(name: str, known: list[str]) -> str | None:
    """The known option closest to `name` (both without --), if any is close enough."""
    found = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return found[0] if found else None


def explain(name: str, values: list[str], known: list[str]) -> tuple[str, bool]:
    """(sentence, is_error) for an option the parser does not know; is_error False: a harmless
    OpenRLHF option given with its default, to be dropped with the sentence as a note."""
    missing = OPENRLHF_ONLY.get(name.removeprefix("no-"))
    if missing is not None:
        harmless = missing.default is not None and tuple(values) == missing.default
        what = ("not an option of this command" if missing.elsewhere
                else "an option of OpenRLHF that rlmesh does not have")
        return f"--{name} is {what}: {missing.advice}", not harmless
    guess = nearest(name, known)
    hint = f"; did you mean --{guess}?" if guess else ""
    return f"--{name} is not an option of this command{hint} (--help lists them)", True
