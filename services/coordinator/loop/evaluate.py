"""Evaluation during training: pass@1 and pass@n of the rollout engines' current weights on
held-out labelled prompts, like simpleRL-reason's math_eval.

`evaluate()` generates n samples per prompt through a RolloutPool and scores them with the caller's
Score function (the loop's scoring pool); `evaluate_episodes()` is its form for agent runs
(--agent_func_path), where a sample is a multi-turn episode. A sample counts as solved when the reward
source says so (the math rule's `accuracy`), otherwise when its reward is at least `pass_reward`.
Results are reported overall, per data source (rows' `datasource` / `data_source` field, else the
file name) and per difficulty (rows' `difficulty` field). pass@1 comes with a 95% confidence
interval over prompts (services/common/confidence.py): Wilson's when each prompt has one sample
(greedy decoding), the percentile bootstrap of the per-prompt shares of correct samples otherwise.
The standalone command over the same computation is `rlmesh eval` (services.coordinator.cli.eval_cli).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import defaultdict

from rlmesh.rollout.v1 import rollout_pb2
from services.common.confidence import bootstrap_mean_interval, wilson_interval
from services.common.datasets import load_prompts
from services.common.log import get_logger, log_event
from services.common.tensors import from_proto
from services.coordinator.loop.data import Prompt
from services.coordinator.loop.group_rewards import _order as level_order  # as training's reward/by_difficulty
from services.coordinator.loop.queries import QueryDecoder
from services.coordinator.loop.rollout_pool import RolloutPool
from services.reward.client import ScoreBatch

_log = get_logger("coordinator")


# ----------------------------------------------------------------------------------------------
# Metrics (pure functions)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass
class PromptResult:
    """The scored samples of one prompt."""

    datasource: str
    correct: list[bool]
    lengths: list[int]  # response tokens per sample
    difficulty: str = ""  # the row's difficulty field as text ("" without one)


CONFIDENCE = 0.95
PASS_AT_1_LABELS = ("pass@1", "pass@1_ci_low", "pass@1_ci_high")


def pass_at_1_interval(results: list[PromptResult], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The confidence interval of pass@1 over prompts: Wilson's score interval when every prompt has one
    sample (its verdicts are a binomial count), else the percentile bootstrap of the per-prompt shares
    of correct samples (the samples of a prompt are resampled together: they are not independent)."""
    if all(len(r.correct) == 1 for r in results):
        return wilson_interval(sum(r.correct[0] for r in results), len(results), confidence)
    return bootstrap_mean_interval([sum(r.correct) / len(r.correct) for r in results], confidence)


def scopes(results: list[PromptResult]) -> dict[str, list[PromptResult]]:
    """The groups summarize() reports, by key infix: "" (all prompts); f"{datasource}/" when there are
    several data sources; f"by_difficulty/{value}/" (f"{datasource}/by_difficulty/{value}/" with several
    sources) for each difficulty of a data source whose rows carry several."""
    by_source: dict[str, list[PromptResult]] = defaultdict(list)
    for r in results:
        by_source[r.datasource].append(r)
    out = {"": results}
    for name, rows in sorted(by_source.items()):
        source = f"{name}/" if len(by_source) > 1 else ""
        if source:
            out[source] = rows
        levels: dict[str, list[PromptResult]] = defaultdict(list)
        for r in rows:
            levels[r.difficulty].append(r)
        if len(levels) > 1:
            for value in sorted(levels, key=level_order):
                out[f"{source}by_difficulty/{value or 'none'}/"] = levels[value]
    return out


def summarize(results: list[PromptResult], n: int, prefix: str = "eval/") -> dict[str, float]:
    """pass@1 with its 95% interval, pass@n, mean response length and prompt count, for each of scopes().

    Keys: f"{prefix}pass@1", f"{prefix}pass@1_ci_low", f"{prefix}pass@1_ci_high", f"{prefix}pass@{n}"
    (n > 1), f"{prefix}response_length", f"{prefix}prompts"; the same under f"{prefix}{scope}" for the
    data sources and difficulties scopes() names.
    """
    out: dict[str, float] = {}
    for scope, rows in scopes(results).items():
        if not rows:
            continue
        key = f"{prefix}{scope}"
        out[f"{key}pass@1"] = sum(pass_at_k(len(r.correct), sum(r.correct), 1) for r in rows) / len(rows)
        out[f"{key}pass@1_ci_low"], out[f"{key}pass@1_ci_high"] = pass_at_1_interval(rows)
        if n > 1:
            out[f"{key}pass@{n}"] = sum(pass_at_k(len(r.correct), sum(r.correct), n) for r in rows) / len(rows)
        lengths = [x for r in rows for x in r.lengths]
        out[f"{key}response_length"] = sum(lengths) / max(len(lengths), 1)
        out[f"{key}prompts"] = float(len(rows))
    return out


