"""deploy/docker-compose.yml's commands, started as local processes (CI cannot afford the images),
so the compose file cannot drift from the code: each rlmesh service's `command` runs through the
image's entry point (`python -m services.cli`) with the container's folders and names mapped onto
this machine (volumes -> temporary folders, service names -> loopback ports). The run trains the
configured steps, saves the model and exits 0; the learner's settings came from the one YAML file
(its learning rate and batch size are checked on the learner itself); a Prometheus-like poller that
scrapes the coordinator only every few seconds still gets the last step, because the coordinator
waits for a scrape before it exits.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml

from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.client import make_sync_channel, wait_for_serving
from tests.conftest import get_free_port
from tests.coordinator.conftest import finish, read_metrics, service_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = ("rollout", "reward", "learner")
POLL_S = 4.0  # the poller's scrape interval: longer than the coordinator's tail after its last step


def expand(arg, env: dict[str, str]) -> str:
    """compose's ${NAME:-default}: the value from env, else the default."""
    return re.sub(r"\$\{([A-Z_]+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), str(arg))


def mounts(spec: dict, folders: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Container path -> local folder for the service's volumes; `folders` names the local folder
    for each container path (a bind mount's host side is the user's, not this test's)."""
    found = {}
    for volume in spec["volumes"]:
        target = expand(volume, {}).split(":")[1]
        assert target in folders, f"compose mounts {target}, which this test does not map"
        found[target] = folders[target]
    return found


def localize(command: list[str], paths: dict[str, pathlib.Path], ports: dict[str, int],
             metrics_port: int) -> list[str]:
    """The compose command with container paths, ports and service names of this machine."""
    out, previous = [], ""
    for arg in command:
        if previous == "--host":
            arg = "127.0.0.1"  # the containers bind every interface; a test binds loopback
        elif previous == "--port":
            arg = "0"  # the coordinator's control API: any free port
        elif previous == "--metrics_port":
            arg = str(metrics_port)
        else:
            for name, port in ports.items():
                arg = arg.replace(f"{name}:50051", f"127.0.0.1:{port}")
            for target, local in paths.items():
                if arg == target or arg.startswith(target + "/"):
                    arg = str(local) + arg[len(target):]
        out.append(arg)
        previous = arg if arg.startswith("--") else ""
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def metric(text: str, name: str, labels: str = "") -> float | None:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


class Poller(threading.Thread):
    """Scrapes a metrics port every POLL_S seconds, as Prometheus would; keeps the last answer."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.last, self.stop = port, "", threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.last = scrape(self.port)
            except OSError:
                # Not up yet (or gone): try again soon, as Prometheus' next scrape would find it; a
                # run of a few seconds on an idle machine must still be scraped while it runs.
                self.stop.wait(0.1)
                continue
            self.stop.wait(POLL_S)


def test_compose_commands_train_as_local_processes(tiny_model_dir, tiny_data_dir, tmp_path):
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    env: dict[str, str] = {}
    # The run's YAML as the containers see it, with the mount points of this machine.
    runs = tmp_path / "runs"
    folders = {"/model": tiny_model_dir, "/data": tiny_data_dir, "/config": tmp_path / "config", "/runs": runs}
    command = [expand(a, env) for a in compose["services"]["coordinator"]["command"]]
    config_in_container = command[command.index("--config") + 1]
    run_config = yaml.safe_load((DEPLOY / "config" / pathlib.Path(config_in_container).relative_to("/config")).read_text())
    for key, value in run_config.items():
        if isinstance(value, str) and value.startswith("/"):
            target = "/" + value.split("/")[1]
            assert target in folders, f"{key}: {value} is outside the compose volumes"
            run_config[key] = str(folders[target]) + value[len(target):]
    steps = min(2, run_config["max_steps"])  # lean: two steps push weights once and generate with them
    run_config["max_steps"] = steps
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / pathlib.Path(config_in_container).name).write_text(yaml.safe_dump(run_config))

    ports = {name: get_free_port() for name in SERVICES}
    metrics = {name: get_free_port() for name in (*SERVICES, "coordinator")}
    child_env = {k: v for k, v in service_env().items() if k != "LOCAL_RANK"}  # the learner must set it itself
    child_env["PYTHONPATH"] = f"{ROOT}:{ROOT / 'protos'}"
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        for name in SERVICES:
            spec = compose["services"][name]
            paths = mounts(spec, folders)
            argv = localize([expand(a, env) for a in spec["command"]], paths, {}, metrics[name])
            argv[argv.index("--port") + 1] = str(ports[name])  # the name:port the coordinator is given
            with open(logs / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=child_env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        async def ready():
            await asyncio.gather(*(wait_for_serving(f"127.0.0.1:{ports[n]}", 600) for n in SERVICES))

        try:
            asyncio.run(ready())
        except Exception:
            pytest.fail("a service did not start:\n" + "\n".join(
                f"--- {n}\n{(logs / f'{n}.log').read_text(errors='replace')[-3000:]}" for n in SERVICES))

        # The learner's training settings are the YAML's, though its command names none of them.
        channel = make_sync_channel(f"127.0.0.1:{ports['learner']}")
        try:
            info = learner_pb2_grpc.LearnerServiceStub(channel).GetInfo(learner_pb2.GetInfoRequest(), timeout=30)
        finally:
            channel.close()
        assert info.train_batch_size == run_config["train_batch_size"]
        assert info.micro_train_batch_size == run_config["micro_train_batch_size"]
        assert info.zero_stage == run_config["zero_stage"]

        spec = compose["services"]["coordinator"]
        argv = localize(command, mounts(spec, folders), ports, metrics["coordinator"])
        log_path = logs / "coordinator.log"
        poller = Poller(metrics["coordinator"])
        poller.start()
        with open(log_path, "wb") as log:
            coordinator = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=child_env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        text = finish(coordinator, log_path, timeout_s=900)
        poller.stop.set()
        assert coordinator.returncode == 0, text[-6000:]

        rows = read_metrics(pathlib.Path(run_config["run_dir"]))
        assert [r["global_step"] for r in rows] == list(range(1, steps + 1))
        saved = pathlib.Path(run_config["save_path"])
        assert (saved / "config.json").is_file() and list(saved.glob("*.safetensors")), "no model saved"
        assert (pathlib.Path(run_config["ckpt_path"]) / "latest").is_file()
        # The learning rate the learner trained with is the YAML's (constant schedule, no warm-up).
        learner_text = scrape(metrics["learner"])
        assert metric(learner_text, "rlmesh_learner_learning_rate", '{model="actor"}') == pytest.approx(
            float(run_config["actor_learning_rate"]))
        for name in ("rollout", "reward"):
            assert "rlmesh_" + name in scrape(metrics[name])
        # The last step reached the scraper although it scrapes only every POLL_S seconds.
        assert re.search(r"metrics\.final_scrape waited_s=", text), "the coordinator did not wait for a last scrape"
        assert metric(poller.last, "rlmesh_coordinator_global_step") == steps
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # the whole group: vLLM's engine core, the learner's ranks
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
