"""Synchronous GRPO vs --async_train on the same task and sample budget: samples/s and final reward.

    python bench/async_speedup.py --run_dir runs/async_bench [--steps 20] [--max_staleness 1]

The task is the quickstart's (services/quickstart.py): a tiny model SFT'd on arithmetic, then GRPO
with the math rule through the real services (vLLM rollout, reward, DeepSpeed learner), once
synchronously and once with --async_train. Both runs train the same number of steps on the same
prompts; the table gives samples/s over the whole run (generated samples / sum of step times),
the mean reward of the last quarter of the steps and the held-out greedy accuracy after training
(eval/pass@1), and the ratio async / sync. On a 2-core CPU the rollout engine and the learner
share the cores, so overlap buys little there; the speed-up is meant for separate GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos")]

from services.quickstart import QuickstartConfig, grpo_argv, run_sft, write_data  # noqa: E402


def prepare(run_dir: pathlib.Path, seed: int, sft_epochs: int) -> tuple[QuickstartConfig, pathlib.Path, dict]:
    """The quickstart's tiny model, data and SFT (reused when already there)."""
    from services.common.tiny import make_tiny_model

    config = QuickstartConfig(run_dir=str(run_dir), seed=seed, device="cpu", sft_epochs=sft_epochs)
    data = write_data(run_dir / "data", config.max_operand, config.test_fraction, seed)
    sft_dir = run_dir / "sft"
    if not (sft_dir / "config.json").is_file():
        model_dir = make_tiny_model(run_dir / "model", size=config.model_size, seed=seed)
        run_sft(config, model_dir, data, sft_dir)
    return config, sft_dir, data


def service_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")]),
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_grpo(config: QuickstartConfig, sft_dir: pathlib.Path, data: dict, run_dir: pathlib.Path, steps: int,
             extra: list[str], timeout_s: float) -> list[dict]:
    """One GRPO run with local placement; returns its metrics.jsonl records."""
    config.grpo_steps = steps
    argv = grpo_argv(config, sft_dir, data, run_dir) + [
        "--placement", "local", "--eval_dataset", str(data["test"]), "--eval_steps", str(10 * steps),
        "--eval_temperature", "0"] + extra
    log = run_dir / "coordinator.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "services.coordinator", *argv], cwd=REPO, env=service_env(),
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"GRPO run {' '.join(extra) or 'sync'} failed (exit {proc.returncode}):\n{tail}")
    return [json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(records: list[dict]) -> dict:
    steps = [r for r in records if "time/step_s" in r]
    samples = sum(r["samples/generated"] for r in steps)
    seconds = sum(r["time/step_s"] for r in steps)
    tail = steps[-max(1, len(steps) // 4):]
    final_eval = [r["eval/pass@1"] for r in records if "eval/pass@1" in r]
    return {"steps": len(steps), "samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
            "final_reward": sum(r["reward/mean"] for r in tail) / len(tail),
            "eval_before": final_eval[0] if final_eval else float("nan"),
            "eval_after": final_eval[-1] if final_eval else float("nan"),
            "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in steps) / len(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/async_bench")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max_staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_epochs", type=int, default=40, help="SFT passes before GRPO (the quickstart's 40)")
    parser.add_argument("--timeout_s", type=float, default=1800.0)
    args = parser.parse_args()
    run_dir = pathlib.Path(args.run_dir).resolve()
    started = time.monotonic()
    config, sft_dir, data = prepare(run_dir, args.seed, args.sft_epochs)
    sides = {"sync": [], "async": ["--async_train", "--max_staleness", str(args.max_staleness)]}
    results = {}
    for name, extra in sides.items():
        records = run_grpo(config, sft_dir, data, run_dir / name, args.steps, extra, args.timeout_s)
        results[name] = summarise(records)
    print(f"\nGRPO on the quickstart task, {args.steps} steps x {config.rollout_batch_size} prompts x "
          f"{config.n_samples_per_prompt} samples, max_staleness {args.max_staleness} ({time.monotonic() - started:.0f} s)")
    print(f"{'':8}{'samples/s':>10}{'final reward':>14}{'eval before':>12}{'eval after':>12}{'staleness':>11}")
    for name, r in results.items():
        print(f"{name:8}{r['samples_per_s']:>10.2f}{r['final_reward']:>14.3f}{r['eval_before']:>12.3f}"
              f"{r['eval_after']:>12.3f}{r['staleness_mean']:>11.2f}")
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async / sync samples/s: {ratio:.2f}x")
    (run_dir / "async_speedup.json").write_text(json.dumps({**results, "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
