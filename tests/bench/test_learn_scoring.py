"""Job L's scoring on fixed inputs: the one verifier every framework and the evaluator use
(bench/gpu/learn_reward.py, in each framework's calling convention), the evaluator's scores and its
check that the engine holds a checkpoint (learn_eval.py), and the report's comparison (learn_report.py)."""

import json
import pathlib
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import learn_eval  # noqa: E402
import learn_report  # noqa: E402
import learn_reward  # noqa: E402


@pytest.mark.parametrize("response,label,correct", [
    ("12 + 30 = 42. So the answer is \\boxed{42}.", "42", True),
    ("\\boxed{41} wait, 42", "42", False),                      # the boxed answer wins over a later number
    ("The answer is 1,234 apples (from 1000 + 234).", "1234", True),  # stated, commas, before later numbers
    ("First 7 - 9 = -2", "-2", True),                           # the last number, negative
    ("So the result is 3/4", "0.75", True),                     # a fraction equals its decimal
    ("\\boxed{\\frac{3}{4}}", "3/4", True),
    ("$2.50$", "2.5", True),
    ("I cannot tell.", "7", False),                             # no answer at all
    ("The sum is 19.<|im_end|>", "19", True),                   # special tokens of a decoded sequence
    ("The sum is 190", "19", False),
])
def test_the_verifier_reads_the_final_answer(response, label, correct):
    assert learn_reward.is_correct(response, label) is correct


def test_every_frameworks_convention_gives_the_same_verdicts():
    prompt = "<|im_start|>user\nWhat is 5+6?<|im_end|>\n<|im_start|>assistant\n"
    responses, labels = ["5 + 6 = \\boxed{11}", "It is 12"], ["11", "11"]
    # OpenRLHF: the query is prompt + response decoded together; rlmesh also passes the responses
    from_queries = learn_reward.reward_func([prompt + r for r in responses], [prompt] * 2, labels)
    from_responses = learn_reward.reward_func(["x", "y"], ["", ""], labels, responses=responses)
    assert from_queries["rewards"].tolist() == from_responses["rewards"].tolist() == [1.0, 0.0]
    assert from_queries["scores"].tolist() == [1.0, 0.0]
    assert [learn_reward.compute_score("arith", r, lab) for r, lab in zip(responses, labels)] == [1.0, 0.0]
    chats = [[{"role": "assistant", "content": r}] for r in responses]
    assert learn_reward.trl_reward(chats, labels) == learn_reward.trl_reward(responses, labels) == [1.0, 0.0]
    assert learn_eval.score(responses, labels, learn_reward.is_correct) == [1, 0]
    with pytest.raises(ValueError, match="2 responses for 1 labels"):
        learn_eval.score(responses, labels[:1], learn_reward.is_correct)


def test_accuracy_with_wilson_interval_and_per_difficulty():
    a = learn_eval.accuracy([1] * 60 + [0] * 140)
    assert (a["accuracy"], a["correct"], a["n"]) == (0.3, 60, 200)
    assert a["ci95"] == [pytest.approx(0.2407, abs=1e-4), pytest.approx(0.3668, abs=1e-4)]  # Wilson, z = 1.96
    assert learn_eval.accuracy([])["accuracy"] is None
    groups = learn_eval.by_difficulty([1, 0, 1, 1], [1, 1, 2, 10])
    assert list(groups) == ["1", "2", "10"] and groups["1"]["accuracy"] == 0.5 and groups["10"]["n"] == 1


def test_the_engine_check_finds_a_parameter_that_was_not_loaded(tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
               "model.norm.weight": torch.randn(8, generator=g)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    held = learn_eval.parameter_sums((name, t.to(torch.bfloat16)) for name, t in weights.items())
    held["lm_head.other"] = [1.0, 1.0]  # a parameter the checkpoint does not have is not compared
    assert learn_eval.held_mismatches(held, str(tmp_path), torch.bfloat16) == (
        ["model.embed_tokens.weight", "model.norm.weight"], [])
    # one element moved by one bf16 step: the engine holds something else
    stale = weights["model.norm.weight"].to(torch.bfloat16).clone()
    stale[3] = (stale[3].float() * (1 + 2 ** -7)).to(torch.bfloat16)  # bf16 keeps 7 bits of mantissa
    assert stale[3] != weights["model.norm.weight"][3].to(torch.bfloat16)
    held["model.norm.weight"] = learn_eval.parameter_sums([("n", stale)])["n"]
    assert learn_eval.held_mismatches(held, str(tmp_path), torch.bfloat16)[1] == ["model.norm.weight"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        learn_eval.checkpoint_files(str(tmp_path / "missing"))


def _scores():
    point = lambda fw, step, t, acc: {"framework": fw, "step": step, "t_s": t, "accuracy": acc,  # noqa: E731
                                      "ci95": [acc - 0.05, acc + 0.05]}
    return [point("base", 0, 0.0, 0.30),
            point("rlmesh", 4, 60.0, 0.36), point("rlmesh", 8, 80.0, 0.44), point("rlmesh", 12, 100.0, 0.46),
            point("trl", 4, 150.0, 0.34), point("trl", 8, 250.0, 0.45), point("trl", 12, 350.0, 0.45),
            point("openrlhf", 4, 140.0, 0.33), point("openrlhf", 8, 200.0, 0.40), point("openrlhf", 12, 260.0, 0.42),
            {"framework": "openrlhf", "step": 16, "t_s": 300.0, "error": "unreadable"}]


def test_the_report_compares_rlmesh_with_the_best_peer_at_equal_steps_and_in_time(tmp_path):
    curve = learn_report.curves(_scores())
    assert list(curve) == ["rlmesh", "openrlhf", "trl"]
    assert [p["step"] for p in curve["openrlhf"]] == [0, 4, 8, 12]  # the base at step 0, the error left out
    c = learn_report.compare(curve)
    assert c["best_peer"] == "trl" and c["best_peer_final_accuracy"] == 0.45
    assert c["accuracy_gap_by_step"] == {4: pytest.approx(0.02), 8: pytest.approx(-0.01), 12: pytest.approx(0.01)}
    assert c["equal_steps_goal_met"] is True
    # TRL first reached its final 0.45 at 250 s; rlmesh reached 0.45 at 100 s: 0.4 of TRL's time
    assert (c["best_peer_seconds_to_target"], c["subject_seconds_to_target"]) == (250.0, 100.0)
    assert c["time_ratio"] == pytest.approx(0.4) and c["time_goal_met"] is True
    text = learn_report.table(curve, c)
    assert "worst rlmesh - trl gap -1.0 points" in text and "ratio 0.40 (goal: <= 0.5): met" in text, text
    # rlmesh three points below at step 8, and never reaching TRL's final accuracy
    slower = [s if (s["framework"], s["step"]) != ("rlmesh", 12) else {**s, "accuracy": 0.40} for s in _scores()]
    slower = [s if (s["framework"], s["step"]) != ("rlmesh", 8) else {**s, "accuracy": 0.42} for s in slower]
    c2 = learn_report.compare(learn_report.curves(slower))
    assert c2["equal_steps_goal_met"] is False and c2["time_ratio"] is None and c2["time_goal_met"] is False
    assert "did not reach trl's final accuracy" in learn_report.table(learn_report.curves(slower), c2)
    assert "no comparison" in learn_report.compare({"rlmesh": curve["rlmesh"]})["verdict"]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"items": [{"job": "A"}, {"evaluation": {"scores": _scores()}, "model_name": "m"}]}))
    assert learn_report.main([str(results), "--out", str(tmp_path / "l.png")]) == 0
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
