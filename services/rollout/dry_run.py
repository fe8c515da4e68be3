"""--dry_run of the rollout service: what `python -m services.rollout` / `rlmesh serve rollout` would
start, checked without loading the model (services/common/service_plan.py).

Checked as a start would meet them: the model folder (config.json, validated by the config), its
tokenizer (loaded: it is small), the engine's package (vLLM) and, on a GPU, that the tensor-parallel
GPUs exist. Printed: the model and its size, the engine with its device, dtype and compile choice
(services/rollout/cpu_defaults.py), a rough memory estimate of the weights per GPU, where it would serve.
"""

from __future__ import annotations

import importlib.util

import torch

from services.common.config import ConfigError
from services.common.memory_estimate import gib, weights_bytes
from services.common.service_plan import checked_model_folder, print_service_plan
from services.rollout import cpu_defaults
from services.rollout.config import RolloutConfig


def _device(config: RolloutConfig) -> str:
    """cuda or cpu, as the engine picks it (vLLM: its build's; hf: --hf_device, auto = cuda if present)."""
    wanted = config.hf_device if config.engine == "hf" else "auto"
    return ("cuda" if torch.cuda.is_available() else "cpu") if wanted == "auto" else wanted


def plan_lines(config: RolloutConfig) -> list[str]:
    """The plan's lines; ConfigError for what the start would fail on."""
    if config.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--engine vllm: vLLM is not installed in this environment; install it (the CPU build: "
                          "bash scripts/setup.sh; on GPUs: pip install 'rlmesh[gpu]'), or serve with --engine hf")
    device = _device(config)
    if device == "cuda" and config.tensor_parallel_size > torch.cuda.device_count():
        raise ConfigError(f"--tensor_parallel_size {config.tensor_parallel_size} needs that many GPUs; this machine "
                          f"has {torch.cuda.device_count()}")
    params = checked_model_folder("--pretrain", config.pretrain, trust_remote_code=config.trust_remote_code)
    dtype, why = cpu_defaults.engine_dtype(config.dtype, device == "cpu", cpu_defaults.read_cpu_flags())
    eager = cpu_defaults.engine_enforce_eager(config.enforce_eager, device == "cpu")
    on = (f"{config.tensor_parallel_size} GPU(s), tensor parallel" if device == "cuda" else device.upper())
    half = dtype in ("bfloat16", "float16") or (dtype == "auto" and device == "cuda")
    cache = (f"KV cache: {config.gpu_memory_utilization} of each GPU's memory" if device == "cuda" else
             "KV cache in host memory (VLLM_CPU_KVCACHE_SPACE GiB if set, else --gpu_memory_utilization "
             f"{config.gpu_memory_utilization} of it)" if config.engine == "vllm" else "no KV cache reserved")
    return [f"model    {config.pretrain} ({params:,} parameters)"
            + (f", served as {config.served_model_name}" if config.served_model_name else "")
            + (", LoRA adapter pushes taken" if config.enable_lora else ""),
            f"engine   {config.engine} on {on}; dtype {dtype} ({why}); "
            + ("eager" if eager else "compiled") + (f"; max_model_len {config.max_model_len}"
                                                     if config.max_model_len else ""),
            f"memory   per {'GPU' if device == 'cuda' else 'process'} "
            f"{gib(weights_bytes(params, half, config.tensor_parallel_size))} of "
            f"weights{' (dtype auto: counted as 16-bit)' if dtype == 'auto' else ''}; {cache}"]


def print_plan(config: RolloutConfig, out=None) -> int:
    return print_service_plan("rollout", config, plan_lines(config), out)
