"""`rlmesh quickstart --real` (`make quickstart-real`): a real pretrained chat model learns arithmetic by
GRPO on this machine (a CPU is enough), with its held-out accuracy measured before and after.

  1. the model: SmolLM2-135M-Instruct, fetched and converted once (`rlmesh fetch-model`, cached), or a
     local Hugging Face folder given as --model_dir (the tests pass a tiny tied Llama built here);
  2. the task: `rlmesh make-task arith`, training and held-out problems that never overlap;
  3. the services, started once: rollout (vLLM), reward (the `math` rule) with the reference model,
     learner (DeepSpeed);
  4. greedy held-out accuracy of the model as fetched, chat template applied;
  5. GRPO over those services (`rlmesh train`), held-out accuracy every --eval_steps steps;
  6. greedy held-out accuracy again, compared problem by problem with step 4 (services.common.paired):
     the gain, both 95% Wilson intervals, and McNemar's exact test;
  7. the learning curve (held-out accuracy against wall-clock time and steps, reward, KL, response
     length and truncation, step time) as one PNG, and `rlmesh plot`'s per-metric PNGs.

The defaults were sized on a 2-core CPU so that the whole run stays well within 30 minutes; see
docs/guides/real-models.md for what was measured and why each default is what it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

from services.common.config import ConfigError, opt, parse_config
from services.common.log import get_logger, log_event
from services.common.user_errors import UserError

_log = get_logger("quickstart")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class RealQuickstartConfig:
    """Fetches a real pretrained chat model, measures its held-out accuracy on arithmetic problems,
    trains it with GRPO on this machine, measures again and draws the learning curve."""

    run_dir: str = opt("runs/quickstart-real", "output folder: task data, run metrics, samples, plots, service logs")
    model: str = opt("smollm2-135m-instruct", "model to fetch (rlmesh fetch-model --list); cached after the "
                     "first run")
    model_dir: str = opt("", "a local Hugging Face model folder with a chat template to train instead of "
                         "fetching --model (e.g. one from rlmesh make-tiny-model --arch llama --tied)")
    task: str = opt("arith", "the task rlmesh make-task writes", choices=["arith"])
    task_args: list[str] = opt(["--levels=1,2"], "options for rlmesh make-task (its --help lists them); the "
                               "default keeps the two easier levels, where a 135M model finds correct answers "
                               "to learn from")
    heldout_problems: int = opt(500, "held-out problems evaluated (the first ones of the held-out split)")
    grpo_steps: int = opt(20, "GRPO steps (each: rollout_batch_size prompts x n_samples_per_prompt samples)")
    rollout_batch_size: int = opt(8, "prompts per GRPO step")
    n_samples_per_prompt: int = opt(8, "samples per prompt; their rewards are normalised within the group")
    micro_train_batch_size: int = opt(16, "samples per forward/backward pass of the learner")
    actor_learning_rate: float = opt(2e-5, "GRPO learning rate (constant)")
    init_kl_coef: float = opt(0.0, "weight of the k3 KL-to-reference loss; 0 = no reference model is run")
    temperature: float = opt(0.7, "GRPO sampling temperature (at 1.0 a 135M model's samples are mostly noise)")
    generate_max_len: int = opt(32, "most tokens per response, in training and in the evaluations")
    eval_steps: int = opt(5, "held-out accuracy every N steps (and before the first, after the last)")
    bf16: str = opt("auto", "bfloat16 learner and reference: auto = where the CPU has bf16 units (or on a GPU)",
                    choices=["auto", "on", "off"])
    device: str = opt("auto", "where the services run", choices=["auto", "cpu", "cuda"])
    seed: int = opt(0, "seed of the data order and the sampling (the task has its own: --task_args)")

    def validate(self) -> None:
        for name in ("heldout_problems", "grpo_steps", "rollout_batch_size", "micro_train_batch_size",
                     "generate_max_len", "eval_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.n_samples_per_prompt < 2:
            raise ConfigError("--n_samples_per_prompt must be >= 2: GRPO compares the samples of a prompt")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % self.micro_train_batch_size:
            raise ConfigError(f"--micro_train_batch_size {self.micro_train_batch_size} must divide the samples of a "
                              f"step, --rollout_batch_size x --n_samples_per_prompt = {samples}")
        if self.model_dir and not (pathlib.Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(f"--model_dir {self.model_dir}: no config.json there; give a Hugging Face model folder")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def use_bf16(self) -> bool:
        if self.bf16 != "auto":
            return self.bf16 == "on"
        if self.device == "cuda":
            return True
        from services.rollout.cpu_defaults import cpu_has_bf16_units, read_cpu_flags

        # Without bf16 units a bf16 matmul is emulated and slower than float32 (measured 0.35x).
        return cpu_has_bf16_units(read_cpu_flags())


# ----------------------------------------------------------------------------------------------
# The model and the task


def resolve_model(config: RealQuickstartConfig) -> pathlib.Path:
    """--model_dir as given, else the fetched model (downloaded and converted on the first run)."""
    if config.model_dir:
        return pathlib.Path(config.model_dir).resolve()
    from services.common.model_fetch import cache_root, fetch, load_catalogue

    models = load_catalogue()
    if config.model not in models:
        raise ConfigError(f"--model {config.model!r} cannot be fetched; the models are {', '.join(models)}")
    return fetch(models[config.model], cache_root() / config.model)


def write_task(config: RealQuickstartConfig, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """`rlmesh make-task TASK --out DIR` in its own process, as a user runs it; its train and held-out files."""
    argv = [sys.executable, "-m", "services.cli", "make-task", config.task, "--out", str(out_dir), *config.task_args]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"rlmesh make-task {config.task} failed (exit {done.returncode}): "
                        f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    files = sorted(out_dir.rglob("*.jsonl"))
    train = [f for f in files if "train" in f.name]
    test = [f for f in files if any(word in f.name for word in ("test", "heldout", "held_out"))]
    if len(train) != 1 or len(test) != 1:
        raise RuntimeError(f"rlmesh make-task {config.task} wrote {[str(f) for f in files]}: expected one "
                           "training and one held-out JSONL file")
    return {"train": train[0], "test": test[0]}


# ----------------------------------------------------------------------------------------------
# GRPO over services started once


def grpo_argv(config: RealQuickstartConfig, model: pathlib.Path, data: dict, run_dir: pathlib.Path) -> list[str]:
    """The `rlmesh train` flags of the GRPO run (OpenRLHF's names)."""
    prompts = sum(1 for line in data["train"].open() if line.strip())
    samples = config.rollout_batch_size * config.n_samples_per_prompt
    episodes = -(-config.grpo_steps * config.rollout_batch_size // max(prompts, 1))  # passes for grpo_steps
    return ["--pretrain", str(model), "--prompt_data", str(data["train"]), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--reward_func", "math",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(config.n_samples_per_prompt),
            "--rollout_batch_size", str(config.rollout_batch_size), "--micro_rollout_batch_size", str(samples),
            "--train_batch_size", str(samples), "--micro_train_batch_size", str(config.micro_train_batch_size),
            "--max_epochs", "1", "--num_episodes", str(episodes), "--max_steps", str(config.grpo_steps),
            "--prompt_max_len", "256", "--generate_max_len", str(config.generate_max_len),
            "--temperature", str(config.temperature), "--actor_learning_rate", str(config.actor_learning_rate),
            "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0",
            "--init_kl_coef", str(config.init_kl_coef), *(["--use_kl_loss"] if config.init_kl_coef > 0 else []),
            "--kl_estimator", "k3",
            "--zero_stage", "2", "--device", config.device, "--seed", str(config.seed),
            "--eval_dataset", str(data["test"]), "--eval_steps", str(config.eval_steps),
            "--eval_max_samples", str(config.heldout_problems),
            "--save_path", str(run_dir / "model"), "--disable_ds_ckpt", "--run_dir", str(run_dir / "grpo"),
            "--logging_steps", "1", *(["--bf16"] if config.use_bf16() else [])]


async def heldout_verdicts(pool, scorer, prompts, decoder, max_tokens: int, label: str) -> tuple[dict, list[bool]]:
    """Greedy pass@1 metrics on the held-out prompts and each prompt's verdict, in their order."""
    from rlmesh.rollout.v1 import rollout_pb2
    from services.coordinator.loop.evaluate import evaluate

    versions = {info.weight_version for info in await pool.model_infos()}
    sampling = rollout_pb2.SamplingOptions(temperature=0.0, max_tokens=max_tokens, return_text=True)
    results: list = []
    metrics = await evaluate(pool, scorer, prompts, 1, sampling, max(versions), seed=0, request_name=label,
                             decoder=decoder, results_out=results)
    return metrics, [r.correct[0] for r in results]


async def run_services_and_rl(config: RealQuickstartConfig, model: pathlib.Path, data: dict,
                              run_dir: pathlib.Path) -> dict:
    """Starts rollout, reward + reference and learner once; evaluates, runs GRPO over them, evaluates
    again on the same engine, now holding the trained weights."""
    from transformers import AutoTokenizer

    from services.common.paired import compare
    from services.coordinator.cli import train
    from services.coordinator.cli.eval_cli import pool_scorer, reward_pool
    from services.coordinator.config import CoordinatorConfig
    from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready
    from services.coordinator.fleet.placement import learner_argv, reward_argv, rollout_argv
    from services.coordinator.loop.evaluate import load_eval_prompts
    from services.coordinator.loop.queries import QueryDecoder
    from services.coordinator.loop.rollout_pool import RolloutPool

    base = grpo_argv(config, model, data, run_dir)
    local = parse_config(CoordinatorConfig, base + ["--placement", "local"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = load_eval_prompts(str(data["test"]), tokenizer, "prompt", "label", True, "", local.prompt_max_len,
                                config.heldout_problems, config.seed)
    log_dir = run_dir / "logs"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if config.device == "cpu" else {}
    services = [
        spawn_service("rollout", "services.rollout", rollout_argv(local), log_dir, env=env),
        spawn_service("reward-ref", "services.reward", reward_argv(local, True, True), log_dir, env=env),
        spawn_service("learner", "services.learner", learner_argv(local, config.grpo_steps, 1), log_dir,
                      env={**env, "LOCAL_RANK": "0"}),
    ]
    pool = scoring = None
    timings: dict[str, float] = {}
    try:
        started = time.monotonic()
        await asyncio.gather(*(wait_until_ready(s, local.service_start_timeout_s) for s in services))
        rollout, reward, learner = (s.address for s in services)
        timings["services_s"] = time.monotonic() - started
        log_event(_log, "services.ready", seconds=f"{timings['services_s']:.1f}", rollout=rollout, reward=reward,
                  learner=learner)
        pool = RolloutPool([rollout], local.rpc_timeout_s)
        scoring = reward_pool([reward], local.rpc_timeout_s)
        scorer, decoder = pool_scorer(scoring), QueryDecoder(tokenizer)
        started = time.monotonic()
        before, before_ok = await heldout_verdicts(pool, scorer, prompts, decoder, config.generate_max_len, "eval_before")
        timings["eval_before_s"] = time.monotonic() - started
        static = parse_config(CoordinatorConfig, base + [
            "--placement", "static", "--rollout_addresses", rollout, "--reward_addresses", reward,
            "--ref_addresses", reward, "--learner_address", learner])
        started = time.monotonic()
        code = await train.run(static)
        if code != 0:
            raise RuntimeError(f"the GRPO run failed (exit {code}); see {run_dir / 'grpo'} and {log_dir}")
        timings["grpo_s"] = time.monotonic() - started
        started = time.monotonic()
        after, after_ok = await heldout_verdicts(pool, scorer, prompts, decoder, config.generate_max_len, "eval_after")
        timings["eval_after_s"] = time.monotonic() - started
    finally:
        if pool is not None:
            await pool.close()
        if scoring is not None:
            await scoring.close()
        await asyncio.to_thread(stop_all, services, 30.0)
    return {"comparison": compare(before_ok, after_ok).as_dict(),
            "response_length_before": before["eval/response_length"],
            "response_length_after": after["eval/response_length"], **timings}


# ----------------------------------------------------------------------------------------------
# Report


def plot_curves(run_dir: pathlib.Path, title: str) -> list[pathlib.Path]:
    """The learning curve (one PNG) first, then `rlmesh plot`'s summary and per-metric PNGs."""
    from services.coordinator.cli.learning_curve import plot_learning_curve
    from services.coordinator.cli.plot import plot_run

    grpo = run_dir / "grpo"
    curve = plot_learning_curve(grpo, run_dir / "learning_curve.png", title=title)
    keys = ["reward/mean", "eval/pass@1", "kl/mean", "response_length/mean", "response_length/truncated_ratio",
            "time/step_s"]
    return [curve, *plot_run(grpo, keys)]


def describe(result: dict) -> str:
    c = result["comparison"]
    interval = lambda pair: f"[{pair[0]:.3f}, {pair[1]:.3f}]"  # noqa: E731
    verdict = ("more than both 95% intervals' half-widths combined" if c["significant"] else
               "NOT more than both 95% intervals' half-widths combined")
    return "\n".join([
        f"held-out greedy accuracy on {c['problems']} problems ({result['model']}):",
        f"  before GRPO: {c['before']:.3f} {interval(c['before_interval'])}",
        f"  after GRPO : {c['after']:.3f} {interval(c['after_interval'])}",
        f"  gain {c['gain']:+.3f}: {verdict} ({c['margin']:.3f}); McNemar exact p = {c['mcnemar_p']:.2g} "
        f"({c['gained']} problems gained, {c['lost']} lost)",
        f"  mean response length {result['response_length_before']:.1f} -> {result['response_length_after']:.1f} tokens",
        f"time: {result['total_seconds']:.0f} s in all (model {result['model_s']:.0f} s, services "
        f"{result['services_s']:.0f} s, evaluations {result['eval_before_s'] + result['eval_after_s']:.0f} s, "
        f"GRPO {result['grpo_s']:.0f} s for {result['grpo_steps']} steps)"])


def main(argv: list[str] | None = None) -> int:
    from services.common import config as config_module

    if config_module.PROGRAM == "rlmesh quickstart":  # usage lines and errors name what the user typed
        config_module.PROGRAM = "rlmesh quickstart --real"
    config = parse_config(RealQuickstartConfig, argv, description=RealQuickstartConfig.__doc__)
    started = time.monotonic()
    run_dir = pathlib.Path(config.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(config)
    model_s = time.monotonic() - started
    data = write_task(config, run_dir / "task")
    log_event(_log, "quickstart.ready", model=str(model), seconds=f"{model_s:.1f}", train=str(data["train"]),
              heldout=str(data["test"]))
    result = asyncio.run(run_services_and_rl(config, model, data, run_dir))
    result.update({"model": config.model_dir or config.model, "model_dir": str(model), "model_s": model_s,
                   "grpo_steps": config.grpo_steps, "train_file": str(data["train"]), "heldout_file": str(data["test"]),
                   "trained_model": str(run_dir / "model"), "total_seconds": time.monotonic() - started})
    plots = plot_curves(run_dir, f"GRPO of {pathlib.Path(result['model']).name} on {config.task}, "
                                 f"{config.device.upper()}")
    result["plots"] = [str(p) for p in plots]
    (run_dir / "quickstart.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n" + describe(result))
    print(f"learning curve: {plots[0]}")
    print(f"other curves: {plots[1].parent}; samples: rlmesh samples {run_dir / 'grpo'}; "
          f"trained model: {result['trained_model']}; summary: {run_dir / 'quickstart.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
