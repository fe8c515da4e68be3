"""Where the services are: started here as subprocesses (local), found at fixed addresses (static),
or placed on a Ray cluster (ray, see ray_placement.py). All three hand the loop the same
`Endpoints`; every call after that is gRPC, so the loop has one code path.

The command line of each service is built here from the coordinator's flags (the OpenRLHF names)
so a user never has to repeat an option per service.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import shlex
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.client import make_channel, verify_tls_as, wait_for_serving
from services.common.log import get_logger, log_event
from services.common.security import client_credentials, launch_settings
from services.common.user_errors import ServiceUnreachable
from services.coordinator.config import CoordinatorConfig
from services.coordinator.loop.run_state import Endpoints
from services.coordinator.fleet.launcher import ServiceProcess, log_tail, spawn_service, stop_all, wait_until_ready

_log = get_logger("coordinator")
REFERENCE_SERVICE = "rlmesh.reward.v1.ReferenceService"


@dataclasses.dataclass
class ServiceSpec:
    """One service process to start: its name, module, arguments, GPUs and environment."""

    name: str  # e.g. "rollout-0"
    module: str  # e.g. "services.rollout"
    argv: list[str]
    roles: tuple[str, ...]  # what it serves: rollout, reward, reference, learner
    num_gpus: float = 0.0
    gpu_ids: list[int] = dataclasses.field(default_factory=list)  # local placement on GPUs
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Command lines


def rollout_dtype(cfg: CoordinatorConfig) -> str:
    """--rollout_dtype, where auto is the learner's bfloat16 with --bf16 on GPUs; elsewhere the engine
    decides (on a CPU it knows whether bfloat16 is fast there: services/rollout/cpu_defaults.py)."""
    if cfg.rollout_dtype != "auto":
        return cfg.rollout_dtype
    return "bfloat16" if cfg.bf16 and cfg.on_gpu else "auto"


def rollout_argv(cfg: CoordinatorConfig) -> list[str]:
    argv = ["--pretrain", cfg.pretrain, "--engine", cfg.rollout_engine,
            "--tensor_parallel_size", str(cfg.vllm_tensor_parallel_size),
            "--gpu_memory_utilization", str(cfg.vllm_gpu_memory_utilization),
            "--max_model_len", str(cfg.prompt_max_len + cfg.generate_max_len),
            "--seed", str(cfg.seed), "--metrics_port", "0",
            "--enable_prefix_caching" if cfg.enable_prefix_caching else "--no-enable_prefix_caching"]
    argv += ["--dtype", rollout_dtype(cfg)]
    if cfg.enforce_eager is not None:  # unset: the service's default (eager on a CPU, compiled on a GPU)
        argv.append("--enforce_eager" if cfg.enforce_eager else "--no-enforce_eager")
    if cfg.vllm_enable_sleep and cfg.on_gpu:
        argv.append("--enable_sleep_mode")
    if cfg.partial_rollout:
        argv.append("--partial_rollout")
    if cfg.vllm_max_num_seqs:
        argv += ["--max_num_seqs", str(cfg.vllm_max_num_seqs)]
    if cfg.vllm_max_num_batched_tokens:
        argv += ["--max_num_batched_tokens", str(cfg.vllm_max_num_batched_tokens)]
    if cfg.vllm_quantization:
        argv += ["--quantization", cfg.vllm_quantization]
    if cfg.lora_rank:  # pushes carry the actor's adapter, which the engines merge (services/rollout/adapters.py)
        argv.append("--enable_lora")
    if cfg.rollout_engine == "hf" and not cfg.on_gpu:
        argv += ["--hf_device", "cpu"]
    return argv + shlex.split(cfg.rollout_extra_args)


def reward_argv(cfg: CoordinatorConfig, reward: bool, reference: bool) -> list[str]:
    argv = ["--device", "cuda" if cfg.on_gpu else "cpu", "--metrics_port", "0"]
    if reward:
        if cfg.reward_pretrain:
            argv += ["--reward_pretrain", cfg.reward_pretrain, "--reward_dtype", "bf16" if cfg.bf16 else "fp32"]
        elif cfg.remote_rm_url:
            argv += ["--remote_rm_url", cfg.remote_rm_url, "--remote_rm_batch_size", str(cfg.remote_rm_batch_size)]
        else:
            argv += ["--reward_func", cfg.reward_func]
        argv += ["--reward_clip_range", *map(str, cfg.reward_clip_range),
                 "--reward_micro_batch_size", str(cfg.micro_rollout_batch_size)]
        if cfg.normalize_reward:
            argv.append("--normalize_reward")
    if reference:
        # The same dtype as the learner's, so reference and policy log-probs are computed alike.
        argv += ["--ref_pretrain", cfg.ref_pretrain or cfg.pretrain, "--ref_dtype", "bf16" if cfg.bf16 else "fp32",
                 "--ref_micro_batch_size", str(cfg.micro_rollout_batch_size)]
    return argv + shlex.split(cfg.reward_extra_args)


def learner_optimizer_steps(cfg: CoordinatorConfig, total_steps: int) -> int:
    """Optimizer steps of the whole run, for the learning-rate schedule."""
    return max(1, total_steps * cfg.samples_per_step() // cfg.train_batch_size * cfg.max_epochs)


def warmup_ratio(cfg: CoordinatorConfig, total_steps: int) -> float:
    """The learner's warm-up as a fraction of the run: --lr_warmup_steps global steps of total_steps (the
    learner counts optimizer steps, so a fraction keeps the meaning), or --lr_warmup_ratio. A ratio must stay
    below 1: warm-up steps beyond the run warm up over all of it."""
    if cfg.lr_warmup_steps <= 0:
        return cfg.lr_warmup_ratio
    return min(cfg.lr_warmup_steps / max(total_steps, 1), 1 - 1e-9)


def learner_argv(cfg: CoordinatorConfig, total_steps: int, num_ranks: int) -> list[str]:
    argv = ["--pretrain", cfg.pretrain, "--num_gpus", str(num_ranks),
            "--zero_stage", str(cfg.zero_stage), "--actor_learning_rate", str(cfg.actor_learning_rate),
            "--train_batch_size", str(cfg.train_batch_size), "--micro_train_batch_size", str(cfg.micro_train_batch_size),
            "--micro_forward_batch_size", str(cfg.micro_rollout_batch_size),
            "--max_norm", str(cfg.max_norm), "--l2", str(cfg.l2), "--lr_warmup_ratio", str(warmup_ratio(cfg, total_steps)),
            "--adam_betas", *(str(b) for b in cfg.adam_betas),
            "--lr_scheduler", cfg.lr_scheduler, "--min_lr_ratio", str(cfg.min_lr_ratio), "--max_steps", str(learner_optimizer_steps(cfg, total_steps)),
            "--max_len", str(cfg.prompt_max_len + cfg.generate_max_len),
            "--max_ckpt_num", str(cfg.max_ckpt_num), "--seed", str(cfg.seed), "--metrics_port", "0"]
    if cfg.critic_needed:
        argv += ["--critic_pretrain", cfg.critic_pretrain or cfg.reward_pretrain or cfg.pretrain,
                 "--critic_learning_rate", str(cfg.critic_learning_rate)]
    for flag in ("bf16", "gradient_checkpointing", "adam_offload", "packing_samples", "use_liger_kernel",
                 "use_ds_universal_ckpt", "use_dynamic_batch"):
        if getattr(cfg, flag):
            argv.append(f"--{flag}")
    if cfg.elastic and cfg.zero_stage > 0 and not cfg.use_ds_universal_ckpt:
        argv.append("--use_ds_universal_ckpt")  # a learner re-formed on other ranks loads the last checkpoint
    if cfg.use_dynamic_batch:
        argv += ["--train_max_tokens_per_gpu", str(cfg.train_max_tokens_per_gpu)]
        if cfg.rollout_max_tokens_per_gpu:
            argv += ["--rollout_max_tokens_per_gpu", str(cfg.rollout_max_tokens_per_gpu)]
    if cfg.flash_attn:
        argv += ["--attn_implementation", "flash_attention_2"]  # PyTorch's varlen kernel without flash-attn
    elif cfg.packing_samples and cfg.on_gpu:
        argv += ["--attn_implementation", "varlen"]  # sdpa would attend through a (tokens x tokens) mask
    if cfg.on_gpu and cfg.zero_stage < 3:
        # Log-probs straight from the hidden states: less memory and time than full float32 logits.
        argv += ["--logprobs_head", "fused"]
    if cfg.deepspeed:
        argv += ["--deepspeed", cfg.deepspeed]  # the learner lays the file's other settings over its config
    if cfg.lora_rank:  # the actor's adapter; the critic trains in full
        argv += ["--lora_rank", str(cfg.lora_rank), "--lora_alpha", str(cfg.lora_alpha),
                 "--target_modules", *cfg.target_modules, "--lora_dropout", str(cfg.lora_dropout)]
        if cfg.lora_merge_on_save:
            argv.append("--lora_merge_on_save")
    return argv + shlex.split(cfg.learner_extra_args)


# ----------------------------------------------------------------------------------------------
# Which processes a run needs


def role_instances(cfg: CoordinatorConfig, role: str) -> int:
    """Service instances of the reward or reference role: one per GPU (one per count on CPU); no
    reward instance when an agent's own rewards are the rewards."""
    if role == "reward" and not cfg.reward_service_needed:
        return 0
    if cfg.colocate_all_models or (role == "ref" and cfg.colocate_actor_ref):
        return cfg.actor_gpus() if cfg.on_gpu else 1
    if role == "reward" and cfg.colocate_critic_reward:
        return max(1, cfg.critic_num_nodes * cfg.critic_num_gpus_per_node) if cfg.on_gpu else 1
    return max(1, getattr(cfg, f"{role}_num_nodes") * getattr(cfg, f"{role}_num_gpus_per_node"))


