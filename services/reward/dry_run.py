"""--dry_run of the reward service: what `python -m services.reward` / `rlmesh serve reward` would
start, checked without loading a model or starting a worker (services/common/service_plan.py).

Checked as a start would meet them: a reward or reference model folder's weights and tokenizer, a
reward function file's function (read with ast; its OpenRLHF imports were checked by the config),
the device. Remote reward servers are named, not contacted. Printed: the reward source, the
reference model, a rough memory estimate of each model, where it would serve.
"""

from __future__ import annotations

import torch

from services.common.config import ConfigError
from services.common.memory_estimate import gib, weights_bytes
from services.common.python_names import defined_names
from services.common.service_plan import checked_model_folder, print_service_plan
from services.reward.config import RewardConfig
from services.reward.function_worker import FUNCTION_NAMES, split_file_target


def _device(config: RewardConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {config.device}: CUDA is not available here; use --device cpu")
    return config.device


def _model(flag: str, path: str, dtype: str, device: str) -> str:
    params = checked_model_folder(flag, path)
    bf16 = dtype == "bf16" or (dtype == "auto" and device.startswith("cuda"))
    return (f"{path} ({params:,} parameters, {'bfloat16' if bf16 else 'float32'} on {device}: "
            f"{gib(weights_bytes(params, bf16))} of weights)")


def _reward_source(config: RewardConfig, device: str) -> str:
    if config.reward_pretrain:
        return (f"reward model {_model('--reward_pretrain', config.reward_pretrain, config.reward_dtype, device)}, "
                f"{config.reward_micro_batch_size} sequences per pass, scoring the {config.reward_input}")
    if config.remote_kind == "function":
        file, name = split_file_target(config.remote_urls[0])
        wanted = (name,) if name else FUNCTION_NAMES
        found = [n for n in wanted if n in defined_names(file)]
        if not found:
            raise ConfigError(f"--remote_rm_url {config.remote_rm_url}: {file} defines no "
                              f"{' or '.join(wanted)}; name the function as FILE.py:NAME")
        return (f"reward function {found[0]} of {file}, run in up to {config.remote_rm_max_in_flight} worker "
                "processes")
    if config.remote_kind:
        return f"remote reward server(s) {', '.join(config.remote_urls)} ({config.remote_kind}; not contacted)"
    if config.rules:
        return f"rule(s) {', '.join(config.rules)}"
    return "none (the reference model only)"


def plan_lines(config: RewardConfig) -> list[str]:
    device = _device(config)
    reference = (_model("--ref_pretrain", config.ref_pretrain, config.ref_dtype, device) if config.ref_pretrain
                 else "none")
    return [f"rewards  {_reward_source(config, device)}", f"reference {reference}"]


def print_plan(config: RewardConfig, out=None) -> int:
    return print_service_plan("reward", config, plan_lines(config), out)
