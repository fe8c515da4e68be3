"""Job L's settings and each framework's command (bench/gpu/learn_peers.py runs them).

Every framework gets the same learning problem, written out explicitly where its default differs:
GRPO (rewards minus the group mean over the group's std), no KL and no reference model, no entropy
term, PPO clip 0.2 with one policy update per step (so the ratio starts at 1), token-level loss, AdamW
with betas (0.9, 0.95), no weight decay, gradient norm clipped at 1.0, constant learning rate without
warm-up, sampling at temperature 0.7 with top-p 1.0, bf16 compute with fp32 master weights, no
gradient checkpointing (a 135M model fits), the chat template of the model's tokenizer, seed 42.
Each framework saves the model in Hugging Face format every `eval_every` steps (the evaluator reads
those): rlmesh --save_steps --save_hf_ckpt (with its DeepSpeed checkpoint, which rlmesh writes with
every HF export), OpenRLHF --ckpt.save_steps --ckpt.save_hf --ckpt.disable_ds, TRL save_only_model,
veRL checkpoint.save_contents=[hf_model].

Where a framework cannot be set the same (documented here and in the results):
  - loss aggregation: rlmesh and veRL take the token mean over the step's samples; OpenRLHF the token
    mean per micro-batch, averaged over micro-batches; TRL its "dapo" loss (tokens of the whole
    generation batch). Equal when micro-batches hold equal token counts.
  - TRL corrects for the vLLM/trainer mismatch by default (vllm_importance_sampling_correction):
    turned off, as the others run without it.
  - micro-batches: rlmesh and veRL by tokens (16,384 a pass, as in jobs A and B), OpenRLHF and TRL 32
    samples; the optimizer step is one per 256 samples everywhere.
"""

from __future__ import annotations

import pathlib
import sys
import types
from dataclasses import asdict, dataclass

import verl_peer

FRAMEWORKS = ("rlmesh", "openrlhf", "trl", "verl")
HERE = pathlib.Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    """What every framework gets (learn_peers.py's options of the same names)."""
    steps: int = 20                      # optimizer steps (one per prompts_per_step x samples_per_prompt samples)
    eval_every: int = 4                  # a checkpoint (and a held-out score) every this many steps
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 256
    prompt_max_len: int = 128            # the chat-templated prompt's tokens; a longer prompt stops the build
    learning_rate: float = 1e-5
    temperature: float = 0.7             # sampling in training (at 1.0 SmolLM2-135M's samples are mostly noise)
    micro_batch: int = 32                # samples per forward/backward where a framework counts samples
    micro_batch_tokens: int = 16384      # tokens per pass where a framework counts tokens (rlmesh, veRL)
    gpu_memory_utilization: float = 0.4  # vLLM's share of the GPU, every framework (rlmesh: all its engines)
    rlmesh_engines: int = 2              # rlmesh's vLLM engines on the GPU
    seed: int = 42

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def checkpoints(self) -> int:
        return self.steps // self.eval_every


@dataclass(frozen=True)
class Inputs:
    """Files of one job L run, shared by every framework."""
    model: pathlib.Path        # the HF folder (bf16)
    prompts: pathlib.Path      # JSONL: prompt, label, difficulty; steps x prompts_per_step rows
    heldout: pathlib.Path      # JSONL, the same keys
    verifier: pathlib.Path     # learn_reward.py's copy
    verl_data: pathlib.Path    # prompts as veRL's parquet


def rlmesh_command(s: Settings, inputs: Inputs, work: pathlib.Path, scratch: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "services.coordinator.cli.train",
            "--pretrain", str(inputs.model), "--prompt_data", str(inputs.prompts), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--remote_rm_url", str(inputs.verifier),
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(s.samples_per_prompt),
            "--rollout_batch_size", str(s.prompts_per_step), "--micro_rollout_batch_size", str(s.micro_batch),
            "--train_batch_size", str(s.samples_per_step), "--micro_train_batch_size", str(s.micro_batch),
            "--max_epochs", "1", "--num_episodes", "1", "--max_steps", str(s.steps),
            "--prompt_max_len", str(s.prompt_max_len), "--generate_max_len", str(s.max_new_tokens),
            "--temperature", str(s.temperature), "--top_p", "1.0", "--init_kl_coef", "0", "--entropy_loss_coef", "0",
            "--eps_clip", "0.2", "--actor_learning_rate", str(s.learning_rate), "--lr_warmup_ratio", "0",
            "--lr_scheduler", "constant_with_warmup", "--adam_betas", "0.9", "0.95", "--l2", "0", "--max_norm", "1.0",
            "--zero_stage", "2", "--bf16", "--packing_samples", "--use_dynamic_batch",
            "--train_max_tokens_per_gpu", str(s.micro_batch_tokens),
            "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep", "--vllm_sync_backend", "ipc",
            "--vllm_num_engines", str(s.rlmesh_engines),
            "--vllm_gpu_memory_utilization", f"{s.gpu_memory_utilization / s.rlmesh_engines:.4g}",
            "--vllm_max_num_seqs", "512", "--vllm_max_num_batched_tokens", "4096",
            "--run_dir", str(work / "run"), "--ckpt_path", str(scratch / "ckpt"), "--save_path", str(scratch / "final"),
            "--save_steps", str(s.eval_every), "--save_hf_ckpt", "--max_ckpt_num", str(s.checkpoints + 1),
            "--metrics_port", "-1", "--no-progress_bar", "--seed", str(s.seed)]


