"""Kill trials: run the real coordinator (local placement) on the tiny model, `kill -9` one service
at a chosen moment, and compare the run with one that had no fault.

A moment is (phase, step): the kill lands once the control API reports that phase during that
global step (GENERATING, SCORING, TRAINING, PUSHING_WEIGHTS, CHECKPOINTING), after an optional
delay. Killing the coordinator itself is followed by the same command with --load_checkpoint.
tests/chaos/ runs a few seeded trials; bench/chaos.py runs many.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc

from rlmesh.coordinator.v1 import coordinator_pb2 as pb
from rlmesh.coordinator.v1 import coordinator_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]
PHASES = {"generate": pb.PHASE_GENERATING, "score": pb.PHASE_SCORING, "train": pb.PHASE_TRAINING,
          "push": pb.PHASE_PUSHING_WEIGHTS, "checkpoint": pb.PHASE_CHECKPOINTING}
# What a run without faults and a run with one must agree on, step by step: the same samples were
# generated, scored and trained on (float values are compared within `rtol`).
COMPARED = ("samples/generated", "samples/trained", "reward/mean", "response_length/mean", "actor/policy_loss",
            "actor/grad_norm", "weights/bytes")


@dataclasses.dataclass
class Kill:
    service: str  # "rollout-0", "reward-0", "learner", "learner-rank1" (a rank > 0), "coordinator"
    phase: str  # a key of PHASES
    step: int  # global step (1-based) during which the kill lands
    delay_s: float = 0.0  # after the phase is seen


@dataclasses.dataclass
class Trial:
    kills: list[Kill]
    returncode: int
    records: list[dict]
    events: list[dict]
    killed_at_s: list[float] = dataclasses.field(default_factory=list)  # seconds after the start, per kill
    seconds: float = 0.0
    log: str = ""
    crashed_at: list[str] = dataclasses.field(default_factory=list)  # the crash_at entries that fired

    @property
    def steps(self) -> list[int]:
        return [r["global_step"] for r in self.records]

    def count(self, event: str) -> int:
        return sum(e["event"] == event for e in self.events)

    @property
    def redone_steps(self) -> int:
        return sum(int(e.get("redone_steps", 0)) for e in self.events if e["event"] == "learner.rewound")


class Holds:
    """RLMESH_HOLD_AT entries (services/common/hold_points.py) for one run: env() for its processes,
    wait() until a process holds at an entry, release() to let it go on. A moment held is there
    however slow or loaded the machine is, where a status poll can miss a step that lasts 0.1 s."""

    def __init__(self, folder: pathlib.Path, *entries: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.entries = folder, entries

    def env(self) -> dict[str, str]:
        return {"RLMESH_HOLD_AT": ",".join(self.entries), "RLMESH_HOLD_DIR": str(self.folder)}

    def wait(self, entry: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> int:
        """The pid of the process held at `entry`, once it is; fails when `proc` (the coordinator) exits first."""
        assert entry in self.entries, entry
        path = self.folder / ("held-" + entry.replace("/", "_"))
        deadline = time.monotonic() + timeout_s
        while not (path.is_file() and path.read_text().endswith("\n")):
            assert proc.poll() is None, f"the coordinator exited before anything held at {entry}"
            assert time.monotonic() < deadline, f"nothing held at {entry} within {timeout_s} s"
            time.sleep(0.02)
        return int(path.read_text().split()[0])

    def release(self, entry: str) -> None:
        (self.folder / ("release-" + entry.replace("/", "_"))).write_text("")


def service_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "protos"), env.get("PYTHONPATH", "")) if p)
    return env


def grpo_argv(model: pathlib.Path, data: pathlib.Path, out: pathlib.Path, engines: int = 2, steps: int = 3,
              engine: str = "hf", *extra: str) -> list[str]:
    """A small GRPO run: rule reward with the reference model (merged reward-ref process), a
    checkpoint every step, the final model exported to out/model, no end-of-run plots (each run
    would import matplotlib and draw them: a second or more of CPU). Restarts back off from 0.1 s,
    doubled per restart of an instance as with any --restart_backoff_s: the walks restart one
    instance up to four times, which from 0.5 s waited 7.5 s with nothing to wait for."""
    return ["--pretrain", str(model), "--prompt_data", str(data / "arith_train.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--reward_func", "math,format",
            "--reward_extra_args", "--format_pattern .*th.*", "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", "k3",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
            "--micro_rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--actor_learning_rate", "1e-3", "--lr_scheduler", "constant_with_warmup", "--lr_warmup_ratio", "0",
            "--generate_max_len", "16", "--prompt_max_len", "64", "--max_steps", str(steps), "--seed", "0",
            "--vllm_num_engines", str(engines), "--rollout_engine", engine, "--save_steps", "1",
            "--ckpt_path", str(out / "ckpt"), "--run_dir", str(out / "run"), "--save_path", str(out / "model"),
            "--port", "0", "--ready_file", str(out / "control.json"), "--restart_backoff_s", "0.1",
            "--rpc_timeout_s", "600", "--no-plots", *extra]


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pid_of(run_dir: pathlib.Path, service: str) -> int:
    """The process of a service; "learner-rank1" is rank 1 of a learner with several ranks (a child
    of rank 0, which started it with RANK=1)."""
    name, _, rank = service.partition("-rank")
    pid = json.loads((run_dir / "logs" / f"{name}.ready.json").read_text())["pid"]
    if not rank:
        return pid
    import psutil

    for child in psutil.Process(pid).children():
        if child.environ().get("RANK") == rank:
            return child.pid
    raise RuntimeError(f"{service}: no child of the learner ({pid}) runs with RANK={rank}")


def _wait_for_services_to_exit(out: pathlib.Path, timeout_s: float = 60.0) -> None:
    """After the coordinator died: until no service of the run is left (each one's command line
    names its ready file under out/run/logs, a learner's other ranks too), so that the resumed run
    starts on a machine where the old services have stopped, without a fixed pause that is too
    long on an idle machine and may be too short on a loaded one. Past timeout_s it goes on anyway."""
    import psutil

    logs = str(out / "run" / "logs")
    deadline = time.monotonic() + timeout_s

    def left(process: psutil.Process) -> bool:
        try:
            return (any(logs in arg for arg in process.info["cmdline"] or ())
                    and process.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    while time.monotonic() < deadline and any(left(p) for p in psutil.process_iter(["cmdline"])):
        time.sleep(0.05)


def _wait_moment(stub, kill: Kill, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        except grpc.RpcError:
            time.sleep(0.1)
            continue
        # During step k the control API reports global_step k-1 (the last completed one).
        if status.global_step + 1 >= kill.step and status.phase == PHASES[kill.phase]:
            return True
        if status.global_step >= kill.step:
            return True  # the phase passed between two polls: kill now, later in the same run
        time.sleep(0.03)
    return False


def run_trial(argv: list[str], out: pathlib.Path, kills: list[Kill] = (), timeout_s: float = 900.0,
              module: str = "services.coordinator", crash_at: list[str] = ()) -> Trial:
    """Runs the coordinator with argv (built for `out`), kills as planned (in order), waits for the end.

    crash_at: entries of RLMESH_CRASH_AT (services/common/crash_points.py), each fired once over the
    whole run; a coordinator that kills itself at one is followed by the same command with
    --load_checkpoint, as after a Kill("coordinator")."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "coordinator.log"
    t0 = time.monotonic()
    env = service_env()
    if crash_at:
        (out / "crashes").mkdir(exist_ok=True)
        env.update(RLMESH_CRASH_AT=",".join(crash_at), RLMESH_CRASH_ONCE_DIR=str(out / "crashes"))

    def start(extra: list[str]) -> subprocess.Popen:
        (out / "control.json").unlink(missing_ok=True)
        return subprocess.Popen([sys.executable, "-m", module, *argv, *extra], cwd=REPO, env=env,
                                stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)

    proc = start([])
    killed_at: list[float] = []
    try:
        for kill in kills:
            while not (out / "control.json").is_file():
                if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                    break
                time.sleep(0.1)
            if not (out / "control.json").is_file():
                break
            address = json.loads((out / "control.json").read_text())["address"]
            with grpc.insecure_channel(address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                if not _wait_moment(stub, kill, proc, timeout_s - (time.monotonic() - t0)):
                    break
            time.sleep(kill.delay_s)
            pid = proc.pid if kill.service == "coordinator" else _pid_of(out / "run", kill.service)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic() - t0)
            if kill.service == "coordinator":
                proc.wait(60)
                # Its services die with it (PR_SET_PDEATHSIG); the same command resumes.
                _wait_for_services_to_exit(out)
                proc = start(["--load_checkpoint"])
        proc.wait(max(timeout_s - (time.monotonic() - t0), 1.0))
        for _ in crash_at:  # at most one rerun per planned crash
            if proc.returncode != -signal.SIGKILL:
                break
            killed_at.append(time.monotonic() - t0)
            _wait_for_services_to_exit(out)  # its services die with it (PR_SET_PDEATHSIG)
            proc = start(["--load_checkpoint"])
            proc.wait(max(timeout_s - (time.monotonic() - t0), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    run_dir = out / "run"
    fired = sorted(p.name.removeprefix("fired-") for p in (out / "crashes").glob("fired-*")) if crash_at else []
    return Trial(list(kills), proc.returncode, _read_jsonl(run_dir / "metrics.jsonl"), _read_jsonl(run_dir / "events.jsonl"),
                 killed_at, time.monotonic() - t0, log_path.read_text(errors="replace"), fired)


def differences(baseline: Trial, trial: Trial, rtol: float = 1e-6) -> list[str]:
    """Where trial's per-step metrics differ from the fault-free run's (empty = the same run)."""
    diffs = []
    if baseline.steps != trial.steps:
        return [f"steps {trial.steps} != {baseline.steps}"]
    for a, b in zip(baseline.records, trial.records):
        for key in COMPARED:
            if key not in a and key not in b:
                continue
            x, y = a.get(key), b.get(key)
            if x is None or y is None or abs(x - y) > rtol * max(abs(x), abs(y), 1e-12):
                diffs.append(f"step {a['global_step']} {key}: {y} != {x}")
    return diffs


def unmarked_checkpoints(ckpt: pathlib.Path) -> dict[str, list[str]]:
    """global_step_N folders without the learner's marker (learner.json), with their contents: after a
    run that killed saves, each was redone or removed, so none should be left."""
    return {f.name: sorted(p.name for p in f.iterdir()) for f in ckpt.glob("global_step_*")
            if not (f / "learner.json").is_file()}


def model_difference(a: pathlib.Path, b: pathlib.Path) -> float:
    """Largest absolute difference between two exported models' parameters."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
