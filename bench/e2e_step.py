"""End-to-end GRPO step on the tiny model, CPU: rlmesh's services vs TRL's GRPOTrainer.

    .venv/bin/python bench/e2e_step.py                 # rlmesh (vLLM rollout) + TRL
    .venv/bin/python bench/e2e_step.py --engine hf     # rlmesh with the transformers rollout engine
    .venv/bin/python bench/e2e_step.py --no-trl        # rlmesh only

rlmesh runs the real services on this machine (local placement): rollout (vLLM or transformers),
reward (math rule + reference model), learner (DeepSpeed, 1 rank), coordinator. The table shows
the mean over the measured steps (the first --warmup steps are left out) of each phase, steps/s,
and the coordinator's overhead: wall time outside generate, score, train and push, and the CPU
the coordinator process used, both as a share of the step (target: at most 5%).

TRL is installed for the benchmark only, into a throw-away virtual environment that sees this
project's packages (--trl_venv, created on first use with `pip install trl`); it is never a
dependency of rlmesh. It runs the same configuration (model, prompts, group size, batch sizes,
response length, KL coefficient, learning rate, math reward) with transformers generation, and
its step time is compared with rlmesh's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("generate", "score", "advantages", "train", "push")


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    return env


def run_rlmesh(args, model: pathlib.Path, data: pathlib.Path, work: pathlib.Path) -> list[dict]:
    run_dir = work / "rlmesh-run"
    argv = [sys.executable, "-m", "services.coordinator",
            "--pretrain", str(model), "--prompt_data", str(data / "arith_train.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--reward_func", "math",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(args.n),
            "--rollout_batch_size", str(args.prompts), "--micro_rollout_batch_size", str(args.micro_rollout),
            "--train_batch_size", str(args.prompts * args.n), "--micro_train_batch_size", str(args.micro),
            "--generate_max_len", str(args.max_len), "--prompt_max_len", "64", "--temperature", "1.0",
            "--actor_learning_rate", str(args.lr), "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0",
            "--init_kl_coef", str(args.beta), "--use_kl_loss", "--kl_estimator", "k3",
            "--max_steps", str(args.warmup + args.steps), "--rollout_engine", args.engine,
            "--run_dir", str(run_dir), "--ckpt_path", str(work / "ckpt"), "--save_path", "", "--seed", "42"]
    t0 = time.monotonic()
    result = subprocess.run(argv, cwd=REPO, env=bench_env(), capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the rlmesh run failed ({result.returncode}):\n{result.stderr[-5000:]}")
    print(f"rlmesh run: {time.monotonic() - t0:.0f} s including service start-up", file=sys.stderr)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records[args.warmup:]


TRL_SCRIPT = textwrap.dedent('''
    import json, sys, time
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from services.reward.math_check import answers_match
    from services.reward.rules import extract_answer

    cfg = json.loads(sys.argv[1])
    rows = [json.loads(line) for line in open(cfg["data"])][: cfg["prompts"] * cfg["total_steps"]]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in rows])

    def math_reward(completions, label, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        answers = [extract_answer(t) for t in texts]
        return [1.0 if a is not None and answers_match(a, l, 5)[0] else 0.0 for a, l in zip(answers, label)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.monotonic()
        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.monotonic() - self.start)

    timer = StepTimer()
    batch = cfg["prompts"] * cfg["n"]
    config = GRPOConfig(output_dir=cfg["out"], per_device_train_batch_size=cfg["micro"],
                        gradient_accumulation_steps=batch // cfg["micro"], num_generations=cfg["n"],
                        max_completion_length=cfg["max_len"], learning_rate=cfg["lr"], beta=cfg["beta"],
                        temperature=1.0, max_steps=cfg["total_steps"], logging_steps=1, report_to=[],
                        use_cpu=True, save_strategy="no", seed=42, dataloader_num_workers=0, bf16=False,
                        shuffle_dataset=False)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    trainer = GRPOTrainer(model=cfg["model"], reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    import trl
    print("TRL_RESULT " + json.dumps({"step_times": timer.times, "trl": trl.__version__}))
''')


def ensure_trl(venv: pathlib.Path) -> pathlib.Path:
    """A virtual environment with TRL that sees this project's packages; created once."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"installing TRL into {venv} (benchmark only; not a project dependency)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # Pin everything this project already has (torch, transformers, ...) so that TRL runs on the same
    # stack as rlmesh and pip picks a TRL release compatible with it (and no CUDA torch).
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True).stdout
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(l for l in frozen.splitlines() if "==" in l) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "trl", "-c", str(constraints)], check=True)
    return python


