"""The coordinator's configuration: the flags OpenRLHF users already type, plus placement.

Every flag of `openrlhf.cli.train_ppo_ray` that the seed documents use keeps its name and meaning
(`--actor_num_gpus_per_node`, `--vllm_num_engines`, `--advantage_estimator group_norm`, ...), so a
command line moves over by changing only the module name. rlmesh's own additions (where the
services run, their addresses, run folders) are grouped at the end.

`validate()` runs once at start-up: contradictions fail with a message that says what to change;
flags that only mean something on a GPU give a warning on CPU and are turned off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from typing import ClassVar

from services.common import flags
from services.common.config import ConfigError, check_fields, opt
from services.common.deepspeed_file import apply_flags, check_batches, read_deepspeed_file
from services.common.is_correction import IS_CORRECTION_TYPES
from services.common.lora_check import check_lora
from services.common.openrlhf_compat import check_imports
from services.common.moe_check import check_aux_loss_coef
from services.common.paths import absolute_paths, resolve_path_fields
# The estimators and what each needs (a critic, a group of samples per prompt) come from the maths.
from services.common.rl_math import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
from services.common.server import ServerConfig

PLACEMENTS = ("auto", "local", "ray", "static")
# --loss_agg_mode -> the learner's aggregation level (services.common.rl_math.aggregate_loss); "" = default.
LOSS_AGG_MODES = {"": "token", "token_mean": "token", "seq_mean_token_mean": "sequence",
                  "seq_mean_token_sum": "sequence_sum"}


class GpuOnlyFlagWarning(UserWarning):
    """A flag that only has an effect on a GPU was given on a CPU-only machine."""


@dataclasses.dataclass
class CoordinatorConfig(ServerConfig):
    """Trains a policy with PPO / GRPO / RLOO / REINFORCE++ over the rollout, reward and learner services."""

    # ---- where the models run (GPU counts; on CPU each count is a number of processes) -------
    actor_num_nodes: int = opt(1, "nodes for the actor (policy) learner")
    actor_num_gpus_per_node: int = opt(1, "GPUs per node for the actor; the learner runs one DeepSpeed rank per GPU")
    critic_num_nodes: int = opt(1, "nodes for the critic (used only with --advantage_estimator gae)")
    critic_num_gpus_per_node: int = opt(1, "GPUs per node for the critic")
    reward_num_nodes: int = opt(1, "nodes for the reward model (ignored with --remote_rm_url / --reward_func)")
    reward_num_gpus_per_node: int = opt(1, "GPUs per node for the reward model; one reward service per GPU")
    ref_num_nodes: int = opt(1, "nodes for the reference model (used when --init_kl_coef > 0)")
    ref_num_gpus_per_node: int = opt(1, "GPUs per node for the reference model; one reference service per GPU")
    vllm_num_engines: int = opt(1, "number of rollout services (one vLLM engine each)")
    vllm_tensor_parallel_size: int = opt(1, "GPUs per vLLM engine (tensor parallel)")
    vllm_gpu_memory_utilization: float = opt(
        0.0, "fraction of GPU memory vLLM may use; 0 = 0.9 on GPU, 0.5 when colocated, 0.1 on CPU "
        "(where vLLM reads it as a fraction of host memory)")
    vllm_sync_backend: str = opt("auto", "weight transfer backend learner -> rollout; auto = gloo on CPU, "
                                 "ipc when colocated on GPU, nccl otherwise", choices=["auto", "nccl", "gloo", "ipc"])
    vllm_max_num_seqs: int = opt(0, "vLLM max_num_seqs (concurrent sequences per engine); 0 = vLLM's default")
    vllm_max_num_batched_tokens: int = opt(0, "vLLM max_num_batched_tokens; 0 = vLLM's default")
    vllm_quantization: str = opt("", "vLLM quantization method, e.g. awq; empty = none")
    enable_prefix_caching: bool = flags.ENABLE_PREFIX_CACHING.field(False)
    enforce_eager: bool | None = flags.ENFORCE_EAGER.field(None)
    rollout_dtype: str = opt("auto", "dtype of the rollout engines' weights and activations: auto = bfloat16 with "
                             "--bf16 on GPUs, else the engine's choice (on a CPU: bfloat16 where it has bf16 units, "
                             "avx512_bf16 or amx_bf16, float32 where it has none and bfloat16 would decode slower); "
                             "or float32, bfloat16, float16", choices=["auto", "float32", "bfloat16", "float16"])
    colocate_all_models: bool = opt(False, "actor, critic, reward, reference and vLLM share the actor's GPUs; "
                                    "needs vllm_num_engines x vllm_tensor_parallel_size == actor GPUs, or a "
                                    "multiple of them for several engines per GPU (each with its share of "
                                    "--vllm_gpu_memory_utilization)")
    colocate_actor_ref: bool = opt(False, "the reference model shares the actor's GPUs")
    colocate_critic_reward: bool = opt(False, "the reward model shares the critic's GPUs")
    vllm_enable_sleep: bool = opt(False, "vLLM frees its GPU memory between generations (GPU only)")
    deepspeed_enable_sleep: bool = opt(False, "the learner offloads its states to CPU between trainings (GPU only)")

    # ---- models and rewards -------------------------------------------------------------------
    pretrain: str = opt("", "local folder of the policy model (HF format); also the reference model by default")
    ref_pretrain: str = opt("", "local folder of the reference model; empty = --pretrain")
    critic_pretrain: str = opt("", "local folder to initialise the critic from; empty = --reward_pretrain or --pretrain")
    reward_pretrain: str = opt("", "local folder of a reward model (HF sequence classification, one label)")
    remote_rm_url: str = opt("", "reward server URL(s), comma separated, or a Python file defining reward_func "
                             "(OpenRLHF) or compute_score (veRL); FILE.py:NAME picks another function")
    remote_rm_batch_size: int = flags.REMOTE_RM_BATCH_SIZE.field(64)
    reward_func: str = opt("", "built-in rule reward instead of a model: math, simplerl_math (simpleRL-reason's "
                           "1 / -0.5 / -1), exact_match, format or countdown (comma separated rules add up)")
    normalize_reward: bool = flags.NORMALIZE_REWARD.field(False)
    reward_clip_range: list[float] = opt([-10.0, 10.0], "rewards are clipped to [low, high]")

    # ---- outputs and checkpoints --------------------------------------------------------------
    save_path: str = opt("./ckpt", "folder of the final model (HF format) written at the end")
    export_dtype: str = opt("auto", "dtype of the exported HF models (--save_path, --save_hf_ckpt): auto = never wider "
                            "than --pretrain's checkpoint nor than the training (a bfloat16 checkpoint trained in "
                            "float32 is saved in bfloat16; --bf16 saves bfloat16); or float32, bfloat16, float16. "
                            "The DeepSpeed checkpoints keep float32 master weights for resuming",
                            choices=["auto", "float32", "bfloat16", "float16"])
    ckpt_path: str = opt("./ckpt/checkpoints_ppo", "folder of the resumable checkpoints (global_step_N/...)")
    save_steps: int = opt(-1, "checkpoint every N global steps; -1 = only at the end")
    logging_steps: int = opt(1, "log metrics every N global steps")
    load_checkpoint: bool = opt(False, "resume from the latest complete checkpoint under --ckpt_path")
    use_ds_universal_ckpt: bool = opt(False, "a checkpoint saved under another --zero_stage (1-3) or actor GPU count "
                                      "resumes through DeepSpeed's universal checkpoint (the learner converts it "
                                      "once, into its global_step_N/universal/), keeping step, data position, "
                                      "optimizer states and LR schedule; without it such a resume is refused")
    max_ckpt_num: int = flags.MAX_CKPT_NUM.field(3)
    save_hf_ckpt: bool = opt(False, "with each checkpoint also export the actor in HF format")
    save_value_network: bool = opt(False, "also export the critic in HF format to {save_path}_critic at the end (the "
                                   "DeepSpeed checkpoints always hold it, in global_step_N/critic)")
    disable_ds_ckpt: bool = opt(False, "do not write DeepSpeed checkpoints (no resume possible)")

    # ---- batch sizes and lengths --------------------------------------------------------------
    micro_train_batch_size: int = flags.MICRO_TRAIN_BATCH_SIZE.field(8)
    train_batch_size: int = flags.TRAIN_BATCH_SIZE.field(128)
    micro_rollout_batch_size: int = opt(16, "samples per LogProbs / Values / Score call")
    rollout_batch_size: int = opt(1024, "prompts per global step (each sampled --n_samples_per_prompt times)")
    n_samples_per_prompt: int = opt(1, "responses sampled per prompt; > 1 for the group estimators")
    max_epochs: int = opt(1, "passes over each rollout batch in training")
    num_episodes: int = opt(1, "passes over the prompt data")
    max_steps: int = opt(0, "stop after this global step; 0 = run all episodes")
    max_samples: int = opt(1_000_000_000, "use at most this many prompts from the data")
    shuffle_prompts: bool = opt(True, "shuffle the prompts (by --seed) for each episode; --no-shuffle_prompts takes "
                                      "them in the order of the data every episode")
    prompt_max_len: int = opt(1024, "prompts longer than this many tokens are skipped (counted in the log)")
    generate_max_len: int = opt(1024, "most tokens generated per response")

    # ---- optimisation -------------------------------------------------------------------------
    zero_stage: int = flags.ZERO_STAGE.field(2)
    deepspeed: str = flags.DEEPSPEED_FILE.field("")
    bf16: bool = flags.BF16.field(False)
    actor_learning_rate: float = flags.ACTOR_LEARNING_RATE.field(1e-6)
    critic_learning_rate: float = flags.CRITIC_LEARNING_RATE.field(9e-6)
    lr_warmup_ratio: float = flags.LR_WARMUP_RATIO.field(0.03)
    min_lr_ratio: float = opt(0.1, "cosine_with_min_lr: the final learning rate as a fraction of the peak "
                                   "(veRL's cosine ends at 0)")
    lr_warmup_steps: int = opt(0, "warm up over this many global steps instead of --lr_warmup_ratio of the run "
                                  "(veRL's lr_warmup_steps; at most the whole run); 0: the ratio")
    lr_scheduler: str = flags.LR_SCHEDULER.field("cosine_with_min_lr")
    max_norm: float = flags.MAX_NORM.field(1.0)
    l2: float = flags.L2.field(0.0)
    adam_betas: list[float] = flags.ADAM_BETAS.field([0.9, 0.95])
    adam_offload: bool = flags.ADAM_OFFLOAD.field(False)
    gradient_checkpointing: bool = flags.GRADIENT_CHECKPOINTING.field(False)
    flash_attn: bool = opt(False, "FlashAttention in the learner: the flash-attn package if installed, else "
                           "PyTorch's variable-length FlashAttention (GPU only; with --packing_samples the "
                           "latter is used anyway)")
    use_liger_kernel: bool = flags.USE_LIGER_KERNEL.field(False)
    packing_samples: bool = flags.PACKING_SAMPLES.field(False)
    use_dynamic_batch: bool = flags.USE_DYNAMIC_BATCH.field(False)
    train_max_tokens_per_gpu: int = flags.TRAIN_MAX_TOKENS_PER_GPU.field(16384)
    rollout_max_tokens_per_gpu: int | None = opt(
        None, "with --use_dynamic_batch: most tokens in one micro-batch of the learner's packed forward passes "
        "(the old policy's log-probs, the critic's values; OpenRLHF's experience passes); unset = "
        "--train_max_tokens_per_gpu")
    aux_loss_coef: float = opt(0.0, "MoE models: weight of the router's load-balancing loss added to the actor's "
                               "loss and, as in OpenRLHF, to a MoE critic's (transformers' aux_loss with "
                               "output_router_logits); 0 = none")
    lora_rank: int = flags.LORA_RANK.field(0)
    lora_alpha: float = flags.LORA_ALPHA.field(16.0)
    target_modules: list[str] = flags.TARGET_MODULES.field(["all-linear"])
    lora_dropout: float = flags.LORA_DROPOUT.field(0.0)
    lora_merge_on_save: bool = flags.LORA_MERGE_ON_SAVE.field(False)

    # ---- the RL objective ---------------------------------------------------------------------
    advantage_estimator: str = opt("gae", "advantage estimator (group_norm = GRPO)", choices=list(ADVANTAGE_ESTIMATORS))
    no_advantage_std_norm: bool = opt(False, "whiten advantages by the mean only, not the std")
    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss); 0 = no KL and no reference model")
    kl_target: float = opt(0.0, "adaptive KL target; 0 = fixed coefficient")
    kl_horizon: int = opt(10000, "adaptive KL horizon (samples)")
    use_kl_loss: bool = opt(False, "KL as a loss term (GRPO) instead of a reward penalty")
    kl_estimator: str = opt("k1", "KL estimator", choices=["k1", "k2", "k3"])
    gamma: float = opt(1.0, "discount factor")
    lambd: float = opt(1.0, "GAE lambda")
    eps_clip: float = opt(0.2, "PPO clip range")
    eps_clip_low_high: list[float] = opt([], "asymmetric clip range LOW HIGH (e.g. 0.2 0.28); overrides --eps_clip")
    dual_clip: float = opt(0.0, "dual-clip constant c > 1 for negative advantages; 0 = off")
    value_clip: float = opt(0.5, "value clip range")
    policy_loss_type: str = opt("ppo", "policy loss: token ratios (ppo) or sequence ratios (gspo)", choices=["ppo", "gspo"])
    loss_agg_mode: str = opt("", "how per-token losses become one number (veRL's names, '-' or '_'): token_mean "
                             "(sum / tokens of the batch), seq_mean_token_mean (mean per sequence, then over "
                             "sequences), seq_mean_token_sum (sum per sequence, then mean over sequences); applies "
                             "to the policy, KL, entropy and value terms; empty = token_mean, except that with "
                             "--policy_loss_type gspo the policy term is seq_mean_token_mean (OpenRLHF's GSPO)")
    entropy_loss_coef: float = opt(0.0, "entropy bonus coefficient")
    dynamic_filtering: bool = opt(False, "DAPO dynamic sampling: drop prompts whose samples all get the same reward, and refill")
    dynamic_filtering_reward_range: list[float] = opt(
        [0.0, 1.0], "with --dynamic_filtering keep a prompt when LOW < mean reward < HIGH")
    dynamic_filtering_max_rounds: int = opt(8, "with --dynamic_filtering, extra generation rounds per step before training on fewer prompts")
    overlong_buffer_len: int = opt(0, "DAPO overlong penalty: responses longer than generate_max_len - N are penalised; 0 = off")
    overlong_penalty_factor: float = opt(1.0, "penalty at generate_max_len with --overlong_buffer_len")
    stop_properly_penalty_coef: float | None = opt(
        None, "ProRL's penalty for responses that did not stop (cut at --generate_max_len): in [0, 1] their reward "
        "is multiplied by it, below 0 it replaces their reward; unset = off")

    # ---- sampling -----------------------------------------------------------------------------
    temperature: float = opt(1.0, "sampling temperature")
    top_p: float = opt(1.0, "nucleus sampling")
    top_k: int = opt(-1, "top-k sampling; -1 = off")

    # ---- asynchronous training and agents (services/coordinator/loop/async_loop.py, agent.py) -------
    async_train: bool = opt(False, "generate the next step(s) while the learner trains the current one; "
                            "a sample may lag the trained policy by up to --max_staleness weight versions")
    max_staleness: int = opt(1, "with --async_train: how many weight versions a sample's oldest token may lag "
                             "the policy it is trained on (0 = on-policy, as without --async_train)")
    staleness_policy: str = opt("wait", "with --async_train, samples past --max_staleness: wait = generation of a "
                                "step starts only once the weights are recent enough, so none is ever past the "
                                "bound; drop = generation never waits and groups with a sample past the bound are "
                                "dropped (counted in async/dropped_stale_samples)", choices=["wait", "drop"])
    partial_rollout: bool = opt(False, "with --async_train: a weight push does not wait for running generations; "
                                "they pause, take the new weights and continue, so a sample's tokens may carry two "
                                "or more versions (its oldest token's counts for --max_staleness); needs vLLM engines")
    use_tis: bool = opt(False, "importance-sampling correction: weight each token's policy loss by "
                        "w = exp(old_logprob - rollout_logprob) within the band [--tis_low, --tis_cap] as --tis_type "
                        "says, the rollout engine's own log-probs being the behaviour policy (corrects for "
                        "--async_train lag and engine/learner mismatch); with GSPO the sequence ratio is taken from "
                        "the engine's log-probs instead")
    tis_cap: float = opt(2.0, "with --use_tis: the upper bound of the band (veRL's tis_imp_ratio_cap)")
    tis_low: float = opt(0.0, "with --use_tis: the lower bound of the band, in [0, 1]; 0 = a cap from above only "
                         "(veRL's truncated IS; OpenRLHF's default band is 0.5 5)")
    tis_type: str = opt("tis", "with --use_tis: tis = w clamped into the band; icepop = w inside the band, 0 "
                        "outside; seq-mask-tis = whole sequences dropped when their geometric-mean w is outside "
                        "the band, the others' tokens weighted by w (OpenRLHF's is_correction_type)",
                        choices=list(IS_CORRECTION_TYPES))
    agent_func_path: str = opt("", "Python file with OpenRLHF's agent API (class AgentExecutor / AgentInstance "
                               "with async reset and step): multi-turn episodes; empty = single-turn samples")
    agent_max_turns: int = opt(8, "with --agent_func_path: model turns per episode at most")
    agent_max_length: int = opt(0, "with --agent_func_path: tokens per episode at most (prompt, model and "
                                "environment tokens); 0 = --prompt_max_len + --generate_max_len")
    agent_timeout_s: float = opt(120.0, "with --agent_func_path: an episode's agent code (reset and step calls) "
                                 "running longer than this fails that episode; its worker is replaced")
    agent_num_workers: int = opt(8, "with --agent_func_path: worker processes running agent code, one episode "
                                 "each at a time")
    agent_rewards: str = opt("agent", "with --agent_func_path: where an episode's reward comes from: the sum of "
                             "the agent's step rewards, or the reward service scoring the whole episode",
                             choices=["agent", "reward_service"])

    # ---- data ---------------------------------------------------------------------------------
    prompt_data: str = opt("", "prompt data: JSONL / Parquet / Arrow files or save_to_disk folders, comma separated")
    prompt_data_probs: str = opt("", "blending probabilities of --prompt_data, comma separated; empty = equal")
    input_key: str = opt("input", "field of the prompt text")
    label_key: str = opt("", "field of the reference answer, passed to the reward (e.g. answer)")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    input_template: str = opt("", "format string with {} for the prompt, e.g. 'Question: {}\\nAnswer:'")

    # ---- evaluation during training (the computation of `rlmesh eval`) ----------------------------
    eval_dataset: str = opt("", "held-out labelled prompts (JSONL / Parquet / Arrow files or save_to_disk folders, "
                            "comma separated; same --input_key / --label_key as the training data), evaluated on "
                            "the rollout engines' current weights; empty = no evaluation")
    eval_steps: int = opt(-1, "with --eval_dataset: evaluate before the first step, every N global steps and at "
                          "the end (a large N: only first and last); <= 0 = no evaluation")
    eval_max_samples: int = opt(1_000_000_000, "evaluate at most this many prompts (the first ones of --eval_dataset)")
    eval_n_samples_per_prompt: int = opt(1, "samples per evaluation prompt: eval/pass@1 is their mean, "
                                         "eval/pass@N is reported when N > 1")
    eval_temperature: float = opt(0.0, "sampling temperature of the evaluation; 0 = greedy")
    eval_pass_reward: float = opt(1.0, "an evaluation sample counts as solved at this reward or more, unless the "
                                  "reward source reports its own verdict (the math rule's accuracy)")

    # ---- logging ------------------------------------------------------------------------------
    use_wandb: str = opt("", "Weights & Biases: an API key, 'offline', or 'True' (use the saved login); empty = off")
    wandb_org: str = opt("", "W&B entity")
    wandb_project: str = opt("rlmesh", "W&B project")
    wandb_group: str = opt("", "W&B group")
    wandb_run_name: str = opt("", "run name for W&B and the run folder; empty = <estimator>_<time>")
    use_tensorboard: str = opt("", "TensorBoard log folder; empty = off")
    seed: int = opt(42, "seed of the data order and the sampling")

    # ---- rlmesh: where the services are --------------------------------------------------------
    placement: str = opt("auto", "how the services are found: local subprocesses, Ray actors, or fixed "
                         "addresses; auto = ray inside a Ray job, static when addresses are given, else local",
                         choices=list(PLACEMENTS))
    rollout_engine: str = opt("vllm", "rollout engine of the services this run starts", choices=["vllm", "hf"])
    device: str = opt("auto", "device of the services this run starts; auto = cuda when available",
                      choices=["auto", "cpu", "cuda"])
    rollout_addresses: list[str] = opt([], "static: host:port of each rollout service (env RLMESH_ROLLOUT_ADDRESSES)")
    reward_addresses: list[str] = opt([], "static: host:port of each reward service (env RLMESH_REWARD_ADDRESSES)")
    ref_addresses: list[str] = opt([], "static: host:port of each reference service (env RLMESH_REF_ADDRESSES)")
    learner_address: str = opt("", "static: host:port of the learner's rank 0 (env RLMESH_LEARNER_ADDRESS)")
    weight_sync_master: str = opt("", "host:port the learner's rank 0 opens for weight transfer (the rollout "
                                  "engines connect to it); empty = a free port on the learner's host when this "
                                  "run starts the learner or shares its host, else (static placement) the host "
                                  "of --learner_address and port 29600")
    service_start_timeout_s: float = opt(900.0, "how long to wait for a service to report SERVING")
    rollout_extra_args: str = opt("", "extra command-line options for every rollout service, e.g. '--max_model_len 2048'")
    reward_extra_args: str = opt("", "extra command-line options for every reward / reference service")
    learner_extra_args: str = opt("", "extra command-line options for the learner")
    ray_address: str = opt("", "ray: cluster address (given, it means --placement ray); empty = RAY_ADDRESS, else a "
                           "local Ray instance")
    ray_num_cpus: int = opt(0, "ray: CPUs of the local Ray instance this run starts; 0 = all")
    ray_cpus_per_service: float = opt(0.1, "ray: CPUs reserved for each service actor (GPU counts come from the *_num_gpus_per_node flags)")
    ray_placement_timeout_s: float = opt(180.0, "ray: how long the cluster may take to find room for the job's "
                                         "placement groups, and for a bundle whose node was lost; past it the "
                                         "run stops with an error naming the role, what it asks and what the "
                                         "cluster has")
    run_dir: str = opt("", "folder of metrics.jsonl, service logs and plots; empty = runs/<run name>")
    dry_run: bool = opt(False, "check the flags, model folders, data and reward source, print the plan (each service, "
                        "its GPUs, a memory estimate) and exit; nothing is started")
    plots: bool = opt(True, "draw the run's curves into run_dir/plots/ when it ends (`rlmesh plot RUN_DIR` "
                      "draws them at any time)")
    progress_bar: bool = opt(True, "show a progress bar per step when stderr is a terminal")
    log_samples: int = opt(8, "generated samples of each step written to run_dir/samples/step_NNNNNN.jsonl (prompt, "
                           "response, reward, label, difficulty, truncated, weight version; one per prompt first, "
                           "then second ones); `rlmesh samples RUN_DIR` shows them; 0 writes none",
                           check=lambda value: "" if value >= 0 else "must be >= 0 (0 writes no samples)")
    rpc_timeout_s: float = opt(1800.0, "deadline of the long calls (Generate, TrainActor, PushWeights)")
    scoring_retries: int = opt(4, "times a reward / reference call is sent again after its instance died "
                               "(connection refused or reset), to another instance or the restarted one")
    scoring_wait_s: float = opt(300.0, "how long a reward / reference call waits in all for a serving instance "
                                "when every instance is down (e.g. restarting), seconds; past it the step fails")
    # Supervision (services/coordinator/fleet/supervisor.py): restarts of services that die during the run.
    max_restarts: int = opt(3, "restarts allowed per service instance (rollout-0, learner, ...) before the run "
                            "stops with that service's exit code and log; 0 = never restart")
    restart_backoff_s: float = opt(1.0, "wait before a service's first restart; doubled for each further "
                                   "restart of the same instance before it served a finished step again "
                                   "(a crash loop), at most 60 s")
    health_poll_s: float = opt(0.5, "how often the supervisor checks that every service is alive")
    elastic: bool = opt(False, "ray: when a node is lost and no node takes its services within --elastic_wait_s, "
                        "the run goes on with what is left instead of stopping: a lost rollout engine (or reward / "
                        "reference instance) is left out while another of its role serves, its prompts going to the "
                        "others; lost learner ranks re-form the learner on the ranks left (from the newest "
                        "checkpoint, the same global batch); a node that joins brings them back at a step boundary")
    elastic_wait_s: float = opt(30.0, "with --elastic: how long a lost node's services wait for another node to take "
                                "their place before the run goes on without them, seconds")

    # The coordinator's own gRPC API (GetStatus, StreamMetrics, Pause, Resume, Stop) and metrics.
    host: str = opt("127.0.0.1", "address the coordinator's control API binds to")
    metrics_port: int = opt(0, "Prometheus port of the training metrics; 0 picks a free port, -1 disables")
    metrics_final_scrape_timeout_s: float = opt(
        60.0, "at the end of a run whose metrics were being scraped, keep serving them until one more scrape "
        "has taken the last step's values, at most this many seconds; 0 = exit at once")

    # ---- derived in validate() ----------------------------------------------------------------
    on_gpu: bool = opt(False, "services run on GPUs", derived=True)
    critic_needed: bool = opt(False, "the estimator needs a critic (gae)", derived=True)
    ref_needed: bool = opt(False, "a reference model is needed (init_kl_coef > 0)", derived=True)
    reward_model_needed: bool = opt(False, "rewards come from a reward model service role", derived=True)
    reward_service_needed: bool = opt(True, "a reward service scores the samples (not when an agent's own rewards "
                                      "are the rewards)", derived=True)

    # OpenRLHF 0.11's namespaced options are taken too (services/common/openrlhf_names.py).
    OPENRLHF_NAMESPACED: ClassVar[bool] = True
    # ------------------------------------------------------------------------------------------

    def loss_levels(self) -> tuple[str, str]:
        """(level of the KL / entropy / value terms, level of the policy term) for the learner."""
        level = LOSS_AGG_MODES[self.loss_agg_mode]
        if not self.loss_agg_mode and self.policy_loss_type == "gspo":
            # OpenRLHF's GSPO: the GSPO paper's per-sequence objective, KL and entropy per token.
            return level, "sequence"
        return level, level

    def actor_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def engines_per_gpu(self) -> int:
        """Rollout engines sharing each GPU: several when colocated with more engine GPUs than actor GPUs."""
        if not self.colocate_all_models or self.actor_gpus() < 1:
            return 1
        return max(1, self.vllm_num_engines * self.vllm_tensor_parallel_size // self.actor_gpus())

    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    def validate(self) -> None:
        self.validate_server()
        check_fields(self)
        self._resolve_paths()
        self._resolve_placement()
        self._check_models()
        self._apply_deepspeed_file()
        self._async_colocation()
        self._check_placement_counts()
        self._check_batches()
        self._check_objective()
        self._check_values()
        self._check_eval()
        self._check_async_and_agent()
        self._check_elastic()
        self._check_gpu_only_flags()

    def _resolve_paths(self) -> None:
        """Every path flag absolute against the user's working directory (services.common.paths):
        the services this run starts have working directories of their own."""
        if not self.run_dir:
            name = self.wandb_run_name or os.path.basename(os.path.normpath(self.ckpt_path)) or "run"
            self.run_dir = os.path.join("runs", name)
        resolve_path_fields(self, inputs=("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain",
                                          "prompt_data", "eval_dataset", "deepspeed"),
                            outputs=("save_path", "ckpt_path", "run_dir", "use_tensorboard"))
        # Reward function files (entries without a scheme); URLs stay as they are.
        self.remote_rm_url = absolute_paths(self.remote_rm_url, "remote_rm_url")

    def _resolve_placement(self) -> None:
        env_lists = {"rollout_addresses": "RLMESH_ROLLOUT_ADDRESSES", "reward_addresses": "RLMESH_REWARD_ADDRESSES",
                     "ref_addresses": "RLMESH_REF_ADDRESSES"}
        for name, env in env_lists.items():
            if not getattr(self, name) and os.environ.get(env):
                setattr(self, name, [a.strip() for a in os.environ[env].split(",") if a.strip()])
        if not self.learner_address:
            self.learner_address = os.environ.get("RLMESH_LEARNER_ADDRESS", "")
        given = bool(self.rollout_addresses or self.learner_address or self.reward_addresses or self.ref_addresses)
        if self.placement == "auto":
            if given:
                self.placement = "static"
            elif self.ray_address or os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
                self.placement = "ray"
            else:
                self.placement = "local"
        if self.placement == "static":
            if not self.rollout_addresses:
                raise ConfigError("--placement static needs --rollout_addresses HOST:PORT ... "
                                  "(or env RLMESH_ROLLOUT_ADDRESSES)")
            if not self.learner_address:
                raise ConfigError("--placement static needs --learner_address HOST:PORT (or env RLMESH_LEARNER_ADDRESS)")
        elif given:
            raise ConfigError(f"service addresses were given but --placement is {self.placement}; "
                              "use --placement static (or drop the addresses to let the coordinator start the services)")
        if self.device == "auto":
            if self.placement == "local":
                import torch
                self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.on_gpu = self.device == "cuda"

    def _check_models(self) -> None:
        if not self.pretrain and self.placement != "static":
            raise ConfigError("--pretrain is required: a local folder with the policy model "
                              "(e.g. build one with `rlmesh make-tiny-model runs/tiny`)")
        if not self.prompt_data:
            raise ConfigError("--prompt_data is required: JSONL / Parquet / Arrow file(s) or save_to_disk folder(s)")
        if self.placement == "local":
            for name in ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain"):
                path = getattr(self, name)
                if path and not pathlib.Path(path).is_dir():
                    raise ConfigError(f"--{name} {path}: no such folder; rlmesh does not download models, "
                                      "give a local folder in Hugging Face format")
        self._check_reward_sources()
        rules = [r.strip() for r in self.reward_func.split(",") if r.strip()]
        if any(r not in flags.REWARD_RULES for r in rules):
            raise ConfigError(f"--reward_func {self.reward_func}: use {', '.join(flags.REWARD_RULES)} "
                              "(several comma separated add up)")
        if any(r in flags.LABELLED_REWARD_RULES for r in rules) and not self.label_key:
            raise ConfigError(f"--reward_func {self.reward_func} compares answers with labels; "
                              "set --label_key to the data field holding the answer")
        self.reward_model_needed = bool(self.reward_pretrain) and self.reward_service_needed
        model_config = pathlib.Path(self.reward_pretrain) / "config.json"
        # Readable here for local runs and usually for Ray (shared storage); else the service decides.
        if self.normalize_reward and self.reward_pretrain and self.placement != "static" and model_config.is_file():
            stats = json.loads(model_config.read_text())
            if "mean" not in stats or "std" not in stats:
                # OpenRLHF reads mean 0 / std 1 then, i.e. no normalisation; say so instead of failing.
                warnings.warn(f"--normalize_reward: {model_config} stores no reward 'mean' / 'std', so there is "
                              "nothing to normalise with; rewards are used as the model gives them", stacklevel=2)
                self.normalize_reward = False
        self.critic_needed = ADVANTAGE_ESTIMATORS[self.advantage_estimator].critic
        self.ref_needed = self.init_kl_coef > 0
        if len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]:
            raise ConfigError(f"--reward_clip_range {self.reward_clip_range}: give LOW HIGH with LOW <= HIGH")

    def _check_reward_sources(self) -> None:
        """One reward source, or none when an agent's own rewards are the rewards: in OpenRLHF the agent
        function returns them (--agent_rewards agent), so no reward service is started."""
        sources = [n for n in ("reward_pretrain", "remote_rm_url", "reward_func") if getattr(self, n)]
        agent_scores = bool(self.agent_func_path) and self.agent_rewards == "agent"
        self.reward_service_needed = not agent_scores
        if agent_scores:
            if sources:
                warnings.warn(f"--{sources[0]} is not used: with --agent_func_path the agent's step rewards are the "
                              "rewards (--agent_rewards agent, as in OpenRLHF); give --agent_rewards reward_service "
                              "to score whole episodes with it instead", stacklevel=3)
            return
        self._check_reward_file()
        if self.placement == "static" and self.reward_addresses:
            return
        if len(sources) != 1:
            why = " (--agent_rewards reward_service scores the agent's episodes with it)" if self.agent_func_path else ""
            raise ConfigError("give exactly one reward source: --reward_pretrain DIR, --remote_rm_url URL|file.py, "
                              "--reward_func math|exact_match|format, or --agent_func_path FILE.py whose agent returns "
                              f"the rewards{why} (got {sources or 'none'})")

    def _apply_deepspeed_file(self) -> None:
        """--deepspeed FILE decides the ZeRO stage, bf16, offload and clipping the learner gets."""
        if not self.deepspeed:
            return
        ds_file = read_deepspeed_file(self.deepspeed)
        apply_flags(self, ds_file)
        ranks = max(1, self.actor_gpus())
        accumulation = self.train_batch_size // max(1, self.micro_train_batch_size * ranks)
        check_batches(ds_file, self.train_batch_size, self.micro_train_batch_size, accumulation)

    def _check_reward_file(self) -> None:
        """A reward function file (--remote_rm_url FILE.py[:NAME]) exists where this run starts the services,
        and what it imports of OpenRLHF is provided (services/common/openrlhf_compat.py)."""
        entry = self.remote_rm_url.strip()
        head, sep, name = entry.rpartition(":")
        file = head if sep and head.endswith(".py") and name.isidentifier() else entry
        if "," in entry or not file.endswith(".py") or self.placement == "static":
            return
        if pathlib.Path(file).is_file():
            check_imports(file, "--remote_rm_url")
        elif self.placement == "local":
            raise ConfigError(f"--remote_rm_url {file}: no such reward function file")

    def _async_colocation(self) -> None:
        """As OpenRLHF: with --async_train the engines need GPUs of their own to generate while the learner
        trains, so --colocate_all_models colocates only the DeepSpeed-side models."""
        if self.async_train and self.colocate_all_models:
            warnings.warn("--colocate_all_models with --async_train colocates only the reference with the actor and "
                          "the reward model with the critic (--colocate_actor_ref --colocate_critic_reward): the "
                          "rollout engines get GPUs of their own, as in OpenRLHF", stacklevel=3)
            self.colocate_all_models, self.colocate_actor_ref, self.colocate_critic_reward = False, True, True

    def _check_placement_counts(self) -> None:
        for role in ("actor", "critic", "reward", "ref"):
            nodes, gpus = getattr(self, f"{role}_num_nodes"), getattr(self, f"{role}_num_gpus_per_node")
            if nodes < 0 or gpus < 0:
                raise ConfigError(f"--{role}_num_nodes / --{role}_num_gpus_per_node must be >= 0")
        if self.actor_gpus() < 1:
            raise ConfigError("the actor needs at least one GPU (or process on CPU): "
                              "set --actor_num_nodes >= 1 and --actor_num_gpus_per_node >= 1")
        if not self.ray_placement_timeout_s > 0:
            raise ConfigError(f"--ray_placement_timeout_s {self.ray_placement_timeout_s} must be > 0 (seconds the Ray "
                              "cluster may take to find room for the job, e.g. 180)")
        if self.vllm_num_engines < 1 or self.vllm_tensor_parallel_size < 1:
            raise ConfigError("--vllm_num_engines and --vllm_tensor_parallel_size must be >= 1")
        if self.placement == "static":
            return
        engine_gpus = self.vllm_num_engines * self.vllm_tensor_parallel_size
        if self.colocate_all_models and (engine_gpus < self.actor_gpus() or engine_gpus % self.actor_gpus()
                                         or self.actor_gpus() % self.vllm_tensor_parallel_size):
            raise ConfigError(
                f"--colocate_all_models puts vLLM on the actor's GPUs, so actor GPUs "
                f"({self.actor_num_nodes} x {self.actor_num_gpus_per_node} = {self.actor_gpus()}) must equal "
                f"--vllm_num_engines x --vllm_tensor_parallel_size ({self.vllm_num_engines} x "
                f"{self.vllm_tensor_parallel_size} = {engine_gpus}), or divide it for several engines per GPU "
                "(each engine on GPUs of its own set); change one side")
        if self.colocate_actor_ref and not self.colocate_all_models and self.ref_needed:
            if self.ref_num_nodes and (self.ref_num_nodes, self.ref_num_gpus_per_node) != (
                    self.actor_num_nodes, self.actor_num_gpus_per_node):
                raise ConfigError("--colocate_actor_ref places the reference on the actor's GPUs: set --ref_num_nodes / "
                                  "--ref_num_gpus_per_node equal to the actor's (or to 0)")
        if self.colocate_critic_reward and not self.colocate_all_models and self.reward_model_needed:
            if self.reward_num_nodes and (self.reward_num_nodes, self.reward_num_gpus_per_node) != (
                    self.critic_num_nodes, self.critic_num_gpus_per_node):
                raise ConfigError("--colocate_critic_reward places the reward model on the critic's GPUs: set "
                                  "--reward_num_nodes / --reward_num_gpus_per_node equal to the critic's (or to 0)")
        if self.ref_needed and not (self.colocate_all_models or self.colocate_actor_ref) and \
                self.ref_num_nodes * self.ref_num_gpus_per_node < 1:
            raise ConfigError("--init_kl_coef > 0 needs the reference model: set --ref_num_nodes and "
                              "--ref_num_gpus_per_node >= 1 (or --colocate_actor_ref), or --init_kl_coef 0")
        if self.reward_model_needed and not (self.colocate_all_models or self.colocate_critic_reward) and \
                self.reward_num_nodes * self.reward_num_gpus_per_node < 1:
            raise ConfigError("--reward_pretrain needs the reward model placed: set --reward_num_nodes and "
                              "--reward_num_gpus_per_node >= 1 (or --colocate_critic_reward)")

    def _check_batches(self) -> None:
        for name in ("micro_train_batch_size", "train_batch_size", "micro_rollout_batch_size", "rollout_batch_size",
                     "n_samples_per_prompt", "max_epochs", "num_episodes", "prompt_max_len", "generate_max_len",
                     "logging_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.max_restarts < 0 or self.restart_backoff_s < 0 or self.health_poll_s <= 0:
            raise ConfigError(f"--max_restarts {self.max_restarts} and --restart_backoff_s {self.restart_backoff_s} "
                              f"must be >= 0 and --health_poll_s {self.health_poll_s} > 0")
        samples = self.samples_per_step()
        if samples % self.train_batch_size:
            raise ConfigError(
                f"--train_batch_size {self.train_batch_size} must divide the samples of one step: "
                f"--rollout_batch_size x --n_samples_per_prompt = {self.rollout_batch_size} x "
                f"{self.n_samples_per_prompt} = {samples}; e.g. use --train_batch_size "
                f"{max(d for d in range(1, samples + 1) if samples % d == 0 and d <= self.train_batch_size)}")
        ranks = self.actor_gpus()
        if self.train_batch_size % (self.micro_train_batch_size * ranks):
            raise ConfigError(
                f"--train_batch_size {self.train_batch_size} must be a multiple of --micro_train_batch_size x actor "
                f"ranks = {self.micro_train_batch_size} x {ranks}; change either")
        if self.use_dynamic_batch and not self.packing_samples:
            raise ConfigError("--use_dynamic_batch sizes micro-batches by their tokens, which needs --packing_samples "
                              "(samples end to end, no padding): add --packing_samples, or drop --use_dynamic_batch")
        if self.scoring_retries < 0 or not self.scoring_wait_s > 0:
            raise ConfigError(f"--scoring_retries {self.scoring_retries} must be >= 0 and --scoring_wait_s "
                              f"{self.scoring_wait_s} > 0")
        if self.max_steps < 0:
            raise ConfigError("--max_steps must be >= 0 (0 = run all episodes)")
        if self.save_steps == 0:
            raise ConfigError("--save_steps 0: use -1 to save only at the end, or N >= 1")
        if self.load_checkpoint and not self.ckpt_path:
            raise ConfigError("--load_checkpoint needs --ckpt_path (the same folder the run saved to)")
        if self.use_ds_universal_ckpt and self.zero_stage == 0:
            raise ConfigError("--use_ds_universal_ckpt converts between ZeRO stages 1, 2 and 3; with --zero_stage 0 "
                              "a checkpoint resumes on any number of GPUs without it: drop the flag, or pick a stage")
        if self.prompt_data_probs:
            probs = [float(p) for p in self.prompt_data_probs.split(",")]
            if len(probs) != len(self.prompt_data.split(",")):
                raise ConfigError(f"--prompt_data_probs has {len(probs)} values for "
                                  f"{len(self.prompt_data.split(','))} --prompt_data entries; give one per entry")

    def _check_objective(self) -> None:
        if self.advantage_estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            raise ConfigError(f"--advantage_estimator {self.advantage_estimator} compares the samples of one prompt: "
                              "set --n_samples_per_prompt >= 2 (e.g. 8)")
        if self.dynamic_filtering:
            if self.n_samples_per_prompt < 2:
                raise ConfigError("--dynamic_filtering drops prompts whose samples all score the same: "
                                  "set --n_samples_per_prompt >= 2")
            low_high = self.dynamic_filtering_reward_range
            if len(low_high) != 2 or low_high[0] >= low_high[1]:
                raise ConfigError(f"--dynamic_filtering_reward_range {low_high}: give LOW HIGH with LOW < HIGH")
        if self.eps_clip_low_high and len(self.eps_clip_low_high) != 2:
            raise ConfigError("--eps_clip_low_high takes two numbers: LOW HIGH (e.g. 0.2 0.28)")
        self.loss_agg_mode = self.loss_agg_mode.replace("-", "_")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ConfigError(f"--loss_agg_mode {self.loss_agg_mode}: use one of {', '.join(m for m in LOSS_AGG_MODES if m)}")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"--dual_clip {self.dual_clip} must be > 1 (or 0 to disable)")
        if self.overlong_buffer_len < 0 or self.overlong_buffer_len >= self.generate_max_len:
            raise ConfigError(f"--overlong_buffer_len {self.overlong_buffer_len} must be in [0, --generate_max_len)")
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p {self.top_p} must be in (0, 1]")
        if self.use_kl_loss and self.init_kl_coef <= 0:
            warnings.warn("--use_kl_loss has no effect with --init_kl_coef 0; set e.g. --init_kl_coef 0.001", stacklevel=2)
        if self.critic_needed and self.critic_num_nodes * self.critic_num_gpus_per_node not in (
                0, self.actor_gpus()) and not self.colocate_all_models:
            warnings.warn("the learner trains the critic on the actor's ranks; --critic_num_nodes / "
                          "--critic_num_gpus_per_node only need to be >= 1", stacklevel=2)
        if not self.critic_needed and (self.critic_pretrain or self.save_value_network):
            warnings.warn(f"--advantage_estimator {self.advantage_estimator} trains no critic; "
                          "--critic_pretrain / --save_value_network are ignored", stacklevel=2)

    def _check_token_budgets(self) -> None:
        """--rollout_max_tokens_per_gpu bounds the packed forward passes that --use_dynamic_batch sizes by tokens."""
        if self.rollout_max_tokens_per_gpu is None:
            return
        if self.rollout_max_tokens_per_gpu < 1:
            raise ConfigError(f"--rollout_max_tokens_per_gpu {self.rollout_max_tokens_per_gpu} must be >= 1 (tokens "
                              "in one forward micro-batch of a learner rank; unset = --train_max_tokens_per_gpu)")
        if not self.use_dynamic_batch:
            warnings.warn(f"--rollout_max_tokens_per_gpu {self.rollout_max_tokens_per_gpu} has no effect without "
                          "--use_dynamic_batch (as in OpenRLHF): forward passes hold --micro_rollout_batch_size "
                          "samples each", stacklevel=3)

    def _check_values(self) -> None:
        """Numbers that make no sense fail here, before any service starts (never reinterpreted)."""
        for name in ("init_kl_coef", "eps_clip", "value_clip", "entropy_loss_coef", "kl_target"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 0")
        if any(e < 0 for e in self.eps_clip_low_high):
            raise ConfigError(f"--eps_clip_low_high {self.eps_clip_low_high}: both clip ranges must be >= 0")
        for name in ("gamma", "lambd"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be in [0, 1]")
        if self.max_norm < 0:
            raise ConfigError(f"--max_norm {self.max_norm} must be >= 0 (0 disables clipping)")
        if not 0 <= self.lr_warmup_ratio < 1:
            raise ConfigError(f"--lr_warmup_ratio {self.lr_warmup_ratio} must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio {self.min_lr_ratio} must be in [0, 1]")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"--lr_warmup_steps {self.lr_warmup_steps} must be >= 0 (0: --lr_warmup_ratio applies)")
        # The actor's adapter, checked against --pretrain before any service starts (the critic trains in full).
        check_lora(self.lora_rank, self.lora_alpha, self.target_modules, self.lora_dropout,
                   self.pretrain if self.pretrain and pathlib.Path(self.pretrain, "config.json").is_file() else "")
        if self.lora_merge_on_save and not self.lora_rank:
            raise ConfigError("--lora_merge_on_save merges a LoRA adapter into the saved model, but --lora_rank is 0; "
                              "give --lora_rank N, or drop --lora_merge_on_save")
        check_aux_loss_coef(self.aux_loss_coef, self.pretrain if self.pretrain and
                            pathlib.Path(self.pretrain, "config.json").is_file() else "")
        self._check_token_budgets()
        if self.stop_properly_penalty_coef is not None and self.stop_properly_penalty_coef > 1:
            raise ConfigError(f"--stop_properly_penalty_coef {self.stop_properly_penalty_coef} must be in [0, 1] (the "
                              "factor on a truncated response's reward) or negative (the reward it gets instead)")
        if self.lora_rank and self.vllm_quantization:
            raise ConfigError(f"--lora_rank {self.lora_rank} with --vllm_quantization {self.vllm_quantization}: the "
                              "engines merge each pushed adapter into their weights, which a quantized engine cannot "
                              "take; drop one of the two")
        model_config = pathlib.Path(self.pretrain) / "config.json" if self.pretrain else None
        if model_config is not None and model_config.is_file():
            context = json.loads(model_config.read_text()).get("max_position_embeddings")
            if isinstance(context, int) and self.generate_max_len > context:
                raise ConfigError(f"--generate_max_len {self.generate_max_len} is beyond the model's context: "
                                  f"{model_config} says max_position_embeddings {context}; use at most {context} "
                                  "(minus the prompt's length)")
        if self.normalize_reward and (self.remote_rm_url or self.reward_func):
            # OpenRLHF's meaning: a reward model's scores with the mean / std stored in its config.
            warnings.warn("--normalize_reward normalises a reward model's scores with the mean / std stored in its "
                          "config.json; rewards from --remote_rm_url or --reward_func are used as they come (as in "
                          "OpenRLHF), so it has no effect here; normalise in your reward server, or compare "
                          "samples of a prompt with --advantage_estimator group_norm", stacklevel=2)

    def eval_enabled(self) -> bool:
        return bool(self.eval_dataset) and self.eval_steps > 0

    def _check_elastic(self) -> None:
        if not self.elastic:
            return
        if self.placement != "ray":
            raise ConfigError(f"--elastic re-plans the services of a lost Ray node; this run's placement is "
                              f"{self.placement}: run it on a Ray cluster (--placement ray, --ray_address, or `ray job "
                              "submit`), or drop --elastic")
        if self.async_train:
            raise ConfigError("--elastic re-forms the learner between two steps, which --async_train does not have "
                              "(the next step generates while this one trains): drop one of them")
        if not self.elastic_wait_s > 0:
            raise ConfigError(f"--elastic_wait_s {self.elastic_wait_s} must be > 0 (seconds a lost node's services "
                              "wait for another node, e.g. 30)")

    def _check_async_and_agent(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"--max_staleness {self.max_staleness} must be >= 0 (0 = on-policy)")
        if self.async_train and self.vllm_enable_sleep:
            raise ConfigError("--async_train generates while the learner trains, so the engines never sleep: drop "
                              "--vllm_enable_sleep (OpenRLHF refuses it too)")
        if self.partial_rollout and not self.async_train:
            raise ConfigError("--partial_rollout lets a weight push land in the middle of a generation, which only "
                              "overlaps pushes with --async_train; add --async_train, or drop --partial_rollout")
        if self.partial_rollout and self.rollout_engine == "hf" and self.placement != "static":
            raise ConfigError("--partial_rollout pauses running generations for a push, which --rollout_engine hf "
                              "cannot do (it decodes each batch to its end); use --rollout_engine vllm, or drop "
                              "--partial_rollout")
        if self.use_tis and not self.tis_cap >= 1:
            raise ConfigError(f"--tis_cap {self.tis_cap} must be >= 1 (e.g. 2.0)")
        if self.use_tis and not 0 <= self.tis_low <= 1:
            raise ConfigError(f"--tis_low {self.tis_low} must be in [0, 1] (e.g. 0.5; 0 = a cap from above only)")
        if not self.agent_func_path:
            return
        path = pathlib.Path(self.agent_func_path)
        if path.suffix != ".py" or not path.is_file():
            raise ConfigError(f"--agent_func_path {self.agent_func_path}: no such Python file; give a .py file "
                              "defining AgentExecutor (or AgentInstance) as OpenRLHF's agent_func.py does")
        check_imports(self.agent_func_path, "--agent_func_path", agent=True)
        for name in ("agent_max_turns", "agent_num_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        if not self.agent_timeout_s > 0:
            raise ConfigError(f"--agent_timeout_s {self.agent_timeout_s} must be > 0")
        if self.agent_max_length < 0:
            raise ConfigError(f"--agent_max_length {self.agent_max_length} must be >= 0 (0 = prompt + generate lengths)")
        context = self.prompt_max_len + self.generate_max_len  # the rollout services' max_model_len
        if self.placement != "static" and self.agent_max_length > context:
            raise ConfigError(f"--agent_max_length {self.agent_max_length} is beyond the {context} tokens the rollout "
                              f"services this run starts hold (--prompt_max_len + --generate_max_len); raise "
                              "--prompt_max_len (the episode so far is the prompt of each turn)")

    def _check_eval(self) -> None:
        if self.eval_dataset and self.eval_steps <= 0:
            warnings.warn(f"--eval_dataset is given but --eval_steps is {self.eval_steps}: no evaluation; set "
                          "--eval_steps N to evaluate every N steps (plus before the first and after the last)",
                          stacklevel=2)
        if self.eval_steps > 0 and not self.eval_dataset:
            warnings.warn(f"--eval_steps {self.eval_steps} without --eval_dataset: no evaluation; give "
                          "--eval_dataset FILE with held-out labelled prompts", stacklevel=2)
        if not self.eval_enabled():
            return
        # The coordinator reads the evaluation prompts itself, wherever the services run.
        for path in (p.strip() for p in self.eval_dataset.split(",")):
            if path and not pathlib.Path(path).exists():
                raise ConfigError(f"--eval_dataset {path}: no such file or folder; give a local JSONL / Parquet / "
                                  "Arrow file or save_to_disk folder (rlmesh does not download data)")
        if self.eval_max_samples < 1:
            raise ConfigError(f"--eval_max_samples {self.eval_max_samples} must be >= 1")
        if self.eval_n_samples_per_prompt < 1:
            raise ConfigError(f"--eval_n_samples_per_prompt {self.eval_n_samples_per_prompt} must be >= 1")
        if self.eval_temperature < 0:
            raise ConfigError(f"--eval_temperature {self.eval_temperature} must be >= 0 (0 = greedy)")
        if self.eval_n_samples_per_prompt > 1 and self.eval_temperature == 0:
            raise ConfigError(f"--eval_n_samples_per_prompt {self.eval_n_samples_per_prompt} with --eval_temperature "
                              "0 gives identical samples; set --eval_temperature (e.g. 0.6) or use one sample")

    def _check_gpu_only_flags(self) -> None:
        if self.device != "auto":
            self.resolve_device(self.device == "cuda")

    def resolve_device(self, on_gpu: bool) -> None:
        """Fixes the device once it is known (local: at validation; ray: from the cluster's resources).

        On CPU the GPU-only flags would fail or do nothing: each gives a warning and is turned off.
        """
        self.device = "cuda" if on_gpu else "cpu"
        self.on_gpu = on_gpu
        if on_gpu:
            per_gpu = self.engines_per_gpu()
            if self.vllm_gpu_memory_utilization == 0:
                self.vllm_gpu_memory_utilization = (0.5 if self.colocate_all_models else 0.9) / per_gpu
            elif per_gpu > 1 and per_gpu * self.vllm_gpu_memory_utilization > 0.95:
                raise ConfigError(
                    f"--vllm_gpu_memory_utilization {self.vllm_gpu_memory_utilization} is per engine, and "
                    f"{per_gpu} engines share each GPU (--vllm_num_engines {self.vllm_num_engines} on "
                    f"{self.actor_gpus()} actor GPUs): together {per_gpu * self.vllm_gpu_memory_utilization:g} of "
                    f"its memory; give at most {0.95 / per_gpu:.2f} (or 0 for {0.5 / per_gpu:g})")
            return
        if self.flash_attn:  # the offline trainers' words and choice for the same request
            warnings.warn(flags.no_gpu_attention("--flash_attn (--ds.attn_implementation flash_attention_2)"),
                          GpuOnlyFlagWarning, stacklevel=2)
            self.flash_attn = False
        for name in ("adam_offload", "use_liger_kernel"):
            if getattr(self, name):
                warnings.warn(f"--{name} needs a GPU; ignored on CPU", GpuOnlyFlagWarning, stacklevel=2)
                setattr(self, name, False)
        for name in ("vllm_enable_sleep", "deepspeed_enable_sleep"):
            if getattr(self, name):
                # Kept: the phases still run one after another as on a GPU, so a CPU run checks the order.
                warnings.warn(f"--{name} frees no memory on CPU; the step still runs wake -> generate -> sleep -> "
                              "reload -> train -> offload in order", GpuOnlyFlagWarning, stacklevel=2)
        if self.bf16:
            warnings.warn("--bf16 on CPU: bfloat16 training on CPU is slow; kept as asked",
                          GpuOnlyFlagWarning, stacklevel=2)
        if self.vllm_sync_backend in ("nccl", "ipc"):
            warnings.warn(f"--vllm_sync_backend {self.vllm_sync_backend} needs GPUs; using gloo on CPU",
                          GpuOnlyFlagWarning, stacklevel=2)
            self.vllm_sync_backend = "gloo"
        if self.vllm_gpu_memory_utilization == 0:
            self.vllm_gpu_memory_utilization = 0.1
        elif self.vllm_gpu_memory_utilization > 0.3:
            warnings.warn(f"--vllm_gpu_memory_utilization {self.vllm_gpu_memory_utilization}: on CPU vLLM reserves "
                          "this fraction of host memory; using 0.1", GpuOnlyFlagWarning, stacklevel=2)
            self.vllm_gpu_memory_utilization = 0.1


REDACTED = ("auth_token",)  # config fields never written to the run folder or logged


def public_config(config) -> dict:
    """The config as written to {run_dir}/config.json and the metrics loggers: without secrets."""
    return {k: v for k, v in vars(config).items() if k not in REDACTED}