def decoding_keys(metrics: dict[str, float], decoding: str, prefix: str = "eval/") -> dict[str, float]:
    """The pass@1 keys of summarize()'s metrics (its interval included) renamed after the decoding that
    gave them: f"{prefix}[scope]{decoding}_pass@1" and its _ci_low / _ci_high (decoding: "greedy" or
    "sampled"), so that one report can hold both."""
    out = {}
    for key, value in metrics.items():
        scope, _, name = key.removeprefix(prefix).rpartition("/")
        if key.startswith(prefix) and name in PASS_AT_1_LABELS:
            out[f"{prefix}{scope + '/' if scope else ''}{decoding}_{name}"] = value
    return out


# ----------------------------------------------------------------------------------------------
# The evaluation over running services


def is_correct(reward: float, extra: dict[str, float], pass_reward: float) -> bool:
    """The reward source's own verdict when it gives one (`accuracy`), else reward >= pass_reward."""
    if "accuracy" in extra and math.isfinite(extra["accuracy"]):
        return extra["accuracy"] >= 0.5
    return reward >= pass_reward


async def evaluate(pool: RolloutPool, score, prompts: list[Prompt], n: int, sampling: rollout_pb2.SamplingOptions,
                   expected_version: int, seed: int, pass_reward: float = 1.0, prefix: str = "eval/",
                   request_name: str = "eval", decoder: QueryDecoder | None = None,
                   results_out: list[PromptResult] | None = None) -> dict[str, float]:
    """Generates n samples per prompt on the pool's engines, scores them, returns summarize(...).

    score: async fn(ScoreBatch) -> an object with `rewards` (N,) and `extra` {name: (N,)} (a
    RewardClient's score, or the loop's balanced call). Samples are scored in batches as they arrive.
    decoder: makes the queries as in training (OpenRLHF's decoded sequence); None: prompt + response text.
    results_out: when given, each prompt's PromptResult is appended to it, in the order of `prompts`
    (a before / after comparison pairs the verdicts problem by problem).
    """
    samples: list[tuple[Prompt, rollout_pb2.GenerateResponse]] = []
    pending: list[asyncio.Task] = []
    verdicts: dict[str, list[bool]] = defaultdict(list)
    lengths: dict[str, list[int]] = defaultdict(list)
    batch_size = 256

    async def score_batch(batch: list[tuple[Prompt, rollout_pb2.GenerateResponse]]) -> None:
        if decoder is None:
            queries = [p.text + s.text for p, s in batch]
        else:
            queries = decoder.queries([list(p.token_ids) + from_proto(s.response_token_ids, "response_token_ids")
                                       .tolist() for p, s in batch])
        scored = await score(ScoreBatch(
            queries=queries, prompts=[p.text for p, _ in batch],
            responses=[s.text for _, s in batch], labels=[p.label for p, _ in batch],
            sample_ids=[f"{p.uid}/{s.sample_index}" for p, s in batch],
            data_sources=[p.datasource for p, _ in batch], extra_infos=[p.extra_info for p, _ in batch]))
        for i, (prompt, sample) in enumerate(batch):
            extra = {k: float(v[i]) for k, v in scored.extra.items()}
            verdicts[prompt.uid].append(is_correct(float(scored.rewards[i]), extra, pass_reward))
            lengths[prompt.uid].append(from_proto(sample.response_token_ids, "response_token_ids").numel())

    def on_sample(prompt: Prompt, sample: rollout_pb2.GenerateResponse) -> None:
        if sample.finish_reason == rollout_pb2.FINISH_REASON_ABORT:
            raise RuntimeError(f"rollout aborted sample {sample.sample_index} of prompt {prompt.uid}")
        samples.append((prompt, sample))
        if len(samples) >= batch_size:
            pending.append(asyncio.ensure_future(score_batch(samples[:])))
            samples.clear()

    def on_retry(prompt: Prompt) -> None:
        # The prompt is generated again from scratch on another engine: forget what it had.
        samples[:] = [(p, s) for p, s in samples if p.uid != prompt.uid]
        verdicts.pop(prompt.uid, None)
        lengths.pop(prompt.uid, None)

    started = time.monotonic()
    try:
        await pool.generate(prompts, n, sampling, expected_version, seed, step=0, round_index=0,
                            on_sample=on_sample, on_retry=on_retry)
        if samples:
            pending.append(asyncio.ensure_future(score_batch(samples[:])))
        await asyncio.gather(*pending)
    except BaseException:
        for task in pending:
            task.cancel()
        raise
    results = [PromptResult(p.datasource, verdicts[p.uid], lengths[p.uid], p.difficulty) for p in prompts]
    if results_out is not None:
        results_out.extend(results)
    return _report(summarize(results, n, prefix), prefix, started, request_name, samples_per_prompt=n)