def link_project_packages(python: pathlib.Path) -> None:
    """Makes this project's virtual environment (grpc, math-verify, ...) visible to the TRL one,
    behind its own packages: `--system-site-packages` only reaches the base interpreter's."""
    ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    theirs = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    (pathlib.Path(theirs) / "rlmesh-project.pth").write_text(ours + "\n")


def run_trl(args, model: pathlib.Path, data: pathlib.Path, work: pathlib.Path) -> dict:
    python = ensure_trl(pathlib.Path(args.trl_venv))
    link_project_packages(python)
    script = work / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    cfg = {"model": str(model), "data": str(data / "arith_train.jsonl"), "prompts": args.prompts, "n": args.n,
           "micro": args.micro, "max_len": args.max_len, "lr": args.lr, "beta": args.beta,
           "total_steps": args.warmup + args.steps, "out": str(work / "trl-out")}
    env = bench_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "protos")])
    t0 = time.monotonic()
    result = subprocess.run([python, str(script), json.dumps(cfg)], cwd=REPO, env=env, capture_output=True, text=True)
    line = next((l for l in result.stdout.splitlines() if l.startswith("TRL_RESULT ")), None)
    if result.returncode != 0 or line is None:
        sys.exit(f"the TRL run failed ({result.returncode}):\n{result.stderr[-5000:]}")
    print(f"TRL run: {time.monotonic() - t0:.0f} s including model loading", file=sys.stderr)
    out = json.loads(line.removeprefix("TRL_RESULT "))
    out["step_times"] = out["step_times"][args.warmup:]
    return out


def mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="rlmesh rollout engine")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and left out of the means")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (rollout_batch_size)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--micro", type=int, default=16, help="micro_train_batch_size")
    parser.add_argument("--micro_rollout", type=int, default=16,
                        help="rlmesh micro_rollout_batch_size: samples per Score / LogProbs call (pipelining grain)")
    parser.add_argument("--max_len", type=int, default=32, help="generate_max_len / max_completion_length")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate")
    parser.add_argument("--beta", type=float, default=0.001, help="KL coefficient (k3, as a loss)")
    parser.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL comparison")
    parser.add_argument("--trl_venv", default=str(pathlib.Path(tempfile.gettempdir()) / "rlmesh-bench-trl"),
                        help="throw-away virtual environment for TRL")
    args = parser.parse_args()

    from services.common.tiny import make_data, make_tiny_model

    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-") as tmp:
        work = pathlib.Path(tmp)
        model = make_tiny_model(work / "model", seed=0)
        data = make_data(work / "data", seed=0)
        records = run_rlmesh(args, model, data, work)
        step = print_rlmesh(args, records)
        if args.trl:
            trl = run_trl(args, model, data, work)
            trl_step = statistics.fmean(trl["step_times"])
            print(f"\nTRL {trl['trl']} GRPOTrainer, same configuration (transformers generation): "
                  f"{trl_step:.3f} s/step (mean of {len(trl['step_times'])} steps after {args.warmup} warm-up)")
            print(f"step-time ratio TRL / rlmesh: {trl_step / step:.2f}x")
    return 0


def print_rlmesh(args, records: list[dict]) -> float:
    step = mean(records, "time/step_s")
    samples = args.prompts * args.n
    print(f"\nGRPO on the tiny model, CPU: {args.prompts} prompts x {args.n} samples, {args.max_len} tokens max, "
          f"rollout engine {args.engine}; mean of {len(records)} steps after {args.warmup} warm-up steps\n")
    print(f"{'phase':<28}{'seconds':>10}{'share':>9}")
    for phase in PHASES:
        seconds = mean(records, f"time/{phase}_s")
        print(f"{phase:<28}{seconds:>10.3f}{seconds / step:>9.1%}")
    overhead = mean(records, "time/overhead_s")
    cpu = mean(records, "time/coordinator_cpu_s")
    calls = ", ".join(f"{what} {mean(records, f'rpc/{what}_s'):.3f}" for what in ("score", "logprobs", "ref_logprobs")
                      if mean(records, f"rpc/{what}_s"))
    print(f"{'  (summed call time: ' + calls + ')':<28}")
    print(f"{'outside the phases':<28}{overhead:>10.3f}{overhead / step:>9.1%}")
    print(f"{'step (wall)':<28}{step:>10.3f}{1:>9.0%}")
    print(f"{'coordinator CPU':<28}{cpu:>10.3f}{cpu / step:>9.1%}")
    print(f"\nsteps/s {1 / step:.3f}   samples/s {samples / step:.1f}   "
          f"tokens/s {mean(records, 'throughput/tokens_per_s'):.0f}")
    print(f"coordinator overhead (outside the phases): {overhead / step:.1%} of the step "
          f"({'within' if overhead / step <= 0.05 else 'ABOVE'} the 5% target)", flush=True)
    return step


if __name__ == "__main__":
    sys.exit(main())