def service_specs(cfg: CoordinatorConfig, total_steps: int) -> list[ServiceSpec]:
    """The processes of a run, with their GPUs for a single machine (local placement)."""
    specs: list[ServiceSpec] = []
    # DeepSpeed insists on LOCAL_RANK even for a plainly started rank 0 (ranks it spawns get their own).
    specs.append(ServiceSpec("learner", "services.learner", learner_argv(cfg, total_steps, cfg.actor_gpus()),
                             ("learner",), num_gpus=cfg.actor_gpus(), env={"LOCAL_RANK": "0"}))
    for i in range(cfg.vllm_num_engines):
        specs.append(ServiceSpec(f"rollout-{i}", "services.rollout", rollout_argv(cfg), ("rollout",),
                                 num_gpus=cfg.vllm_tensor_parallel_size))
    n_reward = role_instances(cfg, "reward")
    n_ref = role_instances(cfg, "ref") if cfg.ref_needed else 0
    # On CPU (and when everything shares GPUs) one process serves both roles: one model load less.
    merge = not cfg.on_gpu or cfg.colocate_all_models
    n_merged = min(n_reward, n_ref) if merge else 0
    for i in range(n_merged):
        specs.append(ServiceSpec(f"reward-ref-{i}", "services.reward", reward_argv(cfg, True, True),
                                 ("reward", "reference"), num_gpus=1))
    for i in range(n_merged, n_reward):
        specs.append(ServiceSpec(f"reward-{i}", "services.reward", reward_argv(cfg, True, False), ("reward",),
                                 num_gpus=1))
    for i in range(n_merged, n_ref):
        specs.append(ServiceSpec(f"ref-{i}", "services.reward", reward_argv(cfg, False, True), ("reference",),
                                 num_gpus=1))
    secure_local_specs(cfg, specs)
    if not cfg.on_gpu:
        for spec in specs:
            spec.num_gpus = 0
        return specs
    assign_local_gpus(cfg, specs)
    return specs


