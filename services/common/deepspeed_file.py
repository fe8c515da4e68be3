"""`--deepspeed FILE`: a DeepSpeed config the user already has (simpleRL-reason's
`--deepspeed train/recipes/deepspeed_zero3.yaml`), honoured by the learner and the offline trainers.

The file is a DeepSpeed config (JSON or YAML: `zero_optimization`, `bf16`, `gradient_clipping`, ...)
or an Accelerate config whose `deepspeed_config` section holds the same settings in Accelerate's
names (`zero_stage`, `offload_optimizer_device`, `mixed_precision: bf16` beside it) or points at a
DeepSpeed JSON (`deepspeed_config_file`). What it means here:

- settings that rlmesh also has as flags become those flags' values (the file wins): ZeRO stage ->
  --zero_stage, optimizer offload -> --adam_offload, bf16 -> --bf16, gradient_clipping ->
  --max_norm, optimizer betas / weight_decay -> --adam_betas / --l2;
- every other DeepSpeed setting (bucket sizes, stage-3 prefetch and persistence, parameter
  offload, communication dtype, ...) is laid over the config rlmesh builds (`extra`);
- "auto" values (Hugging Face's convention) leave rlmesh's own value in place;
- batch sizes must agree with the flags (the coordinator sizes the steps from them), and an
  explicit learning rate or schedule must be given as flags: a conflict is a ConfigError that says
  which flag to use, never a silent choice.

Pure: reads the file, touches nothing else (the coordinator validates with it before any service
starts; the learner and the offline trainers apply it at their start).
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib

import yaml

from services.common.config import ConfigError

# DeepSpeed keys rlmesh fills from the flags; the file may only repeat them ("auto" or the same value).
BATCH_KEYS = {"train_batch_size": "--train_batch_size", "train_micro_batch_size_per_gpu": "--micro_train_batch_size"}


@dataclasses.dataclass
class DeepSpeedFile:
    """What a --deepspeed file says: flag values it sets, and the rest of its DeepSpeed settings."""

    path: str
    flags: dict  # option name -> value (zero_stage, bf16, adam_offload, max_norm, adam_betas, l2)
    batch: dict  # DeepSpeed batch key -> value, checked against the flags
    extra: dict  # DeepSpeed config laid over rlmesh's (nested dicts merged key by key)


def _drop_auto(value):
    if isinstance(value, dict):
        return {k: _drop_auto(v) for k, v in value.items() if v != "auto"}
    return value


def _from_accelerate(section: dict, top: dict, path: pathlib.Path) -> dict:
    """An Accelerate `deepspeed_config` section -> the DeepSpeed config it stands for."""
    if section.get("deepspeed_config_file"):
        inner = pathlib.Path(section["deepspeed_config_file"])
        inner = inner if inner.is_absolute() else path.parent / inner
        return _read(inner)
    config: dict = {"zero_optimization": {}}
    zero = config["zero_optimization"]
    if "zero_stage" in section:
        zero["stage"] = section["zero_stage"]
    for kind in ("optimizer", "param"):
        device = section.get(f"offload_{kind}_device")
        if device not in (None, "none"):
            zero[f"offload_{kind}"] = {"device": device}
    if "gradient_clipping" in section:
        config["gradient_clipping"] = section["gradient_clipping"]
    if top.get("mixed_precision") in ("bf16", "fp16"):
        config[top["mixed_precision"]] = {"enabled": True}
    return config


def _read(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"--deepspeed {path}: no such file; give a DeepSpeed config (JSON or YAML)")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--deepspeed {path}: not a JSON / YAML file ({exc})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--deepspeed {path}: must be a mapping (a DeepSpeed config)")
    if isinstance(loaded.get("deepspeed_config"), dict):
        return _from_accelerate(loaded["deepspeed_config"], loaded, path)
    return loaded


def read_deepspeed_file(path: str) -> DeepSpeedFile:
    """Parses FILE into flag values and extra settings; ConfigError naming the key and the fix."""
    config = _drop_auto(copy.deepcopy(_read(pathlib.Path(path))))
    flags: dict = {}
    zero = dict(config.pop("zero_optimization", {}) or {})
    if "stage" in zero:
        stage = zero.pop("stage")
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"--deepspeed {path}: zero_optimization.stage {stage!r} must be 0, 1, 2 or 3")
        flags["zero_stage"] = stage
    offload = zero.pop("offload_optimizer", None)
    if offload is not None:
        flags["adam_offload"] = isinstance(offload, dict) and offload.get("device", "none") not in ("none", None)
    if (config.get("fp16") or {}).get("enabled"):
        raise ConfigError(f"--deepspeed {path}: fp16 is not supported (rlmesh trains in bfloat16 or float32); "
                          "set \"bf16\": {\"enabled\": true} in the file or use --bf16")
    config.pop("fp16", None)
    bf16 = config.pop("bf16", None)
    if isinstance(bf16, dict) and "enabled" in bf16:
        flags["bf16"] = bool(bf16["enabled"])
    if "gradient_clipping" in config:
        flags["max_norm"] = float(config.pop("gradient_clipping"))
    optimizer = config.pop("optimizer", None) or {}
    params = optimizer.get("params", {}) or {}
    if "lr" in params:
        raise ConfigError(f"--deepspeed {path}: optimizer.params.lr {params['lr']}: set the learning rate with "
                          "the trainer's flag (--learning_rate; --actor_learning_rate / --critic_learning_rate in "
                          "RL), or write \"lr\": \"auto\"")
    if "betas" in params:
        flags["adam_betas"] = [float(b) for b in params["betas"]]
    if "weight_decay" in params:
        flags["l2"] = float(params["weight_decay"])
    scheduler = config.pop("scheduler", None) or {}
    if scheduler.get("params"):
        raise ConfigError(f"--deepspeed {path}: scheduler {scheduler.get('type', '')} with explicit params: rlmesh "
                          "builds the schedule from --lr_scheduler, --lr_warmup_ratio and --min_lr_ratio; set those "
                          "(or write the params as \"auto\")")
    batch = {key: config.pop(key) for key in list(config) if key in BATCH_KEYS}
    accumulation = config.pop("gradient_accumulation_steps", None)
    if accumulation is not None:
        batch["gradient_accumulation_steps"] = accumulation
    if zero:
        config["zero_optimization"] = zero
    return DeepSpeedFile(path=str(path), flags=flags, batch=batch, extra=config)


def apply_flags(options, ds_file: DeepSpeedFile) -> None:
    """Sets the options the file decides (the file wins over the flags' values)."""
    for name, value in ds_file.flags.items():
        if hasattr(options, name):
            setattr(options, name, value)


def check_batches(ds_file: DeepSpeedFile, train_batch_size: int, micro_train_batch_size: int,
                  accumulation: int | None = None) -> None:
    """The file's batch sizes (if any) must equal the flags'; ConfigError naming both otherwise."""
    given = {"train_batch_size": train_batch_size, "train_micro_batch_size_per_gpu": micro_train_batch_size,
             "gradient_accumulation_steps": accumulation}
    for key, value in ds_file.batch.items():
        if given.get(key) is not None and value != given[key]:
            flag = BATCH_KEYS.get(key, "--train_batch_size / (--micro_train_batch_size x ranks)")
            raise ConfigError(f"--deepspeed {ds_file.path}: {key} {value} differs from {flag} ({given[key]}); "
                              f"rlmesh sizes the steps from the flags: set {flag} {value} or write \"{key}\": "
                              "\"auto\" in the file")


def merge(base: dict, extra: dict) -> dict:
    """base with extra laid over it, nested dicts merged key by key (a new dict)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