async def evaluate_episodes(agents, score, prompts: list[Prompt], n: int, sampling: rollout_pb2.SamplingOptions,
                            expected_version: int, seed: int, pass_reward: float = 1.0, prefix: str = "eval/",
                            request_name: str = "eval", decoder: QueryDecoder | None = None) -> dict[str, float]:
    """evaluate() for agent runs (--agent_func_path): each sample is a whole episode, played by the
    agent file's workers as in training (same --agent_max_turns and --agent_max_length) with `sampling`.

    agents: a started services.coordinator.loop.agent.AgentRunner. An episode's reward is the agent's (the
    sum of its step rewards), or `score`'s of the whole episode when the run takes rewards from the
    reward service; is_correct judges it. Besides summarize(...)'s keys (response_length counts the
    model's tokens of an episode): f"{prefix}reward" (mean), f"{prefix}turns_mean",
    f"{prefix}failed_episodes", and each of the agent's extra logs as f"{prefix}<name>", averaged over
    the episodes that log it as training's reward/<name> is (the retry agent's eval/solved: right at
    either attempt). A failed episode counts as unsolved in pass@k, with reward 0 and no extra logs.
    """
    outcomes: list[tuple[Prompt, object]] = []  # (prompt, agent.Outcome)
    started = time.monotonic()
    await agents.generate(prompts, n, sampling, expected_version, seed, step=0, round_index=0,
                          on_sample=lambda prompt, outcome: outcomes.append((prompt, outcome)))
    episodes = [(p, o) for p, o in outcomes if _finished(o)]
    rewards = [float(o.result.get("reward") or 0.0) for _, o in episodes]
    extras = [dict(o.result.get("extra_logs") or {}) for _, o in episodes]
    if not agents.own_rewards:  # the reward service scores the episode, as in training
        for i in range(0, len(episodes), 256):
            scored = await score(_episode_batch(episodes[i:i + 256], agents.tokenizer, decoder))
            for k in range(len(scored.rewards)):
                rewards[i + k] = float(scored.rewards[k])
                extras[i + k].update({name: float(v[k]) for name, v in scored.extra.items()})
    metrics = episode_metrics(prompts, n, outcomes, rewards, extras, pass_reward, prefix)
    return _report(metrics, prefix, started, request_name, samples_per_prompt=n, episodes=len(outcomes))


async def evaluate_during_training(cfg, engines, rewards, prompts: list[Prompt], step: int, version: int,
                                   decoder: QueryDecoder | None, episodes: bool) -> dict[str, float]:
    """--eval_dataset during training: the metrics of `evaluate` (or `evaluate_episodes` for an
    agent run, `engines` then being its runner) on the weights the engines hold after `step`,
    scored through the run's reward pool `rewards`; logged as eval.step."""
    sampling = rollout_pb2.SamplingOptions(temperature=cfg.eval_temperature, max_tokens=cfg.generate_max_len,
                                           return_text=True)

    def score(batch: ScoreBatch):
        return rewards.call(lambda c: c.score(batch, request_id=f"eval{step}"))

    run = evaluate_episodes if episodes else evaluate
    metrics = await run(engines, score, prompts, cfg.eval_n_samples_per_prompt, sampling, version, cfg.seed,
                        pass_reward=cfg.eval_pass_reward, decoder=decoder)
    n = cfg.eval_n_samples_per_prompt
    log_event(_log, "eval.step", step=step, version=version, pass_at_1=f"{metrics['eval/pass@1']:.4f}",
              **({f"pass_at_{n}": f"{metrics[f'eval/pass@{n}']:.4f}"} if n > 1 else {}),
              response_length=f"{metrics['eval/response_length']:.1f}", prompts=len(prompts))
    return metrics


