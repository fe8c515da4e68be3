"""veRL's command (`python3 -m verl.trainer.main_ppo key=value ...`) as `python -m
services.coordinator.main_ppo`: the overrides a veRL GRPO user runs become the equivalent rlmesh
configuration, and a run on veRL-format data with a veRL reward file trains."""

from __future__ import annotations

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet
import pytest

from services.common.config import ConfigError, parse_config
from services.coordinator.config import CoordinatorConfig
from services.coordinator.cli.verl_cli import parse_overrides, read_command, translate
from tests.coordinator.conftest import finish, read_metrics, start_coordinator


def verl_parquet(tiny_data_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The tiny arithmetic prompts in the layout of veRL's preprocessed GSM8K parquet files."""
    rows = [json.loads(line) for line in (tiny_data_dir / "arith_train.jsonl").read_text().splitlines()]
    table = [{"data_source": "arith", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": str(r["label"])},
              "extra_info": {"split": "train", "index": i}} for i, r in enumerate(rows)]
    pyarrow.parquet.write_table(pa.Table.from_pylist(table), out)
    return out


def config_of(args: list[str]) -> tuple[CoordinatorConfig, list[str], str]:
    """(the configuration, the keys without effect, the translated command line)."""
    overrides, flags = parse_overrides(args)
    argv, ignored = translate(overrides)
    with pytest.warns():  # GPU-only flags (colocation, sleep) on this CPU machine
        return parse_config(CoordinatorConfig, argv + flags), ignored, " ".join(argv + flags)


def test_a_verl_grpo_command_becomes_the_same_rlmesh_run(tiny_model_dir, tiny_reward_model_dir, tiny_data_dir,
                                                         tmp_path, capsys):
    train = verl_parquet(tiny_data_dir, tmp_path / "train.parquet")
    cfg, ignored, line = config_of([
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files=[{train}]",
        "data.train_batch_size=64", "data.max_prompt_length=128", "data.max_response_length=256",
        "data.filter_overlong_prompts=True", "data.truncation=error", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
        "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen_function_rm",
        "trainer.n_gpus_per_node=4", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
        "trainer.total_epochs=15", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "--placement", "local"])
    assert (cfg.prompt_data, cfg.input_key, cfg.label_key, cfg.apply_chat_template) == (
        str(train), "prompt", "reward_model.ground_truth", True)
    assert cfg.eval_dataset == str(train) and cfg.eval_steps == 5
    assert (cfg.advantage_estimator, cfg.n_samples_per_prompt) == ("group_norm", 5)
    # Prompts per step and per optimizer step in veRL; samples in rlmesh.
    assert (cfg.rollout_batch_size, cfg.train_batch_size, cfg.micro_train_batch_size,
            cfg.micro_rollout_batch_size) == (64, 80, 4, 8)
    assert (cfg.prompt_max_len, cfg.generate_max_len) == (128, 256)
    assert (cfg.use_kl_loss, cfg.init_kl_coef, cfg.kl_estimator) == (True, 0.001, "k3")
    assert (cfg.actor_learning_rate, cfg.l2, cfg.max_norm, cfg.eps_clip, cfg.dual_clip) == (1e-6, 0.01, 1.0, 0.2, 3.0)
    assert (cfg.lr_scheduler, cfg.lr_warmup_ratio, cfg.entropy_loss_coef) == ("constant_with_warmup", 0.0, 0.0)
    assert cfg.adam_betas == [0.9, 0.999]  # veRL's default, not rlmesh's (0.9, 0.95)
    assert (cfg.packing_samples, cfg.gradient_checkpointing) == (True, True)
    # The hybrid engine: learner and engines on the same 4 GPUs, two engines of 2.
    assert (cfg.actor_num_gpus_per_node, cfg.vllm_num_engines, cfg.vllm_tensor_parallel_size) == (4, 2, 2)
    assert cfg.colocate_all_models and cfg.vllm_enable_sleep and cfg.enforce_eager
    assert "--vllm_gpu_memory_utilization 0.6" in line and cfg.rollout_engine == "vllm"  # CPU here: 0.1 in cfg
    assert (cfg.num_episodes, cfg.save_steps, cfg.load_checkpoint) == (15, 20, True)
    assert cfg.ckpt_path == str(tmp_path / "ckpt") and cfg.wandb_project == "verl_grpo_example_gsm8k"
    assert cfg.reward_func == "math" and not cfg.use_wandb
    # trainer.critic_warmup=0 is read (rlmesh's behaviour); another value is refused below.
    assert ignored == ["actor_rollout_ref.actor.fsdp_config.param_offload", "data.filter_overlong_prompts",
                       "data.truncation"]
    assert not cfg.disable_ds_ckpt  # trainer.save_freq=20 saves
    # veRL's defaults where rlmesh's differ: no KL at all unless asked, and the rest as veRL has it.
    one_cpu = [f"data.train_files={train}", f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.n_gpus_per_node=1",
               "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.logger=console"]
    (tmp_path / "r.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.0\n")  # a missing reward file fails at validation
    cfg, _, _ = config_of([*one_cpu, "algorithm.norm_adv_by_std_in_grpo=False", "algorithm.adv_estimator=grpo",
                           "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                           f"custom_reward_function.path={tmp_path / 'r.py'}",
                           "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
                           "actor_rollout_ref.rollout.top_k=null", "trainer.total_training_steps=null"])
    assert (cfg.init_kl_coef, cfg.use_kl_loss, cfg.advantage_estimator) == (0.0, False, "dr_grpo")
    assert cfg.eps_clip_low_high == [0.2, 0.28] and cfg.loss_agg_mode == "seq_mean_token_sum"
    assert (cfg.top_k, cfg.max_steps) == (-1, 0)  # null: veRL's default, and no step limit
    assert cfg.remote_rm_url.endswith("/r.py:compute_score") and cfg.rollout_batch_size == 1024
    assert cfg.label_key == "reward_model.ground_truth"
    # LoRA on the actor; with lora_rank 0 (veRL's default) its other keys are not read, as in veRL.
    cfg, _, _ = config_of([*one_cpu, "actor_rollout_ref.actor.optim.betas=[0.9,0.95]"])
    assert cfg.adam_betas == [0.9, 0.95]
    cfg, _, _ = config_of([*one_cpu, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                           "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == (8, 32.0, ["q_proj", "v_proj"])
    cfg, _, ignored = config_of([*one_cpu, "actor_rollout_ref.model.lora_alpha=32"])
    assert (cfg.lora_rank, cfg.lora_alpha) == (0, 16.0) and "actor_rollout_ref.model.lora_alpha" not in ignored
    # Dynamic batch sizes: micro-batches of up to ppo_max_token_len_per_gpu tokens, packed.
    cfg, _, ignored = config_of([*one_cpu, "actor_rollout_ref.model.use_remove_padding=True",
                                 "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000"])
    assert (cfg.use_dynamic_batch, cfg.train_max_tokens_per_gpu, cfg.packing_samples) == (True, 24000, True)
    assert not any("dynamic_bsz" in k or "max_token_len" in k for k in ignored)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        config_of([*one_cpu, "actor_rollout_ref.actor.use_dynamic_bsz=True"])
    assert "--use_dynamic_batch sizes micro-batches by their tokens, which needs --packing_samples" in capsys.readouterr().err
    # A reward model scores instead; it needs no ground truth.
    cfg, _, _ = config_of([*one_cpu, "reward_model.enable=True", f"reward_model.model.path={tiny_reward_model_dir}"])
    assert (cfg.reward_pretrain, cfg.label_key, cfg.reward_func) == (str(tiny_reward_model_dir), "", "")


@pytest.mark.parametrize("args, words", [
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax: rlmesh has no advantage estimator"),
    (["actor_rollout_ref.rollout.name=sglang"], "rollout backend of that name"),
    (["actor_rollout_ref.actor.strategy=megatron"], "Megatron is not supported"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True"], "choose one"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=full"], "KL estimator"),
    (["actor_rollout_ref.rollout.multi_turn.enable=True"], "--agent_func_path"),
    (["trainer.n_gpus_per_node=3"], "does not divide the 3 GPUs"),
    (["data.train_batch_size"], "expected a veRL override key=value"),
    (["trainer.critic_warmup=5"], "trainer.critic_warmup=5: training the critic alone"),
    (["actor_rollout_ref.model.lora_rank=-1"], "lora_rank=-1 must be >= 0"),
    (["actor_rollout_ref.rollout.do_sample=False"], "greedy rollouts are not supported"),
    (["algorithm.rollout_correction.rollout_is=sequence"], "rollout_is=sequence: rlmesh weights by token"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.bypass_mode=true"],
     "bypass_mode=True: not supported"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs=token_k1: rejection sampling"),
    (["data.custom_cls.path=my_data.py", "data.custom_cls.name=MyDataset"], "a dataset class of the user's"),
    (["trainer.nnodes="], "trainer.nnodes='': expected a whole number"),
    (["actor_rollout_ref.rollout.n=2.5"], "actor_rollout_ref.rollout.n=2.5: expected a whole number"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2"],
     "ppo_micro_batch_size=2 counts samples over all 4 GPUs"),
    (["--config-name=ppo_megatron_trainer"], "Megatron is not supported"),
    (["--config-path", "/nowhere", "--config-name", "mine"], "no mine.yaml in --config-path /nowhere"),
    (["-cn"], "-cn: give a value"),
    (["reward_model.reward_manager=prime"], "reward_model.reward_manager=prime"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=wsd"], "lr_scheduler_type=wsd: rlmesh has no learning-rate"),
])
def test_what_cannot_run_here_is_named(args, words):
    with pytest.raises(ConfigError, match=None) as err:
        overrides, _ = read_command(["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", *args])
        translate(overrides)
    assert words in str(err.value)
    with pytest.raises(ConfigError, match="data.train_files: required"):
        translate(parse_overrides(["actor_rollout_ref.model.path=m"])[0])


def test_older_keys_no_shuffle_and_warmup_steps(tiny_model_dir):
    """veRL's global micro-batch keys (divided among the GPUs as veRL does), data.shuffle=False and
    optim.lr_warmup_steps, as veRL's LoRA tuning scripts and large-model scripts give them."""
    from services.coordinator.fleet.placement import learner_argv, warmup_ratio

    base = ["data.train_files=t.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.logger=console",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.n=4", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
    cfg, ignored, _ = config_of([*base, "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size=64"])
    assert (cfg.train_batch_size, cfg.micro_train_batch_size, cfg.micro_rollout_batch_size) == (256, 32, 32)
    assert not any("micro_batch_size" in k for k in ignored)
    # The per-GPU key wins where both are given.
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert cfg.micro_train_batch_size == 4
    assert config_of(base)[0].shuffle_prompts
    cfg, _, line = config_of([*base, "data.shuffle=False"])
    assert not cfg.shuffle_prompts and "--no-shuffle_prompts" in line
    # Warm-up: a count of training steps wins over the ratio; 0 is none; veRL's -1 leaves the ratio.
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
                           "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"])
    assert cfg.lr_warmup_steps == 10 and warmup_ratio(cfg, 40) == 0.25 and warmup_ratio(cfg, 5) < 1
    assert "--lr_warmup_ratio 0.25" in " ".join(learner_argv(cfg, 40, 2))
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                           "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"])
    assert (cfg.lr_warmup_steps, cfg.lr_warmup_ratio) == (0, 0.0)
    # Truncated importance sampling against the engine's log-probs: veRL's rollout_correction at token
    # level, or its older tis_imp_ratio_cap.
    assert not config_of(base)[0].use_tis
    cfg, ignored, _ = config_of([*base, "algorithm.rollout_correction.rollout_is=token",
                                 "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    assert (cfg.use_tis, cfg.tis_cap) == (True, 3.0) and not ignored
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.tis_imp_ratio_cap=2.5"])
    assert (cfg.use_tis, cfg.tis_cap) == (True, 2.5)
    assert not config_of([*base, "actor_rollout_ref.actor.tis_imp_ratio_cap=-1"])[0].use_tis
    # DAPO's reward manager with its overlong penalty, as veRL's scripts give it now.
    dapo = [*base, "reward_model.reward_manager=dapo", "data.max_response_length=64",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=64"]
    cfg, ignored, _ = config_of(dapo)
    assert (cfg.overlong_buffer_len, cfg.overlong_penalty_factor, cfg.generate_max_len) == (16, 0.5, 64) and not ignored
    assert config_of([*base, "reward_model.reward_kwargs.overlong_buffer_cfg.enable=False"])[0].overlong_buffer_len == 0
    with pytest.raises(ConfigError, match="max_resp_len=128 differs from data.max_response_length=64"):
        config_of([*dapo, "+reward_model.reward_kwargs.max_resp_len=128"])
    # The schedule: lr_scheduler_type, or the deprecated warmup_style over it; veRL's cosine ends at
    # min_lr_ratio (0 unless set), which reaches the learner.
    cfg, _, _ = config_of(base)
    assert (cfg.lr_scheduler, cfg.min_lr_ratio) == ("constant_with_warmup", 0.1)
    cfg, ignored, _ = config_of([*base, "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"])
    assert (cfg.lr_scheduler, cfg.min_lr_ratio) == ("cosine_with_min_lr", 0.0) and not ignored
    assert "--lr_scheduler cosine_with_min_lr --min_lr_ratio 0.0" in " ".join(learner_argv(cfg, 40, 2))
    from services.learner.config import LearnerConfig
    learner = parse_config(LearnerConfig, learner_argv(cfg, 40, 1))
    assert (learner.lr_scheduler, learner.min_lr_ratio) == ("cosine_with_min_lr", 0.0)
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
                           "actor_rollout_ref.actor.optim.warmup_style=cosine",
                           "actor_rollout_ref.actor.optim.min_lr_ratio=0.2"])
    assert (cfg.lr_scheduler, cfg.min_lr_ratio) == ("cosine_with_min_lr", 0.2)
    cfg, _, _ = config_of([*base, "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
                           "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"])
    assert (cfg.lr_warmup_steps, warmup_ratio(cfg, 40)) == (0, 0.5)


MY_CONFIG = """
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - base_of_mine
  - _self_
data:
  train_batch_size: 16
  max_response_length: 96
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 8
    ppo_micro_batch_size_per_gpu: ${actor_rollout_ref.rollout.n}
    optim:
      lr: 3e-6
  rollout:
    n: 4
    max_num_batched_tokens: ${data.max_response_length}
trainer:
  project_name: from_my_file
"""


def test_a_config_file_of_the_users_own(tiny_model_dir, tmp_path):
    """`--config-path DIR --config-name NAME`: the file's keys (and those of the files its defaults list
    names) as overrides, the command line's key=value over them, interpolations resolved."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(MY_CONFIG)
    (tmp_path / "conf" / "base_of_mine.yaml").write_text(
        "algorithm:\n  adv_estimator: grpo\ndata:\n  train_batch_size: 999\n")
    args = ["data.train_files=t.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.logger=console",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    for options in (["--config-path", str(tmp_path / "conf"), "--config-name", "mine"],
                    [f"--config-path={tmp_path / 'conf'}", "--config-name=mine.yaml"],
                    ["-cp", str(tmp_path / "conf"), "-cn", "mine"]):
        overrides, flags = read_command([*options, *args, "actor_rollout_ref.actor.optim.lr=2e-6"])
        assert flags == []
        argv, ignored = translate(overrides)
        with pytest.warns():
            cfg = parse_config(CoordinatorConfig, argv)
        assert (cfg.advantage_estimator, cfg.rollout_batch_size, cfg.n_samples_per_prompt) == ("group_norm", 16, 4)
        assert (cfg.train_batch_size, cfg.micro_train_batch_size, cfg.generate_max_len) == (32, 4, 96)
        assert cfg.vllm_max_num_batched_tokens == 96 and cfg.wandb_project == "from_my_file"
        assert cfg.actor_learning_rate == 2e-6  # the command line wins over the file
        assert ignored == []
    # veRL's own config names need no file; a Megatron group in a user's defaults is refused by name.
    assert read_command(["--config-name=ppo_trainer", *args])[0] == read_command(args)[0]
    (tmp_path / "conf" / "mega.yaml").write_text("defaults:\n  - ppo_trainer\n  - actor@actor_rollout_ref.actor: "
                                                  "megatron_actor\n")
    with pytest.raises(ConfigError, match="megatron_actor: Megatron is not supported"):
        read_command(["-cp", str(tmp_path / "conf"), "-cn", "mega", *args])
    # An interpolation that names nothing known, on a key that matters, asks for the value.
    (tmp_path / "conf" / "bad.yaml").write_text("actor_rollout_ref:\n  rollout:\n    n: ${oc.env:N}\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.n=\$\{oc.env:N\}: .*give "
                                          "actor_rollout_ref.rollout.n=VALUE"):
        read_command(["-cp", str(tmp_path / "conf"), "-cn", "bad", *args])
    (tmp_path / "conf" / "bad.yaml").write_text("data: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        read_command(["-cp", str(tmp_path / "conf"), "-cn", "bad", *args])


VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({calls!r}, "a") as f:
        f.write(repr((data_source, ground_truth, extra_info)) + "\\n")
    return {{"score": float(ground_truth in solution_str), "has_digit": any(c.isdigit() for c in solution_str)}}
'''


def test_a_verl_command_trains_on_verl_data_with_a_verl_reward_file(tiny_model_dir, tiny_data_dir, tmp_path):
    train = verl_parquet(tiny_data_dir, tmp_path / "train.parquet")
    reward = tmp_path / "my_reward.py"
    reward.write_text(VERL_REWARD.format(calls=str(tmp_path / "calls.txt")))
    # Part of the configuration in a config file of the user's (Hydra's -cp / -cn), the rest as overrides.
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_grpo.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nalgorithm:\n  adv_estimator: grpo\ndata:\n  train_batch_size: 4\n"
        "  max_prompt_length: 64\n  max_response_length: 16\n  shuffle: false\nactor_rollout_ref:\n  rollout:\n"
        "    n: 4\n    name: hf\n  actor:\n    optim:\n      lr_scheduler_type: cosine\n      lr_warmup_steps: 1\n")
    argv = ["-cp", str(tmp_path / "conf"), "-cn", "my_grpo", f"data.train_files={train}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
            f"custom_reward_function.path={reward}", "trainer.logger=['console']", "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}", "--run_dir", str(tmp_path / "run")]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator.main_ppo", argv, log)
    output = finish(proc, log, timeout_s=420)
    assert proc.returncode == 0, output[-6000:]
    assert "verl.translated rlmesh train --prompt_data" in output
    [metrics] = read_metrics(tmp_path / "run")
    assert metrics["samples/trained"] == 16 and "reward/has_digit" in metrics
    # veRL's hybrid engine with padding removal and no reference model: the learner sleeps while the
    # engine generates, then takes the step's old log-probs in one packed call (scoring went by
    # micro-batches of 8 samples, alongside generation).
    assert (metrics["rpc/score_calls"], metrics["rpc/logprobs_calls"]) == (2, 1), metrics
    calls = [eval(line) for line in (tmp_path / "calls.txt").read_text().splitlines()]  # noqa: S307 - our own file
    labels = {str(json.loads(line)["label"]) for line in (tiny_data_dir / "arith_train.jsonl").read_text().splitlines()}
    assert len(calls) == 16 and all(source == "arith" and truth in labels for source, truth, _ in calls)
    # Each call got its row's extra_info column (veRL's), the row found by its index there.
    rows = [json.loads(line) for line in (tiny_data_dir / "arith_train.jsonl").read_text().splitlines()]
    for _, truth, info in calls:
        assert set(info) == {"split", "index"} and info["split"] == "train", info
        assert str(rows[info["index"]]["label"]) == truth, (info, truth)
    # The step's 4 prompts, 4 samples each: with data.shuffle false the file's first 4 rows.
    assert {info["index"] for _, _, info in calls} == {0, 1, 2, 3}
    assert ("--advantage_estimator group_norm" in output and "--no-shuffle_prompts" in output
            and "--lr_scheduler cosine_with_min_lr --min_lr_ratio 0.0" in output and "--lr_warmup_steps 1" in output)
    assert (tmp_path / "ckpt" / "final").is_dir()  # the final model, under trainer.default_local_dir


def test_simplerl_remove_clip_trains_the_unclipped_objective_and_save_freq_minus_one_never_saves(tiny_model_dir):
    """simpleRL-reason's trainer.remove_clip=True: loss = -ratio x advantage, no clipping of any kind.
    The clip range it becomes is checked against rl_math's loss: values and gradients equal the
    unclipped objective even at ratios that veRL's clip (0.2) and dual clip (3) would bound."""
    import torch

    from services.common.rl_math import policy_loss

    base = ["data.train_files=t.parquet", f"actor_rollout_ref.model.path={tiny_model_dir}",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "trainer.logger=console", "actor_rollout_ref.actor.clip_ratio_high=0.28"]
    cfg, ignored, _ = config_of([*base, "trainer.remove_clip=True"])
    assert "trainer.remove_clip" not in ignored and cfg.eps_clip_low_high == []
    assert (cfg.eps_clip, cfg.dual_clip) == (1e9, 0.0)
    clipped_cfg, _, _ = config_of(base)
    assert (clipped_cfg.eps_clip_low_high, clipped_cfg.dual_clip) == ([0.2, 0.28], 3.0)

    old = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3], [0.4, 0.05, 0.6, 0.2]]))
    logp = (old + torch.tensor([[3.0, -2.5, 0.0, 5.0], [-4.0, 2.0, 0.1, -0.3]])).requires_grad_()  # ratios e^-4..e^5
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.5], [0.5, -1.0, 2.0, -0.5]])
    mask = torch.ones_like(adv)

    def loss_and_grad(eps_low, eps_high, dual_clip):
        logp.grad = None
        out = policy_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        out.loss.backward()
        return out.loss.detach(), logp.grad.clone(), out.clip_ratio

    loss, grad, clip_fraction = loss_and_grad(cfg.eps_clip, cfg.eps_clip, cfg.dual_clip or None)
    ratio = torch.exp(logp.detach() - old)
    assert torch.allclose(loss, -(ratio * adv).mean(), rtol=1e-6)
    assert torch.allclose(grad, -(ratio * adv) / adv.numel(), rtol=1e-6)  # d(-r A)/d logp = -r A, per token mean
    assert float(clip_fraction) == 0.0
    veRL_loss, _, _ = loss_and_grad(0.2, 0.28, 3.0)
    assert not torch.allclose(veRL_loss, loss)  # what training went on with while the key was ignored

    # trainer.save_freq=-1 (veRL's default): never save a checkpoint.
    assert (cfg.save_steps, cfg.disable_ds_ckpt) == (-1, True)
