"""`rlmesh eval`: pass@1 and pass@n of a model through the rollout and reward services, like
simpleRL-reason's math_eval.

    rlmesh eval --pretrain DIR --dataset test.jsonl --input_key prompt --label_key label --reward_func math
    rlmesh eval ... --n_samples_per_prompt 8 --temperature 0.6          (pass@1 averaged over 8, and pass@8)
    rlmesh eval --rollout_addresses H:P --reward_addresses H:P --dataset ...   (services already running)

Without addresses it starts one rollout service (vLLM, or --rollout_engine hf) and one reward service
on this machine and stops them at the end. A sample counts as solved when the reward source says so
(the math rule's `accuracy`), otherwise when its reward is at least --pass_reward. Results are
reported overall and per data source (rows' `datasource` / `data_source` field, else the file name),
printed as JSON and written to --output when given.

`evaluate()` is the same computation for callers that already hold the services (the training loop);
`evaluate_episodes()` its form for agent runs (--agent_func_path), where a sample is a multi-turn episode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib
import sys
import time
from collections import defaultdict
from typing import ClassVar

from rlmesh.rollout.v1 import rollout_pb2
from services.common.config import ConfigError, opt, parse_config
from services.common.paths import absolute_paths, resolve_path_fields
from services.common.datasets import DatasetError, load_prompts
from services.common.log import get_logger, log_event
from services.common.tensors import from_proto
from services.coordinator.loop.data import Prompt
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


def summarize(results: list[PromptResult], n: int, prefix: str = "eval/") -> dict[str, float]:
    """pass@1, pass@n, mean response length and prompt count, overall and per data source.

    Keys: f"{prefix}pass@1", f"{prefix}pass@{n}", f"{prefix}response_length", f"{prefix}prompts", and
    the same under f"{prefix}{datasource}/" when there are several data sources.
    """
    groups: dict[str, list[PromptResult]] = defaultdict(list)
    for r in results:
        groups[r.datasource].append(r)
    scopes = {"": results}
    if len(groups) > 1:
        scopes.update({f"{name}/": rows for name, rows in sorted(groups.items())})
    out: dict[str, float] = {}
    for scope, rows in scopes.items():
        if not rows:
            continue
        key = f"{prefix}{scope}"
        out[f"{key}pass@1"] = sum(pass_at_k(len(r.correct), sum(r.correct), 1) for r in rows) / len(rows)
        if n > 1:
            out[f"{key}pass@{n}"] = sum(pass_at_k(len(r.correct), sum(r.correct), n) for r in rows) / len(rows)
        lengths = [x for r in rows for x in r.lengths]
        out[f"{key}response_length"] = sum(lengths) / max(len(lengths), 1)
        out[f"{key}prompts"] = float(len(rows))
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
                   request_name: str = "eval", decoder: QueryDecoder | None = None) -> dict[str, float]:
    """Generates n samples per prompt on the pool's engines, scores them, returns summarize(...).

    score: async fn(ScoreBatch) -> an object with `rewards` (N,) and `extra` {name: (N,)} (a
    RewardClient's score, or the loop's balanced call). Samples are scored in batches as they arrive.
    decoder: makes the queries as in training (OpenRLHF's decoded sequence); None: prompt + response text.
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
            data_sources=[p.datasource for p, _ in batch]))
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
    results = [PromptResult(p.datasource, verdicts[p.uid], lengths[p.uid]) for p in prompts]
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
    results = {p.uid: PromptResult(p.datasource, [], []) for p in prompts}
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
                      data_sources=[p.datasource for p, _ in episodes])


def load_eval_prompts(paths: str, tokenizer, input_key: str, label_key: str, apply_chat_template: bool,
                      input_template: str, prompt_max_len: int, max_samples: int, seed: int) -> list[Prompt]:
    """Evaluation prompts in file order (no shuffle), tokenized as the training loop tokenizes them."""
    rows = load_prompts(paths, input_key=input_key, label_key=label_key, tokenizer=tokenizer,
                        apply_chat_template=apply_chat_template, input_template=input_template or None,
                        max_len=prompt_max_len, max_samples=max_samples, seed=seed, shuffle=False)
    encoded = tokenizer([r.prompt for r in rows], add_special_tokens=not apply_chat_template)["input_ids"]
    return [Prompt(f"{r.datasource}-{r.index}", r.prompt, tuple(ids), r.label, r.datasource)
            for r, ids in zip(rows, encoded)]


