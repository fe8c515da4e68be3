"""SFT, reward-model and DPO training on the tiny model, run as users run them.

Each trainer runs as a real process on CPU (one rank, gloo) through a different entry point
(`rlmesh sft`, `deepspeed --module services.learner.train_rm`, `python -m
services.learner.train_dpo`; SFT and DPO also with --packing_samples); the checks then load the
saved folders with plain transformers, so they do not trust the trainers' own numbers.

The preference data is the kit's arithmetic split turned into a format preference (the boxed
answer over a bare wrong one): a tiny model learns that from a few steps and it carries over to
held-out prompts, which is what the RM and DPO checks measure.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from services.common.tiny import boxed_response

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--apply_chat_template", "--train_batch_size", "32", "--lr_scheduler", "constant_with_warmup",
          "--lr_warmup_ratio", "0", "--seed", "1"]


def run_trainer(command: list[str], timeout: float = 300) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command[:4]} failed (exit {proc.returncode}):\n{output[-4000:]}"
    return output


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tiny_data_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("offline_data")
    rng = random.Random(0)

    def pairs(split: str) -> list[dict]:
        rows = [json.loads(line) for line in (tiny_data_dir / f"arith_{split}.jsonl").read_text().splitlines()]
        return [{"prompt": r["prompt"], "chosen": boxed_response(int(r["label"])),
                 "rejected": f"The answer is {int(r['label']) + rng.choice([-2, -1, 1, 2])}"} for r in rows]

    test_rows = [json.loads(line) for line in (tiny_data_dir / "arith_test.jsonl").read_text().splitlines()]
    return {
        "sft": tiny_data_dir / "sft.jsonl",
        "sft_heldout": write_jsonl(out / "sft_heldout.jsonl", [
            {"prompt": r["prompt"], "response": boxed_response(int(r["label"]))} for r in test_rows[:64]]),
        "prefs": write_jsonl(out / "prefs_train.jsonl", pairs("train")[:192]),
        "prefs_heldout": write_jsonl(out / "prefs_heldout.jsonl", pairs("test")[:64]),
    }


def chat_ids(tokenizer, prompt: str, response: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if response is not None:
        text += response + tokenizer.eos_token
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response_logprob(model, tokenizer, prompt: str, response: str) -> float:
    """Sum of log p(response tokens | prompt) with one unpadded forward pass."""
    n_prompt = len(chat_ids(tokenizer, prompt))
    ids = torch.tensor([chat_ids(tokenizer, prompt, response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return float(picked[n_prompt - 1:].sum())


@pytest.mark.parametrize("packing", [[], ["--packing_samples"]], ids=["padded", "packed"])
def test_sft_lowers_heldout_loss_and_saves_a_loadable_policy(tiny_model_dir, data, tmp_path, packing):
    out = tmp_path / "sft"
    run_trainer([sys.executable, "-m", "services.cli", "sft", "--pretrain", str(tiny_model_dir),
                 "--dataset", str(data["sft"]), "--eval_dataset", str(data["sft_heldout"]),
                 "--input_key", "prompt", "--output_key", "response", "--max_samples", "256",
                 "--micro_train_batch_size", "16", "--learning_rate", "3e-3", "--save_path", str(out), *COMMON,
                 *packing])
    metrics = read_metrics(out)
    evals = [m["eval/loss"] for m in metrics if "eval/loss" in m]
    train = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(train) == 8 and train[-1] < train[0]
    assert evals[-1] < 0.7 * evals[0], evals
    # The saved folder is a plain causal LM with its tokenizer; its held-out loss recomputed here
    # without padding equals the trainer's last evaluation.
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    rows = [json.loads(line) for line in data["sft_heldout"].read_text().splitlines()]
    nll = sum(-response_logprob(model, tokenizer, r["prompt"], r["response"]) for r in rows)
    tokens = sum(len(chat_ids(tokenizer, r["prompt"], r["response"])) - len(chat_ids(tokenizer, r["prompt"]))
                 for r in rows)
    assert nll / tokens == pytest.approx(evals[-1], rel=1e-4)


@pytest.mark.skipif(shutil.which("deepspeed", path=str(Path(sys.executable).parent)) is None,
                    reason="the deepspeed launcher is not installed beside this Python")
def test_reward_model_ranks_heldout_pairs(tiny_model_dir, data, tmp_path):
    out = tmp_path / "rm"
    launcher = str(Path(sys.executable).parent / "deepspeed")
    run_trainer([launcher, "--module", "services.learner.train_rm", "--pretrain", str(tiny_model_dir),
                 "--dataset", str(data["prefs"]), "--eval_dataset", str(data["prefs_heldout"]),
                 "--chosen_key", "chosen", "--rejected_key", "rejected", "--micro_train_batch_size", "32",
                 "--max_epochs", "2", "--learning_rate", "1e-3", "--save_path", str(out), *COMMON])
    metrics = read_metrics(out)
    train = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(train) == 12 and train[-1] < train[0]
    # Scored one sequence at a time by the saved sequence-classification model.
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.std > 0 and "mean" in model.config.to_dict()

    def score(prompt: str, response: str) -> float:
        with torch.no_grad():
            return float(model(torch.tensor([chat_ids(tokenizer, prompt, response)])).logits[0, 0])

    pairs = [json.loads(line) for line in data["prefs_heldout"].read_text().splitlines()]
    chosen = [score(p["prompt"], p["chosen"]) for p in pairs]
    rejected = [score(p["prompt"], p["rejected"]) for p in pairs]
    wins = sum(c > r for c, r in zip(chosen, rejected))
    assert wins / len(pairs) >= 0.9, f"chosen scored higher on {wins}/{len(pairs)} held-out pairs"
    # The reward service's loader reads the folder and gives the same scores (batched, padded).
    from services.reward.model_source import RewardModel

    served = RewardModel(str(out), device="cpu", dtype="fp32").scores(
        [torch.tensor(chat_ids(tokenizer, p["prompt"], p["chosen"])) for p in pairs])
    assert served.tolist() == pytest.approx(chosen, abs=1e-4)


@pytest.mark.parametrize("packing", [[], ["--packing_samples"]], ids=["padded", "packed"])
def test_dpo_raises_the_heldout_log_ratio_margin(tiny_model_dir, data, tmp_path, packing):
    out = tmp_path / "dpo"
    run_trainer([sys.executable, "-m", "services.learner.train_dpo", "--pretrain", str(tiny_model_dir),
                 "--dataset", str(data["prefs"]), "--eval_dataset", str(data["prefs_heldout"]),
                 "--beta", "0.1", "--nll_loss_coef", "0.1", "--micro_train_batch_size", "16",
                 "--learning_rate", "1e-3", "--save_path", str(out), *COMMON, *packing])
    metrics = read_metrics(out)
    evals = [m for m in metrics if "eval/margin" in m]
    assert evals[0]["eval/margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference before training
    assert evals[-1]["eval/margin"] > 0.5 and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    # The margin recomputed here from the saved policy and the untouched reference.
    policy = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    pairs = [json.loads(line) for line in data["prefs_heldout"].read_text().splitlines()]
    margins = []
    for p in pairs:
        chosen = response_logprob(policy, tokenizer, p["prompt"], p["chosen"]) - response_logprob(
            reference, tokenizer, p["prompt"], p["chosen"])
        rejected = response_logprob(policy, tokenizer, p["prompt"], p["rejected"]) - response_logprob(
            reference, tokenizer, p["prompt"], p["rejected"])
        margins.append(0.1 * (chosen - rejected))
    assert sum(margins) / len(margins) == pytest.approx(evals[-1]["eval/margin"], rel=1e-3)
    assert sum(m > 0 for m in margins) / len(margins) >= 0.9
