"""DeepSpeed engines from a typed config: ZeRO stage, precision, offload, schedule, batch sizes.

The learner service builds its actor and critic with it, and the offline trainers
(`deepspeed --module services.learner.train_sft` and friends) reuse it, so one set of flags means
the same thing everywhere:

    options = DeepSpeedOptions(zero_stage=3, bf16=True, train_batch_size=128, micro_train_batch_size=4)
    config = deepspeed_config(options, world_size)
    model, keep = load_pretrained(path, options, config, kind="causal_lm")  # ZeRO-3: loads into partitions
    engine = build_engine(model, options, config, learning_rate=1e-6)

Batch sizes mean what OpenRLHF users expect: train_batch_size is the number of samples per
optimizer step over all ranks; micro_train_batch_size the samples of one forward/backward pass on
one rank; gradient accumulation makes up the rest (train_batch_size / (micro x ranks) passes).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.util
import math
import os
import sys
import warnings
from typing import Literal

import torch

from services.common import flags
from services.common.config import ConfigError, check_fields, opt
from services.common.flags import LR_SCHEDULERS, no_gpu_attention
from services.common.deepspeed_file import apply_flags, check_batches, merge, read_deepspeed_file
from services.common.lora_check import check_lora
from services.learner.lora import LoraOptions, apply_lora

def _own_extension_folder() -> None:
    """On the CPU, DeepSpeed's collectives compile a C++ op (deepspeed_shm_comm) at every start, a
    no-op while torch's extension cache holds it, a minute or more on a small machine when not. That
    cache is one folder per op name, and the build command names the install's paths: two installs on
    one machine (two virtual environments, a checkout and a clone) rebuild it in turn, each start.
    A folder per install (and Python, torch, compiler settings) keeps each build; TORCH_EXTENSIONS_DIR,
    when set, is the user's choice and stays (one of these folders, inherited from a parent process
    of another install, is chosen again)."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen and not os.path.basename(chosen.rstrip(os.sep)).startswith("rlmesh-"):
        return
    spec = importlib.util.find_spec("deepspeed")
    build = [sys.executable, sys.prefix, spec.origin if spec else "", torch.__file__, torch.__version__,
             *(os.environ.get(name, "") for name in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS"))]
    key = hashlib.sha256("\0".join(build).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(cache, "torch_extensions", f"rlmesh-{key}")


# DeepSpeed picks its accelerator when it is first imported; on a machine without CUDA it must be
# the CPU one (gloo collectives, torch Adam).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _own_extension_folder()

import deepspeed  # noqa: E402

if not torch.cuda.is_available():
    # DeepSpeed's CPU collectives compile a shared-memory C++ op at the first init_distributed (one to
    # two minutes on a small machine, at a fresh install's first learner start). Only its inference
    # all-reduce (tensor-parallel inference kernels) uses it; training's collectives go through gloo.
    # (deepspeed.comm.torch as an attribute is the torch package, which deepspeed.comm re-exports.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

# torch.distributed warns on every call DeepSpeed makes with its older collective names.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+`? is deprecated.*", category=FutureWarning)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "varlen")
ModelKind = Literal["causal_lm", "critic"]


@dataclasses.dataclass
class DeepSpeedOptions:
    """DeepSpeed and optimizer settings shared by every trainer."""

    zero_stage: int = flags.ZERO_STAGE.field(2)
    bf16: bool = flags.BF16.field(False)
    gradient_checkpointing: bool = flags.GRADIENT_CHECKPOINTING.field(False)
    adam_offload: bool = flags.ADAM_OFFLOAD.field(False)
    max_norm: float = flags.MAX_NORM.field(1.0)
    micro_train_batch_size: int = flags.MICRO_TRAIN_BATCH_SIZE.field(1)
    train_batch_size: int = flags.TRAIN_BATCH_SIZE.field(128)
    lr_scheduler: str = flags.LR_SCHEDULER.field("constant_with_warmup")
    lr_warmup_ratio: float = flags.LR_WARMUP_RATIO.field(0.03)
    min_lr_ratio: float = opt(0.1, "cosine_with_min_lr: final learning rate as a fraction of the peak")
    max_steps: int = opt(0, "optimizer steps of the whole run, for the schedule (the coordinator computes it); "
                         "required by cosine_with_min_lr; 0 = unknown")
    adam_betas: list[float] = flags.ADAM_BETAS.field([0.9, 0.95])
    l2: float = flags.L2.field(0.0)
    attn_implementation: str = opt("sdpa", "attention kernel of the transformers model; varlen: PyTorch's "
                                   "FlashAttention for variable-length sequences (CUDA; per-sequence sdpa "
                                   "elsewhere), the fast choice with --packing_samples; flash_attention_2 "
                                   "without the flash-attn package installed means varlen",
                                   choices=list(ATTN_IMPLEMENTATIONS))
    use_liger_kernel: bool = flags.USE_LIGER_KERNEL.field(False)
    packing_samples: bool = flags.PACKING_SAMPLES.field(False)
    seed: int = opt(42, "seed of model initialisation where weights are new (e.g. the critic's value head)")
    deepspeed: str = flags.DEEPSPEED_FILE.field("")
    lora_rank: int = flags.LORA_RANK.field(0)
    lora_alpha: float = flags.LORA_ALPHA.field(16.0)
    target_modules: list[str] = flags.TARGET_MODULES.field(["all-linear"])
    lora_dropout: float = flags.LORA_DROPOUT.field(0.0)
    lora_merge_on_save: bool = flags.LORA_MERGE_ON_SAVE.field(False)

    @property
    def lora(self) -> LoraOptions | None:
        """The adapter of the trained model (the RL actor), or None without --lora_rank."""
        if self.lora_rank <= 0:
            return None
        return LoraOptions(self.lora_rank, self.lora_alpha, tuple(self.target_modules), self.lora_dropout)

    def validate_lora(self, pretrain: str) -> None:
        """The LoRA flags together and against the model at `pretrain` (its config only)."""
        check_lora(self.lora_rank, self.lora_alpha, self.target_modules, self.lora_dropout, pretrain)
        if self.lora_merge_on_save and not self.lora_rank:
            raise ConfigError("--lora_merge_on_save merges a LoRA adapter into the saved model, but --lora_rank is 0; "
                              "give --lora_rank N, or drop --lora_merge_on_save")

    def apply_deepspeed_file(self) -> None:
        """--deepspeed FILE: the settings it decides replace the flags' values (idempotent)."""
        if self.deepspeed:
            apply_flags(self, read_deepspeed_file(self.deepspeed))

    def validate_deepspeed(self, world_size: int | None = None) -> None:
        self.apply_deepspeed_file()
        check_fields(self)  # the shared flags' checks (services/common/flags.py), the file's values too
        if self.micro_train_batch_size < 1:
            raise ConfigError(f"--micro_train_batch_size {self.micro_train_batch_size} must be >= 1")
        if self.train_batch_size < 1:
            raise ConfigError(f"--train_batch_size {self.train_batch_size} must be >= 1")
        if world_size is not None and self.train_batch_size % (self.micro_train_batch_size * world_size):
            raise ConfigError(
                f"--train_batch_size {self.train_batch_size} is not a multiple of --micro_train_batch_size "
                f"{self.micro_train_batch_size} x {world_size} ranks; pick a train_batch_size divisible by "
                f"{self.micro_train_batch_size * world_size}")
        if self.adam_offload and self.zero_stage == 0:
            raise ConfigError("--adam_offload needs --zero_stage 1, 2 or 3")
        if self.max_norm < 0:
            raise ConfigError(f"--max_norm {self.max_norm} must be >= 0 (0 disables clipping)")
        if not 0 <= self.lr_warmup_ratio < 1:
            raise ConfigError(f"--lr_warmup_ratio {self.lr_warmup_ratio} must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min_lr_ratio {self.min_lr_ratio} must be in [0, 1]")
        if self.lr_scheduler == "cosine_with_min_lr" and self.max_steps < 1:
            raise ConfigError("--lr_scheduler cosine_with_min_lr needs --max_steps (optimizer steps of the run), "
                              "or use --lr_scheduler constant_with_warmup")
        if self.deepspeed:
            check_batches(read_deepspeed_file(self.deepspeed), self.train_batch_size, self.micro_train_batch_size,
                          self.gradient_accumulation_steps(world_size) if world_size else None)
        self.attention_for_this_machine()
        if self.use_liger_kernel:
            if not torch.cuda.is_available():
                raise ConfigError("--use_liger_kernel needs a CUDA GPU (the kernels are Triton); drop the flag on CPU")
            if importlib.util.find_spec("liger_kernel") is None:
                raise ConfigError("--use_liger_kernel: the liger-kernel package is not installed; "
                                  "pip install liger-kernel, or drop the flag")

    def attention_for_this_machine(self) -> None:
        """flash_attention_2 without a CUDA GPU: a warning, and sdpa (idempotent)."""
        if self.attn_implementation == "flash_attention_2" and not torch.cuda.is_available():
            warnings.warn(no_gpu_attention("--attn_implementation flash_attention_2"), stacklevel=3)
            self.attn_implementation = "sdpa"

    def gradient_accumulation_steps(self, world_size: int) -> int:
        return self.train_batch_size // (self.micro_train_batch_size * world_size)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.lr_warmup_ratio * self.max_steps)


# ----------------------------------------------------------------------------------------------
# Learning-rate schedule


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Factor of the peak learning rate at optimizer step `step` (0-based).

    Linear warm-up over warmup_steps (step 0 gets 1 / warmup_steps, the last warm-up step 1), then
    constant, or a cosine from 1 down to min_lr_ratio at total_steps (held there afterwards).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant_with_warmup":
        return 1.0
    if schedule == "cosine_with_min_lr":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule must be one of {LR_SCHEDULERS}, got {schedule!r}")


class LRSchedule:
    """lr_multiplier with its settings bound; a picklable callable for torch's LambdaLR."""

    def __init__(self, options: DeepSpeedOptions):
        self.warmup_steps = options.warmup_steps
        self.total_steps = options.max_steps
        self.schedule = options.lr_scheduler
        self.min_lr_ratio = options.min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.warmup_steps, self.total_steps, self.schedule, self.min_lr_ratio)


# ----------------------------------------------------------------------------------------------
# DeepSpeed config


def deepspeed_config(options: DeepSpeedOptions, world_size: int) -> dict:
    """The DeepSpeed config dict for training with `options` on `world_size` data-parallel ranks."""
    options.validate_deepspeed(world_size)
    zero: dict = {
        "stage": options.zero_stage,
        # Also with one rank: the reduction's per-parameter copies then run on a stream of their own,
        # beside the backward's kernels (turned off there, job A's train phase was not faster: an
        # H200 A/B on docs/benchmarks/2026-12-03-logprobs-call.md).
        "overlap_comm": torch.cuda.is_available(),
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
        # ZeRO-3: small parameters (norms, biases) stay whole on every rank; gathering them one
        # by one would cost more than it saves.
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_prefetch_bucket_size": 5e8,
    }
    if options.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": options.train_batch_size,
        "train_micro_batch_size_per_gpu": options.micro_train_batch_size,
        "gradient_accumulation_steps": options.gradient_accumulation_steps(world_size),
        "gradient_clipping": options.max_norm,
        "zero_optimization": zero,
        # A step whose gradient norm is not finite is skipped (and counted in skipped_steps).
        "bf16": {"enabled": options.bf16, "check_grad_overflow": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_allow_untested_optimizer": True,
        # The client's torch optimizer is used as is, also with offload (DeepSpeedCPUAdam then).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if options.deepspeed:
        # The user's own settings (bucket sizes, stage-3 tuning, parameter offload, ...) win.
        config = merge(config, read_deepspeed_file(options.deepspeed).extra)
    return config


# ----------------------------------------------------------------------------------------------
# Models


def load_pretrained(path: str, options: DeepSpeedOptions, ds_config: dict, kind: ModelKind = "causal_lm",
                    adapter: LoraOptions | None = None):
    """Loads a Hugging Face model for training; returns (model, keepalive).

    kind "causal_lm": AutoModelForCausalLM. kind "critic": the same backbone with a scalar value
    per token (AutoModelForTokenClassification, one label, no dropout, no bias); its head `score`
    is taken from the checkpoint when it has one (a reward model saved as sequence
    classification), otherwise initialised from options.seed.
    Under ZeRO-3 the weights are loaded straight into their partitions: `keepalive` (the
    transformers view of the DeepSpeed config) must stay referenced until the engine is built.
    With `adapter` the model is a PEFT model in which only the LoRA adapter (and a critic's head)
    trains (services.learner.lora).
    """
    import transformers

    keepalive = None
    if options.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keepalive = HfDeepSpeedConfig(ds_config)
    common = {"dtype": options.dtype, "attn_implementation": resolve_attn_implementation(options.attn_implementation)}
    if kind == "causal_lm":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **common)
    elif kind == "critic":
        config = transformers.AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        config.token_classification_bias = False
        torch.manual_seed(options.seed)
        model = transformers.AutoModelForTokenClassification.from_pretrained(path, config=config, **common)
    else:
        raise ValueError(f"kind must be 'causal_lm' or 'critic', got {kind!r}")
    model.config.use_cache = False
    if options.use_liger_kernel:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        # The losses read the hidden states or logits themselves: no fused cross-entropy.
        _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                        cross_entropy=False, fused_linear_cross_entropy=False)
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter is not None:
        # The same adapter initialisation on every rank: under ZeRO-3 each rank keeps its own part.
        torch.manual_seed(options.seed)
        model = apply_lora(model, adapter, kind)
    return model, keepalive


def resolve_attn_implementation(name: str) -> str:
    """The attn_implementation to give transformers: `varlen` is registered with it first, and
    flash_attention_2 without the flash-attn package becomes varlen (the same FlashAttention
    kernel, shipped with PyTorch)."""
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        warnings.warn("flash-attn is not installed: using PyTorch's FlashAttention (--attn_implementation varlen)",
                      stacklevel=2)
        name = "varlen"
    if name == "varlen":
        from services.learner.varlen_attention import register

        register()
    return name


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are not decayed. Under ZeRO-3 a
    parameter is an empty placeholder of its partition; ds_shape is its real shape."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class FiniteStepAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose gradients are not all finite, and says so in `overflow`.

    DeepSpeed's ZeRO and bf16 optimizers already skip such steps; the plain fp32 ZeRO-0 path does
    not, so this covers it (DeepSpeed reads `overflow` to count skipped steps and hold the LR
    schedule). At ZeRO-0 every rank holds the same all-reduced gradients, so all ranks agree.
    """

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        if self.overflow:
            return None
        return super().step(closure)


def make_optimizer(model: torch.nn.Module, options: DeepSpeedOptions, learning_rate: float):
    """AdamW: DeepSpeedCPUAdam with offload, torch's fused kernel on CUDA, torch's own on CPU."""
    groups = optimizer_param_groups(model, options.l2)
    betas = tuple(options.adam_betas)
    if options.adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=learning_rate, betas=betas, adamw_mode=True)
    cls = FiniteStepAdamW if (options.zero_stage == 0 and not options.bf16) else torch.optim.AdamW
    return cls(groups, lr=learning_rate, betas=betas, fused=torch.cuda.is_available())


def _load_muon_uncompiled() -> None:
    """deepspeed.initialize's ZeRO check imports DeepSpeed's Muon optimizer (to count it among the
    optimizers ZeRO supports), whose module wraps its kernels in torch.compile as it loads: that
    brings torch's compiler (dynamo, inductor, functorch) into every rank, ~1.2 s of CPU per start.
    rlmesh trains with AdamW (Muon is refused: services/common/openrlhf_names.py) and never calls
    them, so the module is loaded first with torch.compile a no-op (TORCHDYNAMO_DISABLE)."""
    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # a DeepSpeed without Muon: its check does without it too
    finally:
        if before is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def build_engine(model: torch.nn.Module, options: DeepSpeedOptions, ds_config: dict, learning_rate: float):
    """deepspeed.initialize with AdamW and the LR schedule; returns the DeepSpeedEngine."""
    _load_muon_uncompiled()
    optimizer = make_optimizer(model, options, learning_rate)
    schedule = LRSchedule(options)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return engine


def trainable_parameters(engine) -> int:
    """Trainable parameter count of the full (unsharded) model."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)


def current_lr(engine) -> float:
    return float(engine.get_lr()[0])


def init_distributed_from_env(timeout_s: float = 1800.0) -> tuple[int, int]:
    """For scripts started by `deepspeed` / `torchrun`: joins the group from RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; returns (rank, world_size). nccl on CUDA, gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()
