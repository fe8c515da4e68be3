"""What reward functions get in a real run, as OpenRLHF gives it: the decoded sequence as the query
(chat template and special tokens kept), and a scalar "extra_logs" entry logged as a batch metric."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.coordinator.conftest import finish, read_metrics, start_coordinator

# OpenRLHF's examples/python/math_reward_func.py in shape: tensor rewards, one accuracy per call.
REWARD_FILE = """import json
import torch

def reward_func(queries, prompts, labels, responses, **kwargs):
    with open({log!r}, "a") as log:
        for q, p, r in zip(queries, prompts, responses):
            log.write(json.dumps({{"query": q, "prompt": p, "response": r, "calls": len(queries)}}) + "\\n")
    rewards = torch.tensor([1.0 if label in r else 0.0 for r, label in zip(responses, labels)])
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{"math_accuracy": rewards.mean()}}}}
"""


def test_function_file_gets_openrlhf_queries_and_its_batch_accuracy_is_logged(tiny_model_dir, tiny_data_dir,
                                                                              tmp_path):
    calls = tmp_path / "calls.jsonl"
    reward_file = tmp_path / "math_reward_func.py"
    reward_file.write_text(REWARD_FILE.format(log=str(calls)))
    argv = ["--pretrain", str(tiny_model_dir), "--prompt_data", str(tiny_data_dir / "arith_train.jsonl"),
            "--input_key", "prompt", "--label_key", "label", "--apply_chat_template",
            "--remote_rm_url", str(reward_file), "--remote_rm_batch_size", "3",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
            "--micro_rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--generate_max_len", "32", "--temperature", "1.0", "--init_kl_coef", "0", "--max_steps", "1",
            "--rollout_engine", "hf", "--run_dir", str(tmp_path / "run"), "--ckpt_path", str(tmp_path / "ckpt"),
            "--save_path", "", "--no-plots"]
    log = tmp_path / "coordinator.log"
    proc = start_coordinator("services.coordinator", argv, log)
    output = finish(proc, log, timeout_s=420)
    assert proc.returncode == 0, output[-6000:]

    records = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(records) == 16 and {r["calls"] for r in records} <= {1, 2, 3}
    specials = AutoTokenizer.from_pretrained(tiny_model_dir).all_special_tokens
    with_specials = 0
    for r in records:
        # The prompt as the model saw it, chat template and all, then the generated tokens decoded with
        # special tokens kept (the tiny random model emits EOS, <|im_start|>, <|pad|>): the response text
        # is the same without them, so prompt + response, what reward servers got before, lacks them.
        assert r["prompt"].startswith("<|im_start|>user\n") and r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["query"].startswith(r["prompt"])
        generated = r["query"][len(r["prompt"]):]
        without = generated
        for token in specials:
            without = without.replace(token, "")
        assert without == r["response"], r
        with_specials += generated != r["response"]
    print(f"{with_specials} of {len(records)} queries hold special tokens the response text lacks")
    assert with_specials, "no reply held a special token; the test cannot tell the query from prompt + response"

    [metrics] = read_metrics(tmp_path / "run")
    # The accuracy came as one number per call of up to 3 samples; logged as a batch metric, weighted by
    # each call's samples, it is the accuracy of the step's 16 samples: the mean 0/1 reward.
    assert metrics["reward/math_accuracy"] == pytest.approx(metrics["reward/mean"])
