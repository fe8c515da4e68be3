"""`rlmesh quickstart` (`make quickstart`): a small model learns arithmetic, by imitation and then by RL.

Everything runs on this machine (a CPU is enough) through the real services:

  1. build a tiny model and tokenizer (services.common.tiny) and an arithmetic set: "12+7=" and
     "15-9=" with operands below --max_operand, answers written "\\boxed{19}"; a held-out split
     is kept for evaluation;
  2. SFT on the training problems (services.learner.train_sft: DeepSpeed, loss on the answer);
  3. start the services once: rollout (vLLM), reward (the `math` rule), learner (DeepSpeed);
  4. greedy accuracy on the held-out problems, through the rollout and reward services;
  5. GRPO (the coordinator's loop, `rlmesh train`) over those services: n samples per prompt,
     group-normalised rewards, weights pushed to the rollout engine after every step;
  6. greedy accuracy again, on the same engine now holding the RL weights; print both numbers,
     the run time and the PNG curves.

The task is sized so that SFT stops short of what the model can do and RL's reward closes part of
the gap within a few minutes of CPU time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import subprocess
import sys
import time

from services.common.config import ConfigError, opt, parse_config
from services.common.log import get_logger, log_event

_log = get_logger("quickstart")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class QuickstartConfig:
    """Builds a tiny model, SFTs it on arithmetic, runs GRPO with the math rule reward, and reports held-out
    accuracy before and after RL. `rlmesh quickstart --real` does the same with a real pretrained model
    (SmolLM2-135M-Instruct, no SFT); `rlmesh quickstart --real --help` lists its options."""

    run_dir: str = opt("runs/quickstart", "output folder: data, models, metrics, plots, service logs")
    model_size: str = opt("tiny", "model from the tiny kit: tiny (~0.6M parameters) or small (~3M)",
                          choices=["tiny", "small"])
    max_operand: int = opt(20, "problems are a+b and a-b (a >= b) with operands 0 .. max_operand-1")
    test_fraction: float = opt(0.2, "share of the problems held out for evaluation (at most 200 problems)")
    seed: int = opt(0, "seed of the model, the data split and the runs")
    sft_epochs: int = opt(40, "SFT passes over the training problems")
    sft_learning_rate: float = opt(2e-3, "SFT learning rate (constant)")
    grpo_steps: int = opt(40, "GRPO steps (each: rollout_batch_size prompts x n_samples_per_prompt samples)")
    rollout_batch_size: int = opt(16, "prompts per GRPO step")
    n_samples_per_prompt: int = opt(8, "samples per prompt; their rewards are normalised within the group")
    actor_learning_rate: float = opt(2e-4, "GRPO learning rate (constant)")
    temperature: float = opt(1.0, "GRPO sampling temperature")
    rollout_engine: str = opt("vllm", "rollout engine: vllm, or hf (transformers) where vLLM is missing",
                              choices=["vllm", "hf"])
    device: str = opt("auto", "where the services run", choices=["auto", "cpu", "cuda"])
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage of SFT and the learner", choices=[0, 1, 2, 3])

    def validate(self) -> None:
        if self.max_operand < 5:
            raise ConfigError(f"--max_operand {self.max_operand} leaves too few problems; use >= 5")
        if not 0 < self.test_fraction < 0.5:
            raise ConfigError(f"--test_fraction {self.test_fraction} must be in (0, 0.5)")
        for name in ("sft_epochs", "grpo_steps", "rollout_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.n_samples_per_prompt < 2:
            raise ConfigError("--n_samples_per_prompt must be >= 2: GRPO compares the samples of a prompt")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# Data


def arithmetic_problems(max_operand: int) -> list[tuple[str, int]]:
    """("a+b=", a+b) for a, b < max_operand and ("a-b=", a-b) for b <= a: no negative answers."""
    from services.common.tiny import arith_prompt

    problems = [(arith_prompt(a, "+", b), a + b) for a in range(max_operand) for b in range(max_operand)]
    problems += [(arith_prompt(a, "-", b), a - b) for a in range(max_operand) for b in range(a + 1)]
    return problems


def write_data(out_dir: pathlib.Path, max_operand: int, test_fraction: float, seed: int) -> dict[str, pathlib.Path]:
    """train.jsonl / test.jsonl {"prompt", "label"} (disjoint) and sft.jsonl {"prompt", "response"}."""
    problems = arithmetic_problems(max_operand)
    random.Random(seed).shuffle(problems)
    n_test = min(200, int(len(problems) * test_fraction))
    test, train = problems[:n_test], problems[n_test:]
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"train": out_dir / "train.jsonl", "test": out_dir / "test.jsonl", "sft": out_dir / "sft.jsonl"}
    rows = {"train": [{"prompt": p, "label": str(c)} for p, c in train],
            "test": [{"prompt": p, "label": str(c)} for p, c in test],
            # The short answer keeps sequences at ~12 tokens: cheap to train and to sample on a CPU.
            "sft": [{"prompt": p, "response": f"\\boxed{{{c}}}"} for p, c in train]}
    for name, path in files.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
    return files


# ----------------------------------------------------------------------------------------------
# Steps


def run_sft(config: QuickstartConfig, model_dir: pathlib.Path, data: dict, out_dir: pathlib.Path) -> dict:
    """SFT in its own process (DeepSpeed owns its process group); returns its last metrics."""
    argv = [sys.executable, "-m", "services.learner.train_sft", "--pretrain", str(model_dir),
            "--dataset", str(data["sft"]), "--input_key", "prompt", "--output_key", "response",
            "--input_template", "",  # the raw prompt, as GRPO samples from it
            "--max_epochs", str(config.sft_epochs), "--train_batch_size", "32", "--micro_train_batch_size", "32",
            "--learning_rate", str(config.sft_learning_rate), "--lr_scheduler", "constant_with_warmup",
            "--lr_warmup_ratio", "0", "--zero_stage", str(config.zero_stage), "--seed", str(config.seed),
            "--logging_steps", "10", "--save_path", str(out_dir)]
    log_path = out_dir.parent / "logs" / "sft.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "protos")])}
    with log_path.open("w") as log:
        code = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"SFT failed (exit {code}); last lines of {log_path}:\n{tail}")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


def grpo_argv(config: QuickstartConfig, sft_dir: pathlib.Path, data: dict, run_dir: pathlib.Path) -> list[str]:
    """The `rlmesh train` flags of the GRPO run (the seed documents' names)."""
    prompts = sum(1 for _ in data["train"].open())
    samples = config.rollout_batch_size * config.n_samples_per_prompt
    episodes = -(-config.grpo_steps * config.rollout_batch_size // prompts)  # enough passes for grpo_steps
    return ["--pretrain", str(sft_dir), "--prompt_data", str(data["train"]), "--input_key", "prompt",
            "--label_key", "label", "--reward_func", "math", "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", str(config.n_samples_per_prompt),
            "--rollout_batch_size", str(config.rollout_batch_size), "--micro_rollout_batch_size", str(samples),
            "--train_batch_size", str(samples), "--micro_train_batch_size", str(samples), "--max_epochs", "1",
            "--num_episodes", str(episodes), "--max_steps", str(config.grpo_steps),
            "--prompt_max_len", "16", "--generate_max_len", "12", "--temperature", str(config.temperature),
            "--actor_learning_rate", str(config.actor_learning_rate), "--lr_scheduler", "constant_with_warmup",
            "--lr_warmup_ratio", "0", "--init_kl_coef", "0", "--zero_stage", str(config.zero_stage),
            "--rollout_engine", config.rollout_engine, "--device", config.device, "--seed", str(config.seed),
            "--save_path", str(run_dir / "grpo_model"), "--ckpt_path", str(run_dir / "grpo" / "ckpt"),
            "--disable_ds_ckpt", "--run_dir", str(run_dir / "grpo"), "--logging_steps", "1",
            # On a CPU, vLLM's torch.compile takes ~34 s of a ~55 s start and decodes this model no
            # faster (16 x 8 samples x 12 tokens: 0.157 s compiled, 0.160 s eager).
            *(["--enforce_eager"] if config.device == "cpu" and config.rollout_engine == "vllm" else [])]


async def accuracy(pool, scorer, prompts, label: str) -> float:
    """Greedy pass@1 on the held-out prompts through the rollout and reward services."""
    from rlmesh.rollout.v1 import rollout_pb2
    from services.coordinator.loop.evaluate import evaluate

    versions = {info.weight_version for info in await pool.model_infos()}
    sampling = rollout_pb2.SamplingOptions(temperature=0.0, max_tokens=12, return_text=True)
    metrics = await evaluate(pool, scorer, prompts, 1, sampling, max(versions), seed=0, request_name=label)
    return metrics["eval/pass@1"]


async def run_services_and_rl(config: QuickstartConfig, sft_dir: pathlib.Path, data: dict,
                              run_dir: pathlib.Path) -> dict:
    """Starts rollout, reward and learner once; evaluates, runs GRPO over them, evaluates again."""
    from transformers import AutoTokenizer

    from services.coordinator.cli import train
    from services.coordinator.config import CoordinatorConfig
    from services.coordinator.cli.eval_cli import pool_scorer, reward_pool
    from services.coordinator.loop.evaluate import load_eval_prompts
    from services.coordinator.fleet.launcher import spawn_service, stop_all, wait_until_ready
    from services.coordinator.fleet.placement import learner_argv, reward_argv, rollout_argv
    from services.coordinator.loop.rollout_pool import RolloutPool

    base = grpo_argv(config, sft_dir, data, run_dir)
    local = parse_config(CoordinatorConfig, base + ["--placement", "local"])
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    prompts = load_eval_prompts(str(data["test"]), tokenizer, "prompt", "label", False, "", 16, 10**9, config.seed)
    log_dir = run_dir / "logs"
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if config.device == "cpu" else {}
    services = [
        spawn_service("rollout", "services.rollout", rollout_argv(local), log_dir, env=env),
        spawn_service("reward", "services.reward", reward_argv(local, True, False), log_dir, env=env),
        spawn_service("learner", "services.learner", learner_argv(local, config.grpo_steps, 1), log_dir,
                      env={**env, "LOCAL_RANK": "0"}),
    ]
    pool = scoring = None
    try:
        started = time.monotonic()
        await asyncio.gather(*(wait_until_ready(s, local.service_start_timeout_s) for s in services))
        rollout, reward, learner = (s.address for s in services)
        log_event(_log, "services.ready", seconds=f"{time.monotonic() - started:.1f}", rollout=rollout,
                  reward=reward, learner=learner)
        pool = RolloutPool([rollout], local.rpc_timeout_s)
        scoring = reward_pool([reward], local.rpc_timeout_s)
        scorer = pool_scorer(scoring)
        before = await accuracy(pool, scorer, prompts, "eval_after_sft")
        static = parse_config(CoordinatorConfig, base + [
            "--placement", "static", "--rollout_addresses", rollout, "--reward_addresses", reward,
            "--learner_address", learner])
        started = time.monotonic()
        code = await train.run(static)
        if code != 0:
            raise RuntimeError(f"the GRPO run failed (exit {code}); see {run_dir / 'grpo'} and {log_dir}")
        grpo_seconds = time.monotonic() - started
        after = await accuracy(pool, scorer, prompts, "eval_after_grpo")
        return {"accuracy_after_sft": before, "accuracy_after_grpo": after, "heldout_problems": len(prompts),
                "grpo_seconds": grpo_seconds}
    finally:
        if pool is not None:
            await pool.close()
        if scoring is not None:
            await scoring.close()
        await asyncio.to_thread(stop_all, services, 30.0)


def plot_curves(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """The SFT loss curve and the GRPO reward / length / step-time curves as PNG files."""
    from services.coordinator.cli.plot import plot_run

    paths = plot_run(run_dir / "sft", ["train/loss"])
    grpo_plots = run_dir / "grpo" / "plots"
    paths += sorted(grpo_plots.glob("*.png")) if grpo_plots.is_dir() else []
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--real" in argv:  # the real pretrained model's quickstart: its own module and options
        from services.quickstart_real import main as main_real

        return main_real([a for a in argv if a != "--real"])
    config = parse_config(QuickstartConfig, argv, description=QuickstartConfig.__doc__)
    from services.common.tiny import make_tiny_model

    started = time.monotonic()
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(run_dir / "model", size=config.model_size, seed=config.seed)
    data = write_data(run_dir / "data", config.max_operand, config.test_fraction, config.seed)
    log_event(_log, "quickstart.data", folder=str(run_dir / "data"), model=str(model_dir))
    sft_started = time.monotonic()
    sft = run_sft(config, model_dir, data, run_dir / "sft")
    sft_seconds = time.monotonic() - sft_started
    log_event(_log, "quickstart.sft_done", seconds=f"{sft_seconds:.1f}", loss=f"{sft.get('train/loss', 0):.4f}")
    result = asyncio.run(run_services_and_rl(config, run_dir / "sft", data, run_dir))
    result.update({"sft_seconds": sft_seconds, "total_seconds": time.monotonic() - started,
                   "sft_model": str(run_dir / "sft"), "grpo_model": str(run_dir / "grpo_model")})
    plots = plot_curves(run_dir)
    result["plots"] = [str(p) for p in plots]
    (run_dir / "quickstart.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nheld-out greedy accuracy on {result['heldout_problems']} problems:")
    print(f"  after SFT : {result['accuracy_after_sft']:.3f}")
    print(f"  after GRPO: {result['accuracy_after_grpo']:.3f}")
    print(f"time: {result['total_seconds']:.0f} s (SFT {sft_seconds:.0f} s, GRPO {result['grpo_seconds']:.0f} s)")
    print("curves:")
    for path in plots:
        print(f"  {path}")
    print(f"models: {result['sft_model']} (SFT), {result['grpo_model']} (GRPO); summary: {run_dir / 'quickstart.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
