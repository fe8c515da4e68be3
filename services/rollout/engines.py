"""The engine factory: the one module that knows both engine implementations.

engine.py holds what the servicer and the engines share (the Engine interface and its types);
vllm_engine.py and hf_engine.py implement it and import engine.py. Building an engine lives here,
so that engine.py imports neither implementation and no import runs in a circle.
"""

from __future__ import annotations

from services.rollout.config import RolloutConfig
from services.rollout.engine import Engine


def build_engine(config: RolloutConfig) -> Engine:
    """The engine --engine selects (imports vLLM only when it is used)."""
    if config.engine == "vllm":
        from services.rollout.vllm_engine import VllmEngine

        return VllmEngine(config)
    from services.rollout.hf_engine import HfEngine

    return HfEngine(config)
