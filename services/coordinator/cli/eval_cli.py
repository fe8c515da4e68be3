"""`rlmesh eval`: pass@1 and pass@n of a model through the rollout and reward services, like
simpleRL-reason's math_eval.

    rlmesh eval --pretrain DIR --dataset test.jsonl --input_key prompt --label_key label --reward_func math
    rlmesh eval ... --n_samples_per_prompt 8 --temperature 0.6          (pass@1 averaged over 8, and pass@8,
                                                                          and greedy pass@1)
    rlmesh eval --rollout_addresses H:P --reward_addresses H:P --dataset ...   (services already running)

Held-out pass@1 is reported for greedy decoding (eval/greedy_pass@1) and, with --temperature > 0, for
sampling (eval/sampled_pass@1: the mean over prompts of each prompt's share of correct samples), each
with a 95% confidence interval over prompts (..._ci_low, ..._ci_high): Wilson's score interval for
greedy (one verdict per prompt), the percentile bootstrap over prompts (10,000 resamples, fixed seed)
for the sampled mean (services/common/confidence.py). With --temperature > 0 the greedy numbers come
from a second, greedy pass over the prompts (--no-greedy leaves it out). eval/pass@1 keeps its meaning:
the pass@1 of the configured decoding, with its interval as eval/pass@1_ci_low / _ci_high.

Without addresses it starts one rollout service (vLLM, or --rollout_engine hf) and one reward service
on this machine, with the command lines a training run would give them for the same settings
(fleet.placement), and stops them at the end. A sample counts as solved when the reward source says so
(the math rule's `accuracy`), otherwise when its reward is at least --pass_reward. Results are
reported overall, per data source (rows' `datasource` / `data_source` field, else the file name) and
per difficulty (rows' `difficulty` field: eval/by_difficulty/<value>/...), printed as JSON and written
to --output when given.

The computation is the training loop's (loop.evaluate.evaluate); the Score calls go through the loop's
scoring pool (loop.scoring_pool), which spreads them over the reward services.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import sys
from typing import ClassVar

from rlmesh.rollout.v1 import rollout_pb2
from services.common.config import ConfigError, opt, parse_config
from services.common.datasets import DatasetError
from services.common.openrlhf_compat import check_imports
from services.common.paths import absolute_paths, resolve_path_fields
from services.common.user_errors import run_command
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready
from services.coordinator.fleet.placement import reward_argv, rollout_argv
from services.coordinator.loop.evaluate import decoding_keys, evaluate, load_eval_prompts
from services.coordinator.loop.queries import QueryDecoder
from services.coordinator.loop.rollout_pool import RolloutPool
from services.coordinator.loop.scoring_pool import ScoringPool
from services.reward.client import RewardClient, ScoreBatch


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
    greedy: bool = opt(True, "with --temperature > 0, also decode each prompt once greedily and report "
                       "eval/greedy_pass@1 beside the sampled eval/sampled_pass@1")
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
    dry_run: bool = opt(False, "check the flags, the data and the reward source, print what would be evaluated "
                        "and which services would start, and exit; nothing is started")

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
        if self.remote_rm_url.endswith(".py") and pathlib.Path(self.remote_rm_url).is_file():
            check_imports(self.remote_rm_url, "--remote_rm_url")  # its OpenRLHF imports, before any service starts
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


def service_settings(config: EvalConfig) -> CoordinatorConfig:
    """The training settings under which placement.rollout_argv / reward_argv start the services this
    command needs, so that they run as a training run with the same flags would start them. Not
    validated (there is no training data): every field the argument builders read is set here or
    keeps its default. On a GPU the models run in bfloat16, as under `rlmesh train --bf16`."""
    on_gpu = config.device == "cuda"
    settings = CoordinatorConfig(
        pretrain=config.pretrain, rollout_engine=config.rollout_engine, device=config.device,
        vllm_gpu_memory_utilization=config.vllm_gpu_memory_utilization, prompt_max_len=config.prompt_max_len,
        generate_max_len=config.generate_max_len, seed=config.seed, bf16=on_gpu,
        # The n samples of a prompt share its prefix (the rollout service's own default).
        enable_prefix_caching=True,
        reward_func=config.reward_func, reward_pretrain=config.reward_pretrain, remote_rm_url=config.remote_rm_url)
    settings.on_gpu = on_gpu
    return settings


def reward_pool(addresses: list[str], timeout_s: float) -> ScoringPool:
    """The reward services behind one scoring pool: each batch goes to the instance with the fewest
    calls in flight, and moves to another one if its instance dies."""
    return ScoringPool("reward", addresses, lambda address: RewardClient(address, timeout_s=timeout_s))


def pool_scorer(pool: ScoringPool, request_id: str = "eval"):
    """evaluate()'s `score`: one Score call on the pool per batch."""
    async def score(batch: ScoreBatch):
        return await pool.call(lambda client: client.score(batch, request_id=request_id))

    return score


