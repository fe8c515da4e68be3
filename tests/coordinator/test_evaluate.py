"""pass@k, the evaluation summary and the agent runs' episode evaluation (the service path runs in
tests/test_quickstart.py and tests/test_async_and_agent_learning.py)."""

import math

import pytest

from services.common.config import parse_config
from services.coordinator.loop.agent import Outcome
from services.coordinator.cli.eval_cli import EvalConfig
from services.common.confidence import bootstrap_mean_interval, wilson_interval
from services.coordinator.loop.evaluate import PromptResult, decoding_keys, is_correct, pass_at_k, summarize


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
    assert single == {"eval/pass@1": 1.0, "eval/pass@1_ci_low": pytest.approx(0.2065, abs=1e-4),
                      "eval/pass@1_ci_high": 1.0, "eval/response_length": 3.0, "eval/prompts": 1.0}


def test_pass_at_1_intervals_per_source_and_difficulty():
    """Greedy (one sample per prompt): Wilson's interval of the count; several samples: the bootstrap of
    the per-prompt shares. Scopes: each data source, and each difficulty within a source."""
    greedy = ([PromptResult("arith", [True], [4], "1") for _ in range(6)]
              + [PromptResult("arith", [False], [4], "1") for _ in range(2)]
              + [PromptResult("arith", [i < 1], [4], "10") for i in range(4)]
              + [PromptResult("arith", [False], [4], "2") for _ in range(2)])
    m = summarize(greedy, n=1)
    assert (m["eval/pass@1_ci_low"], m["eval/pass@1_ci_high"]) == wilson_interval(7, 14)
    assert m["eval/by_difficulty/1/pass@1"] == 0.75 and m["eval/by_difficulty/10/prompts"] == 4.0
    assert (m["eval/by_difficulty/1/pass@1_ci_low"], m["eval/by_difficulty/1/pass@1_ci_high"]) == wilson_interval(6, 8)
    assert m["eval/by_difficulty/2/pass@1_ci_low"] == 0.0 < m["eval/by_difficulty/2/pass@1_ci_high"]
    assert [k.split("/")[2] for k in m if k.endswith("/prompts") and "by_difficulty" in k] == ["1", "2", "10"]
    assert not any(k.startswith("eval/arith/") for k in m)  # one data source: no per-source keys

    sampled = [PromptResult("arith", [True, True, False, False], [4] * 4, "1"),
               PromptResult("arith", [True] * 4, [4] * 4, "2"),
               PromptResult("count", [False] * 4, [4] * 4),
               PromptResult("count", [True, False, False, False], [4] * 4)]
    m = summarize(sampled, n=4)
    assert m["eval/pass@1"] == pytest.approx(0.4375)
    assert (m["eval/pass@1_ci_low"], m["eval/pass@1_ci_high"]) == bootstrap_mean_interval([0.5, 1.0, 0.0, 0.25])
    assert (m["eval/count/pass@1_ci_low"], m["eval/count/pass@1_ci_high"]) == bootstrap_mean_interval([0.0, 0.25])
    assert m["eval/arith/by_difficulty/2/pass@1"] == 1.0 and "eval/count/by_difficulty/none/pass@1" not in m
    # The same keys named after the decoding, for a report that holds greedy and sampled numbers.
    named = decoding_keys(m, "sampled")
    assert named["eval/sampled_pass@1"] == m["eval/pass@1"]
    assert named["eval/arith/by_difficulty/1/sampled_pass@1_ci_high"] == m["eval/arith/by_difficulty/1/pass@1_ci_high"]
    assert len(named) == 3 * sum(k.endswith("pass@1") for k in m) and not any("pass@4" in k for k in named)


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


