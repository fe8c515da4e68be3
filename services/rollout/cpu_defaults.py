"""What `--dtype auto` and an unset `--enforce_eager` mean for the engine, which differs on a CPU.

dtype: on a GPU, `auto` is vLLM's choice (the checkpoint's dtype). On a CPU vLLM picks bfloat16
even for a float32 checkpoint; that pays where the CPU has bf16 units (the avx512_bf16 or amx_bf16
flags of /proc/cpuinfo), but elsewhere bf16 falls back to plain torch matmuls that decode several
times slower than float32 (3.6x measured on an AVX2-only CPU for a 135M model). So `auto` on a CPU
without bf16 units is float32; with them it stays vLLM's choice.

enforce_eager: compiling the model (torch.compile, vLLM's default) costs ~100 s at the start of a
135M model on a CPU and decodes no faster there, so an unset --enforce_eager means eager on a CPU;
on a GPU it means vLLM's default (compiled, with CUDA graphs). --enforce_eager / --no-enforce_eager
decide on any device.

Pure functions of the request, the device and the CPU's flags; the engines call them once at start.
"""

from __future__ import annotations

import pathlib

# /proc/cpuinfo flags of the instructions that make bfloat16 matmuls fast on x86 (oneDNN uses them).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's text (x86 "flags", ARM "Features"); empty when it has none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def read_cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        return cpu_flags(pathlib.Path(path).read_text(errors="replace"))
    except OSError:  # not Linux: nothing known, so nothing assumed fast
        return set()


def cpu_has_bf16_units(flags: set[str]) -> bool:
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def engine_dtype(requested: str, on_cpu: bool, flags: set[str]) -> tuple[str, str]:
    """(the dtype to give the engine, why) for --dtype `requested`; "auto" leaves the choice to the engine."""
    if requested != "auto":
        return requested, "--dtype"
    if on_cpu and not cpu_has_bf16_units(flags):
        return "float32", "CPU without bf16 units (no avx512_bf16 / amx_bf16 flag): bfloat16 would be slower"
    return "auto", "the engine's choice"


def engine_enforce_eager(requested: bool | None, on_cpu: bool) -> bool:
    """--enforce_eager as given, else eager on a CPU (compiling buys nothing there) and compiled on a GPU."""
    return on_cpu if requested is None else requested
