"""The step collector: micro-batches fixed by prompt order (not arrival), filtering, deferral."""

import asyncio
import random

import torch

from services.coordinator.loop.data import Prompt
from services.coordinator.loop.experience import Sample, StepCollector


def prompts(k):
    return [Prompt(f"e1-{i}", f"p{i}", (1, 2), "", "d") for i in range(k)]


def make(prompt, index, reward):
    return Sample(prompt, index, torch.tensor([5, 6]), "x", 1, 0, reward=None, extra={"r": reward})


def run(collector, plist, order, rewards):
    async def main():
        collector.expect(plist)
        for p_index, s_index in order:
            collector.add(make(plist[p_index], s_index, rewards[p_index][s_index]))
            await asyncio.sleep(0)
        await collector.finish()
    asyncio.run(main())


def recorder():
    score_calls, logprob_calls = [], []

    async def score(samples):
        score_calls.append([s.sample_id for s in samples])
        for s in samples:
            s.reward = s.extra["r"]

    async def logprobs(samples):
        logprob_calls.append([s.sample_id for s in samples])
        for s in samples:
            s.old_logprobs = torch.zeros(2)

    return score_calls, logprob_calls, score, logprobs


def test_micro_batches_do_not_depend_on_arrival_order():
    plist = prompts(5)
    rewards = [[1.0, 0.0]] * 5
    order = [(p, s) for p in range(5) for s in range(2)]
    results = []
    for seed in (0, 1):
        random.Random(seed).shuffle(order)
        scores, logps, score, logprobs = recorder()
        run(StepCollector(2, 4, score, logprobs), plist, order, rewards)
        results.append((sorted(map(sorted, scores)), sorted(map(sorted, logps))))
    assert results[0] == results[1]
    assert len(results[0][0]) == 3  # 5 prompts, 2 per micro-batch


def test_dynamic_filtering_keeps_mixed_groups_only():
    plist = prompts(4)
    rewards = [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
    scores, logps, score, logprobs = recorder()
    collector = StepCollector(2, 4, score, logprobs, keep_group=lambda r: 0 < sum(r) / len(r) < 1)
    run(collector, plist, [(p, s) for p in range(4) for s in range(2)], rewards)
    assert collector.kept_uids() == ["e1-1", "e1-3"] and sorted(collector.dropped) == ["e1-0", "e1-2"]
    assert sorted(i for call in logps for i in call) == ["e1-1/0", "e1-1/1", "e1-3/0", "e1-3/1"]
    assert [s.sample_id for s in collector.kept_samples(max_groups=1)] == ["e1-1/0", "e1-1/1"]


def test_deferred_logprobs_wait_for_finish():
    plist = prompts(2)
    scores, logps, score, logprobs = recorder()
    collector = StepCollector(2, 2, score, logprobs, defer_logprobs=True)

    async def main():
        collector.expect(plist)
        for p in range(2):
            for s in range(2):
                collector.add(make(plist[p], s, 0.0))
        await collector.wait_scores()
        assert len(scores) == 2 and logps == []  # the learner sleeps during generation
        await collector.finish()
        assert len(logps) == 2

    asyncio.run(main())


def test_merged_deferred_logprobs_go_in_one_call_in_prompt_order():
    plist = prompts(5)
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    order = [(p, s) for p in range(5) for s in range(2)]
    calls = []
    for seed in (0, 1):
        random.Random(seed).shuffle(order)
        scores, logps, score, logprobs = recorder()
        collector = StepCollector(2, 4, score, logprobs, keep_group=lambda r: 0 < sum(r) / len(r) < 1,
                                  defer_logprobs=True, merge_deferred=True)
        run(collector, plist, order, rewards)
        assert len(scores) == 3  # scoring keeps its micro-batches of 2 prompts
        calls.append(logps)
    # One call, whatever the arrival order: the kept groups' samples, in prompt order.
    assert calls[0] == calls[1] == [["e1-0/0", "e1-0/1", "e1-2/0", "e1-2/1", "e1-4/0", "e1-4/1"]]
    # Without merging, one call per micro-batch that kept a group.
    scores, logps, score, logprobs = recorder()
    run(StepCollector(2, 4, score, logprobs, keep_group=lambda r: 0 < sum(r) / len(r) < 1, defer_logprobs=True),
        plist, order, rewards)
    assert len(logps) == 3
