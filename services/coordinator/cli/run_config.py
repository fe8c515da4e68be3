"""Services started elsewhere take their settings from the run's one configuration file.

In local and Ray placement the coordinator builds each service's command line from its own flags
(`placement.rollout_argv` / `reward_argv` / `learner_argv`). Services that a deployment starts
(docker compose, Kubernetes) get the same command lines from the same file:

    rlmesh serve learner --run_config /config/grpo.yaml --host 0.0.0.0 --port 50051 --metrics_port 9103
    rlmesh train --config /config/grpo.yaml --placement static --learner_address learner:50051 ...

`--run_config FILE` is the coordinator's YAML (`rlmesh train --help` names its keys). It expands
into the options the coordinator would pass that service, and the options after it on the
command line win (deployment settings: host, ports, TLS). So the learning rate, batch sizes,
lengths, schedule and reward source are written once, and the coordinator's start-up check
(GetInfo: the learner's --train_batch_size against its own) still guards a mismatched file.
"""

from __future__ import annotations

import os
import pathlib
import warnings

import yaml

from services.common.config import ConfigError, from_mapping
from services.coordinator.config import CoordinatorConfig

# Keys that say where the services are: meaningless to a service, and they would make the
# coordinator's validation expect static placement.
_PLACEMENT_KEYS = ("placement", "rollout_addresses", "reward_addresses", "ref_addresses", "learner_address")
_ADDRESS_ENV = ("RLMESH_ROLLOUT_ADDRESSES", "RLMESH_REWARD_ADDRESSES", "RLMESH_REF_ADDRESSES", "RLMESH_LEARNER_ADDRESS")


def load_run_config(path: str) -> CoordinatorConfig:
    """The coordinator's configuration in FILE, validated as the coordinator validates it on this
    machine (so the device, and what depends on it, is this machine's)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"--run_config {path}: no such file; mount the run's YAML (the file given to "
                          "`rlmesh train --config`) into this container")
    loaded = yaml.safe_load(file.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--run_config {path}: must be a mapping of option: value (the keys of `rlmesh train --help`)")
    values = from_mapping(CoordinatorConfig, {k.replace("-", "_"): v for k, v in loaded.items()}, str(path))
    values = {k: v for k, v in values.items() if k not in _PLACEMENT_KEYS}
    # The addresses in the environment are the coordinator's business, not this service's.
    saved = {name: os.environ.pop(name) for name in _ADDRESS_ENV if name in os.environ}
    try:
        config = CoordinatorConfig(**values, placement="local")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the coordinator reports them; once is enough
            config.validate()
    finally:
        os.environ.update(saved)
    return config


def total_steps_of(config: CoordinatorConfig, num_prompts_steps: int) -> int:
    """Global steps of the run: the data's steps, capped by --max_steps. The learner's learning-rate
    schedule spans them, so the coordinator and a learner started from the file count alike."""
    return min(num_prompts_steps, config.max_steps) if config.max_steps else num_prompts_steps


def run_total_steps(config: CoordinatorConfig) -> int:
    """Reads and tokenizes the prompt data as the coordinator does, to count the run's steps."""
    from transformers import AutoTokenizer

    from services.coordinator.loop.data import build_prompt_stream

    from services.common.datasets import DatasetError

    tokenizer = AutoTokenizer.from_pretrained(config.pretrain)
    try:
        stream = build_prompt_stream(config, tokenizer)
    except DatasetError as exc:
        raise ConfigError(f"--run_config: prompt_data {config.prompt_data}: {exc}") from exc
    return total_steps_of(config, stream.total_steps(config.rollout_batch_size))


def service_argv(service: str, config: CoordinatorConfig) -> list[str]:
    """The options the coordinator would give `service` (rollout, reward, learner) for this run.

    A reward service also serves the reference model's log-probs when the run uses KL
    (--init_kl_coef > 0), as local placement does on CPU: static placement finds it there.
    """
    from services.coordinator.fleet.placement import learner_argv, reward_argv, rollout_argv

    if service == "rollout":
        return rollout_argv(config)
    if service == "reward":
        return reward_argv(config, reward=True, reference=config.ref_needed)
    if service == "learner":
        return learner_argv(config, run_total_steps(config), config.actor_gpus())
    raise ConfigError(f"--run_config applies to rollout, reward and learner, not {service}; the coordinator "
                      "reads the same file with `rlmesh train --config FILE`")


def split_run_config(argv: list[str]) -> tuple[str, list[str]]:
    """('FILE', the other options) from argv holding `--run_config FILE` (or `--run_config=FILE`);
    ('', argv) without it."""
    for i, arg in enumerate(argv):
        if arg == "--run_config":
            if i + 1 >= len(argv):
                raise ConfigError("--run_config needs a FILE (the run's YAML)")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--run_config="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return "", argv


def expand_run_config(service: str, argv: list[str]) -> list[str]:
    """argv with `--run_config FILE` replaced by the options it stands for, placed first so that
    the options given on the command line win (argparse keeps the last value of an option)."""
    path, rest = split_run_config(argv)
    if not path:
        return argv
    config = load_run_config(path)
    if service == "learner":
        # DeepSpeed insists on LOCAL_RANK even for a plainly started rank 0 (local placement sets it too).
        os.environ.setdefault("LOCAL_RANK", "0")
    return service_argv(service, config) + rest
