"""One GRPO job, four frameworks, one GPU: rlmesh (hybrid) vs TRL's GRPOTrainer vs OpenRLHF's train_ppo_ray vs
veRL's main_ppo.

    . /tmp/gpu-env.sh; python3 bench/gpu/vs_peers.py --out /tmp/logs            # jobs A and B, 4 steps each
    python3 bench/gpu/vs_peers.py --jobs A --frameworks rlmesh trl --steps 5

Stage the packages first (bench/gpu/stage_peers.sh). Every framework runs the same job on the same
model, colocated on one GPU with vLLM sleeping between generations:
  - rlmesh: `rlmesh train` with --colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep
    (weights pushed over CUDA IPC), DeepSpeed ZeRO-2 bf16, --packing_samples (varlen attention),
    --use_dynamic_batch (micro-batches of up to 32 full-length samples' tokens: 18,432 on A, 34,816 on B),
    two vLLM engines sharing the GPU and the others' memory share (--rlmesh_engines);
  - TRL: GRPOTrainer with use_vllm, vllm_mode="colocate", vllm_enable_sleep_mode (plain torch AdamW);
  - OpenRLHF: train_ppo_ray --train.colocate_all --vllm.enable_sleep --ds.enable_sleep, ZeRO-2 bf16,
    sdpa attention, no sample packing (its packing needs the flash-attn package, which has no wheel
    for this machine's torch; a stand-in `flash_attn` whose functions raise lets its modules import);
  - veRL: main_ppo (v1 sync trainer), FSDP actor, vLLM in its hybrid engine with free_cache_engine
    (vLLM sleeps), sdpa attention without padding removal; its settings and how they differ from the
    others are listed in bench/gpu/verl_peer.py.

The job: a random Qwen2 with Qwen2.5-0.5B's layers and the project's ~660-token tokenizer
(services/common/tiny.py, size qwen2.5-0.5b), bf16; 64 arithmetic prompts x 8 samples per step;
a rule reward (1 when the label's digits appear in the response); no KL, no reference model;
one optimizer step per 512 samples in micro-batches of 32 (rlmesh, veRL: up to 32 x the longest) with gradient
checkpointing; lr 1e-6.
  A: responses of up to 512 tokens (the random model ends one when it samples an end token).
  B: responses of 1,024 tokens, all of them: a copy of the model whose end tokens can never be
     sampled (their output rows read one constant residual direction with a large negative weight).

Each framework runs as a child process; steps are timed from outside as the wall time between
consecutive step ends (rlmesh: metrics.jsonl lines, TRL: a callback, OpenRLHF: its "Global step"
log lines, veRL: its console logger's "step:N" lines). A background thread samples nvidia-smi every
0.2 s: GPU busy fraction (the mean of utilization.gpu, the share of time a kernel ran) over steps
2..N, and the peak of memory.used over the whole run; another reads /proc/stat every 0.5 s: the
machine's CPU busy and stolen (hypervisor) shares over the same steps. A framework that fails is
reported with its error and versions; the rest go on.
Prints one table per job with ratios to rlmesh and writes results.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import verl_peer  # this folder's modules (vs_peers.py runs as a script)
from peer_run import TEARDOWN_S, child_env, commit_id, versions, watch
from spread import spread
from timing import timed_into

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRAMEWORKS = ("rlmesh", "trl", "openrlhf", "verl")
SAMPLES_PER_PROMPT, LEARNING_RATE, PROMPT_MAX_LEN = 8, 1e-6, 64
SPECIAL_IDS = (0, 1, 2, 3)  # the tiny tokenizer's <|endoftext|>, <|pad|>, <|im_start|>, <|im_end|>

# veRL's copy of the rule, with veRL's signature, is verl_peer.REWARD_FILE.
REWARD_FILE = '''"""Rule reward of rlmesh, TRL and OpenRLHF: 1 when the label's digits appear in the response."""


import torch