# ----------------------------------------------------------------------------------------------
# `rlmesh eval`


@dataclasses.dataclass
class EvalConfig:
    """Evaluates a model on labelled prompts through the rollout and reward services (pass@1, pass@n)."""

    # simpleRL-reason's `python eval/math_eval.py --model_path DIR` names the model differently.
    UNSUPPORTED_FLAGS: ClassVar[dict[str, str]] = {"model_path": "rlmesh eval takes the model folder as --pretrain DIR"}

    pretrain: str = opt("", "local model folder: served by the rollout service this command starts, and the "
                        "tokenizer of the prompts (with --rollout_addresses only its tokenizer is read)")
    dataset: str = opt("", "evaluation prompts: JSONL / Parquet / Arrow files or save_to_disk folders, comma separated")
    input_key: str = opt("input", "field of the prompt text (or chat message list)")
    label_key: str = opt("label", "field of the reference answer")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    input_template: str = opt("", "format string with {} for the prompt, e.g. 'Question: {}\\nAnswer:'")
    max_samples: int = opt(1_000_000_000, "evaluate at most this many prompts (the first ones)")
    prompt_max_len: int = opt(1024, "longer prompts are skipped (and counted in the log)")
    generate_max_len: int = opt(1024, "most tokens generated per response")
    n_samples_per_prompt: int = opt(1, "samples per prompt: pass@1 is their mean; pass@n is reported when n > 1")
    temperature: float = opt(0.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling")
    seed: int = opt(42, "sampling seed")
    reward_func: str = opt("", "built-in rule reward: math, exact_match or format")
    reward_pretrain: str = opt("", "local reward model folder instead of a rule")
    remote_rm_url: str = opt("", "reward server URL(s) or a Python file defining reward_func, instead of a rule")
    pass_reward: float = opt(1.0, "a sample counts as solved at this reward or more, unless the reward source "
                             "reports its own verdict (the math rule's accuracy)")
    rollout_addresses: list[str] = opt([], "host:port of running rollout services (the model they hold is evaluated)")
    reward_addresses: list[str] = opt([], "host:port of running reward services")
    rollout_engine: str = opt("vllm", "engine of the rollout service this command starts", choices=["vllm", "hf"])
    device: str = opt("auto", "device of the services this command starts", choices=["auto", "cpu", "cuda"])
    vllm_gpu_memory_utilization: float = opt(0.0, "fraction of GPU memory vLLM may use; 0 = 0.9 on GPU, 0.1 on CPU")
    run_dir: str = opt("runs/eval", "folder of the started services' logs")
    output: str = opt("", "also write the metrics as JSON to this file")
    service_start_timeout_s: float = opt(900.0, "how long to wait for a started service to report SERVING")
    rpc_timeout_s: float = opt(1800.0, "deadline of the Generate and Score calls")

    def validate(self) -> None:
        # The services this command starts run elsewhere than the user's working directory.
        resolve_path_fields(self, inputs=("pretrain", "dataset", "reward_pretrain"), outputs=("run_dir",))
        self.remote_rm_url = absolute_paths(self.remote_rm_url, "remote_rm_url")
        if not self.pretrain or not pathlib.Path(self.pretrain).is_dir():
            raise ConfigError(f"--pretrain {self.pretrain!r}: give a local model folder (its tokenizer encodes the "
                              "prompts, and without --rollout_addresses it is the model evaluated)")
        if not self.dataset:
            raise ConfigError("--dataset is required: local JSONL / Parquet / Arrow file(s) or save_to_disk folder(s)")
        sources = [n for n in ("reward_func", "reward_pretrain", "remote_rm_url") if getattr(self, n)]
        if not self.reward_addresses and len(sources) != 1:
            raise ConfigError("give exactly one reward source (--reward_func math, --reward_pretrain DIR or "
                              f"--remote_rm_url URL) or --reward_addresses; got {sources or 'none'}")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(f"--n_samples_per_prompt {self.n_samples_per_prompt} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature} must be >= 0 (0 = greedy)")
        if self.n_samples_per_prompt > 1 and self.temperature == 0:
            raise ConfigError("--n_samples_per_prompt > 1 with --temperature 0 gives n identical samples; "
                              "set --temperature (e.g. 0.6) or use one sample")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.vllm_gpu_memory_utilization == 0:
            self.vllm_gpu_memory_utilization = 0.9 if self.device == "cuda" else 0.1


def rollout_service_argv(config: EvalConfig) -> list[str]:
    argv = ["--pretrain", config.pretrain, "--engine", config.rollout_engine,
            "--gpu_memory_utilization", str(config.vllm_gpu_memory_utilization),
            "--max_model_len", str(config.prompt_max_len + config.generate_max_len), "--seed", str(config.seed)]
    if config.rollout_engine == "hf":
        argv += ["--hf_device", config.device]
    return argv


def reward_service_argv(config: EvalConfig) -> list[str]:
    argv = ["--device", config.device]
    if config.reward_pretrain:
        return argv + ["--reward_pretrain", config.reward_pretrain]
    if config.remote_rm_url:
        return argv + ["--remote_rm_url", config.remote_rm_url]
    return argv + ["--reward_func", config.reward_func]


class BalancedScorer:
    """Spreads Score calls over reward services: each batch goes to the one with the fewest in flight."""

    def __init__(self, addresses: list[str], timeout_s: float):
        from services.reward.client import RewardClient

        self.clients = [RewardClient(a, timeout_s=timeout_s) for a in addresses]
        self.in_flight = [0] * len(self.clients)

    async def __call__(self, batch: ScoreBatch):
        i = min(range(len(self.clients)), key=lambda k: (self.in_flight[k], k))
        self.in_flight[i] += 1
        try:
            return await self.clients[i].score(batch, request_id="eval")
        finally:
            self.in_flight[i] -= 1

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


async def run_eval(config: EvalConfig) -> dict[str, float]:
    """Starts the services that were not given, evaluates, stops what it started."""
    from transformers import AutoTokenizer

    from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready

    tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
    try:
        prompts = load_eval_prompts(config.dataset, tokenizer, config.input_key, config.label_key,
                                    config.apply_chat_template, config.input_template, config.prompt_max_len,
                                    config.max_samples, config.seed)
    except DatasetError as exc:
        raise ConfigError(str(exc)) from exc
    log_dir = pathlib.Path(config.run_dir) / "logs"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if config.device == "cpu" else {}
    started = []
    if not config.rollout_addresses:
        started.append(spawn_service("eval-rollout", "services.rollout", rollout_service_argv(config), log_dir, env=env))
    if not config.reward_addresses:
        started.append(spawn_service("eval-reward", "services.reward", reward_service_argv(config), log_dir, env=env))
    pool = scorer = None
    try:
        await asyncio.gather(*(wait_until_ready(s, config.service_start_timeout_s) for s in started))
        by_name = {s.name: s.address for s in started}
        rollout = config.rollout_addresses or [by_name["eval-rollout"]]
        reward = config.reward_addresses or [by_name["eval-reward"]]
        pool = RolloutPool(rollout, config.rpc_timeout_s)
        scorer = BalancedScorer(reward, config.rpc_timeout_s)
        versions = {info.weight_version for info in await pool.model_infos()}
        if len(versions) != 1:
            raise RuntimeError(f"the rollout services hold different weight versions {sorted(versions)}; "
                               "evaluate one model at a time")
        sampling = rollout_pb2.SamplingOptions(temperature=config.temperature, top_p=config.top_p,
                                               max_tokens=config.generate_max_len, return_text=True)
        return await evaluate(pool, scorer, prompts, config.n_samples_per_prompt, sampling, versions.pop(),
                              config.seed, config.pass_reward, decoder=QueryDecoder(tokenizer))
    finally:
        if pool is not None:
            await pool.close()
        if scorer is not None:
            await scorer.close()
        await asyncio.to_thread(stop_all, started, 30.0)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(EvalConfig, argv, description=EvalConfig.__doc__)
    try:
        metrics = asyncio.run(run_eval(config))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(metrics, indent=1, sort_keys=True)
    print(text)
    if config.output:
        pathlib.Path(config.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
