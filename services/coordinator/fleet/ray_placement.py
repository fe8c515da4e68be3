"""Placing the services on a Ray cluster: the coordinator is the Ray driver.

Resources are reserved up front as placement groups built from the OpenRLHF flags: one GPU bundle
per learner rank (--actor_num_nodes x --actor_num_gpus_per_node), one per GPU of each vLLM engine
(--vllm_num_engines x --vllm_tensor_parallel_size), one per reward / reference instance. Colocated
roles (--colocate_all_models, --colocate_actor_ref, --colocate_critic_reward) share the actor's
bundles (strategy PACK) and each takes a fraction of a GPU. On a cluster without GPUs every
service gets a CPU bundle of --ray_cpus_per_service.

Each service runs as a `ServiceHost` actor placed on its bundle. The actor starts the service's
usual entry point (`python -m services.<name>`, the same command as the local placement) as a
child process on its node, with CUDA_VISIBLE_DEVICES naming the GPUs of its bundles, waits until
it serves, and reports its address; the coordinator then talks gRPC to it like to any other. A
learner over several GPUs runs one actor per rank (rank 0 serves gRPC and drives the others).
Stopping the run stops every child, kills the actors and removes the placement groups; if the
driver dies, Ray kills its actors and the children follow (they get SIGTERM when their parent dies).

Supervision (supervisor.py) asks each actor whether its child still runs. A dead child is started
again by its actor; a dead actor (its child gets SIGTERM) is replaced by a new one on the same
bundle. An instance added while the run goes on gets a placement group of its own, which goes with
it when it is removed. One of the run's first instances shares its placement group with the others
(Ray frees a group only whole): when it is removed its bundles stay reserved, and the next instance
added with the same roles takes them instead of asking the cluster for more (a full cluster can
scale down and up again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import warnings

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.common.log import get_logger, log_event
from services.common.security import client_credentials, launch_settings
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet.launcher import ServiceStartError
from services.coordinator.fleet.placement import (Endpoints, ServiceSpec, learner_argv, reward_argv, role_instances,
                                            rollout_argv, scaled_spec, start_waves)
from services.coordinator.fleet.ray_cluster import (actor_node, bundle_has_live_node, cluster_summary, describe_bundles,
                                                  join_command, live_node_ips)
from services.coordinator.fleet.ray_host import FORWARDED_ENV, ServiceHost

_log = get_logger("coordinator")
ACTOR_ANSWER_S = 30.0  # a health check or stop of a service's actor; a lost node's actors may never answer
TARGETS_FILE = "prometheus_targets.json"  # Prometheus file_sd: every instance's metrics port, kept current


@dataclasses.dataclass
class Placed:
    spec: ServiceSpec
    bundles: list[tuple[object, int]]  # (placement group, bundle index), first = where the actor sits
    share: float = 0.0  # GPU fraction the actor takes on its first bundle
    rank: int = -1  # learner rank for per-rank learner actors
    actor: object = None
    address: str = ""
    node_ip: str = ""  # the node the service runs on (its address's host)
    metrics_port: int | None = None


class RayPlacement:
    name = "ray"

    def __init__(self, cfg: CoordinatorConfig, run_dir: pathlib.Path, total_steps: int):
        self.cfg, self.run_dir, self.total_steps = cfg, run_dir, total_steps
        self.groups: list = []
        self.placed: list[Placed] = []
        self.vacated: list[Placed] = []  # removed instances whose bundles stay reserved in a shared group
        self.started_ray = False
        self.learner_host: Placed | None = None
        self.gpu_plan = False  # the cluster declares GPUs: plan by them (services may still run on the CPU)
        self.group_roles: dict[int, str] = {}  # id(group) -> what it holds, for errors
        self._log_offsets: dict[tuple[str, str], int] = {}  # (service, node) -> bytes copied to the run folder
        self._mirror: asyncio.Task | None = None
        self._log_dir, self._driver_ip = str((run_dir / "logs").resolve()), ""
        # Actors made per service name: a replaced actor gets a new name (the dead one may hold its name a while).
        self._actors_named: dict[str, int] = {}
        # How long a restart waits for a node to take a bundle whose node was lost, and the flag that says so.
        self.lost_bundle_wait_s, self.lost_bundle_flag = cfg.ray_placement_timeout_s, "--ray_placement_timeout_s"

    # ---- the cluster ----
    def connect(self) -> None:
        """Joins (or starts) the Ray cluster. Call it before this process serves gRPC: ray.init forks
        Ray's own servers, and a fork beside live gRPC threads can crash the child before it execs."""
        cfg = self.cfg
        if ray.is_initialized():
            return
        address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or None
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=cfg.ray_num_cpus or None, include_dashboard=False, log_to_driver=False)
            self.started_ray = True
        gpus = ray.cluster_resources().get("GPU", 0)
        # Logical GPUs (`ray start --num-gpus N` on machines without any, e.g. `rlmesh cluster up`) place
        # the services as real ones would; --device cpu then runs them on the CPU.
        self.gpu_plan = gpus > 0
        if cfg.device == "auto":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cfg.resolve_device(gpus > 0)
            for w in caught:
                log_event(_log, "config.warning", level=30, message=str(w.message))
        log_event(_log, "ray.connected", address=address or "local", gpus=gpus,
                  cpus=ray.cluster_resources().get("CPU", 0))

    def _group(self, bundles: list[dict], role: str, strategy: str = "PACK"):
        group = placement_group(bundles, strategy=strategy)
        self.groups.append(group)
        self.group_roles[id(group)] = role
        return group

    async def _wait_groups(self) -> None:
        """Every group reserved within --ray_placement_timeout_s, else an error naming what did not fit."""
        timeout = self.cfg.ray_placement_timeout_s
        pending = {id(g): g for g in self.groups}

        async def ready(g):
            await g.ready()
            pending.pop(id(g), None)

        try:
            await asyncio.wait_for(asyncio.gather(*(ready(g) for g in self.groups)), timeout)
        except asyncio.TimeoutError:
            asked = "; ".join(f"{self.group_roles[key]} asks for {describe_bundles(g.bundle_specs)}"
                              for key, g in pending.items())
            raise RuntimeError(f"the Ray cluster cannot hold this job: {asked}; {cluster_summary()}; waited "
                               f"--ray_placement_timeout_s {timeout:.0f} s. Add nodes (`{join_command('N')}`), lower the "
                               "*_num_nodes / *_num_gpus_per_node / --vllm_num_engines flags, or colocate roles") from None

    # ---- what goes where ----
    def _plan(self) -> list[Placed]:
        cfg = self.cfg
        specs_reward = role_instances(cfg, "reward")
        specs_ref = role_instances(cfg, "ref") if cfg.ref_needed else 0
        learner_spec = lambda ranks: ServiceSpec("learner", "services.learner",  # noqa: E731
                                                 learner_argv(cfg, self.total_steps, ranks), ("learner",),
                                                 env={"LOCAL_RANK": "0"})
        rollout_specs = [ServiceSpec(f"rollout-{i}", "services.rollout", rollout_argv(cfg), ("rollout",))
                         for i in range(cfg.vllm_num_engines)]
        # As in the local placement: one process serves both roles on CPU or when everything is colocated.
        merge = not self.gpu_plan or cfg.colocate_all_models
        reward_specs = [ServiceSpec(f"reward-ref-{i}" if merge and i < specs_ref else f"reward-{i}", "services.reward",
                                    reward_argv(cfg, True, merge and i < specs_ref),
                                    ("reward", "reference") if merge and i < specs_ref else ("reward",))
                        for i in range(specs_reward)]
        ref_specs = [ServiceSpec(f"ref-{i}", "services.reward", reward_argv(cfg, False, True), ("reference",))
                     for i in range(specs_reward if merge else 0, specs_ref)]
        if not self.gpu_plan:
            # CPU cluster: one CPU bundle per process; a multi-rank learner starts its ranks itself.
            specs = [learner_spec(cfg.actor_gpus()), *rollout_specs, *reward_specs, *ref_specs]
            group = self._group([{"CPU": cfg.ray_cpus_per_service} for _ in specs], "the services (CPU bundles)")
            return [Placed(s, [(group, i)]) for i, s in enumerate(specs)]
        return self._plan_gpus(learner_spec, rollout_specs, reward_specs, ref_specs)

    def _plan_gpus(self, learner_spec, rollout_specs, reward_specs, ref_specs) -> list[Placed]:
        cfg = self.cfg
        one_gpu = lambda n: [{"GPU": 1, "CPU": cfg.ray_cpus_per_service} for _ in range(n)]  # noqa: E731
        actor_group = self._group(one_gpu(cfg.actor_gpus()), f"the actor (--actor_num_nodes {cfg.actor_num_nodes} x "
                                  f"--actor_num_gpus_per_node {cfg.actor_num_gpus_per_node})")
        actor_bundles = [(actor_group, i) for i in range(cfg.actor_gpus())]
        placed: list[Placed] = []
        # One actor per learner rank; each rank sees one GPU.
        ranks = cfg.actor_gpus()
        for r in range(ranks):
            spec = learner_spec(ranks) if r == 0 else dataclasses.replace(learner_spec(ranks), name=f"learner-rank{r}")
            placed.append(Placed(spec, [actor_bundles[r]], rank=r))
        tp = cfg.vllm_tensor_parallel_size
        if cfg.colocate_all_models:
            engine_bundles = actor_bundles
        else:
            group = self._group(one_gpu(cfg.vllm_num_engines * tp), f"the rollout engines (--vllm_num_engines "
                                f"{cfg.vllm_num_engines} x --vllm_tensor_parallel_size {tp})")
            engine_bundles = [(group, i) for i in range(cfg.vllm_num_engines * tp)]
        for i, spec in enumerate(rollout_specs):
            first = i * tp % len(engine_bundles)  # colocated: several engines per GPU when more than the ranks
            placed.append(Placed(spec, engine_bundles[first:first + tp]))
        for role, specs, shares_actor in (("reward", reward_specs, cfg.colocate_all_models or cfg.colocate_critic_reward),
                                          ("ref", ref_specs, cfg.colocate_all_models or cfg.colocate_actor_ref)):
            if not specs:
                continue
            if shares_actor:
                bundles = actor_bundles
            else:
                group = self._group(one_gpu(len(specs)), f"the {role} model (--{role}_num_nodes "
                                    f"{getattr(cfg, f'{role}_num_nodes')} x --{role}_num_gpus_per_node "
                                    f"{getattr(cfg, f'{role}_num_gpus_per_node')})")
                bundles = [(group, i) for i in range(len(specs))]
            for i, spec in enumerate(specs):
                placed.append(Placed(spec, [bundles[i % len(bundles)]]))
        # Actors sharing a bundle split its GPU; the reservation itself is the placement group's.
        users: dict[tuple, int] = {}
        for p in placed:
            key = (id(p.bundles[0][0]), p.bundles[0][1])
            users[key] = users.get(key, 0) + 1
        for p in placed:
            p.share = int(100 / users[(id(p.bundles[0][0]), p.bundles[0][1])]) / 100
        return placed

    async def _probe_gpus(self) -> dict[tuple, tuple[str, str]]:
        """(group id, bundle) -> (node ip, physical GPU id) for every GPU bundle."""

        @ray.remote(num_gpus=0.01, num_cpus=0)
        def probe():
            return ray.util.get_node_ip_address(), str(ray.get_gpu_ids()[0])

        keys = {(id(g), i): (g, i) for p in self.placed for g, i in p.bundles}
        refs = {k: probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=i))
                .remote() for k, (g, i) in keys.items()}
        return {k: await ref for k, ref in refs.items()}

    # ---- start / stop ----
    async def start(self) -> Endpoints:
        cfg = self.cfg
        self.connect()
        self.placed = self._plan()
        await self._wait_groups()
        gpu_of = await self._probe_gpus() if self.gpu_plan else {}
        driver_ip = ray.util.get_node_ip_address()
        log_dir = str((self.run_dir / "logs").resolve())
        self._log_dir, self._driver_ip = log_dir, driver_ip
        for p in self.placed:
            self._make_actor(p)
            p.spec.env.update(forwarded_env())
            if self.gpu_plan:
                located = [gpu_of[(id(g), i)] for g, i in p.bundles]
                if len({node for node, _ in located}) > 1:
                    raise RuntimeError(f"{p.spec.name} would span nodes {sorted({n for n, _ in located})}; keep "
                                       "--vllm_tensor_parallel_size <= GPUs per node")
            if cfg.on_gpu and self.gpu_plan:
                p.spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for _, gpu in located)
            else:
                p.spec.env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        self._mirror = asyncio.create_task(self._mirror_logs())
        # Roles colocated on the learner's GPUs start after it (the engines size their memory to what
        # the learner left); otherwise every service loads at once.
        shares_gpus = cfg.on_gpu and (cfg.colocate_all_models or cfg.colocate_actor_ref or cfg.colocate_critic_reward)
        if shares_gpus:
            await self._start_learner()
        others = [p for p in self.placed if "learner" not in p.spec.roles]
        # Engines sharing a GPU start one round after another (placement.start_waves says why).
        for k, wave in enumerate(start_waves(cfg, others, spec_of=lambda p: p.spec)):
            starts = [self._start_one(p, wait=True) for p in wave]
            if k == 0 and not shares_gpus:
                starts.append(self._start_learner())
            results = await asyncio.gather(*starts, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        by_role = lambda role: [p.address for p in self.placed if role in p.spec.roles and p.address]  # noqa: E731
        return Endpoints(rollout=by_role("rollout"), reward=by_role("reward"), reference=by_role("reference"),
                         learner=self.learner_host.address)

    def _make_actor(self, p: Placed) -> None:
        group, index = p.bundles[0]
        # Named by its service (the dashboard's actor list reads rollout-0, learner-rank1, ...).
        made = self._actors_named[p.spec.name] = self._actors_named.get(p.spec.name, 0) + 1
        name = p.spec.name if made == 1 else f"{p.spec.name}-restart{made - 1}"
        p.actor = ray.remote(ServiceHost).options(
            name=name, num_cpus=0 if self.gpu_plan else self.cfg.ray_cpus_per_service, num_gpus=p.share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(p.spec.name, self._log_dir, self._driver_ip)

    # ---- supervision (services/coordinator/fleet/supervisor.py) ----
    def instances(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(name, roles, address) of every service; a multi-rank learner is one instance (rank 0)."""
        return [(p.spec.name, p.spec.roles, p.address) for p in self.placed if p.rank <= 0]

    def _members(self, name: str) -> list[Placed]:
        """The actors of an instance: every rank for the learner, else the one actor."""
        if name == "learner":
            return [p for p in self.placed if "learner" in p.spec.roles]
        return [p for p in self.placed if p.spec.name == name]

    async def check(self, name: str) -> str | None:
        """None while the service (every rank of the learner) runs; else how it ended."""
        for p in self._members(name):
            try:
                code = await asyncio.wait_for(p.actor.exit_code.remote(), ACTOR_ANSWER_S)
            except ray.exceptions.RayActorError as exc:
                return f"its Ray actor died ({type(exc).__name__})"
            except asyncio.TimeoutError:
                # No answer: a lost node (Ray declares it dead after its health checks fail) or a busy one.
                if p.node_ip and p.node_ip not in live_node_ips():
                    return f"its node {p.node_ip} was lost"
                continue
            if code is not None:
                return f"{p.spec.name} exit code {code}"
        return None

    def log_tail(self, name: str) -> str:
        p = self._members(name)[0]
        if not bundle_has_live_node(*p.bundles[0]):
            # Its node was lost (or none took the bundle): an actor there would answer only at the
            # timeout. What it logged while its node lived was mirrored into the run folder.
            return f"(its node is gone; its log up to then is in {self._log_dir})"
        try:
            return ray.get(p.actor.tail.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - a dead actor's log stays in the run folder
            return f"(log unavailable through Ray: {type(exc).__name__}; see {self._log_dir})"

    async def restart(self, name: str) -> str:
        """Stops what is left of the service, restarts any dead actor on its bundle and starts the
        child again; returns the new address (a restarted learner restarts every rank)."""
        members = self._members(name)
        await self._stop_actors(members)
        if name == "learner":
            await self._start_learner()
            return self.learner_host.address
        await self._start_one(members[0], wait=True)
        return members[0].address

    async def _stop_actors(self, members: list[Placed]) -> None:
        """Stops the services of `members`; a dead actor is replaced by a new one on its bundle."""
        for p in members:
            try:
                await asyncio.wait_for(p.actor.stop.remote(5.0), ACTOR_ANSWER_S)
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as exc:
                # Its bundle is free again once Ray has seen the actor die (a lost node's bundles move to
                # a node with room, or wait for one): a new actor takes it.
                ray.kill(p.actor)
                self._make_actor(p)
                log_event(_log, "ray.actor_replaced", service=p.spec.name, why=type(exc).__name__)

    # ---- scaling while running (services/coordinator/fleet/scaling.py) ----
    async def add(self, role: str) -> tuple[str, tuple[str, ...], str]:
        """One more rollout or reward instance on a placement group of its own; (name, roles, address)."""
        cfg = self.cfg
        spec = scaled_spec(cfg, role, [p.spec.name for p in self.placed])
        vacated = next((v for v in self.vacated if v.spec.roles == spec.roles), None)
        if vacated is not None:
            return await self._add_on_vacated(spec, vacated)
        gpus = (cfg.vllm_tensor_parallel_size if role == "rollout" else 1) if self.gpu_plan else 0
        bundles = ([{"GPU": 1, "CPU": cfg.ray_cpus_per_service} for _ in range(gpus)] if gpus
                   else [{"CPU": cfg.ray_cpus_per_service}])
        group = self._group(bundles, f"another {role} instance")
        try:
            await asyncio.wait_for(group.ready(), cfg.ray_placement_timeout_s)
        except asyncio.TimeoutError:
            self.groups.remove(group)
            remove_placement_group(group)
            raise RuntimeError(f"the Ray cluster has no room for another {role} instance ({bundles}); it has "
                               f"{ray.available_resources()} free") from None
        p = Placed(spec, [(group, i) for i in range(len(bundles))], share=1.0 if gpus else 0.0)
        self._make_actor(p)
        p.spec.env.update(forwarded_env())
        if gpus and cfg.on_gpu:
            gpu_of = await self._probe_gpus_of(p)
            p.spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_of)
        else:
            p.spec.env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        self.placed.append(p)
        await self._start_one(p, wait=True)
        return spec.name, spec.roles, p.address

    async def _add_on_vacated(self, spec: ServiceSpec, vacated: Placed) -> tuple[str, tuple[str, ...], str]:
        """The new instance takes the bundles (and GPU share, and devices) a removed one left reserved."""
        self.vacated.remove(vacated)
        p = Placed(spec, vacated.bundles, share=vacated.share)
        for key in ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"):
            if key in vacated.spec.env:
                p.spec.env[key] = vacated.spec.env[key]
        self._make_actor(p)
        self.placed.append(p)
        log_event(_log, "ray.bundle_reused", service=spec.name, bundle_of=vacated.spec.name,
                  bundles=",".join(f"{g.id.hex()[:12]}:{i}" for g, i in p.bundles))
        try:
            await self._start_one(p, wait=True)
        except BaseException:
            # It never served: its bundles go back to the reserve for the next attempt.
            self.placed.remove(p)
            ray.kill(p.actor)
            self.vacated.append(vacated)
            raise
        return spec.name, spec.roles, p.address

    async def _probe_gpus_of(self, p: Placed) -> list[str]:
        @ray.remote(num_gpus=0.01, num_cpus=0)
        def probe():
            return str(ray.get_gpu_ids()[0])

        return [await probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            g, placement_group_bundle_index=i)).remote() for g, i in p.bundles]

    async def remove(self, name: str) -> None:
        """Stops the instance's child, its actor and (when it had one of its own) its placement group."""
        p = next(p for p in self.placed if p.spec.name == name)
        code = None
        try:
            code = await asyncio.wait_for(p.actor.stop.remote(30.0), 60.0)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            pass
        await self._copy_logs()
        ray.kill(p.actor)
        log_event(_log, "service.stopped", service=name, code=code)
        self.placed.remove(p)
        self._write_targets()
        group = p.bundles[0][0]
        if not any(g is group for q in self.placed for g, _ in q.bundles):
            self.groups.remove(group)
            remove_placement_group(group)
        else:  # a group shared with other instances stays whole: the next add of these roles takes the bundles
            self.vacated.append(p)
            log_event(_log, "ray.bundle_vacated", service=name, roles=",".join(p.spec.roles))

    async def _placed_on(self, p: Placed) -> str:
        group, index = p.bundles[0]
        return await actor_node(p.actor, group, index, p.spec.name, self.group_roles.get(id(group), "its group"),
                                self.lost_bundle_wait_s, self.cfg.service_start_timeout_s, self.lost_bundle_flag)

    async def _start_one(self, p: Placed, wait: bool, env: dict | None = None) -> None:
        await self._placed_on(p)
        try:
            # The run's TLS settings and token (services.common.security); the token in env, not argv.
            secure_argv, secure_env = launch_settings(self.cfg, client_credentials())
            # Bounded here too: an actor whose bundle has no node (a lost node) never runs the call.
            info = await asyncio.wait_for(p.actor.start.remote(p.spec.module, [*p.spec.argv, *secure_argv],
                                                               {**p.spec.env, **(env or {}), **secure_env}, wait,
                                                               self.cfg.service_start_timeout_s),
                                          self.cfg.service_start_timeout_s + 60.0)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, ServiceStartError) else exc
            raise ServiceStartError(f"{p.spec.name} on Ray: {cause}") from None
        except asyncio.TimeoutError:
            raise ServiceStartError(f"{p.spec.name} on Ray: its actor did not start the service within "
                                    f"{self.cfg.service_start_timeout_s + 60.0:.0f} s (`ray status` shows whether "
                                    "its placement group still has a node); raise --service_start_timeout_s if "
                                    "it only starts slowly") from None
        p.address, p.node_ip, p.metrics_port = info["address"], info["node_ip"], info.get("metrics_port")
        log_event(_log, "ray.service_ready" if wait else "ray.service_started", service=p.spec.name,
                  address=p.address or "-", node=info["node_ip"], log=info["log"])
        self._write_targets()

    # ---- what reaches the driver from every node: logs, Prometheus targets ----
    def _write_targets(self) -> None:
        """run_dir/prometheus_targets.json (Prometheus file_sd_configs), rewritten whenever an instance
        starts, restarts or leaves: each service's metrics port on its node, labelled by service and node."""
        targets = [{"targets": [f"{p.node_ip}:{p.metrics_port}"],
                    "labels": {"service": p.spec.name, "role": ",".join(p.spec.roles),
                               "node": p.node_ip}}
                   for p in self.placed if p.metrics_port and p.node_ip]
        path = self.run_dir / TARGETS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(targets, indent=1))
        os.replace(tmp, path)

    async def _copy_logs(self, live_only: bool = False) -> None:
        """Appends what the services on other nodes wrote since the last copy to run_dir/logs/<name>.log
        (live_only: only from actors whose bundle has a live node, the others being asked not at all)."""
        remote = [p for p in list(self.placed) if p.node_ip and p.node_ip != self._driver_ip and p.actor is not None
                  and (not live_only or bundle_has_live_node(*p.bundles[0]))]

        async def chunk_of(p: Placed) -> bytes:
            try:
                return await asyncio.wait_for(p.actor.log_chunk.remote(self._log_offsets.get((p.spec.name, p.node_ip), 0)),
                                              30)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                return b""  # a dead node's last lines are lost with it; its restart logs anew

        # At once: an actor whose node was lost answers only at the timeout.
        for p, chunk in zip(remote, await asyncio.gather(*(chunk_of(p) for p in remote))):
            key = (p.spec.name, p.node_ip)
            if chunk:
                self._log_offsets[key] = self._log_offsets.get(key, 0) + len(chunk)
                log_dir = pathlib.Path(self._log_dir)
                log_dir.mkdir(parents=True, exist_ok=True)
                with open(log_dir / f"{p.spec.name}.log", "ab") as f:
                    f.write(chunk)

    async def _mirror_logs(self, every_s: float = 2.0) -> None:
        while True:
            await self._copy_logs()
            await asyncio.sleep(every_s)

    async def _start_learner(self) -> None:
        ranks = [p for p in self.placed if "learner" in p.spec.roles]
        self.learner_host = ranks[0]
        if len(ranks) == 1:
            await self._start_one(ranks[0], wait=True)
            return
        # Rank 0 hosts the rendezvous store on a port free on its node; the others join it.
        master_ip = await self._placed_on(ranks[0])
        master_port = await ranks[0].actor.free_port.remote()
        env = lambda r: {"RANK": str(r), "WORLD_SIZE": str(len(ranks)), "LOCAL_RANK": "0",  # noqa: E731
                         "MASTER_ADDR": master_ip, "MASTER_PORT": str(master_port)}
        workers = [self._start_one(p, wait=False, env=env(p.rank)) for p in ranks[1:]]
        await asyncio.gather(self._start_one(ranks[0], wait=True, env=env(0)), *workers)

    async def weight_sync_master(self, endpoints: Endpoints) -> tuple[str, int]:
        actor = self.learner_host.actor
        return await actor.node_ip.remote(), await actor.free_port.remote()

    async def stop(self) -> None:
        if not ray.is_initialized():
            return
        if self._mirror is not None:
            self._mirror.cancel()
        # An actor whose bundle has no live node (its node was lost, nothing took the bundle) would
        # never answer: it is killed below without being asked.
        stops = [p.actor.stop.remote(30.0) for p in self.placed
                 if p.actor is not None and bundle_has_live_node(*p.bundles[0])]
        if stops:
            try:
                await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), 60.0)
            except asyncio.TimeoutError:
                log_event(_log, "ray.stop_timeout", action="killing the actors")
        await self._copy_logs(live_only=True)  # the last lines, written while the services stopped
        for p in self.placed:
            if p.actor is not None:
                ray.kill(p.actor)
        for group in self.groups:
            remove_placement_group(group)
        if self.started_ray:
            ray.shutdown()
        log_event(_log, "ray.stopped", services=len(self.placed))


def forwarded_env() -> dict[str, str]:
    """The driver's networking settings that every service on every node gets (FORWARDED_ENV)."""
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
