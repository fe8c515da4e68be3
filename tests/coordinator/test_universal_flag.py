"""--use_ds_universal_ckpt on the coordinator's side: accepted (no longer refused), handed to the
learner, pointless with ZeRO stage 0 (a clear error). The learner's side: tests/learner/test_learner_universal.py."""

import pytest

from services.common.config import ConfigError, build_parser, config_from_args
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.placement import learner_argv


def parse(argv):
    return config_from_args(CoordinatorConfig, build_parser(CoordinatorConfig).parse_args(argv))


@pytest.fixture
def base(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--placement", "local", "--device", "cpu", "--pretrain", str(tmp_path / "model"),
            "--prompt_data", str(tmp_path / "data.jsonl"), "--reward_func", "math", "--label_key", "label",
            "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--train_batch_size", "8",
            "--micro_train_batch_size", "2", "--advantage_estimator", "group_norm", "--load_checkpoint"]


def test_the_flag_reaches_the_learner(base):
    assert "--use_ds_universal_ckpt" in learner_argv(parse([*base, "--use_ds_universal_ckpt"]), 4, num_ranks=1)
    assert "--use_ds_universal_ckpt" not in learner_argv(parse(base), 4, num_ranks=1)


def test_zero_stage_0_needs_no_conversion(base):
    with pytest.raises(ConfigError, match="--use_ds_universal_ckpt converts between ZeRO stages 1, 2 and 3"):
        parse([*base, "--use_ds_universal_ckpt", "--zero_stage", "0"])