def test_rlmesh_eval_starts_services_and_reports_per_source(tiny_model_dir, tmp_path):
    """`rlmesh eval` with its own rollout (transformers engine) and reward services. The reward
    function pays 1 exactly on rows labelled "yes", so the expected numbers do not depend on what a
    random model writes: they check the rows, samples, verdicts and per-source split end to end."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "reward.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    return [1.0 if label == 'yes' else 0.0 for label in labels]\n")
    rows = {"a": ["yes", "no", "yes", "yes"], "b": ["no", "no"]}
    for name, labels in rows.items():  # a's rows alternate difficulties 1 and 2; b's have none
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": f"{i}+1=", "label": label, **({"difficulty": i % 2 + 1} if name == "a" else {})})
            + "\n" for i, label in enumerate(labels)))
    out = tmp_path / "metrics.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "protos")])}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", "--pretrain", str(tiny_model_dir),
         "--dataset", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}", "--input_key", "prompt",
         "--remote_rm_url", str(tmp_path / "reward.py"), "--rollout_engine", "hf", "--device", "cpu",
         "--n_samples_per_prompt", "2", "--temperature", "1.0", "--generate_max_len", "6", "--prompt_max_len", "16",
         "--run_dir", str(tmp_path / "run"), "--output", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    m = json.loads(out.read_text())
    assert m["eval/prompts"] == 6.0 and m["eval/pass@1"] == pytest.approx(0.5) and m["eval/pass@2"] == pytest.approx(0.5)
    assert m["eval/a/pass@1"] == pytest.approx(0.75) and m["eval/b/pass@2"] == 0.0
    assert 0 < m["eval/response_length"] <= 6
    # Sampled pass@1 with the bootstrap interval over prompts, and greedy pass@1 (a second pass, one
    # sample per prompt) with Wilson's, overall, per source and per difficulty.
    assert m["eval/sampled_pass@1"] == m["eval/pass@1"] and m["eval/greedy_pass@1"] == pytest.approx(0.5)
    assert (m["eval/sampled_pass@1_ci_low"], m["eval/sampled_pass@1_ci_high"]) == \
        pytest.approx(bootstrap_mean_interval([1, 0, 1, 1, 0, 0]))
    assert (m["eval/greedy_pass@1_ci_low"], m["eval/greedy_pass@1_ci_high"]) == pytest.approx(wilson_interval(3, 6))
    assert m["eval/a/by_difficulty/1/greedy_pass@1"] == 1.0 and m["eval/a/by_difficulty/2/sampled_pass@1"] == 0.5
    assert (m["eval/a/by_difficulty/2/greedy_pass@1_ci_low"], m["eval/a/by_difficulty/2/greedy_pass@1_ci_high"]) == \
        pytest.approx(wilson_interval(1, 2))
    assert not any("by_difficulty" in k for k in m if k.startswith("eval/b/"))
    assert m["eval/greedy_seconds"] > 0 and "eval.greedy.done" in proc.stderr


def _episode(index, tokenizer, prompt, turns, reward, solved):
    """An agent.Outcome as an agent worker returns it: the prompt's tokens, then model turns with the
    environment's feedback between them (action_ranges: the model's tokens)."""
    ids, ranges = list(tokenizer(prompt)["input_ids"]), []
    for k, (action, feedback) in enumerate(turns):
        start = len(ids)
        ids += tokenizer(action)["input_ids"]
        ranges.append((start, len(ids)))
        if k + 1 < len(turns):
            ids += tokenizer(feedback)["input_ids"]
    result = {"reward": reward, "observation_tokens": ids, "action_ranges": ranges,
              "extra_logs": {"solved": float(solved), "attempts": float(len(turns))}}
    return Outcome(index, result=result)


def test_episode_evaluation_judges_whole_episodes(tiny_model_dir):
    from transformers import AutoTokenizer

    from services.coordinator.loop.data import Prompt
    from services.coordinator.loop.evaluate import _episode_batch, episode_metrics

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [Prompt(f"p{i}", f"{i}+1=", tuple(tok(f"{i}+1=")["input_ids"]), str(i + 1), "arith") for i in range(3)]
    right = _episode(0, tok, "0+1=", [("\\boxed{1}", "")], 1.0, True)  # right at once
    retried = _episode(0, tok, "1+1=", [("\\boxed{3}", " wrong, again: 1+1="), ("\\boxed{2}", "")], 0.5, True)
    outcomes = [(prompts[0], right), (prompts[1], retried), (prompts[2], Outcome(0, error="the agent code raised"))]
    finished = [right, retried]
    m = episode_metrics(prompts, 1, outcomes, [o.result["reward"] for o in finished],
                        [o.result["extra_logs"] for o in finished])
    assert m["eval/pass@1"] == pytest.approx(1 / 3)  # reward >= 1: right at the first attempt; failed: unsolved
    assert m["eval/solved"] == 1.0 and m["eval/attempts"] == 1.5  # the agent's logs, over episodes that ended
    assert m["eval/reward"] == pytest.approx(1.5 / 3) and m["eval/failed_episodes"] == 1.0
    model_tokens = [sum(e - s for s, e in o.result["action_ranges"]) for o in finished]
    assert m["eval/turns_mean"] == 1.5 and m["eval/response_length"] == pytest.approx(sum(model_tokens) / 2)

    # --agent_rewards reward_service: the service sees the episode from the first model token to the
    # last, the environment's feedback included, and its verdict (extra "accuracy") judges it.
    batch = _episode_batch(outcomes[:2], tok, None)
    assert [r.replace(" ", "") for r in batch.responses] == ["\\boxed{1}", "\\boxed{3}wrong,again:1+1=\\boxed{2}"]
    assert batch.queries == [p.text + r for p, r in zip(prompts, batch.responses)] and batch.labels == ["1", "2"]
    assert batch.sample_ids == ["p0/0", "p1/0"]
    m = episode_metrics(prompts[:2], 1, outcomes[:2], [0.0, 0.0], [{"accuracy": 1.0}, {"accuracy": 0.0}])
    assert m["eval/pass@1"] == 0.5 and m["eval/reward"] == 0.0 and m["eval/accuracy"] == 0.5
