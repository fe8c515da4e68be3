"""Job L (bench/gpu/learn_peers.py): every framework's command carries the same learning problem,
the inputs are selected as documented, and a checkpoint is timed only once it is whole on disk."""

import json
import pathlib
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import learn_commands as lc  # noqa: E402
import learn_peers  # noqa: E402


def _inputs(tmp_path):
    return lc.Inputs(model=tmp_path / "model", prompts=tmp_path / "p.jsonl", heldout=tmp_path / "h.jsonl",
                     verifier=tmp_path / "learn_reward.py", verl_data=tmp_path / "p.parquet")


def _value(cmd, flag, n=1):
    i = cmd.index(flag)
    return cmd[i + 1:i + 1 + n] if n > 1 else cmd[i + 1]


def test_the_four_commands_share_the_learning_problem(tmp_path):
    s = lc.Settings(steps=12, eval_every=3, learning_rate=3e-6, prompts_per_step=16, samples_per_prompt=4,
                    max_new_tokens=200, prompt_max_len=100, micro_batch=16, temperature=0.8)
    inputs = _inputs(tmp_path)
    cmds = {}
    for framework, make in lc.COMMANDS.items():
        (tmp_path / framework).mkdir()
        cmds[framework] = make(s, inputs, tmp_path / framework, tmp_path / "scratch" / framework)
    rl, orl, verl = cmds["rlmesh"], cmds["openrlhf"], dict(a.split("=", 1) for a in cmds["verl"][3:])
    trl = json.loads((tmp_path / "trl" / "trl_settings.json").read_text())
    assert cmds["trl"][-1] == str(tmp_path / "trl" / "trl_settings.json")
    g = trl["grpo_config"]
    # learning rate, constant, no warm-up
    assert _value(rl, "--actor_learning_rate") == _value(orl, "--actor.adam.lr") == "3e-06"
    assert g["learning_rate"] == float(verl["actor_rollout_ref.actor.optim.lr"]) == 3e-6
    assert _value(rl, "--lr_scheduler") == _value(orl, "--actor.lr_scheduler") == "constant_with_warmup"
    assert g["lr_scheduler_type"] == verl["actor_rollout_ref.actor.optim.lr_scheduler_type"] == "constant"
    # AdamW betas, no weight decay, clipping at 1.0
    assert _value(rl, "--adam_betas", 2) == _value(orl, "--actor.adam.betas", 2) == ["0.9", "0.95"]
    assert (g["adam_beta1"], g["adam_beta2"]) == (0.9, 0.95) and verl["actor_rollout_ref.actor.optim.betas"] == "[0.9,0.95]"
    assert _value(rl, "--l2") == _value(orl, "--actor.adam.weight_decay") == "0" and g["weight_decay"] == 0.0
    assert verl["actor_rollout_ref.actor.optim.weight_decay"] == "0.0"
    # batch: 16 prompts x 4 samples, one optimizer step per 64 samples, 12 steps
    assert _value(rl, "--rollout_batch_size") == _value(orl, "--rollout.batch_size") == "16"
    assert verl["data.train_batch_size"] == verl["actor_rollout_ref.actor.ppo_mini_batch_size"] == "16"
    assert _value(rl, "--n_samples_per_prompt") == _value(orl, "--rollout.n_samples_per_prompt") == "4"
    assert g["num_generations"] == int(verl["actor_rollout_ref.rollout.n"]) == 4
    assert _value(rl, "--train_batch_size") == _value(orl, "--train.batch_size") == "64"
    assert g["per_device_train_batch_size"] * g["gradient_accumulation_steps"] == 64
    assert _value(rl, "--max_steps") == "12" and g["max_steps"] == 12 and verl["trainer.total_training_steps"] == "12"
    assert _value(orl, "--data.max_samples") == "192"  # 12 steps x 16 prompts, one pass
    # lengths and sampling
    assert _value(rl, "--generate_max_len") == _value(orl, "--rollout.max_new_tokens") == "200"
    assert g["max_completion_length"] == int(verl["data.max_response_length"]) == 200
    assert _value(rl, "--prompt_max_len") == verl["data.max_prompt_length"] == "100"
    assert _value(orl, "--data.max_len") == verl["actor_rollout_ref.rollout.max_model_len"] == "300"
    assert _value(rl, "--temperature") == _value(orl, "--rollout.temperature") == "0.8" == verl["actor_rollout_ref.rollout.temperature"]
    assert g["temperature"] == 0.8 and g["top_p"] == 1.0
    # GRPO without KL, no reference, no entropy term; the same verifier file
    assert _value(rl, "--advantage_estimator") == _value(orl, "--algo.advantage.estimator") == "group_norm"
    assert verl["algorithm.adv_estimator"] == "grpo" and g["scale_rewards"] == "group"
    assert _value(rl, "--init_kl_coef") == _value(orl, "--algo.kl.init_coef") == "0" and g["beta"] == 0.0
    assert verl["actor_rollout_ref.actor.use_kl_loss"] == verl["algorithm.use_kl_in_reward"] == "False"
    assert g["vllm_importance_sampling_correction"] is False
    assert _value(rl, "--remote_rm_url") == _value(orl, "--reward.remote_url") == str(inputs.verifier) == trl["verifier"]
    assert verl["reward.custom_reward_function.path"] == str(inputs.verifier)
    assert verl["reward.custom_reward_function.name"] == "compute_score"
    assert "--apply_chat_template" in rl and "--data.apply_chat_template" in orl
    # an HF checkpoint every 3 steps, all kept
    assert _value(rl, "--save_steps") == _value(orl, "--ckpt.save_steps") == "3" and g["save_steps"] == 3
    assert verl["trainer.save_freq"] == "3" and verl["actor_rollout_ref.actor.checkpoint.save_contents"] == "[hf_model]"
    assert "--save_hf_ckpt" in rl and {"--ckpt.save_hf", "--ckpt.disable_ds"} <= set(orl) and g["save_only_model"]
    assert _value(rl, "--max_ckpt_num") == _value(orl, "--ckpt.max_num") == verl["trainer.max_actor_ckpt_to_keep"] == "5"
    # no gradient checkpointing anywhere; fp32 master weights in TRL
    assert "--gradient_checkpointing" not in rl and "--actor.gradient_checkpointing_enable" not in orl
    assert g["gradient_checkpointing"] is False and verl["actor_rollout_ref.model.enable_gradient_checkpointing"] == "False"
    assert g["model_init_kwargs"] == {"dtype": "float32"} and g["bf16"] is True


