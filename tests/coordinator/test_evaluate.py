"""pass@k and the evaluation summary (the service path runs in tests/test_quickstart.py)."""

import math

import pytest

from services.common.config import parse_config
from services.coordinator.evaluate import EvalConfig, PromptResult, is_correct, pass_at_k, summarize


def test_pass_at_k_matches_the_combinatorial_definition():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at_k(8, 3, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summary_overall_and_per_datasource():
    results = [PromptResult("gsm", [True, False, False, False], [10, 12, 8, 10]),
               PromptResult("gsm", [False] * 4, [5, 5, 5, 5]),
               PromptResult("math", [True] * 4, [20, 20, 20, 20])]
    m = summarize(results, n=4)
    assert m["eval/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/response_length"] == pytest.approx((40 + 20 + 80) / 12)
    assert m["eval/gsm/pass@1"] == pytest.approx(0.125) and m["eval/gsm/pass@4"] == 0.5
    assert m["eval/math/prompts"] == 1.0
    single = summarize([PromptResult("a", [True], [3])], n=1)
    assert single == {"eval/pass@1": 1.0, "eval/response_length": 3.0, "eval/prompts": 1.0}


def test_verdict_prefers_the_sources_accuracy():
    assert is_correct(0.0, {"accuracy": 1.0}, pass_reward=1.0)
    assert not is_correct(5.0, {"accuracy": 0.0}, pass_reward=1.0)
    assert is_correct(1.0, {}, pass_reward=1.0) and not is_correct(0.9, {}, pass_reward=1.0)


def test_eval_flags(tiny_model_dir, capsys):
    base = ["--pretrain", str(tiny_model_dir), "--dataset", "x.jsonl"]
    cfg = parse_config(EvalConfig, base + ["--reward_func", "math", "--device", "cpu"])
    assert cfg.vllm_gpu_memory_utilization == 0.1
    for extra, message in [([], "exactly one reward source"),
                           (["--reward_func", "math", "--n_samples_per_prompt", "4"], "identical samples")]:
        with pytest.raises(SystemExit):
            parse_config(EvalConfig, base + extra)
        assert message in capsys.readouterr().err
