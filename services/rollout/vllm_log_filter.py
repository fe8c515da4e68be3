"""Keeps vLLM's known-harmless warnings out of the rollout service's log, so that a real one is seen.

Each dropped message is matched on its logger, its message template and its arguments, never on a
loose pattern. Dropped:

- `<X>: Failed to load weights` from vLLM's layer-wise reload
  (vllm.model_executor.model_loader.reload.layerwise), where X is a rotary embedding class
  (RotaryEmbedding, Llama3RotaryEmbedding, YaRNScalingRotaryEmbedding, MRotaryEmbedding, ...).
  On a CPU every weight push reloads the whole model through that path (vLLM 0.32 repacks the
  linear weights at load time), and the reload counts a rotary embedding's cos/sin cache as a
  loadable tensor although no checkpoint holds one: the cache is computed from the model's config,
  and the reload puts the layer's own tensor back. So the line comes after every push and says
  nothing about the pushed weights.

Never dropped: the same message for any other layer. `ParallelLMHead: Failed to load weights`,
`VocabParallelEmbedding: ...`, a linear or a norm layer mean that a real weight of the pushed model
did not arrive, and the engine would keep generating with the old one. For a model with tied
embeddings the reload reports the output head this way; the rollout service then rebuilds the head
from the pushed embeddings (services/rollout/readback.py), and the push check reads a checksum back
from the engine's parameters, head included, so a head that stayed stale fails the push. The line is
kept all the same: the filter cannot tell the repaired case from another layer's failure.

install() adds the filter to those loggers in this process; vLLM's engine-core process (and a
worker inside it) forked from the rollout service inherit it, which is how the service runs vLLM on
a CPU with tensor parallel 1 (services/rollout/vllm_engine.py, cpu_process_layout). A worker that
vLLM spawns fresh (tensor parallel > 1 on a CPU) needs install() called in it.
"""

from __future__ import annotations

import logging

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_LOAD = "%s: Failed to load weights"


def _computed_buffers_only(layer_class: str) -> bool:
    """Layers whose only tensors are computed from the config, never read from a checkpoint."""
    return layer_class.endswith("RotaryEmbedding")


class HarmlessVllmWarnings(logging.Filter):
    """Drops exactly the records listed in this module's docstring; lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == RELOAD_LOGGER and record.msg == FAILED_LOAD and isinstance(record.args, tuple) \
                and len(record.args) == 1 and _computed_buffers_only(str(record.args[0])):
            return False
        return True


def install() -> None:
    """Adds the filter to the vLLM loggers that emit the harmless warnings (once per process)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, HarmlessVllmWarnings) for f in logger.filters):
        logger.addFilter(HarmlessVllmWarnings())
