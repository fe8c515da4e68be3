"""SFT, reward-model and DPO training with LoRA (--lora_rank), each a short real run on CPU (one rank).

Checked on the saved folders with plain transformers and PEFT: only the adapter (and a reward model's
head) changed, the PEFT adapter folder and the merged model give the same outputs, an SFT run resumed
from its checkpoint ends with the same adapter as the uninterrupted run, and the DPO reference is the
base model (the margin starts at zero).
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file

from services.common.tiny import boxed_response

ROOT = Path(__file__).resolve().parents[2]
LORA = ["--lora_rank", "4", "--lora_alpha", "8", "--lora_merge_on_save"]


def run(module: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT),
                                            "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def format_preferences(tiny_data_dir: Path, tmp_path: Path) -> Path:
    """96 pairs preferring the boxed answer over a bare wrong one (as in test_offline_trainers.py): a
    preference a tiny model learns in a few steps."""
    rng = random.Random(0)
    rows = [json.loads(line) for line in (tiny_data_dir / "arith_train.jsonl").read_text().splitlines()[:96]]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": boxed_response(int(r["label"])),
                                         "rejected": f"The answer is {int(r['label']) + rng.choice([-2, -1, 1, 2])}"})
                             + "\n" for r in rows))
    return prefs


def unchanged_outside_targets(merged: dict, initial: dict, adapted: tuple[str, ...]) -> None:
    for name, weight in initial.items():
        if name in merged:
            assert torch.equal(merged[name], weight) != name.endswith(adapted), name


def test_sft_with_lora_resumes_and_saves_adapter_and_merged_model(tiny_model_dir, tiny_data_dir, tmp_path):
    def sft(save: Path, *extra: str) -> str:
        return run("services.learner.train_sft", "--pretrain", str(tiny_model_dir), "--dataset",
                   str(tiny_data_dir / "sft.jsonl"), "--input_key", "prompt", "--output_key", "response",
                   "--apply_chat_template", "--max_samples", "64", "--train_batch_size", "16",
                   "--micro_train_batch_size", "8", "--learning_rate", "5e-3", "--lr_scheduler", "cosine_with_min_lr",
                   "--lr_warmup_ratio", "0.25", "--save_steps", "2", "--ckpt_path", str(tmp_path / "ckpt"),
                   "--save_path", str(save), "--seed", "3", "--zero_stage", "2", *LORA, *extra)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    sft(whole)
    assert "checkpoint.loaded" in sft(resumed, "--load_checkpoint")
    first = {m["step"]: m["train/loss"] for m in metrics(whole)}
    second = {m["step"]: m["train/loss"] for m in metrics(resumed)}
    assert sorted(second) == [3, 4] and first[4] < first[1]
    for step in (3, 4):
        assert second[step] == pytest.approx(first[step], abs=1e-5)
    a, b = load_file(str(whole / "adapter_model.safetensors")), load_file(str(resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers x 2 blocks
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)

    merged = load_file(str(whole / "merged" / "model.safetensors"))
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert merged.keys() == initial.keys()
    unchanged_outside_targets(merged, initial, ("_proj.weight",))  # all-linear: every projection, not lm_head
    ids = torch.tensor([[5, 17, 33, 8, 90, 12]])
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        over_base = PeftModel.from_pretrained(base, whole).eval()(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(whole / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, over_base, rtol=1e-4, atol=1e-4)


def test_reward_model_with_lora_under_zero3(tiny_model_dir, tiny_data_dir, tmp_path):
    out = tmp_path / "rm"
    run("services.learner.train_rm", "--pretrain", str(tiny_model_dir), "--dataset",
        str(format_preferences(tiny_data_dir, tmp_path)), "--max_epochs", "2", "--apply_chat_template",
        "--train_batch_size", "32", "--micro_train_batch_size", "16",
        "--learning_rate", "5e-3", "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0",
        "--zero_stage", "3", "--save_path", str(out), "--lora_rank", "4", "--target_modules", "q_proj", "v_proj")
    losses = [m["train/loss"] for m in metrics(out) if "train/loss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    # The adapter folder carries the head; merged/ is the reward model the reward service loads.
    assert any(".score." in name for name in load_file(str(out / "adapter_model.safetensors")))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "merged").eval()
    assert model.config.num_labels == 1 and model.config.std > 0
    merged = load_file(str(out / "merged" / "model.safetensors"))
    unchanged_outside_targets(merged, load_file(str(tiny_model_dir / "model.safetensors")),
                              ("q_proj.weight", "v_proj.weight"))
    from services.reward.model_source import RewardModel

    ids = torch.tensor([5, 17, 33, 8, 90, 12])
    with torch.no_grad():
        own = float(model(ids[None]).logits[0, 0])
    assert RewardModel(str(out / "merged"), device="cpu", dtype="fp32").scores([ids]).tolist() == pytest.approx(
        [own], abs=1e-4)


def test_dpo_with_lora_against_the_base_reference(tiny_model_dir, tiny_data_dir, tmp_path):
    prefs = format_preferences(tiny_data_dir, tmp_path)
    out = tmp_path / "dpo"
    run("services.learner.train_dpo", "--pretrain", str(tiny_model_dir), "--dataset", str(prefs), "--eval_dataset",
        str(prefs), "--apply_chat_template", "--train_batch_size", "16", "--micro_train_batch_size", "16",
        "--learning_rate", "5e-3", "--beta", "0.1", "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0",
        "--save_path", str(out), *LORA)
    evals = [m for m in metrics(out) if "eval/margin" in m]
    assert evals[0]["eval/margin"] == pytest.approx(0.0, abs=1e-5)  # the adapter starts as a no-op
    assert evals[-1]["eval/margin"] > 0.3 and evals[-1]["eval/loss"] < evals[0]["eval/loss"], evals
    unchanged_outside_targets(load_file(str(out / "merged" / "model.safetensors")),
                              load_file(str(tiny_model_dir / "model.safetensors")), ("_proj.weight",))
