"""Reward models: both checkpoint layouts, scores at the last real token, normalisation, dtypes."""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from services.common.config import ConfigError
from services.reward.model_source import ModelRewardSource, RewardModel, last_token_values
from services.reward.source import ScoreBatch

TEXTS = ["1+2=The answer is \\boxed{3}", "7-5=", "12+30=The answer is \\boxed{42}<|im_end|>",
         "Good morning, how are you today? I am fine, thank you.", "9"]


@pytest.fixture(scope="module")
def hf_scores(tiny_reward_model_dir):
    """Reference: Hugging Face's own classifier, one unpadded sequence at a time."""
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    with torch.inference_mode():
        return np.array([model(torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits.item()
                         for t in TEXTS])


@pytest.fixture(scope="module")
def value_head_dir(tiny_reward_model_dir, tmp_path_factory):
    """The tiny reward model rewritten in the value-head layout, with normalisation stats in its config."""
    out = tmp_path_factory.mktemp("value_head_rm")
    for f in tiny_reward_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["Qwen2Model"], value_head_prefix="value_head", normalize_reward=True,
                  mean=0.25, std=2.0)
    (out / "config.json").write_text(json.dumps(config))
    return out


def score(source, batch):
    return asyncio.run(source.score(batch))


def test_scores_match_hf_classifier_with_padding_and_sorting(tiny_reward_model_dir, hf_scores):
    """Mixed lengths in micro-batches of 2: each score equals the unpadded HF score, in request order."""
    model = RewardModel(str(tiny_reward_model_dir), device="cpu", micro_batch_size=2)
    out = score(ModelRewardSource(model), ScoreBatch.from_texts(TEXTS, [""] * len(TEXTS)))
    np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(out.rewards, out.scores)
    assert np.ptp(hf_scores) > 1e-3  # the texts really score differently


def test_token_id_input_equals_text_input(tiny_reward_model_dir, hf_scores):
    model = RewardModel(str(tiny_reward_model_dir), device="cpu")
    ids = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = ScoreBatch.from_texts([""] * len(TEXTS), [""] * len(TEXTS),
                                  prompt_token_ids=[torch.tensor(i[:1]) for i in ids],
                                  response_token_ids=[torch.tensor(i[1:]) for i in ids])
    out = score(ModelRewardSource(model, use_token_ids=True), batch)
    np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=1e-5)


def test_value_head_layout_with_normalisation(value_head_dir, hf_scores):
    model = RewardModel(str(value_head_dir), device="cpu", micro_batch_size=3)
    assert model.head_name == "value_head"
    out = score(ModelRewardSource(model, normalize=True), ScoreBatch.from_texts(TEXTS, [""] * len(TEXTS)))
    np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out.rewards, (hf_scores - 0.25) / 2.0, rtol=0, atol=1e-5)


def test_bf16_is_close_to_fp32(tiny_reward_model_dir, hf_scores):
    model = RewardModel(str(tiny_reward_model_dir), device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    out = score(ModelRewardSource(model), ScoreBatch.from_texts(TEXTS, [""] * len(TEXTS)))
    np.testing.assert_allclose(out.scores, hf_scores, rtol=0, atol=0.05)


def test_missing_head_and_missing_stats_are_config_errors(tiny_reward_model_dir):
    with pytest.raises(ConfigError, match="no 'value_head.weight'.*--value_head_prefix"):
        RewardModel(str(tiny_reward_model_dir), device="cpu", value_head_prefix="value_head")
    model = RewardModel(str(tiny_reward_model_dir), device="cpu")
    with pytest.raises(ConfigError, match="no 'mean' and 'std'"):
        ModelRewardSource(model, normalize=True)


def test_last_token_values_left_and_right_padding():
    values = torch.arange(12.0).reshape(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert last_token_values(values, mask).tolist() == [1.0, 7.0, 11.0]