def secure_local_specs(cfg: CoordinatorConfig, specs: list[ServiceSpec]) -> None:
    """Every process serves with the run's TLS settings and token (services.common.security), and
    keeps its gloo traffic on loopback: the learner ranks' process group and the weight-sync group
    otherwise listen on the address the host name resolves to, reachable from other machines."""
    argv, env = launch_settings(cfg, client_credentials())
    for spec in specs:
        spec.argv = [*spec.argv, *argv]
        spec.env.update(env)
        spec.env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def assign_local_gpus(cfg: CoordinatorConfig, specs: list[ServiceSpec]) -> None:
    """GPU ids per process on this machine: colocated roles share the actor's GPUs, others get their own."""
    import torch

    available = torch.cuda.device_count()
    learner = specs[0]
    learner.gpu_ids = list(range(cfg.actor_gpus()))
    next_free = cfg.actor_gpus()
    engines = [s for s in specs if "rollout" in s.roles]
    for i, spec in enumerate(engines):
        tp = cfg.vllm_tensor_parallel_size
        if cfg.colocate_all_models:  # several engines per GPU when there are more than the actor's GPUs
            spec.gpu_ids = [(i * tp + j) % cfg.actor_gpus() for j in range(tp)]
        else:
            spec.gpu_ids = list(range(next_free, next_free + tp))
            next_free += tp
    for i, spec in enumerate(s for s in specs if "reward" in s.roles or "reference" in s.roles):
        shares_actor = cfg.colocate_all_models or (spec.roles == ("reference",) and cfg.colocate_actor_ref)
        if shares_actor:
            spec.gpu_ids = [i % cfg.actor_gpus()]
        else:
            spec.gpu_ids = [next_free]
            next_free += 1
    needed = max(max(s.gpu_ids, default=-1) for s in specs) + 1
    if needed > available:
        raise RuntimeError(f"this placement needs {needed} GPUs on this machine but {available} are visible; lower "
                           "the *_num_gpus_per_node / --vllm_num_engines flags, use --colocate_all_models, or "
                           "--placement ray for several machines")
    for spec in specs:
        spec.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpu_ids))


