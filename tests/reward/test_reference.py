"""The reference model's response log-probs against services.common.logprobs, which the learner uses."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.logprobs import sequence_logprobs
from services.reward.reference import ReferenceModel


def sequences(n: int, seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g) for _ in range(n)]
    starts = [int(torch.randint(1, len(s) + 1, (1,), generator=g)) for s in seqs]
    return seqs, starts


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_sequence_per_batch_is_bit_identical_to_learner_function(tiny_model_dir, hf_model, temperature):
    seqs, starts = sequences(6)
    ref = ReferenceModel(str(tiny_model_dir), device="cpu", micro_batch_size=1)
    out = ref.response_logprobs(seqs, starts, temperature)
    with torch.inference_mode():
        for s, k, got in zip(seqs, starts, out):
            full = sequence_logprobs(hf_model, s.unsqueeze(0), torch.ones(1, len(s), dtype=torch.long), temperature)
            assert got.dtype == torch.float32 and got.shape == (len(s) - k,)
            assert torch.equal(got, full[0, k - 1:])


def test_padded_batch_is_bit_identical_to_learner_function_on_the_same_batch(tiny_model_dir, hf_model):
    """Same rows, same right padding: the learner's function gives the same bits."""
    seqs, starts = sequences(5, seed=1)
    ref = ReferenceModel(str(tiny_model_dir), device="cpu", micro_batch_size=8)
    out = ref.response_logprobs(seqs, starts, 1.0)
    order = sorted(range(5), key=lambda i: -len(seqs[i]))  # the service's batch order: longest first
    width = len(seqs[order[0]])
    ids = torch.zeros(5, width, dtype=torch.long)
    mask = torch.zeros(5, width, dtype=torch.long)
    for row, i in enumerate(order):
        ids[row, :len(seqs[i])] = seqs[i]
        mask[row, :len(seqs[i])] = 1
    with torch.inference_mode():
        full = sequence_logprobs(hf_model, ids, mask)
    for row, i in enumerate(order):
        assert torch.equal(out[i], full[row, starts[i] - 1:len(seqs[i]) - 1])


def test_padding_changes_little(tiny_model_dir):
    """Across batch compositions the numbers agree to float32 rounding."""
    seqs, starts = sequences(7, seed=2)
    one = ReferenceModel(str(tiny_model_dir), device="cpu", micro_batch_size=1).response_logprobs(seqs, starts, 1.0)
    many = ReferenceModel(str(tiny_model_dir), device="cpu", micro_batch_size=3).response_logprobs(seqs, starts, 1.0)
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert all(len(t) == len(s) - k for t, s, k in zip(one, seqs, starts))
