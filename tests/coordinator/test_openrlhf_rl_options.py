"""OpenRLHF 0.11's RL options that rlmesh takes with their meaning: importance-sampling correction
(--algo.advantage.is_correction_*, and OpenRLHF 0.9's flat names), ProRL's
--reward.stop_properly_penalty_coef, --actor.aux_loss_coef, --rollout.max_tokens_per_gpu; ring
attention refused by name; FlashAttention on a machine without a GPU handled alike by the
coordinator and the offline trainers. Parsing and the coordinator's own maths; the learner's side
is in tests/learner/test_learner_zero2.py and tests/learner/test_moe_aux_loss.py."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from rlmesh.learner.v1 import learner_pb2
from rlmesh.rollout.v1 import rollout_pb2
from services.common.config import ConfigError, build_parser, config_from_args, parse_config
from services.common.openrlhf_names import translate_argv
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.placement import learner_argv
from services.coordinator.loop.advantages import stop_properly_penalty
from services.coordinator.loop.data import Prompt
from services.coordinator.loop.experience import Sample
from services.coordinator.loop.learn import actor_loss, critic_aux_loss_coef, training_batch
from services.learner.train_sft import SFTConfig


def build(cls, args: list[str]):
    return config_from_args(cls, build_parser(cls).parse_args(translate_argv(cls, args)))


@pytest.fixture(scope="module")
def base(tiny_model_dir, tiny_data_dir) -> list[str]:
    return ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset",
            str(tiny_data_dir / "arith_train.jsonl"), "--data.input_key", "prompt", "--data.label_key", "label",
            "--reward_func", "math", "--placement", "local", "--device", "cpu", "--rollout.batch_size", "8",
            "--train.batch_size", "8"]


def correction(base, *extra: str) -> tuple[bool, float, float, str]:
    cfg = build(CoordinatorConfig, [*base, *extra])
    return cfg.use_tis, cfg.tis_low, cfg.tis_cap, cfg.tis_type


@pytest.mark.filterwarnings("ignore")
def test_is_correction_options_with_openrlhf_defaults_and_names(base):
    enable = "--algo.advantage.is_correction_enable"
    assert correction(base, enable) == (True, 0.5, 5.0, "tis")  # OpenRLHF's default band and type
    assert correction(base) == (False, 0.0, 2.0, "tis")
    assert correction(base, enable, "--algo.advantage.is_correction_type", "icepop") == (True, 0.5, 5.0, "icepop")
    assert correction(base, enable, "--algo.advantage.is_correction_threshold", "0.8", "2",
                      "--algo.advantage.is_correction_type", "seq-mask-tis") == (True, 0.8, 2.0, "seq-mask-tis")
    # OpenRLHF 0.9's flat names; a single threshold is OpenRLHF 0.8's cap from above.
    assert correction(base, "--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "3",
                      "--vllm_is_correction_type", "icepop") == (True, 0.5, 3.0, "icepop")
    assert correction(base, "--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "2") == (True, 0, 2, "tis")
    # rlmesh's own flags (veRL's truncated IS is --use_tis --tis_cap).
    assert correction(base, "--use_tis", "--tis_low", "0.25", "--tis_type", "icepop") == (True, 0.25, 2.0, "icepop")
    for extra, words in [((enable, "--vllm_is_correction_type", "tis", "--algo.advantage.is_correction_type", "tis"),
                          "are the same option"),
                         ((enable, "--algo.advantage.is_correction_threshold", "1.5", "5"), "LOW in [0, 1]"),
                         (("--use_tis", "--tis_low", "1.5"), "--tis_low 1.5 must be in [0, 1]")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            build(CoordinatorConfig, [*base, *extra])
    with pytest.raises(ConfigError, match="is_correction_type sequence: give one of tis, icepop, seq-mask-tis"):
        build(CoordinatorConfig, [*base, enable, "--algo.advantage.is_correction_type", "sequence"])


@pytest.mark.parametrize("given, words", [
    (["--algo.advantage.is_correction_threshold", "0.5"], "a single value is the cap from above"),
    (["--algo.advantage.is_correction_threshold"], "expected LOW HIGH (2 numbers), got 0 value(s)"),
    (["--algo.advantage.is_correction_threshold", "0.5", "5", "7"], "expected LOW HIGH (2 numbers), got 3"),
    (["--algo.advantage.is_correction_threshold", "low", "high"], "not numbers"),
    (["--algo.advantage.is_correction_threshold", "0.5", "inf"], "must be finite numbers"),
    (["--algo.advantage.is_correction_threshold", "nan"], "must be finite numbers"),
    (["--algo.advantage.is_correction_threshold", "5", "0.5"], "the band of importance weights must hold 1"),
    (["--algo.advantage.is_correction_type"], "is_correction_type: give one of tis, icepop, seq-mask-tis"),
    (["--algo.advantage.is_correction_type", "tis", "icepop"], "give one of tis, icepop, seq-mask-tis"),
])
def test_a_malformed_is_correction_value_is_one_config_line_naming_the_flag(base, given, words, capsys):
    """Each is refused before anything starts with one line: the option as typed, its values and the fix."""
    with pytest.raises(SystemExit) as exit_:
        parse_config(CoordinatorConfig, [*base, "--algo.advantage.is_correction_enable", *given])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {' '.join(given)}") and err.count("\n") == 1, err
    assert words in err and "Traceback" not in err
    fix = "give LOW HIGH with 0 <= LOW <= 1 <= HIGH, e.g. OpenRLHF's default 0.5 5"
    assert fix in err or "is_correction_type" in given[0]


@pytest.mark.parametrize("given, named", [
    (["--data.max_len", "inf"], "--data.max_len inf"),
    (["--data.max_len", "2048", "--rollout.max_new_tokens", "nan"], "--rollout.max_new_tokens nan"),
    (["--data.max_len"], "--data.max_len"),
    (["--reward.overlong_buffer_len", "12.5"], "--reward.overlong_buffer_len 12.5"),
    (["--rollout.max_new_tokens", "1", "2"], "--rollout.max_new_tokens 1 2"),
])
def test_a_malformed_token_count_is_one_config_line_naming_the_flag(base, given, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(CoordinatorConfig, [*base, *given])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"config error: {named}: expected one whole number of tokens, e.g. 2048"), err


@pytest.mark.filterwarnings("ignore")
def test_is_correction_single_values_and_the_flat_names_in_messages(base):
    enable = "--algo.advantage.is_correction_enable"
    # One value: a cap from above (OpenRLHF 0.8), no lower bound; 1 is the smallest that keeps on-policy tokens.
    assert correction(base, enable, "--algo.advantage.is_correction_threshold", "1") == (True, 0.0, 1.0, "tis")
    assert correction(base, enable, "--algo.advantage.is_correction_threshold", "1", "1") == (True, 1.0, 1.0, "tis")
    with pytest.raises(ConfigError, match=r"^--enable_vllm_is_correction yes: it is a switch"):
        build(CoordinatorConfig, [*base, "--enable_vllm_is_correction", "yes"])
    with pytest.raises(ConfigError, match=r"^--vllm_is_truncated_threshold 0.9: a single value"):
        build(CoordinatorConfig, [*base, "--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.9"])
    with pytest.warns(UserWarning, match="without --algo.advantage.is_correction_enable: no importance-sampling"):
        assert correction(base, "--algo.advantage.is_correction_threshold", "0.5", "5")[0] is False


@pytest.mark.filterwarnings("ignore")
def test_the_learner_gets_the_band_type_and_router_coefficient(base, tiny_moe_model_dir):
    cfg = build(CoordinatorConfig, [*base, "--algo.advantage.is_correction_enable",
                                    "--algo.advantage.is_correction_type", "icepop"])
    loss = actor_loss(cfg, kl_coef=0.0, kl_in_loss=False)
    assert (loss.tis_low, loss.tis_cap, loss.is_correction_type) == (0.5, 5.0, learner_pb2.IS_CORRECTION_TYPE_ICEPOP)
    assert actor_loss(build(CoordinatorConfig, base), 0.0, False).tis_cap == 0.0  # off
    moe = [*base[:1], str(tiny_moe_model_dir), *base[2:]]
    cfg = build(CoordinatorConfig, [*moe, "--actor.aux_loss_coef", "0.001"])
    assert actor_loss(cfg, 0.0, False).aux_loss_coef == pytest.approx(0.001)
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        build(CoordinatorConfig, [*base, "--actor.aux_loss_coef", "0.001"])
    assert build(CoordinatorConfig, [*base, "--actor.aux_loss_coef", "0"]).aux_loss_coef == 0.0
    # OpenRLHF adds the actor's coefficient to the critic's loss too: a MoE critic (here initialised from
    # the actor) gets it; a dense one has no router loss and gets 0, said once.
    gae = [*moe, "--algo.advantage.estimator", "gae", "--actor.aux_loss_coef", "0.001"]
    assert critic_aux_loss_coef(build(CoordinatorConfig, gae)) == pytest.approx(0.001)
    dense_critic = build(CoordinatorConfig, [*gae, "--critic.model_name_or_path", base[1]])
    with pytest.warns(UserWarning, match="is not a mixture-of-experts model, so only the actor's loss gets"):
        assert critic_aux_loss_coef(dense_critic) == 0.0


def test_stop_properly_penalty_hand_computed():
    rewards = torch.tensor([1.0, 0.8, -0.2, 0.6])
    truncated = torch.tensor([True, False, True, False])
    # In [0, 1]: a truncated response's reward times the coefficient; below 0: the coefficient itself.
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([0.5, 0.8, -0.1, 0.6]))
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.0), torch.tensor([0.0, 0.8, 0.0, 0.6]))
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, -0.5), torch.tensor([-0.5, 0.8, -0.5, 0.6]))
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, None), rewards)


@pytest.mark.filterwarnings("ignore")
def test_the_step_trains_on_penalised_rewards(base):
    """Two samples of one prompt, both rewarded 1, the first cut at the length limit. rloo (no whitening):
    coef 0.5 -> rewards [0.5, 1] -> advantages [-0.5, 0.5] on every token; coef -0.5 -> [-0.5, 1] ->
    [-1.5, 1.5]; unset -> [0, 0]."""
    prompt = Prompt(uid="e1-0", text="1+1=", token_ids=(5, 6), label="2", datasource="t")
    samples = [Sample(prompt=prompt, index=i, response_ids=torch.tensor([7, 8, 9]), text="", weight_version=0,
                      finish_reason=rollout_pb2.FINISH_REASON_LENGTH if i == 0 else rollout_pb2.FINISH_REASON_STOP,
                      reward=1.0, old_logprobs=torch.zeros(3)) for i in range(2)]
    args = [*base, "--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "2",
            "--train.batch_size", "2", "--train.micro_batch_size", "1", "--rollout.batch_size", "1"]
    for coef, expected in ((["--reward.stop_properly_penalty_coef", "0.5"], [-0.5, 0.5]),
                           (["--reward.stop_properly_penalty_coef", "-0.5"], [-1.5, 1.5]), ([], [0.0, 0.0])):
        cfg = build(CoordinatorConfig, [*args, *coef])
        batch = training_batch(cfg, samples, kl_coef=0.0, use_ref=False, use_critic=False)
        torch.testing.assert_close(batch["advantages"], torch.tensor(expected)[:, None].expand(2, 3))
        assert batch["truncated"].tolist() == [True, False]
    with pytest.raises(ConfigError, match="--stop_properly_penalty_coef 1.5 must be in \\[0, 1\\]"):
        build(CoordinatorConfig, [*args, "--reward.stop_properly_penalty_coef", "1.5"])


def test_rollout_token_budget_reaches_the_learner(base):
    dynamic = ["--ds.packing_samples", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"]
    cfg = build(CoordinatorConfig, [*base, *dynamic, "--rollout.max_tokens_per_gpu", "8192"])
    argv = " ".join(learner_argv(cfg, 10, 1))
    assert "--train_max_tokens_per_gpu 4096" in argv and "--rollout_max_tokens_per_gpu 8192" in argv
    # Unset: the learner's packed forward passes take --train.max_tokens_per_gpu, as in OpenRLHF.
    assert "--rollout_max_tokens_per_gpu" not in " ".join(learner_argv(build(CoordinatorConfig, [*base, *dynamic]),
                                                                      10, 1))
    with pytest.warns(UserWarning, match="no effect without --use_dynamic_batch"):
        build(CoordinatorConfig, [*base, "--rollout.max_tokens_per_gpu", "8192"])
    with pytest.raises(ConfigError, match="--rollout_max_tokens_per_gpu 0 must be >= 1"):
        build(CoordinatorConfig, [*base, *dynamic, "--rollout.max_tokens_per_gpu", "0"])


def test_ring_attention_is_refused_by_name_with_what_to_use(base):
    for option in ("--ds.ring_attn_size", "--ds.ring_attn_head_stride"):
        with pytest.raises(ConfigError) as err:
            build(CoordinatorConfig, [*base, option, "2"])
        message = str(err.value)
        assert message.startswith(option) and "ring_flash_attn" in message and "flash_attn" in message
        assert "CUDA" in message and "--train.dynamic_batch_enable" in message
    assert build(CoordinatorConfig, [*base, "--ds.ring_attn_size", "1", "--ds.ring_attn_head_stride", "1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without a CUDA GPU")
def test_flash_attention_without_a_gpu_falls_back_to_sdpa_alike(base, tiny_model_dir, tiny_data_dir):
    """The coordinator and the offline trainers (SFT here; RM and DPO share its config) take
    --ds.attn_implementation flash_attention_2 without a GPU the same way: a warning naming sdpa, and sdpa."""
    said = []
    for cls, args in ((CoordinatorConfig, base), (SFTConfig, ["--model.model_name_or_path", str(tiny_model_dir),
                                                             "--data.dataset", str(tiny_data_dir / "sft.jsonl")])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = build(cls, [*args, "--ds.attn_implementation", "flash_attention_2"])
        messages = [str(w.message) for w in caught if "sdpa" in str(w.message)]
        assert len(messages) == 1, [str(w.message) for w in caught]
        said.append(messages[0].split(" needs ", 1)[1])
        if cls is CoordinatorConfig:
            assert not cfg.flash_attn and "--attn_implementation" not in learner_argv(cfg, 10, 1)  # sdpa
        else:
            assert cfg.attn_implementation == "sdpa"
    assert said[0] == said[1] and "this machine has none: training with sdpa attention instead" in said[0]
    # The offline trainers' own --flash_attn says the same.
    with pytest.warns(UserWarning, match="--flash_attn needs a CUDA GPU and this machine has none"):
        cfg = build(SFTConfig, ["--pretrain", str(tiny_model_dir), "--dataset", "x.jsonl", "--flash_attn"])
    assert dataclasses.asdict(cfg)["attn_implementation"] == "sdpa"
