"""What --dtype auto and an unset --enforce_eager become on a CPU with and without bf16 units, and
the log filter that keeps vLLM's harmless per-push warnings out of the service log (never a real one).

The running engine's side of both is in tests/rollout/test_rollout_service.py (no warning line after
a push) and tests/coordinator/test_local.py (eager and the chosen dtype in vLLM's own config line)."""

from __future__ import annotations

import io
import logging

import pytest

from services.rollout import cpu_defaults, vllm_log_filter

# The flags lines of two real CPUs (shortened): an AVX2-only one and an AVX-512 one with bf16.
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2\nbogomips\t: 4000\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_cpu_flags_are_read_from_the_flags_line():
    assert "avx2" in cpu_defaults.cpu_flags(AVX2_ONLY) and "bogomips" not in cpu_defaults.cpu_flags(AVX2_ONLY)
    assert not cpu_defaults.cpu_has_bf16_units(cpu_defaults.cpu_flags(AVX2_ONLY))
    assert cpu_defaults.cpu_has_bf16_units(cpu_defaults.cpu_flags(ZEN4))
    assert cpu_defaults.cpu_has_bf16_units(cpu_defaults.cpu_flags(SAPPHIRE_RAPIDS))
    assert cpu_defaults.cpu_flags("") == set()
    # This machine's own answer is a set of strings, whatever the CPU.
    assert all(isinstance(f, str) for f in cpu_defaults.read_cpu_flags())


@pytest.mark.parametrize("cpuinfo, on_cpu, expected", [
    (AVX2_ONLY, True, "float32"),  # bf16 would fall back to plain matmuls: float32 is faster
    (ZEN4, True, "auto"),  # vLLM's own choice (bfloat16 on a CPU)
    (SAPPHIRE_RAPIDS, True, "auto"),
    (AVX2_ONLY, False, "auto"),  # a GPU: the checkpoint's dtype, as vLLM picks it
])
def test_auto_dtype_is_float32_only_on_a_cpu_without_bf16_units(cpuinfo, on_cpu, expected):
    dtype, why = cpu_defaults.engine_dtype("auto", on_cpu, cpu_defaults.cpu_flags(cpuinfo))
    assert dtype == expected and why


def test_an_explicit_dtype_is_kept_everywhere():
    for requested in ("float32", "bfloat16", "float16"):
        assert cpu_defaults.engine_dtype(requested, True, cpu_defaults.cpu_flags(AVX2_ONLY))[0] == requested
        assert cpu_defaults.engine_dtype(requested, False, set())[0] == requested


def test_unset_enforce_eager_is_eager_on_a_cpu_and_compiled_on_a_gpu():
    assert cpu_defaults.engine_enforce_eager(None, on_cpu=True) is True
    assert cpu_defaults.engine_enforce_eager(None, on_cpu=False) is False
    # The flags decide on any device: --no-enforce_eager compiles on a CPU, --enforce_eager is eager on a GPU.
    assert cpu_defaults.engine_enforce_eager(False, on_cpu=True) is False
    assert cpu_defaults.engine_enforce_eager(True, on_cpu=False) is True


def _log_through_vllm(*lines: tuple[str, str]) -> str:
    """Emits (logger name, layer class) warnings through vLLM's own loggers, filter installed; returns
    what a handler on the "vllm" logger wrote."""
    vllm_log_filter.install()
    vllm_log_filter.install()  # twice: still one filter
    reload_logger = logging.getLogger(vllm_log_filter.RELOAD_LOGGER)
    assert sum(isinstance(f, vllm_log_filter.HarmlessVllmWarnings) for f in reload_logger.filters) == 1
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    parent = logging.getLogger("vllm")
    parent.addHandler(handler)
    try:
        for name, layer in lines:
            logging.getLogger(name).warning("%s: Failed to load weights", layer)
    finally:
        parent.removeHandler(handler)
    return out.getvalue()


def test_the_filter_drops_only_the_rotary_embedding_reload_warning():
    from vllm.model_executor.model_loader.reload import layerwise  # the module that logs it

    assert layerwise.logger.name == vllm_log_filter.RELOAD_LOGGER
    reload = vllm_log_filter.RELOAD_LOGGER
    text = _log_through_vllm((reload, "RotaryEmbedding"), (reload, "Llama3RotaryEmbedding"),
                             (reload, "ParallelLMHead"), (reload, "VocabParallelEmbedding"),
                             (reload, "QKVParallelLinear"), (reload, "RMSNorm"),
                             # The same words from another logger are not the known case: kept.
                             ("vllm.model_executor.model_loader.default_loader", "RotaryEmbedding"))
    assert text.splitlines() == ["ParallelLMHead: Failed to load weights",
                                 "VocabParallelEmbedding: Failed to load weights",
                                 "QKVParallelLinear: Failed to load weights", "RMSNorm: Failed to load weights",
                                 "RotaryEmbedding: Failed to load weights"]


def test_the_filter_keeps_other_messages_of_the_reload_logger():
    f = vllm_log_filter.HarmlessVllmWarnings()
    record = logging.LogRecord(vllm_log_filter.RELOAD_LOGGER, logging.WARNING, __file__, 1,
                               "%s: Delayed processing", ("RotaryEmbedding",), None)
    assert f.filter(record)
    record = logging.LogRecord(vllm_log_filter.RELOAD_LOGGER, logging.WARNING, __file__, 1,
                               "RotaryEmbedding: Failed to load weights", None, None)  # preformatted: not the template
    assert f.filter(record)
