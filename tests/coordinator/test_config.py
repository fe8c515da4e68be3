"""The coordinator's flags: the seed documents' commands parse, contradictions fail with a fix."""

import pytest

from services.common.config import ConfigError, build_parser, config_from_args
from services.coordinator.config import CoordinatorConfig, GpuOnlyFlagWarning

# The flags named in the coordinator issue (the seed documents' vocabulary); each must exist.
SEED_FLAGS = """actor_num_nodes actor_num_gpus_per_node critic_num_nodes critic_num_gpus_per_node reward_num_nodes
reward_num_gpus_per_node ref_num_nodes ref_num_gpus_per_node vllm_num_engines vllm_tensor_parallel_size
vllm_gpu_memory_utilization colocate_all_models colocate_actor_ref colocate_critic_reward vllm_enable_sleep
deepspeed_enable_sleep pretrain reward_pretrain remote_rm_url save_path ckpt_path save_steps logging_steps
load_checkpoint max_ckpt_num save_hf_ckpt save_value_network micro_train_batch_size train_batch_size
micro_rollout_batch_size rollout_batch_size n_samples_per_prompt max_epochs num_episodes prompt_max_len
generate_max_len zero_stage bf16 actor_learning_rate critic_learning_rate init_kl_coef use_kl_loss kl_estimator
advantage_estimator no_advantage_std_norm normalize_reward gamma lambd eps_clip value_clip temperature top_p
gradient_checkpointing flash_attn packing_samples adam_offload prompt_data input_key label_key apply_chat_template
input_template use_wandb wandb_project use_tensorboard seed""".split()


