"""Start-up validation of the reward service's options."""

import pytest

from services.common.config import ConfigError, config_from_args, build_parser
from services.reward.config import RewardConfig


def parse(*argv: str) -> RewardConfig:
    return config_from_args(RewardConfig, build_parser(RewardConfig).parse_args(list(argv)))


def test_remote_url_kinds(tmp_path):
    cfg = parse("--remote_rm_url", "http://a:5000/get_reward, https://b/get_reward")
    assert (cfg.remote_kind, cfg.remote_urls) == ("http", ["http://a:5000/get_reward", "https://b/get_reward"])
    assert parse("--remote_rm_url", "grpc://a:1,grpc://b:2").remote_kind == "grpc"
    f = tmp_path / "r.py"
    f.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    assert parse("--remote_rm_url", str(f)).remote_kind == "function"
    # A function named in the file (veRL's custom_reward_function.name), as the coordinator passes it on:
    # made absolute against the user's working directory, the name kept.
    from services.common.paths import absolute_paths

    named = absolute_paths("r.py:compute_score", "remote_rm_url")
    assert named.endswith("/r.py:compute_score")
    cfg = parse("--remote_rm_url", f"{f}:compute_score")
    assert (cfg.remote_kind, cfg.remote_urls) == ("function", [f"{f}:compute_score"])


@pytest.mark.parametrize("argv, words", [
    ([], "nothing to serve"),
    (["--reward_func", "math", "--remote_rm_url", "http://a/x"], "one reward source"),
    (["--remote_rm_url", "http://a/x,grpc://b:1"], "not mixed"),
    (["--remote_rm_url", "grpc://nohostport"], "grpc://host:port"),
    (["--remote_rm_url", "missing.py"], "no such reward function file"),
    (["--remote_rm_url", "missing.py:compute_score"], "missing.py:compute_score: no such reward function file"),
    (["--reward_func", "math,style"], "unknown rule(s) ['style']"),
    (["--reward_func", "math", "--reward_clip_range", "1"], "LOW HIGH"),
    (["--reward_func", "math", "--reward_clip_range", "2", "1"], "LOW < HIGH"),
    (["--reward_pretrain", "/nonexistent"], "not a model folder"),
    (["--reward_func", "math", "--remote_rm_timeout_s", "0"], "positive number of seconds"),
    (["--reward_func", "math", "--math_verify_workers", "0"], "must be >= 1"),
])
def test_bad_options_say_what_to_change(argv, words):
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert words in str(err.value)


def test_reference_only_and_clipping_off(tiny_model_dir):
    cfg = parse("--ref_pretrain", str(tiny_model_dir), "--reward_clip_range")
    assert cfg.reward_clip_range == [] and not cfg.rules and not cfg.remote_kind
    assert parse("--reward_func", "math, format").rules == ["math", "format"]
