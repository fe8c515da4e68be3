"""What `--dtype auto` and an unset `--enforce_eager` mean for the engine, which differs on a CPU.

dtype: on a GPU, `auto` is vLLM's choice (the checkpoint's dtype). On a CPU vLLM picks bfloat16
even for a float32 checkpoint; that pays where the CPU has bf16 units (the avx512_bf16 or amx_bf16
flags of /proc/cpuinfo), but elsewhere bf16 falls back to plain torch matmuls that decode several
times slower than float32. So `auto` on a CPU without bf16 units is float32; with them it stays
vLLM's choice. Measured with bench/cpu_rollout_dtype.py, SmolLM2-135M-Instruct, vLLM 0.32, 2 cores
of an AVX-512 CPU with avx512_bf16: bfloat16 decodes 1.38x as fast as float32; with oneDNN held to
AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, as on a CPU without bf16 units) 0.35x as fast.

enforce_eager: compiling the model (torch.compile, vLLM's default) made the same engine start in
37 s instead of 8 s and decode 1.10x (float32) to 1.17x (bfloat16) as fast, so it pays for itself
only after minutes of generation. An unset --enforce_eager is eager on a CPU (short runs, tests,
a first look at a model start at once); --no-enforce_eager compiles, worth it for long CPU runs. On
a GPU unset means vLLM's default (compiled, with CUDA graphs). The flags decide on any device.

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
