"""Kill trials: does a GRPO run survive `kill -9` of any one service at a random moment, and does it
end with the same steps and samples as a run without faults?

    python bench/chaos.py --trials 20 [--seed 0] [--steps 3] [--engines 2] [--out runs/chaos]

First a run without faults (the baseline), then one run per trial with one kill: a service drawn
from rollout-0, reward-ref-0, learner and the coordinator itself, a phase drawn from generate,
score, train, push and checkpoint, a step drawn from 1..steps, and a delay of 0-0.5 s after the
phase is seen. A killed coordinator is followed by the same command with --load_checkpoint. Per
trial it prints the service killed, when, whether the run finished, the steps redone, and whether
the step count and every step's sample counts (and rewards, losses) equal the baseline's; the last
line is `completed K/N` (finished with exact counts).
Everything runs on this machine (local placement, CPU, the tiny model, hf rollout engines).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import sys
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(__file__).resolve().parents[1] / "protos")]

from services.common.tiny import make_data, make_tiny_model  # noqa: E402
from tests.chaos.harness import Kill, differences, grpo_argv, model_difference, run_trial  # noqa: E402

SERVICES = ("rollout-0", "reward-ref-0", "learner", "coordinator")
PHASES = ("generate", "score", "train", "push", "checkpoint")


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="draws the kills")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--out", default="runs/chaos")
    parser.add_argument("--timeout_s", type=float, default=900.0)
    args = parser.parse_args()
    root = pathlib.Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    # DeepSpeed's JIT-built comm op gets a cache of its own: a learner killed while it holds the
    # shared cache's build lock would leave every later learner on the machine waiting for it.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    model = make_tiny_model(root / "model", seed=0)
    data = make_data(root / "data", seed=0)
    argv = lambda out: grpo_argv(model, data, out, args.engines, args.steps, args.engine)  # noqa: E731

    base_out = root / "baseline"
    t0 = time.monotonic()
    base = run_trial(argv(base_out), base_out, timeout_s=args.timeout_s)
    if base.returncode != 0:
        print(base.log[-4000:])
        print("the run without faults failed; no trials")
        return 1
    print(f"baseline: {len(base.steps)} steps in {base.seconds:.0f} s, "
          f"{sum(r['samples/generated'] for r in base.records)} samples")

    rng = random.Random(args.seed)
    completed = 0
    restart_s: dict[str, list[float]] = {}
    header = (f"{'trial':>5}  {'killed':<13} {'when':<22} {'at_s':>6}  {'finished':<8} {'redone':>6}  {'restarts':>8}  "
              f"{'restart_s':>9}  {'same as baseline':<16} {'run_s':>6}")
    print(header)
    for n in range(1, args.trials + 1):
        kill = Kill(rng.choice(SERVICES), rng.choice(PHASES), rng.randint(1, args.steps), round(rng.uniform(0, 0.5), 2))
        out = root / f"trial{n:02d}"
        trial = run_trial(argv(out), out, [kill], timeout_s=args.timeout_s)
        finished = trial.returncode == 0
        diffs = differences(base, trial)
        if finished and not diffs and (out / "model").is_dir():
            if model_difference(base_out / "model", out / "model") > 1e-6:
                diffs.append("final model differs")
        same = finished and not diffs
        completed += same
        # A coordinator kill redoes what its checkpoint did not hold; the learner's rewind says so itself.
        redone = trial.redone_steps
        at = f"{trial.killed_at_s[0]:6.1f}" if trial.killed_at_s else "  miss"
        # From the death noticed to serving again (back-off included); a killed coordinator: none.
        seconds = [e["since_death_s"] for e in trial.events if e["event"] == "service.restarted"]
        for e in trial.events:
            if e["event"] == "service.restarted":
                restart_s.setdefault(e["service"].rsplit("-", 1)[0] if e["service"] != "learner" else "learner",
                                     []).append(e["since_death_s"])
        print(f"{n:>5}  {kill.service:<13} {f'{kill.phase} step {kill.step} +{kill.delay_s}s':<22} {at}  "
              f"{'yes' if finished else 'NO':<8} {redone:>6}  {trial.count('service.restarted'):>8}  "
              f"{(f'{max(seconds):.1f}' if seconds else '-'):>9}  {'yes' if same else 'NO':<16} {trial.seconds:6.0f}")
        if not same:
            print(f"       {'; '.join(diffs[:3]) or trial.log[-1500:]}")
    for service, values in sorted(restart_s.items()):
        values.sort()
        print(f"restart time {service}: median {values[len(values) // 2]:.1f} s, range {values[0]:.1f}-{values[-1]:.1f} s "
              f"over {len(values)} restarts")
    print(f"completed {completed}/{args.trials} (baseline + trials: {time.monotonic() - t0:.0f} s)")
    return 0 if completed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
