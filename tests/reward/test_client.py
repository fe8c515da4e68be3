"""Request splitting: a rollout batch of 8,192 samples with 2k-token responses fits the message limit."""

import torch

from services.reward.client import chunk_ranges, sample_sizes, score_request
from services.reward.source import ScoreBatch

MiB = 1024 * 1024


def test_chunk_ranges_cover_in_order_within_budget():
    sizes = [5, 5, 5, 20, 1, 1, 9]
    ranges = chunk_ranges(sizes, 10)
    assert ranges == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    assert chunk_ranges([], 10) == []


def test_rollout_sized_batch_splits_below_the_limit():
    """8,192 samples, 2,048 response tokens (~8 KiB of text) each: every request's real encoded size
    stays below the 32 MiB budget and far below the 256 MiB message limit."""
    n, tokens = 8192, 2048
    prompt_ids, response_ids = torch.arange(256), torch.arange(tokens) % 600
    response, prompt = "word " * (tokens // 2) + "\\boxed{12}", "What is 5+7? " * 20
    batch = ScoreBatch.from_texts([prompt] * n, [response] * n, ["12"] * n, sample_ids=[f"p{i // 8}/{i % 8}" for i in range(n)],
                                  prompt_token_ids=[prompt_ids] * n, response_token_ids=[response_ids] * n)
    ranges = chunk_ranges(sample_sizes(batch), 32 * MiB)
    assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) > 1
    start, stop = max(ranges, key=lambda r: r[1] - r[0])
    real = score_request(batch.slice(start, stop)).ByteSize()
    assert 16 * MiB < real <= 32 * MiB


def test_estimate_is_never_below_the_real_size_for_non_ascii_text():
    texts = ["答案是 \\boxed{12}", "naïve café ✓", "plain"]
    batch = ScoreBatch.from_texts(texts, texts[::-1], ["12", "é", ""], prompt_token_ids=[torch.arange(3)] * 3,
                                  response_token_ids=[torch.arange(70000, 70010)] * 3)
    for i in range(3):
        assert sample_sizes(batch.slice(i, i + 1))[0] >= score_request(batch.slice(i, i + 1)).ByteSize()