def _report(metrics: dict[str, float], prefix: str, started: float, request_name: str, **fields) -> dict[str, float]:
    """Adds f"{prefix}seconds" and logs the overall (not per-datasource) numbers as <request_name>.done."""
    metrics[f"{prefix}seconds"] = time.monotonic() - started
    overall = {k.removeprefix(prefix): f"{v:.4g}" for k, v in metrics.items() if "/" not in k.removeprefix(prefix)}
    log_event(_log, f"{request_name}.done", **fields, **overall)
    return metrics


def _finished(outcome) -> bool:
    return outcome.result is not None and bool(outcome.result["action_ranges"])


def episode_metrics(prompts: list[Prompt], n: int, outcomes: list, rewards: list[float], extras: list[dict],
                    pass_reward: float = 1.0, prefix: str = "eval/") -> dict[str, float]:
    """evaluate_episodes' summary. outcomes: (prompt, agent.Outcome) of every episode played;
    rewards and extras: the reward and extra logs of each finished one (a model turn at least), in
    outcomes' order. A failed episode counts as unsolved, with reward 0 and no extra logs."""
    finished = [(p, o) for p, o in outcomes if _finished(o)]
    results = {p.uid: PromptResult(p.datasource, [], [], p.difficulty) for p in prompts}
    for (prompt, outcome), reward, extra in zip(finished, rewards, extras):
        results[prompt.uid].correct.append(is_correct(reward, extra, pass_reward))
        results[prompt.uid].lengths.append(sum(int(e) - int(s) for s, e in outcome.result["action_ranges"]))
    for prompt, outcome in outcomes:
        if not _finished(outcome):
            results[prompt.uid].correct.append(False)
    logged: dict[str, list[float]] = defaultdict(list)
    for extra in extras:
        for name, value in extra.items():
            if math.isfinite(value):
                logged[name].append(value)
    metrics = {f"{prefix}{name}": sum(values) / len(values) for name, values in sorted(logged.items())}
    turns = [len(o.result["action_ranges"]) for _, o in finished]
    metrics.update({f"{prefix}reward": sum(rewards) / max(len(outcomes), 1),
                    f"{prefix}turns_mean": sum(turns) / max(len(turns), 1),
                    f"{prefix}failed_episodes": float(len(outcomes) - len(finished))})
    metrics.update(summarize([results[p.uid] for p in prompts], n, prefix))
    return metrics


def _episode_batch(episodes: list[tuple[Prompt, object]], tokenizer, decoder: QueryDecoder | None) -> ScoreBatch:
    """The reward service's view of finished episodes (prompt, agent.Outcome), as training builds it: the
    response runs from the first model token to the last (environment feedback included), the query is
    the whole sequence."""
    tokens = [[int(t) for t in o.result["observation_tokens"][:int(o.result["action_ranges"][-1][1])]]
              for _, o in episodes]
    responses = [tokenizer.decode(ids[int(o.result["action_ranges"][0][0]):], skip_special_tokens=True)
                 for (_, o), ids in zip(episodes, tokens)]
    queries = (decoder.queries(tokens) if decoder is not None
               else [p.text + text for (p, _), text in zip(episodes, responses)])
    return ScoreBatch(queries=queries, prompts=[p.text for p, _ in episodes], responses=responses,
                      labels=[p.label for p, _ in episodes], sample_ids=[f"{p.uid}/{o.index}" for p, o in episodes],
                      data_sources=[p.datasource for p, _ in episodes],
                      extra_infos=[p.extra_info for p, _ in episodes])


def load_eval_prompts(paths: str, tokenizer, input_key: str, label_key: str, apply_chat_template: bool,
                      input_template: str, prompt_max_len: int, max_samples: int, seed: int) -> list[Prompt]:
    """Evaluation prompts in file order (no shuffle), tokenized as the training loop tokenizes them."""
    rows = load_prompts(paths, input_key=input_key, label_key=label_key, tokenizer=tokenizer,
                        apply_chat_template=apply_chat_template, input_template=input_template or None,
                        max_len=prompt_max_len, max_samples=max_samples, seed=seed, shuffle=False)
    encoded = tokenizer([r.prompt for r in rows], add_special_tokens=not apply_chat_template)["input_ids"]
    return [Prompt(f"{r.datasource}-{r.index}", r.prompt, tuple(ids), r.label, r.datasource, r.extra_info,
                   r.difficulty) for r, ids in zip(rows, encoded)]
