"""A step's generation: its prompts to the engines (or agent episodes), each sample collected as it
arrives, and DAPO's refill rounds while dynamic filtering drops groups."""

from __future__ import annotations

import math
import sys

import torch

from rlmesh.rollout.v1 import rollout_pb2
from services.common.tensors import from_proto
from services.coordinator.loop.async_loop import token_versions
from services.coordinator.loop.experience import Sample, StepCollector


def sampling_options(cfg) -> rollout_pb2.SamplingOptions:
    return rollout_pb2.SamplingOptions(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                       max_tokens=cfg.generate_max_len, return_text=True,
                                       logprobs=cfg.use_tis)  # the behaviour policy's, for TIS


def sample_from_response(prompt, response: rollout_pb2.GenerateResponse, use_tis: bool) -> Sample:
    ids = from_proto(response.response_token_ids, "response_token_ids").to(torch.int64)
    rollout_logprobs = from_proto(response.logprobs, "logprobs").float() if use_tis else None
    return Sample(prompt=prompt, index=response.sample_index, response_ids=ids, text=response.text,
                  finish_reason=response.finish_reason, weight_version=response.weight_version,
                  rollout_logprobs=rollout_logprobs, token_versions=token_versions(response))


async def generate_step(cfg, stream, generate, new_sample, collector: StepCollector, step: int,
                        expected_version: int | None, progress=None) -> dict:
    """Takes the step's prompts from `stream`, generates them with `generate` (the rollout pool's
    or the agents'), adds each sample (`new_sample(prompt, response, use_tis)`) to `collector`, and
    refills dropped groups; returns {"prompts_consumed", "filter_rounds"}, or {} when the data ran out."""
    prompts = stream.next_batch(cfg.rollout_batch_size, whole=True)
    if len(prompts) < cfg.rollout_batch_size:
        return {}
    consumed = len(prompts)
    sampling = sampling_options(cfg)

    def on_sample(prompt, response):
        if response.finish_reason == rollout_pb2.FINISH_REASON_ABORT:
            raise RuntimeError(f"rollout aborted sample {response.sample_index} of prompt {prompt.uid}; "
                               "an engine is shutting down")
        collector.add(new_sample(prompt, response, cfg.use_tis))
        if progress is not None:
            progress.update(1)

    collector.expect(prompts)
    await generate(prompts, cfg.n_samples_per_prompt, sampling, expected_version, cfg.seed, step, 0,
                   on_sample, on_retry=collector.forget_prompt)
    rounds = 0
    if collector.keep_group is not None:
        await collector.wait_scores()
        while len(collector.kept) < cfg.rollout_batch_size and rounds < cfg.dynamic_filtering_max_rounds:
            decided = len(collector.kept) + len(collector.dropped)
            keep_rate = max(len(collector.kept) / max(decided, 1), 0.1)
            need = math.ceil((cfg.rollout_batch_size - len(collector.kept)) / keep_rate)
            more = stream.next_batch(need, whole=False)
            if not more:
                break
            rounds += 1
            consumed += len(more)
            if progress is not None:
                progress.total += len(more) * cfg.n_samples_per_prompt
            collector.expect(more)
            await generate(more, cfg.n_samples_per_prompt, sampling, expected_version, cfg.seed, step,
                           rounds, on_sample, on_retry=collector.forget_prompt)
            await collector.wait_scores()
    return {"prompts_consumed": consumed, "filter_rounds": rounds}

def progress_bar(config, step: int, total_steps: int):
    if not config.progress_bar or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=config.samples_per_step(), desc=f"step {step}/{total_steps or '?'}", unit="sample",
                leave=False, dynamic_ncols=True)

