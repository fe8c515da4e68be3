"""Job L: does the model LEARN as well under rlmesh as under OpenRLHF, TRL and veRL, and in how much
time? One real instruct model (SmolLM2-135M-Instruct by default), one task (arithmetic problems with a
verifier), the same prompts, reward, batch, samples per prompt, learning rate, steps and held-out set
for every framework, one GPU, one invocation:

    . /tmp/gpu-env.sh; python3 bench/gpu/learn_peers.py --out /tmp/logs/L --frameworks rlmesh openrlhf trl
    python3 bench/gpu/learn_peers.py --model_dir DIR --train_file T.jsonl --test_file H.jsonl --steps 40 --eval_every 5

Inputs: --model_dir (an HF folder), else `rlmesh fetch-model NAME`; --train_file / --test_file (JSONL
of prompt, label and optionally difficulty), else `rlmesh make-task TASK`. The training prompts are
the first steps x prompts_per_step rows of the train file after a seeded shuffle, the held-out set the
first --eval_size rows of the test file after the same; a held-out prompt that is also a training
prompt stops the build. The settings and each framework's exact command are in learn_commands.py
and in the results.

Each framework runs as a watched child (peer_run.watch: steps, GPU, host) and saves an HF checkpoint
every --eval_every steps; a thread notes the second (from the framework's start) at which each
checkpoint is complete on disk. After all runs, ONE evaluator (learn_eval.py: one vLLM engine, greedy,
the same verifier) scores the base model and every checkpoint on the held-out set; learn_report.py
compares accuracy against steps and against wall-clock seconds and draws learning-L.png. Writes
results.json (settings, commands, steps, checkpoints, scores, comparison) and table.txt into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

import learn_commands as lc
import learn_report
from peer_run import ROOT, TEARDOWN_S, child_env, commit_id, versions, watch
from spread import spread

HERE = pathlib.Path(__file__).resolve().parent
# How the project's own commands are called when an input is not given (services/cli.py).
FETCH_MODEL = ["fetch-model", "{name}", "--out", "{out}"]
MAKE_TASK = ["make-task", "{task}", "--out", "{out}", "--levels={levels}"]
# --task make-data: the tiny kit's arithmetic ("12+7=" prompts, train/test split), which needs no make-task
MAKE_DATA = ["make-data", "{out}"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/logs/L", help="folder of logs, results.json, table.txt and the PNG (small)")
    p.add_argument("--scratch", default="/tmp/vs_peers_scratch/L", help="folder of the model, data and checkpoints (GBs)")
    p.add_argument("--frameworks", nargs="+", default=["rlmesh", "openrlhf", "trl"], choices=lc.FRAMEWORKS,
                   help="in the order they run; veRL (~270 s of start-up) is left out unless named")
    p.add_argument("--model_dir", default="", help="the model as an HF folder; empty: rlmesh fetch-model --model_name")
    p.add_argument("--model_name", default="smollm2-135m-instruct", help="what rlmesh fetch-model fetches")
    p.add_argument("--train_file", default="", help="training prompts (JSONL); empty: rlmesh make-task --task")
    p.add_argument("--test_file", default="", help="held-out prompts (JSONL); with --train_file")
    p.add_argument("--task", default="arith", help="what rlmesh make-task writes when no files are given; "
                   "make-data: rlmesh make-data's arith_train/arith_test.jsonl instead")
    p.add_argument("--task_levels", default="1,2", help="rlmesh make-task's --levels (arith: the two easier levels, "
                   "where SmolLM2-135M finds correct answers to learn from)")
    p.add_argument("--input_key", default="prompt")
    p.add_argument("--label_key", default="label")
    p.add_argument("--eval_size", type=int, default=200, help="held-out problems scored at every checkpoint")
    defaults = lc.Settings()
    for field in dataclasses.fields(lc.Settings):
        p.add_argument(f"--{field.name}", type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name),
                       help=f"every framework's {field.name} (learn_commands.Settings)")
    p.add_argument("--timeout_s", type=float, default=900.0,
                   help="wall-clock limit of ONE framework's run (start-up, steps, saves); a run past it is stopped "
                        f"and its saved checkpoints are still scored. Not included: the build before the first run, "
                        f"the ~{TEARDOWN_S:.0f} s of teardown after each run, the evaluation after all runs")
    p.add_argument("--budget_s", type=float, default=0.0,
                   help="wall-clock limit of all the framework runs together; 0 = none. Each run gets at most what "
                        "is left; with under 60 s left a run is reported as not run. Not included, as for "
                        "--timeout_s: the build, the teardowns and the evaluation (learn_peers.eval_estimate_s)")
    p.add_argument("--eval_timeout_s", type=float, default=0.0, help="limit of the evaluation; 0 = its estimate x 2")
    p.add_argument("--eval_enforce_eager", action=argparse.BooleanOptionalAction, default=True,
                   help="the evaluator's vLLM without CUDA graphs (its start ~1 min faster; one checkpoint's 200 "
                        "greedy answers take seconds either way)")
    p.add_argument("--dry_run", action="store_true", help="build the inputs, write and print the commands, run nothing")
    args = p.parse_args(argv)
    s = settings_of(args)
    if s.steps % s.eval_every:
        p.error(f"--steps {s.steps} must be a multiple of --eval_every {s.eval_every} (every framework saves then)")
    if s.samples_per_step % s.micro_batch:
        p.error(f"--micro_batch {s.micro_batch} must divide prompts_per_step x samples_per_prompt ({s.samples_per_step})")
    if bool(args.train_file) != bool(args.test_file):
        p.error("--train_file and --test_file go together")
    return args


def settings_of(args) -> lc.Settings:
    return lc.Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(lc.Settings)})


def eval_estimate_s(checkpoints: int) -> float:
    """The evaluation's expected seconds: the engine's start and ~6 s per checkpoint (a guess until
    measured; learn_eval.py reports both)."""
    return 90.0 + 6.0 * (checkpoints + 1)


# ----------------------------------------------------------------------------------------------
# Inputs


def project_command(template: list[str], log: pathlib.Path, **values) -> subprocess.CompletedProcess:
    """`rlmesh <template>` in a child; stops the build with its output when it fails."""
    cmd = [sys.executable, "-m", "services.cli", *(part.format(**values) for part in template)]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env("rlmesh", log.parent), capture_output=True, text=True)
    log.write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        raise SystemExit(f"learn_peers: `rlmesh {' '.join(template[:2]).format(**values)}` failed (exit "
                         f"{done.returncode}; {log}): {said[:600]}; or give the input yourself "
                         "(--model_dir / --train_file and --test_file, or --task make-data)")
    return done


def find_model(args, scratch: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    if args.model_dir:
        model = pathlib.Path(args.model_dir).resolve()
    else:
        done = project_command(FETCH_MODEL, out / "fetch-model.log", name=args.model_name, out=scratch / "model")
        printed = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        model = pathlib.Path(printed[-1]) if printed and pathlib.Path(printed[-1]).is_dir() else scratch / "model"
    if not (model / "config.json").is_file():
        raise SystemExit(f"learn_peers: {model} has no config.json: give an HF model folder as --model_dir")
    return model


def task_files(args, scratch: pathlib.Path, out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    if args.train_file:
        return pathlib.Path(args.train_file).resolve(), pathlib.Path(args.test_file).resolve()
    folder = scratch / "task"
    project_command(MAKE_DATA if args.task == "make-data" else MAKE_TASK, out / "make-task.log", task=args.task,
                    out=folder, levels=args.task_levels)
    files = sorted(glob.glob(str(folder / "**" / "*.jsonl"), recursive=True))
    train = [f for f in files if "train" in pathlib.Path(f).name]
    test = [f for f in files if re.search(r"test|heldout|held_out|eval", pathlib.Path(f).name)]
    if len(train) != 1 or len(test) != 1:
        raise SystemExit(f"learn_peers: rlmesh make-task {args.task} wrote {files}: expected one train and one "
                         "test/heldout JSONL; give them as --train_file and --test_file")
    return pathlib.Path(train[0]), pathlib.Path(test[0])


def read_rows(path: pathlib.Path, args) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if args.input_key not in row or args.label_key not in row:
            raise SystemExit(f"learn_peers: {path} line {i + 1} has no {args.input_key!r} / {args.label_key!r} "
                             "(--input_key / --label_key)")
        rows.append({"prompt": row[args.input_key], "label": str(row[args.label_key]),
                     "difficulty": row.get("difficulty", "-")})
    return rows


def select_rows(train: list[dict], test: list[dict], s: lc.Settings, eval_size: int) -> tuple[list[dict], list[dict]]:
    """The training prompts (steps x prompts_per_step) and the held-out set (eval_size), each the first
    rows after a shuffle seeded with s.seed; SystemExit when too few or when they share a prompt."""
    need = s.steps * s.prompts_per_step
    train, test = list(train), list(test)
    random.Random(s.seed).shuffle(train)
    random.Random(s.seed).shuffle(test)
    if len(train) < need:
        raise SystemExit(f"learn_peers: {len(train)} training rows for {s.steps} steps x {s.prompts_per_step} "
                         f"prompts = {need}: fewer steps or a larger task")
    if len(test) < eval_size:
        raise SystemExit(f"learn_peers: {len(test)} held-out rows for --eval_size {eval_size}")
    train, test = train[:need], test[:eval_size]
    shared = {r["prompt"] for r in train} & {r["prompt"] for r in test}
    if shared:
        raise SystemExit(f"learn_peers: {len(shared)} held-out prompts are training prompts too, e.g. "
                         f"{sorted(shared)[0]!r}: the task's splits overlap")
    return train, test


def check_prompt_lengths(model: pathlib.Path, rows: list[dict], limit: int) -> int:
    """The longest chat-templated prompt in tokens; SystemExit past limit (veRL would stop on it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = 0
    for row in rows:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            tokenize=True)
        longest = max(longest, len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    if longest > limit:
        raise SystemExit(f"learn_peers: a chat-templated prompt has {longest} tokens > --prompt_max_len {limit}")
    return longest


def build_inputs(args, s: lc.Settings, scratch: pathlib.Path, out: pathlib.Path) -> tuple[lc.Inputs, dict]:
    model = find_model(args, scratch, out)
    train_path, test_path = task_files(args, scratch, out)
    train, heldout = select_rows(read_rows(train_path, args), read_rows(test_path, args), s, args.eval_size)
    longest = check_prompt_lengths(model, train + heldout, s.prompt_max_len)
    inputs = lc.Inputs(model=model, prompts=scratch / "prompts.jsonl", heldout=scratch / "heldout.jsonl",
                       verifier=scratch / "learn_reward.py", verl_data=scratch / "verl_prompts.parquet")
    inputs.prompts.write_text("".join(json.dumps(r) + "\n" for r in train))
    inputs.heldout.write_text("".join(json.dumps(r) + "\n" for r in heldout))
    shutil.copyfile(HERE / "learn_reward.py", inputs.verifier)
    if "verl" in args.frameworks:  # its parquet is written with the peers' pandas (verl_peer.py's main)
        subprocess.run([sys.executable, str(HERE / "verl_peer.py"), str(scratch)], cwd=ROOT,
                       env=child_env("verl", out), check=True)
    mix = lambda rows: {str(d): sum(1 for r in rows if r["difficulty"] == d) for d in sorted({r["difficulty"] for r in rows}, key=str)}  # noqa: E731
    described = {"model": str(model), "train_file": str(train_path), "test_file": str(test_path),
                 "train_rows": len(train), "heldout_rows": len(heldout), "longest_prompt_tokens": longest,
                 "train_difficulty": mix(train), "heldout_difficulty": mix(heldout)}
    return inputs, described


# ----------------------------------------------------------------------------------------------
# Checkpoints as they appear


def safetensors_complete(path: pathlib.Path) -> bool:
    """Whether a .safetensors file is whole: its size is the header's length plus the end of its last tensor."""
    try:
        with path.open("rb") as f:
            size_bytes = f.read(8)
            header_len = int.from_bytes(size_bytes, "little")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size == 8 + header_len + end
    except (OSError, ValueError, KeyError, TypeError):
        return False


def checkpoint_complete(folder: pathlib.Path) -> bool:
    """An HF folder whose config and every weight file are whole (sharded ones as their index lists them)."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    try:
        names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    except (OSError, ValueError, KeyError):
        return False
    return all(safetensors_complete(folder / name) for name in names)


class CheckpointClock:
    """Notes, for one framework's run, the second (from its start) at which each step's HF export is
    complete on disk; poll() runs on peer_run.watch's 0.2 s tick."""

    def __init__(self, framework: str, scratch: pathlib.Path):
        self.pattern, self.step_of = lc.CHECKPOINT_GLOBS[framework]
        self.scratch = scratch
        self.found: dict[int, dict] = {}

    def poll(self, t_s: float) -> None:
        for path in glob.glob(str(self.scratch / self.pattern)):
            match = re.search(self.step_of, path)
            if match and int(match.group(1)) not in self.found and checkpoint_complete(pathlib.Path(path)):
                step = int(match.group(1))
                self.found[step] = {"step": step, "t_s": round(t_s, 2), "path": path}

    def checkpoints(self) -> list[dict]:
        return [self.found[k] for k in sorted(self.found)]


# ----------------------------------------------------------------------------------------------
# Runs, evaluation, report


def run_framework(framework: str, s: lc.Settings, inputs: lc.Inputs, out: pathlib.Path, scratch: pathlib.Path,
                  args, time_left: float) -> dict:
    work, fw_scratch = out / f"L-{framework}", scratch / f"L-{framework}"
    for folder in (work, fw_scratch):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    cmd = lc.COMMANDS[framework](s, inputs, work, fw_scratch)
    (work / "command.txt").write_text(" ".join(cmd) + "\n")
    result = {"framework": framework, "job": "L", "command": cmd}
    if framework == "trl":
        result["trl_settings"] = json.loads((work / "trl_settings.json").read_text())
    if args.dry_run:
        print(f"[L {framework}] " + " ".join(cmd), flush=True)
        return result
    clock = CheckpointClock(framework, fw_scratch)
    watched, _ = watch(framework, cmd, child_env(framework, out), work, out / f"L-{framework}.log",
                       min(args.timeout_s, time_left), s.steps, f"L {framework}", on_poll=clock.poll)
    result.update(watched, checkpoints=clock.checkpoints())
    ends = [row["t_end"] for row in result["steps"]]
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    if step_s:
        # what run_items.py's estimates hold: the start-up (to step 1's end, less a step) and s/step
        result.update(step_s=step_s, step_stats=spread(step_s),
                      startup_s=max(ends[0] - statistics.median(step_s), 0.0))
    return result


def evaluate(runs: list[dict], s: lc.Settings, inputs: lc.Inputs, out: pathlib.Path, args) -> dict:
    checkpoints = [{"framework": r["framework"], **c} for r in runs for c in r.get("checkpoints", [])]
    manifest = {"base_model": str(inputs.model), "heldout": str(inputs.heldout), "verifier": str(inputs.verifier),
                "max_new_tokens": s.max_new_tokens, "prompt_max_len": s.prompt_max_len,
                "gpu_memory_utilization": 0.3, "enforce_eager": args.eval_enforce_eager, "checkpoints": checkpoints}
    (out / "eval_manifest.json").write_text(json.dumps(manifest, indent=1))
    timeout = args.eval_timeout_s or 2 * eval_estimate_s(len(checkpoints))
    log = out / "L-eval.log"
    with log.open("w") as f:
        try:
            subprocess.run([sys.executable, str(HERE / "learn_eval.py"), str(out / "eval_manifest.json"),
                            str(out / "eval.json")], cwd=ROOT, env=child_env("rlmesh", out), stdout=f,
                           stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            f.write(f"\nstopped after {timeout:.0f} s (--eval_timeout_s)\n")
    report = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else {"scores": []}
    if not report["scores"]:
        report["error"] = "no checkpoint scored: " + " | ".join(log.read_text(errors="replace").splitlines()[-3:])
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    s = settings_of(args)
    out, scratch = pathlib.Path(args.out).resolve(), pathlib.Path(args.scratch).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    results = {"job": "L", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit_id(),
               "versions": versions(), "settings": lc.settings_record(s), "frameworks": args.frameworks,
               "notes": lc.__doc__, "results": []}
    inputs, results["inputs"] = build_inputs(args, s, scratch, out)
    results["model_name"] = args.model_dir or args.model_name
    print(json.dumps({k: results[k] for k in ("date_utc", "commit", "settings", "inputs")}, indent=1), flush=True)
    t_begin = time.monotonic()
    for framework in args.frameworks:
        print(f"=== job L: {framework} ===", flush=True)
        time_left = args.budget_s - (time.monotonic() - t_begin) if args.budget_s else float("inf")
        if time_left < 60:
            results["results"].append({"framework": framework, "job": "L", "error": "not run: --budget_s spent"})
            continue
        try:
            results["results"].append(run_framework(framework, s, inputs, out, scratch, args, time_left - 10))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot start is a result, not the end
            results["results"].append({"framework": framework, "job": "L", "error": f"{type(exc).__name__}: {exc}"})
        (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.dry_run:
        return 0
    results["evaluation"] = evaluate(results["results"], s, inputs, out, args)
    curve = learn_report.curves(results["evaluation"]["scores"])
    results["comparison"] = learn_report.compare(curve)
    text = learn_report.table(curve, results["comparison"])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.txt").write_text(text + "\n")
    print(text, flush=True)
    if curve:
        learn_report.plot(curve, out / "learning-L.png", f"job L: {results['model_name']}, {results['date_utc']}, "
                          f"commit {results['commit'][:9]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
