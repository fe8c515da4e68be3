"""Reward and reference models on a CUDA GPU (skipped without one)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from services.common.logprobs import sequence_logprobs
from services.reward.model_source import RewardModel
from services.reward.reference import ReferenceModel

pytestmark = pytest.mark.requires_cuda

TEXTS = ["1+2=The answer is \\boxed{3}", "7-5=", "Good morning, how are you today? I am fine, thank you.", "9"]


def hf_scores(model_dir, device):
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.inference_mode():
        return np.array([model(torch.tensor([tok(t, add_special_tokens=False)["input_ids"]], device=device)).logits.item()
                         for t in TEXTS])


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.05)])
def test_reward_model_on_gpu_matches_hf(tiny_reward_model_dir, dtype, atol):
    model = RewardModel(str(tiny_reward_model_dir), device="cuda", dtype=dtype, micro_batch_size=2)
    assert model.device.type == "cuda" and model.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ids = [torch.tensor(model.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    np.testing.assert_allclose(model.scores(ids), hf_scores(tiny_reward_model_dir, "cuda"), rtol=0, atol=atol)


def test_auto_picks_bf16_on_gpu(tiny_reward_model_dir):
    model = RewardModel(str(tiny_reward_model_dir))
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_on_gpu_bit_identical_to_learner_function(tiny_model_dir, dtype):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 600, (n,), generator=g) for n in (9, 33, 4)]
    starts = [3, 10, 1]
    ref = ReferenceModel(str(tiny_model_dir), device="cuda", dtype=dtype, micro_batch_size=1)
    out = ref.response_logprobs(seqs, starts, 0.9)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch_dtype, attn_implementation="sdpa").cuda().eval()
    with torch.inference_mode():
        for s, k, got in zip(seqs, starts, out):
            s = s.cuda()
            full = sequence_logprobs(model, s.unsqueeze(0), torch.ones(1, len(s), dtype=torch.long, device="cuda"), 0.9)
            assert torch.equal(got, full[0, k - 1:].cpu())
