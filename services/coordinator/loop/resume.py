"""A run's checkpoints over the learner, the Trainer's checkpoint half (a mixin of
services/coordinator/loop/trainer.py): saving a step (the learner writes its folder, then the
coordinator commits coordinator.json and `latest`, checkpoint.py), resuming at start from the step
`latest` names, and rewinding to the newest complete checkpoint after the learner restarted (the
fleet's recovery calls `rewind`)."""

from __future__ import annotations

import json
import os
import time

from rlmesh.common.v1 import common_pb2
from rlmesh.coordinator.v1 import coordinator_pb2 as cpb
from rlmesh.learner.v1 import learner_pb2
from services.common.log import get_logger, log_event
from services.coordinator.loop import checkpoint
from services.coordinator.loop.checkpoint import CoordinatorState, config_digest

_log = get_logger("coordinator")
_EXPORT_DTYPES = {"auto": common_pb2.DTYPE_UNSPECIFIED, "float32": common_pb2.DTYPE_FLOAT32,
                  "bfloat16": common_pb2.DTYPE_BFLOAT16, "float16": common_pb2.DTYPE_FLOAT16}


def export_request(cfg, output_dir: str, critic: bool = False) -> learner_pb2.ExportHFRequest:
    """ExportHF of the actor (or the critic) into output_dir in --export_dtype (auto: the learner's
    rule, services/learner/export_dtype.py)."""
    return learner_pb2.ExportHFRequest(output_dir=output_dir, critic=critic, dtype=_EXPORT_DTYPES[cfg.export_dtype])


def same_folder(a: str, b: str) -> bool:
    """Whether two run folders, as given, are one (a relative one is taken from the current folder)."""
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


class RunCheckpoints:
    """Needs of the class it is mixed into: config, learner (stub), state, stream, control, colocation,
    metrics, trained_step and refresh_learner_info()."""

    async def save_checkpoint(self, step: int) -> dict:
        cfg = self.config
        t0 = time.monotonic()
        self.control.set_phase(cpb.PHASE_CHECKPOINTING)
        await self.colocation.reload_learner()
        self.state.config_digest, self.state.config_values = config_digest(cfg)
        reply = await self.learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(
            ckpt_path=cfg.ckpt_path, global_step=step, client_state=self.state.to_json().encode(),
            max_ckpt_num=cfg.max_ckpt_num, request_id=f"step{step}"), timeout=cfg.rpc_timeout_s)
        if cfg.save_hf_ckpt:
            await self.learner.ExportHF(export_request(cfg, f"{reply.path.rstrip('/')}_hf"), timeout=cfg.rpc_timeout_s)
        # The learner's files are complete (its marker is in place): coordinator.json, then `latest`.
        checkpoint.commit(cfg.ckpt_path, self.state, cfg.max_ckpt_num)
        self.control.last_checkpoint_step = step
        log_event(_log, "checkpoint.saved", step=step, path=reply.path, removed=",".join(reply.removed))
        return {"time/checkpoint_s": time.monotonic() - t0}

    async def _load_checkpoint(self) -> None:
        """Continues from the checkpoint `latest` names: the coordinator's state from its
        coordinator.json, the learner's from the same global_step_N folder."""
        cfg = self.config
        saved = checkpoint.load_latest(cfg.ckpt_path)
        if saved is None:
            log_event(_log, "resume.no_checkpoint", ckpt_path=cfg.ckpt_path, action="starting from step 0")
            return
        path = await self._restore(saved)
        digest, values = config_digest(cfg)
        if saved.config_digest and saved.config_digest != digest:
            changed = {k: (saved.config_values.get(k), v) for k, v in values.items() if saved.config_values.get(k) != v}
            log_event(_log, "resume.config_changed", changed=json.dumps(changed, default=str))
        log_event(_log, "resume.loaded", step=saved.global_step, episode=saved.episode,
                  position=saved.data_position, path=path)

    async def _restore(self, saved: CoordinatorState) -> str:
        """The learner loads `saved`'s global_step folder and the loop continues from its state;
        returns the folder the learner loaded."""
        cfg = self.config
        reply = await self.learner.LoadCheckpoint(learner_pb2.LoadCheckpointRequest(
            ckpt_path=cfg.ckpt_path, global_step=saved.global_step), timeout=cfg.rpc_timeout_s)
        if not same_folder(saved.run_dir, self.state.run_dir):
            # A resume into another run folder: its metrics.jsonl records only the steps that run
            # there, not the checkpoint's step (its record stays with the folder where it ran).
            saved.step_record = {}
        saved.run_dir = self.state.run_dir
        self.state = saved
        self.stream.restore(saved.episode, saved.data_position)
        self.control.global_step, self.control.episode = saved.global_step, saved.episode
        self.control.last_checkpoint_step = saved.global_step
        return reply.path

    async def rewind(self) -> int | None:
        """A restarted learner: it loads the newest complete checkpoint (none: it keeps --pretrain's
        weights and the run starts over) and the loop goes back to that step. Returns the
        checkpoint's step, or None when there was none."""
        cfg = self.config
        self.colocation.learner_offloaded = False
        await self.refresh_learner_info()
        saved = None if cfg.disable_ds_ckpt else checkpoint.load_latest(cfg.ckpt_path)
        version = self.state.weight_version
        if saved is not None:
            await self._restore(saved)
        else:
            self.state = checkpoint.new_state(cfg, self.state.run_dir)
            self.stream.restore(self.state.episode, self.state.data_position)
            self.control.global_step, self.control.episode = 0, self.state.episode
            self.control.last_checkpoint_step = 0
        self.state.weight_version = max(self.state.weight_version, version)  # versions only grow
        self.trained_step = self.state.global_step
        if self.metrics is not None:
            self.metrics.rewind(self.state.global_step)
        return None if saved is None else saved.global_step