def parse(argv, tmp_path=None):
    parser = build_parser(CoordinatorConfig)
    return config_from_args(CoordinatorConfig, parser.parse_args(argv))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    for name in ("model", "rm"):
        (root / name).mkdir()
    (root / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return root


def base(paths, *extra):
    return ["--placement", "local", "--device", "cpu", "--pretrain", str(paths / "model"),
            "--prompt_data", str(paths / "data.jsonl"), "--reward_func", "math", "--label_key", "label",
            "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8",
            "--micro_train_batch_size", "2", "--advantage_estimator", "group_norm", *extra]


def test_every_seed_flag_has_help():
    parser = build_parser(CoordinatorConfig)
    options = {a.dest: a for a in parser._actions}
    for flag in SEED_FLAGS:
        assert flag in options, f"--{flag} missing"
        assert options[flag].help and len(options[flag].help) > 15, f"--{flag} has no help text"


def test_openrlhf_grpo_command_parses(paths):
    argv = ["--advantage_estimator", "group_norm", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "8",
            "--reward_num_nodes", "1", "--reward_num_gpus_per_node", "8", "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "8", "--vllm_num_engines", "4", "--vllm_tensor_parallel_size", "2",
            "--colocate_all_models", "--pretrain", str(paths / "model"), "--reward_pretrain", str(paths / "rm"),
            "--save_path", "./output/llama3-8b-grpo", "--micro_train_batch_size", "8", "--train_batch_size", "128",
            "--micro_rollout_batch_size", "16", "--rollout_batch_size", "1024", "--max_epochs", "1", "--bf16",
            "--actor_learning_rate", "5e-7", "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", "k3",
            "--normalize_reward", "--no_advantage_std_norm", "--n_samples_per_prompt", "8",
            "--prompt_data", str(paths / "data.jsonl"), "--placement", "local", "--device", "cuda"]
    cfg = parse(argv)
    assert (cfg.advantage_estimator, cfg.kl_estimator, cfg.use_kl_loss, cfg.no_advantage_std_norm) == \
        ("group_norm", "k3", True, True)
    assert cfg.actor_gpus() == 8 and cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size == 8
    assert cfg.vllm_gpu_memory_utilization == 0.5  # colocated default


@pytest.mark.parametrize("extra, needle", [
    (["--colocate_all_models", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "3"],
     "actor GPUs (1 x 2 = 2) must equal --vllm_num_engines x --vllm_tensor_parallel_size (3 x 1 = 3), or divide it"),
    (["--colocate_all_models", "--actor_num_gpus_per_node", "3", "--vllm_num_engines", "3",
      "--vllm_tensor_parallel_size", "2"], "or divide it for several engines per GPU"),
    (["--n_samples_per_prompt", "1", "--train_batch_size", "4"], "set --n_samples_per_prompt >= 2"),
    (["--train_batch_size", "32"], "--train_batch_size 32 must divide the samples of one step"),
    (["--train_batch_size", "6"], "must divide the samples of one step"),
    (["--micro_train_batch_size", "3"], "multiple of --micro_train_batch_size"),
    (["--remote_rm_url", "http://127.0.0.1:5000/get_reward"], "give exactly one reward source"),
    (["--label_key", ""], "set --label_key"),
    (["--dynamic_filtering", "--dynamic_filtering_reward_range", "1", "0"], "LOW < HIGH"),
    (["--rollout_addresses", "127.0.0.1:1"], "use --placement static"),
    (["--partial_rollout"], "add --async_train"),
    (["--partial_rollout", "--async_train", "--rollout_engine", "hf"], "use --rollout_engine vllm"),
])
def test_contradictions_fail_with_a_fix(paths, extra, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse(base(paths, *extra))
    assert needle in str(err.value)


def test_missing_model_folder_says_no_downloads(paths):
    with pytest.raises(ConfigError) as err:
        parse(base(paths, "--pretrain", "Qwen/Qwen2.5-0.5B"))
    assert "does not download" in str(err.value)


def test_gpu_only_flags_warn_on_cpu(paths):
    with pytest.warns(GpuOnlyFlagWarning) as caught:
        cfg = parse(base(paths, "--flash_attn", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
                         "--vllm_gpu_memory_utilization", "0.9", "--vllm_sync_backend", "nccl"))
    messages = " ".join(str(w.message) for w in caught)
    assert "--flash_attn (--ds.attn_implementation flash_attention_2) needs a CUDA GPU" in messages
    assert "--vllm_enable_sleep frees no memory on CPU" in messages
    # Sleep flags stay on: the colocation order of the phases is the same on CPU.
    assert (cfg.flash_attn, cfg.vllm_enable_sleep, cfg.deepspeed_enable_sleep) == (False, True, True)
    assert cfg.vllm_gpu_memory_utilization == 0.1 and cfg.vllm_sync_backend == "gloo"


def test_yaml_holds_any_flag_and_cli_wins(paths, tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"pretrain: {paths / 'model'}\nprompt_data: {paths / 'data.jsonl'}\nreward_func: math\n"
                         "label_key: label\nadvantage_estimator: rloo\nn_samples_per_prompt: 2\nrollout_batch_size: 4\n"
                         "train_batch_size: 8\nmicro_train_batch_size: 2\ninit_kl_coef: 0.0\nplacement: local\n"
                         "device: cpu\ntemperature: 0.7\n")
    cfg = parse(["--config", str(yaml_file), "--temperature", "0.9"])
    assert (cfg.advantage_estimator, cfg.temperature, cfg.ref_needed) == ("rloo", 0.9, False)


def test_static_placement_from_environment(paths, monkeypatch):
    monkeypatch.setenv("RLMESH_ROLLOUT_ADDRESSES", "10.0.0.1:1,10.0.0.2:1")
    monkeypatch.setenv("RLMESH_LEARNER_ADDRESS", "10.0.0.3:1")
    argv = [a for a in base(paths) if a not in ("--placement", "local")]
    cfg = parse(["--placement", "auto", *argv[0:]])
    assert cfg.placement == "static" and cfg.rollout_addresses == ["10.0.0.1:1", "10.0.0.2:1"]
    monkeypatch.delenv("RLMESH_LEARNER_ADDRESS")
    with pytest.raises(ConfigError, match="--learner_address"):
        parse(["--placement", "auto", *argv])


def test_learner_gets_the_fast_training_paths_on_gpu(paths):
    """On GPUs the learner packs with varlen FlashAttention and takes log-probs from the hidden
    states; on CPU neither is asked for, and --use_liger_kernel is dropped with a warning."""
    from services.coordinator.fleet.placement import learner_argv

    with pytest.warns(GpuOnlyFlagWarning, match="--use_liger_kernel needs a GPU"):
        cpu = parse(base(paths, "--packing_samples", "--use_liger_kernel"))
    argv = learner_argv(cpu, total_steps=4, num_ranks=1)
    assert "--attn_implementation" not in argv and "--logprobs_head" not in argv and "--use_liger_kernel" not in argv
    gpu = parse([a if a != "cpu" else "cuda" for a in base(paths, "--packing_samples", "--use_liger_kernel")])
    gpu.resolve_device(on_gpu=True)
    argv = learner_argv(gpu, total_steps=4, num_ranks=1)
    pairs = dict(zip(argv, argv[1:]))
    assert (pairs["--attn_implementation"], pairs["--logprobs_head"]) == ("varlen", "fused")
    assert "--use_liger_kernel" in argv
    gpu.zero_stage = 3  # the output projection is sharded: full logits
    assert "--logprobs_head" not in learner_argv(gpu, total_steps=4, num_ranks=1)
    assert "--use_dynamic_batch" not in argv
    dynamic = parse(base(paths, "--packing_samples", "--use_dynamic_batch", "--train_max_tokens_per_gpu", "9000"))
    argv = " ".join(learner_argv(dynamic, total_steps=4, num_ranks=1))
    assert "--use_dynamic_batch" in argv and "--train_max_tokens_per_gpu 9000" in argv
    with pytest.raises(ConfigError, match="--use_dynamic_batch sizes micro-batches by their tokens"):
        parse(base(paths, "--use_dynamic_batch"))


@pytest.mark.parametrize("extra, levels", [
    ([], ("token", "token")),
    (["--policy_loss_type", "gspo"], ("token", "sequence")),  # OpenRLHF's GSPO: policy per sequence
    (["--policy_loss_type", "gspo", "--loss_agg_mode", "token_mean"], ("token", "token")),
    (["--loss_agg_mode", "seq-mean-token-mean"], ("sequence", "sequence")),
    (["--loss_agg_mode", "seq_mean_token_sum"], ("sequence_sum", "sequence_sum")),
])
def test_loss_agg_mode(paths, extra, levels):
    assert parse(base(paths, *extra)).loss_levels() == levels


def test_unknown_loss_agg_mode_names_the_choices(paths):
    with pytest.raises(ConfigError, match="seq_mean_token_sum"):
        parse(base(paths, "--loss_agg_mode", "seq_sum"))


@pytest.mark.parametrize("extra, needle", [
    (["--init_kl_coef", "-0.01"], "--init_kl_coef -0.01 must be >= 0"),
    (["--gamma", "1.5"], "--gamma 1.5 must be in [0, 1]"),
    (["--lambd", "-0.1"], "--lambd -0.1 must be in [0, 1]"),
    (["--eps_clip", "-0.2"], "--eps_clip -0.2 must be >= 0"),
    (["--actor_learning_rate", "0"], "--actor_learning_rate 0.0 must be > 0"),
    (["--advantage_estimator", "gae", "--critic_learning_rate=-1e-6"], "--critic_learning_rate -1e-06 must be > 0"),
    (["--generate_max_len", "4096"], "beyond the model's context"),
])
def test_nonsense_values_are_config_errors(paths, extra, needle):
    (paths / "model" / "config.json").write_text('{"max_position_embeddings": 1024}')
    with pytest.raises(ConfigError) as err:
        parse(base(paths, *extra))
    assert needle in str(err.value)


def test_abbreviations_are_rejected(capsys):
    parser = build_parser(CoordinatorConfig)
    for argv in (["--load"], ["--save_hf"], ["--packing"], ["--n_samples", "8"], ["--deepspeed_enable"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert f"unrecognized arguments: {' '.join(argv)}" in capsys.readouterr().err


def test_normalize_reward_without_a_reward_model_says_why_it_does_nothing(paths):
    with pytest.warns(UserWarning, match="--normalize_reward normalises a reward model's scores"):
        parse(base(paths, "--normalize_reward"))


@pytest.mark.parametrize("extra, words", [
    (["--lora_rank", "-2"], "--lora_rank -2 must be >= 0"),
    (["--lora_rank", "8", "--lora_alpha", "0"], "--lora_alpha 0.0 must be > 0"),
    (["--lora_rank", "8", "--lora_dropout", "1"], "--lora_dropout 1.0 must be in [0, 1)"),
    (["--lora_rank", "8", "--lora_dropout", "-0.1"], "--lora_dropout -0.1 must be in [0, 1)"),
    (["--lora_alpha", "32"], "--lora_alpha is a LoRA option, but --lora_rank is 0"),
    (["--target_modules", "q_proj"], "--target_modules is a LoRA option, but --lora_rank is 0"),
    (["--lora_merge_on_save"], "--lora_merge_on_save merges a LoRA adapter"),
    (["--lora_rank", "8", "--vllm_quantization", "awq"], "a quantized engine cannot take"),
    (["--lora_rank", "8", "--target_modules", "all-linear", "q_proj"], "all-linear already means every linear"),
    (["--lora_rank", "8", "--target_modules", "q_proj", "attn_out"],
     "--target_modules attn_out: the model {model} has no such module; its linear modules are q_proj, k_proj, "
     "v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"),
])
def test_lora_flags_are_checked_before_anything_starts(tiny_model_dir, paths, extra, words):
    argv = base(paths, *extra)
    argv[argv.index("--pretrain") + 1] = str(tiny_model_dir)
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert words.format(model=tiny_model_dir) in str(err.value)


def test_lora_flags_reach_the_actors_learner_only(tiny_model_dir, paths):
    from services.coordinator.fleet.placement import learner_argv

    argv = base(paths, "--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj",
                "--lora_dropout", "0.05", "--lora_merge_on_save")
    argv[argv.index("--pretrain") + 1] = str(tiny_model_dir)
    line = " ".join(learner_argv(parse(argv), total_steps=4, num_ranks=1))
    assert ("--lora_rank 16 --lora_alpha 32.0 --target_modules q_proj v_proj --lora_dropout 0.05 "
            "--lora_merge_on_save") in line
    # The learner takes them as the actor's adapter, and the same checks apply there.
    learner = parse_learner(learner_argv(parse(argv), total_steps=4, num_ranks=1))
    assert learner.lora == learner.lora.__class__(16, 32.0, ("q_proj", "v_proj"), 0.05)
    with pytest.raises(ConfigError, match="--target_modules nope: the model"):
        parse_learner(["--pretrain", str(tiny_model_dir), "--lora_rank", "4", "--target_modules", "nope"])


def parse_learner(argv):
    from services.learner.config import LearnerConfig

    return config_from_args(LearnerConfig, build_parser(LearnerConfig).parse_args(argv))


def test_several_engines_per_gpu_when_colocated(paths, monkeypatch):
    """Colocated, engines x TP may be a multiple of the actor's GPUs: each GPU serves as many
    engines, each with its share of the memory (the default divided, a too large share refused),
    and the local placement gives them the actor's GPUs in turn."""
    import torch

    from services.coordinator.fleet.placement import service_specs, start_waves

    argv = base(paths, "--colocate_all_models", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "4")
    cfg = parse(argv)
    assert cfg.engines_per_gpu() == 2
    cfg.vllm_gpu_memory_utilization = 0.0  # as given (parsing on this CPU machine set the CPU default)
    cfg.resolve_device(True)
    assert cfg.vllm_gpu_memory_utilization == 0.25  # 0.5 colocated, over two engines
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    specs = service_specs(cfg, total_steps=1)
    engines = [s for s in specs if "rollout" in s.roles]
    assert [s.gpu_ids for s in engines] == [[0], [1], [0], [1]]
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in engines} == {"0", "1"}
    # The second engine of each GPU starts once the first ones serve (vLLM sizes its cache from the
    # memory left while it starts); everything else starts with the first round.
    waves = start_waves(cfg, specs)
    others = [s.name for s in specs if "rollout" not in s.roles]
    assert [[s.name for s in w] for w in waves] == [others[:1] + ["rollout-0", "rollout-1"] + others[1:],
                                                    ["rollout-2", "rollout-3"]]
    one = parse(base(paths, "--colocate_all_models", "--vllm_num_engines", "1"))
    assert one.engines_per_gpu() == 1
    one.resolve_device(True)
    assert len(start_waves(one, service_specs(one, total_steps=1))) == 1
    cfg.vllm_gpu_memory_utilization = 0.6
    with pytest.raises(ConfigError) as err:
        cfg.resolve_device(True)
    assert "is per engine, and 2 engines share each GPU" in str(err.value) and "at most 0.47" in str(err.value)


def test_an_agent_function_is_a_reward_source(paths, tmp_path):
    """As in OpenRLHF, the agent function returns the rewards: no other reward source is needed, no
    reward service is placed, and one given besides it is not used (unless --agent_rewards reward_service)."""
    from services.coordinator.fleet.placement import role_instances, service_specs

    agent = tmp_path / "agent_func.py"
    agent.write_text("class AgentInstance:\n    pass\n")
    no_reward = [a for a in base(paths) if a not in ("--reward_func", "math")]
    cfg = parse([*no_reward, "--agent_func_path", str(agent)])
    assert cfg.reward_service_needed is False and role_instances(cfg, "reward") == 0
    assert not [s for s in service_specs(cfg, 4) if "reward" in s.roles]
    with pytest.warns(UserWarning, match="--reward_func is not used"):
        cfg = parse(base(paths, "--agent_func_path", str(agent)))
    assert cfg.reward_service_needed is False
    cfg = parse(base(paths, "--agent_func_path", str(agent), "--agent_rewards", "reward_service"))
    assert cfg.reward_service_needed is True and role_instances(cfg, "reward") == 1
    with pytest.raises(ConfigError, match=r"--agent_rewards reward_service scores the agent's episodes .* \(got none\)"):
        parse([*no_reward, "--agent_func_path", str(agent), "--agent_rewards", "reward_service"])
    with pytest.raises(ConfigError, match="or --agent_func_path FILE.py whose agent returns the rewards"):
        parse(no_reward)


def test_async_training_takes_the_learner_sleep_and_partial_agent_rollouts(paths, tmp_path):
    """OpenRLHF's async agent script: --ds.enable_sleep with async (the learner offloads between its
    steps), --train.colocate_all under async (only the DeepSpeed-side models share GPUs) and
    --train.partial_rollout_enable with an agent; vLLM's sleep is refused with async, as there."""
    agent = tmp_path / "agent_func.py"
    agent.write_text("class AgentInstance:\n    pass\n")
    with pytest.warns(UserWarning) as caught:
        cfg = parse(base(paths, "--async_train", "--deepspeed_enable_sleep", "--partial_rollout",
                         "--agent_func_path", str(agent), "--colocate_all_models"))
    assert (cfg.async_train, cfg.deepspeed_enable_sleep, cfg.partial_rollout) == (True, True, True)
    assert (cfg.colocate_all_models, cfg.colocate_actor_ref, cfg.colocate_critic_reward) == (False, True, True)
    assert any("colocates only the reference with the actor" in str(w.message) for w in caught)
    with pytest.raises(ConfigError, match="drop --vllm_enable_sleep"):
        parse(base(paths, "--async_train", "--vllm_enable_sleep"))
