"""A Ray cluster of several nodes on this machine, for trying the multi-node guide on a laptop and
for the tests: a head and N worker nodes, each its own raylet started with `ray start`, each on its
own loopback address (127.0.0.2, 127.0.0.3, ...: all of 127.0.0.0/8 is this machine), each with
the GPUs it declares (`--num-gpus N`: logical GPUs, the services then run on the CPU with
`--device cpu`). Placement groups, node loss and rescheduling behave there as on machines.

    cluster = LocalCluster(pathlib.Path("/tmp/rlmesh-cluster"))
    cluster.up(workers=4, gpus_per_node=2)        # head 127.0.0.2 (no GPUs), workers .3 to .6
    cluster.kill("127.0.0.4")                      # the node and everything on it, SIGKILL (a lost machine)
    cluster.join(gpus=2)                           # a new node, 127.0.0.7
    cluster.down()

The state (which node has which address, ports and folder) is a JSON file in the cluster's folder,
so `rlmesh cluster kill|join|down` work from another shell. Every port is chosen here and given to
Ray (several raylets on one machine would otherwise collide on Ray's fixed defaults); a node's
processes are found by its address on their command lines, never by name, so other Ray instances
on the machine are left alone. Each node is lean: one CPU and a small object store by default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

STATE_FILE = "cluster.json"
FIRST_HOST = 2  # 127.0.0.2: 127.0.0.1 stays what "localhost" means, so an address fixed to it shows up
START_ATTEMPTS = 3  # `ray start` of one node, on a machine too busy for its agents' start-up wait
WORKER_PORTS = 40  # Ray worker processes per node (actors and tasks): a tiny run needs far fewer


@dataclasses.dataclass
class NodeInfo:
    ip: str
    gpus: int
    cpus: int
    temp_dir: str
    head: bool = False


@dataclasses.dataclass
class ClusterState:
    port: int  # the head's GCS port: workers join HEAD_IP:port
    dashboard_port: int
    nodes: list[NodeInfo] = dataclasses.field(default_factory=list)
    used: list[str] = dataclasses.field(default_factory=list)  # every address a node ever had: never reused

    @property
    def head_ip(self) -> str:
        return next(n.ip for n in self.nodes if n.head)


class ClusterError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def free_port(host: str = "") -> int:
    """A port free on every address (Ray binds some of a node's ports on all of them) a moment ago,
    and not handed out before by this process: a node's `ray start` takes eight at once, and the OS
    may offer one port twice in a row, which `ray start` refuses ("trying to use a port number ...
    that is used by other components")."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _ray_command() -> list[str]:
    """`ray` of this interpreter's environment (the same Ray as the driver's)."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def node_processes(ip: str) -> list[int]:
    """Every process of the node at `ip`: those whose command line names the address (raylet, agents,
    Ray workers, services started with --host ip) and all their descendants (engine cores, ranks)."""
    parents: dict[int, int] = {}
    roots: set[int] = set()
    tokens = (f"={ip}", ip)
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parents[int(proc.name)] = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        words = [a.decode(errors="replace") for a in argv]
        if any(w == ip or w.endswith(tokens[0]) for w in words):
            roots.add(int(proc.name))
    roots.discard(os.getpid())
    found, changed = set(roots), True
    while changed:
        children = {pid for pid, ppid in parents.items() if ppid in found and pid not in found}
        found |= children
        changed = bool(children)
    found.discard(os.getpid())
    return sorted(found)


def _ray_env() -> dict[str, str]:
    """This process's environment for the cluster's nodes and clients, with Ray's token
    authentication off unless RAY_AUTH_MODE says otherwise: a local Ray instance started by
    ray.init() leaves a token in ~/.ray/auth_token, and nodes that find it there would refuse the
    clients that do not send it (the cluster listens on loopback only)."""
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}


class LocalCluster:
    def __init__(self, folder: pathlib.Path, env: dict[str, str] | None = None):
        self.folder = pathlib.Path(folder).resolve()
        self.env = dict(env or {})  # set on every node (its raylet, hence its workers and services)

    # ---- state ----
    def state(self) -> ClusterState:
        path = self.folder / STATE_FILE
        if not path.is_file():
            raise ClusterError(f"no local cluster in {self.folder} (no {STATE_FILE}); start one with "
                               f"`rlmesh cluster up --dir {self.folder}`")
        raw = json.loads(path.read_text())
        return ClusterState(raw["port"], raw["dashboard_port"], [NodeInfo(**n) for n in raw["nodes"]], raw["used"])

    def _save(self, state: ClusterState) -> None:
        tmp = self.folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(state), indent=1))
        os.replace(tmp, self.folder / STATE_FILE)

    @property
    def address(self) -> str:
        """HEAD:PORT, what `ray start --address` and `ray.init(address=...)` take."""
        state = self.state()
        return f"{state.head_ip}:{state.port}"

    @property
    def dashboard_url(self) -> str:
        """What `ray job submit --address` takes."""
        return f"http://127.0.0.1:{self.state().dashboard_port}"

    # ---- nodes ----
    def up(self, workers: int, gpus_per_node: int, head_gpus: int = 0, cpus_per_node: int = 1,
           object_store_mb: int = 80, port: int = 6379, dashboard_port: int = 8265, timeout_s: float = 300,
           head_env: dict[str, str] | None = None) -> None:
        """Starts the head (the dashboard on 127.0.0.1:dashboard_port, as the guide submits to) and
        `workers` worker nodes of `gpus_per_node` GPUs each. `head_env` is set on the head alone (the
        guide exports NCCL settings there before `ray start --head`; jobs' drivers run there)."""
        if len(str(self.folder)) > 40:
            # Ray puts unix sockets at <folder>/node-IP/session_<time>/sockets/...: at most 107 bytes.
            raise ClusterError(f"the cluster folder {self.folder} is too long ({len(str(self.folder))} characters) "
                               "for Ray's socket paths; give a folder of 40 characters at most, e.g. /tmp/rlmesh-cluster")
        if (self.folder / STATE_FILE).is_file():
            raise ClusterError(f"a local cluster is already described in {self.folder}; `rlmesh cluster down "
                               f"--dir {self.folder}` first")
        if workers < 0 or gpus_per_node < 0 or head_gpus < 0 or cpus_per_node < 1 or object_store_mb < 75:
            raise ClusterError(f"workers {workers}, gpus_per_node {gpus_per_node} and head_gpus {head_gpus} must be "
                               f">= 0, cpus_per_node {cpus_per_node} >= 1, object_store_mb {object_store_mb} >= 75 "
                               "(Ray's smallest object store)")
        self.folder.mkdir(parents=True, exist_ok=True)
        state = ClusterState(port, dashboard_port)
        self._save(state)
        try:
            self._start_node(state, head_gpus, cpus_per_node, object_store_mb, head=True, timeout_s=timeout_s,
                             extra_env=head_env)
            # One wait for all the workers: each check is a Ray driver started in a child process
            # (about a second of CPU), and a worker's start does not need the one before registered.
            for _ in range(workers):
                self._start_node(state, gpus_per_node, cpus_per_node, object_store_mb, head=False, timeout_s=timeout_s,
                                 wait=False)
            self.wait_nodes(len(state.nodes), timeout_s)
        except BaseException:
            self.down()
            raise

    def join(self, gpus: int, cpus: int = 1, object_store_mb: int = 80, timeout_s: float = 300) -> str:
        """A new worker node on the next free address; returns its address."""
        state = self.state()
        return self._start_node(state, gpus, cpus, object_store_mb, head=False, timeout_s=timeout_s).ip

    def _next_ip(self, state: ClusterState) -> str:
        # A killed node's address stays taken: the head remembers the dead node under it for a while.
        taken = {n.ip for n in state.nodes} | set(state.used)
        host = FIRST_HOST
        while f"127.0.0.{host}" in taken or node_processes(f"127.0.0.{host}"):
            host += 1
            if host > 254:
                raise ClusterError("no free address left in 127.0.0.2-254 for another node")
        return f"127.0.0.{host}"

    def _start_node(self, state: ClusterState, gpus: int, cpus: int, object_store_mb: int, head: bool,
                    timeout_s: float, extra_env: dict[str, str] | None = None, wait: bool = True) -> NodeInfo:
        """Starts one node and records it; wait: until the cluster counts it among its live nodes."""
        ip = self._next_ip(state)
        temp_dir = self.folder / f"node-{ip}"
        temp_dir.mkdir(parents=True, exist_ok=True)
        worker_base = self._worker_port_base(state)
        command = [*_ray_command(), "start", "--node-ip-address", ip, "--num-cpus", str(cpus), "--num-gpus", str(gpus),
                   "--object-store-memory", str(object_store_mb * 1024 * 1024), "--temp-dir", str(temp_dir),
                   "--disable-usage-stats", "--node-manager-port", str(free_port()),
                   "--object-manager-port", str(free_port()), "--metrics-export-port", str(free_port()),
                   "--dashboard-agent-listen-port", str(free_port()),
                   "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                   "--min-worker-port", str(worker_base), "--max-worker-port", str(worker_base + WORKER_PORTS - 1)]
        if head:
            command += ["--head", "--port", str(state.port), "--dashboard-host", "127.0.0.1",
                        "--dashboard-port", str(state.dashboard_port), "--include-dashboard", "true",
                        "--ray-client-server-port", str(free_port())]
        else:
            command += ["--address", f"{state.head_ip}:{state.port}"]
        # The agents start slowly on a busy machine; Ray's default wait for them is short.
        # `python3` in a submitted job's entry point is this environment's (the guide's `-- python3 -m ...`).
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        env = {**_ray_env(), **self.env, **(extra_env or {}), "PATH": path,
               "RAY_agent_register_timeout_ms": str(int(timeout_s * 1000)), "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
        env.pop("RAY_ADDRESS", None)
        log = temp_dir / "ray-start.log"
        for attempt in range(1, START_ATTEMPTS + 1):
            with open(log, "ab") as out:
                code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                       stdin=subprocess.DEVNULL, timeout=timeout_s)
            if code == 0:
                break
            self._kill_ip(ip)
            text = log.read_text(errors="replace")
            # On a busy machine a node's dashboard agent can miss the raylet's fixed wait for its port
            # file ("timed out during startup"); a second start usually makes it.
            if "timed out during startup" not in text or attempt == START_ATTEMPTS:
                tail = "\n".join(text.splitlines()[-15:])
                raise ClusterError(f"`ray start` for node {ip} exited with code {code} ({attempt} attempt(s)); "
                                   f"{log}:\n{tail}")
            time.sleep(2.0)
        node = NodeInfo(ip, gpus, cpus, str(temp_dir), head)
        state.nodes.append(node)
        state.used.append(ip)
        self._save(state)
        if wait:
            self.wait_nodes(len(state.nodes), timeout_s)
        return node

    def _worker_port_base(self, state: ClusterState) -> int:
        """A range of worker ports per node, below Linux's ephemeral range (32768 up: where free ports
        come from), shifted by the head's port so that two clusters on one machine rarely share one:
        21000 + 24 x 400 + 10 nodes x 40 = 31000 at most."""
        return 21000 + WORKER_PORTS * len(state.nodes) + (state.port % 25) * WORKER_PORTS * 10

    def wait_nodes(self, count: int, timeout_s: float) -> None:
        """Until the cluster reports `count` live nodes (a joined raylet registers a moment after `ray start`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.alive_nodes()
            if len(alive) >= count:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster at {self.address} shows {len(alive)} live nodes, not {count}, "
                                   f"after {timeout_s:.0f} s; see the ray-start.log files in {self.folder}")
            time.sleep(1.0)

    def alive_nodes(self) -> list[str]:
        """Addresses of the nodes the head's GCS counts alive (asked in a child process: a driver here
        would pin this process to the cluster)."""
        script = ("import json, ray; ray.init(address=%r, log_to_driver=False, logging_level='ERROR'); "
                  "print('NODES ' + json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
                  % self.address)
        env = {k: v for k, v in _ray_env().items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        line = next((l for l in out.stdout.splitlines() if l.startswith("NODES ")), None)
        if line is None:
            raise ClusterError(f"could not ask the cluster at {self.address} for its nodes:\n{out.stderr[-2000:]}")
        return json.loads(line[len("NODES "):])

    def kill(self, ip: str) -> int:
        """Stops the node at `ip` as a lost machine does: its raylet, agents, Ray workers and the service
        processes they started, all SIGKILLed at once. Returns how many processes it killed."""
        state = self.state()
        node = next((n for n in state.nodes if n.ip == ip), None)
        if node is None:
            raise ClusterError(f"no node {ip} in the cluster of {self.folder}; its nodes are "
                               f"{', '.join(n.ip for n in state.nodes)}")
        if node.head:
            raise ClusterError(f"{ip} is the head: killing it ends the cluster; use `rlmesh cluster down`")
        killed = self._kill_ip(ip)
        state.nodes.remove(node)
        self._save(state)
        return killed

    def _kill_ip(self, ip: str, sig: int = signal.SIGKILL) -> int:
        pids = node_processes(ip)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def down(self) -> None:
        """Every node (workers first, then the head) and the state file; the folder's logs stay."""
        try:
            state = self.state()
        except ClusterError:
            return
        for node in sorted(state.nodes, key=lambda n: n.head):
            self._kill_ip(node.ip, signal.SIGTERM)
        time.sleep(2.0)
        for node in state.nodes:
            self._kill_ip(node.ip)
        (self.folder / STATE_FILE).unlink(missing_ok=True)
