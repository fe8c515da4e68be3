"""The learner's states to host memory and back between steps (--deepspeed_enable_sleep).

DeepSpeed's `offload_states` copies the ZeRO states into pinned host buffers and `reload_states`
brings them back; under ZeRO-1/2 the reload drops the pinned buffers of the master and model
weights, so every offload pinned them again (page-locking gigabytes: most of an offload's time).
Here the buffers are kept from one offload to the next, the copies are queued without waiting
for each, and the device is synchronized once at the end of each direction.
"""

from __future__ import annotations

import time

import torch

# ZeRO-1/2 optimizer attributes holding the pinned host copies that reload_states deletes
# (ZeRO-3 and the Adam states keep theirs).
_PINNED = ("hp_params_pin_buffers", "lp_params_pin_buffers")


def offload_engine(engine) -> float:
    """Moves one DeepSpeed engine's states to pinned host memory; returns the seconds it took."""
    t0 = time.monotonic()
    engine.offload_states(pin_memory=True, non_blocking=True)
    torch.cuda.synchronize()
    return time.monotonic() - t0


def reload_engine(engine) -> float:
    """Brings the states back to the device, keeping the pinned host buffers for the next offload."""
    t0 = time.monotonic()
    optimizer = engine.optimizer
    kept = {name: getattr(optimizer, name) for name in _PINNED if hasattr(optimizer, name)}
    engine.reload_states(non_blocking=True)
    torch.cuda.synchronize()  # the copies out of the kept buffers are done before they are reused
    for name, buffers in kept.items():
        if not hasattr(optimizer, name):
            setattr(optimizer, name, buffers)
    return time.monotonic() - t0