def openrlhf_command(s: Settings, inputs: Inputs, work: pathlib.Path, scratch: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "openrlhf.cli.train_ppo_ray",
            "--actor.model_name_or_path", str(inputs.model), "--reward.remote_url", str(inputs.verifier),
            "--data.prompt_dataset", str(inputs.prompts), "--data.input_key", "prompt", "--data.label_key", "label",
            "--data.apply_chat_template", "--data.max_samples", str(s.prompts_per_step * s.steps),
            "--data.max_len", str(s.prompt_max_len + s.max_new_tokens), "--rollout.max_new_tokens", str(s.max_new_tokens),
            "--rollout.batch_size", str(s.prompts_per_step), "--rollout.n_samples_per_prompt", str(s.samples_per_prompt),
            "--rollout.micro_batch_size", str(s.micro_batch), "--rollout.temperature", str(s.temperature), "--rollout.top_p", "1.0",
            "--train.batch_size", str(s.samples_per_step), "--train.micro_batch_size", str(s.micro_batch),
            "--train.max_epochs", "1", "--train.num_episodes", "1", "--train.seed", str(s.seed),
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--actor.entropy_coef", "0",
            "--actor.eps_clip", "0.2", "--actor.adam.lr", str(s.learning_rate), "--actor.adam.betas", "0.9", "0.95",
            "--actor.adam.weight_decay", "0", "--actor.lr_scheduler", "constant_with_warmup",
            "--actor.lr_warmup_ratio", "0", "--actor.max_norm", "1.0",
            "--ds.zero_stage", "2", "--ds.param_dtype", "bf16", "--ds.attn_implementation", "sdpa",
            "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_nodes", "1",
            "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
            "--vllm.gpu_memory_utilization", str(s.gpu_memory_utilization),
            "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep",
            "--ckpt.path", str(scratch / "ckpt"), "--ckpt.output_dir", str(scratch / "final"),
            "--ckpt.save_steps", str(s.eval_every), "--ckpt.save_hf", "--ckpt.disable_ds",
            "--ckpt.max_num", str(s.checkpoints + 1)]


def trl_settings(s: Settings, inputs: Inputs, work: pathlib.Path, scratch: pathlib.Path) -> dict:
    """What learn_trl.py reads: the data and reward files and GRPOConfig's arguments."""
    config = dict(
        output_dir=str(scratch / "out"), per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=s.samples_per_step // s.micro_batch, num_generations=s.samples_per_prompt,
        max_completion_length=s.max_new_tokens, max_steps=s.steps, learning_rate=s.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        vllm_importance_sampling_correction=False, temperature=s.temperature, top_p=1.0,
        # fp32 master weights under bf16 autocast, as DeepSpeed and FSDP keep them for the others: in a
        # bf16 model AdamW's steps of ~lr are below bf16's resolution of most weights and are lost
        bf16=True, model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=False,
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=s.gpu_memory_utilization,
        vllm_max_model_length=s.prompt_max_len + s.max_new_tokens,
        save_strategy="steps", save_steps=s.eval_every, save_only_model=True,
        logging_steps=1, report_to="none", seed=s.seed, shuffle_dataset=False)
    return {"model": str(inputs.model), "prompts": str(inputs.prompts), "verifier": str(inputs.verifier),
            "work": str(work), "grpo_config": config}


def trl_command(s: Settings, inputs: Inputs, work: pathlib.Path, scratch: pathlib.Path) -> list[str]:
    import json

    (work / "trl_settings.json").write_text(json.dumps(trl_settings(s, inputs, work, scratch), indent=1))
    return [sys.executable, str(HERE / "learn_trl.py"), str(work / "trl_settings.json")]


def verl_command(s: Settings, inputs: Inputs, work: pathlib.Path, scratch: pathlib.Path) -> list[str]:
    job = types.SimpleNamespace(name="L", max_tokens=s.max_new_tokens, micro_batch_tokens=s.micro_batch_tokens)
    options = types.SimpleNamespace(prompts_per_step=s.prompts_per_step, gpu_memory_utilization=s.gpu_memory_utilization,
                                    steps=s.steps, liger=False)
    paths = {"verl_data": inputs.verl_data, "verl_reward": inputs.verifier}
    overrides = verl_peer.verl_overrides(job, inputs.model, paths, scratch, options, prompt_max_len=s.prompt_max_len,
                                         learning_rate=s.learning_rate, samples_per_prompt=s.samples_per_prompt)
    A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."  # noqa: N806
    overrides.update({
        "actor_rollout_ref.model.enable_gradient_checkpointing": False, A + "optim.betas": "[0.9,0.95]",
        A + "grad_clip": 1.0, A + "clip_ratio": 0.2, A + "loss_agg_mode": "token-mean",
        R + "temperature": s.temperature, R + "top_p": 1.0, "data.seed": s.seed,
        "trainer.save_freq": s.eval_every, A + "checkpoint.save_contents": "[hf_model]",
        "trainer.max_actor_ckpt_to_keep": s.checkpoints + 1})
    return verl_peer.as_command(overrides)


COMMANDS = {"rlmesh": rlmesh_command, "openrlhf": openrlhf_command, "trl": trl_command, "verl": verl_command}

# Where each framework puts its HF export of step N (under its scratch folder).
CHECKPOINT_GLOBS = {"rlmesh": ("ckpt/global_step_*_hf", r"global_step_(\d+)_hf$"),
                    "openrlhf": ("ckpt/global_step*_hf", r"global_step(\d+)_hf$"),
                    "trl": ("out/checkpoint-*", r"checkpoint-(\d+)$"),
                    "verl": ("ckpt/global_step_*/actor/huggingface", r"global_step_(\d+)/actor/huggingface$")}


def settings_record(s: Settings) -> dict:
    return {**asdict(s), "samples_per_step": s.samples_per_step, "checkpoints": s.checkpoints}