async def run_eval(config: EvalConfig) -> dict[str, float]:
    """Starts the services that were not given, evaluates, stops what it started."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
    try:
        prompts = load_eval_prompts(config.dataset, tokenizer, config.input_key, config.label_key,
                                    config.apply_chat_template, config.input_template, config.prompt_max_len,
                                    config.max_samples, config.seed)
    except DatasetError as exc:
        raise ConfigError(str(exc)) from exc
    if config.dry_run:
        return dry_run_plan(config, len(prompts))
    settings = service_settings(config)
    log_dir = pathlib.Path(config.run_dir) / "logs"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if config.device == "cpu" else {}
    started = []
    if not config.rollout_addresses:
        started.append(spawn_service("eval-rollout", "services.rollout", rollout_argv(settings), log_dir, env=env))
    if not config.reward_addresses:
        started.append(spawn_service("eval-reward", "services.reward", reward_argv(settings, True, False), log_dir,
                                     env=env))
    pool = scoring = None
    try:
        await asyncio.gather(*(wait_until_ready(s, config.service_start_timeout_s) for s in started))
        by_name = {s.name: s.address for s in started}
        pool = RolloutPool(config.rollout_addresses or [by_name["eval-rollout"]], config.rpc_timeout_s)
        scoring = reward_pool(config.reward_addresses or [by_name["eval-reward"]], config.rpc_timeout_s)
        versions = {info.weight_version for info in await pool.model_infos()}
        if len(versions) != 1:
            raise RuntimeError(f"the rollout services hold different weight versions {sorted(versions)}; "
                               "evaluate one model at a time")
        version, decoder = versions.pop(), QueryDecoder(tokenizer)
        sampling = rollout_pb2.SamplingOptions(temperature=config.temperature, top_p=config.top_p,
                                               max_tokens=config.generate_max_len, return_text=True)
        metrics = await evaluate(pool, pool_scorer(scoring), prompts, config.n_samples_per_prompt, sampling,
                                 version, config.seed, config.pass_reward, decoder=decoder)
        if config.temperature == 0:
            return {**metrics, **decoding_keys(metrics, "greedy")}
        metrics.update(decoding_keys(metrics, "sampled"))
        if config.greedy:
            greedy = rollout_pb2.SamplingOptions(temperature=0.0, max_tokens=config.generate_max_len, return_text=True)
            greedy_metrics = await evaluate(pool, pool_scorer(scoring, "eval-greedy"), prompts, 1, greedy, version,
                                            config.seed, config.pass_reward, request_name="eval.greedy",
                                            decoder=decoder)
            metrics.update(decoding_keys(greedy_metrics, "greedy"))
            metrics["eval/greedy_seconds"] = greedy_metrics["eval/seconds"]
        return metrics
    finally:
        if pool is not None:
            await pool.close()
        if scoring is not None:
            await scoring.close()
        await asyncio.to_thread(stop_all, started, 30.0)


def dry_run_plan(config: EvalConfig, prompts: int) -> dict:
    """--dry_run: what would be evaluated and which services would start; nothing is started."""
    source = (f"reward services at {', '.join(config.reward_addresses)}" if config.reward_addresses else
              f"a reward service ({config.reward_func or config.reward_pretrain or config.remote_rm_url})")
    rollout = (f"rollout services at {', '.join(config.rollout_addresses)}" if config.rollout_addresses else
               f"a rollout service ({config.rollout_engine}, {config.pretrain}, on {config.device})")
    print(f"dry run (eval): nothing was started\ndata     {config.dataset}: {prompts} usable prompts x "
          f"{config.n_samples_per_prompt} samples (temperature {config.temperature})\nservices {rollout}; {source}",
          flush=True)
    return {}


def main(argv: list[str] | None = None) -> int:
    config = parse_config(EvalConfig, argv, description=EvalConfig.__doc__)
    metrics = asyncio.run(run_eval(config))  # a user error: run_command prints its message (exit 2)
    if config.dry_run:
        return 0
    text = json.dumps(metrics, indent=1, sort_keys=True)
    print(text)
    if config.output:
        pathlib.Path(config.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