def scaled_spec(cfg: CoordinatorConfig, role: str, taken: list[str]) -> ServiceSpec:
    """The spec of one more instance of `role` (rollout or reward), named after the first free index.
    A reward instance also serves the reference model where the run's first ones do (merged on CPU)."""
    def free(prefix: str) -> str:
        i = 0
        while f"{prefix}-{i}" in taken:
            i += 1
        return f"{prefix}-{i}"

    if role == "rollout":
        return ServiceSpec(free("rollout"), "services.rollout", rollout_argv(cfg), ("rollout",),
                           num_gpus=cfg.vllm_tensor_parallel_size if cfg.on_gpu else 0)
    if role != "reward":
        raise ValueError(f"role {role!r}: only rollout and reward instances scale; use rollout or reward")
    merged = cfg.ref_needed and (not cfg.on_gpu or cfg.colocate_all_models)
    if merged:
        return ServiceSpec(free("reward-ref"), "services.reward", reward_argv(cfg, True, True), ("reward", "reference"),
                           num_gpus=1 if cfg.on_gpu else 0)
    return ServiceSpec(free("reward"), "services.reward", reward_argv(cfg, True, False), ("reward",),
                       num_gpus=1 if cfg.on_gpu else 0)


def start_waves(cfg: CoordinatorConfig, items: list, spec_of=lambda item: item) -> list[list]:
    """`items` (specs, or what holds one) in the groups that start together, one group after another.

    vLLM sizes its KV cache from the memory the GPU has left while it profiles, so rollout engines
    that share a GPU (several engines per GPU, --colocate_all_models) must not start at once: seen on
    an H200, the second of two engines starting together counted the first's allocation as its own
    and found -0.47 GiB for its cache. The first engine of each GPU starts with every other service;
    each further round of engines starts once the round before it serves.
    """
    per_round = cfg.actor_gpus() // cfg.vllm_tensor_parallel_size if cfg.actor_gpus() else 1
    if not (cfg.on_gpu and cfg.engines_per_gpu() > 1 and per_round > 0):
        return [list(items)]
    waves: list[list] = [[]]
    engine = 0
    for item in items:
        if "rollout" in spec_of(item).roles:
            wave = engine // per_round
            engine += 1
            while len(waves) <= wave:
                waves.append([])
            waves[wave].append(item)
        else:
            waves[0].append(item)
    return [wave for wave in waves if wave]


def endpoints_from(specs: list[ServiceSpec], addresses: list[str]) -> Endpoints:
    by_role = lambda role: [a for s, a in zip(specs, addresses) if role in s.roles]  # noqa: E731
    return Endpoints(rollout=by_role("rollout"), reward=by_role("reward"), reference=by_role("reference"),
                     learner=by_role("learner")[0])


# ----------------------------------------------------------------------------------------------
# local