def reward_func(queries, prompts, labels, **kwargs):
    responses = kwargs.get("responses") or [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([1.0 if str(label) in response else 0.0 for response, label in zip(responses, labels)])
    # OpenRLHF reads a dict (a plain list counts as no reward there); rlmesh takes either.
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
'''

@dataclass(frozen=True)
class Job:
    name: str
    max_tokens: int
    eos: bool  # False: the end tokens are never sampled, every response runs to max_tokens
    # token budget of a micro-batch where a framework sizes them by tokens (rlmesh, veRL): what the
    # others' fixed micro-batch holds at full length (A: 32 x 576, B: 32 x 1,088), at least 16,384
    micro_batch_tokens: int


def jobs_of(args) -> dict[str, Job]:
    def job(name: str, max_tokens: int, eos: bool) -> Job:
        return Job(name, max_tokens, eos, max(16384, args.micro_batch * (PROMPT_MAX_LEN + max_tokens)))
    return {"A": job("A", args.max_tokens[0], True), "B": job("B", args.max_tokens[1], False)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/logs", help="folder of logs, metrics, results.json and table.txt (small)")
    p.add_argument("--scratch", default="/tmp/vs_peers_scratch", help="folder of the models, data and checkpoints (GBs)")
    p.add_argument("--jobs", nargs="+", default=["A", "B"], choices=["A", "B"])
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS,
                   help="order of the first job; each later job runs them in the reverse order of the one before")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the median is over steps 2..N)")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.4, help="vLLM's share of the GPU, all frameworks")
    p.add_argument("--timeout_s", type=float, nargs=2, default=[330.0, 450.0], metavar=("JOB_A", "JOB_B"),
                   help="wall-clock limit of ONE framework's run (its start-up and steps), one value per job, the "
                        "same for every framework; a run past it is stopped and reported. Not included: the model "
                        f"and data build before the first run, and the ~{TEARDOWN_S:.0f} s of teardown after each "
                        "run (the stop, Ray's exit, the GPU's release). veRL needs ~270 s of start-up: give it more")
    p.add_argument("--budget_s", type=float, default=0.0,
                   help="wall-clock limit of all the framework runs of this invocation together (a rented GPU's "
                        "time); 0 = none. Each run gets at most what is left (and at most --timeout_s); with under "
                        f"60 s left a run is reported as not run. Not included: the model and data build before the "
                        f"first run and the ~{TEARDOWN_S:.0f} s of teardown after each run: subtract them from the "
                        "device time left (bench/gpu/run_items.py does)")
    p.add_argument("--max_tokens", type=int, nargs=2, default=[512, 1024], metavar=("JOB_A", "JOB_B"),
                   help="response limit of each job")
    p.add_argument("--prompts_per_step", type=int, default=64, help="prompts per step (x 8 samples = one optimizer step)")
    p.add_argument("--micro_batch", type=int, default=32, help="samples per forward/backward")
    p.add_argument("--size", default="qwen2.5-0.5b", help="services/common/tiny.py model size (tiny: a CPU check)")
    p.add_argument("--rlmesh_engines", type=int, default=2,
                   help="rlmesh's vLLM engines on the GPU (--vllm_num_engines), each with 1/N of --gpu_memory_utilization")
    p.add_argument("--rlmesh_args", default="", help="options added to rlmesh's command (one string), e.g. "
                   "\"--use_dynamic_batch --train_max_tokens_per_gpu 16384\"")
    p.add_argument("--liger", action="store_true",
                   help="every framework with liger-kernel's Triton RMSNorm / SwiGLU / RoPE, each through its own "
                        "switch: rlmesh --use_liger_kernel, OpenRLHF --ds.use_liger_kernel, TRL use_liger_kernel "
                        "(its layer kernels; its fused log-prob head stays), veRL actor_rollout_ref.model.use_liger")
    p.add_argument("--dry_run", action="store_true", help="build the model, data and commands, print them, run nothing")
    p.add_argument("--role", default="driver", choices=["driver", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--job", default="A", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    p.add_argument("--work_scratch", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Model and data


def build_inputs(out: pathlib.Path, args) -> dict[str, pathlib.Path]:
    """out: the scratch folder."""
    """The model (and job B's copy without reachable end tokens), the prompts and the reward file."""
    sys.path.insert(0, str(ROOT))
    from services.common.tiny import make_data, make_tiny_model

    model = out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, size=args.size, seed=0)
        # bf16 on disk: every framework's "auto" dtype (vLLM's included) then means bf16.
        import torch
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(model)
    paths = {"A": model}
    if "B" in args.jobs:
        paths["B"] = out / "model_no_eos"
        if not (paths["B"] / "config.json").exists():
            write_no_eos_model(model, paths["B"])
    data = make_data(out / "data")
    rows = (data / "arith_train.jsonl").read_text().splitlines()[: args.prompts_per_step * args.steps]
    (out / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    (out / "reward_func.py").write_text(REWARD_FILE)
    paths["prompts"], paths["reward"] = out / "prompts.jsonl", out / "reward_func.py"
    if "verl" in args.frameworks:  # its parquet is written with the peers' pandas, which the driver may lack
        subprocess.run([sys.executable, str(pathlib.Path(verl_peer.__file__).resolve()), str(out)], cwd=ROOT,
                       env=child_env("verl", out), check=True)
        paths.update(verl_peer.input_paths(out))
    return paths


def write_no_eos_model(src: pathlib.Path, dst: pathlib.Path, dim: int = 0) -> None:
    """Copies src with a constant added to residual dimension `dim` of every token embedding and
    the special tokens' output rows reading only that dimension, negatively: after the final norm
    their logits sit ~250 below every other token's, so none of them is ever sampled."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # (V, H), untied
    # The random layers grow the residual to an rms of ~2 per dimension; 10 keeps this one positive
    # at every position (~5 after the final norm), and -50 puts the end tokens' logits near -250.
    emb[:, dim] += 10.0
    for i in SPECIAL_IDS:
        head[i] = 0.0
        head[i, dim] = -50.0
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    check_no_eos(dst)


def check_no_eos(model_dir: pathlib.Path) -> None:
    """Raises unless the special tokens' probability stays below 1e-9 on random sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (2, 256), generator=g)
    with torch.no_grad():
        probs = model(ids).logits.float().softmax(-1)  # (2, 256, V)
    worst = probs[..., list(SPECIAL_IDS)].max().item()
    if worst > 1e-9:
        raise RuntimeError(f"end tokens still reachable in {model_dir}: max probability {worst:.3g}")
    print(f"no-EOS model: max end-token probability {worst:.3g} on random sequences", flush=True)


# ----------------------------------------------------------------------------------------------
# Commands


def rlmesh_command(job: Job, model, paths, work: pathlib.Path, scratch: pathlib.Path, args) -> list[str]:
    return [sys.executable, "-m", "services.coordinator.cli.train",
            "--pretrain", str(model), "--prompt_data", str(paths["prompts"]), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--remote_rm_url", str(paths["reward"]),
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(SAMPLES_PER_PROMPT),
            "--rollout_batch_size", str(args.prompts_per_step), "--micro_rollout_batch_size", str(args.micro_batch),
            "--train_batch_size", str(args.prompts_per_step * SAMPLES_PER_PROMPT),
            "--micro_train_batch_size", str(args.micro_batch), "--max_epochs", "1", "--max_steps", str(args.steps),
            "--prompt_max_len", str(PROMPT_MAX_LEN), "--generate_max_len", str(job.max_tokens),
            "--temperature", "1.0", "--init_kl_coef", "0", "--actor_learning_rate", str(LEARNING_RATE),
            "--lr_warmup_ratio", "0", "--lr_scheduler", "constant_with_warmup", "--zero_stage", "2", "--bf16",
            "--gradient_checkpointing", "--packing_samples", "--use_dynamic_batch", "--train_max_tokens_per_gpu", str(job.micro_batch_tokens),
            "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep", "--vllm_sync_backend", "ipc",
            # --rlmesh_engines engines share the GPU and, together, the others' share of its memory
            "--vllm_num_engines", str(args.rlmesh_engines),
            "--vllm_gpu_memory_utilization", f"{args.gpu_memory_utilization / args.rlmesh_engines:.4g}",
            "--vllm_max_num_seqs", "512", "--vllm_max_num_batched_tokens", "4096",  # TRL's fixed values
            "--run_dir", str(work / "run"), "--ckpt_path", str(scratch / "ckpt"), "--save_path", str(scratch / "final"),
            "--disable_ds_ckpt", "--metrics_port", "-1", "--no-progress_bar", "--seed", "42",
            *(["--use_liger_kernel"] if args.liger else []), *shlex.split(args.rlmesh_args)]


def trl_command(job: Job, model, paths, work: pathlib.Path, scratch: pathlib.Path, args) -> list[str]:
    return [sys.executable, str(pathlib.Path(__file__).resolve()), "--role", "trl", "--job", job.name,
            "--model", str(model), "--work", str(work), "--steps", str(args.steps), "--max_tokens", *map(str, args.max_tokens),
            "--prompts_per_step", str(args.prompts_per_step), "--micro_batch", str(args.micro_batch),
            "--gpu_memory_utilization", str(args.gpu_memory_utilization), "--scratch", str(paths["prompts"].parent), "--work_scratch", str(scratch),
            *(["--liger"] if args.liger else [])]


def openrlhf_command(job: Job, model, paths, work: pathlib.Path, scratch: pathlib.Path, args) -> list[str]:
    return [sys.executable, "-m", "openrlhf.cli.train_ppo_ray",
            "--actor.model_name_or_path", str(model), "--reward.remote_url", str(paths["reward"]),
            "--data.prompt_dataset", str(paths["prompts"]), "--data.input_key", "prompt", "--data.label_key", "label",
            "--data.apply_chat_template", "--data.max_samples", str(args.prompts_per_step * args.steps),
            "--data.max_len", str(PROMPT_MAX_LEN + job.max_tokens), "--rollout.max_new_tokens", str(job.max_tokens),
            "--rollout.batch_size", str(args.prompts_per_step), "--rollout.n_samples_per_prompt", str(SAMPLES_PER_PROMPT),
            "--rollout.micro_batch_size", str(args.micro_batch), "--rollout.temperature", "1.0",
            "--train.batch_size", str(args.prompts_per_step * SAMPLES_PER_PROMPT), "--train.micro_batch_size",
            str(args.micro_batch), "--train.max_epochs", "1", "--train.num_episodes", "1", "--train.seed", "42",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
            "--actor.adam.lr", str(LEARNING_RATE), "--actor.lr_warmup_ratio", "0",
            "--actor.gradient_checkpointing_enable", "--ds.zero_stage", "2", "--ds.param_dtype", "bf16",
            "--ds.attn_implementation", "sdpa",
            "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_nodes", "1",
            "--ref.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1",
            "--vllm.gpu_memory_utilization", str(args.gpu_memory_utilization),
            "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep",
            "--ckpt.path", str(scratch / "ckpt"), "--ckpt.output_dir", str(scratch / "final"), "--ckpt.save_steps", "-1",
            *(["--ds.use_liger_kernel"] if args.liger else [])]


COMMANDS = {"rlmesh": rlmesh_command, "trl": trl_command, "openrlhf": openrlhf_command, "verl": verl_peer.verl_command}


# ----------------------------------------------------------------------------------------------
# A run (peer_run.watch) and its summary


def run_one(framework: str, job: Job, paths, out: pathlib.Path, args, time_left: float) -> dict:
    work, scratch = out / f"{job.name}-{framework}", pathlib.Path(args.scratch).resolve() / f"{job.name}-{framework}"
    for folder in (work, scratch):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    log = out / f"{job.name}-{framework}.log"
    model = paths[job.name]
    cmd = COMMANDS[framework](job, model, paths, work, scratch, args)
    (work / "command.txt").write_text(" ".join(cmd) + "\n")
    result = {"framework": framework, "job": job.name, "command": cmd}
    if args.dry_run:
        print(f"[{job.name} {framework}] " + " ".join(cmd), flush=True)
        return result
    timeout = min(args.timeout_s[0] if job.name == "A" else args.timeout_s[1], time_left)
    watched, samples = watch(framework, cmd, child_env(framework, out), work, log, timeout, args.steps,
                             f"{job.name} {framework}")
    result.update(watched)
    result.update(summarize(framework, result["steps"], args.prompts_per_step * SAMPLES_PER_PROMPT))
    if framework == "rlmesh" and samples:
        result["rlmesh_timeline"] = rlmesh_timeline(result["steps"], samples)
    return result


def rlmesh_phases(row: dict) -> list[tuple[str, float]]:
    """The phases of one rlmesh step in the order they run, seconds each. time/rollout_sleep_s is
    the end of "generate" and time/learner_reload_s the start of "score" (when the metrics have them)."""
    t = lambda key: row.get(f"time/{key}_s", 0.0)  # noqa: E731
    return [("generate", t("generate") - t("rollout_sleep")), ("rollout_sleep", t("rollout_sleep")),
            ("learner_reload", t("learner_reload")), ("score", t("score") - t("learner_reload")),
            ("logprobs", t("logprobs")), ("advantages", t("advantages")), ("train", t("train")), ("push", t("push")),
            ("learner_offload", t("learner_offload"))]


def rlmesh_timeline(steps: list[dict], samples: list[tuple[float, float, float]]) -> dict:
    """Seconds and GPU busy fraction per phase of rlmesh's steps 2..N. A step starts when the one
    before it ended (its metrics line); its phases run one after another (rlmesh_phases), and
    "between" is the rest until its own metrics line (without time/learner_offload_s in the
    metrics, the learner's offload is in it)."""
    seconds: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    phase_windows: list[tuple[str, float, float]] = []
    for before, row in zip(steps, steps[1:]):
        t = before["t_end"]
        windows = []
        for phase, d in rlmesh_phases(row):
            windows.append((phase, t, t + d))
            t += d
        windows.append(("between", t, row["t_end"]))
        phase_windows.extend((phase, round(t0, 2), round(t1, 2)) for phase, t0, t1 in windows)
        for phase, t0, t1 in windows:
            seconds.setdefault(phase, []).append(max(t1 - t0, 0.0))
            util = [u for ts, u, _ in samples if t0 <= ts < t1]
            if util:
                busy.setdefault(phase, []).append(statistics.fmean(util) / 100)
    return {"seconds_per_step": seconds, "gpu_busy_median": {p: statistics.median(v) for p, v in busy.items()},
            "windows": phase_windows}


def summarize(framework: str, steps: list[dict], samples: int) -> dict:
    """Seconds per step (wall time between step ends, steps 2..N), tokens and phases per step."""
    if len(steps) < 2:
        return {}
    step_s = [b["t_end"] - a["t_end"] for a, b in zip(steps, steps[1:])]
    if framework == "rlmesh":
        lengths = [r["response_length/mean"] for r in steps[1:]]
        phases = {p: [r.get(f"time/{p}_s", 0.0) for r in steps[1:]] for p in ("generate", "score", "logprobs", "train", "push", "overhead")}
        phases["own_step"] = [r["time/step_s"] for r in steps[1:]]
        gen_s, train_s = phases["generate"], phases["train"]
    elif framework == "trl":
        lengths = [r.get("completions/mean_length", 0.0) for r in steps[1:]]
        phases = {p: [r.get(f"phase/{p}_s", 0.0) for r in steps[1:]] for p in ("sync_weights", "generate", "rollout_total")}
        phases["train"] = [s - r for s, r in zip(step_s, phases["rollout_total"])]
        gen_s, train_s = phases["generate"], phases["train"]
    elif framework == "verl":  # its own timers (verl/trainer/ppo/v1/trainer_base.py, trainer_sync.py)
        lengths = [r.get("response_length/mean", 0.0) for r in steps[1:]]
        phases = {p: [r.get(f"timing_s/{p}", 0.0) for r in steps[1:]]
                  for p in ("gen", "old_log_prob", "adv", "update_actor", "update_weights", "step")}
        gen_s, train_s = phases["gen"], phases["update_actor"]
    else:
        lengths = [r.get("rollout/response_length_mean", 0.0) for r in steps[1:]]
        phases = {p: [r.get(f"timing/{p}", 0.0) for r in steps[1:]] for p in ("generation", "make_experience", "ppo_train", "broadcast", "step_total")}
        gen_s, train_s = phases["generation"], phases["ppo_train"]
    tokens = [length * samples for length in lengths]
    rate = lambda toks, secs: statistics.median(t / s for t, s in zip(toks, secs) if s > 0) if any(s > 0 for s in secs) else None  # noqa: E731
    # Every measured step's time stays in the results (step_s, phases_s): spread.py compares leases.
    return {"step_s": step_s, "step_stats": spread(step_s), "step_median_s": statistics.median(step_s),
            "step_mean_s": statistics.fmean(step_s), "step_min_s": min(step_s), "step_max_s": max(step_s),
            "response_tokens_per_step": tokens, "mean_response_len": statistics.fmean(lengths),
            "generated_tokens_per_s": rate(tokens, gen_s), "trained_tokens_per_s": rate(tokens, train_s),
            "step_tokens_per_s": rate(tokens, step_s),
            "phases_s": {p: v for p, v in phases.items() if v},
            "phases_stats": {p: spread(v) for p, v in phases.items() if v},
            "phases_median_s": {p: statistics.median(v) for p, v in phases.items() if v}}


# ----------------------------------------------------------------------------------------------
# The TRL side (a child process)


def trl_config(job: Job, scratch: pathlib.Path, args):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(scratch / "out"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts_per_step * SAMPLES_PER_PROMPT // args.micro_batch,
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=job.max_tokens, max_steps=args.steps,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", beta=0.0, num_iterations=1,
        temperature=1.0, bf16=True, gradient_checkpointing=True, model_init_kwargs={"dtype": "bfloat16"},
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization, vllm_max_model_length=PROMPT_MAX_LEN + job.max_tokens,
        logging_steps=1, report_to="none", save_strategy="no", seed=42, shuffle_dataset=False,
        use_liger_kernel=args.liger)


def run_trl(args) -> None:
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    job, work = jobs_of(args)[args.job], pathlib.Path(args.work)
    rows = load_dataset("json", data_files=str(pathlib.Path(args.scratch) / "prompts.jsonl"), split="train")
    rows = rows.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})
    phases: dict[str, float] = {}
    timed = functools.partial(timed_into, phases)

    def rule_reward(completions, label, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if str(lab) in text else 0.0 for text, lab in zip(texts, label)]

    class StepLog(TrainerCallback):
        """One line per optimizer step: the phases timed since the last one and the step's logs."""

        def on_log(self, _args, state, control, logs=None, **kw):
            if "loss" not in (logs or {}):  # the end-of-training summary has train_loss instead
                return
            row = {"step": state.global_step, **{f"phase/{k}_s": v for k, v in phases.items()}}
            row.update({k: v for k, v in logs.items() if isinstance(v, (int, float))})
            with (work / "steps.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            phases.clear()

    config = trl_config(job, pathlib.Path(args.work_scratch), args)
    trainer = GRPOTrainer(model=args.model, reward_funcs=rule_reward, args=config, train_dataset=rows,
                          callbacks=[StepLog()])
    trainer._generate_and_score_completions = timed("rollout_total", trainer._generate_and_score_completions)
    trainer.vllm_generation.generate = timed("generate", trainer.vllm_generation.generate)
    trainer.vllm_generation.sync_weights = timed("sync_weights", trainer.vllm_generation.sync_weights)
    trainer.train()


# ----------------------------------------------------------------------------------------------
# Report


def table(results: list[dict], job: str) -> str:
    rows = [r for r in results if r["job"] == job]
    base = next((r for r in rows if r["framework"] == "rlmesh" and r.get("step_median_s")), None)
    head = (f"{'job ' + job:<10}{'s/step':>8}{'mean':>7}{'min-max':>14}{'x rlmesh':>10}{'gen tok/s':>11}{'train tok/s':>12}"
            f"{'GPU busy':>10}{'peak GiB':>10}{'resp len':>10}  phases (median s, min-max)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("step_median_s"):
            lines.append(f"{r['framework']:<10}  did not run: {r.get('error', 'no steps')[:300]}")
            continue
        ratio = f"{r['step_median_s'] / base['step_median_s']:.2f}" if base else "-"
        fmt = lambda v, spec: format(v, spec) if v is not None else format("-", ">" + spec[1:].split(",")[0].split(".")[0])  # noqa: E731
        ranges = r.get("phases_stats") or {}
        phases = " ".join(f"{k}={v:.1f}" + (f"({ranges[k]['min']:.1f}-{ranges[k]['max']:.1f})" if k in ranges else "")
                          for k, v in r["phases_median_s"].items())
        mean = r.get("step_mean_s", r["step_median_s"])
        lines.append(f"{r['framework']:<10}{r['step_median_s']:>8.2f}{mean:>7.2f}{r['step_min_s']:>7.2f}-{r['step_max_s']:<6.2f}"
                     f"{ratio:>10}{fmt(r['generated_tokens_per_s'], '>11,.0f')}{fmt(r['trained_tokens_per_s'], '>12,.0f')}"
                     f"{fmt(r.get('gpu_busy'), '>10.0%')}{r['peak_memory_gib']:>10.1f}{r['mean_response_len']:>10.0f}  {phases}"
                     + (f"  [{r['error'][:120]}]" if r.get("error") else ""))
    for r in rows:
        if r.get("host_cpu"):
            h = r["host_cpu"]
            lines.append(f"{r['framework']}: the machine's {h['cores']} cores over steps 2..N: {h['busy']:.0%} busy, "
                         f"{h['steal']:.1%} stolen by the hypervisor")
    for r in rows:
        if r.get("rlmesh_timeline"):
            tl = r["rlmesh_timeline"]
            parts = [f"{p} {statistics.median(v):.2f} s ({tl['gpu_busy_median'].get(p, 0):.0%} busy)"
                     for p, v in tl["seconds_per_step"].items() if max(v) > 0]
            lines.append("rlmesh step, median per phase: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "trl":
        run_trl(args)
        return 0
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit_id(),
            "versions": versions(), "steps": args.steps,
            "gpu_memory_utilization": args.gpu_memory_utilization, "rlmesh_engines": args.rlmesh_engines,
            "rlmesh_args": args.rlmesh_args, "liger": args.liger}
    print(json.dumps(info, indent=1), flush=True)
    scratch = pathlib.Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    paths = build_inputs(scratch, args)
    results: list[dict] = []
    order = list(args.frameworks)
    t_begin = time.monotonic()
    for job_name in args.jobs:
        for framework in order:
            print(f"=== job {job_name}: {framework} ===", flush=True)
            time_left = args.budget_s - (time.monotonic() - t_begin) if args.budget_s else float("inf")
            if time_left < 60:
                results.append({"framework": framework, "job": job_name, "error": "not run: --budget_s spent"})
                continue
            try:
                results.append(run_one(framework, jobs_of(args)[job_name], paths, out, args, time_left - 10))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot start is a result, not the end
                results.append({"framework": framework, "job": job_name, "error": f"{type(exc).__name__}: {exc}"})
            (out / "results.json").write_text(json.dumps({**info, "results": results}, indent=1))
        if not args.dry_run:
            print(table(results, job_name), flush=True)
        order.reverse()
    if not args.dry_run:
        report = "\n\n".join(table(results, j) for j in args.jobs)
        (out / "table.txt").write_text(report + "\n")
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
