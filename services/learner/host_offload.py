"""The learner's states to host memory and back between steps (--deepspeed_enable_sleep).

DeepSpeed's `offload_states` copies the ZeRO states into pinned host buffers and `reload_states`
brings them back. Under ZeRO-1/2 it page-locks new host memory at every offload: the optimizer's
states (Adam's two moments, the largest part) get fresh pinned buffers each time, and the reload
drops those of the master and model weights. Page-locking gigabytes is most of an offload's time.
Here every pinned buffer is kept from one offload to the next (the optimizer's states are moved by
this module under ZeRO-1/2; ZeRO-3 keeps its own), the copies are queued without waiting for each,
and the device is synchronized once at the end of each direction.

Adam creates its moments at the first optimizer step, so the offload before step 1 (the coordinator
offloads the learner once its services are up) finds none: it page-locks their buffers ahead, with
the shapes Adam will give them, so that step 1's offload costs what the later ones cost.
"""

from __future__ import annotations

import time

import torch
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

# ZeRO-1/2 optimizer attributes holding the pinned host copies that reload_states deletes.
_PINNED = ("hp_params_pin_buffers", "lp_params_pin_buffers")
# What DeepSpeed moves under ZeRO-1/2 when this module moves the optimizer's states itself.
_ZERO12_STATES = (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads)


def _zero12(engine) -> bool:
    return engine.zero_optimization_stage() in (1, 2)


def offload_engine(engine) -> float:
    """Moves one DeepSpeed engine's states to pinned host memory; returns the seconds it took."""
    t0 = time.monotonic()
    if _zero12(engine):
        engine.offload_states(include=_ZERO12_STATES, pin_memory=True, non_blocking=True)
        _offload_optimizer_states(engine)
    else:
        engine.offload_states(pin_memory=True, non_blocking=True)
    torch.cuda.synchronize()
    return time.monotonic() - t0


def reload_engine(engine) -> float:
    """Brings the states back to the device, keeping the pinned host buffers for the next offload."""
    t0 = time.monotonic()
    optimizer = engine.optimizer
    kept = {name: getattr(optimizer, name) for name in _PINNED if hasattr(optimizer, name)}
    engine.reload_states(non_blocking=True)
    if _zero12(engine):
        _reload_optimizer_states(engine)
    torch.cuda.synchronize()  # the copies out of the kept buffers are done before they are reused
    for name, buffers in kept.items():
        if not hasattr(optimizer, name):
            setattr(optimizer, name, buffers)
    return time.monotonic() - t0


# The per-parameter state torch's Adam and AdamW create at their first step, shaped like the parameter.
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _pin_ahead(optimizer, buffers: dict) -> None:
    """Pinned buffers for the moments an Adam that has not stepped yet will create (nothing for
    other optimizers: their state is not known before it exists)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        keys = _ADAM_MOMENTS + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for param in group["params"]:
            # (DeepSpeed has moved the master weights, which these are, to host memory by now.)
            if not param.requires_grad or optimizer.state.get(param):
                continue
            for key in keys:
                if (param, key) not in buffers:
                    buffers[(param, key)] = torch.empty_like(param, device="cpu", pin_memory=True)


def _offload_optimizer_states(engine) -> None:
    """The wrapped optimizer's device tensors (Adam's moments, a fused step count) into pinned host
    buffers made once per tensor; the ones moved are remembered for the reload."""
    buffers = engine.__dict__.setdefault("_rlmesh_pinned_states", {})
    moved = engine.__dict__["_rlmesh_moved_states"] = []
    _pin_ahead(engine.optimizer.optimizer, buffers)
    for param, state in engine.optimizer.optimizer.state.items():
        for key, value in state.items():
            if not (torch.is_tensor(value) and value.device.type == "cuda"):
                continue
            buffer = buffers.get((param, key))
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = buffers[(param, key)] = torch.empty_like(value, device="cpu", pin_memory=True)
            buffer.copy_(value, non_blocking=True)
            state[key] = buffer
            moved.append((state, key, value.device))


def _reload_optimizer_states(engine) -> None:
    for state, key, device in engine.__dict__.pop("_rlmesh_moved_states", []):
        state[key] = state[key].to(device, non_blocking=True)