class LocalPlacement:
    """Starts every service as a subprocess on free loopback ports; stops them all on exit."""

    name = "local"

    def __init__(self, cfg: CoordinatorConfig, run_dir: pathlib.Path, total_steps: int):
        self.cfg, self.run_dir, self.total_steps = cfg, run_dir, total_steps
        self.processes: list[ServiceProcess] = []
        self.specs: list[ServiceSpec] = []  # in the order of `processes`

    def _spawn(self, spec: ServiceSpec) -> ServiceProcess:
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"} if not self.cfg.on_gpu else {}
        return spawn_service(spec.name, spec.module, spec.argv, self.run_dir / "logs", "127.0.0.1",
                             env={**env, **spec.env})

    async def start(self) -> Endpoints:
        specs = service_specs(self.cfg, self.total_steps)
        started: dict[str, ServiceProcess] = {}
        for wave in start_waves(self.cfg, specs):
            processes = [self._spawn(spec) for spec in wave]
            for spec, process in zip(wave, processes):
                started[spec.name] = process
            # Kept in the specs' order whatever the waves: the supervisor finds each by its name.
            self.specs = [s for s in specs if s.name in started]
            self.processes = [started[s.name] for s in self.specs]
            # A wave loads its models in parallel; the first that fails stops the wait.
            waits = [asyncio.ensure_future(wait_until_ready(p, self.cfg.service_start_timeout_s)) for p in processes]
            try:
                await asyncio.gather(*waits)
            except BaseException:
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
                raise
        return endpoints_from(specs, [p.address for p in self.processes])

    async def weight_sync_master(self, endpoints: Endpoints) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    # ---- supervision (services/coordinator/fleet/supervisor.py) ----
    def instances(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(name, roles, address) of every service process."""
        return [(s.name, s.roles, p.address) for s, p in zip(self.specs, self.processes)]

    def _process(self, name: str) -> ServiceProcess:
        return next(p for p in self.processes if p.name == name)

    async def check(self, name: str) -> str | None:
        """None while the process runs; else how it ended ("exit code -9")."""
        code = self._process(name).process.poll()
        return None if code is None else f"exit code {code}"

    def log_tail(self, name: str) -> str:
        process = self._process(name)
        return f"last lines of {process.log_path}:\n{log_tail(process.log_path)}"

    async def restart(self, name: str) -> str:
        """Kills what is left of the instance (its whole process group), starts it again with the
        same command line and returns its new address once it serves."""
        i = next(k for k, p in enumerate(self.processes) if p.name == name)
        await asyncio.to_thread(self.processes[i].stop, 5.0)
        self.processes[i] = self._spawn(self.specs[i])
        await wait_until_ready(self.processes[i], self.cfg.service_start_timeout_s)
        return self.processes[i].address

    # ---- scaling while running (services/coordinator/fleet/scaling.py) ----
    async def add(self, role: str) -> tuple[str, tuple[str, ...], str]:
        """Starts one more rollout or reward instance like the run's first ones; (name, roles, address)."""
        spec = scaled_spec(self.cfg, role, [s.name for s in self.specs])
        if self.cfg.on_gpu:
            raise RuntimeError("scaling the local placement on GPUs is not supported (this machine's GPUs are "
                               "assigned at start); use --placement ray, or start the run with more instances")
        secure_local_specs(self.cfg, [spec])
        process = self._spawn(spec)
        try:
            await wait_until_ready(process, self.cfg.service_start_timeout_s)
        except BaseException:
            await asyncio.to_thread(process.stop, 5.0)
            raise
        self.specs.append(spec)
        self.processes.append(process)
        return spec.name, spec.roles, process.address

    async def remove(self, name: str) -> None:
        """Stops the instance (SIGTERM: it drains what it still runs) and forgets it."""
        i = next(k for k, p in enumerate(self.processes) if p.name == name)
        process = self.processes.pop(i)
        self.specs.pop(i)
        code = await asyncio.to_thread(process.stop, 30.0)
        log_event(_log, "service.stopped", service=name, pid=process.pid, code=code)

    async def stop(self) -> None:
        await asyncio.to_thread(stop_all, self.processes, 30.0)


# ----------------------------------------------------------------------------------------------
# static


async def serves(address: str, service: str, timeout_s: float = 5.0) -> bool:
    """Whether the server at address reports `service` SERVING (grpc.health.v1 per service)."""
    return (await _health(address, service, timeout_s))[0] is True


async def _health(address: str, service: str, timeout_s: float) -> tuple[bool | None, str]:
    """(True: SERVING | False: the server has no such service | None: not known now, why)."""
    try:
        async with make_channel(address, default_timeout_s=timeout_s) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False, f"{address} has no {service}"
        return None, f"{address}: {exc.code().name}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001 - e.g. a bad address: reported by the caller
        return None, f"{address}: {type(exc).__name__}: {exc}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return True, ""
    return None, f"{address} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)} for {service}"


async def serves_service(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """Whether the server at address has `service`: asks again while the answer is unknown (the
    server busy, a lost connection) until timeout_s; (answer, why not)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        answer, why = await _health(address, service, min(5.0, max(deadline - loop.time(), 0.5)))
        if answer is not None or loop.time() >= deadline:
            return bool(answer), why
        await asyncio.sleep(0.5)


DEFAULT_WEIGHT_SYNC_PORT = 29600  # static placement, learner on another host: the rendezvous port


def instance_addresses(addresses: list[str]) -> list[str]:
    """host:port of every instance behind `addresses`: a name that resolves to several IP addresses
    (all A/AAAA records: `docker compose up --scale rollout=2`, a Kubernetes headless Service)
    stands for one instance per address. IPv4 addresses are used when there are any (a dual-stack
    host has an IPv4 and an IPv6 address: one instance, not two). A name with one address, an IP,
    or a name that does not resolve stays as given (waiting for it reports what is wrong). With TLS,
    each such instance's certificate is checked against the name it was found behind."""
    found: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        ips: list[str] = []
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                infos = socket.getaddrinfo(host.strip("[]"), int(port), family=family, type=socket.SOCK_STREAM)
            except (OSError, ValueError):
                continue
            ips = sorted({info[4][0] for info in infos})
            if ips:
                break
        if len(ips) < 2:
            found.append(address)
            continue
        for ip in ips:
            found.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
            verify_tls_as(found[-1], host.strip("[]"))  # their certificates name the service
    return list(dict.fromkeys(found))


class StaticPlacement:
    """Services started elsewhere (docker compose, Kubernetes, by hand): wait until they serve."""

    name = "static"

    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        self.reference: list[str] = []
        self.named: list[tuple[str, tuple[str, ...], str]] = []  # instances(), fixed at the first call

    async def start(self) -> Endpoints:
        cfg = self.cfg
        flags = {cfg.learner_address: "--learner_address"}  # address -> the flag that gave it
        for flag, given in (("--ref_addresses", cfg.ref_addresses), ("--reward_addresses", cfg.reward_addresses),
                            ("--rollout_addresses", cfg.rollout_addresses)):
            flags.update({a: flag for a in given})
        addresses = [*cfg.rollout_addresses, *cfg.reward_addresses, *cfg.ref_addresses, cfg.learner_address]
        await self._wait_given([(flags[a], a) for a in dict.fromkeys(addresses)])
        # A name may stand for several instances (compose --scale, a Kubernetes headless Service).
        cfg.rollout_addresses = await asyncio.to_thread(instance_addresses, cfg.rollout_addresses)
        cfg.reward_addresses = await asyncio.to_thread(instance_addresses, cfg.reward_addresses)
        cfg.ref_addresses = await asyncio.to_thread(instance_addresses, cfg.ref_addresses)
        found = [a for a in (*cfg.rollout_addresses, *cfg.reward_addresses, *cfg.ref_addresses) if a not in addresses]
        await asyncio.gather(*(wait_for_serving(a, cfg.service_start_timeout_s) for a in dict.fromkeys(found)))
        if not cfg.reward_addresses:
            raise RuntimeError("--placement static needs --reward_addresses (or env RLMESH_REWARD_ADDRESSES)")
        reference = list(cfg.ref_addresses)
        if cfg.ref_needed and not reference:
            # A reward service started with --ref_pretrain serves both roles.
            answers = await asyncio.gather(*(serves_service(a, REFERENCE_SERVICE, 60.0) for a in cfg.reward_addresses))
            reference = [a for a, (ok, _) in zip(cfg.reward_addresses, answers) if ok]
            if not reference:
                raise RuntimeError("--init_kl_coef > 0 needs a reference service: give --ref_addresses, start a "
                                   "reward service with --ref_pretrain, or set --init_kl_coef 0 ("
                                   + "; ".join(why for _, why in answers) + ")")
        self.reference = reference
        log_event(_log, "static.ready", rollout=",".join(cfg.rollout_addresses), learner=cfg.learner_address)
        return Endpoints(list(cfg.rollout_addresses), list(cfg.reward_addresses), reference, cfg.learner_address)

    async def _wait_given(self, given: list[tuple[str, str]]) -> None:
        """Waits for the services at the (flag, address) pairs the user gave; one error names every
        address where none answered, with its flag."""
        answers = await asyncio.gather(*(wait_for_serving(a, self.cfg.service_start_timeout_s) for _, a in given),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, ServiceUnreachable):
                raise answer
        missing = [f"{flag}: {answer}" for (flag, _), answer in zip(given, answers) if answer is not None]
        if missing:
            raise ServiceUnreachable("; ".join(missing) + " (the wait is --service_start_timeout_s)")

    async def weight_sync_master(self, endpoints: Endpoints) -> tuple[str, int] | None:
        if self.cfg.weight_sync_master:
            host, _, port = self.cfg.weight_sync_master.rpartition(":")
            return host, int(port)
        # A free port can only be picked here when the learner runs on this machine.
        host = endpoints.learner.rpartition(":")[0]
        if host in ("127.0.0.1", "localhost"):
            return "127.0.0.1", free_port()
        if host in (socket.gethostname(), socket.gethostbyname(socket.gethostname())):
            return host, free_port(host)
        # Elsewhere no free port can be picked from here: a fixed, documented one, which firewalls
        # and network policies can open (the learner's container or pod has its own ports).
        return host, DEFAULT_WEIGHT_SYNC_PORT

    # ---- supervision: the deployment (compose, Kubernetes) restarts; this only waits ----
    def instances(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(name, roles, address) of every instance; names stay with their address while scaling."""
        if not self.named:
            cfg = self.cfg
            self.named += [(f"rollout-{i}", ("rollout",), a) for i, a in enumerate(cfg.rollout_addresses)]
            reference = set(self.reference)
            self.named += [(f"reward-{i}", ("reward", "reference") if a in reference else ("reward",), a)
                           for i, a in enumerate(cfg.reward_addresses)]
            self.named += [(f"ref-{i}", ("reference",), a) for i, a in enumerate(self.reference)
                           if a not in cfg.reward_addresses]
            self.named.append(("learner", ("learner",), cfg.learner_address))
        return list(self.named)

    async def check(self, name: str) -> str | None:
        address = dict((n, a) for n, _, a in self.instances())[name]
        # Twice, a second apart: one lost health check on a busy machine is not a death.
        for attempt in range(2):
            if await serves(address, "", timeout_s=5.0):
                return None
            if attempt == 0:
                await asyncio.sleep(1.0)
        return f"{address} stopped answering health checks"

    def log_tail(self, name: str) -> str:
        return "its log is wherever the deployment keeps it (kubectl logs, docker logs)"

    async def restart(self, name: str) -> str:
        address = dict((n, a) for n, _, a in self.instances())[name]
        await wait_for_serving(address, self.cfg.service_start_timeout_s)
        return address

    async def add_address(self, role: str, address: str) -> tuple[str, tuple[str, ...], str]:
        """An instance the deployment started: once it serves, it joins the run's instances."""
        cfg = self.cfg
        if role not in ("rollout", "reward"):
            raise ValueError(f"role {role!r}: only rollout and reward instances scale; use rollout or reward")
        listed = cfg.rollout_addresses if role == "rollout" else cfg.reward_addresses
        if address in listed:
            raise ValueError(f"{address} is already a {role} instance of this run")
        await wait_for_serving(address, min(cfg.service_start_timeout_s, 60.0))
        roles = (role,)
        if role == "reward" and self.reference and (await serves_service(address, REFERENCE_SERVICE, 60.0))[0]:
            roles = ("reward", "reference")
            self.reference.append(address)
        listed.append(address)
        taken = {n for n, _, _ in self.instances()}
        name = next(f"{role}-{i}" for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        self.named.append((name, roles, address))
        return name, roles, address

    async def remove(self, name: str) -> None:
        """Forgets the instance (the deployment keeps it running)."""
        address = dict((n, a) for n, _, a in self.instances())[name]
        self.named = [entry for entry in self.named if entry[0] != name]
        for listed in (self.cfg.rollout_addresses, self.cfg.reward_addresses, self.reference):
            if address in listed:
                listed.remove(address)

    async def stop(self) -> None:
        """Services started elsewhere keep running."""