def test_parse_args_checks_the_steps_and_the_inputs(capsys):
    args = learn_peers.parse_args(["--steps", "8", "--eval_every", "4", "--learning_rate", "2e-6"])
    s = learn_peers.settings_of(args)
    assert (s.steps, s.eval_every, s.learning_rate, s.checkpoints) == (8, 4, 2e-6, 2)
    assert args.frameworks == ["rlmesh", "openrlhf", "trl"]
    for bad, message in ((["--steps", "10", "--eval_every", "4"], "multiple of --eval_every"),
                         (["--micro_batch", "7"], "must divide"), (["--train_file", "t.jsonl"], "go together")):
        with pytest.raises(SystemExit):
            learn_peers.parse_args(bad)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        learn_peers.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "wall-clock limit of ONE framework's run" in help_text and "Not included: the build" in help_text


def test_rows_are_selected_after_a_seeded_shuffle_and_never_shared(tmp_path):
    train = [{"prompt": f"{i}+1=", "label": str(i + 1), "difficulty": i % 3} for i in range(100)]
    test = [{"prompt": f"{i}+2=", "label": str(i + 2), "difficulty": 1} for i in range(30)]
    s = lc.Settings(steps=4, eval_every=2, prompts_per_step=8)
    chosen, heldout = learn_peers.select_rows(train, test, s, eval_size=20)
    assert len(chosen) == 32 and len(heldout) == 20
    assert chosen != train[:32] and chosen == learn_peers.select_rows(train, test, s, 20)[0]  # shuffled, seeded
    with pytest.raises(SystemExit, match="4 steps x 8 prompts = 32"):
        learn_peers.select_rows(train[:31], test, s, 20)
    with pytest.raises(SystemExit, match="held-out rows"):
        learn_peers.select_rows(train, test, s, 31)
    with pytest.raises(SystemExit, match="held-out prompts are training prompts too"):
        learn_peers.select_rows(train, train[:40], s, 40)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": 2}) + "\n")
    args = learn_peers.parse_args(["--input_key", "question", "--label_key", "answer"])
    assert learn_peers.read_rows(path, args) == [{"prompt": "1+1=", "label": "2", "difficulty": "-"}]
    with pytest.raises(SystemExit, match="line 1 has no 'prompt'"):
        learn_peers.read_rows(path, learn_peers.parse_args([]))


def _write_hf(folder: pathlib.Path, truncate: int = 0) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.ones(64, 64), "b": torch.zeros(64)}, str(folder / "model.safetensors"))
    if truncate:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:-truncate])


@pytest.mark.parametrize("framework,folder", [("rlmesh", "ckpt/global_step_{}_hf"), ("openrlhf", "ckpt/global_step{}_hf"),
                                              ("trl", "out/checkpoint-{}"), ("verl", "ckpt/global_step_{}/actor/huggingface")])
def test_a_checkpoint_is_timed_once_whole_on_disk(tmp_path, framework, folder):
    clock = learn_peers.CheckpointClock(framework, tmp_path)
    _write_hf(tmp_path / folder.format(4), truncate=100)  # being written
    clock.poll(10.0)
    assert clock.checkpoints() == []
    (tmp_path / folder.format(4) / "model.safetensors").unlink()
    (tmp_path / folder.format(4) / "config.json").unlink()
    (tmp_path / folder.format(4)).rmdir()
    _write_hf(tmp_path / folder.format(4))
    _write_hf(tmp_path / folder.format(8))
    clock.poll(12.5)
    clock.poll(20.0)  # seen before: keeps its first time
    assert [(c["step"], c["t_s"]) for c in clock.checkpoints()] == [(4, 12.5), (8, 12.5)]
    assert clock.checkpoints()[0]["path"] == str(tmp_path / folder.format(4))


def test_a_sharded_checkpoint_is_whole_when_every_listed_shard_is(tmp_path):
    folder = tmp_path / "hf"
    _write_hf(folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not learn_peers.checkpoint_complete(folder)
    save_file({"b": torch.zeros(3)}, str(folder / "model-00002-of-00002.safetensors"))
    assert learn_peers.checkpoint_complete(folder)
    assert not learn_peers.safetensors_complete(folder / "config.json")
